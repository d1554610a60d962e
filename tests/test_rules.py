"""Every scaled rule preserves values: ``asarray(scalify(f)(scaled x)) == f(x)``.

Property tests over shapes and power-of-two scales from 2**-30 to 2**30. A coverage test
checks that the cases below exercise every registered rule, so a new rule without a
value test fails the suite.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax
from jax.ad_checkpoint import checkpoint_name as _checkpoint_name
from jax.experimental import io_callback

import scalescope as ss
from scalescope.scalify import has_rule, primitives_in, registered_primitives

SHAPES = [(8,), (3, 5), (2, 3, 4)]
IDX = np.array([0, 2, 1])


def _domain(kind: str, rng: np.random.Generator, shape) -> np.ndarray:
    if kind == "pos":
        return rng.uniform(0.1, 4.0, shape).astype(np.float32)
    if kind == "unit":
        return rng.uniform(-0.9, 0.9, shape).astype(np.float32)
    if kind == "ge1":
        return rng.uniform(1.1, 4.0, shape).astype(np.float32)
    return rng.normal(0.0, 2.0, shape).astype(np.float32)


def _lgamma_pos(x):
    return lax.lgamma(x)


@jax.custom_jvp
def _custom_jvp_fn(x):
    return jnp.sin(x) * 2.0


_custom_jvp_fn.defjvp(lambda p, t: (_custom_jvp_fn(p[0]), 2.0 * jnp.cos(p[0]) * t[0]))


@jax.custom_vjp
def _custom_vjp_fn(x):
    return x * 3.0


_custom_vjp_fn.defvjp(lambda x: (x * 3.0, None), lambda r, g: (g * 3.0,))


def _scan_fn(x):
    def body(c, a):
        return c * 0.5 + a, c * a

    return lax.scan(body, jnp.zeros_like(x[0]), x)


def _while_fn(x):
    return lax.while_loop(lambda c: c[1] < 3, lambda c: (c[0] * 2.0 + 1.0, c[1] + 1), (x, 0))


def _cond_fn(x):
    return lax.cond(jnp.sum(x) > 0, lambda a: a * 2.0, lambda a: jnp.sin(a), x)


def _conv(x):
    lhs = x.reshape(1, 1, -1)
    rhs = jnp.ones((2, 1, 3), jnp.float32) * 0.5
    return lax.conv_general_dilated(lhs, rhs, (1,), "SAME")


def _pool(init, op, padding="SAME"):
    """A 2-wide, stride-1 window on every axis (avg/max/min pooling of any rank)."""

    def pool(x):
        dims = tuple(min(2, n) for n in x.shape)
        return lax.reduce_window(x, init, op, dims, (1,) * x.ndim, padding)

    return pool


_sum_pool = _pool(0.0, lax.add)
_max_pool = _pool(-jnp.inf, lax.max, "VALID")


def _grad(f):
    return jax.grad(lambda x: jnp.sum(f(x)))


def _ragged_dot(x):
    """Two experts' matmuls over the rows of ``x`` (a mixture-of-experts layer):
    ``ragged_dot_general`` with ragged rows; its gradient contracts them."""
    a = x.reshape(x.shape[0], -1)
    m = a.shape[0]
    experts = jnp.stack([a.T, jnp.sin(a.T)])  # [2, k, m]
    return lax.ragged_dot(a, experts, jnp.array([m // 2, m - m // 2], jnp.int32))


def _host(fn):
    """A NumPy function run on the host (the callback returns float32, as declared)."""
    return lambda v: np.asarray(fn(np.asarray(v)), np.float32)


# name -> (function of one scaled float input, input domain, shapes)
UNARY = {
    "name": (lambda x: _checkpoint_name(jnp.tanh(x), "h"), "any"),
    "complex": (lambda x: (lax.complex(x, 0.5 * x) * (1 + 2j)).imag, "any"),
    "random_gamma": (lambda x: jax.random.gamma(jax.random.key(0), jnp.abs(x) + 1.0), "any"),
    "neg": (lambda x: -x, "any"),
    "abs": (jnp.abs, "any"),
    "sign": (jnp.sign, "any"),
    "square": (lax.square, "any"),
    "integer_pow": (lambda x: x**3, "any"),
    "integer_pow_neg": (lambda x: lax.integer_pow(x, -2), "pos"),
    "sqrt": (jnp.sqrt, "pos"),
    "rsqrt": (lax.rsqrt, "pos"),
    "cbrt": (jnp.cbrt, "any"),
    "exp": (jnp.exp, "any"),
    "exp2": (jnp.exp2, "any"),
    "log": (jnp.log, "pos"),
    "log1p": (jnp.log1p, "pos"),
    "log2": (jnp.log2, "pos"),  # a primitive of its own from JAX 0.11
    "expm1": (jnp.expm1, "any"),
    "tanh": (jnp.tanh, "any"),
    "logistic": (jax.nn.sigmoid, "any"),
    "sin": (jnp.sin, "any"),
    "cos": (jnp.cos, "any"),
    "tan": (jnp.tan, "unit"),
    "asin": (jnp.arcsin, "unit"),
    "acos": (jnp.arccos, "unit"),
    "atan": (jnp.arctan, "any"),
    "sinh": (jnp.sinh, "any"),
    "cosh": (jnp.cosh, "any"),
    "asinh": (jnp.arcsinh, "any"),
    "acosh": (jnp.arccosh, "ge1"),
    "atanh": (jnp.arctanh, "unit"),
    "erf": (lax.erf, "any"),
    "erfc": (lax.erfc, "any"),
    "erf_inv": (lax.erf_inv, "unit"),
    "lgamma": (_lgamma_pos, "pos"),
    "digamma": (lax.digamma, "pos"),
    "floor": (jnp.floor, "any"),
    "ceil": (jnp.ceil, "any"),
    "round": (jnp.round, "any"),
    "pow": (lambda x: x**2.5, "pos"),
    "rem": (lambda x: lax.rem(x, 1.5), "any"),
    "nextafter": (lambda x: jnp.nextafter(x, 10.0), "any"),
    "is_finite": (jnp.isfinite, "any"),
    "mul_const": (lambda x: x * 0.375, "any"),
    "div_const": (lambda x: x / 3.0, "any"),
    "rdiv_const": (lambda x: 3.0 / x, "pos"),
    "add_const": (lambda x: x + 1.0, "any"),
    "sub_const": (lambda x: 2.0 - x, "any"),
    "max_zero": (jax.nn.relu, "any"),
    "min_inf": (lambda x: jnp.minimum(x, jnp.inf), "any"),
    "log_softmax": (lambda x: jax.nn.log_softmax(x, axis=-1), "any"),
    "softmax": (lambda x: jax.nn.softmax(x, axis=-1), "any"),
    "gelu": (jax.nn.gelu, "any"),
    "gelu_erf": (lambda x: jax.nn.gelu(x, approximate=False), "any"),
    "clamp": (lambda x: lax.clamp(-1.0, x, 1.0), "any"),
    "clip": (lambda x: jnp.clip(x, -1.0, 1.0), "any"),
    "compare": (
        lambda x: jnp.stack([x == 1.0, x != 0.5, x < 0.0, x <= 1.0, x > 0.0, x >= 2.0]),
        "any",
    ),
    "where": (lambda x: jnp.where(x > 0, x, 0.0), "any"),
    "atan2": (lambda x: jnp.arctan2(x, 2.0), "any"),
    "reshape": (lambda x: x.reshape(-1), "any"),
    "broadcast": (lambda x: jnp.broadcast_to(x, (2,) + x.shape), "any"),
    "transpose": (lambda x: x.T, "any"),
    "squeeze": (lambda x: jnp.squeeze(x[None]), "any"),
    "expand_dims": (lambda x: jnp.expand_dims(x, 0), "any"),
    "slice": (lambda x: x[1:], "any"),
    "rev": (lambda x: x[::-1], "any"),
    "copy": (jnp.copy, "any"),
    "dynamic_slice": (lambda x: lax.dynamic_slice_in_dim(x, jnp.int32(1), 1), "any"),
    "gather": (lambda x: jnp.take(x, IDX, axis=0), "any"),
    "split": (lambda x: jnp.split(x[:2], 2), "any"),
    "tile": (lambda x: jnp.tile(x, 2), "any"),
    "unstack": (lambda x: jnp.unstack(x[:2]), "any"),
    "stack": (lambda x: jnp.stack([x, x * 2.0]), "any"),
    "concatenate": (lambda x: jnp.concatenate([x, x * 4.0, jnp.zeros_like(x)]), "any"),
    "pad": (lambda x: jnp.pad(x, 1, constant_values=0.5), "any"),
    "dynamic_update_slice": (lambda x: lax.dynamic_update_slice_in_dim(x, x[:1] * 3, 1, 0), "any"),
    "scatter_add": (lambda x: x.at[IDX].add(x[:3] * 2.0), "any"),
    "scatter_add_zeros": (lambda x: jnp.zeros_like(x).at[IDX].add(x[:3]), "any"),
    "scatter": (lambda x: x.at[IDX].set(x[:3] * 0.5), "any"),
    "scatter_sub": (lambda x: x.at[IDX].subtract(1.0), "any"),
    "scatter_mul": (lambda x: x.at[IDX].multiply(2.0), "any"),
    "scatter_max": (lambda x: x.at[IDX].max(0.0), "any"),
    "scatter_min": (lambda x: x.at[IDX].min(0.0), "any"),
    "convert_int": (lambda x: x.astype(jnp.int32), "any"),
    "bitcast": (lambda x: lax.bitcast_convert_type(x, jnp.int32), "any"),
    "stop_gradient": (lax.stop_gradient, "any"),
    "sort": (lambda x: jnp.sort(x, axis=0), "any"),
    "top_k": (lambda x: lax.top_k(x.reshape(-1), 3), "any"),
    "optimization_barrier": (lambda x: lax.optimization_barrier((x, x * 2.0)), "any"),
    "reduce_sum": (lambda x: jnp.sum(x, axis=0), "any"),
    "reduce_sum_all": (jnp.sum, "any"),
    "mean_var": (lambda x: (jnp.mean(x), jnp.var(x)), "any"),
    "reduce_max": (lambda x: jnp.max(x, axis=-1), "any"),
    "reduce_min": (jnp.min, "any"),
    "reduce_prod": (lambda x: jnp.prod(x, axis=0), "unit"),
    "argmax": (lambda x: jnp.argmax(x, axis=0), "any"),
    "argmin": (jnp.argmin, "any"),
    "cumsum": (lambda x: jnp.cumsum(x, axis=0), "any"),
    # the callback receives the unscaled value (test_scalify checks what it sees)
    "debug_callback": (lambda x: (jax.debug.callback(lambda v: None, x), x)[1], "any"),
    # host callbacks that return values: run on the unscaled value, plain outputs
    "pure_callback": (
        lambda x: jax.pure_callback(_host(np.sin), jax.ShapeDtypeStruct(x.shape, x.dtype), x),
        "any",
    ),
    "io_callback": (
        lambda x: io_callback(_host(np.cos), jax.ShapeDtypeStruct(x.shape, x.dtype), x * 2.0),
        "any",
    ),
    # total-order comparisons (lt_to, le_to), as jnp.searchsorted and jnp.interp use them
    "searchsorted": (
        lambda x: [
            jnp.searchsorted(
                jnp.sort(x.reshape(-1)), x.reshape(-1) * 0.5, side=side, method="compare_all"
            )
            for side in ("left", "right")
        ],
        "any",
    ),
    "ragged_dot": (_ragged_dot, "any"),
    "grad_ragged_dot": (_grad(lambda x: jnp.tanh(_ragged_dot(x))), "any"),
    "cumprod": (lambda x: jnp.cumprod(x, axis=0), "unit"),
    "cummax": (lambda x: lax.cummax(x, axis=0), "any"),
    "cummin": (lambda x: lax.cummin(x, axis=0), "any"),
    "cumlogsumexp": (lambda x: lax.cumlogsumexp(x, axis=0), "any"),
    "logsumexp": (lambda x: jax.nn.logsumexp(x), "any"),
    "dot_self": (lambda x: x.reshape(x.shape[0], -1) @ x.reshape(x.shape[0], -1).T, "any"),
    "dot_const": (lambda x: x.reshape(-1) @ jnp.arange(x.size, dtype=jnp.float32), "any"),
    "conv": (_conv, "any"),
    "avg_pool": (lambda x: _sum_pool(x) / 4.0, "any"),
    "max_pool": (_max_pool, "any"),
    "min_pool": (_pool(jnp.inf, lax.min), "any"),
    "grad_avg_pool": (lambda x: jax.grad(lambda y: jnp.sum(_sum_pool(y) ** 2))(x), "any"),
    # select_and_scatter_add: the cotangent goes to each window's max
    "grad_max_pool": (lambda x: jax.grad(lambda y: jnp.sum(jnp.sin(_max_pool(y))))(x), "any"),
    # select_and_gather_add: the tangent at each window's max
    "jvp_max_pool": (lambda x: jax.jvp(_max_pool, (x,), (jnp.cos(x) * 3.0,))[1], "any"),
    "device_put": (lambda x: jax.device_put(x) * 2.0, "any"),
    "approx_max_k": (lambda x: lax.approx_max_k(x.reshape(-1), 3), "any"),
    "bessel": (lambda x: (lax.bessel_i0e(x), lax.bessel_i1e(x)), "any"),
    "igamma": (
        lambda x: (lax.igamma(2.0, x), lax.igammac(2.0, x), lax.igamma_grad_a(2.0, x)),
        "pos",
    ),
    "polygamma": (lambda x: lax.polygamma(1.0, x), "pos"),
    "zeta": (lambda x: lax.zeta(2.5, x), "pos"),
    "betainc": (lambda x: lax.betainc(2.0, 3.0, jnp.abs(x)), "unit"),
    "jit": (jax.jit(lambda x: jnp.sin(x) * x), "any"),
    "custom_jvp": (_custom_jvp_fn, "any"),
    "custom_vjp": (_custom_vjp_fn, "any"),
    "remat": (jax.checkpoint(lambda x: jnp.sin(x) * x), "any"),
    "scan": (_scan_fn, "any"),
    "while": (_while_fn, "any"),
    "cond": (_cond_fn, "any"),
    "grad_add_any": (_grad(lambda x: x * x + jnp.sin(x)), "any"),
    "grad_softmax": (_grad(lambda x: jax.nn.softmax(x) ** 2), "any"),
    "grad_scan": (_grad(lambda x: _scan_fn(x)[1]), "any"),
    "grad_custom_vjp": (_grad(_custom_vjp_fn), "any"),
    "grad_gather": (_grad(lambda x: jnp.take(x, IDX, axis=0) ** 2), "any"),
    "dynamic_rescale": (
        lambda x: (
            ss.ops.dynamic_rescale_l2(x) * ss.ops.dynamic_rescale_l1(x)
            + ss.ops.dynamic_rescale_max(x)
        ),
        "any",
    ),
    "dynamic_rescale_grad": (
        _grad(
            lambda x: (
                ss.ops.dynamic_rescale_l2_grad(x) ** 2
                + ss.ops.dynamic_rescale_max_grad(jnp.sin(x))
                + ss.ops.dynamic_rescale_l1_grad(x)
            )
        ),
        "any",
    ),
    "set_scaling": (
        lambda x: ss.ops.set_scaling(x, 4.0) + ss.ops.set_scaling(jnp.sin(x), 0.25),
        "any",
    ),
    "stop_scaling": (lambda x: ss.ops.stop_scaling(x * 2.0), "any"),
}
if hasattr(lax, "one_minus_square"):  # JAX 0.11: 1 - x**2 (tanh's derivative)
    UNARY["one_minus_square"] = (lax.one_minus_square, "any")

# name -> (function of two inputs; second one plain or scaled as the test decides)
BINARY = {
    "add": (jnp.add, "any"),
    "sub": (jnp.subtract, "any"),
    "mul": (jnp.multiply, "any"),
    "div": (jnp.divide, "pos"),
    "max": (jnp.maximum, "any"),
    "min": (jnp.minimum, "any"),
    "pow2": (jnp.power, "pos"),
    "atan2": (jnp.arctan2, "any"),
    "eq_lt": (lambda a, b: (a == b, a < b, a >= b), "any"),
    "total_order": (
        lambda a, b: [p.bind(a, b) for p in (lax.eq_to_p, lax.lt_to_p, lax.le_to_p)],
        "any",
    ),
    "where": (lambda a, b: jnp.where(a > b, a, b), "any"),
    "clamp": (lambda a, b: lax.clamp(-jnp.abs(b), a, jnp.abs(b)), "any"),
    "dot": (lambda a, b: jnp.einsum("...i,...i->...", a, b), "any"),
    "dot_batched": (lambda a, b: jnp.einsum("...ij,...kj->...ik", a[None], b[None]), "any"),
    "dot_multi_contract": (lambda a, b: jnp.tensordot(a, b, axes=a.ndim), "any"),
    "concat": (lambda a, b: jnp.concatenate([a, b]), "any"),
    "select": (lambda a, b: lax.select(a > 0, a, b), "any"),
    "dus": (lambda a, b: lax.dynamic_update_slice_in_dim(a, b[:1], 0, 0), "any"),
    "scatter_add": (lambda a, b: a.at[IDX].add(b[:3]), "any"),
}


def _reference(f, *args):
    return jax.tree.map(np.asarray, f(*[jnp.asarray(a) for a in args]))


def _assert_close(actual, expected, where):
    actual, expected = jax.tree.leaves(actual), jax.tree.leaves(expected)
    assert len(actual) == len(expected), where
    for a, e in zip(actual, expected):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape and a.dtype == e.dtype, (where, a.dtype, e.dtype)
        a, e = a.astype(np.float64) if a.dtype.kind == "f" else a, e
        if np.issubdtype(e.dtype, np.floating):
            np.testing.assert_allclose(
                a.astype(np.float64), e.astype(np.float64), rtol=2e-6, atol=1e-30, err_msg=where
            )
        else:
            np.testing.assert_array_equal(a, e, err_msg=where)


scale_exps = st.integers(min_value=-30, max_value=30)
shape_idx = st.integers(min_value=0, max_value=len(SHAPES) - 1)
seeds = st.integers(min_value=0, max_value=2**31 - 1)
SETTINGS = settings(
    max_examples=6, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)


@pytest.mark.parametrize("name", sorted(UNARY))
@SETTINGS
@given(exp=scale_exps, si=shape_idx, seed=seeds)
def test_unary_rule_preserves_values(name, exp, si, seed):
    fn, kind = UNARY[name]
    shape = (
        SHAPES[si]
        if name
        not in {
            "gather",
            "scatter_add",
            "scatter_add_zeros",
            "scatter",
            "scatter_sub",
            "scatter_mul",
            "scatter_max",
            "scatter_min",
            "grad_gather",
        }
        else (4,) + SHAPES[si][1:]
    )
    if name in {"split", "unstack", "dynamic_update_slice"}:
        shape = (4,) + SHAPES[si][1:]
    x = _domain(kind, np.random.default_rng(seed), shape)
    expected = _reference(fn, x)
    scaled = ss.as_scaled_array(jnp.asarray(x), scale=2.0**exp)
    out = ss.scalify(fn)(scaled)
    _assert_close(ss.asarray(out), expected, f"{name} scale=2**{exp} shape={shape}")


def _np_cast(dtype):
    return lambda d: d.astype(dtype).astype(np.float64)


# name -> (function under test, what it does to the data: an independent reference)
CASTS = {
    "f16": (lambda x: x.astype(jnp.float16), _np_cast(np.float16)),
    "bf16": (lambda x: x.astype(jnp.bfloat16), _np_cast(ml_dtypes.bfloat16)),
    "e4m3": (lambda x: x.astype(jnp.float8_e4m3fn), _np_cast(ml_dtypes.float8_e4m3fn)),
    "e5m2": (lambda x: x.astype(jnp.float8_e5m2), _np_cast(ml_dtypes.float8_e5m2)),
    "cast_on_forward_e4m3": (
        lambda x: ss.ops.cast_on_forward(x, jnp.float8_e4m3fn),
        _np_cast(ml_dtypes.float8_e4m3fn),
    ),
}


@pytest.mark.parametrize("name", sorted(CASTS))
@SETTINGS
@given(exp=st.integers(min_value=-4, max_value=30), seed=seeds)
def test_casts_round_the_scaled_data(name, exp, seed):
    """A cast under scalify is a real cast of the data: the value is data rounded to the
    format, times the scale (checked with ml_dtypes, not with JAX)."""
    fn, on_data = CASTS[name]
    x = _domain("any", np.random.default_rng(seed), (64,))
    s = 2.0**exp
    expected = on_data((x / s).astype(np.float32)) * s
    # normalize=False: the cast applies to the data exactly as passed (x / s)
    out = ss.scalify(fn, normalize=False)(ss.as_scaled_array(jnp.asarray(x), scale=s))
    assert isinstance(out, ss.ScaledArray)
    np.testing.assert_array_equal(np.asarray(out.to_array(jnp.float32), np.float64), expected)


def _reduced(x: np.ndarray, e: int, m: int) -> np.ndarray:
    """NumPy reference of XLA's reduce_precision to ``e`` exponent and ``m`` mantissa
    bits: the mantissa rounded half to even at the value's own exponent, then a result
    above the format's largest value is inf and one below its smallest normal a signed
    zero (XLA flushes the format's subnormals; matched bit for bit on 200 000 values)."""
    x = np.asarray(x, np.float64)
    frac, exp = np.frexp(x)
    r = np.ldexp(np.rint(np.ldexp(frac, m + 1)), exp - m - 1)
    bias = 2 ** (e - 1) - 1
    r = np.where(np.abs(r) > (2 - 2.0**-m) * 2.0**bias, np.copysign(np.inf, x), r)
    return np.where(np.abs(r) < 2.0 ** (1 - bias), np.copysign(0.0, x), r)


@pytest.mark.parametrize("bits", [(5, 10), (8, 7), (5, 2), (4, 3)])
@SETTINGS
@given(exp=st.integers(min_value=-30, max_value=30), seed=seeds)
def test_reduce_precision_rounds_the_value_whatever_the_scale(bits, exp, seed):
    """``lax.reduce_precision`` emulates a format on the value (a program's own fake
    quantisation), so under scalify it gives what plain JAX gives, whatever the data's
    scale: each value rounded to the format, overflow to inf and flushes included."""
    rng = np.random.default_rng(seed)
    # magnitudes from 2^-30 to 2^20: beyond the emulated format at both ends
    x = (rng.standard_normal(64) * 2.0 ** rng.integers(-30, 21, 64)).astype(np.float32)
    out = ss.scalify(lambda v: lax.reduce_precision(v, *bits))(
        ss.as_scaled_array(jnp.asarray(x), scale=2.0**exp)
    )
    np.testing.assert_array_equal(np.asarray(ss.asarray(out), np.float64), _reduced(x, *bits))


def test_user_written_fake_quantisation_is_the_plain_functions():
    """A qwix/AQT-style fake quantisation (per-tensor abs-max scaling into E4M3's 240,
    ``reduce_precision``, scaled back) of heavy-tailed values: bit for bit the plain
    function's result at any input scale. Rounding the data instead (scale 128, data
    abs-max 1.9) flushed 68 % of the elements to zero, against 0.5 % in plain JAX."""

    def fake_quant(x, fmax=240.0):
        s = jnp.max(jnp.abs(x)) / fmax
        return lax.reduce_precision(jnp.clip(x / s, -fmax, fmax), 4, 3) * s

    x = jnp.asarray(np.random.default_rng(0).standard_t(2, size=4096) * 0.05, jnp.float32)
    plain = np.asarray(jax.jit(fake_quant)(x))
    assert np.mean(plain == 0) < 0.01
    for scaled in (ss.as_scaled_array(x, "rms"), ss.as_scaled_array(x, scale=2.0**-10)):
        out = np.asarray(ss.asarray(jax.jit(ss.scalify(fake_quant))(scaled)))
        np.testing.assert_array_equal(out, plain)


@pytest.mark.parametrize("name", sorted(BINARY))
@pytest.mark.parametrize("second", ["scaled", "plain"])
@SETTINGS
@given(exp_a=scale_exps, exp_b=scale_exps, si=shape_idx, seed=seeds)
def test_binary_rule_preserves_values(name, second, exp_a, exp_b, si, seed):
    fn, kind = BINARY[name]
    shape = (4,) + SHAPES[si][1:]
    rng = np.random.default_rng(seed)
    a, b = _domain(kind, rng, shape), _domain(kind, rng, shape)
    expected = _reference(fn, a, b)
    sa = ss.as_scaled_array(jnp.asarray(a), scale=2.0**exp_a)
    sb = ss.as_scaled_array(jnp.asarray(b), scale=2.0**exp_b) if second == "scaled" else b
    out = ss.scalify(fn)(sa, sb)
    _assert_close(ss.asarray(out), expected, f"{name} 2**{exp_a} 2**{exp_b} {second}")


# Names registered only as aliases for older/newer JAX spellings of the same primitive.
_ALIASES = {
    "debug_print",  # the name of debug_callback in other JAX releases
    "pjit",
    "checkpoint",
    "custom_vjp_call_jaxpr",
    "closed_call",
    "core_call",
    "eval_jaxpr",  # JAX 0.11's closed_call
    "sharding_constraint",
    "real",
    "expand_dims",
    "iota",
}
# Collectives and shard_map need several devices: their value tests (against NumPy, per
# device scales) run on 8 host devices in tests/test_collectives.py.
_MULTI_DEVICE = {
    "all_gather",
    "all_gather_invariant",
    "all_to_all",
    "axis_index",
    "pbroadcast",
    "pmax",
    "pmin",
    "ppermute",
    "psum",
    "psum_invariant",
    "pvary",
    "reduce_scatter",
    "shard_map",
}


def _spd(a):
    return a @ a.T + a.shape[0] * jnp.eye(a.shape[0], dtype=a.dtype)


# name -> (function of one scaled square matrix, NumPy reference in float64)
LINALG = {
    "cholesky": (lambda a: jnp.linalg.cholesky(_spd(a)), lambda a: np.linalg.cholesky(_np_spd(a))),
    "triangular_solve": (
        lambda a: jax.scipy.linalg.solve_triangular(jnp.linalg.cholesky(_spd(a)), a, lower=True),
        lambda a: np.linalg.solve(np.linalg.cholesky(_np_spd(a)), a),
    ),
    "eigh": (lambda a: jnp.linalg.eigh(_spd(a))[0], lambda a: np.linalg.eigvalsh(_np_spd(a))),
    "qr": (  # Q and R (their signs are a convention)
        lambda a: [jnp.abs(m) for m in jnp.linalg.qr(a)],
        lambda a: [np.abs(m) for m in np.linalg.qr(a)],
    ),
    "svd": (
        lambda a: jnp.linalg.svd(a, compute_uv=False),
        lambda a: np.linalg.svd(a, compute_uv=False),
    ),
    "lu": (lambda a: jnp.linalg.det(a), np.linalg.det),
    "solve": (lambda a: jnp.linalg.solve(_spd(a), a), lambda a: np.linalg.solve(_np_spd(a), a)),
    "fft": (lambda a: jnp.abs(jnp.fft.rfft(a)), lambda a: np.abs(np.fft.rfft(a))),
}
# One generic rule (`rules_linalg.on_values`) serves these too; the public jnp functions
# above reach the others.
_LINALG_SAME_RULE = {
    "cholesky_update",
    "eig",
    "hessenberg",
    "householder_product",
    "ormqr",
    "schur",
    "symmetric_product",
    "tridiagonal",
    "tridiagonal_solve",
}


def _np_spd(a):
    return a @ a.T + a.shape[0] * np.eye(a.shape[0])


@pytest.mark.parametrize("name", sorted(LINALG))
@pytest.mark.parametrize("exp", [-20, 17])
def test_linear_algebra_rules_compute_the_plain_values(name, exp):
    fn, ref = LINALG[name]
    a = np.random.default_rng(0).normal(0.0, 1.0, (6, 6)).astype(np.float32)
    out = ss.scalify(fn)(ss.as_scaled_array(jnp.asarray(a), scale=2.0**exp))
    expected = ref(a.astype(np.float64))
    np.testing.assert_allclose(
        np.asarray(ss.asarray(out), np.float64), expected, rtol=2e-4, atol=1e-5
    )
    _assert_close(ss.asarray(out), _reference(fn, a), f"{name} against the plain function")


@functools.cache
def _primitives_in(fn, nargs):
    x = jnp.ones((4, 3), jnp.float32)
    return primitives_in(jax.make_jaxpr(fn)(*([x] * nargs)))


def test_cases_cover_every_registered_rule():
    covered = set()
    for fn, _ in UNARY.values():
        covered |= _primitives_in(fn, 1)
    for fn, _ in BINARY.values():
        covered |= _primitives_in(fn, 2)
    for fn, _ in CASTS.values():
        covered |= _primitives_in(fn, 1)
    for fn, _ in LINALG.values():
        covered |= primitives_in(jax.make_jaxpr(fn)(jnp.ones((4, 4), jnp.float32)))
    covered |= _LINALG_SAME_RULE
    covered.add("reduce_precision")  # test_reduce_precision_rounds_the_value_whatever_the_scale
    # test_self_scaled.py::test_flax_fp8_meta_in_its_max_gradient_dtype_runs_under_scalify
    covered |= {"to_edtype", "from_edtype"}
    missing = set(registered_primitives()) - covered - _ALIASES - _MULTI_DEVICE
    assert not missing, f"rules without a value test: {sorted(missing)}"


#: JAX's primitives that need no scaled rule: they never take a float operand that could
#: be scaled (integers, bits, RNG keys, tokens, state references, JAX-internal).
_NO_FLOAT_OPERAND = {
    "and", "or", "xor", "not", "clz", "population_count", "shift_left",
    "shift_right_arithmetic", "shift_right_logical", "reduce_and", "reduce_or",
    "reduce_xor", "random_bits", "random_fold_in", "random_seed", "random_split",
    "random_wrap", "random_unwrap", "threefry2x32", "rng_bit_generator", "rng_uniform",
    "after_all", "create_token", "get", "swap", "empty2", "custom_lin",
}  # fmt: skip
#: Primitives a scaled operand cannot reach yet (scalify raises, naming the primitive and
#: the user's line, or runs them unscaled with ``fallback="unscale"``).
_KNOWN_GAPS = {
    "call", "conj", "imag", "reduce", "reduce_window", "select_and_scatter",
    "ragged_all_to_all",
}  # fmt: skip


def test_every_primitive_jax_exports_has_a_rule_or_takes_no_scaled_operand():
    """A primitive a new JAX release adds (0.11's ``log2`` and ``one_minus_square``, in
    the derivative of tanh) must be given a rule or classified here, not found by the
    first step that meets it."""
    import jax.extend.core.primitives as prims

    names = {getattr(prims, n).name for n in dir(prims) if n.endswith("_p")}
    assert len(names) > 100  # the module still lists JAX's primitives
    missing = {n for n in names if not has_rule(n)} - _NO_FLOAT_OPERAND - _KNOWN_GAPS
    assert not missing, f"primitives without a scaled rule or a class here: {sorted(missing)}"


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16])
def test_a_constant_times_a_scale_at_the_edge_of_float32_keeps_the_value(dtype):
    """``x * c`` with ``c`` not a power of two multiplies the data by the mantissa of
    ``c`` and the scale by its power of two; where that product leaves float32's normal
    range, the excess joins the mantissa (one pass over the data). Checked against
    NumPy + ml_dtypes at both edges of the range, and bit for bit inside it."""
    data = np.array([1.5, -3.0, 0.25, 0.0, 2.0], dtype)
    cases = [
        (2.0**-124, 0.1, "low"),  # 0.1 = 0.8 * 2^-3: the scale would be 2^-127
        (2.0**125, 12.0, "high"),  # 12 = 0.75 * 2^4: the scale would be 2^129
        (2.0**-3, 0.1, "inside"),
    ]
    f = jax.jit(ss.scalify(lambda x, c: x * c[0]), static_argnums=1)
    for scale, c, where in cases:
        out = f(ss.ScaledArray(jnp.asarray(data), jnp.float32(scale)), (c,))
        s = float(out.scale)
        assert 2.0**-126 <= s <= 2.0**127, (where, s)
        mant, _ = np.frexp(c)  # c = mant * 2^e, mant in [0.5, 1)
        # the data times the mantissa as the data's dtype holds it, rounded to that
        # dtype (as ml_dtypes computes it), then the exact power of two of scale * c
        times_mant = (data * np.asarray(mant, dtype)).astype(dtype)
        want = times_mant.astype(np.float64) * (scale * c / mant)
        got = np.asarray(out.data).astype(np.float64) * s
        np.testing.assert_array_equal(got, want)
        if where == "inside":  # the scale takes the power of two; the data only the mantissa
            assert s == scale * c / mant
            np.testing.assert_array_equal(np.asarray(out.data), times_mant)


def test_a_product_with_an_all_zero_tensor_is_zero_not_nan():
    """A zero-initialised weight (a classifier head, a LoRA B matrix) is scale 0 once
    normalised; ``x @ w`` multiplied the remainder's split of the scale product (4 x
    2^126: inf) by that 0 and gave NaN data, so the loss and every gradient were NaN.
    NumPy (float64) is the reference."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 16)).astype(np.float32)
    w = np.zeros((16, 5), np.float32)

    def loss(x, w):
        return jax.nn.log_softmax(x @ w).sum()

    want = np.float64(-20 * np.log(5.0))  # uniform logits: log(1/5) per entry
    for run in (ss.scalify(loss), jax.jit(ss.scalify(loss))):
        got = ss.asarray(run(ss.as_scaled_array(x, scale=4.0), ss.as_scaled_array(w)))
        np.testing.assert_allclose(float(got), want, rtol=1e-6)
    grad = jax.jit(ss.scalify(jax.grad(loss, argnums=1)))(x, ss.as_scaled_array(w))
    x64 = x.astype(np.float64)
    want_grad = x64.T @ (np.ones((4, 5)) - 5 * np.full((4, 5), 0.2))  # d/dw = x^T (1 - 5 p)
    np.testing.assert_allclose(np.asarray(ss.asarray(grad)), want_grad, atol=1e-5)
    out = ss.scalify(lambda x, w: x @ w)(x, ss.as_scaled_array(w))
    assert np.array_equal(np.asarray(ss.asarray(out)), np.zeros((4, 5)))
    assert float(out.scale) == 0.0  # the all-zero mark: it sets no scale downstream
    # ... so a plain target subtracted from a zero-initialised head's output keeps its
    # own scale (at 2^-126 it was lifted to data ~2^126 and the L1 loss's sum was inf)
    t = rng.normal(size=(4, 5)).astype(np.float32)
    l1 = jax.jit(ss.scalify(lambda w, x, t: jnp.mean(jnp.abs(x @ w - t))))
    got = float(ss.asarray(l1(ss.as_scaled_array(w), x, t)))
    np.testing.assert_allclose(got, np.mean(np.abs(t.astype(np.float64))), rtol=1e-6)


def test_checkpoint_names_complex_numbers_and_gamma_samples_have_rules():
    """Primitives other people's models bind: ``checkpoint_name`` (remat policies in
    MaxText-style models), ``lax.complex`` (a complex RoPE), ``random_gamma`` (a scaled
    shape parameter: gamma, beta, dirichlet). Each was "no scaled rule"."""
    from jax.ad_checkpoint import checkpoint_name

    x = np.random.default_rng(3).normal(size=(4, 8)).astype(np.float32)
    sx = ss.as_scaled_array(x, scale=2.0**-4)
    x64 = x.astype(np.float64)
    tagged = ss.scalify(lambda v: jnp.sum(checkpoint_name(jnp.tanh(v), "h")))(sx)
    np.testing.assert_allclose(float(ss.asarray(tagged)), np.tanh(x64).sum(), rtol=1e-5)

    def rope(v):
        z = lax.complex(v[:, 0::2], v[:, 1::2]) * (1 + 2j)
        return jnp.sum(z.real), jnp.sum(z.imag)

    re_, im_ = jax.jit(ss.scalify(rope))(sx)
    z = (x64[:, 0::2] + 1j * x64[:, 1::2]) * (1 + 2j)
    np.testing.assert_allclose([float(ss.asarray(re_)), float(ss.asarray(im_))],
                               [z.real.sum(), z.imag.sum()], rtol=1e-5)  # fmt: skip

    def gamma(v):
        return jax.random.gamma(jax.random.key(0), jnp.abs(v) + 1.0)

    np.testing.assert_allclose(
        np.asarray(ss.asarray(ss.scalify(gamma)(sx))), np.asarray(gamma(x)), rtol=1e-5
    )


def test_a_plain_value_added_to_an_all_zero_tensor_keeps_its_own_scale():
    """A BatchNorm's running mean is zeros at step 0 (scale 0 once normalised): ``x -
    mean`` with a plain batch took the least scale x fits in (2^-123), its data ~1e38,
    and ``sum((x - mean)**2)`` was inf. NumPy (float64) is the reference."""
    x = (np.random.default_rng(1).normal(size=(4, 16)) * 3 + 1).astype(np.float32)
    mean = np.zeros(16, np.float32)

    def ssq(mean, x):
        d = x - mean
        return jnp.sum(d * d)

    want = float(np.sum(x.astype(np.float64) ** 2))
    for run in (ss.scalify(ssq), jax.jit(ss.scalify(ssq))):
        got = run(ss.as_scaled_array(mean), x)
        np.testing.assert_allclose(float(ss.asarray(got)), want, rtol=1e-6)
    d = ss.scalify(lambda m, x: x - m)(ss.as_scaled_array(mean), x)
    assert float(d.scale) == 1.0 and float(jnp.abs(d.data).max()) < 2**8


@pytest.mark.parametrize("traced_constant", [False, True])
def test_a_product_of_scales_beyond_float32_moves_the_excess_into_the_data(traced_constant):
    """Scales are kept in float32's normal range: a product beyond it is clamped and the
    exact remainder joins the data. Above the range that remainder was computed through
    1 / 2^127, a subnormal that XLA's CPU code flushes to zero, so the value became 0.
    Checked against NumPy (float64) for scaled x scaled and scaled x traced scalar, at
    both edges."""
    xd = np.array([1.5, -3.0, 0.25, 0.0, 2.0], np.float32)
    yd = np.array([2.0, 0.5, -4.0, 1.0, -1.0], np.float32)
    if traced_constant:  # a scalar computed in the step (a bias correction, say)
        f = jax.jit(ss.scalify(lambda x, c: x * c))
        cases = [(2.0**125, 12.0), (2.0**-124, 0.1), (2.0**100, 2.0**40)]
    else:
        f = jax.jit(ss.scalify(lambda x, y: x * y))
        cases = [(2.0**120, 2.0**20), (2.0**-120, 2.0**-20), (2.0**127, 2.0**8)]
    for sx, other in cases:
        x = ss.ScaledArray(jnp.asarray(xd), jnp.float32(sx))
        if traced_constant:
            out = f(x, jnp.float32(other))
            want = xd.astype(np.float64) * sx * float(np.float32(other))
        else:
            out = f(x, ss.ScaledArray(jnp.asarray(yd), jnp.float32(other)))
            want = xd.astype(np.float64) * yd * sx * other
        s = float(out.scale)
        assert 2.0**-126 <= s <= 2.0**127, (sx, other, s)
        got = np.asarray(out.data).astype(np.float64) * s
        np.testing.assert_allclose(got, want, rtol=2e-7, atol=0, err_msg=f"{sx} * {other}")
    # a clamped scale is one later rules can align on: at 2^127 its reciprocal was
    # subnormal, and a sum of two such values came out 0
    x = ss.ScaledArray(jnp.asarray(xd), jnp.float32(2.0**120))
    y = jnp.float32(2.0**20) if traced_constant else ss.ScaledArray(jnp.asarray(yd), 2.0**20)
    twice = jax.jit(ss.scalify(lambda x, y: x * y + x * y))(x, y)
    want = 2 * xd.astype(np.float64) * (1.0 if traced_constant else yd) * 2.0**140
    got = np.asarray(twice.data).astype(np.float64) * float(twice.scale)
    np.testing.assert_allclose(got, want, rtol=2e-7, atol=0)


def test_values_at_scale_2_127_align_and_divide_without_flushing_to_zero():
    """float32 holds values up to 2^128, so a scale of 2^127 is a valid input; its
    reciprocal (2^-127) is subnormal, and XLA's CPU code flushes it to zero: aligning
    such a value (a sum, a max) or dividing by it gave 0. The common scale is now at most
    2^126 (the data doubled, exactly). Checked against NumPy (float64)."""
    xd = np.array([0.5, -0.25, 0.125, 0.0], np.float32)
    yd = np.array([0.75, 0.5, -0.25, 1.0], np.float32)
    x = ss.ScaledArray(jnp.asarray(xd), jnp.float32(2.0**127))
    y = ss.ScaledArray(jnp.asarray(yd), jnp.float32(2.0**127))
    xv, yv = xd.astype(np.float64) * 2.0**127, yd.astype(np.float64) * 2.0**127
    cases = {
        "x + x": (lambda x, y: x + x, 2 * xv),
        "x - y": (lambda x, y: x - y, xv - yv),
        "max(x, y)": (jnp.maximum, np.maximum(xv, yv)),
        "x / y": (lambda x, y: x / y, xv / yv),
        "x * 0.5 + y": (lambda x, y: x * 0.5 + y, xv * 0.5 + yv),
    }
    for name, (fn, want) in cases.items():
        out = jax.jit(ss.scalify(fn, normalize=False))(x, y)
        got = np.asarray(out.data).astype(np.float64) * float(out.scale)
        np.testing.assert_allclose(got, want, rtol=2e-7, atol=0, err_msg=name)
    # a quotient far from both: its divisor's reciprocal was 0, and the value NaN
    small = ss.ScaledArray(jnp.asarray(xd), jnp.float32(2.0**100))
    out = jax.jit(ss.scalify(lambda a, b: a / b, normalize=False))(small, y)
    got = np.asarray(out.data).astype(np.float64) * float(out.scale)
    np.testing.assert_allclose(got, xd.astype(np.float64) * 2.0**100 / yv, rtol=2e-7, atol=0)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float16])
def test_a_clip_at_a_formats_max_casts_the_value_the_code_scaled(dtype):
    """MX-style fake quantisation with its own power-of-two scale per column (qwix's
    mxfp8): ``clip(w / s, -max, max).astype(fp8) * s``. Under scalify ``w / s`` was held
    as data ~3 500 at scale 1/8 and the cast cast the data: 91 % NaN. A clip at a
    format's max is the code's own scaling: its result is held at scale 1, and the whole
    function equals the plain one bit for bit."""
    fmax = float(jnp.finfo(dtype).max)

    def fq(w):
        amax = jnp.max(jnp.abs(w), axis=0, keepdims=True)
        s = 2.0 ** jnp.ceil(jnp.log2(amax / fmax))
        return jnp.clip(w / s, -fmax, fmax).astype(dtype).astype(jnp.float32) * s

    w = jnp.asarray(np.random.default_rng(0).standard_normal((64, 64)) * 0.05, jnp.float32)
    plain = np.asarray(jax.jit(fq)(w))
    for scale in ("rms", 2.0**-10):
        out = np.asarray(ss.asarray(jax.jit(ss.scalify(fq))(ss.as_scaled_array(w, scale))))
        np.testing.assert_array_equal(out, plain)


def test_a_clip_elsewhere_keeps_the_common_scale():
    """Only a bound at a narrow format's largest value reads as the code's own scaling:
    another clip is aligned on a common scale as before (not held at scale 1)."""
    v = jnp.linspace(-3.0, 3.0, 16)
    out = jax.jit(ss.scalify(lambda v: jnp.clip(v, -1.0, 2.0)))(ss.as_scaled_array(v, 2.0**-5))
    assert float(out.scale) != 1.0
    np.testing.assert_allclose(ss.asarray(out), np.clip(np.asarray(v), -1, 2), rtol=1e-6)
