"""On-device statistics of many values at once, in one fused pass.

Compiling separate reductions for each of a thousand values of a training step costs
minutes of XLA time (see the field notes), so the values of one scope (the step, or one
loop body) are flattened, padded to whole blocks of ``block`` elements and concatenated
into one ``[blocks, block]`` buffer. One variadic reduction computes every per-element
feature (moments, zeros, non-finite, the rounding error and range flags of each format,
the exponent histogram) per block; segment sums then fold blocks into values. The
compiled code is the same whatever the number of values.

The result of a scope is *raw*: sums, counts, maxima and last values per row, which
can be summed over while-loop iterations and stacked over scan iterations.
`finalize` turns raw rows into the published statistics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core.formats import Format

#: Exponent histogram: bins for ``floor(log2|d|)`` from HIST_LO to HIST_HI inclusive.
#: Columns of ``stats["hist"]``: zero, below (finite, nonzero, exponent < HIST_LO),
#: one per exponent HIST_LO..HIST_HI, above (finite, exponent > HIST_HI), non-finite.
#: The range covers every FP8/FP16 format's normal and subnormal range with margin.
HIST_LO = -40
HIST_HI = 23
HIST_EXPONENTS = tuple(range(HIST_LO, HIST_HI + 1))
HIST_COLUMNS = ("zero", "below", *(f"2^{e}" for e in HIST_EXPONENTS), "above", "nonfinite")

BASIC_STATS = ("count", "scale", "rms", "absmax", "mean", "std", "frac_zero", "frac_nonfinite")
FORMAT_STATS = ("underflow", "subnormal", "overflow", "snr")

DEFAULT_BLOCK = 512
_F32 = jnp.float32


@dataclass(frozen=True)
class StatSpec:
    """What to compute: the audited formats, whether to build histograms, block size."""

    formats: tuple[Format, ...]
    histograms: bool = True
    block: int = DEFAULT_BLOCK

    def stat_names(self) -> tuple[str, ...]:
        """Names of the per-row scalar statistics, in output order."""
        per_format = tuple(f"{s}_{f.name}" for f in self.formats for s in FORMAT_STATS)
        return BASIC_STATS + per_format

    @property
    def sum_columns(self) -> tuple[str, ...]:
        return ("sum", "sumsq", *(f"err2_{f.name}" for f in self.formats))

    @property
    def count_columns(self) -> tuple[str, ...]:
        cols = ["n", "zero", "nonfinite"]
        for f in self.formats:
            cols += [f"under_{f.name}", f"sub_{f.name}", f"over_{f.name}"]
        if self.histograms:
            cols += ["below", *(f"e{e}" for e in HIST_EXPONENTS), "above"]
        return tuple(cols)


RAW_KEYS = ("sum", "cnt", "max", "last")


def empty_raw(spec: StatSpec) -> dict[str, jax.Array]:
    """Raw statistics with zero rows."""
    return {
        "sum": jnp.zeros((0, len(spec.sum_columns)), _F32),
        "cnt": jnp.zeros((0, len(spec.count_columns)), jnp.int32),
        "max": jnp.zeros((0, 1), _F32),
        "last": jnp.zeros((0, 1), _F32),
    }


def accumulate(acc: dict[str, jax.Array], new: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Fold one more while-loop iteration into raw statistics."""
    return {
        "sum": acc["sum"] + new["sum"],
        "cnt": acc["cnt"] + new["cnt"],
        "max": jnp.maximum(acc["max"], new["max"]),
        "last": new["last"],
    }


def concat_raw(parts: Sequence[dict[str, jax.Array]], spec: StatSpec) -> dict[str, jax.Array]:
    parts = [p for p in parts if p["sum"].shape[0]]
    if not parts:
        return empty_raw(spec)
    if len(parts) == 1:
        return parts[0]
    return {k: jnp.concatenate([p[k] for p in parts]) for k in RAW_KEYS}


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
    """``q_F``: clip to the format's range, then round to nearest even by a cast."""
    if np.dtype(fmt.dtype) == np.float32:
        return x
    big = np.float32(fmt.max)
    return lax.clamp(-big, x, big).astype(fmt.dtype).astype(_F32)


def _exponent(x: jax.Array) -> jax.Array:
    """``floor(log2|x|)`` for normal float32 ``x``, read from the exponent bits."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return ((bits >> 23) & 0xFF) - 127


def _block_features(x: jax.Array, spec: StatSpec) -> tuple[list, list, list]:
    """Per-element features of ``x`` (float32): summed, counted and maximised ones."""
    a = jnp.abs(x)
    finite = a < np.float32(np.inf)
    xf = jnp.where(finite, x, 0.0)
    nonzero = finite & (x != 0)
    as_f = lambda m: m.astype(_F32)
    sums = [xf, xf * xf]
    counts = [as_f(x == 0), as_f(~finite)]
    for fmt in spec.formats:
        q = _round_to(xf, fmt)
        err = xf - q
        aq = jnp.abs(q)
        sums.append(err * err)
        counts += [
            as_f(nonzero & (q == 0)),
            as_f((aq > 0) & (aq < np.float32(fmt.min_normal))),
            as_f(a > np.float32(fmt.max)),
        ]
    if spec.histograms:
        k = jnp.clip(_exponent(xf) - (HIST_LO - 1), 0, len(HIST_EXPONENTS) + 1)
        counts += [as_f(nonzero & (k == i)) for i in range(len(HIST_EXPONENTS) + 2)]
    maxes = [jnp.where(finite, a, 0.0)]
    return sums, counts, maxes


def _reduce_blocks(x: jax.Array, spec: StatSpec) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One variadic reduction over axis 1 of ``x [blocks, block]``."""
    sums, counts, maxes = _block_features(x, spec)
    n_add = len(sums) + len(counts)
    operands = [*sums, *counts, *maxes]

    def combine(a, b):
        return tuple(lax.add(a[i], b[i]) if i < n_add else lax.max(a[i], b[i]) for i in range(len(a)))

    inits = [np.float32(0)] * len(operands)
    out = lax.reduce(operands, inits, combine, (1,))
    s = jnp.stack(out[: len(sums)], axis=1)
    c = jnp.stack(out[len(sums) : n_add], axis=1)
    m = jnp.stack(out[n_add:], axis=1)
    return s, c, m


def scope_raw(values: Sequence[tuple[Any, Any]], spec: StatSpec) -> dict[str, jax.Array]:
    """Raw statistics of ``values`` (pairs of data and scale, the scale ``None`` for a
    plain value), one row each, computed in one fused pass."""
    if not values:
        return empty_raw(spec)
    b = spec.block
    pieces, blocks_per_value, sizes, pads = [], [], [], []
    for data, _ in values:
        flat = jnp.ravel(data).astype(_F32)
        n = int(flat.shape[0])
        nb = -(-n // b)
        pad = nb * b - n
        if pad:
            flat = jnp.concatenate([flat, jnp.zeros((pad,), _F32)])
        pieces.append(flat)
        blocks_per_value.append(nb)
        sizes.append(n)
        pads.append(pad)
    x = jnp.concatenate(pieces) if len(pieces) > 1 else pieces[0]
    s, c, m = _reduce_blocks(x.reshape(-1, b), spec)
    rows = len(values)
    seg = np.repeat(np.arange(rows, dtype=np.int32), blocks_per_value)
    seg_sum = lambda v: jax.ops.segment_sum(v, seg, rows, indices_are_sorted=True)
    sums = seg_sum(s)
    counts = seg_sum(c.astype(jnp.int32))
    maxes = jax.ops.segment_max(m, seg, rows, indices_are_sorted=True)
    # Padding adds zeros only: correct the zero count; the element count is static.
    fix = np.zeros((rows, counts.shape[1] + 1), np.int32)
    fix[:, 0] = sizes
    fix[:, 1] = -np.asarray(pads, np.int32)
    counts = jnp.concatenate([jnp.zeros((rows, 1), jnp.int32), counts], axis=1) + fix
    scales = jnp.stack(
        [
            jnp.asarray(1.0 if scale is None else scale, _F32).reshape(())
            for _, scale in values
        ]
    )[:, None]
    return {"sum": sums, "cnt": counts, "max": maxes, "last": scales}


def finalize(raw: dict[str, jax.Array], spec: StatSpec) -> dict[str, jax.Array]:
    """Published statistics from raw rows (see DESIGN.md, "The probe").

    Moments (rms, mean, std, absmax) are over the finite elements; fractions over all
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
    with np.errstate(all="ignore"):
        mean = sums[:, 0] / finite_n
        meansq = sums[:, 1] / finite_n
    out = {
        "count": n,
        "scale": jnp.where(ran, raw["last"][:, 0], nan),
        "rms": jnp.sqrt(meansq),
        "absmax": jnp.where(ran & (finite_n > 0), raw["max"][:, 0], nan),
        "mean": mean,
        "std": jnp.sqrt(jnp.maximum(meansq - mean * mean, 0.0)),
        "frac_zero": frac(counts[:, col["zero"]]),
        "frac_nonfinite": frac(counts[:, col["nonfinite"]]),
    }
    for i, fmt in enumerate(spec.formats):
        name = fmt.name
        err2 = sums[:, 2 + i]
        snr = jnp.where(err2 > 0, 10.0 * jnp.log10(sums[:, 1] / err2), np.float32(np.inf))
        out[f"underflow_{name}"] = frac(counts[:, col[f"under_{name}"]])
        out[f"subnormal_{name}"] = frac(counts[:, col[f"sub_{name}"]])
        out[f"overflow_{name}"] = frac(counts[:, col[f"over_{name}"]])
        out[f"snr_{name}"] = jnp.where(ran & (finite_n > 0), snr, nan)
    if spec.histograms:
        lo = col["below"]
        out["hist"] = jnp.concatenate(
            [
                counts[:, col["zero"], None],
                counts[:, lo : lo + len(HIST_EXPONENTS) + 2],
                counts[:, col["nonfinite"], None],
            ],
            axis=1,
        )
    return out
