"""Operations on the scale itself: dynamic rescaling, setting and dropping the scale.

Each is a small JAX primitive that is the identity on plain values (so a model keeps
working outside `scalify`) and has a scaled rule that moves magnitude between data and
scale. ``dynamic_rescale_*`` re-centres data at unit norm when static scale propagation
has lost track of it, which is the fix the advisor suggests.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from ..core.scaled_array import SCALE_DTYPE, ScaledArray
from ..scalify.common import make_scaled, rescale_data, unit_scale, unscale
from ..scalify.registry import register_rule
from .dispatch import accepts_scaled

NORMS = ("l1", "l2", "max")


def _identity_primitive(name: str) -> Primitive:
    """A primitive that is the identity on its first operand for every transformation."""
    prim = Primitive(name)
    prim.def_impl(lambda x, *rest, **params: x)
    prim.def_abstract_eval(lambda x, *rest, **params: x)
    mlir.register_lowering(prim, lambda ctx, x, *rest, **params: [x])

    def jvp(primals, tangents, **params):
        return prim.bind(*primals, **params), tangents[0]

    def batch(args, dims, **params):
        if any(d is not None for d in dims[1:]):  # None: not batched
            raise ValueError(f"{name}: the scale argument cannot be batched")
        return prim.bind(*args, **params), dims[0]

    ad.primitive_jvps[prim] = jvp
    batching.primitive_batchers[prim] = batch
    return prim


dynamic_rescale_p = _identity_primitive("dynamic_rescale")
set_scaling_p = _identity_primitive("set_scaling")
stop_scaling_p = _identity_primitive("stop_scaling")


def _check_float(x, where: str):
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        raise TypeError(f"{where}: expected a floating-point array, got {type(x).__name__}")
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{where}: expected a floating-point array, got {dtype}")


def _is_leaf(x) -> bool:
    return isinstance(x, ScaledArray) or hasattr(x, "dtype")


def _on_floats(x, op, where: str):
    """``op`` on an array, or on every floating-point leaf of a pytree (a model's whole
    state: ``state = dynamic_rescale_l2(state)``), other leaves (an optimizer's integer
    step count) as they are. A lone array that is not floating point is a `TypeError`."""
    if _is_leaf(x) or not any(map(_is_leaf, jax.tree_util.tree_leaves(x, is_leaf=_is_leaf))):
        _check_float(x, where)
        return op(x)

    def leaf(v):
        return op(v) if _is_leaf(v) and jnp.issubdtype(v.dtype, jnp.floating) else v

    return jax.tree_util.tree_map(leaf, x, is_leaf=_is_leaf)


def _dynamic_rescale(x, norm: str):
    return _on_floats(x, lambda v: dynamic_rescale_p.bind(v, norm=norm), f"dynamic_rescale_{norm}")


@accepts_scaled
def dynamic_rescale_l1(x):
    """Move the mean absolute value of the data into the scale (identity on values).
    ``x``: an array or a pytree (each floating-point leaf rescaled on its own)."""
    return _dynamic_rescale(x, "l1")


@accepts_scaled
def dynamic_rescale_l2(x):
    """Move the RMS of the data into the scale, so the data has unit RMS again.
    ``x``: an array or a pytree (each floating-point leaf rescaled on its own)."""
    return _dynamic_rescale(x, "l2")


@accepts_scaled
def dynamic_rescale_max(x):
    """Move the abs-max of the data into the scale, so the data fits in [-1, 1].
    ``x``: an array or a pytree (each floating-point leaf rescaled on its own)."""
    return _dynamic_rescale(x, "max")


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _rescale_grad(x, norm):
    return x


def _rescale_grad_fwd(x, norm):
    return x, None


def _rescale_grad_bwd(norm, _, ct):
    return (dynamic_rescale_p.bind(ct, norm=norm),)


_rescale_grad.defvjp(_rescale_grad_fwd, _rescale_grad_bwd)


@accepts_scaled
def dynamic_rescale_l1_grad(x):
    """Identity forward; dynamic L1 rescaling of the gradient in the backward pass."""
    return _on_floats(x, lambda v: _rescale_grad(v, "l1"), "dynamic_rescale_l1_grad")


@accepts_scaled
def dynamic_rescale_l2_grad(x):
    """Identity forward; dynamic RMS rescaling of the gradient in the backward pass."""
    return _on_floats(x, lambda v: _rescale_grad(v, "l2"), "dynamic_rescale_l2_grad")


@accepts_scaled
def dynamic_rescale_max_grad(x):
    """Identity forward; dynamic abs-max rescaling of the gradient in the backward pass."""
    return _on_floats(x, lambda v: _rescale_grad(v, "max"), "dynamic_rescale_max_grad")


@accepts_scaled
def set_scaling(x, scale):
    """Re-express ``x`` with the given ``scale`` (identity on values). Scale 0, the
    mark of an exactly-zero tensor, gives zeros."""
    _check_float(x, "set_scaling")
    return set_scaling_p.bind(x, jnp.asarray(scale, SCALE_DTYPE))


@accepts_scaled
def stop_scaling(x, dtype=None):
    """Turn a scaled value back into a plain array inside `scalify` (identity outside),
    converted to ``dtype`` when given."""
    _check_float(x, "stop_scaling")
    out = stop_scaling_p.bind(x)
    return out if dtype is None else out.astype(dtype)


# -- scaled rules -----------------------------------------------------------------------


def _norm(data, norm: str):
    """The norm of the data: the mean square for ``l2`` (its root is taken on the
    exponent bits, see `_pow2_of`), else the mean or largest absolute value."""
    d = data.astype(jnp.promote_types(data.dtype, SCALE_DTYPE))
    if norm == "l1":
        return jnp.mean(jnp.abs(d))
    if norm == "l2":
        return jnp.mean(d * d)
    return jnp.max(jnp.abs(d))


def _pow2_of(n, *, root: bool):
    """``(2^k, 2^-k, usable)`` for the power of two 2^k at or below ``n`` (or below
    ``sqrt(n)`` when ``root``), by integer work on the float32 exponent field: no
    sqrt or divide, which XLA would give scalar kernels of their own. ``usable`` is
    false for an infinite or NaN norm (the value is then left as it is)."""
    bits = lax.bitcast_convert_type(jnp.asarray(n, SCALE_DTYPE), jnp.int32)
    biased = lax.shift_right_logical(bits, jnp.int32(23))  # n >= 0: no sign bit
    usable = lax.lt(biased, jnp.int32(255))
    k = biased - jnp.int32(127)
    if root:
        k = lax.shift_right_arithmetic(k, jnp.int32(1))  # floor(k / 2)
    k = lax.clamp(jnp.int32(-126), k, jnp.int32(126))
    p2 = lax.bitcast_convert_type(lax.shift_left(k + 127, jnp.int32(23)), SCALE_DTYPE)
    inv = lax.bitcast_convert_type(lax.shift_left(127 - k, jnp.int32(23)), SCALE_DTYPE)
    return p2, inv, usable


def scaled_dynamic_rescale(x, *, norm: str):
    if not isinstance(x, ScaledArray):
        x = make_scaled(x, unit_scale())
    n = _norm(x.data, norm)
    p2, inv, usable = _pow2_of(n, root=norm == "l2")
    one = jnp.ones((), SCALE_DTYPE)
    factor, inverse = lax.select(usable, p2, one), lax.select(usable, inv, one)
    # All-zero data gets scale 0 (exactly zero), so a stale huge or tiny scale does not
    # reach later sums: adding eps to it would underflow eps and turn 0/(0+eps) into 0/0.
    scale = lax.select(lax.eq(n, jnp.zeros_like(n)), jnp.zeros((), SCALE_DTYPE), x.scale * factor)
    return make_scaled(rescale_data(x.data, inverse), scale)


def scaled_set_scaling(x, scale):
    scale = jnp.asarray(unscale(scale), SCALE_DTYPE)
    data, old = (x.data, x.scale) if isinstance(x, ScaledArray) else (x, unit_scale())
    # scale 0 marks an exactly-zero tensor: the data becomes 0, never x / 0
    zero = lax.eq(scale, jnp.zeros((), SCALE_DTYPE))
    factor = jnp.where(zero, 0.0, old / jnp.where(zero, 1.0, scale)).astype(SCALE_DTYPE)
    return make_scaled(rescale_data(data, factor), scale)


def scaled_stop_scaling(x):
    return unscale(x)


register_rule(dynamic_rescale_p, scaled_dynamic_rescale, on_plain=True)
register_rule(set_scaling_p, scaled_set_scaling, on_plain=True)
register_rule(stop_scaling_p, scaled_stop_scaling)
