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

from collections.abc import Sequence

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


def _cast(y: jax.Array, el: Format) -> jax.Array:
    """Round non-negative ``y`` to format ``el``, nearest even, saturating."""
    return jnp.minimum(y, np.float32(el.max)).astype(el.dtype).astype(_F32)


def _cast_exact(p: jax.Array, r: jax.Array, el: Format) -> jax.Array:
    """Round ``p + r`` (``p`` float32 >= 0, ``r`` its residual, |r| below one float32
    step of ``p``) to the element format: like ``p`` unless ``p`` is a tie."""
    q = _cast(p, el)
    step = jnp.where(
        p >= np.float32(el.min_normal),
        _pow2(_exponent(jnp.maximum(p, _TINY)) - el.mantissa_bits),
        np.float32(el.min_subnormal),
    )
    t = p / step
    tie = (t - jnp.floor(t)) == 0.5
    half = step * 0.5
    q = jnp.where(tie & (r > 0), p + half, jnp.where(tie & (r < 0), p - half, q))
    return jnp.minimum(q, np.float32(el.max))


def _tensor_amax(a: jax.Array) -> jax.Array:
    return jnp.max(a) if a.size else jnp.float32(0)


def _scaled(a: jax.Array, s: jax.Array, e: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(p, r)``: float32 product ``a * s`` and its residual, with ``a`` taken in units
    of ``2**e`` first (``s * 2**e`` then stays small enough to split exactly)."""
    a2, s2 = a * _pow2(-e), s * _pow2(e)
    p = a2 * s2
    return p, _residual(a2, s2, p)


def recipe_raw(
    data: jax.Array, recipes: Sequence[Recipe], axes: Sequence[int] | None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(sums[R], counts[4R], maxima[2R])`` of one value under each recipe: squared
    error in units of ``2**k``; (underflowed, clipped, flushed blocks, non-empty
    blocks); (largest, negated smallest) log2 of the blocks' dequantisation scales.
    ``k`` is the exponent of the value's finite abs-max, as in `kernel`."""
    x = block_view(jnp.asarray(data).astype(_F32), axes)
    a_all = jnp.abs(x)
    inf = a_all == np.float32(np.inf)
    finite = a_all < np.float32(np.inf)
    a_all = jnp.where(finite & (a_all >= _TINY), a_all, 0.0)
    amax = _tensor_amax(a_all)
    e_amax = jnp.where(amax > 0, _exponent(jnp.maximum(amax, _TINY)), 0)
    unit = _pow2(-jnp.clip(e_amax, -126, 126))
    sums, counts, maxima = [], [], []
    n_inf = jnp.sum(inf.astype(jnp.int32))
    for recipe in recipes:
        a = _blocks(a_all, recipe)
        amax_b = jnp.max(a, axis=1, keepdims=True)
        has = amax_b > 0
        e_b = _exponent(jnp.maximum(amax_b, _TINY))
        el = recipe.element
        big = np.float32(el.max)
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
            q = q_y * _pow2(-h) * _pow2(h - e_s)
            zero_scale = jnp.zeros_like(has)
            log2x = log2x.astype(_F32)
        elif recipe.rule == "tensor":
            s = jnp.where(amax > 0, np.float32(448.0) / jnp.maximum(amax, _TINY), 1.0)
            p, r = _scaled(a, s, e_amax)
            q_y = _cast_exact(p, r, el)
            over = (p > big) | ((p == big) & (r > 0))
            q = q_y / s
            log2x = jnp.broadcast_to(-jnp.log2(s), amax_b.shape)
            zero_scale = jnp.zeros_like(has)
        else:  # nvfp4
            enc = jnp.where(amax > 0, np.float32(448.0 * 6.0) / jnp.maximum(amax, _TINY), 1.0)
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
            q = q_y * s_b / enc
            log2x = jnp.log2(jnp.maximum(s_b, _TINY)) - jnp.log2(enc)
        err = (a - q) * unit
        flushed = has & jnp.all(q == 0, axis=1, keepdims=True)
        scaled_ok = has & ~zero_scale if recipe.rule == "nvfp4" else has
        sums.append(jnp.sum(err * err))
        counts += [
            jnp.sum(((a > 0) & (q == 0)).astype(jnp.int32)),
            jnp.sum(over.astype(jnp.int32)) + n_inf,
            jnp.sum(flushed.astype(jnp.int32)),
            jnp.sum(has.astype(jnp.int32)),
        ]
        lg = log2x.astype(_F32)
        maxima += [
            jnp.max(jnp.where(scaled_ok, lg, -np.inf)),
            jnp.max(jnp.where(scaled_ok, -lg, -np.inf)),
        ]
    return jnp.stack(sums), jnp.stack(counts), jnp.stack(maxima)
