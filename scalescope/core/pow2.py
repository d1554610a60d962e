"""Power-of-two rounding of scales.

Scales are kept at powers of two so that rescaling data by a ratio of scales is exact
(it only changes the exponent) unless the result leaves the data format's range.
"""

from __future__ import annotations

import enum
import math

import jax
import jax.numpy as jnp


class Pow2Round(enum.Enum):
    DOWN = "down"
    UP = "up"
    NEAREST = "nearest"


def _as_float(x) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(jnp.float32)
    return x


_EXPONENT_MASK = {4: 0x7F800000, 8: 0x7FF0000000000000}
_INT_OF = {4: jnp.int32, 8: jnp.int64}


def pow2_round_down(x) -> jax.Array:
    """Largest power of two ``<= |x|``, by clearing the sign and mantissa bits.

    Three cheap ops (bitcast, and, bitcast), so the rule table can call it on every
    scale without bloating the compiled graph. 0 and subnormals give 0, inf gives inf.
    """
    x = _as_float(x)
    if x.dtype.itemsize not in _EXPONENT_MASK:
        x = x.astype(jnp.float32)
    size = x.dtype.itemsize
    bits = jax.lax.bitcast_convert_type(x, _INT_OF[size])
    mask = jnp.asarray(_EXPONENT_MASK[size], _INT_OF[size])
    return jax.lax.bitcast_convert_type(bits & mask, x.dtype)


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
    "pow2_round",
    "pow2_round_down",
    "pow2_round_up",
    "pow2_round_nearest",
    "static_pow2_round_down",
]
