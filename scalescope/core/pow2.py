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


def pow2_round_down(x) -> jax.Array:
    """Largest power of two ``<= |x|`` (0, inf and NaN are returned as they are)."""
    x = _as_float(jnp.abs(_as_float(x)))
    mant, exp = jnp.frexp(x)  # x = mant * 2**exp, mant in [0.5, 1)
    out = jnp.ldexp(jnp.ones_like(x), exp - 1)
    return jnp.where(jnp.isfinite(x) & (x > 0), out, x)


def pow2_round_up(x) -> jax.Array:
    """Smallest power of two ``>= |x|``."""
    x = _as_float(jnp.abs(_as_float(x)))
    down = pow2_round_down(x)
    return jnp.where(down < x, down * 2, down)


def pow2_round_nearest(x) -> jax.Array:
    """Power of two nearest to ``|x|`` in log scale (ties round up)."""
    x = _as_float(jnp.abs(_as_float(x)))
    down = pow2_round_down(x)
    # log-nearest: choose 2*down when x >= down * sqrt(2)
    return jnp.where(x >= down * jnp.sqrt(jnp.asarray(2.0, x.dtype)), down * 2, down)


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
