"""Scaled rules for linear algebra (Cholesky, triangular solves, QR, SVD, eigen- and LU
decompositions, ...) and the FFT: they run on the unscaled values.

These are rare in training steps (second-order optimisers such as Shampoo, Gaussian
processes, spectral layers) and their outputs mix scales non-trivially (a Cholesky
factor scales with ``sqrt(s)``, an inverse with ``1/s``, eigenvectors not at all), so
each is computed on the represented value, in at least float32, exactly as the plain
function does. Real floating outputs come back as `ScaledArray` at scale 1 (see
`common.fit_to` for FP16/FP8 data); integer and complex outputs (pivots, spectra) as
plain arrays. ``complex`` (a complex number from two real parts) and ``random_gamma`` (a
scaled shape parameter) run on the values too. (``custom_linear_solve``,
``jnp.linalg.solve``, is a higher-order primitive: `rules_control.scaled_on_values` binds
it whole on the unscaled values.)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.lax.linalg as lax_linalg
import jax.numpy as jnp
from jax import lax

from .common import data_of, fit_to, is_scaled, wide_dtype
from .registry import primitive_in, register_rule


def _unscaled(x: Any) -> Any:
    """The value of ``x`` (in at least float32 when real floating)."""
    if not is_scaled(x):
        return x
    if jnp.issubdtype(x.dtype, jnp.floating):
        return x.to_array(wide_dtype(x.dtype))
    return x.to_array()


def _abstract(x: Any) -> Any:
    data = data_of(x)
    return jax.ShapeDtypeStruct(jnp.shape(data), jnp.result_type(data))


def on_values(prim: Any):
    """Rule binding ``prim`` on the unscaled values; outputs in the dtypes the plain
    primitive gives, real floating ones as `ScaledArray`."""

    def rule(*args: Any, **params: Any) -> Any:
        expected = jax.eval_shape(lambda *a: prim.bind(*a, **params), *[_abstract(a) for a in args])
        outs = prim.bind(*[_unscaled(a) for a in args], **params)
        if not prim.multiple_results:
            outs, expected = [outs], [expected]
        result = []
        for out, want in zip(outs, expected, strict=True):
            if jnp.issubdtype(want.dtype, jnp.floating):
                result.append(fit_to(out, want.dtype))
            else:
                result.append(out.astype(want.dtype))
        return result if prim.multiple_results else result[0]

    return rule


_PRIMITIVES = [lax.fft_p] + [
    getattr(lax_linalg, name)
    for name in (
        "cholesky_p",
        "cholesky_update_p",
        "eig_p",
        "eigh_p",
        "hessenberg_p",
        "householder_product_p",
        "lu_p",
        "ormqr_p",
        "qr_p",
        "schur_p",
        "svd_p",
        "symmetric_product_p",
        "triangular_solve_p",
        "tridiagonal_p",
        "tridiagonal_solve_p",
    )
    if hasattr(lax_linalg, name)  # the set changes between JAX releases
]

# Also on the values: complex numbers built from real parts (a complex RoPE), and gamma
# samples whose shape parameter is a scaled value (jax.random.gamma, beta, dirichlet).
_PRIMITIVES.append(lax.complex_p)
_GAMMA = primitive_in(  # traced on shapes only: importing starts no JAX backend
    lambda key, a: jax.random.gamma(key, a),
    jax.ShapeDtypeStruct((2,), jnp.uint32),
    jax.ShapeDtypeStruct((2,), jnp.float32),
    name="random_gamma",
)
if _GAMMA is not None:
    _PRIMITIVES.append(_GAMMA)

for _prim in _PRIMITIVES:
    register_rule(_prim, on_values(_prim))
