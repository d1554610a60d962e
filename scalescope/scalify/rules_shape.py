"""Scaled rules for data movement, indexing and dtype conversion.

Moving or selecting elements does not change their magnitude, so these rules apply the
primitive to the data and keep the scale. Ops that combine several floating operands
(concatenate, pad, dynamic_update_slice, scatter) first express them in one common scale.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from .common import align, data_of, is_scaled, make_scaled, recentred_scalar, unscale
from .registry import primitive_in, register_rule


def _keeps_scale(prim):
    """Rule for ops whose first operand is the scaled tensor and the rest are indices."""

    def rule(x, *rest, **params):
        out = prim.bind(x.data, *[unscale(r) for r in rest], **params)
        if prim.multiple_results:
            return [make_scaled(o, x.scale) for o in out]
        return make_scaled(out, x.scale)

    return rule


def _joins(prim):
    """Rule for ops that join several tensors (concatenate, stack): one common scale."""

    def rule(*operands, **params):
        datas, s = align(list(operands))
        return make_scaled(prim.bind(*datas, **params), s)

    return rule


def scaled_pad(operand, padding_value, **params):
    (d, pv), s = align([operand, padding_value])
    return make_scaled(lax.pad_p.bind(d, pv, **params), s)


def scaled_dynamic_update_slice(operand, update, *indices, **params):
    (d, u), s = align([operand, update])
    out = lax.dynamic_update_slice_p.bind(d, u, *[unscale(i) for i in indices], **params)
    return make_scaled(out, s)


def _scatter(prim):
    def rule(operand, indices, updates, **params):
        (d, u), s = align([operand, updates])
        return make_scaled(prim.bind(d, unscale(indices), u, **params), s)

    return rule


def scaled_scatter_mul(operand, indices, updates, **params):
    # Multiplying by (unscaled) factors keeps the operand's scale.
    if not is_scaled(operand):
        operand = make_scaled(operand, 1.0)
    out = lax.scatter_mul_p.bind(operand.data, unscale(indices), unscale(updates), **params)
    return make_scaled(out, operand.scale)


def scaled_convert_element_type(x, *, new_dtype, **params):
    if jnp.issubdtype(new_dtype, jnp.floating):
        # FP8/FP16 casts are real casts of the data: that is what scaling is for. A
        # scalar's data is re-centred first (scalar work), so it fits any format.
        x = recentred_scalar(x)
        out = lax.convert_element_type_p.bind(x.data, new_dtype=new_dtype, **params)
        return make_scaled(out, x.scale)
    return lax.convert_element_type_p.bind(unscale(x), new_dtype=new_dtype, **params)


def scaled_bitcast_convert_type(x, **params):
    return lax.bitcast_convert_type_p.bind(unscale(x), **params)


def scaled_extended_cast(prim, x, **params):
    """A cast into or out of an extended dtype (``to_edtype`` / ``from_edtype``: Flax's
    ``fm32`` for FP8 meta, a float32 whose gradients combine by max). Such a value carries
    no scale: the cast reads the value."""
    return prim.bind(unscale(x), **params)


def scaled_stop_gradient(x, **params):
    return make_scaled(lax.stop_gradient(x.data), lax.stop_gradient(x.scale))


def scaled_sort(*operands, **params):
    # Sorting by a positive scale keeps the order; scaled operands keep their scale.
    datas = [data_of(o) for o in operands]
    outs = lax.sort_p.bind(*datas, **params)
    return [make_scaled(d, o.scale) if is_scaled(o) else d for d, o in zip(outs, operands)]


def _top_k(prim):
    """top_k and approx_top_k: a positive scale keeps the order; values keep the scale."""

    def rule(x, *rest, **params):
        values, indices = prim.bind(x.data, *[unscale(r) for r in rest], **params)
        return [make_scaled(values, x.scale), indices]

    return rule


def scaled_device_put(*xs, **params):
    """``jax.device_put`` inside a traced function: the data moves, each scale stays."""
    outs = lax.device_put_p.bind(*[data_of(x) for x in xs], **params)
    return [make_scaled(o, x.scale) if is_scaled(x) else o for o, x in zip(outs, xs)]


def scaled_optimization_barrier(*operands, **params):
    flat = []
    for o in operands:
        flat.extend([o.data, o.scale] if is_scaled(o) else [o])
    outs = list(lax.optimization_barrier_p.bind(*flat, **params))
    result = []
    for o in operands:
        if is_scaled(o):
            result.append(make_scaled(outs.pop(0), outs.pop(0)))
        else:
            result.append(outs.pop(0))
    return result


def scaled_broadcast_in_dim(x, *rest, **params):
    """A scalar broadcast into an array is re-centred first (`recentred_scalar`): every
    element of the array would hold its data."""
    x = recentred_scalar(x)
    return make_scaled(lax.broadcast_in_dim_p.bind(x.data, *map(unscale, rest), **params), x.scale)


def scaled_iota(**params):
    """iota has no inputs, so it is never scaled; listed so coverage checks see a rule."""
    return lax.iota_p.bind(**params)


_KEEPS_SCALE = (
    "reshape transpose squeeze expand_dims slice rev copy "
    "dynamic_slice gather split tile sharding_constraint real "
    "reduce_max reduce_min cummax cummin unstack reduce_window_max reduce_window_min"
).split()

RULES = {
    "concatenate": _joins(lax.concatenate_p),
    "stack": _joins(lax.stack_p),
    "pad": scaled_pad,
    "dynamic_update_slice": scaled_dynamic_update_slice,
    "scatter-add": _scatter(lax.scatter_add_p),
    "scatter-sub": _scatter(lax.scatter_sub_p),
    "scatter": _scatter(lax.scatter_p),
    "scatter-max": _scatter(lax.scatter_max_p),
    "scatter-min": _scatter(lax.scatter_min_p),
    "scatter-mul": scaled_scatter_mul,
    "convert_element_type": scaled_convert_element_type,
    "bitcast_convert_type": scaled_bitcast_convert_type,
    "stop_gradient": scaled_stop_gradient,
    "sort": scaled_sort,
    "top_k": _top_k(lax.top_k_p),
    "approx_top_k": _top_k(lax.approx_top_k_p),
    "device_put": scaled_device_put,
    "optimization_barrier": scaled_optimization_barrier,
    "iota": scaled_iota,
    "broadcast_in_dim": scaled_broadcast_in_dim,
}
for _name in _KEEPS_SCALE:
    _prim = getattr(lax, f"{_name}_p", None)
    if _prim is not None:
        RULES[_name] = _keeps_scale(_prim)
# jax.ad_checkpoint.checkpoint_name tags a value for remat policies: the value unchanged
_NAME = primitive_in(
    lambda x: checkpoint_name(x, "a"), jax.ShapeDtypeStruct((2,), jnp.float32), name="name"
)
if _NAME is not None:
    RULES["name"] = _keeps_scale(_NAME)

for _name, _rule in RULES.items():
    register_rule(_name, _rule)
for _name in ("to_edtype", "from_edtype"):
    register_rule(_name, scaled_extended_cast, with_primitive=True)
