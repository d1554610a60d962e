"""Casts that act on one pass only: `cast_on_forward` and `cast_on_backward`.

Both round a value to a low-precision ``dtype`` and return it in its original dtype
(quantise-dequantise), so the surrounding graph keeps its dtypes and XLA can fuse the
pair into an FP8 GEMM on hardware that has one. Under `scalify` the rounding applies to
the scaled data, which is what makes FP8 "just a cast".
"""

from __future__ import annotations

from functools import partial

import jax
import numpy as np
from jax import lax

from .dispatch import accepts_scaled


def _round_trip(x: jax.Array, dtype) -> jax.Array:
    return lax.convert_element_type(lax.convert_element_type(x, dtype), x.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _cast_fwd_only(x, dtype):
    return _round_trip(x, dtype)


def _cast_fwd_only_fwd(x, dtype):
    return _round_trip(x, dtype), None


def _cast_fwd_only_bwd(dtype, _, ct):
    return (ct,)


_cast_fwd_only.defvjp(_cast_fwd_only_fwd, _cast_fwd_only_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _cast_bwd_only(x, dtype):
    return x


def _cast_bwd_only_fwd(x, dtype):
    return x, None


def _cast_bwd_only_bwd(dtype, _, ct):
    return (_round_trip(ct, dtype),)


_cast_bwd_only.defvjp(_cast_bwd_only_fwd, _cast_bwd_only_bwd)


def _check_float_dtype(dtype, where: str) -> np.dtype:
    try:
        dtype = np.dtype(dtype)
    except TypeError as err:
        raise TypeError(f"{where}: {dtype!r} is not a dtype") from err
    if not np.issubdtype(dtype, np.floating) and "float" not in dtype.name:
        raise TypeError(f"{where}: dtype must be a floating-point dtype, got {dtype.name}")
    return dtype


@accepts_scaled
def cast_on_forward(x, dtype):
    """Round ``x`` to ``dtype`` in the forward pass; the gradient passes through unchanged.

    Returns an array of ``x``'s dtype holding values representable in ``dtype``.
    """
    dtype = _check_float_dtype(dtype, "cast_on_forward")
    return _cast_fwd_only(x, dtype)


@accepts_scaled
def cast_on_backward(x, dtype):
    """Identity in the forward pass; rounds the incoming gradient to ``dtype``."""
    dtype = _check_float_dtype(dtype, "cast_on_backward")
    return _cast_bwd_only(x, dtype)
