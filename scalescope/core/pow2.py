"""Power-of-two rounding of scales.

Scales are kept at powers of two so that rescaling data by a ratio of scales is exact
(it only changes the exponent) unless the result leaves the data format's range.
"""

from __future__ import annotations

import enum
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


class Pow2Round(enum.Enum):
    DOWN = "down"
    UP = "up"
    NEAREST = "nearest"


def is_static(x: Any) -> bool:
    """True for a value known at trace time (NumPy or Python number): scale arithmetic
    on such values is done in NumPy and emits no operation at all."""
    return isinstance(x, (np.ndarray, np.generic, float, int)) and not isinstance(x, bool)


def _static_f32(x: Any) -> np.ndarray:
    return np.asarray(x, np.float32)


def _strong(x: Any) -> bool:
    """``x`` is a JAX array or tracer that is not weakly typed."""
    return isinstance(x, jax.Array) and not getattr(getattr(x, "aval", x), "weak_type", False)


def as_f32(x: Any) -> jax.Array:
    """``x`` as a float32 JAX value; a float32 array or tracer is returned as it is
    (``jnp.asarray`` costs a dispatch per call, and scale helpers run thousands of times
    while a step is traced)."""
    if _strong(x) and x.dtype == np.float32:
        return x
    return jnp.asarray(x, jnp.float32)


def literal_like(x: jax.Array, value: Any) -> Any:
    """``value`` in ``x``'s dtype and shape: a NumPy scalar (a literal of the traced
    program, no operation) for a scalar ``x``, else a filled array."""
    if np.ndim(x) == 0:
        return np.asarray(value, x.dtype)
    return jax.lax.full_like(x, value)


def _as_float(x) -> jax.Array:
    if not _strong(x):
        x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(jnp.float32)
    return x


_EXPONENT_MASK = {4: 0x7F800000, 8: 0x7FF0000000000000}
_INT_OF = {4: np.int32, 8: np.int64}


def pow2_round_down(x) -> jax.Array:
    """Largest power of two ``<= |x|``, by clearing the sign and mantissa bits.

    Three cheap ops (bitcast, and, bitcast), so the rule table can call it on every
    scale without bloating the compiled graph. 0 and subnormals give 0, inf gives inf.
    A static scalar (NumPy or Python) gives a NumPy float32 scalar: no operation.
    """
    if is_static(x) and np.ndim(x) == 0:
        bits = _static_f32(x).view(np.int32) & np.int32(0x7F800000)
        return np.asarray(bits.view(np.float32))
    x = _as_float(x)
    if x.dtype.itemsize not in _EXPONENT_MASK:
        x = x.astype(jnp.float32)
    size = x.dtype.itemsize
    bits = jax.lax.bitcast_convert_type(x, _INT_OF[size])
    mask = literal_like(bits, _EXPONENT_MASK[size])
    return jax.lax.bitcast_convert_type(jax.lax.bitwise_and(bits, mask), x.dtype)


_F32_BITS_254 = 254 << 23  # exponent field of 2^127
_F32_HALF_MIN_SUBNORMAL = 1 << 22  # bits of 2^-127


def pow2_reciprocal(p) -> jax.Array:
    """Exactly ``1 / p`` for a positive power of two ``p`` (float32, normal range).

    Integer work on the exponent field: XLA counts a float divide as expensive and
    gives a scalar one a kernel of its own, while these ops fuse into their consumers.
    The result for anything but a positive normal power of two is meaningless
    (callers pass scales made positive, e.g. by ``positive_or_one``).
    """
    if is_static(p) and np.ndim(p) == 0:
        return _static_f32(1.0 / np.float64(p))
    bits = jax.lax.bitcast_convert_type(as_f32(p), jnp.int32)
    top = literal_like(bits, _F32_BITS_254)
    tiny = literal_like(bits, _F32_HALF_MIN_SUBNORMAL)
    inv = jax.lax.select(jax.lax.ge(bits, top), tiny, jax.lax.sub(top, bits))
    return jax.lax.bitcast_convert_type(inv, jnp.float32)


def pow2_sqrt_even(p) -> jax.Array:
    """Exactly ``sqrt(p)`` for ``p`` 0 or an even power of two (float32): halves the
    exponent field instead of calling sqrt (expensive to XLA, see `pow2_reciprocal`)."""
    if is_static(p) and np.ndim(p) == 0:
        return _static_f32(np.sqrt(np.float64(p)))
    p = as_f32(p)
    bits = jax.lax.bitcast_convert_type(p, jnp.int32)
    biased = jax.lax.shift_right_logical(bits, literal_like(bits, 23))
    half = jax.lax.shift_left(
        jax.lax.shift_right_logical(
            jax.lax.add(biased, literal_like(bits, 127)), literal_like(bits, 1)
        ),
        literal_like(bits, 23),
    )
    root = jax.lax.bitcast_convert_type(half, jnp.float32)
    return jax.lax.select(jax.lax.gt(p, literal_like(p, 0)), root, p)


def pow2_round_up(x) -> jax.Array:
    """Smallest power of two ``>= |x|``."""
    x = jnp.abs(_as_float(x))
    down = pow2_round_down(x)
    return jax.lax.select(down < x, down * 2, down)


def pow2_round_nearest(x) -> jax.Array:
    """Power of two nearest to ``|x|`` in log scale (ties round up)."""
    x = jnp.abs(_as_float(x))
    down = pow2_round_down(x)
    # log-nearest: choose 2*down when x >= down * sqrt(2)
    return jax.lax.select(x >= down * math.sqrt(2.0), down * 2, down)


def pow2_round(x, mode: Pow2Round | str = Pow2Round.DOWN) -> jax.Array:
    mode = Pow2Round(mode)
    if mode is Pow2Round.DOWN:
        return pow2_round_down(x)
    if mode is Pow2Round.UP:
        return pow2_round_up(x)
    return pow2_round_nearest(x)


def static_pow2_round_down(x: float) -> float:
    """Python-float version used for scale factors known at trace time (e.g. sqrt(K))."""
    if not (math.isfinite(x) and x > 0):
        return x
    return math.ldexp(1.0, math.frexp(x)[1] - 1)


__all__ = [
    "Pow2Round",
    "as_f32",
    "literal_like",
    "is_static",
    "pow2_round",
    "pow2_round_down",
    "pow2_round_up",
    "pow2_round_nearest",
    "pow2_reciprocal",
    "pow2_sqrt_even",
    "static_pow2_round_down",
]
