"""The scalify transform: composition, caching, scale propagation and errors."""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import fail_on_warnings
from jax import lax

import scalescope as ss


def _rng(shape, seed=0, std=1.0):
    return jnp.asarray(np.random.default_rng(seed).normal(0.0, std, shape).astype(np.float32))


def test_kwargs_pytrees_and_static_leaves():
    def f(params, x, *, train, extra=None):
        y = x @ params["w"] + params["b"]
        if train:
            y = y * 2.0
        return {"y": y, "extra": extra}

    params = {"w": _rng((4, 3)), "b": _rng((3,), 1)}
    x = _rng((2, 4), 2)
    out = ss.scalify(f)(ss.as_scaled_array(params), ss.as_scaled_array(x), train=True, extra=None)
    assert isinstance(out["y"], ss.ScaledArray)
    np.testing.assert_allclose(ss.asarray(out["y"]), f(params, x, train=True)["y"], rtol=1e-6)
    off = ss.scalify(f)(ss.as_scaled_array(params), x, train=False)
    np.testing.assert_allclose(ss.asarray(off["y"]), f(params, x, train=False)["y"], rtol=1e-6)


def test_trace_is_cached_per_signature():
    calls = []

    def f(x):
        calls.append(1)
        return jnp.tanh(x) * 3.0

    g = ss.scalify(f)
    x = ss.as_scaled_array(_rng((5,)), scale=4.0)
    g(x)
    g(ss.as_scaled_array(_rng((5,), 1), scale=0.5))
    assert len(calls) == 1 and g.cache_size() == 1
    g(ss.as_scaled_array(_rng((6,))))
    assert len(calls) == 2 and g.cache_size() == 2


def test_composes_with_jit_outside_and_grad_inside():
    def loss(w, x):
        return jnp.mean(jax.nn.gelu(x @ w) ** 2)

    w, x = _rng((8, 4)), _rng((16, 8), 1)
    step = jax.jit(ss.scalify(jax.value_and_grad(loss)))
    val, grad = step(ss.as_scaled_array(w, 2.0**-6), ss.as_scaled_array(x, 2.0**5))
    ref_val, ref_grad = jax.value_and_grad(loss)(w, x)
    np.testing.assert_allclose(ss.asarray(val), ref_val, rtol=1e-6)
    np.testing.assert_allclose(ss.asarray(grad), ref_grad, rtol=1e-5, atol=1e-9)


def test_closing_over_outer_tracers_is_not_cached_stale():
    @jax.jit
    def f(p, x):
        return ss.scalify(lambda v: v @ p)(x)

    x = ss.as_scaled_array(_rng((3, 4)))
    for seed in range(2):
        p = _rng((4, 2), seed)
        np.testing.assert_allclose(ss.asarray(f(p, x)), ss.asarray(x) @ p, rtol=1e-6)


def test_dot_general_keeps_data_at_unit_scale():
    a, b = _rng((64, 256)), _rng((256, 32), 1)
    out = ss.scalify(jnp.matmul)(ss.as_scaled_array(a), ss.as_scaled_array(b))
    # K=256: output RMS ~ sqrt(256) = 16 is moved into the scale.
    assert float(out.scale) == 16.0
    rms = float(jnp.sqrt(jnp.mean(out.data.astype(jnp.float32) ** 2)))
    assert 0.5 < rms < 2.0


def test_add_and_reduce_scales_follow_unit_scaling():
    x = ss.as_scaled_array(_rng((1024,)), scale=8.0)
    y = ss.as_scaled_array(_rng((1024,), 1), scale=8.0)
    assert float(ss.scalify(jnp.add)(x, y).scale) == 8.0  # pow2_down(sqrt(2) * 8)
    z = ss.as_scaled_array(_rng((1024,), 1), scale=2.0**-3)
    assert float(ss.scalify(jnp.add)(x, z).scale) == 8.0
    s = ss.scalify(jnp.sum)(x)
    assert float(s.scale) == 8.0 * 32.0  # sqrt(1024) = 32
    assert float(ss.scalify(lambda v: v * 0.25)(x).scale) == 2.0


@pytest.mark.parametrize("exp", [-40, 0, 40])
def test_log_softmax_and_relu_survive_extreme_scales(exp):
    v = _rng((4, 10)) * 2.0**exp  # values far from 1, data at unit scale
    f = lambda a: jax.nn.log_softmax(jax.nn.relu(a) - 1.0)
    out = ss.scalify(f)(ss.as_scaled_array(v, scale=2.0**exp))
    assert np.isfinite(float(out.scale)) and float(out.scale) > 0
    assert np.all(np.isfinite(np.asarray(out.data)))
    expected = f(v)
    np.testing.assert_allclose(ss.asarray(out), expected, rtol=1e-5, atol=1e-5)


def _reduce_window(x):
    # a computation JAX does not recognise as a monoid: the generic reduce_window
    # primitive, which has no scaled rule (reduce_window_sum, from lax.add, has one)
    return lax.reduce_window(x, 0.0, lambda a, b: a + b, (2,), (1,), "VALID")


def test_missing_rule_error_names_primitive_and_source_line():
    x = ss.as_scaled_array(_rng((6,)))
    with pytest.raises(ss.ScalifyError) as info:
        ss.scalify(_reduce_window)(x)
    msg = str(info.value)
    assert "'reduce_window'" in msg
    m = re.search(r"test_scalify\.py:(\d+)", msg)
    assert m, msg
    import inspect

    src, start = inspect.getsourcelines(_reduce_window)
    assert start <= int(m.group(1)) < start + len(src)


def test_register_rule_adds_a_rule_and_refuses_to_replace_one_silently():
    """A user's rule for a primitive that has none is used; one for a primitive that has
    a rule is refused (the table is global: jax-scalify refuses too) unless replace=True."""
    from scalescope.scalify.registry import RULES

    x = _rng((6,))
    prim = jax.make_jaxpr(_reduce_window)(x).eqns[0].primitive

    def on_values(*args, **params):  # the value computed plain, returned at scale 1
        return ss.as_scaled_array(prim.bind(*map(ss.asarray, args), **params))

    before = dict(RULES)
    try:
        ss.register_rule(prim, on_values)
        out = ss.scalify(_reduce_window)(ss.as_scaled_array(x, scale=2.0**-8))
        np.testing.assert_allclose(
            np.asarray(ss.asarray(out)), np.convolve(x, [1, 1], "valid"), rtol=1e-6
        )
        with pytest.raises(
            KeyError, match="'reduce_window' already has a scaled rule.*replace=True"
        ):
            ss.register_rule("reduce_window", on_values)
        with pytest.raises(KeyError, match="'mul' already has"):
            ss.register_rule(lax.mul_p, on_values)
        assert RULES["mul"] is before["mul"]
        ss.register_rule(prim, on_values, replace=True)
    finally:
        RULES.clear()
        RULES.update(before)


def test_fallback_policy_runs_on_unscaled_values_and_records_it():
    x = _rng((6,))
    g = ss.scalify(lambda v: _reduce_window(v) * 2.0, fallback="unscale")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = g(ss.as_scaled_array(x, scale=2.0**12))
    np.testing.assert_allclose(np.asarray(ss.asarray(out)), _reduce_window(x) * 2.0, rtol=1e-6)
    assert [fb.primitive for fb in g.fallbacks] == ["reduce_window"]
    assert "test_scalify.py" in g.fallbacks[0].source
    assert any("reduce_window" in str(w.message) for w in caught)


def test_bad_fallback_policy_is_rejected():
    with pytest.raises(ValueError, match="fallback"):
        ss.scalify(jnp.sin, fallback="ignore")


def test_transforms_reject_non_callables(tmp_path):
    for make, name in ((ss.scalify, "scalify"), (ss.instrument, "instrument")):
        with pytest.raises(TypeError, match=f"{name}: fn must be callable, got int"):
            make(3)
    with ss.Run(tmp_path / "run") as run, pytest.raises(TypeError, match="Run.track"):
        run.track(None)


def test_unscaled_inputs_run_unchanged():
    x = _rng((5,))
    out = ss.scalify(lambda v: jnp.tanh(v) @ v)(x)
    assert not isinstance(out, ss.ScaledArray)
    np.testing.assert_allclose(out, jnp.tanh(x) @ x, rtol=1e-6)


def test_scan_carry_structure_is_stable_when_it_becomes_scaled():
    # The carry starts unscaled (zeros) and becomes scaled through the scaled xs.
    def f(xs):
        return lax.scan(lambda c, x: (c + x, c * 2.0), jnp.zeros(3), xs)

    xs = _rng((5, 3))
    carry, ys = ss.scalify(f)(ss.as_scaled_array(xs, 2.0**-9))
    assert isinstance(carry, ss.ScaledArray) and isinstance(ys, ss.ScaledArray)
    ref_c, ref_y = f(xs)
    np.testing.assert_allclose(ss.asarray(carry), ref_c, rtol=1e-6)
    np.testing.assert_allclose(ss.asarray(ys), ref_y, rtol=1e-6)


def test_dynamic_rescale_restores_unit_rms():
    x = ss.as_scaled_array(_rng((4096,), std=2.0**-12))  # data far from unit scale
    out = ss.scalify(ss.ops.dynamic_rescale_l2)(x)
    rms = float(jnp.sqrt(jnp.mean(out.data**2)))
    assert 1.0 <= rms < 2.0
    np.testing.assert_array_equal(np.asarray(ss.asarray(out)), np.asarray(ss.asarray(x)))
    # outside scalify the ops are identities
    v = _rng((3,))
    for op in (ss.ops.dynamic_rescale_l1, ss.ops.dynamic_rescale_l2, ss.ops.dynamic_rescale_max):
        np.testing.assert_array_equal(op(v), v)
        np.testing.assert_array_equal(jax.jit(op)(v), v)
    np.testing.assert_array_equal(ss.ops.stop_scaling(v), v)
    np.testing.assert_array_equal(ss.ops.set_scaling(v, 4.0), v)


def test_dynamic_rescale_of_a_whole_state_rescales_each_float_leaf():
    """``state = ss.ops.dynamic_rescale_l2(state)`` on a pytree, as jax-scalify's
    quickstart writes it: every floating-point leaf is rescaled on its own, an integer
    leaf (an optimizer's count) is left as it is, in and out of scalify. A lone
    non-float value is refused naming its type."""
    w = ss.ScaledArray(jnp.full((4,), 2.0**-10, jnp.float32), jnp.float32(1.0))
    b = ss.ScaledArray(jnp.full((2,), 64.0, jnp.float32), jnp.float32(1.0))
    state = {"w": w, "b": b, "count": jnp.int32(3)}
    for fn in (ss.ops.dynamic_rescale_l2, jax.jit(ss.ops.dynamic_rescale_l2)):
        out = fn(state)
        assert float(out["w"].scale) == 2.0**-10 and float(out["b"].scale) == 64.0
        np.testing.assert_array_equal(np.asarray(out["w"].data), np.ones(4, np.float32))
        assert int(out["count"]) == 3
    inside = ss.scalify(lambda s: ss.ops.dynamic_rescale_max(s))(state)
    assert float(inside["b"].scale) == 64.0
    grads = jax.grad(lambda s: jnp.sum(ss.ops.dynamic_rescale_l2_grad(s)["x"]))({"x": jnp.ones(2)})
    np.testing.assert_array_equal(np.asarray(grads["x"]), [1.0, 1.0])
    with pytest.raises(TypeError, match="dynamic_rescale_l2: expected a floating-point .* got str"):
        ss.ops.dynamic_rescale_l2("w")
    with pytest.raises(TypeError, match="got int32"):
        ss.ops.dynamic_rescale_l2(jnp.int32(3))


@pytest.mark.parametrize("jit", [False, True])
def test_an_operand_of_infinite_scale_sets_no_common_scale(jit):
    """max/min/concatenate of a finite value with one whose scale is inf (jax-scalify's
    "inf scale" case): the finite operand keeps its values (it was aligned to a scale
    clamped at 2^126 and flushed to zero) and the other its infinities."""
    wrap = jax.jit if jit else (lambda f: f)
    x = ss.ScaledArray(np.array([-1e-3, 2e-3], np.float32), np.float32(4))
    y = ss.ScaledArray(np.array([-np.inf, np.inf], np.float32), np.float32(np.inf))
    vx, vy = np.float32([-4e-3, 8e-3]), np.float32([-np.inf, np.inf])
    for prim, ref in ((lax.max, np.maximum(vx, vy)), (lax.min, np.minimum(vx, vy))):
        out = wrap(ss.scalify(prim))(x, y)
        np.testing.assert_array_equal(np.asarray(out, np.float32), ref)
        assert np.isfinite(float(out.scale)) and float(out.scale) < 1.0
    cat = wrap(ss.scalify(lambda a, b: jnp.concatenate([a, b])))(x, y)
    np.testing.assert_array_equal(np.asarray(cat, np.float32), np.concatenate([vx, vy]))


@pytest.mark.parametrize("jit", [False, True])
def test_joining_exact_zeros_keeps_the_zero_mark(jit):
    """Concatenating or padding tensors of scale 0 (exactly zero) gives scale 0, as
    jax-scalify's tests ask: the mark is what lets a later FP16 sum take the other
    operand's scale; with scale 1 a sum with 1.5 * 2^-30 flushed to zero in FP16."""
    wrap = jax.jit if jit else (lambda f: f)
    z = ss.ScaledArray(jnp.ones((2,), jnp.float16), jnp.float32(0))
    small = ss.ScaledArray(jnp.full((4,), 1.5, jnp.float16), jnp.float32(2.0**-30))
    cat = wrap(ss.scalify(lambda a: jnp.concatenate([a, a])))(z)
    assert float(cat.scale) == 0.0 and not np.asarray(cat, np.float32).any()
    for join in (
        lambda a: jnp.concatenate([a, a]),
        lambda a: lax.pad(a, jnp.float16(0), [(1, 1, 0)]),
    ):
        out = wrap(ss.scalify(lambda a, s: join(a) + s))(z, small)  # noqa: B023
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.full(4, 1.5 * 2.0**-30))
    # a non-zero operand still sets the scale
    one = ss.ScaledArray(jnp.ones((2,), jnp.float16), jnp.float32(8))
    mixed = wrap(ss.scalify(lambda a, b: jnp.concatenate([a, b])))(z, one)
    np.testing.assert_array_equal(np.asarray(mixed, np.float32), [0, 0, 8, 8])


def test_scale_ops_under_vmap():
    """vmap over the value (the scale argument not batched) keeps the ops identities;
    a batched scale is refused by name."""
    v = _rng((4, 3))
    for op in (
        ss.ops.dynamic_rescale_l2,
        ss.ops.stop_scaling,
        lambda x: ss.ops.set_scaling(x, 4.0),
    ):
        np.testing.assert_array_equal(jax.vmap(op)(v), v)
    with pytest.raises(ValueError, match="set_scaling: the scale argument cannot be batched"):
        jax.vmap(ss.ops.set_scaling)(v, jnp.ones(4))


def test_dynamic_rescale_grad_rescales_only_the_gradient():
    def loss(x):
        return jnp.sum(ss.ops.dynamic_rescale_l2_grad(x) * 2.0**-20)

    x = ss.as_scaled_array(_rng((256,)))
    g = ss.scalify(jax.grad(loss))(x)
    # the raw gradient is 2**-20 everywhere; after rescaling its data is unit
    np.testing.assert_array_equal(np.asarray(g.data), np.ones(256, np.float32))
    assert float(g.scale) == 2.0**-20
    assert jax.grad(loss)(jnp.ones(3)).tolist() == [2.0**-20] * 3


@pytest.mark.parametrize("jit", [False, True])
def test_ops_take_scaled_arrays_outside_scalify(jit):
    # float16 data [2, -3] * 4 (abs-max 12), [1, -6] * 4 (mean |.| 14), [4, -8] * 4
    # (RMS 25.3): the scale moves to the power of two of the norm, the value stays
    wrap = jax.jit if jit else (lambda f: f)
    cases = [
        (ss.ops.dynamic_rescale_max, [2.0, -3.0], 8.0),
        (ss.ops.dynamic_rescale_l1, [1.0, -6.0], 8.0),
        (ss.ops.dynamic_rescale_l2, [4.0, -8.0], 16.0),
    ]
    for op, data, scale in cases:
        x = ss.ScaledArray(jnp.asarray(data, jnp.float16), jnp.float32(4.0))
        out = wrap(op)(x)
        assert isinstance(out, ss.ScaledArray) and out.dtype == jnp.float16
        assert float(out.scale) == scale, op.__name__
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.float32(data) * 4)
    x = ss.ScaledArray(jnp.asarray([3.0, 300.0]), jnp.float32(0.5))
    cast = wrap(lambda v: ss.ops.cast_on_forward(v, jnp.float8_e4m3fn))(x)
    expected = np.float32([3.0, 300.0]).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(cast.data), expected)  # 300 -> 288
    assert float(cast.scale) == 0.5
    plain = wrap(ss.ops.stop_scaling)(x)
    assert not isinstance(plain, ss.ScaledArray)
    np.testing.assert_array_equal(np.asarray(plain), [1.5, 150.0])
    half = wrap(lambda v: ss.ops.stop_scaling(v, np.float16))(x)
    assert half.dtype == np.float16 and not isinstance(half, ss.ScaledArray)
    np.testing.assert_array_equal(np.asarray(half), np.float16([1.5, 150.0]))
    moved = wrap(ss.ops.set_scaling)(x, 2.0**-3)
    assert float(moved.scale) == 2.0**-3
    np.testing.assert_array_equal(np.asarray(moved.data), [12.0, 1200.0])
    same = wrap(ss.ops.dynamic_rescale_l2_grad)(x)  # the identity forward
    np.testing.assert_array_equal(np.asarray(same), np.asarray(x))


def test_ops_reject_bad_dtypes():
    with pytest.raises(TypeError, match="dynamic_rescale_l2"):
        ss.ops.dynamic_rescale_l2(jnp.arange(3))
    with pytest.raises(TypeError, match="cast_on_forward"):
        ss.ops.cast_on_forward(jnp.ones(3), jnp.int8)


def test_cast_on_forward_and_backward_act_on_one_pass():
    f8, e5 = jnp.float8_e4m3fn, jnp.float8_e5m2
    x = jnp.array([1.0, 1.06, 3.3], jnp.float32)
    y = ss.ops.cast_on_forward(x, f8)
    np.testing.assert_array_equal(y, x.astype(f8).astype(jnp.float32))
    g = jax.grad(lambda v: jnp.sum(ss.ops.cast_on_forward(v, f8) * 1.03))(x)
    np.testing.assert_allclose(g, 1.03, rtol=1e-7)  # gradient not rounded
    gb = jax.grad(lambda v: jnp.sum(ss.ops.cast_on_backward(v, e5) * 1.03))(x)
    assert float(gb[0]) == float(jnp.float32(1.03).astype(e5).astype(jnp.float32))


def test_flax_module_under_scalify():
    flax_nn = pytest.importorskip("flax.linen")

    class MLP(flax_nn.Module):
        @flax_nn.compact
        def __call__(self, x):
            x = flax_nn.relu(flax_nn.Dense(16)(x))
            x = flax_nn.LayerNorm()(x)
            return flax_nn.Dense(4)(x)

    model = MLP()
    x = _rng((8, 5))
    params = model.init(jax.random.PRNGKey(0), x)
    out = jax.jit(ss.scalify(model.apply))(ss.as_scaled_array(params), ss.as_scaled_array(x, 4.0))
    np.testing.assert_allclose(ss.asarray(out), model.apply(params, x), rtol=1e-5, atol=1e-6)


def test_mul_and_div_by_a_traced_scalar_move_its_power_of_two_into_the_scale():
    # Adam's bias correction 1 - 0.999**t is a traced scalar: dividing FP16 data by 0.002
    # directly would overflow (260 / 0.002 > 65504).
    data = jnp.array([260.0, -3.0, 0.5], jnp.float16)
    x = ss.ScaledArray(data, jnp.float32(2.0**-24))

    def f(x, t):
        c = 1.0 - 0.999 ** t.astype(jnp.float16)
        return x / c, x * c, c / x

    t = jnp.int32(2)
    q, m, r = jax.jit(ss.scalify(f))(x, t)
    c = 1.0 - 0.999 ** np.float16(2.0)
    ref = np.asarray(data, np.float64) * 2.0**-24
    for out, expected in [(q, ref / c), (m, ref * c), (r, c / ref)]:
        assert isinstance(out, ss.ScaledArray) and out.dtype == jnp.float16
        assert 1.0 <= float(np.max(np.abs(np.asarray(out.data, np.float64)))) < 2 * 65504
        value = np.asarray(out.data, np.float64) * float(out.scale)  # beyond FP16's range
        np.testing.assert_allclose(value, expected, rtol=2e-3)


def test_dynamic_rescale_of_all_zero_data_gives_scale_zero():
    x = ss.ScaledArray(jnp.zeros(4, jnp.float16), jnp.float32(2.0**21))
    out = ss.scalify(ss.ops.dynamic_rescale_l2)(x)
    assert float(out.scale) == 0.0 and not np.any(np.asarray(out.data))

    def adam_like(g):  # 0 / (sqrt(0) + eps) is 0, not 0 / 0
        g = ss.ops.dynamic_rescale_l2(g)
        return g / (jnp.sqrt(g * g) + 1e-6)

    np.testing.assert_array_equal(np.asarray(ss.asarray(ss.scalify(adam_like)(x))), np.zeros(4))


def test_scales_known_at_trace_time_emit_no_operations():
    """After a non-linear op (scale 1, static) the scale arithmetic of mul, add, sum and
    division by constants is folded at trace time: the scalified jaxpr holds no more
    equations than the plain one plus the unscaling of the output, and the values match
    NumPy."""
    x = np.linspace(-2.0, 2.0, 64, dtype=np.float32).reshape(8, 8)

    def f(v):
        t = jnp.tanh(v)
        return jnp.sum(t * 3.0 + 0.5, axis=0) / 4.0

    plain = jax.make_jaxpr(f)(x)
    # normalize=False: the input's own normalisation reads its data (not folded)
    scaled = jax.make_jaxpr(ss.scalify(f, normalize=False))(ss.as_scaled_array(x))
    # the plain ops, one rescale of the data per op at most, and no scalar work
    assert len(scaled.eqns) <= 2 * len(plain.eqns), scaled
    scalar_ops = [
        e for e in scaled.eqns if all(getattr(v.aval, "shape", None) == () for v in e.outvars)
    ]
    assert len(scalar_ops) <= 2, scalar_ops
    out = ss.scalify(f)(ss.as_scaled_array(x))
    ref = np.sum(np.tanh(x.astype(np.float64)) * 3.0 + 0.5, axis=0) / 4.0
    np.testing.assert_allclose(np.asarray(ss.asarray(out)), ref, rtol=1e-6)
    assert isinstance(out.scale, jax.Array)  # static scales leave scalify as JAX arrays


def test_adding_a_literal_zero_is_free_and_exact():
    """``x + 0.0``, ``0.0 + x`` and ``x - 0.0`` (optax's ``eps_root``) return ``x`` with
    its scale and emit nothing; ``0.0 - x`` is one negation of the data. Values, inf and
    NaN included, equal NumPy's at a traced scale far from 1."""
    x = np.array([1.5, -2.0, 0.0, np.inf, -np.inf, np.nan, 3e-5, 7.0], np.float32)
    scaled_x = ss.as_scaled_array(x, scale=2.0**-20)

    def f(v):
        return v + 0.0, 0.0 + v, v - 0.0, 0.0 - v

    jaxpr = jax.make_jaxpr(ss.scalify(f, normalize=False))(scaled_x)
    assert [e.primitive.name for e in jaxpr.eqns] == ["neg"], jaxpr
    outs = jax.jit(ss.scalify(f))(scaled_x)
    refs = (x + 0.0, 0.0 + x, x - 0.0, 0.0 - x)
    for out, ref in zip(outs, refs, strict=True):
        np.testing.assert_array_equal(np.asarray(ss.asarray(out)), ref)


def test_division_by_a_traced_scalar_moves_its_power_of_two_into_the_scale():
    """Dividing by a scalar computed in the step (Adam's bias correction ``1 - b**t``)
    divides the data by the scalar's mantissa only: at t=1 with b=0.999 the plain data
    would grow 1000x, the scaled data stays within [1, 2) of the input's; the value
    equals NumPy's float32 division."""
    x = np.array([1.0, -0.5, 0.25, 0.75], np.float32)

    def f(v, t):
        return v / (1.0 - 0.999**t), v * (1.0 - 0.999**t)

    div, mul = jax.jit(ss.scalify(f))(ss.as_scaled_array(x), jnp.int32(1))
    c = np.float32(1.0) - np.float32(0.999) ** np.float32(1)
    np.testing.assert_allclose(np.asarray(ss.asarray(div)), x / c, rtol=2e-7)
    np.testing.assert_allclose(np.asarray(ss.asarray(mul)), x * c, rtol=2e-7)
    assert float(np.max(np.abs(np.asarray(div.data)))) <= 2.0
    assert float(np.max(np.abs(np.asarray(mul.data)))) >= 0.5


@pytest.mark.parametrize("norm", ["l1", "l2", "max"])
def test_dynamic_rescale_recentres_data_at_a_power_of_two(norm):
    """dynamic_rescale_* keeps the value, moves a power of two into the scale and leaves
    data whose norm lies in [1, 2) (the l2 root is taken on the exponent bits)."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((32, 16)) * 3e-5).astype(np.float32)
    fn = {
        "l1": ss.ops.dynamic_rescale_l1,
        "l2": ss.ops.dynamic_rescale_l2,
        "max": ss.ops.dynamic_rescale_max,
    }[norm]
    out = jax.jit(ss.scalify(fn))(ss.as_scaled_array(x, scale=2.0**-3))
    data = np.asarray(out.data, np.float64)
    n = {"l1": np.mean(np.abs(data)), "l2": np.sqrt(np.mean(data**2)), "max": np.max(np.abs(data))}[
        norm
    ]
    assert 1.0 <= n < 2.0, n
    assert np.log2(float(out.scale)).is_integer()
    np.testing.assert_array_equal(np.asarray(ss.asarray(out)), x)
    zero = jax.jit(ss.scalify(fn))(ss.as_scaled_array(np.zeros(8, np.float32), scale=4.0))
    assert float(zero.scale) == 0.0 and not np.any(np.asarray(zero.data))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float8_e4m3fn])
def test_sums_of_one_signed_narrow_data_do_not_overflow(dtype):
    # A bias gradient sums thousands of terms of one sign: it grows like n, not sqrt(n).
    # 2048 x 40 = 81920 is beyond FP16's 65504 (E4M3: 2048 x 40 / 64 > 448).
    data = jnp.full((4, 2048), 40.0, dtype)
    x = ss.ScaledArray(data, jnp.float32(0.5))

    def f(x):
        return jnp.sum(x, axis=1), jnp.cumsum(x, axis=1), jnp.sum(x)

    outs = jax.jit(ss.scalify(f))(x)
    ref = np.asarray(data, np.float64) * 0.5
    refs = (ref.sum(axis=1), np.cumsum(ref, axis=1), ref.sum())
    fmax = float(ml_dtypes.finfo(dtype).max)
    for out, expected in zip(outs, refs):
        assert isinstance(out, ss.ScaledArray) and out.dtype == dtype
        d = np.asarray(out.data, np.float64)
        assert np.isfinite(d).all() and np.abs(d).max() < fmax
        eps = float(ml_dtypes.finfo(dtype).eps)
        if out.ndim == 2 and dtype == jnp.float8_e4m3fn:
            continue  # a cumsum spans 2^11 under one scale: E4M3 cannot hold its first terms
        value = d * float(out.scale)  # (in float64: the value itself is beyond FP16)
        np.testing.assert_allclose(value, expected, rtol=eps)


@pytest.mark.parametrize("jit", [False, True])
def test_rules_that_read_the_data_see_a_nan_scale(jit):
    """The value is ``data * scale``: with a NaN scale every element is NaN, whatever the
    data, so comparisons, sign, argmax and max pooling's selection answer as NumPy does
    on the NaN values (issue 14's regression: is_finite answered [True, True])."""
    data = np.array([[2.0, -3.0, 0.5, 4.0]], np.float32)
    x = ss.ScaledArray(jnp.asarray(data), jnp.float32(np.nan))
    value = data * np.float32(np.nan)

    def fns(v):
        pooled_grad = jax.grad(
            lambda y: jnp.sum(lax.reduce_window(y, -jnp.inf, lax.max, (1, 2), (1, 1), "VALID"))
        )
        return {
            "is_finite": jnp.isfinite(v),
            "sign": jnp.sign(v),
            "argmax": jnp.argmax(v, axis=-1),
            "argmin": jnp.argmin(v, axis=-1),
            "gt": v > 0.0,
            "pool_grad": pooled_grad(v),
        }

    f = ss.scalify(fns)
    out = ss.asarray((jax.jit(f) if jit else f)(x))
    expected = jax.tree.map(np.asarray, fns(jnp.asarray(value)))
    assert not np.any(np.asarray(out["is_finite"]))
    np.testing.assert_array_equal(np.asarray(out["is_finite"]), np.isfinite(value))
    assert np.isnan(np.asarray(out["sign"])).all()
    np.testing.assert_array_equal(np.asarray(out["argmax"]), np.argmax(value, axis=-1))
    np.testing.assert_array_equal(np.asarray(out["argmin"]), np.argmin(value, axis=-1))
    np.testing.assert_array_equal(np.asarray(out["gt"]), value > 0)
    # positions follow JAX's own selection on the NaN values
    np.testing.assert_array_equal(np.asarray(out["pool_grad"]), expected["pool_grad"])


@pytest.mark.parametrize("jit", [False, True])
def test_debug_callbacks_see_the_values(jit):
    seen = []

    def f(a):
        jax.debug.callback(lambda v: seen.append(np.asarray(v)), a)
        jax.debug.print("a={a}", a=a)
        return a * 2

    fn = ss.scalify(f, normalize=False)
    x = ss.ScaledArray(jnp.asarray([2.0, 3.0]), jnp.float32(0.25))
    out = (jax.jit(fn) if jit else fn)(x)
    jax.effects_barrier()
    np.testing.assert_array_equal(np.asarray(out), [1.0, 1.5])
    assert len(seen) == 1
    np.testing.assert_array_equal(seen[0], [0.5, 0.75])


def test_dtype_classes_are_static_arguments():
    x = ss.ScaledArray(jnp.asarray([1.0, 300.0]), jnp.float32(2.0))
    out = ss.scalify(lambda a, dt: a.astype(dt))(x, np.float16)
    assert out.dtype == np.float16
    np.testing.assert_array_equal(np.asarray(out, np.float32), [2.0, 600.0])
    cast = ss.ops.cast_on_forward(x, ml_dtypes.float8_e4m3fn)  # eager, an ml_dtypes class
    np.testing.assert_array_equal(np.asarray(cast.data), [1.0, 288.0])


def test_unscaled_rules_keep_narrow_data_in_range():
    """A non-linear rule computes the value in float32; FP16 data far beyond its range
    gets the power of two of its abs-max in the scale instead of becoming inf."""
    data = np.float16([1.5, -2.5])
    x = ss.ScaledArray(jnp.asarray(data), jnp.float32(2.0**20))
    out = ss.scalify(lax.floor)(x)
    expected = np.floor(np.float64(data) * 2.0**20)  # beyond float16's max
    assert out.dtype == np.float16 and float(out.scale) > 1
    np.testing.assert_array_equal(np.asarray(out, np.float64), expected)
    halves = ss.ScaledArray(jnp.full(5, 0.5, jnp.float16), jnp.float32(2.0**10))
    prod = ss.scalify(lambda a: lax.reduce_prod_p.bind(a, axes=(0,), out_sharding=None))(halves)
    assert float(np.asarray(prod, np.float64)) == 2.0**45
    # near unit the data is the float32 result cast to float16, at scale 1
    y = ss.ScaledArray(jnp.asarray(np.float16([0.5, -1.25, 2.0])), jnp.float32(1.0))
    e = ss.scalify(jnp.exp)(y)
    assert float(e.scale) == 1.0
    ref = np.exp(np.float32([0.5, -1.25, 2.0])).astype(np.float16)
    np.testing.assert_array_equal(np.asarray(e.data), ref)


def test_set_scaling_to_zero_gives_the_zero_tensor():
    x = ss.ScaledArray(jnp.asarray([1.0, -2.0]), jnp.float32(1.0))
    for fn in (ss.ops.set_scaling, ss.scalify(ss.ops.set_scaling, check=True)):
        out = fn(x, 0.0)
        assert float(out.scale) == 0.0
        np.testing.assert_array_equal(np.asarray(out.data), [0.0, 0.0])


def test_nnx_state_assigned_and_not_returned_is_warned_about():
    """A step assigning to a module argument (``optimizer.update(model, grads)``) loses
    the update under scalify as under jax.jit: warned. The functional NNX pattern (merge,
    update, return ``nnx.state``) is not warned about and matches the plain step."""
    import optax
    from flax import nnx

    model = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    batch = jnp.ones((2, 8))

    def loss_fn(m, b):
        return jnp.mean(m(b) ** 2)

    def stateful(m, opt, b):
        loss, grads = nnx.value_and_grad(loss_fn)(m, b)
        opt.update(m, grads)
        return loss

    with pytest.warns(UserWarning, match="not written back"):
        ss.scalify(stateful)(model, optimizer, batch)

    graphdef, state = nnx.split((model, optimizer))

    def step(state, b):
        m, opt = nnx.merge(graphdef, state)
        loss = stateful(m, opt, b)
        return loss, nnx.state((m, opt))

    with warnings.catch_warnings():
        fail_on_warnings()
        loss, new = jax.jit(ss.scalify(step))(ss.as_scaled_array(state), batch)
    plain_loss, plain_new = jax.jit(step)(state, batch)
    assert float(ss.asarray(loss)) == pytest.approx(float(plain_loss), rel=1e-6)
    for a, b in zip(jax.tree.leaves(ss.asarray(new)), jax.tree.leaves(plain_new), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_products_of_a_value_with_itself_recentre_like_powers():
    """``x @ x.T`` and ``a @ a`` are powers: each multiplies the data's distance from unit.
    Muon's Newton-Schulz orthogonalisation (optax.contrib.muon) iterates such a quintic
    on a normalised matrix whose values stay near 1; its data drifted 2^-3, 2^-25, 2^-123
    over three steps and underflowed to zero at the fourth (scale clamped at 2^127)."""
    x = _rng((12, 16))
    coeffs = (3.4445, -4.7750, 2.0315)

    def orthogonalize(x):
        x = x / (jnp.linalg.norm(x) + 1e-8)
        for _ in range(5):
            a = x @ x.T
            x = coeffs[0] * x + (coeffs[1] * a + coeffs[2] * a @ a) @ x
        return x

    expected = orthogonalize(x)
    for k in (None, -20, 20):
        sx = ss.as_scaled_array(x) if k is None else ss.as_scaled_array(x, scale=2.0**k)
        out = jax.jit(ss.scalify(orthogonalize))(sx)
        np.testing.assert_allclose(ss.asarray(out), expected, rtol=1e-4, atol=1e-5)
        assert 2.0**-40 < float(np.max(np.abs(np.asarray(out.data)))) < 2.0**40, k

    # a value drifted far from unit data (kept so: normalize=False), times itself:
    # re-centred first, as square does
    far = ss.ScaledArray(x * 2.0**-30, jnp.float32(2.0**30))
    gram = jax.jit(ss.scalify(lambda v: v @ v.T, normalize=False))(far)
    np.testing.assert_allclose(ss.asarray(gram), x @ x.T, rtol=1e-5, atol=1e-5)
    assert 1.0 <= float(np.max(np.abs(np.asarray(gram.data)))) < 64.0
    # other products are left as they are (no extra reduction): unrelated operands
    w = ss.ScaledArray(x.T * 2.0**-30, jnp.float32(2.0**30))
    prod = ss.scalify(lambda v, w: v @ w, normalize=False)(far, w)
    assert float(np.max(np.abs(np.asarray(prod.data)))) < 2.0**-50


def test_a_constant_selected_into_a_small_scale_keeps_its_value():
    """A plain value that a select, max or concatenate puts in the output is expressed in
    the common scale: that scale is raised where the value would overflow the data."""
    f32max = np.finfo(np.float32).max
    x = ss.ScaledArray(jnp.array([np.inf, 1.0, -np.inf, np.nan, -2.0]), jnp.float32(0.5))
    want = np.nan_to_num(np.array([np.inf, 0.5, -np.inf, np.nan, -1.0], np.float32))
    assert want[0] == f32max
    for f in (ss.scalify(jnp.nan_to_num), jax.jit(ss.scalify(jnp.nan_to_num))):
        np.testing.assert_array_equal(np.asarray(ss.asarray(f(x))), want)
    # attention masked as Flax masks it (the dtype's min), one query row fully masked:
    # the plain softmax is uniform there; a fill turned -inf would give NaN
    v = _rng((2, 4, 4), seed=3)
    mask = np.tril(np.ones((4, 4), bool))[None].repeat(2, 0)
    mask[1, 0] = False
    z = np.where(mask, np.asarray(v, np.float64), float(np.finfo(np.float32).min))
    e = np.exp(z - z.max(-1, keepdims=True))
    want = e / e.sum(-1, keepdims=True)
    assert np.allclose(want[1, 0], 0.25)

    def attend(s):
        return jax.nn.softmax(jnp.where(mask, s, jnp.finfo(jnp.float32).min), axis=-1)

    scores = ss.as_scaled_array(jnp.asarray(v), 2.0**-3)
    for f in (ss.scalify(attend), jax.jit(ss.scalify(attend))):
        np.testing.assert_allclose(np.asarray(ss.asarray(f(scores))), want, rtol=1e-5, atol=1e-7)
    # FP16 data at a tiny scale: 1.0 selected in is 1.0 (2^20 in that scale: inf)
    h = ss.ScaledArray(jnp.array([1.0, 2.0], jnp.float16), jnp.float32(2.0**-20))
    got = ss.scalify(lambda a: jnp.where(jnp.array([True, False]), a, 1.0))(h)
    np.testing.assert_array_equal(np.asarray(got.to_array(np.float32)), [2.0**-20, 1.0])
    got = ss.scalify(lambda a: jnp.maximum(a, 3e38))(x)
    np.testing.assert_array_equal(
        np.asarray(ss.asarray(got))[[0, 1, 4]], np.float32([np.inf, 3e38, 3e38])
    )


def test_negative_integer_powers_divide_as_a_division_does():
    zero = ss.as_scaled_array(jnp.zeros(3), scale="rms")  # scale 0: exactly zero
    assert float(zero.scale) == 0.0
    v = np.array([2.0, 0.5, -3.0], np.float32)
    for y in (-1, -2, -3):
        # 1/0 is inf, as for the plain array (the scale's reciprocal times 0 was NaN)
        got = ss.scalify(lambda a, y=y: a**y)(zero)
        with np.errstate(divide="ignore"):
            want = np.zeros(3, np.float32) ** y
        np.testing.assert_array_equal(np.asarray(ss.asarray(got)), want)
        for scale in (2.0**-40, 3.0, 2.0**40):
            x = ss.ScaledArray(jnp.asarray(v), jnp.float32(scale))
            got = np.asarray(ss.asarray(ss.scalify(lambda a, y=y: a**y)(x)), np.float64)
            np.testing.assert_allclose(got, (v.astype(np.float64) * scale) ** y, rtol=1e-6)


def test_scaled_array_refuses_a_negative_scale_and_takes_lists():
    for scale in (-2.0, np.float32(-1.0), jnp.float32(-0.5)):
        with pytest.raises(ValueError, match="scale must not be negative"):
            ss.ScaledArray(jnp.ones(3), scale)
    x = ss.ScaledArray([[1.0, 2.0]], 4.0)
    assert x.shape == (1, 2) and x.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(x), [[4.0, 8.0]])
    # 0 (an exactly-zero tensor) and NaN (a poisoned scale) stay representable
    assert float(ss.ScaledArray(jnp.ones(2), 0.0).scale) == 0.0
    assert np.isnan(float(ss.ScaledArray(jnp.ones(2), np.nan).scale))


def test_a_product_with_a_runtime_zero_is_the_zero_mark():
    """A warmup schedule's learning rate is 0 at step 0, traced: ``lr * u`` is the zero
    mark (scale 0), so ``p + lr * u`` keeps the parameter's scale. Before, the product
    kept ``u``'s scale with zero data, and the parameter took it (8x a kernel's): its
    data shrank for the rest of the run."""
    p = ss.ScaledArray(jnp.linspace(-1.0, 1.0, 8), jnp.float32(0.25))
    u = ss.ScaledArray(jnp.linspace(1.0, 2.0, 8), jnp.float32(2.0))
    prod, new = jax.jit(ss.scalify(lambda p, u, lr: (lr * u, p + lr * u)))(p, u, jnp.float32(0))
    assert float(prod.scale) == 0.0 and not np.any(np.asarray(prod.data))
    assert float(new.scale) == 0.25
    np.testing.assert_array_equal(np.asarray(new.data), np.asarray(p.data))
    # a non-zero rate splits as before: its power of two joins the scale
    prod = jax.jit(ss.scalify(lambda u, lr: lr * u))(u, jnp.float32(3e-4))
    assert float(prod.scale) == 2.0 * 2.0**-11
    np.testing.assert_allclose(ss.asarray(prod), 6e-4 * np.linspace(1.0, 2.0, 8), rtol=1e-6)


def test_multiplying_by_a_plain_array_keeps_the_datas_rms():
    """A plain array operand's power of two comes from its RMS, not its abs-max: a
    LayerNorm's ``(x - mean) * rsqrt(var) * scale`` on plain inputs with a scaled
    ``scale`` keeps unit data (each abs-max split shrank it by the array's crest
    factor: 0.125 after one LayerNorm)."""
    from flax import linen as nn

    x = jax.random.normal(jax.random.key(0), (64, 16))
    ln = nn.LayerNorm()
    params = ln.init(jax.random.key(1), x)["params"]
    out = ss.scalify(lambda p, x: ln.apply({"params": p}, x))(ss.as_scaled_array(params, "rms"), x)
    rms = float(jnp.sqrt(jnp.mean(jnp.square(out.data))))
    assert 0.5 <= rms <= 2.0, rms
    np.testing.assert_allclose(
        ss.asarray(out), ln.apply({"params": params}, x), rtol=1e-5, atol=1e-6
    )
    # a heavy-tailed plain array: one element 1000x the rest
    c = jnp.ones((256,)).at[0].set(1000.0)
    y = ss.scalify(lambda a, c: a * c)(ss.as_scaled_array(jnp.ones((256,)), "rms"), c)
    assert 0.5 <= float(jnp.sqrt(jnp.mean(jnp.square(y.data)))) <= 2.0  # abs-max: 0.06
    np.testing.assert_array_equal(np.asarray(ss.asarray(y)), np.asarray(c))
    # a lone spike among zeros grows the data by at most 2**5, not by its crest factor
    spike = jnp.zeros((1 << 16,)).at[7].set(3.0)
    y = ss.scalify(lambda a, c: a * c)(ss.as_scaled_array(jnp.ones((1 << 16,)), "rms"), spike)
    assert float(jnp.max(jnp.abs(y.data))) <= 32.0
    np.testing.assert_array_equal(np.asarray(ss.asarray(y)), np.asarray(spike))


@pytest.mark.parametrize(
    "case",
    ["inf_among_zeros", "e4m3_one_hot", "fp16_5000_one_hot", "scalar_3e38", "nan_among_zeros"],
)
def test_a_plain_operand_at_the_edges_multiplies_as_plain_jax_does(case):
    """Products of a scaled and a plain operand equal the plain product (float32
    rounding aside) where the split of the plain operand is at an edge: a plain array
    of zeros and one inf or NaN is no zero mark (scale 0 times inf made NaN); FP8 and
    FP16 data keep the abs-max split, which never grows them (E4M3 data of 200 times an
    E4M3 one-hot passed 448 and became NaN, FP16 data of 5000 at scale 1 passed 65504);
    a traced scalar of 3e38 keeps a normal reciprocal (it gave NaN)."""
    n = 1024
    one_hot = np.zeros(n, np.float32)
    one_hot[0] = 1.0
    x = np.random.default_rng(0).normal(size=n).astype(np.float32)
    if case in ("inf_among_zeros", "nan_among_zeros"):
        c = np.zeros(n, np.float32)
        c[3] = np.inf if case == "inf_among_zeros" else np.nan
        xs, c = ss.as_scaled_array(jnp.asarray(x), "rms"), jnp.asarray(c)
    elif case == "e4m3_one_hot":
        x[0] = 200.0
        e4m3 = jnp.float8_e4m3fn
        xs = ss.as_scaled_array(jnp.asarray(x, e4m3), "rms")
        c = jnp.asarray(one_hot, e4m3)
    elif case == "fp16_5000_one_hot":
        xs = ss.as_scaled_array(jnp.full((n,), 5000.0, jnp.float16))
        c = jnp.asarray(one_hot, jnp.float16)
    else:
        xs, c = ss.as_scaled_array(jnp.full((n,), 0.5), "rms"), jnp.float32(3e38)
    want = np.asarray(jax.jit(lambda x, c: x * c)(ss.asarray(xs), c), np.float32)
    got = np.asarray(ss.asarray(jax.jit(ss.scalify(lambda x, c: x * c))(xs, c)), np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("dtype, keep, times", [(jnp.float16, 8, 5), (jnp.float32, 768, 24)])
def test_a_mask_applied_again_and_again_does_not_grow_the_data(dtype, keep, times):
    """The same plain mask multiplied in again and again (a padding mask after every
    layer) leaves the data's abs-max bounded: FP16 data keeps the abs-max split (a mask
    keeping 8 of 1024 grew it 16x a time: inf at the fourth), and float32 data's RMS
    split rounds to the nearest power of two (1 for a mask keeping 75 %, where rounding
    down doubled the data at every product)."""
    n = 1024
    x = jnp.asarray(np.random.default_rng(0).normal(size=n), dtype)
    m = jnp.asarray((np.arange(n) < keep).astype(np.float32), dtype)

    def chain(x, m):
        for _ in range(times):
            x = x * m
        return x

    out = jax.jit(ss.scalify(chain))(ss.as_scaled_array(x, "rms"), m)
    assert float(jnp.max(jnp.abs(out.data.astype(jnp.float32)))) <= 64.0
    np.testing.assert_array_equal(np.asarray(ss.asarray(out)), np.asarray(jax.jit(chain)(x, m)))


def test_an_fp16_model_trains_under_scalify_as_it_does_plain():
    """A Flax model computing in float16 (float32 parameters) with Adam on a warmup
    schedule, 150 steps: the scalified step's losses follow the plain step's. Before
    the two fixes above, the scalified run ended 25 % worse: the data of the forward
    pass drifted into FP16's subnormals (x**3 of GELU) and the backward pass flushed."""
    optax = pytest.importorskip("optax")
    from flax import linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.LayerNorm(dtype=jnp.float16)(x)
            h = nn.gelu(nn.Dense(32, dtype=jnp.float16)(h))
            return nn.Dense(1)(h.astype(jnp.float32))

    model = Net()
    tx = optax.adam(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 150))

    def step(params, opt_state, x, y):
        loss_fn = lambda p: jnp.mean((model.apply({"params": p}, x) - y) ** 2)  # noqa: E731
        loss, g = jax.value_and_grad(loss_fn)(params)
        upd, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, loss

    def data(i):
        x = jax.random.normal(jax.random.key(i), (64, 16))
        return x, jnp.sin(x[:, :1] * 2) + x[:, 1:2] ** 2

    params = model.init(jax.random.key(0), data(0)[0])["params"]
    plain, scaled = jax.jit(step), jax.jit(ss.scalify(step))
    a = (params, tx.init(params))
    b = (ss.as_scaled_array(params, "rms"), ss.as_scaled_array(tx.init(params), "rms"))
    la, lb = [], []
    for i in range(150):
        *a, loss_a = plain(*a, *data(i))
        *b, loss_b = scaled(*b, *data(i))
        la.append(float(loss_a))
        lb.append(float(ss.asarray(loss_b)))
    tail_a, tail_b = np.mean(la[-15:]), np.mean(lb[-15:])
    assert abs(tail_b / tail_a - 1) < 0.01, (tail_a, tail_b)


def _rnn_grads(dtype, steps):
    """Gradients of an RNN whose cell reads a gate slice of a wider product (as LSTM and
    GRU cells do): under unit scaling the backward carry's data drifts about a binade
    per iteration."""

    def loss(w, u, xs):
        def body(h, x):
            h = jnp.tanh((x @ w + h @ u)[:, :32])
            return h, h

        _, hs = lax.scan(body, jnp.zeros((8, 32), dtype), xs)
        return jnp.mean(hs.astype(jnp.float32) ** 2)

    key = jax.random.split(jax.random.key(0), 3)
    w, u = ((jax.random.normal(k, (32, 256)) / np.sqrt(32)).astype(dtype) for k in key[:2])
    xs = jax.random.normal(key[2], (steps, 8, 32)).astype(dtype)
    grad = jax.grad(loss, argnums=(0, 1))
    plain = jax.jit(grad)(w, u, xs)
    scaled = jax.jit(ss.scalify(grad))(*(ss.as_scaled_array(p, "rms") for p in (w, u)), xs)
    flat = lambda t: np.concatenate([np.ravel(np.asarray(a, np.float64)) for a in t])
    return flat(plain), flat(ss.asarray(scaled))


@pytest.mark.parametrize(("dtype", "steps"), [(jnp.float32, 160), (jnp.float16, 60)])
def test_a_long_scan_keeps_its_carry_in_range(dtype, steps):
    """A loop carry's data is re-centred when it drifts: 160 iterations of float32 (it
    left float32's range at ~120 and the gradients were exactly zero) and 60 of float16
    (~20) give plain JAX's gradients, to float32 rounding for float32 (bit for bit on
    some CPUs; XLA's code for the two programs may contract multiply-adds differently
    on others: 3e-8 on an AMD EPYC)."""
    plain, scaled = _rnn_grads(dtype, steps)
    assert np.linalg.norm(plain) > 0.01
    err = np.linalg.norm(scaled - plain) / np.linalg.norm(plain)
    assert err < 1e-6 if dtype == jnp.float32 else err < 1e-2, err


def test_a_long_while_loop_keeps_its_carry_in_range():
    """A permutation applied 100 times: unit scaling expects 32 terms per output and
    finds one, so the data shrinks 2 binades per iteration; re-centred, the value is
    plain JAX's, exactly."""
    perm = jnp.asarray(np.eye(32, dtype=np.float32)[np.random.default_rng(0).permutation(32)])

    def f(h, n):
        return lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] @ perm), (0, h))[1]

    h = jax.random.normal(jax.random.key(0), (8, 32))
    plain = jax.jit(f)(h, 100)
    scaled = ss.asarray(jax.jit(ss.scalify(f))(ss.as_scaled_array(h, "rms"), 100))
    np.testing.assert_array_equal(np.asarray(scaled), np.asarray(plain))


def test_a_learned_fp16_temperature_multiplies_as_plain_jax_does():
    """CLIP's logit scale: ``exp(t)`` (2e4, finite in FP16) times unit-scaled FP16
    similarities. The exp's scalar came out as data 2e4 at scale 1, and every product
    with it held that magnitude in its FP16 data: the gradients were NaN where plain
    JAX's are finite. A scalar is re-centred where it is cast or broadcast."""

    def loss(p, a, b):
        a = (a @ p["wa"]).astype(jnp.float16)
        a = a / jnp.linalg.norm(a, axis=-1, keepdims=True)
        logits = (jnp.exp(p["t"]).astype(jnp.float16) * (a @ b.T)).astype(jnp.float32)
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(16), jnp.arange(16)])

    key = jax.random.split(jax.random.key(0), 3)
    b = jax.random.normal(key[0], (16, 32))
    b = (b / jnp.linalg.norm(b, axis=-1, keepdims=True)).astype(jnp.float16)
    a = jax.random.normal(key[1], (16, 32))
    p = {"t": jnp.float32(np.log(2e4)), "wa": jax.random.normal(key[2], (32, 32)) / 6}
    grad = jax.value_and_grad(loss)
    plain_loss, plain = jax.jit(grad)(p, a, b)
    got_loss, got = jax.jit(ss.scalify(grad))(ss.as_scaled_array(p, "rms"), a, b)
    got = ss.asarray(got)
    assert np.isfinite(float(plain_loss)) and np.all(np.isfinite(plain["wa"]))
    np.testing.assert_allclose(float(ss.asarray(got_loss)), float(plain_loss), rtol=1e-3)
    for name in ("t", "wa"):
        err = np.linalg.norm(got[name] - plain[name]) / np.linalg.norm(plain[name])
        assert err < 1e-2, (name, err)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_a_quotient_of_data_far_from_unit_fits_a_narrow_format(dtype):
    """``a / b`` with FP16 data 121 (scale 2^-7) over data 1.4e-4 (scale 2^14): the value
    is 0.41, the data quotient 8.6e5, past FP16's 65504: it was inf (a seq2seq's FP16
    LayerNorm went NaN under scalify, finite plain). The quotient is fitted to the
    format; bfloat16 has float32's range and needs nothing."""
    a = ss.ScaledArray(jnp.full((4,), 121.0, dtype), jnp.float32(2.0**-7))
    b = ss.ScaledArray(jnp.full((4,), 1.4e-4, dtype), jnp.float32(2.0**14))
    got = np.asarray(ss.asarray(jax.jit(ss.scalify(lambda a, b: a / b))(a, b)), np.float64)
    want = (np.float64(np.asarray(a.data, np.float64)[0]) * 2.0**-7) / (
        np.float64(np.asarray(b.data, np.float64)[0]) * 2.0**14
    )
    np.testing.assert_allclose(got, want, rtol=1e-2)


def _conv1d(x, w):
    return lax.conv_general_dilated(x, w, (1,), "VALID")


@pytest.mark.parametrize(
    "dtype, data, scale, k, op",
    [
        (jnp.float8_e4m3fn, 1.0, 1.0, 512, "dot"),  # 512 > 448 before the division
        (jnp.float8_e4m3fn, 1.0, 1.0, 4096, "dot"),
        (jnp.float16, 16.0, 2.0**-10, 1024, "dot"),  # 262144 > 65504 before it
        (jnp.float16, 16.0, 2.0**-10, 1024, "conv"),
        (jnp.float16, 8.0, 2.0**-10, 4096, "dot"),
    ],
)
def test_narrow_contractions_add_up_before_they_are_narrowed(dtype, data, scale, k, op):
    """A contraction's terms can each fit FP16 or FP8 and their sum not, until unit scaling
    divides it by pow2(sqrt(k)): ones(512) @ ones(512) in E4M3 is 512 (NaN in the format),
    32 once divided. The plain computation on the values is finite, so scalify's must be."""
    if op == "dot":
        shapes, fn = ((2, k), (k, 3)), lambda a, b: a @ b
    else:
        shapes, fn = ((1, 1, k), (1, 1, k)), _conv1d
    a, b = (ss.ScaledArray(jnp.full(s, data, dtype), jnp.float32(scale)) for s in shapes)
    out = jax.jit(ss.scalify(fn))(a, b)
    assert out.dtype == dtype
    assert np.isfinite(np.asarray(out.data, np.float64)).all()
    want = k * (data * scale) ** 2  # NumPy: every term is the same product
    np.testing.assert_allclose(np.asarray(out.to_array(jnp.float32), np.float64), want, rtol=0)


def test_an_fp16_cube_of_data_far_from_unit_stays_in_range():
    """FP16 data of 50 at scale 2^-6 (values 0.78): its cube (gelu's ``x**3``) is 125000
    in the data, past 65504, while the value's cube is 0.48. Data is brought back to unit
    first when its power would leave FP16, not only beyond 2^16 as for float32."""
    data = np.array([50.0, -40.0, 10.0], np.float16)
    x = ss.ScaledArray(jnp.asarray(data), jnp.float32(2.0**-6))
    value = data.astype(np.float64) * 2.0**-6
    cube = np.asarray(ss.asarray(ss.scalify(lambda v: v**3)(x), jnp.float32), np.float64)
    np.testing.assert_allclose(cube, value**3, rtol=1e-3)
    sixth = ss.ScaledArray(jnp.asarray([7.0, 1.0], jnp.float16), jnp.float32(2.0**-3))
    got = np.asarray(ss.asarray(ss.scalify(lambda v: v**6)(sixth), jnp.float32), np.float64)
    np.testing.assert_allclose(got, (np.array([7.0, 1.0]) * 2.0**-3) ** 6, rtol=2e-3)
    gelu = np.asarray(ss.asarray(ss.scalify(jax.nn.gelu)(x), jnp.float32), np.float64)
    want = 0.5 * value * (1 + np.tanh(np.sqrt(2 / np.pi) * (value + 0.044715 * value**3)))
    np.testing.assert_allclose(gelu, want, rtol=2e-3)


def test_vmap_of_a_scalified_function_gives_one_scale_per_example():
    """``jax.vmap(ss.scalify(f))``: each example gets its own scale; the value of the batch
    is each example's data times its scale."""
    rng = np.random.default_rng(3)
    values = rng.normal(size=(6, 4)).astype(np.float32) * 2.0 ** rng.integers(-8, 8, (6, 1))
    x = ss.ScaledArray(jnp.asarray(values / 2.0), jnp.float32(2.0))
    out = jax.vmap(ss.scalify(lambda a: a * 3.0 + 1.0), in_axes=(ss.ScaledArray(0, None),))(x)
    assert np.shape(out.scale) == (6,)
    np.testing.assert_allclose(np.asarray(ss.asarray(out)), values * 3.0 + 1.0, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out, np.float64), values * 3.0 + 1.0, rtol=1e-6)
    moved = ss.ScaledArray(jnp.swapaxes(out.data, 0, 1), out.scale)  # batch axis not leading
    with pytest.raises(ValueError, match=r"scale has shape \(6,\).*data has shape \(4, 6\)"):
        ss.asarray(moved)


def test_a_scaled_array_outside_scalify_says_how_to_compute_on_it():
    w = ss.ScaledArray(jnp.ones((4, 3)), 0.5)
    x = ss.as_scaled_array(jnp.ones((2, 4)))
    with pytest.raises(TypeError, match="captured by closure"):
        ss.scalify(lambda a: a @ w)(x)  # w never reaches scalify
    with pytest.raises(TypeError, match="ss.asarray"):
        jnp.ones(3) + w
    # NumPy operands read the value, as before
    np.testing.assert_array_equal(w * np.ones((4, 3)), np.full((4, 3), 0.5))
    with pytest.raises(ValueError, match=r"argument leaf 0 is a ScaledArray whose scale has shape"):
        ss.scalify(lambda a: a * 2)(ss.ScaledArray(jnp.ones(3), jnp.ones(3)))
