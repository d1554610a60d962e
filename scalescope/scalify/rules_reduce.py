"""Scaled rules for reductions, windowed reductions (pooling), scans over an axis, and
contractions.

Unit scaling: a sum of ``N`` independent unit-RMS terms has RMS ``sqrt(N)``, so
``reduce_sum``, ``reduce_window_sum``, ``cumsum`` and ``dot_general`` divide their data by
the power of two of ``sqrt(N)`` (``N`` = reduced elements, the window size, or the
contraction size ``K``) and multiply it into the scale. The factor is known at trace time.
Max pooling's derivatives (``select_and_scatter_add``, ``select_and_gather_add``) pick an
element per window by comparing the operand, which a positive scale does not reorder.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from ..core.pow2 import is_static
from .common import (
    data_absmax,
    data_of,
    is_scaled,
    make_scaled,
    on_unscaled,
    pow2_sqrt_static,
    product_scaled,
    renormalized,
    unit_scale,
    unscale,
)
from .registry import register_rule
from .rules_elementwise import _before_power


def _sum_like(data, n: int, *scales):
    """A sum of ``n`` terms: the power of two of sqrt(n) moves from the data into the
    scale (the product of ``scales``), which is kept in range (`product_scaled`)."""
    factor = pow2_sqrt_static(n)
    return product_scaled(data, *scales, factor, data_factor=1.0 / factor)


def _narrow_band(dtype) -> int | None:
    """For floating data narrower than float32, how far (in powers of two) a sum's
    abs-max may stray from 1 before it is renormalised: the format's max stays out of
    reach (2^7 for E4M3, 2^8 otherwise). None for float32 and wider, and non-floats."""
    dtype = np.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize >= 4:
        return None
    return min(8, int(math.floor(math.log2(float(ml_dtypes.finfo(dtype).max)))) - 1)


def _narrow_safe_sum(x, bind, n: int):
    """``bind`` (a sum over ``n`` terms) on ``x``'s data, scaled as `_sum_like`. Narrow
    floating data is summed in float32 and renormalised on the result's abs-max before
    it is narrowed again: terms of one sign (a bias gradient, a mean) add up like ``n``,
    not ``sqrt(n)``, and would overflow FP16 on the way or at the end."""
    band = _narrow_band(x.data.dtype)
    if band is None:
        return _sum_like(bind(x.data), n, x.scale)
    wide = _sum_like(bind(x.data.astype(np.float32)), n, x.scale)
    wide = renormalized(wide, data_absmax(wide.data), band)
    return make_scaled(wide.data.astype(x.data.dtype), wide.scale)


def scaled_reduce_sum(x, *, axes, **params):
    n = math.prod(x.shape[a] for a in axes)
    return _narrow_safe_sum(x, lambda d: lax.reduce_sum_p.bind(d, axes=axes, **params), n)


def scaled_cumsum(x, *, axis, **params):
    return _narrow_safe_sum(x, lambda d: lax.cumsum_p.bind(d, axis=axis, **params), x.shape[axis])


def scaled_reduce_window_sum(x, *, window_dimensions, **params):
    n = math.prod(window_dimensions)
    return _narrow_safe_sum(
        x,
        lambda d: lax.reduce_window_sum_p.bind(d, window_dimensions=window_dimensions, **params),
        n,
    )


def _ordering_data(x):
    """Data whose order within a window is that of ``x``'s values: the data itself for a
    positive (or zero: all-zero data) scale; NaN where the scale is NaN, as the values are."""
    if not is_scaled(x):
        return x
    if is_static(x.scale):
        return jnp.full_like(x.data, np.nan) if np.isnan(x.scale) else x.data
    return lax.select(
        lax.ne(x.scale, x.scale),
        lax.full_like(x.data, np.nan),
        x.data,
    )


def _selects_by_operand(prim):
    """Max/min pooling's derivatives: ``prim(values, operand)`` moves each window's value
    to (or takes it from) the position the operand's comparison selects. The output has
    the values' scale; the operand only decides positions."""

    def rule(values, operand, **params):
        data = data_of(values)
        out = prim.bind(data, _ordering_data(operand), **params)
        return make_scaled(out, values.scale) if is_scaled(values) else out

    return rule


def _on_data(prim):
    """Index-valued reductions: a positive scale does not change the argmax; a NaN scale
    makes every value NaN, whose argmax/argmin is the first index."""

    def rule(x, **params):
        out = prim.bind(x.data, **params)
        if is_static(x.scale):
            return lax.full_like(out, 0) if np.isnan(x.scale) else out
        return lax.select(lax.ne(x.scale, x.scale), lax.full_like(out, 0), out)

    return rule


def _scales(lhs, rhs):
    """The operands' scales, 1 for a plain operand."""
    return (lhs.scale if is_scaled(lhs) else unit_scale()), (
        rhs.scale if is_scaled(rhs) else unit_scale()
    )


def _same_value(lhs, rhs) -> bool:
    """Both operands carry the very same scale object: one value, or views of it that
    passed its scale through (``x @ x.T``, ``a @ a``). Distinct rule outputs get distinct
    scales, so unrelated operands never match (slices of one tensor, such as a fused
    q/k projection split in two, do: re-centring them only costs a reduction)."""
    return is_scaled(lhs) and is_scaled(rhs) and lhs.scale is rhs.scale


def _short_range(dtype) -> bool:
    """Floating dtypes whose largest value a sum of in-range terms can pass: FP16 and
    the 8- and 4-bit floats (not BF16, which has float32's exponent range)."""
    dtype = np.dtype(dtype)
    return bool(jnp.issubdtype(dtype, jnp.floating)) and float(ml_dtypes.finfo(dtype).max) < 2.0**32


def _out_dtype(lhs_data, rhs_data, params: dict):
    """The dtype a contraction returns: its ``preferred_element_type``, else its operands'
    shared dtype (None when they differ: the primitive decides, and is left to)."""
    preferred = params.get("preferred_element_type")
    if preferred is not None:
        return np.dtype(preferred)
    return np.dtype(lhs_data.dtype) if lhs_data.dtype == rhs_data.dtype else None


def _contraction(bind, lhs_data, rhs_data, params: dict, k: int, *scales):
    """A contraction of ``k`` terms per output (``bind(**params)``), scaled as
    `_sum_like`. Into FP16 or an 8-bit float the sum is returned in float32, divided by
    pow2(sqrt(k)) and only then narrowed: terms that each fit the format can add up past
    its max before the division brings them back (``ones(512) @ ones(512)`` in E4M3 is
    512, beyond 448; divided, 32). The division is static: data far from unit (which
    scalify's other rules avoid) can still leave the format."""
    out_dtype = _out_dtype(lhs_data, rhs_data, params)
    if out_dtype is None or not _short_range(out_dtype):
        return _sum_like(bind(**params), k, *scales)
    wide = _sum_like(bind(**{**params, "preferred_element_type": np.dtype(np.float32)}), k, *scales)
    return make_scaled(wide.data.astype(out_dtype), wide.scale)


def scaled_dot_general(lhs, rhs, *, dimension_numbers, **params):
    if _same_value(lhs, rhs):
        # a product of a value with itself is a power: it multiplies the data's distance
        # from unit, and iterated (a Gram matrix, Muon's Newton-Schulz steps) the distance
        # grows geometrically; far data is brought back to unit first, as `square` does
        same = lhs is rhs
        lhs = _before_power(lhs)
        rhs = lhs if same else _before_power(rhs)
    (lhs_contract, _), _ = dimension_numbers
    lhs_data = data_of(lhs)
    rhs_data = data_of(rhs)
    k = math.prod(lhs_data.shape[d] for d in lhs_contract)
    return _contraction(
        lambda **p: lax.dot_general_p.bind(
            lhs_data, rhs_data, dimension_numbers=dimension_numbers, **p
        ),
        lhs_data,
        rhs_data,
        params,
        k,
        *_scales(lhs, rhs),
    )


def scaled_ragged_dot_general(lhs, rhs, group_sizes, *, ragged_dot_dimension_numbers, **params):
    """`lax.ragged_dot` (grouped matmuls of mixture-of-experts layers) and its
    transposes: a `dot_general` per group. Where the ragged dimension is contracted (the
    gradient of the experts' weights), each group sums its own rows: about ``K / groups``
    terms each."""
    dims = ragged_dot_dimension_numbers
    (lhs_contract, _), _ = dims.dot_dimension_numbers
    lhs_data = data_of(lhs)
    rhs_data = data_of(rhs)
    k = math.prod(lhs_data.shape[d] for d in lhs_contract)
    if set(dims.lhs_ragged_dimensions) & set(lhs_contract):
        k = max(1, k // max(1, group_sizes.shape[0]))
    sizes = unscale(group_sizes)
    return _contraction(
        lambda **p: lax.ragged_dot_general(lhs_data, rhs_data, sizes, dims, **p),
        lhs_data,
        rhs_data,
        params,
        k,
        *_scales(lhs, rhs),
    )


def scaled_conv_general_dilated(lhs, rhs, *, dimension_numbers, **params):
    lhs_data = data_of(lhs)
    rhs_data = data_of(rhs)
    out_feature_dim = dimension_numbers.rhs_spec[0]
    k = math.prod(rhs_data.shape) // max(rhs_data.shape[out_feature_dim], 1)
    return _contraction(
        lambda **p: lax.conv_general_dilated_p.bind(
            lhs_data, rhs_data, dimension_numbers=dimension_numbers, **p
        ),
        lhs_data,
        rhs_data,
        params,
        k,
        *_scales(lhs, rhs),
    )


RULES = {
    "reduce_sum": scaled_reduce_sum,
    "reduce_window_sum": scaled_reduce_window_sum,
    "select_and_scatter_add": _selects_by_operand(lax.select_and_scatter_add_p),
    "select_and_gather_add": _selects_by_operand(lax.select_and_gather_add_p),
    "cumsum": scaled_cumsum,
    "argmax": _on_data(lax.argmax_p),
    "argmin": _on_data(lax.argmin_p),
    "reduce_prod": on_unscaled(lax.reduce_prod_p),
    "cumprod": on_unscaled(lax.cumprod_p),
    "cumlogsumexp": on_unscaled(lax.cumlogsumexp_p),
    "dot_general": scaled_dot_general,
    "ragged_dot_general": scaled_ragged_dot_general,
    "conv_general_dilated": scaled_conv_general_dilated,
}

for _name, _rule in RULES.items():
    register_rule(_name, _rule)
