"""Scaled rules for reductions, scans over an axis, and contractions.

Unit scaling: a sum of ``N`` independent unit-RMS terms has RMS ``sqrt(N)``, so
``reduce_sum``, ``cumsum`` and ``dot_general`` divide their data by the power of two of
``sqrt(N)`` (``N`` = reduced elements, or the contraction size ``K``) and multiply it
into the scale. The factor is known at trace time.
"""

from __future__ import annotations

import math

from jax import lax

from .common import (
    is_scaled,
    make_scaled,
    on_unscaled,
    pow2_sqrt_static,
    rescale_data,
    unit_scale,
)
from .registry import register_rule


def _sum_like(data, scale, n: int):
    factor = pow2_sqrt_static(n)
    if factor != 1.0:
        data = rescale_data(data, 1.0 / factor)
    return make_scaled(data, scale * factor)


def scaled_reduce_sum(x, *, axes, **params):
    n = math.prod(x.shape[a] for a in axes)
    return _sum_like(lax.reduce_sum_p.bind(x.data, axes=axes, **params), x.scale, n)


def scaled_cumsum(x, *, axis, **params):
    out = lax.cumsum_p.bind(x.data, axis=axis, **params)
    return _sum_like(out, x.scale, x.shape[axis])


def _on_data(prim):
    """Index-valued reductions: a positive scale does not change the argmax."""

    def rule(x, **params):
        return prim.bind(x.data, **params)

    return rule


def scaled_dot_general(lhs, rhs, *, dimension_numbers, **params):
    (lhs_contract, _), _ = dimension_numbers
    lhs_data = lhs.data if is_scaled(lhs) else lhs
    rhs_data = rhs.data if is_scaled(rhs) else rhs
    k = math.prod(lhs_data.shape[d] for d in lhs_contract)
    out = lax.dot_general_p.bind(lhs_data, rhs_data, dimension_numbers=dimension_numbers, **params)
    scale = (lhs.scale if is_scaled(lhs) else unit_scale()) * (
        rhs.scale if is_scaled(rhs) else unit_scale()
    )
    return _sum_like(out, scale, k)


def scaled_conv_general_dilated(lhs, rhs, *, dimension_numbers, **params):
    lhs_data = lhs.data if is_scaled(lhs) else lhs
    rhs_data = rhs.data if is_scaled(rhs) else rhs
    out_feature_dim = dimension_numbers.rhs_spec[0]
    k = math.prod(rhs_data.shape) // max(rhs_data.shape[out_feature_dim], 1)
    out = lax.conv_general_dilated_p.bind(
        lhs_data, rhs_data, dimension_numbers=dimension_numbers, **params
    )
    scale = (lhs.scale if is_scaled(lhs) else unit_scale()) * (
        rhs.scale if is_scaled(rhs) else unit_scale()
    )
    return _sum_like(out, scale, k)


RULES = {
    "reduce_sum": scaled_reduce_sum,
    "cumsum": scaled_cumsum,
    "argmax": _on_data(lax.argmax_p),
    "argmin": _on_data(lax.argmin_p),
    "reduce_prod": on_unscaled(lax.reduce_prod_p),
    "cumprod": on_unscaled(lax.cumprod_p),
    "cumlogsumexp": on_unscaled(lax.cumlogsumexp_p),
    "dot_general": scaled_dot_general,
    "conv_general_dilated": scaled_conv_general_dilated,
}

for _name, _rule in RULES.items():
    register_rule(_name, _rule)
