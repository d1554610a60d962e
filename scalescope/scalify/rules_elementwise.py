"""Scaled rules for elementwise primitives.

Linear ops move scales exactly (``mul``: scales multiply; ``add``: the output scale is
the power of two of ``sqrt(sA**2 + sB**2)``, the unit-scaling rule for a sum of
independent terms). Non-linear ops (exp, tanh, erf, ...) run on the unscaled value and
return data with scale 1: their outputs have a natural, bounded range.

Every rule re-binds the primitive with the equation's own parameters (``**params``), so
parameters added by later JAX releases pass through.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from ..core.formats import format_bound, narrower_than_float32
from ..core.pow2 import is_static, pow2_reciprocal, pow2_round_down, pow2_sqrt_even
from ..core.scaled_array import SCALE_DTYPE
from .common import (
    align,
    as_scale,
    at_most_max,
    concrete_scalar,
    data_absmax,
    fit_to,
    is_scaled,
    make_scaled,
    on_unscaled,
    positive_or_one,
    pow2_norm_scale,
    product_parts,
    product_scaled,
    renormalized,
    rescale_data,
    split_pow2,
    static_scale,
    unit_scale,
    unscale,
    wide_dtype,
)
from .interpreter import explicit_sharding
from .registry import register_rule


def _pow2_constant(x) -> tuple[float, float] | None:
    """(mantissa, power of two) of a finite non-zero constant known at trace time."""
    value = concrete_scalar(x)
    if value is None or value == 0.0 or not math.isfinite(value):
        return None
    return split_pow2(value)


# -- binary linear ----------------------------------------------------------------------


def _plain_magnitude(c) -> Any:
    """Power of two of a plain scalar operand's magnitude (None for arrays, 0 and ±inf):
    an add of a scaled value and ``eps`` must not express ``eps`` in a scale far below
    it (the data would leave unit range), so it takes part in the output scale."""
    if concrete_scalar(c) is not None:  # 0, inf and NaN known at trace time: no magnitude
        split = _pow2_constant(c)
        return None if split is None else abs(split[1])
    if getattr(c, "size", None) == 1 and jnp.issubdtype(jnp.asarray(c).dtype, jnp.floating):
        p2 = pow2_round_down(jnp.abs(jnp.asarray(c, SCALE_DTYPE)).reshape(()))
        return lax.select(jnp.isfinite(p2), p2, jnp.zeros_like(p2))
    return None


def _is_literal_zero(x) -> bool:
    """``x`` is a scalar zero known at trace time (``x + 0.0`` in optax's ``eps_root``)."""
    value = concrete_scalar(x)
    return value is not None and value == 0.0


def _additive(prim):
    def rule(a, b, **params):
        # x + 0 and x - 0 are x (every element, inf and NaN included): no scale work
        if is_scaled(a) and _is_literal_zero(b):
            return a
        if is_scaled(b) and _is_literal_zero(a):
            return b if prim is lax.add_p else scaled_neg(b)
        if is_scaled(a) and is_scaled(b):
            scale = pow2_norm_scale(a.scale, b.scale)
        else:
            x, c = (a, b) if is_scaled(a) else (b, a)
            mag = _plain_magnitude(c)
            scale = None if mag is None else pow2_norm_scale(x.scale, as_scale(mag))
        (da, db), s = align([a, b], scale=scale)
        return make_scaled(prim.bind(da, db, **params), s)

    return rule


scaled_add = _additive(lax.add_p)
scaled_sub = _additive(lax.sub_p)


def scaled_add_any(a, b, **params):
    return scaled_add(a, b)


def _split_plain(c, dtype, *, at_most_one: bool) -> tuple[Any, Any, Any]:
    """A plain operand of mul/div as (mantissa data or None for 1, power-of-two scale,
    the exact reciprocal of that power of two).

    Constants known at trace time split exactly; a traced scalar (a bias correction
    computed from the step count) splits on the device, so dividing by 0.002 moves 2^-9
    into the scale instead of multiplying FP16 data by 500. Other float arrays split off
    the power of two of their abs-max (one small reduction).
    ``at_most_one``: the mantissa is in (0.5, 1] (multiplying never grows the data: an
    EMA's ``0.9 * mu`` would otherwise grow it 1.8x per step); else in [1, 2) (dividing
    never grows it).
    """
    split = _pow2_constant(c)
    if split is not None:
        mant, p2 = split
        if at_most_one and abs(mant) > 1.0:
            mant, p2 = mant / 2.0, p2 * 2.0
        return (None if mant == 1.0 else jnp.asarray(mant, dtype)), p2, 1.0 / p2
    arr = jnp.asarray(c)
    if not jnp.issubdtype(arr.dtype, jnp.floating):
        return arr.astype(dtype), 1.0, 1.0
    # A plain float array (a broadcast 1/N cotangent seed, a mask): split off the power
    # of two of its RMS, so a backward pass seeded by mean()'s 1/N keeps unit data.
    c32 = arr if arr.dtype == SCALE_DTYPE else lax.convert_element_type(arr, SCALE_DTYPE)
    if arr.size == 1:
        a = lax.abs(c32)
    else:
        finite = lax.select(lax.is_finite(c32), lax.abs(c32), lax.full_like(c32, 0))
        a = lax.reduce_max(finite, tuple(range(c32.ndim)))
    a = a if a.shape == () else a.reshape(())
    p2 = pow2_round_down(a)
    usable = lax.bitwise_and(lax.is_finite(p2), lax.gt(p2, np.float32(0)))
    p2 = lax.select(usable, p2, np.float32(1))
    # float32/bfloat16 data may grow by `_rms_below`'s 2**5; FP16 and FP8 data keep the
    # abs-max split, which never grows them (E4M3 data of 200 times an E4M3 one-hot would
    # pass 448; FP16 data of 5000 at scale 1, 65504)
    if arr.size > 1 and not narrower_than_float32(dtype):
        p2 = lax.mul(p2, _rms_below(c32, p2))
    elif at_most_one:
        p2 = lax.select(lax.gt(a, p2), lax.mul(p2, np.float32(2)), p2)
    # at most 2**126, whose reciprocal is normal (3e38 times data: a mantissa up to 4,
    # not 0 * inf)
    p2 = lax.min(p2, np.float32(2.0**126))
    inverse = pow2_reciprocal(p2)
    mant = (c32 * inverse).astype(dtype)
    if at_most_one and arr.size == 1:
        # a scalar that is 0 at run time (a warmup schedule's learning rate at step 0):
        # the product is the zero mark, scale 0. With the other operand's scale kept,
        # Adam's zero update at step 0 made every parameter take its scale (8x a
        # kernel's) in ``p + u``, and an FP16 forward's data drifted into subnormals.
        # (An array's ``a`` is its finite elements' abs-max: [inf, 0, ...] is no zero.)
        p2 = lax.select(lax.eq(a, np.float32(0)), np.float32(0), p2)
    return mant, p2, inverse


def _rms_below(c32: jax.Array, p2: jax.Array) -> jax.Array:
    """The power of two nearest the RMS of ``c32``'s finite elements over ``p2`` (their
    abs-max's): at most 1, at least `_RMS_FLOOR`. The data multiplied by a plain array
    keeps its RMS (an abs-max split shrank it by the array's crest factor: a LayerNorm's
    ``x - mean`` and ``rsqrt(var)`` made data 8x smaller each time, and an FP16 forward
    then sank into subnormals). The squares are taken in units of 2**32, so XLA reads
    ``c32`` once for this sum and the abs-max together; an array whose squares leave
    that range (all elements under 2**-31, or one over 2**95) keeps the abs-max split."""
    finite = lax.select(lax.is_finite(c32), c32, lax.full_like(c32, 0))
    u = finite * _SQUARE_UNIT
    ms = lax.reduce_sum(u * u, tuple(range(c32.ndim))) * np.float32(1.0 / c32.size)
    # the nearest power of two (in log2), not the one below: a 0/1 mask keeping 75 %
    # (RMS 0.87) then multiplies the data by 1, not 2, and products of many leave the
    # data's RMS where it was on average instead of growing it every time
    rms = lax.mul(pow2_round_down(lax.sqrt(ms) * _SQRT2), np.float32(2.0**32))
    usable = lax.bitwise_and(lax.gt(ms, np.float32(0)), lax.is_finite(ms))
    r = lax.clamp(_RMS_FLOOR, lax.mul(rms, pow2_reciprocal(p2)), np.float32(1))
    return lax.select(usable, r, np.float32(1))


_SQUARE_UNIT = np.float32(2.0**-32)
_SQRT2 = np.float32(math.sqrt(2.0))


#: `_rms_below` never goes below this: an element of a plain array multiplies the data
#: by at most 2**5 (a lone spike among zeros has an RMS far below its abs-max). Gaussian
#: data's abs-max is 4-6 RMS even over 10**8 elements.
_RMS_FLOOR = np.float32(2.0**-4)


def scaled_mul(a, b, **params):
    if is_scaled(a) and is_scaled(b):
        return product_scaled(lax.mul_p.bind(a.data, b.data, **params), a.scale, b.scale)
    x, c = (a, b) if is_scaled(a) else (b, a)
    mant, p2, _ = _split_plain(c, x.dtype, at_most_one=True)
    scale, rest = product_parts(x.scale, p2)
    if mant is None:
        return make_scaled(rescale_data(x.data, rest), scale)
    if np.ndim(mant) == 0 and not is_static(rest):
        # the scale's remainder (exactly 1 unless it left float32's range) joins the
        # scalar the data is multiplied by anyway: one pass over the data, not two
        # (mant itself, bit for bit, where rest is 1)
        mant, rest = rescale_data(mant, rest), unit_scale()
    return make_scaled(rescale_data(lax.mul_p.bind(x.data, mant, **params), rest), scale)


def _split_scale(scale):
    """``scale == mantissa * p2`` with ``p2`` a positive power of two (1 for scale 0),
    at most `SCALE_MAX`, and the mantissa in [1, 2) (up to 4 for a scale of 2^127, whose
    reciprocal would be subnormal): dividing by a scale then needs only the exact
    reciprocal of ``p2`` (see `pow2_reciprocal`), the mantissa going into the data."""
    p2 = at_most_max(positive_or_one(pow2_round_down(scale)))
    return scale * pow2_reciprocal(p2), p2


def _divided(num, den, mant, out_dtype, **params):
    """``num / (den * mant)`` in at least float32, as ``out_dtype`` data and a power of
    two its scale takes on: the divisor's scale mantissa (1 for power-of-two scales)
    joins its data before the divide. FP16/FP8 data is fitted (`fit_to`): a quotient of
    data far from unit (121 / 1.4e-4, a LayerNorm's ``rsqrt(v) / v`` in FP16) would
    overflow the format though the value (0.41) fits it."""
    wide = wide_dtype(out_dtype, den.dtype)
    den = den.astype(wide) if is_static(mant) and float(mant) == 1.0 else den.astype(wide) * mant
    quotient = lax.div_p.bind(num.astype(wide), den, **params)
    if not narrower_than_float32(out_dtype):
        return quotient.astype(out_dtype), unit_scale()
    fitted = fit_to(quotient, out_dtype)
    return fitted.data, fitted.scale


def scaled_div(a, b, **params):
    if is_scaled(b):
        mant, p2 = _split_scale(b.scale)
        if is_scaled(a):
            num, scale = a.data, a.scale
        else:
            split, scale, _ = _split_plain(a, b.dtype, at_most_one=True)
            num = jnp.ones((), b.dtype) if split is None else split
        data, fitted = _divided(jnp.asarray(num), b.data, mant, b.dtype, **params)
        return product_scaled(data, scale, pow2_reciprocal(p2), fitted)
    mant, _, inverse = _split_plain(b, a.dtype, at_most_one=False)
    data = a.data if mant is None else lax.div_p.bind(a.data, mant, **params)
    return product_scaled(data, a.scale, inverse)


def _aligned(prim, *, scaled_out: bool = True):
    """Rule for ops that commute with a common positive scale (max, min, comparisons)."""

    def rule(*args, **params):
        datas, s = align(list(args), fit=scaled_out)
        out = prim.bind(*datas, **params)
        return make_scaled(out, s) if scaled_out else out

    return rule


def _at_format_max(bound: Any) -> bool:
    return format_bound(bound) is not None


def _clipping(prim):
    """max, min and clamp: aligned on a common scale, except a clip at a narrow format's
    largest value (``clip(x / s, -448, 448).astype(float8_e4m3fn)``, the fake
    quantisation of qwix and AQT, MX formats with their own power-of-two scales). Such
    code has scaled the value into the format itself: the result is held at scale 1, so
    the cast that follows casts the value as written, not data that may lie far outside
    the format (with ``x / s`` held as data ~3 500 at scale 1/8, 91 % of an MXFP8
    weight became NaN)."""
    aligned = _aligned(prim)

    def rule(*args, **params):
        if any(_at_format_max(a) for a in args):
            return make_scaled(prim.bind(*map(unscale, args), **params), unit_scale())
        return aligned(*args, **params)

    return rule


scaled_max = _clipping(lax.max_p)
scaled_min = _clipping(lax.min_p)
scaled_clamp = _clipping(lax.clamp_p)
scaled_eq = _aligned(lax.eq_p, scaled_out=False)
scaled_ne = _aligned(lax.ne_p, scaled_out=False)
scaled_lt = _aligned(lax.lt_p, scaled_out=False)
scaled_le = _aligned(lax.le_p, scaled_out=False)
scaled_gt = _aligned(lax.gt_p, scaled_out=False)
scaled_ge = _aligned(lax.ge_p, scaled_out=False)


def scaled_atan2(a, b, **params):
    (da, db), _ = align([a, b])
    return make_scaled(lax.atan2_p.bind(da, db, **params), unit_scale())


def _laid_out_alike(which: Any, datas: list[Any]) -> list[Any]:
    """``datas`` (select's cases) laid out as the sharded one among ``which`` and them,
    on a mesh of explicit axes. A case made from a constant (JAX 0.11's relu derivative
    selects ``broadcast_in_dim 0.0``, typed without a mesh) and rescaled by a scale
    computed from sharded values is typed replicated on the mesh, which select refuses
    beside a sharded case (plain JAX's constant has no mesh in its type and passes)."""
    sharded = [
        (x, sh)
        for x in (which, *datas)
        if (sh := explicit_sharding(x)) is not None and any(a is not None for a in sh.spec)
    ]
    if not sharded:
        return datas
    like, target = sharded[0]
    return [
        jax.sharding.reshard(d, target)
        if (sh := explicit_sharding(d)) is not None
        and sh.spec != target.spec
        and np.shape(d) == np.shape(like)
        else d
        for d in datas
    ]


def scaled_select_n(which, *cases, **params):
    datas, s = align(list(cases))
    which = unscale(which)
    return make_scaled(lax.select_n_p.bind(which, *_laid_out_alike(which, datas), **params), s)


# -- unary, exact on the data ------------------------------------------------------------


def _scale_preserving(prim):
    def rule(x, **params):
        return make_scaled(prim.bind(x.data, **params), x.scale)

    return rule


scaled_neg = _scale_preserving(lax.neg_p)
scaled_abs = _scale_preserving(lax.abs_p)


def scaled_sign(x, **params):
    # sign(data * scale): NaN where the scale is NaN (a positive scale changes nothing)
    sign = lax.sign_p.bind(x.data, **params)
    return make_scaled(sign, np.sign(x.scale) if is_static(x.scale) else lax.sign(x.scale))


def scaled_is_finite(x, **params):
    # the value is data * scale: a NaN or infinite scale makes every element non-finite
    finite = lax.is_finite_p.bind(x.data, **params)
    if is_static(x.scale):
        return finite if np.isfinite(x.scale) else jnp.zeros_like(finite)
    return lax.bitwise_and(finite, lax.is_finite(x.scale))


# A power y multiplies the data's distance from unit (in octaves) by y: data that has
# drifted beyond 2^±SQUARE_BAND (a gradient through a LayerNorm backward can reach 2^-56
# while its value is 0.1) is first brought back to unit abs-max, or its square would
# leave float32's range while the value's square is fine.
SQUARE_BAND = 16


def _power_band(dtype, y: int) -> int:
    """How far (in octaves) data may be from unit before its ``y``-th power leaves its
    dtype's normal range: `SQUARE_BAND` for float32 and BF16; for FP16, 6 for a square, 4
    for a cube (``jax.nn.gelu``'s ``x**3``: FP16 data of 50 cubes past 65504), 1 for a
    sixth power."""
    info = ml_dtypes.finfo(dtype)
    # data with exponent e <= band is below 2^(band + 1), and at least 2^-band
    above = math.floor(math.log2(float(info.max)) / y) - 1
    below = math.floor(-math.log2(float(info.smallest_normal)) / y)
    return max(0, min(SQUARE_BAND, above, below))


def _before_power(x, y: int = 2):
    """``x`` ready to be raised to the power ``y``: data beyond `_power_band` brought
    back to unit abs-max (the value unchanged)."""
    if np.dtype(x.dtype).itemsize == 1:  # FP8 data is the user's representation
        return x
    return renormalized(x, data_absmax(x.data), _power_band(x.dtype, y))


def scaled_square(x, **params):
    x = _before_power(x)
    return product_scaled(lax.square_p.bind(x.data, **params), x.scale, x.scale)


def scaled_integer_pow(x, *, y, **params):
    if y < 0:
        # 1 / x**|y| by the division's rule: the reciprocal of a zero (scale 0, the
        # exact-zero mark) is inf, as lax.integer_pow gives, not inf * 0
        return scaled_div(jnp.ones((), x.dtype), scaled_integer_pow(x, y=-y, **params))
    if y >= 2:
        x = _before_power(x, y)
    data = lax.integer_pow_p.bind(x.data, y=y, **params)
    if y == 0:
        return make_scaled(data, unit_scale())
    return product_scaled(data, x.scale, *(x.scale,) * (y - 1))


def _even_pow2_split(scale):
    """``scale == rest * s2`` with ``s2`` an even power of two and ``rest`` in [1, 4), so
    ``sqrt(s2)`` is an exact power of two. Reads the exponent bits of the float32 scale."""
    if is_static(scale):
        down = float(pow2_round_down(scale))
        if down > 0 and math.isfinite(down) and math.frexp(down)[1] % 2 == 0:
            down /= 2.0  # frexp(2^k) = (0.5, k + 1): k odd
        rest = float(scale) * float(pow2_reciprocal(positive_or_one(down)))
        return static_scale(rest), static_scale(down)
    down = pow2_round_down(scale)
    biased = lax.shift_right_logical(lax.bitcast_convert_type(down, jnp.int32), jnp.int32(23))
    odd = lax.ne(lax.bitwise_and(biased - jnp.int32(127), jnp.int32(1)), jnp.int32(0))
    s2 = lax.select(odd, down * 0.5, down)
    return scale * pow2_reciprocal(positive_or_one(s2)), s2


def scaled_sqrt(x, **params):
    rest, s2 = _even_pow2_split(x.scale)
    return make_scaled(lax.sqrt_p.bind(rescale_data(x.data, rest), **params), pow2_sqrt_even(s2))


def scaled_rsqrt(x, **params):
    rest, s2 = _even_pow2_split(x.scale)
    root = pow2_sqrt_even(s2)
    # 1/sqrt(0) is inf, as lax.rsqrt gives
    inverse = lax.select(root > 0, pow2_reciprocal(root), jnp.full_like(root, np.inf))
    return make_scaled(lax.rsqrt_p.bind(rescale_data(x.data, rest), **params), inverse)


# -- non-linear: computed on the unscaled value --------------------------------------------


_NON_LINEAR = (
    "exp exp2 log log1p expm1 tanh logistic sin cos tan asin acos atan sinh cosh asinh "
    "acosh atanh erf erfc erf_inv lgamma digamma floor ceil round cbrt pow rem nextafter "
    "bessel_i0e bessel_i1e igamma igammac igamma_grad_a polygamma zeta "
    "regularized_incomplete_beta"
).split()
# ``lax.reduce_precision`` rounds the value to a format inside a wider dtype: how a
# program emulates FP8/FP16 (fake quantisation, which scales its values itself:
# ``reduce_precision(x / s, 4, 3) * s``). It is computed on the value, as plain JAX does;
# rounding the data instead flushed 68 % of such a tensor to zero (its data held
# ``x / s`` at abs-max 1.9, not the 240 the code scaled it to). A cast to an FP8/FP16
# dtype (``astype``, ``ss.ops.cast_on_forward``) is the one that rounds the unit-scaled
# data (`rules_shape.scaled_convert_element_type`).
_NON_LINEAR.append("reduce_precision")

RULES = {
    "add": scaled_add,
    "add_any": scaled_add_any,
    "sub": scaled_sub,
    "mul": scaled_mul,
    "div": scaled_div,
    "max": scaled_max,
    "min": scaled_min,
    "clamp": scaled_clamp,
    "eq": scaled_eq,
    "ne": scaled_ne,
    "lt": scaled_lt,
    "le": scaled_le,
    "gt": scaled_gt,
    "ge": scaled_ge,
    "atan2": scaled_atan2,
    "select_n": scaled_select_n,
    "neg": scaled_neg,
    "abs": scaled_abs,
    "sign": scaled_sign,
    "is_finite": scaled_is_finite,
    "square": scaled_square,
    "integer_pow": scaled_integer_pow,
    "sqrt": scaled_sqrt,
    "rsqrt": scaled_rsqrt,
}
# Non-linear primitives of newer JAX releases (JAX 0.11: ``log2``, what ``jnp.log2`` binds,
# and ``one_minus_square``, 1 - x**2 in the derivatives of tanh, asin, acos and atanh).
_NON_LINEAR += [name for name in ("log2", "one_minus_square") if hasattr(lax, f"{name}_p")]
RULES.update({name: on_unscaled(getattr(lax, f"{name}_p")) for name in _NON_LINEAR})
# Total-order comparisons (``jnp.searchsorted``, ``jnp.interp``): a positive power-of-two
# scale keeps the order, signed zeros and NaNs included. (The set changes between JAX
# releases.)
RULES.update(
    {
        name: _aligned(getattr(lax, f"{name}_p"), scaled_out=False)
        for name in ("eq_to", "lt_to", "le_to")
        if hasattr(lax, f"{name}_p")
    }
)

for _name, _rule in RULES.items():
    register_rule(_name, _rule)
