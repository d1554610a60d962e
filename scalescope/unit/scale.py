"""`scale_fwd` and `scale_bwd`: multiply by a constant in one pass only.

They are the two building blocks of every unit-scaled op: ``scale_fwd`` rescales the
forward value and leaves the gradient alone, ``scale_bwd`` is the identity forward and
rescales the gradient. Both are `jax.custom_vjp` functions, so they compose with `jit`,
`grad`, `vmap` and `scalescope.scalify` (which interprets the custom call's primal).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp


def check_float(x: Any, op: str, name: str = "input") -> jax.Array:
    """Return ``x`` as an array, or raise TypeError when it is not floating point."""
    dtype = getattr(x, "dtype", None)
    if dtype is None and isinstance(x, float):
        return jnp.asarray(x)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{op}: {name} must be a floating-point array, got dtype {dtype}")
    return x


def _check_scale(s: Any, op: str) -> Any:
    """A scale is a Python number or a scalar array (it is never differentiated)."""
    if isinstance(s, bool) or not (isinstance(s, int | float) or jnp.ndim(s) == 0):
        raise ValueError(f"{op}: the scale must be a number or a scalar array, got {s!r}")
    if isinstance(s, int | float) and not math.isfinite(s):
        raise ValueError(f"{op}: the scale must be finite, got {s}")
    return s


def _mul(x: jax.Array, s: Any) -> jax.Array:
    """``x * s`` in ``x``'s dtype (one rounding: exact when ``s`` is a power of two)."""
    return x * jnp.asarray(s).astype(x.dtype)


@jax.custom_vjp
def _scale_fwd(x, s):
    return _mul(x, s)


def _scale_fwd_fwd(x, s):
    return _mul(x, s), jnp.zeros_like(jnp.asarray(s))


def _scale_fwd_bwd(zero_s, ct):
    return ct, zero_s


_scale_fwd.defvjp(_scale_fwd_fwd, _scale_fwd_bwd)


@jax.custom_vjp
def _scale_bwd(x, s):
    return x


def _scale_bwd_fwd(x, s):
    return x, jnp.asarray(s)


def _scale_bwd_bwd(s, ct):
    return _mul(ct, s), jnp.zeros_like(s)


_scale_bwd.defvjp(_scale_bwd_fwd, _scale_bwd_bwd)


def scale_fwd(x: jax.Array, s: float | jax.Array) -> jax.Array:
    """``s * x`` in the forward pass; the gradient passes through unchanged."""
    x = check_float(x, "scale_fwd", "x")
    return _scale_fwd(x, _check_scale(s, "scale_fwd"))


def scale_bwd(x: jax.Array, s: float | jax.Array) -> jax.Array:
    """Identity in the forward pass; the gradient is multiplied by ``s``."""
    x = check_float(x, "scale_bwd", "x")
    return _scale_bwd(x, _check_scale(s, "scale_bwd"))


def logarithmic_interpolation(alpha: float, lower: float, upper: float) -> float:
    """Interpolate between ``lower`` (alpha=0) and ``upper`` (alpha=1) geometrically.

    The u-μP rules use it to blend two limiting scales of an op (for example softmax
    near-flat versus near-one-hot) by a sigmoid of the log of the op's ``mult``.
    """
    return math.exp(alpha * math.log(upper) + (1.0 - alpha) * math.log(lower))


__all__ = ["logarithmic_interpolation", "scale_bwd", "scale_fwd"]
