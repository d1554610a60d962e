"""On-device statistics of many values at once, in a few fused passes.

Two kernels compute the same raw rows. On CPU a native custom call (`native`) measures
each value where it is produced. Elsewhere (GPU), the pure-XLA kernel: each value is
handed to its consumers through `hand_off` (computed once, read where the step reads
it), and the values of one scope (the step, or one loop body) are flattened, padded to
whole blocks of ``block`` elements and concatenated into buffers of at most
`GROUP_ELEMENTS` elements, in the values' own type where they share one. A few small
variadic reductions compute the per-element features per block (moments, zeros and
non-finite in one; the rounding error and range flags of each format in one each; the
exponent histogram in packed counters), traced once per buffer shape; segment sums fold
blocks into values. XLA compiles each distinct fusion once, so buffers are made to
share shapes: filled exactly (a value split across two where one fills up), the last
of a scope padded to one of a few sizes (docs/gpu.md).

The result of a scope is *raw*: sums, counts, maxima and last values per row, which
can be summed over while-loop iterations and stacked over scan iterations.
`finalize` turns raw rows into the published statistics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core.formats import Format
from ..core.recipes import RECIPE_STATS, Recipe
from . import native, recipe_kernel

#: Exponent histogram: bins for ``floor(log2|d|)`` from HIST_LO to HIST_HI inclusive.
#: Columns of ``stats["hist"]``: zero, below (finite, nonzero, exponent < HIST_LO),
#: one per exponent HIST_LO..HIST_HI, above (finite, exponent > HIST_HI), non-finite.
#: The range covers every FP8/FP16 format's normal and subnormal range with margin.
HIST_LO = -40
HIST_HI = 23
HIST_EXPONENTS = tuple(range(HIST_LO, HIST_HI + 1))
HIST_COLUMNS = ("zero", "below", *(f"2^{e}" for e in HIST_EXPONENTS), "above", "nonfinite")

BASIC_STATS = (
    "count",
    "scale",
    "rms",
    "absmax",
    "mean",
    "std",
    "frac_zero",
    "frac_nonfinite",
    "min",
    "max",
    "absmin",
    "dynamic_range",
)
#: Raw columns aggregated by maximum for every value: the abs-max, the largest finite
#: element, the negated smallest one, and the negated smallest non-zero magnitude
#: (negated so that one maximum folds blocks, iterations and devices; -inf for none).
BASIC_MAXIMA = ("absmax", "max", "negmin", "negabsmin")
FORMAT_STATS = ("underflow", "subnormal", "overflow", "snr")

DEFAULT_BLOCK = 512
#: Pure-XLA kernel: values are packed into buffers of this many elements (`pack`; a value
#: of half that or more is a buffer of its own), so the probe's extra memory stays bounded
#: whatever the number of values. Buffers of one shape share their passes' compiled code;
#: fewer, larger ones are fewer copies to compile: 2**25 (at most 128 MiB, 64 MiB for
#: 16-bit values) compiles nanoGPT's statistics program in 2.5x the step's time with
#: 1.25x its temporaries on CPU (docs/gpu.md, "The probe's GPU path, measured on CPU").
GROUP_ELEMENTS = 1 << 25
#: A scope whose values are fewer than `GROUPS_PER_SCOPE` full buffers gets smaller ones
#: (an eighth of its elements, at least this many, rounded down to a power of two
#: blocks): a small model's probe holds a few MiB more, not a copy of a scope's values
#: (sample GPT 2x128: 3.2x the step's 36 MiB; 8.4x with 2**25 buffers and no such floor).
GROUP_MIN_ELEMENTS = 1 << 22
GROUPS_PER_SCOPE = 8
_F32 = jnp.float32
#: The smallest normal float32: statistics read the subnormals below it as zeros.
_F32_TINY = np.float32(np.finfo(np.float32).tiny)


@dataclass(frozen=True)
class StatSpec:
    """What to compute: the audited formats and block-scaled recipes, whether to build
    histograms, block size and the optional per-value element cap (``sample``)."""

    formats: tuple[Format, ...]
    histograms: bool = True
    block: int = DEFAULT_BLOCK
    sample: int | None = None
    recipes: tuple[Recipe, ...] = ()

    def stat_names(self) -> tuple[str, ...]:
        """Names of the per-row scalar statistics, in output order."""
        per_format = tuple(f"{s}_{f.name}" for f in self.formats for s in FORMAT_STATS)
        per_recipe = tuple(n for r in self.recipes for n in r.stat_names())
        return BASIC_STATS + per_format + per_recipe

    @property
    def sum_columns(self) -> tuple[str, ...]:
        return (
            "sum",
            "sumsq",
            "m2",  # sum of squared deviations from the row's mean (`_pooled`)
            *(f"err2_{f.name}" for f in self.formats),
            *(f"err2_{r.name}" for r in self.recipes),
        )

    @property
    def count_columns(self) -> tuple[str, ...]:
        cols = ["n", "zero", "nonfinite"]
        for f in self.formats:
            cols += [f"under_{f.name}", f"sub_{f.name}", f"over_{f.name}"]
        for r in self.recipes:
            cols += [f"under_{r.name}", f"over_{r.name}", f"flush_{r.name}", f"blocks_{r.name}"]
        return tuple(cols)

    @property
    def max_columns(self) -> tuple[str, ...]:
        """Columns aggregated by maximum: `BASIC_MAXIMA`, then per recipe the largest
        and the negated smallest block-scale exponent."""
        cols = list(BASIC_MAXIMA)
        for r in self.recipes:
            cols += [f"scale_max_{r.name}", f"scale_negmin_{r.name}"]
        return tuple(cols)

    @property
    def raw_keys(self) -> tuple[str, ...]:
        return ("sum", "cnt", "max", "last", "hist") if self.histograms else RAW_KEYS


#: Raw statistics: float sums, integer counts, maxima, last values (the scale) and, with
#: histograms, integer bin counts; each ``[rows, columns]``. Sums are in units of the
#: row's abs-max power of two (`_row_exponent`; its square for every column but the
#: first); the spread is kept as ``m2``, the squared deviations from the row's own mean,
#: pooled by Chan's formula wherever rows are folded, since ``sumsq/n - mean**2`` cancels
#: in float32 where the mean dwarfs the spread (a LayerNorm gain of 1 +- 1e-4 read 0).
RAW_KEYS = ("sum", "cnt", "max", "last")
_AGGREGATE = {"sum": "add", "cnt": "add", "max": "max", "last": "last", "hist": "add"}


def empty_raw(spec: StatSpec) -> dict[str, jax.Array]:
    """Raw statistics with zero rows."""
    raw = {
        "sum": jnp.zeros((0, len(spec.sum_columns)), _F32),
        "cnt": jnp.zeros((0, len(spec.count_columns)), jnp.int32),
        "max": jnp.zeros((0, len(spec.max_columns)), _F32),
        "last": jnp.zeros((0, 1), _F32),
    }
    if spec.histograms:
        raw["hist"] = jnp.zeros((0, len(HIST_COLUMNS)), jnp.int32)
    return raw


def accumulate(acc: dict[str, jax.Array], new: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Fold one more while-loop iteration into raw statistics (sums are re-expressed in
    the units and about the mid-range of the folded row first, `_reexpress`)."""
    out = {}
    for k, v in new.items():
        how = _AGGREGATE[k]
        out[k] = acc[k] + v if how == "add" else v
    out["max"] = jnp.maximum(_ran_maxima(acc), _ran_maxima(new))
    n_a, n_b = _finite(acc["cnt"]), _finite(new["cnt"])
    a = _reexpress(acc["sum"], n_a, acc["max"], out["max"])
    b = _reexpress(new["sum"], n_b, new["max"], out["max"])
    # Chan's pairwise update: the two means' difference weighs n_a n_b / (n_a + n_b)
    d = _mean(a, n_a) - _mean(b, n_b)
    shift = n_a * n_b / jnp.maximum(n_a + n_b, 1.0) * d * d
    out["sum"] = (a + b).at[:, _M2].add(shift)
    return out


#: Column of ``m2`` among the sum columns (`StatSpec.sum_columns`).
_M2 = 2


def _finite(cnt: jax.Array) -> jax.Array:
    """Finite elements of each row (float32 subnormals counted as zeros): the moments'
    count, from the ``n`` and ``nonfinite`` count columns."""
    return (cnt[:, 0] - cnt[:, 2]).astype(_F32)


def _mean(sums: jax.Array, finite: jax.Array) -> jax.Array:
    """Each row's mean in its sums' units; 0 for a row with no finite element."""
    return sums[:, 0] / jnp.maximum(finite, 1.0)


def _pooled(sums: jax.Array, finite: jax.Array, sum_of, back) -> jax.Array:
    """``sum_of(sums)`` (pieces' sum columns, in the units of the rows they fold into),
    with ``m2`` pooled by Chan's formula: each piece's own, plus its count times its
    mean's squared distance to the folded row's mean (``back`` maps folded rows onto
    the pieces). Every term is non-negative: nothing cancels."""
    total = sum_of(sums)
    row_mean = back(_mean(total, sum_of(finite)))
    d = _mean(sums, finite) - row_mean
    return total.at[:, _M2].set(sum_of(sums[:, _M2] + finite * d * d))


def _ran_maxima(raw: dict[str, jax.Array]) -> jax.Array:
    """``raw["max"]`` with the rows that measured nothing (count 0: a while loop's
    initial accumulator, a group a budget skipped, a device's dropped copy) at -inf, so
    that taking the maximum with them keeps the other side's values; some maxima are
    negative (a recipe's block-scale exponents)."""
    return jnp.where(raw["cnt"][:, :1] > 0, raw["max"], -np.inf)


def across_devices(
    raw: dict[str, jax.Array], keep: jax.Array | None, axes: tuple[str, ...]
) -> dict[str, jax.Array]:
    """Combine per-device raw rows over the manual mesh ``axes`` (inside ``shard_map``):
    counts and histograms add, maxima and scales take the largest, sums are re-expressed
    in the units of the global abs-max before adding. ``keep`` (bool[rows] or None)
    drops a device's contribution to a row (a value replicated along an axis is counted
    on one device of it). The result is the same on every device."""
    if keep is not None:
        k = keep[:, None]
        raw = {name: jnp.where(k, v, jnp.zeros_like(v)) for name, v in raw.items()}
    return _fold(raw, lambda v: lax.pmax(v, axes), lambda v: lax.psum(v, axes))


def _fold(raw: dict[str, jax.Array], top_of, sum_of, back=lambda v: v) -> dict[str, jax.Array]:
    """Raw rows folded by ``top_of`` (a maximum) and ``sum_of`` (a sum) over devices or
    over the pieces of a value: counts and histograms add, maxima and scales take the
    largest, sums are re-expressed in the units and about the mid-range of the folded
    row before adding (`_reexpress`; ``m2`` pooled, `_pooled`).
    ``back`` maps folded rows onto the rows of ``raw``."""
    top = top_of(_ran_maxima(raw))
    finite = _finite(raw["cnt"])
    sums = _reexpress(raw["sum"], finite, raw["max"], back(top))
    out = {
        "sum": _pooled(sums, finite, sum_of, back),
        "cnt": sum_of(raw["cnt"]),
        "max": top,
        "last": top_of(raw["last"]),
    }
    if "hist" in raw:
        out["hist"] = sum_of(raw["hist"])
    return out


def concat_raw(parts: Sequence[dict[str, jax.Array]], spec: StatSpec) -> dict[str, jax.Array]:
    parts = [p for p in parts if p["sum"].shape[0]]
    if not parts:
        return empty_raw(spec)
    if len(parts) == 1:
        return parts[0]
    return {k: jnp.concatenate([p[k] for p in parts]) for k in spec.raw_keys}


def take_rows(raw: dict[str, jax.Array], index: np.ndarray) -> dict[str, jax.Array]:
    return {k: v[index] for k, v in raw.items()}


def unstack_scan(raw: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """``[iterations, rows, k]`` stacked by a scan -> ``[rows * iterations, k]``, each
    row's iterations contiguous."""
    out = {}
    for k, v in raw.items():
        n, r = v.shape[0], v.shape[1]
        out[k] = jnp.swapaxes(v, 0, 1).reshape(r * n, v.shape[2])
    return out


def _round_to(x: jax.Array, fmt: Format) -> jax.Array:
    """``q_F``: clip to the format's range, then round to nearest even by a cast. A
    format without a negative zero (the fnuz FP8 formats) rounds the magnitude and takes
    the sign back: XLA's CPU elemental emitter (``--xla_cpu_use_fusion_emitters=false``)
    casts a negative value that rounds to zero to that format's NaN (the bits of -0)."""
    if np.dtype(fmt.dtype) == np.float32:
        return x
    big = np.float32(fmt.max)
    if np.dtype(fmt.dtype).name.endswith("fnuz"):
        q = jnp.minimum(jnp.abs(x), big).astype(fmt.dtype).astype(_F32)
        return jnp.where(x < 0, -q, q)
    return lax.clamp(-big, x, big).astype(fmt.dtype).astype(_F32)


def _exponent(x: jax.Array) -> jax.Array:
    """``floor(log2|x|)`` for normal float32 ``x``, read from the exponent bits."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return ((bits >> 23) & 0xFF) - 127


def _reduce(operands: list[jax.Array], n_max: int = 0, n_low: int = 0) -> list[jax.Array]:
    """One variadic reduction over axis 1: sums, then ``n_max`` maxima, the last
    ``n_low`` of them starting from -inf (for values that may be negative; the others
    start from 0). A few operands per reduction keep XLA's CPU loop in registers; one huge
    one is many times slower."""
    n_add = len(operands) - n_max
    init = [np.float32(0)] * (len(operands) - n_low) + [np.float32(-np.inf)] * n_low

    def combine(a, b):
        return tuple(
            lax.add(a[i], b[i]) if i < n_add else lax.max(a[i], b[i]) for i in range(len(a))
        )

    return list(lax.reduce(operands, init, combine, (1,)))


def _pow2(k: jax.Array) -> jax.Array:
    """``2.0**k`` in float32 for integer ``k <= 127``, exactly; 0 below the normal range."""
    k = jnp.asarray(k, jnp.int32)
    bits = (jnp.clip(k, -126, 127) + 127) << 23
    return jnp.where(k >= -126, lax.bitcast_convert_type(bits, _F32), 0.0)


def _row_exponent(absmax: jax.Array) -> jax.Array:
    """Exponent of each row's (or block's) abs-max: sums are kept in units of 2**it so
    squares of values up to float32's max neither overflow nor underflow."""
    tiny = _F32_TINY
    return jnp.where(absmax >= tiny, jnp.clip(_exponent(absmax), -126, 126), 0)


def _block_stats(x: jax.Array, spec: StatSpec):
    """Per-block statistics of ``x`` (``[blocks, block]`` float32).

    Pass one: zeros, non-finite and the `BASIC_MAXIMA` (over finite elements; padding
    is NaN, so it counts only as non-finite). Pass two: sums of ``x`` and ``x**2`` in
    units of ``2**k`` (k the block abs-max exponent). Then one pass per format: its
    rounding error (same units) and range flags. A few operands per reduction keep XLA's
    CPU loop fast; one reduction of every feature is several times slower.
    """
    a = jnp.abs(x)
    finite = a < np.float32(np.inf)
    xf = jnp.where(finite, x, 0.0)
    as_f = lambda m: m.astype(_F32)
    low = np.float32(-np.inf)
    # Extremes read float32 subnormals as zeros, as the native kernel does.
    normal = a >= _F32_TINY
    xn = jnp.where(normal, xf, 0.0)
    # float32 subnormals are zeros here, explicitly: XLA on CPU flushes them anyway, on a
    # GPU it does not, and both kernels must read the same definition
    zero, nonfinite, amax, top, negmin, negabsmin = _reduce(
        [
            as_f(a < _F32_TINY),
            as_f(~finite),
            jnp.where(finite, a, 0.0),
            jnp.where(finite, xn, low),
            jnp.where(finite, -xn, low),
            jnp.where(finite & normal, -a, low),
        ],
        4,
        3,
    )
    k = _row_exponent(amax)
    unit = _pow2(-k)[:, None]
    # Each pass below reads x itself and masks non-finite elements out at the end: a
    # shared ``where(finite, x, 0)`` would be a second copy of the buffer in memory.
    xs = jnp.where(finite, x * unit, 0.0)
    # The block's spread, sum((x-c)^2) - sum(x-c)^2/n, loses about as many roundings of
    # the larger term as the block has elements: taken about its mid-range c (known from
    # pass one, so no extra pass) or about 0, whichever leaves the smaller squares. A
    # mean that dwarfs the spread then costs nothing (`_pooled` folds the blocks).
    mid = jnp.where(top > low, top * np.float32(0.5) - negmin * np.float32(0.5), 0.0)
    xc = jnp.where(finite, (x - mid[:, None]) * unit, 0.0)
    s1, s2, c1, c2 = _reduce([xs, xs * xs, xc, xc * xc])
    n_fin = jnp.maximum(np.float32(x.shape[1]) - nonfinite, 1.0)
    about_mid = c2 < s2
    m2 = jnp.where(about_mid, c2 - c1 * c1 / n_fin, s2 - s1 * s1 / n_fin)
    # the first moment about the mid-range (`_reference`): a float32 sum of large values
    # rounds by an ulp of the sum, which pooling blocks would read as a spread of means
    sums = [c1, s2, jnp.maximum(m2, 0.0)]
    counts = [zero, nonfinite]
    for fmt in spec.formats:
        q = _round_to(x, fmt)
        err = jnp.where(finite, (x - q) * unit, 0.0)
        aq = jnp.abs(q)
        e2, under, sub, over = _reduce(
            [
                err * err,
                as_f(finite & normal & (q == 0)),
                as_f((aq > 0) & (aq < np.float32(fmt.min_normal))),
                as_f(a > np.float32(fmt.max)),
            ]
        )
        sums.append(e2)
        counts += [under, sub, over]
    maxima = jnp.stack([amax, top, negmin, negabsmin], axis=1)
    return jnp.stack(sums, axis=1), jnp.stack(counts, axis=1), maxima, k


def _reference(maxima: jax.Array) -> jax.Array:
    """The mid-range of each row's finite elements, from its `BASIC_MAXIMA` (0 where it
    has none): the first sum column is taken about it, so that the mean keeps the
    digits of the spread (`finalize`)."""
    top, negmin = maxima[:, 1], maxima[:, 2]
    return jnp.where(top > -np.inf, top * np.float32(0.5) - negmin * np.float32(0.5), 0.0)


def _reexpress(
    sums: jax.Array, finite: jax.Array, max_from: jax.Array, max_to: jax.Array
) -> jax.Array:
    """Sums of rows with maxima ``max_from`` (units of 2 to their abs-max's exponent,
    column 0 about their `_reference`, the others squares) in the units and about the
    reference of rows with maxima ``max_to``; ``finite``: each row's finite count."""
    k_from, k_to = _row_exponent(max_from[:, 0]), _row_exponent(max_to[:, 0])
    f = _pow2(k_from - k_to)[:, None]
    shift = finite * ((_reference(max_from) - _reference(max_to)) * _pow2(-k_to))
    return jnp.concatenate([sums[:, :1] * f + shift[:, None], sums[:, 1:] * (f * f)], axis=1)


def _hist_bins(x: jax.Array) -> jax.Array:
    """Column of `HIST_COLUMNS` for each element of ``x``."""
    last = len(HIST_COLUMNS) - 1
    k = jnp.clip(_exponent(x) - (HIST_LO - 2), 1, last - 1)
    a = jnp.abs(x)
    k = jnp.where(a < _F32_TINY, 0, k)  # float32 subnormals too
    return jnp.where(a < np.float32(np.inf), k, last)


def _sample(flat: jax.Array, cap: int | None) -> jax.Array:
    """At most ``cap`` elements of ``flat``, evenly strided by a prime stride (a prime
    does not alias with row lengths of the tensor)."""
    n = int(flat.shape[0])
    if cap is None or n <= cap:
        return flat
    stride = _next_prime(-(-n // cap))
    return lax.slice(flat, (0,), (n,), (stride,))


def _next_prime(k: int) -> int:
    k = max(k, 2)
    while any(k % d == 0 for d in range(2, int(k**0.5) + 1)):
        k += 1
    return k


def values_raw(values: Sequence[Any], spec: StatSpec) -> dict[str, jax.Array]:
    """Raw statistics of ``values`` (``(data, scale)`` or ``(data, scale, block_axes)``
    tuples, the scale ``None`` for a plain value, or `Measured`), one row each.

    On CPU each value is read once by the native kernel (`native`), right where it is
    produced. Elsewhere (GPU, or no C++ compiler) values are packed (`pack`) into buffers
    of `GROUP_ELEMENTS` elements (fewer in a small scope: an eighth of its elements, at
    least `GROUP_MIN_ELEMENTS`, rounded down to a power of two blocks), each reduced by
    `group_raw`, the rows of a value split across two buffers merged (`merge_rows`).
    Recipes (opt-in) are appended as columns of their own (per value natively; in XLA
    per group of whole values, as block-scaled recipes read a value's blocks in place).
    """
    if not values:
        return empty_raw(spec)
    if native.use_native():
        raw = _native_raw(values, spec)
        return _append_recipes(raw, _native_recipes(values, spec)) if spec.recipes else raw
    sizes = [
        int(np.size(v[0])) if spec.sample is None else min(int(np.size(v[0])), spec.sample)
        for v in values
    ]
    b = spec.block
    limit = min(GROUP_ELEMENTS, max(GROUP_MIN_ELEMENTS, sum(sizes) // GROUPS_PER_SCOPE))
    flats = [_sample(jnp.ravel(v[0]), spec.sample) for v in values]
    plain = replace(spec, recipes=())
    parts, owner = [], []
    for buffer in pack(sizes, 1 << (max(1, limit // b).bit_length() - 1), b):
        pieces = [(flats[i][start:stop], values[i][1]) for i, start, stop in buffer]
        parts.append(group_raw(pieces, plain, pad_to_class=len(buffer) > 1))
        owner += [i for i, _, _ in buffer]
    raw = merge_rows(concat_raw(parts, plain), np.asarray(owner), len(values))
    if spec.recipes:  # block-scaled recipes read whole values: groups of at most `limit`
        recipe_parts = [
            recipe_kernel.recipe_group_raw([(v[0], _block_axes(v)) for v in group], spec.recipes)
            for group in _whole_groups(values, sizes, limit)
        ]
        raw = _append_recipes(
            raw, tuple(jnp.concatenate(c) for c in zip(*recipe_parts, strict=True))
        )
    return raw


def pack(sizes: Sequence[int], capacity: int, block: int) -> list[list[tuple[int, int, int]]]:
    """Buffers of a scope as lists of ``(value, start, stop)`` element ranges.

    A value of at least half a buffer (``capacity`` blocks of ``block`` elements) is a
    buffer of its own (read in place: no copy). The others are packed, in order, into
    buffers of exactly ``capacity`` blocks, a value split across two buffers where one
    fills up (each piece starts on a block of its value). All full buffers of a scope
    then have one shape, and XLA compiles their passes once: it compiles each distinct
    fusion once, and buffer sizes that differ by a block make every pass differ.
    """
    buffers: list[list[tuple[int, int, int]]] = []
    open_: list[tuple[int, int, int]] = []
    room = capacity
    for i, n in enumerate(sizes):
        blocks = -(-n // block)
        if n == 0:  # a row with nothing counted, in whichever buffer is open
            open_.append((i, 0, 0))
            continue
        if 2 * blocks >= capacity:
            buffers.append([(i, 0, n)])
            continue
        start = 0
        while start < n:
            take = min(room, -(-(n - start) // block))
            stop = min(n, start + take * block)
            open_.append((i, start, stop))
            start, room = stop, room - take
            if room == 0:
                buffers.append(open_)
                open_, room = [], capacity
    if open_:
        buffers.append(open_)
    return buffers


def _whole_groups(values: Sequence[Any], sizes: Sequence[int], limit: int) -> list[list[Any]]:
    """``values`` in order, in groups of at most ``limit`` elements (a larger value
    alone): the buffers of the recipe kernel, which reads whole values."""
    groups: list[list[Any]] = [[]]
    size = 0
    for value, n in zip(values, sizes, strict=True):
        if groups[-1] and size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append(value)
        size += n
    return groups


def merge_rows(raw: dict[str, jax.Array], owner: np.ndarray, rows: int) -> dict[str, jax.Array]:
    """Raw rows of pieces -> one row per value (``owner[i]``: the value of row ``i``),
    folded as `across_devices` folds devices. A value of one piece keeps its row as it
    is."""
    if len(owner) == rows:
        order = np.argsort(owner, kind="stable")
        return raw if np.array_equal(order, np.arange(rows)) else take_rows(raw, order)
    return _fold(
        raw,
        lambda v: jax.ops.segment_max(v, owner, rows),
        lambda v: jax.ops.segment_sum(v, owner, rows),
        back=lambda v: v[owner],
    )


def hand_off(data: jax.Array) -> jax.Array:
    """``data``, bit for bit, computed once into memory for its consumers and the
    pure-XLA kernel to read.

    The pure-XLA twin of the native kernel's pass-through (`native.measure_through`).
    XLA fuses a cheap elementwise producer into each of its consumers, so a measured
    value's producer would be recomputed by the statistics' passes as well as by the step
    (a 2-layer GPT, d=384: 1.4x the HLO, 1.3x the compile). A division is not cheap to XLA
    and is never duplicated into two consumers: the bits of ``data`` are divided, as
    integers, by a ``1`` XLA cannot fold (``(b | 1) & 1``). Integer division is exact for
    every pattern; a float division would flush float32 subnormals on CPU. Types whose
    bits do not fill their bytes (4-bit floats) come back unchanged.
    """
    dtype = np.dtype(data.dtype)
    if not jnp.issubdtype(dtype, jnp.floating) or jnp.finfo(dtype).bits != 8 * dtype.itemsize:
        return data
    bits = lax.bitcast_convert_type(data, jnp.dtype(f"int{8 * dtype.itemsize}"))
    return lax.bitcast_convert_type(lax.div(bits, (bits | 1) & 1), dtype)


def _block_axes(value: Any) -> tuple[int, ...] | None:
    return value[2] if len(value) > 2 else None


def _native_recipes(values: Sequence[Any], spec: StatSpec) -> tuple[Any, Any, Any]:
    """Recipe columns of each value by the native kernel (measured at once, or now): the
    raw rows stacked, then split into columns once for all values (`native.recipe_call`)."""
    parts = [
        value.recipes
        if isinstance(value, Measured) and value.recipes is not None
        else native.recipe_call(value[0], spec.recipes, _block_axes(value))
        for value in values
    ]
    floats, ints = (jnp.stack(p) for p in zip(*parts, strict=True))
    return native.recipe_columns(floats, ints, len(spec.recipes))


def _append_recipes(raw: dict[str, jax.Array], parts: tuple[Any, Any, Any]):
    """``raw`` with recipe columns ``(sums, counts, maxima)`` appended."""
    sums, counts, maxima = parts
    out = dict(raw)
    out["sum"] = jnp.concatenate([raw["sum"], sums.astype(_F32)], axis=1)
    out["cnt"] = jnp.concatenate([raw["cnt"], counts.astype(jnp.int32)], axis=1)
    out["max"] = jnp.concatenate([raw["max"], maxima.astype(_F32)], axis=1)
    return out


def _scales(values: Sequence[Any]) -> jax.Array:
    scales = [v.scale if isinstance(v, Measured) else v[1] for v in values]
    return jnp.stack([jnp.asarray(1.0 if s is None else s, _F32).reshape(()) for s in scales])[
        :, None
    ]


class Measured(NamedTuple):
    """A value the native kernel has already measured (`native.measure_through`): its
    raw row and its scale, standing in for ``(data, scale)`` in `values_raw`;
    ``recipes``: its raw recipe row (`native.recipe_call`), when recipes are requested."""

    floats: jax.Array
    ints: jax.Array
    scale: Any
    recipes: tuple[Any, Any] | None = None


def _native_raw(values: Sequence[Any], spec: StatSpec) -> dict[str, jax.Array]:
    nf = len(spec.formats)
    hist = (HIST_LO, HIST_HI) if spec.histograms else None
    floats, ints = zip(
        *(
            value[:2]
            if isinstance(value, Measured)
            else native.value_raw(_sample(jnp.ravel(value[0]), spec.sample), spec.formats, hist)
            for value in values
        ),
        strict=True,
    )
    f, i = jnp.stack(floats), jnp.stack(ints)
    raw = {
        "sum": f[:, : 3 + nf],
        "cnt": i[:, : 3 + 3 * nf],
        "max": f[:, 3 + nf :],
        "last": _scales(values),
    }
    if spec.histograms:
        raw["hist"] = i[:, 3 + 3 * nf :]
    return raw


def _buffer_dtype(values: Sequence[Any]) -> Any:
    """The type of a group's buffer: the values' own when they share one that can hold
    the NaN padding (a group of float16 values takes half the memory of float32, one of
    float8 a quarter; the passes widen each element as they read it), else float32."""
    types = {np.dtype(v[0].dtype) for v in values}
    if len(types) == 1:
        (dtype,) = types
        if jnp.issubdtype(dtype, jnp.floating) and np.isnan(
            np.float32(np.asarray(np.nan, np.float32).astype(dtype))
        ):
            return dtype
    return np.dtype(np.float32)


def size_class(blocks: int) -> int:
    """``blocks`` rounded up to one of four sizes per octave (``m * 2**k``, ``m`` in
    4..7, at most a quarter more): a scope's last, partly filled buffer then often has
    the shape of another one's (XLA compiles each distinct fusion once)."""
    if blocks <= 8:
        return blocks
    unit = 1 << (blocks.bit_length() - 3)
    return -(-blocks // unit) * unit


def group_raw(
    values: Sequence[tuple[Any, Any]], spec: StatSpec, pad_to_class: bool = False
) -> dict[str, jax.Array]:
    """Raw statistics of ``values``, one row each, computed in a few fused passes over one
    buffer (the pure-XLA kernel); ``spec``'s recipes are not computed here (they read
    whole values: `values_raw` appends them). ``pad_to_class``: NaN blocks after the last value fill
    the buffer up to its `size_class` (counted with the last value, then taken off)."""
    if not values:
        return empty_raw(spec)
    b = spec.block
    dtype = _buffer_dtype(values)
    pieces, blocks_per_value, sizes, pads = [], [], [], []
    for value in values:
        flat = _sample(jnp.ravel(value[0]), spec.sample).astype(dtype)
        n = int(flat.shape[0])
        nb = -(-n // b)
        pad = nb * b - n
        if pad:
            flat = jnp.concatenate([flat, jnp.full((pad,), np.nan, dtype)])
        pieces.append(flat)
        blocks_per_value.append(nb)
        sizes.append(n)
        pads.append(pad)
    extra = size_class(sum(blocks_per_value)) - sum(blocks_per_value) if pad_to_class else 0
    if extra:
        pieces.append(jnp.full((extra * b,), np.nan, dtype))
        blocks_per_value[-1] += extra
        pads[-1] += extra * b
    x = (jnp.concatenate(pieces) if len(pieces) > 1 else pieces[0]).reshape(-1, b)
    rows = len(values)
    seg = np.repeat(np.arange(rows, dtype=np.int32), blocks_per_value)
    s, c, m, _, block_hist = _block_passes(x, spec)
    seg_sum = lambda v: jax.ops.segment_sum(v, seg, rows, indices_are_sorted=True)
    maxima = jax.ops.segment_max(m, seg, rows, indices_are_sorted=True)
    finite_blocks = np.float32(b) - c[:, 1]  # the padding is NaN: not counted
    s = _reexpress(s, finite_blocks, m, maxima[seg])
    s = _pooled(s, finite_blocks, seg_sum, lambda v: v[seg])
    counts = seg_sum(c.astype(jnp.int32))
    # Padding adds NaNs only: correct the non-finite count; the element count is static.
    pads = np.asarray(pads, np.int32)
    fix = np.zeros((rows, counts.shape[1] + 1), np.int32)
    fix[:, 0] = sizes
    fix[:, 2] = -pads
    raw = {
        "sum": s,
        "cnt": jnp.concatenate([jnp.zeros((rows, 1), jnp.int32), counts], axis=1) + fix,
        "max": maxima,
        "last": _scales(values),
    }
    if spec.histograms:
        h = len(HIST_COLUMNS)
        hist = _histograms(x, seg, rows, block_hist)
        fix = np.zeros((rows, h), np.int32)
        fix[:, -1] = -pads
        raw["hist"] = hist + fix
    return raw


#: Bin counters per int32 word in `_block_histograms`: 10 bits each.
_PACK = 3
_COUNTER_BITS = 10


def _block_features(x: jax.Array, spec: StatSpec):
    """`_block_stats` of the blocks ``x``, and their histograms where blocks are short
    enough for packed counters (else None)."""
    x = x.astype(_F32)
    hist = None
    if spec.histograms and x.shape[1] < 1 << _COUNTER_BITS:
        hist = _block_histograms(x)
    return (*_block_stats(x, spec), hist)


#: `_block_features` traced and lowered once per buffer shape: groups of one size (a
#: full buffer, a layer's activations) share them (nanoGPT size, statistics program:
#: tracing and lowering 13.3 s -> 10.3 s; XLA still compiles every group's passes).
_block_passes = jax.jit(_block_features, static_argnums=1)


def _histograms(x: jax.Array, seg: np.ndarray, rows: int, blocks: jax.Array | None) -> jax.Array:
    """Exponent histograms ``[rows, HIST_COLUMNS]`` of the blocks ``x`` (``[blocks,
    block]``), block ``i`` counted in row ``seg[i]``, from ``blocks``, the per-block
    histograms of `_block_features` (None: blocks too long for packed counters)."""
    if blocks is not None:
        return jax.ops.segment_sum(blocks, seg, rows, indices_are_sorted=True)
    # Blocks too long for packed counters: one scatter-add (its bin indices, an int32
    # per element, are held in memory on CPU, where a scatter's operands are not fused).
    h = len(HIST_COLUMNS)
    index = (jnp.asarray(seg)[:, None] * h + _hist_bins(x.astype(_F32))).reshape(-1)
    hist = jnp.zeros((rows * h,), jnp.int32).at[index].add(1, mode="promise_in_bounds")
    return hist.reshape(rows, h)


def _block_histograms(x: jax.Array) -> jax.Array:
    """Histograms ``[blocks, HIST_COLUMNS]`` of each block of ``x`` by one reduction that
    reads ``x`` and holds nothing else: bin counts packed `_PACK` to an int32 word,
    each element adding ``1 << 10*(bin % 3)`` to word ``bin // 3``. (A scatter-add holds
    an index per element; on the sample GPT that was a quarter of the probe's memory.)"""
    h = len(HIST_COLUMNS)
    words = -(-h // _PACK)
    # Through int8 (bins fit in a byte): with the other passes beside it, XLA on CPU kept
    # the int32 bins of every element in memory (a group buffer's size again); through
    # a byte it fuses them into the reduction (a 6.3 M-element value: 145 -> 53 MiB).
    bins = _hist_bins(x).astype(jnp.int8).astype(jnp.int32)
    word = bins // _PACK
    one = jnp.left_shift(jnp.int32(1), _COUNTER_BITS * (bins - _PACK * word))
    operands = [jnp.where(word == j, one, 0) for j in range(words)]
    packed = lax.reduce(
        operands,
        [np.int32(0)] * words,
        lambda a, b: tuple(p + q for p, q in zip(a, b, strict=True)),
        (1,),
    )
    shifts = jnp.arange(_PACK, dtype=jnp.int32) * _COUNTER_BITS
    counts = (jnp.stack(packed, axis=1)[:, :, None] >> shifts) & ((1 << _COUNTER_BITS) - 1)
    return counts.reshape(x.shape[0], words * _PACK)[:, :h]


def _extremes(maxima: jax.Array, measured: jax.Array) -> dict[str, jax.Array]:
    """min, max, the smallest non-zero magnitude and the dynamic range
    ``log2(absmax) - log2(absmin)`` (Transformer Engine's definition) from the raw
    `BASIC_MAXIMA`; NaN where no finite (for the last two: non-zero) element was seen."""
    nan = np.float32(np.nan)
    absmax, top, negmin, negabsmin = (maxima[:, i] for i in range(len(BASIC_MAXIMA)))
    nonzero = measured & (negabsmin > -np.inf)
    absmin = jnp.where(nonzero, -negabsmin, nan)
    # exactly 0 where every non-zero magnitude is the same (a single element: the two
    # log2 may be computed in different fusions, and their difference read -7e-8), and
    # never below 0
    spread = jnp.maximum(jnp.log2(absmax) - jnp.log2(absmin), np.float32(0))
    spread = jnp.where(absmax > absmin, spread, np.float32(0))
    return {
        "min": jnp.where(measured, -negmin, nan),
        "max": jnp.where(measured, top, nan),
        "absmin": absmin,
        "dynamic_range": jnp.where(nonzero, spread, nan),
    }


def _bounded_std(std: jax.Array, top: jax.Array, negmin: jax.Array) -> jax.Array:
    """``std`` at most half the range of the finite elements (Popoviciu's bound): a
    guard, so that no rounding reads a constant as spread."""
    half_range = jnp.maximum(top + negmin, 0.0) * np.float32(0.5)
    return jnp.minimum(std, half_range)


def finalize(raw: dict[str, jax.Array], spec: StatSpec) -> dict[str, jax.Array]:
    """Published statistics from raw rows (see docs/probe.md, "Two kernels, one definition").

    Moments and extremes (rms, mean, std, absmax, min, max, absmin) are over the finite
    elements (float32 subnormals count as zeros); fractions over all
    elements. A row whose code never ran (the untaken branch of a cond) has count 0 and
    NaN statistics.
    """
    sums, counts = raw["sum"], raw["cnt"]
    col = {name: i for i, name in enumerate(spec.count_columns)}
    n = counts[:, col["n"]]
    nf = n.astype(_F32)
    ran = n > 0
    nan = np.float32(np.nan)
    frac = lambda c: jnp.where(ran, c.astype(_F32) / jnp.maximum(nf, 1.0), nan)
    finite_n = (n - counts[:, col["nonfinite"]]).astype(_F32)
    unit = _pow2(_row_exponent(raw["max"][:, 0]))
    mean_u = sums[:, 0] / finite_n  # about the mid-range (`_reference`)
    meansq_u = sums[:, 1] / finite_n
    out = {
        "count": n,
        "scale": jnp.where(ran, raw["last"][:, 0], nan),
        "rms": jnp.sqrt(meansq_u) * unit,
        "absmax": jnp.where(ran & (finite_n > 0), raw["max"][:, 0], nan),
        "mean": _reference(raw["max"]) + mean_u * unit,
        "std": _bounded_std(
            jnp.sqrt(jnp.maximum(sums[:, _M2], 0.0) / finite_n) * unit,
            raw["max"][:, 1],
            raw["max"][:, 2],
        ),
        "frac_zero": frac(counts[:, col["zero"]]),
        "frac_nonfinite": frac(counts[:, col["nonfinite"]]),
        **_extremes(raw["max"], ran & (finite_n > 0)),
    }
    for i, fmt in enumerate(spec.formats):
        name = fmt.name
        err2 = sums[:, _M2 + 1 + i]
        snr = jnp.where(err2 > 0, 10.0 * jnp.log10(sums[:, 1] / err2), np.float32(np.inf))
        out[f"underflow_{name}"] = frac(counts[:, col[f"under_{name}"]])
        out[f"subnormal_{name}"] = frac(counts[:, col[f"sub_{name}"]])
        out[f"overflow_{name}"] = frac(counts[:, col[f"over_{name}"]])
        out[f"snr_{name}"] = jnp.where(ran & (finite_n > 0), snr, nan)
    n_fmt = len(spec.formats)
    maxima = raw["max"]
    for i, recipe in enumerate(spec.recipes):
        name = recipe.name
        err2 = sums[:, _M2 + 1 + n_fmt + i]
        snr = jnp.where(err2 > 0, 10.0 * jnp.log10(sums[:, 1] / err2), np.float32(np.inf))
        blocks = counts[:, col[f"blocks_{name}"]]
        flush = counts[:, col[f"flush_{name}"]].astype(_F32) / jnp.maximum(blocks, 1)
        base = len(BASIC_MAXIMA) + 2 * i
        hi, neg_lo = maxima[:, base], maxima[:, base + 1]
        scaled = ran & (hi > -np.inf)
        stats = {
            "underflow": frac(counts[:, col[f"under_{name}"]]),
            "overflow": frac(counts[:, col[f"over_{name}"]]),
            "snr": jnp.where(ran & (finite_n > 0), snr, nan),
            "block_flush": jnp.where(ran, flush, nan),
            "scale_log2_min": jnp.where(scaled, -neg_lo, nan),
            "scale_log2_max": jnp.where(scaled, hi, nan),
        }
        for stat in RECIPE_STATS:
            out[f"{stat}_{name}"] = stats[stat]
    if spec.histograms:
        out["hist"] = raw["hist"]
    return out
