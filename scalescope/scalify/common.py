"""Helpers shared by the scaled rules: lifting plain values, aligning scales, unscaling.

Rules see two kinds of inputs: `ScaledArray` and plain values (tracers, or literals of
the jaxpr such as ``0.0`` or ``-inf``). Plain literals are never given a scale of their
own: a literal next to a scaled operand is expressed in that operand's scale, so ``0``
and ``±inf`` stay exact and never poison a scale.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core.pow2 import pow2_round_down, static_pow2_round_down
from ..core.scaled_array import SCALE_DTYPE, ScaledArray, wide_float


def is_scaled(x: Any) -> bool:
    return isinstance(x, ScaledArray)


def make_scaled(data: Any, scale: Any) -> ScaledArray:
    """A `ScaledArray` with a float32 scalar scale."""
    return ScaledArray(data, jnp.asarray(scale, SCALE_DTYPE))


def unit_scale() -> jax.Array:
    return jnp.ones((), SCALE_DTYPE)


def positive_or_one(scale: jax.Array) -> jax.Array:
    """``scale`` where positive, else 1 (scale 0 marks an exactly-zero tensor)."""
    one = lax.full_like(scale, 1.0)
    return lax.select(lax.gt(scale, lax.full_like(scale, 0.0)), scale, one)


def concrete_scalar(x: Any) -> float | None:
    """The value of ``x`` if it is a Python/NumPy scalar known at trace time, else None."""
    if isinstance(x, (bool, np.bool_)):
        return None
    if isinstance(x, (int, float, np.number)):
        return float(x)
    if isinstance(x, np.ndarray) and x.ndim == 0 and np.issubdtype(x.dtype, np.number):
        return float(x)
    return None


def wide_dtype(*dtypes: Any) -> np.dtype:
    """The dtype rescaling is computed in: float32, or the widest float input."""
    return max((wide_float(d) for d in dtypes), key=lambda d: d.itemsize)


def rescale_data(data: Any, factor: Any) -> jax.Array:
    """``data * factor`` computed in at least float32 and returned in data's dtype.

    ``factor`` is a ratio of power-of-two scales, so this is exact unless the result
    leaves the data format's range.
    """
    data = jnp.asarray(data)
    wide = wide_dtype(data.dtype)
    return (data.astype(wide) * jnp.asarray(factor, wide)).astype(data.dtype)


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
    """Data of plain value ``x`` expressed in ``scale`` (``x / scale``) as ``dtype``."""
    c = concrete_scalar(x)
    if c is not None and (c == 0.0 or not math.isfinite(c)):
        # 0 and ±inf (and NaN) are the same in every scale: never divide them.
        return jnp.asarray(c, dtype)
    x = jnp.asarray(x)
    wide = wide_dtype(x.dtype, dtype)
    return (x.astype(wide) / jnp.asarray(scale, wide)).astype(dtype)


def common_scale(xs: list[Any]) -> jax.Array:
    """Largest scale among the scaled inputs (all inputs then have data <= their own)."""
    scales = [x.scale for x in xs if is_scaled(x)]
    if not scales:
        return unit_scale()
    out = scales[0]
    for s in scales[1:]:
        out = lax.max(out, s)
    return out


def align(xs: list[Any], dtype: Any = None, scale: Any = None) -> tuple[list[Any], jax.Array]:
    """Express every input in one common scale; returns the data list and the scale.

    Scaled inputs are rescaled by the ratio of their scale to the common one (exact for
    powers of two); plain inputs are lifted. ``dtype`` defaults to the first scaled
    input's data dtype and is used for lifted plain values.
    """
    if scale is None:
        scale = common_scale(xs)
    # Scale 0 marks an exactly-zero tensor; if every input is one, express in scale 1.
    scale = positive_or_one(scale)
    if dtype is None:
        dtype = next(x.dtype for x in xs if is_scaled(x))
    datas = []
    for x in xs:
        if is_scaled(x):
            datas.append(rescale_data(x.data, x.scale / scale))
        else:
            datas.append(lift(x, scale, dtype))
    return datas, scale


# Scales are kept within float32's normal range; a product of scales beyond it moves the
# excess into the data (exact for powers of two), which is where float32 would have had
# to hold the value anyway.
SCALE_MIN = 2.0**-126
SCALE_MAX = 2.0**127


def _is_one(x: Any) -> bool:
    c = concrete_scalar(x)
    return c is not None and c == 1.0


def scale_product(scale: Any, factor: Any, *, divide: bool = False) -> tuple[Any, Any]:
    """``scale * factor`` (or ``scale / factor``) as ``(new_scale, data_factor)``.

    ``new_scale`` is the product clamped to float32's normal range, and
    ``data_factor`` the exact remainder (1 when the product is in range) that the data
    must be multiplied by: ``new_scale * data_factor == scale * factor`` without the
    product ever over- or underflowing. A zero scale (an all-zero tensor) gives the
    smallest normal scale and a zero factor, so scale 0 never meets non-zero data.
    """
    op = lax.div if divide else lax.mul
    scale = jnp.asarray(scale, SCALE_DTYPE)
    factor = jnp.asarray(factor, SCALE_DTYPE)
    exact = op(scale, factor)
    new = lax.clamp(jnp.asarray(SCALE_MIN, SCALE_DTYPE), exact, jnp.asarray(SCALE_MAX, SCALE_DTYPE))
    rest = op(scale / new, factor)
    # in range: exactly 1 (also for scales that are not powers of two); NaN stays NaN
    rest = lax.select(lax.eq(exact, new), jnp.ones_like(rest), rest)
    return new, rest


def product_scaled(
    data: Any, scale: Any, *factors: Any, divisors: tuple = (), data_factor: float = 1.0
) -> ScaledArray:
    """``ScaledArray(data * data_factor, scale * prod(factors) / prod(divisors))`` with
    the scale kept in float32's normal range (see `scale_product`): the data is also
    multiplied by the remainder, which is exactly 1 unless the scale left the range.
    One rescale of the data at most (``data_factor`` is static)."""
    rest = None
    for f, divide in [(f, False) for f in factors] + [(d, True) for d in divisors]:
        if _is_one(f):
            continue
        scale, r = scale_product(scale, f, divide=divide)
        rest = r if rest is None else rest * r
    if rest is not None:
        data = rescale_data(data, rest if data_factor == 1.0 else rest * data_factor)
    elif data_factor != 1.0:
        data = rescale_data(data, data_factor)
    return make_scaled(data, scale)


def renormalized(x: ScaledArray, amax: Any, band: int) -> ScaledArray:
    """``x`` with data divided by the power of two of ``amax`` (its abs-max, measured)
    and the scale multiplied by it, when that power of two is beyond 2^±band; ``x``
    unchanged (bit for bit) otherwise. The value is the same either way.

    Integer work on the float32 exponent field (a dozen scalar ops): the chain is pulled
    into every fusion that reads the data, so it is kept short.
    """
    bits = lax.bitwise_and(
        lax.bitcast_convert_type(jnp.asarray(amax, SCALE_DTYPE), jnp.int32),
        jnp.int32(0x7F800000),
    )
    biased = lax.shift_right_logical(bits, jnp.int32(23))
    far = lax.gt(lax.abs(biased - jnp.int32(127)), jnp.int32(band))
    usable = lax.bitwise_and(lax.gt(biased, jnp.int32(0)), lax.lt(biased, jnp.int32(254)))
    one_bits = jnp.int32(127 << 23)
    p2_bits = lax.select(lax.bitwise_and(far, usable), bits, one_bits)
    p2 = lax.bitcast_convert_type(p2_bits, SCALE_DTYPE)
    inverse = lax.bitcast_convert_type(jnp.int32(254 << 23) - p2_bits, SCALE_DTYPE)
    return make_scaled(rescale_data(x.data, inverse), x.scale * p2)


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
    top = scales[0]
    for s in scales[1:]:
        top = lax.max(top, s)
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


def on_unscaled(prim):
    """Rule evaluating ``prim`` on unscaled values (in at least float32); scale 1 out."""

    def rule(*args, **params):
        dtype = next(a.dtype for a in args if is_scaled(a))
        wide = wide_dtype(dtype)
        vals = [unscale(a, wide) for a in args]
        return make_scaled(prim.bind(*vals, **params).astype(dtype), unit_scale())

    return rule
