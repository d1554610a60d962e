"""Helpers shared by the scaled rules: lifting plain values, aligning scales, unscaling.

Rules see two kinds of inputs: `ScaledArray` and plain values (tracers, or literals of
the jaxpr such as ``0.0`` or ``-inf``). Plain literals are never given a scale of their
own: a literal next to a scaled operand is expressed in that operand's scale, so ``0``
and ``±inf`` stay exact and never poison a scale.

A scale known at trace time (the scale 1 of a non-linear op's output, and whatever is
computed from such scales and constants alone) is kept as a NumPy float32 scalar: its
arithmetic is done here in NumPy and emits no operation into the compiled step. Traced
scales take the ``lax`` path; every helper accepts both.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core.formats import narrower_than_float32
from ..core.pow2 import (
    as_f32,
    is_static,
    literal_like,
    pow2_reciprocal,
    pow2_round_down,
    static_pow2_round_down,
)
from ..core.scaled_array import SCALE_DTYPE, ScaledArray, wide_float


def is_scaled(x: Any) -> bool:
    return isinstance(x, ScaledArray)


def data_of(x: Any) -> Any:
    """The data of a `ScaledArray`, or ``x`` itself when it is plain."""
    return x.data if is_scaled(x) else x


def static_scale(value: Any) -> np.ndarray:
    """A scale known at trace time: a NumPy float32 scalar."""
    return np.asarray(value, np.float32)


def as_scale(scale: Any) -> Any:
    """``scale`` as a float32 scalar: NumPy when known at trace time, else a JAX value
    (returned as it is when it already is one, so a passed-through scale keeps its
    identity)."""
    if is_static(scale):
        return static_scale(scale)
    return as_f32(scale)


def make_scaled(data: Any, scale: Any) -> ScaledArray:
    """A `ScaledArray` with a float32 scalar scale (NumPy when static, see `as_scale`)."""
    return ScaledArray.trusted(data, as_scale(scale))


def unit_scale() -> np.ndarray:
    return static_scale(1.0)


def positive_or_one(scale: Any) -> Any:
    """``scale`` where positive, else 1 (scale 0 marks an exactly-zero tensor)."""
    if is_static(scale):
        return static_scale(scale if scale > 0 else 1.0)
    return lax.select(lax.gt(scale, literal_like(scale, 0.0)), scale, literal_like(scale, 1.0))


def concrete_scalar(x: Any) -> float | None:
    """The value of ``x`` if it is a Python/NumPy scalar known at trace time, else None."""
    if isinstance(x, (bool, np.bool_)):
        return None
    if isinstance(x, (int, float, np.number)):
        return float(x)
    # (jnp.issubdtype: the literals of a bfloat16 or FP8 program are ml_dtypes scalars,
    # which NumPy does not count as numbers)
    if (
        isinstance(x, np.ndarray | np.generic)
        and np.ndim(x) == 0
        and jnp.issubdtype(x.dtype, jnp.number)
    ):
        return float(x)
    return None


def wide_dtype(*dtypes: Any) -> np.dtype:
    """The dtype rescaling is computed in: float32, or the widest float input."""
    return max((wide_float(d) for d in dtypes), key=lambda d: d.itemsize)


def rescale_data(data: Any, factor: Any) -> jax.Array:
    """``data * factor`` computed in at least float32 and returned in data's dtype.

    ``factor`` is a ratio of power-of-two scales, so this is exact unless the result
    leaves the data format's range. A static factor of 1 emits nothing.
    """
    if not isinstance(data, jax.Array):
        data = jnp.asarray(data)
    if is_static(factor) and float(factor) == 1.0:
        return data
    wide = wide_dtype(data.dtype)
    if is_static(factor):
        factor = np.asarray(factor, wide)
    elif factor.dtype != wide:
        factor = lax.convert_element_type(factor, wide)
    widened = data if data.dtype == wide else lax.convert_element_type(data, wide)
    if np.ndim(factor) == 0:
        product = lax.mul(widened, lax.broadcast(factor, data.shape) if data.ndim else factor)
    else:  # a batched scale (under vmap): NumPy broadcasting
        product = widened * factor
    return product if data.dtype == wide else lax.convert_element_type(product, data.dtype)


def unscale(x: Any, dtype: Any = None) -> Any:
    """The plain value of ``x`` (``data * scale``), in ``dtype`` or its own dtype."""
    if is_scaled(x):
        return x.to_array(dtype)
    if dtype is not None:
        return jnp.asarray(x).astype(dtype)
    return x


def scale_of(x: Any) -> jax.Array:
    return x.scale if is_scaled(x) else unit_scale()


def lift(x: Any, scale: Any, dtype: Any) -> jax.Array:
    """Data of plain value ``x`` expressed in the power-of-two ``scale`` (``x / scale``,
    exact) as ``dtype``."""
    c = concrete_scalar(x)
    if c is not None and (c == 0.0 or not math.isfinite(c)):
        # 0 and ±inf (and NaN) are the same in every scale: never divide them.
        return jnp.asarray(c, dtype)
    x = jnp.asarray(x)
    wide = wide_dtype(x.dtype, dtype)
    return (x.astype(wide) * pow2_reciprocal(scale).astype(wide)).astype(dtype)


def lift_floor(x: Any, dtype: Any) -> Any:
    """The least scale at which the plain value ``x`` lifts into ``dtype`` data without
    overflowing (twice the power of two of its largest finite magnitude over that of
    ``dtype``'s max), or None where it cannot bind (0, ±inf, NaN known at trace time;
    non-float data). One reduction for an array traced inside the step (a mask's fill,
    ``jnp.finfo(dtype).min`` broadcast by ``jnp.where``): attention masked with it
    would otherwise select -inf, and a fully masked row would give NaN."""
    if not jnp.issubdtype(dtype, jnp.floating):
        return None
    top = static_pow2_round_down(float(jnp.finfo(dtype).max))
    c = concrete_scalar(x)
    if c is not None:
        if c == 0.0 or not math.isfinite(c):
            return None
        return static_scale(2.0 * static_pow2_round_down(abs(c)) / top)
    arr = jnp.asarray(x)
    if not jnp.issubdtype(arr.dtype, jnp.floating):
        return None
    a = data_absmax(arr)
    a = lax.select(lax.is_finite(a), a, np.float32(0))  # beyond float32 (x64 data)
    return lax.mul(pow2_round_down(a), np.float32(2.0 / top))


def common_scale(xs: list[Any]) -> jax.Array:
    """Largest finite scale among the scaled inputs (all inputs then have data <= their
    own), 0 when none is. An infinite or NaN scale sets none: a finite operand's data
    aligned to it would flush to zero (``max(x, y)`` with ``y``'s scale inf returned 0
    where ``x`` is the maximum), while that operand's own data aligned to a finite scale
    keeps the inf or NaN its value is."""
    scales = [x.scale for x in xs if is_scaled(x)]
    if not scales:
        return unit_scale()
    if all(is_static(s) for s in scales):
        return static_scale(max((float(s) for s in scales if math.isfinite(s)), default=0.0))
    finite = [
        s
        if is_static(s) and math.isfinite(float(s))
        else lax.select(lax.is_finite(as_scale(s)), as_scale(s), np.float32(0))
        for s in scales
    ]
    return scale_max(*finite)


def scale_max(*scales: Any) -> Any:
    """The largest of ``scales`` (NumPy when all are static)."""
    if all(is_static(s) for s in scales):
        return static_scale(max(float(s) for s in scales))
    out = scales[0]
    for s in scales[1:]:
        out = lax.max(as_scale(out), as_scale(s))
    return out


def align(
    xs: list[Any], dtype: Any = None, scale: Any = None, *, fit: bool = True
) -> tuple[list[Any], jax.Array]:
    """Express every input in one common power-of-two scale; returns the data list and
    the scale.

    The common scale is ``scale`` (a power of two) or the power of two of the largest
    input scale, raised where a plain input would overflow ``dtype`` in it
    (`lift_floor`; ``fit=False`` skips that, for comparisons, where a value beyond
    every datum compares as inf does). Scaled inputs are rescaled by the ratio of their
    scale to it (exact for power-of-two scales, and computed without a divide); plain
    inputs are lifted. ``dtype`` defaults to the first scaled input's data dtype and is
    used for lifted plain values.
    """
    if dtype is None:
        dtype = next(x.dtype for x in xs if is_scaled(x))
    # Scale 0 marks an exactly-zero tensor: it sets no scale. If every scaled input is
    # one, the common scale is 1, a plain input's own (raised only where it would
    # overflow): the least scale a plain value fits in (~2^-123 for values near 1) made
    # its data ~1e38, and its square inf (x - zero_mean in a BatchNorm at step 0).
    zero = None
    if scale is None:
        # every input exactly zero (scale 0, or a plain literal 0: a pad's padding value),
        # so is the result: it keeps the mark
        if all(is_scaled(x) or concrete_scalar(x) == 0.0 for x in xs):
            zero = scale_max(*(x.scale for x in xs if is_scaled(x)))
        scale = positive_or_one(common_scale(xs))
        floors = [lift_floor(x, dtype) for x in xs if fit and not is_scaled(x)]
        floors = [f for f in floors if f is not None]
        if floors:
            scale = scale_max(scale, *floors)
        scale = pow2_round_down(scale)
    else:
        scale = positive_or_one(scale)
    # At most SCALE_MAX, whose reciprocal is a normal float32 (an input's 2^127 has a
    # subnormal one, flushed to 0 by XLA's CPU code): such an input's data is doubled.
    scale = at_most_max(scale)
    inverse = pow2_reciprocal(scale)
    datas = []
    for x in xs:
        if is_scaled(x):
            datas.append(rescale_data(x.data, x.scale * inverse))
        else:
            datas.append(lift(x, scale, dtype))
    if zero is not None:
        if is_static(zero):
            scale = static_scale(0.0) if float(zero) == 0.0 else scale
        else:
            scale = lax.select(lax.eq(zero, np.float32(0)), np.float32(0), as_scale(scale))
    return datas, scale


# Scales are kept within float32's normal range; a product of scales beyond it moves the
# excess into the data (exact for powers of two), which is where float32 would have had
# to hold the value anyway.
SCALE_MIN = 2.0**-126
# 2^126, not float32's 2^127: the reciprocal of every scale a rule makes is then a normal
# float32 (2^-127 is subnormal, and XLA's CPU code flushes it to zero: aligning a value at
# scale 2^127 with `pow2_reciprocal` made its data 0).
SCALE_MAX = 2.0**126


def at_most_max(scale: Any) -> Any:
    """``scale``, or `SCALE_MAX` where it is larger (NaN stays NaN)."""
    if is_static(scale):
        return static_scale(min(float(scale), SCALE_MAX)) if scale == scale else scale
    return lax.min(scale, np.float32(SCALE_MAX))


def scale_product(scale: Any, factor: Any, *, divide: bool = False) -> tuple[Any, Any]:
    """``scale * factor`` (or ``scale / factor``) as ``(new_scale, data_factor)``.

    ``new_scale`` is the product clamped to float32's normal range, and
    ``data_factor`` the exact remainder (1 when the product is in range) that the data
    must be multiplied by: ``new_scale * data_factor == scale * factor`` without the
    product ever over- or underflowing. A zero operand (an all-zero tensor's scale 0, a
    factor 0) gives scale 0 and a zero factor: the data becomes zeros, so scale 0 only
    ever holds zeros (NaN where the data held inf or NaN: 0 * inf).
    """
    if is_static(scale) and is_static(factor):
        return _static_product(float(scale), float(factor), divide)
    static = concrete_scalar(factor)
    if divide and static is not None and static != 0.0 and split_pow2(static)[0] == 1.0:
        factor, divide, static = 1.0 / static, False, 1.0 / static  # multiply by the inverse
    if not divide and static is not None and math.isfinite(static) and static > 0:
        return _product_by_constant(as_f32(scale), static)
    op = lax.div if divide else lax.mul
    scale = as_f32(scale)
    factor = as_f32(factor)
    exact = op(scale, factor)
    new = lax.clamp(np.float32(SCALE_MIN), exact, np.float32(SCALE_MAX))
    # where ``rest`` matters ``new`` is one of the bounds, and ``rest`` is the product
    # over that bound, computed with every intermediate a normal float32 (a subnormal
    # one would be flushed to zero by XLA's CPU code, and the value with it)
    high = lax.gt(new, np.float32(1))
    k_scale, k_factor = _bound_split(high, divide)
    rest = op(lax.mul(scale, k_scale), lax.mul(factor, k_factor))
    # a zero operand (an all-zero tensor's scale 0) makes an all-zero tensor: scale 0,
    # the mark that sets no scale when added to (a zero-initialised head's logits minus
    # a plain target), and a zero remainder (the split above assumes a scale under 2
    # below the range: 4 times 2^126 overflowed to inf, times 0 gave NaN data)
    zero = lax.eq(scale, np.float32(0))
    if not divide:
        zero = lax.bitwise_or(zero, lax.eq(factor, np.float32(0)))
    rest = lax.select(zero, exact, rest)
    new = lax.select(zero, exact, new)
    # in range: exactly 1 (also for scales that are not powers of two); NaN stays NaN
    rest = lax.select(lax.eq(exact, new), literal_like(rest, 1.0), rest)
    return new, rest


def _bound_split(high: jax.Array, divide: bool) -> tuple[jax.Array, jax.Array]:
    """Constants ``(a, b)`` with ``(scale * a) op (factor * b) == (scale op factor) /
    bound``, ``bound`` SCALE_MAX (2^126) where ``high`` else SCALE_MIN (2^-126). Above
    the range the product exceeds 2^126 while scales are at most 2^127 and factors below
    2^128, so ``scale > 2^-2`` and ``factor > 2^-1`` (a divisor ``>= 2^-126``, the scale
    then above 1): 2^-64 and 2^-62 (2^62 for a divisor) keep both halves and the result
    normal. Below it ``scale < 2`` and 2^126 alone does."""
    a = lax.select(high, _ABOVE_SCALE, _BELOW_SCALE)
    b = lax.select(high, _ABOVE_DIVISOR if divide else _ABOVE_FACTOR, _ONE)
    return a, b


_ABOVE_SCALE = np.float32(2.0**-64)
_ABOVE_FACTOR = np.float32(2.0**-62)
_ABOVE_DIVISOR = np.float32(2.0**62)
_BELOW_SCALE = np.float32(2.0**126)
_ONE = np.float32(1.0)


def _product_by_constant(scale: jax.Array, c: float) -> tuple[jax.Array, jax.Array]:
    """`scale_product` of a traced scale and a positive constant: a product by ``c > 1``
    can only overflow (to the top bound), by ``c < 1`` only underflow (to the bottom
    one), so the remainder is ``scale`` times a constant known here: five ops."""
    exact = lax.mul(scale, np.float32(c))
    new = lax.clamp(np.float32(SCALE_MIN), exact, np.float32(SCALE_MAX))
    # rest = scale * c / bound, in two steps that keep every intermediate normal
    k1 = 2.0**-64 if c > 1.0 else 2.0**64
    k2 = c / (SCALE_MAX if c > 1.0 else SCALE_MIN) / k1
    rest = lax.mul(lax.mul(scale, np.float32(k1)), np.float32(k2))
    return new, lax.select(lax.eq(exact, new), literal_like(rest, 1.0), rest)


def _static_product(scale: float, factor: float, divide: bool) -> tuple[Any, Any]:
    """`scale_product` of two static scales, in float64 (exact for float32 inputs)."""
    with np.errstate(all="ignore"):
        exact = np.float64(scale) / factor if divide else np.float64(scale) * factor
    if math.isnan(exact):
        return static_scale(np.nan), static_scale(np.nan)
    if exact == 0.0:  # a zero operand: an all-zero tensor, scale 0 (`scale_product`)
        return static_scale(0.0), static_scale(0.0)
    new = min(max(exact, SCALE_MIN), SCALE_MAX)
    new32 = float(static_scale(new))
    if new32 == exact:
        return static_scale(new32), static_scale(1.0)
    with np.errstate(all="ignore"):
        return static_scale(new32), static_scale(exact / new32)


def product_parts(
    scale: Any, *factors: Any, divisors: tuple = (), data_factor: float = 1.0
) -> tuple[Any, Any]:
    """``(new_scale, data_factor)`` of `product_scaled`: the product of the scale by
    ``factors`` over ``divisors``, kept in float32's normal range, and what the data
    must be multiplied by (``data_factor`` times the remainder, which is exactly 1
    unless the scale left the range). A rule that multiplies its data by a scalar
    anyway folds this factor into that scalar instead of rescaling the data again."""
    # static factors first, folded into one (their product is exact in float64)
    steps = [(f, False) for f in factors] + [(d, True) for d in divisors]
    static = 1.0
    dynamic = []
    for f, divide in steps:
        c = concrete_scalar(f)
        if c is not None and c != 0.0 and math.isfinite(c):
            static = static / c if divide else static * c
        else:
            dynamic.append((f, divide))
    if static != 1.0:
        dynamic.insert(0, (static, False))
    rest = static_scale(data_factor)
    for f, divide in dynamic:
        scale, r = scale_product(scale, f, divide=divide)
        if is_static(rest) and float(rest) == 1.0:
            rest = r
        elif is_static(rest) and is_static(r):
            rest = rest * r
        else:
            rest = lax.mul(as_scale(rest), as_scale(r))
    return scale, rest


def product_scaled(
    data: Any, scale: Any, *factors: Any, divisors: tuple = (), data_factor: float = 1.0
) -> ScaledArray:
    """``ScaledArray(data * data_factor, scale * prod(factors) / prod(divisors))`` with
    the scale kept in float32's normal range (see `scale_product`): the data is also
    multiplied by the remainder, which is exactly 1 unless the scale left the range.
    One rescale of the data at most (``data_factor`` is static)."""
    scale, rest = product_parts(scale, *factors, divisors=divisors, data_factor=data_factor)
    return make_scaled(rescale_data(data, rest), scale)


_INF = np.float32(np.inf)


def materialized(scale: Any) -> Any:
    """``scale`` unchanged in value, computed once by XLA instead of in every fusion.

    XLA duplicates cheap scalar producers into each fusion that consumes them, so a
    scale that depends on a chain of rules would be recomputed, chain and all, inside
    every array fusion downstream: compile time then grows with the square of the
    depth. ``fmod(scale, inf)`` is ``scale`` for every finite scale (NaN stays NaN, an
    infinite scale becomes NaN: non-finite either way) and XLA counts a floating
    remainder as expensive, so it is never duplicated into a fusion that broadcasts it.
    Concrete (non-traced) scales are returned as they are.
    """
    if not isinstance(scale, jax.core.Tracer):
        return scale
    return lax.rem(scale, np.asarray(_INF, scale.dtype))


def renormalized(x: ScaledArray, amax: Any, band: int | None, *, zero_scale: bool = False):
    """``x`` with data divided by the power of two of ``amax`` (its abs-max, measured)
    and the scale multiplied by it, when that power of two is beyond 2^±band; ``x``
    unchanged (bit for bit) otherwise. The value is the same either way. ``band=None``
    never shifts the data.

    ``zero_scale``: all-zero data (``amax == 0``) gets scale 0, the mark of an exactly
    zero tensor, unless the scale is not finite (the value is then NaN, and stays so).

    Integer work on the float32 exponent field (a dozen scalar ops): the chain is pulled
    into every fusion that reads the data, so it is kept short.
    """
    amax = as_f32(amax)
    data, scale = x.data, as_f32(x.scale)
    if band is not None:
        i32 = np.int32
        bits = lax.bitwise_and(lax.bitcast_convert_type(amax, jnp.int32), i32(0x7F800000))
        biased = lax.shift_right_logical(bits, i32(23))
        far = lax.gt(lax.abs(lax.sub(biased, i32(127))), i32(band))
        usable = lax.bitwise_and(lax.gt(biased, i32(0)), lax.lt(biased, i32(254)))
        p2_bits = lax.select(lax.bitwise_and(far, usable), bits, i32(127 << 23))
        p2 = lax.bitcast_convert_type(p2_bits, SCALE_DTYPE)
        inverse = lax.bitcast_convert_type(lax.sub(i32(254 << 23), p2_bits), SCALE_DTYPE)
        data = rescale_data(data, materialized(inverse))
        scale = scale * p2
    if zero_scale:
        zero = lax.bitwise_and(lax.eq(amax, np.float32(0)), lax.is_finite(scale))
        scale = lax.select(zero, np.float32(0), scale)
    return make_scaled(data, materialized(scale))


def data_absmax(data: Any) -> jax.Array:
    """Largest finite |element| of ``data``, in float32 (0 for an empty array)."""
    wide = jnp.asarray(data).astype(wide_dtype(data.dtype))
    finite = jnp.where(jnp.isfinite(wide), jnp.abs(wide), jnp.zeros_like(wide))
    return jnp.max(finite, initial=0.0).astype(SCALE_DTYPE)


def pow2_sqrt_static(n: float) -> float:
    """Power of two (rounded down) of ``sqrt(n)``, as a Python float known at trace time."""
    return 1.0 if n <= 1 else static_pow2_round_down(math.sqrt(n))


def pow2_norm_scale(*scales: Any) -> jax.Array:
    """Scale of a sum of independent unit-RMS terms with these scales: the power of two
    (rounded down) of ``sqrt(sum(s**2))``.

    For power-of-two scales that is exactly the largest scale (``sqrt(sum) < 2 * max``
    for two terms), so it is computed as ``pow2_round_down(max)``: a couple of ops, and
    no squaring that could overflow float32 when scales have drifted.
    """
    top = scale_max(*scales)
    if len(scales) > 2 and is_static(top):
        safe = float(positive_or_one(top))
        total = math.sqrt(sum((float(s) / safe) ** 2 for s in scales))
        return static_scale(pow2_round_down(static_scale(total)) * top)
    if len(scales) > 2:
        # with n terms the sum can reach n * max**2: keep the unit-scaling rule exact
        safe = positive_or_one(top)
        total = sum((s / safe) * (s / safe) for s in scales)
        return (pow2_round_down(jnp.sqrt(total)) * top).astype(SCALE_DTYPE)
    return pow2_round_down(top).astype(SCALE_DTYPE)


def split_pow2(c: float) -> tuple[float, float]:
    """Split a finite non-zero constant into (mantissa, power of two): ``c == m * p``,
    ``1 <= |m| < 2``."""
    f, e = math.frexp(c)
    return 2.0 * f, math.ldexp(1.0, e - 1)


# Data whose abs-max is within 2^±FIT_BAND is left where it is (`renormalized`).
FIT_BAND = 4


def recentred_scalar(x: Any) -> Any:
    """``x`` when it is not a scaled float of at most one element; else its data shifted
    to an abs-max in [1, 2) (the power of two moved into the scale) when it is beyond
    2^±FIT_BAND. Scalar work only. A computed scalar (``exp`` of a learned temperature:
    data 2e4 at scale 1) broadcast into an array would give every product with that
    array's unit-scaled data its magnitude, which FP16 data cannot hold."""
    if not is_scaled(x) or np.size(x.data) > 1 or not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    return renormalized(x, data_absmax(x.data), FIT_BAND)


def fit_to(value: jax.Array, dtype: Any) -> ScaledArray:
    """The wide ``value`` as ``dtype`` data: scale 1, or for a narrow-range ``dtype``
    (and for a value of one element, of any dtype: `recentred_scalar`) with the power of
    two of its abs-max moved into the scale when it is beyond 2^±FIT_BAND, so a value
    beyond FP16/FP8 range is not cast to inf."""
    if not narrower_than_float32(dtype):
        out = make_scaled(value.astype(dtype), unit_scale())
        return recentred_scalar(out) if np.size(value) <= 1 else out
    fitted = renormalized(make_scaled(value, unit_scale()), data_absmax(value), FIT_BAND)
    return make_scaled(fitted.data.astype(dtype), fitted.scale)


def on_unscaled(prim):
    """Rule evaluating ``prim`` on unscaled values (in at least float32). The result is
    data at scale 1, except for narrow data dtypes (see `fit_to`)."""

    def rule(*args, **params):
        dtype = next(a.dtype for a in args if is_scaled(a))
        wide = wide_dtype(dtype)
        vals = [unscale(a, wide) for a in args]
        return fit_to(prim.bind(*vals, **params), dtype)

    return rule
