"""Recipe statistics of one value in pure XLA (the GPU twin of the native kernel).

A value is laid out so its block axis is last (`block_view`), cut into blocks, and each
block quantised under each requested recipe (`scalescope.core.recipes`). Everything is
exact in float32 arithmetic:

- power-of-two scales (MX, block128) move the exponent only, so ``d / X`` is exact and
  a float32 -> element-format cast rounds it once;
- the FP32 scales of ``e4m3_tensor`` and ``nvfp4`` make ``d * s`` inexact in float32.
  Its float32 product ``p`` is within one float32 step of the exact one, so the element
  format rounds both alike except where ``p`` itself lies on a tie or at the format's
  max; there the sign of the exact residual ``d*s - p`` (an error-free product of
  12-bit halves) decides. NVFP4 elements ``d * S_enc / s_b`` are compared with the
  E2M1 decision points times ``s_b``, which are exact.

Output per recipe: the squared error sum in units of ``2**k`` (k the value's abs-max
exponent, as `kernel` keeps its sums), counts of underflowed and clipped elements, of
flushed and of non-empty blocks, and the largest and (negated) smallest block-scale
exponent.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core.formats import Format
from ..core.formats import get as _get_format
from ..core.recipes import Recipe

_F32 = jnp.float32
_E4M3 = _get_format("e4m3")
_TINY = np.float32(np.finfo(np.float32).tiny)
#: E2M1 decision points (ties between neighbours) and whether a tie rounds up (to even).
_E2M1_TIES = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
              (3.5, True), (5.0, False))  # fmt: skip
_E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def _tensor_factor(top: float, amax: jax.Array) -> jax.Array:
    """``f32(top / amax)`` correctly rounded, float32's max where it overflows (an
    abs-max below about ``top / 3.4e38``, clamped as Transformer Engine does), 1 for an
    all-zero value. Computed as ``(top / m) * 2**-e`` for ``amax = m * 2**e``: XLA turns
    a division by a broadcast value into a product with its reciprocal, and ``1 / amax``
    is a subnormal (flushed to zero) for an abs-max above 2**126."""
    safe = jnp.maximum(amax, _TINY)
    e = _exponent(safe)
    q = _div_rn(jnp.full(safe.shape, top, _F32), _mantissa(safe))  # in (top / 2, top]
    h = (-e) // 2
    f = q * _pow2(h) * _pow2(-e - h)  # exact steps: each factor and product normal
    return jnp.where(amax > 0, jnp.minimum(f, np.finfo(np.float32).max), 1.0)


def block_view(x: jax.Array, axes: Sequence[int] | None) -> jax.Array:
    """``x`` as ``[outer, rows, length]``: the block axes (``axes``, default the last)
    moved to the end and flattened into ``length``; ``rows`` is the axis before them
    (the second axis of 2-D tiles, 1 when there is none)."""
    if x.ndim == 0:
        return x.reshape(1, 1, 1)
    axes = (x.ndim - 1,) if not axes else tuple(a % x.ndim for a in axes)
    rest = [a for a in range(x.ndim) if a not in axes]
    if list(rest) + list(axes) != list(range(x.ndim)):
        x = jnp.transpose(x, (*rest, *axes))
    length = int(np.prod([x.shape[len(rest) + i] for i in range(len(axes))], dtype=np.int64))
    rows = int(x.shape[len(rest) - 1]) if rest else 1
    outer = int(np.prod(x.shape[: max(len(rest) - 1, 0)], dtype=np.int64))
    return x.reshape(outer, rows, length)


def _blocks(v: jax.Array, recipe: Recipe) -> jax.Array:
    """``[blocks, elements]`` of ``v`` (``[outer, rows, length]``), zero-padded."""
    outer, rows, length = v.shape
    if recipe.per_tensor:
        return v.reshape(1, -1)
    b, r = recipe.block, recipe.rows
    if r == 1:
        v = v.reshape(outer * rows, length)
        pad = -length % b
        if pad:
            v = jnp.pad(v, ((0, 0), (0, pad)))
        return v.reshape(-1, b)
    pad_r, pad_l = -rows % r, -length % b
    if pad_r or pad_l:
        v = jnp.pad(v, ((0, 0), (0, pad_r), (0, pad_l)))
    nr, nl = (rows + pad_r) // r, (length + pad_l) // b
    v = v.reshape(outer, nr, r, nl, b).transpose(0, 1, 3, 2, 4)
    return v.reshape(-1, r * b)


def _exponent(a: jax.Array) -> jax.Array:
    """floor(log2 a) of positive normal float32 ``a``."""
    return ((lax.bitcast_convert_type(a, jnp.int32) >> 23) & 0xFF) - 127


def _mantissa(a: jax.Array) -> jax.Array:
    """``a / 2**floor(log2 a)`` in [1, 2) for positive normal ``a``."""
    bits = lax.bitcast_convert_type(a, jnp.int32)
    return lax.bitcast_convert_type((bits & 0x007FFFFF) | 0x3F800000, _F32)


def _pow2(k: jax.Array) -> jax.Array:
    """``2.0**k`` for integer ``k`` in [-126, 127]."""
    return lax.bitcast_convert_type((jnp.clip(k, -126, 127) + 127) << 23, _F32)


def _split(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``a = hi + lo`` with the 12 leading significant bits in ``hi`` (exact)."""
    bits = lax.bitcast_convert_type(a, jnp.int32)
    hi = lax.bitcast_convert_type(bits & np.int32(-4096), _F32)
    return hi, a - hi


def _residual(a: jax.Array, b: jax.Array, p: jax.Array) -> jax.Array:
    """``a*b - p`` exactly (Dekker's product of 12-bit halves; every partial product
    is exact, so fused multiply-adds do not change it), for float32 ``a, b >= 0``."""
    ah, al = _split(a)
    bh, bl = _split(b)
    return ((ah * bh - p) + ah * bl + al * bh) + al * bl


def _div_rn(n: jax.Array, d: jax.Array) -> jax.Array:
    """``n / d`` correctly rounded (``n >= 0``, ``d > 0``, a quotient in float32's normal
    range), whatever XLA makes of the division: by a broadcast divisor it multiplies by
    the reciprocal, up to two ulps off. Each of two steps moves the quotient ``c`` to the
    neighbour nearer to ``n / d``, judged by the exact residual ``c*d - n`` against
    half the distance to that neighbour (times ``d``, exact), ties to even."""
    c = n / d
    for _ in range(2):
        e = _residual(c, d, n)
        lo, hi = jnp.nextafter(c, 0.0), jnp.nextafter(c, np.float32(np.inf))
        half_lo, half_hi = d * (c - lo) * 0.5, d * (hi - c) * 0.5
        odd = (lax.bitcast_convert_type(c, jnp.int32) & 1) == 1
        down = (e > half_lo) | ((e == half_lo) & odd & (c > 0))
        up = (-e > half_hi) | ((-e == half_hi) & odd)
        c = jnp.where(down, lo, jnp.where(up, hi, c))
    return c


def _cast(y: jax.Array, el: Format) -> jax.Array:
    """Round non-negative ``y`` to format ``el``, nearest even, saturating.

    Byte formats go through XLA's convert. A sub-byte one (E2M1) is rounded here, on
    its grid (``y / step`` is exact, `jnp.round` ties to even), because XLA does not
    round it alike everywhere: its elemental CPU emitter rounds a float32 just above an
    E2M1 tie down (5.0002 to 4, not 6; jaxlib 0.10.2), where ml_dtypes and the default
    emitter give 6."""
    y = jnp.minimum(y, np.float32(el.max))
    if el.mantissa_bits + el.exponent_bits + 1 >= 8:
        return y.astype(el.dtype).astype(_F32)
    step = _grid_step(y, el)
    return jnp.round(y / step) * step


def _grid_step(y: jax.Array, el: Format) -> jax.Array:
    """The spacing of format ``el``'s grid around non-negative ``y`` (a power of two)."""
    return jnp.where(
        y >= np.float32(el.min_normal),
        _pow2(_exponent(jnp.maximum(y, _TINY)) - el.mantissa_bits),
        np.float32(el.min_subnormal),
    )


def _cast_exact(p: jax.Array, r: jax.Array, el: Format) -> jax.Array:
    """Round ``p + r`` (``p`` float32 >= 0, ``r`` its residual, |r| below one float32
    step of ``p``) to the element format: like ``p`` unless ``p`` is a tie."""
    q = _cast(p, el)
    step = _grid_step(p, el)
    t = p / step
    tie = (t - jnp.floor(t)) == 0.5
    half = step * 0.5
    q = jnp.where(tie & (r > 0), p + half, jnp.where(tie & (r < 0), p - half, q))
    return jnp.minimum(q, np.float32(el.max))


def _scaled(a: jax.Array, s: jax.Array, e: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(p, r)``: float32 product ``a * s`` and its residual, with ``a`` taken in units
    of ``2**e`` first (``s * 2**e`` then stays small enough to split exactly). Each
    power of two is applied in two steps: ``2**-127`` (an abs-max of 2**127 or more) is
    no normal float32."""
    h = e // 2
    a2 = a * _pow2(-h) * _pow2(h - e)
    s2 = s * _pow2(h) * _pow2(e - h)
    p = a2 * s2
    return p, _residual(a2, s2, p)


#: Elements per row when a whole-tensor recipe's values are cut into rows of a buffer.
_TENSOR_ROW = 512


def _recipe_blocks(view: jax.Array, recipe: Recipe) -> jax.Array:
    """Blocks of one value (``[blocks, elements]``); a whole-tensor recipe gets rows of
    `_TENSOR_ROW` elements, put back together per value afterwards."""
    if not recipe.per_tensor:
        return _blocks(view, recipe)
    flat = view.reshape(-1)
    pad = -flat.shape[0] % _TENSOR_ROW
    return jnp.pad(flat, (0, pad)).reshape(-1, _TENSOR_ROW)


def recipe_group_raw(
    values: Sequence[tuple[jax.Array, Sequence[int] | None]], recipes: Sequence[Recipe]
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Recipe statistics of several values (``(data, block_axes)`` pairs) at once:
    ``(sums[V, R], counts[V, 4R], maxima[V, 2R])``, per value and recipe the squared
    error in units of ``2**k`` (k the exponent of the value's finite abs-max, as in
    `kernel`); (underflowed, clipped, flushed blocks, non-empty blocks); (largest,
    negated smallest) log2 of the blocks' dequantisation scales.

    The blocks of every value go into one buffer per recipe and per-block results are
    summed per value, so the compiled code does not grow with the number of values."""
    views = [block_view(jnp.asarray(d).astype(_F32), axes) for d, axes in values]
    n_values = len(views)
    sums, counts, maxima = [], [], []
    for recipe in recipes:
        parts = [_recipe_blocks(v, recipe) for v in views]
        seg = np.repeat(np.arange(n_values, dtype=np.int32), [p.shape[0] for p in parts])
        x = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
        s, c, m = _recipe_blocks_raw(x, recipe, seg, functools.partial(_by_value, seg=seg))
        sums.append(s)
        counts.append(c)
        maxima.append(m)
    return jnp.stack(sums, 1), jnp.concatenate(counts, 1), jnp.concatenate(maxima, 1)


def _by_value(v: jax.Array, how: str = "sum", *, seg: np.ndarray) -> jax.Array:
    """Per-block ``v`` summed (or maximised) per value."""
    fn = jax.ops.segment_sum if how == "sum" else jax.ops.segment_max
    return fn(v, seg, int(seg[-1]) + 1, indices_are_sorted=True)


class _Quantised(NamedTuple):
    """One recipe applied to blocks ``[blocks, elements]``: what the statistics and the
    dequantised values are read from."""

    a: jax.Array  # |x|, non-finite and float32-subnormal elements as 0
    q_y: jax.Array  # the elements on the element grid (non-negative)
    q_u: jax.Array  # the dequantised |x| in units of 2**e_unit
    unit: jax.Array  # 2**-e_unit, per block
    e_unit: jax.Array  # the exponent of the value's abs-max, per block
    over: jax.Array  # elements clipped to the element format's max
    n_inf: jax.Array  # infinite elements per block
    amax_b: jax.Array  # each block's finite abs-max ([blocks, 1])
    has: jax.Array  # blocks with a non-zero element ([blocks, 1])
    zero_scale: jax.Array  # blocks whose scale flushed to 0 (NVFP4)
    log2x: jax.Array  # log2 of each block's dequantisation scale ([blocks, 1])


def _quantise_blocks(x: jax.Array, recipe: Recipe, amax_of) -> _Quantised:
    """Apply ``recipe`` to the blocks ``x`` (``[blocks, elements]``); ``amax_of`` maps
    the blocks' abs-maxima (``[blocks]``) to their value's abs-max, per block."""
    ax = jnp.abs(x)
    n_inf = jnp.sum((ax == np.float32(np.inf)).astype(jnp.int32), axis=1)
    a = jnp.where((ax < np.float32(np.inf)) & (ax >= _TINY), ax, 0.0)
    amax_b = jnp.max(a, axis=1, keepdims=True)
    amax = amax_of(amax_b[:, 0])[:, None]  # the value's abs-max, per block
    e_amax = jnp.where(amax > 0, _exponent(jnp.maximum(amax, _TINY)), 0)
    e_unit = jnp.clip(e_amax, -126, 126)
    unit = _pow2(-e_unit)  # errors are summed in units of 2**e_unit
    has = amax_b > 0
    e_b = _exponent(jnp.maximum(amax_b, _TINY))
    el = recipe.element
    big = np.float32(el.max)
    zero_scale = jnp.zeros_like(has)
    if recipe.rule in ("mx_floor", "mx_rceil", "pow2_floor"):
        if recipe.rule == "pow2_floor":
            e_s = el.max_exponent - e_b - (_mantissa(amax_b) * 2.0**el.max_exponent > big)
            e_s = jnp.minimum(e_s, 127)
            log2x = -e_s
        else:
            e_x = e_b - el.max_exponent
            if recipe.rule == "mx_rceil":
                e_x = e_x + (_mantissa(amax_b) * 2.0**el.max_exponent > big)
            log2x = jnp.clip(e_x, -127, 127)
            e_s = -log2x
        # a * 2**e_s, exact (two steps keep each factor a float32 power of two).
        h = e_s // 2
        y = a * _pow2(h) * _pow2(e_s - h)
        q_y = _cast(y, el)
        over = y > big
        t = -e_s - e_unit  # q_y * 2**t: the dequantised value in units, in two exact steps
        q_u = q_y * _pow2(t // 2) * _pow2(t - t // 2)
        log2x = log2x.astype(_F32)
    elif recipe.rule == "tensor":
        s = _tensor_factor(448.0, amax)
        p, r = _scaled(a, s, e_amax)
        q_y = _cast_exact(p, r, el)
        over = (p > big) | ((p == big) & (r > 0))
        q_u = _div_rn(q_y, s * _pow2(e_unit))  # s * 2**e_unit is exact and near 448
        log2x = -jnp.log2(s)
    else:  # nvfp4
        enc = _tensor_factor(448.0 * 6.0, amax)
        pb, rb = _scaled(amax_b, enc, e_amax)
        t = pb / 6.0  # the block scale before rounding: exact only where tied
        rt = (pb - 6.0 * t) + rb
        s_b = _cast_exact(t, rt, _E4M3)
        p, r = _scaled(a, enc, e_amax)
        idx = jnp.zeros(a.shape, jnp.int32)
        for tie, up in _E2M1_TIES:
            c = np.float32(tie) * s_b
            above = (p > c) | ((p == c) & (r > 0)) | ((p == c) & (r == 0) & up)
            idx = idx + above.astype(jnp.int32)
        q_y = jnp.asarray(_E2M1_GRID)[idx]
        lim = np.float32(6.0) * s_b
        zero_scale = s_b == 0
        over = ((p > lim) | ((p == lim) & (r > 0))) & ~zero_scale
        q_y = jnp.where(zero_scale, 0.0, q_y)
        q_u = _div_rn(q_y * s_b, enc * _pow2(e_unit))  # q_y * s_b is exact
        log2x = jnp.log2(jnp.maximum(s_b, _TINY)) - jnp.log2(enc)
    return _Quantised(a, q_y, q_u, unit, e_unit, over, n_inf, amax_b, has, zero_scale, log2x)


def _recipe_blocks_raw(x: jax.Array, recipe: Recipe, seg: np.ndarray, by_value):
    """Per-value results of one recipe from the blocks ``x`` (``[blocks, elements]``,
    block ``i`` belonging to value ``seg[i]``)."""
    a, q_y, q_u, unit, _, over, n_inf, amax_b, has, zero_scale, log2x = _quantise_blocks(
        x, recipe, lambda amax_b: by_value(amax_b, "max")[seg]
    )
    # In units of the value's abs-max, where even a value below float32's normal range
    # keeps its error (float32 subnormals flush on CPUs); the same bits as (a - q) * unit
    # elsewhere. Zero and underflow are decided on the element grid (q_y).
    err = a * unit - q_u
    nonzero = jnp.sum((q_y != 0).astype(jnp.int32), axis=1)
    as_i = lambda m: m.astype(jnp.int32)  # noqa: E731
    under = by_value(jnp.sum(as_i((a > 0) & (q_y == 0)), axis=1))
    clipped = by_value(jnp.sum(as_i(over), axis=1) + n_inf)
    err2 = by_value(jnp.sum(err * err, axis=1))
    lg = log2x.astype(_F32)[:, 0]
    if recipe.per_tensor:  # one block per value, cut into rows here
        has_v = by_value(amax_b[:, 0], "max") > 0
        flushed = as_i(has_v & (by_value(nonzero) == 0))
        blocks = as_i(has_v)
        hi = jnp.where(has_v, by_value(lg, "max"), -np.inf)
        neg_lo = jnp.where(has_v, by_value(-lg, "max"), -np.inf)
    else:
        ok = (has & ~zero_scale)[:, 0]
        flushed = by_value(as_i(has[:, 0] & (nonzero == 0)))
        blocks = by_value(as_i(has[:, 0]))
        hi = by_value(jnp.where(ok, lg, -np.inf), "max")
        neg_lo = by_value(jnp.where(ok, -lg, -np.inf), "max")
    counts = jnp.stack([under, clipped, flushed, blocks], 1)
    return err2, counts, jnp.stack([hi, neg_lo], 1)


def _unview(v: jax.Array, shape: tuple[int, ...], axes: Sequence[int] | None) -> jax.Array:
    """The inverse of `block_view`: ``v`` (``[outer, rows, length]``) back to ``shape``."""
    if len(shape) == 0:
        return v.reshape(())
    axes = (len(shape) - 1,) if not axes else tuple(a % len(shape) for a in axes)
    rest = [a for a in range(len(shape)) if a not in axes]
    perm = (*rest, *axes)
    x = v.reshape(tuple(shape[a] for a in perm))
    if list(perm) != list(range(len(shape))):
        x = jnp.transpose(x, tuple(int(i) for i in np.argsort(perm)))
    return x


def _unblocks(b: jax.Array, recipe: Recipe, view: tuple[int, int, int]) -> jax.Array:
    """The inverse of `_recipe_blocks`: blocks back to the ``[outer, rows, length]`` view."""
    outer, rows, length = view
    if recipe.per_tensor:
        return b.reshape(-1)[: outer * rows * length].reshape(view)
    if recipe.rows == 1:
        return b.reshape(outer * rows, -1)[:, :length].reshape(view)
    r, n = recipe.rows, recipe.block
    nr, nl = -(-rows // r), -(-length // n)
    v = b.reshape(outer, nr, nl, r, n).transpose(0, 1, 3, 2, 4)
    return v.reshape(outer, nr * r, nl * n)[:, :rows, :length]


def dequantise(x: jax.Array, recipe: Recipe, axes: Sequence[int] | None = None) -> jax.Array:
    """``x`` quantised by ``recipe`` and dequantised, in float32: the values a GEMM fed
    the recipe's elements and block scales computes with. Blocks run along ``axes``
    (default the last axis), as the probe measures them. Each element is the float32
    nearest to ``sign(x) * q * X`` (``q`` on the element grid, ``X`` its block's scale),
    the exact dequantised value where it is a float32; non-finite elements are left as
    they are and do not enter the scales; float32 subnormals count as zero."""
    x = jnp.asarray(x).astype(_F32)
    view = block_view(x, axes)
    blocks = _recipe_blocks(view, recipe)
    whole = lambda amax_b: jnp.broadcast_to(jnp.max(amax_b), amax_b.shape)  # noqa: E731
    q = _quantise_blocks(blocks, recipe, whole)
    mag = q.q_u * _pow2(q.e_unit // 2) * _pow2(q.e_unit - q.e_unit // 2)
    out = _unview(_unblocks(mag, recipe, view.shape), x.shape, axes)
    return jnp.where(jnp.isfinite(x), jnp.copysign(out, x), x)
