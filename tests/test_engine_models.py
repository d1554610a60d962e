"""scalify on whole training steps: the sample GPT (unrolled and scanned) and MLP, with
an optax AdamW update, in FP32, FP16 and FP8."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scalescope as ss
from scalescope.sample_models.gpt import GPTConfig, gpt_loss, init_gpt
from scalescope.sample_models.mlp import MLPConfig, init_mlp, mlp_loss
from scalescope.sample_models.precision import PRECISIONS
from scalescope.sample_models.train_step import make_optimizer, make_train_step
from scalescope.scalify import has_rule, primitives_in

VOCAB, SEQ, BATCH = 65, 16, 2


def _gpt(scan: bool, precision="fp32", eps=1e-6):
    cfg = GPTConfig(
        vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_heads=4, n_layers=2, scan_layers=scan
    )
    params = init_gpt(jax.random.PRNGKey(0), cfg)
    opt = make_optimizer(eps=eps)
    step = make_train_step(
        functools.partial(gpt_loss, cfg=cfg, precision=PRECISIONS[precision]), opt
    )
    rng = np.random.default_rng(0)
    batch = {
        "inputs": jnp.asarray(rng.integers(0, VOCAB, (BATCH, SEQ)), jnp.int32),
        "targets": jnp.asarray(rng.integers(0, VOCAB, (BATCH, SEQ)), jnp.int32),
    }
    return step, params, opt.init(params), batch


def _mlp(precision="fp32", dtype=jnp.float32, lr=1e-3):
    cfg = MLPConfig(in_dim=64, hidden=(128, 128), n_classes=10)
    params = jax.tree.map(lambda a: a.astype(dtype), init_mlp(jax.random.PRNGKey(0), cfg))
    opt = make_optimizer(lr)
    step = make_train_step(
        functools.partial(mlp_loss, cfg=cfg, precision=PRECISIONS[precision]), opt
    )
    rng = np.random.default_rng(0)
    batch = {
        "x": jnp.asarray(rng.normal(size=(32, 64)), dtype),
        "y": jnp.asarray(rng.integers(0, 10, 32), jnp.int32),
    }
    return step, params, opt.init(params), batch


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("precision", ["fp32", "fp8"])
def test_every_primitive_of_the_gpt_step_has_a_rule(scan, precision):
    step, params, opt_state, batch = _gpt(scan, precision)
    closed = jax.make_jaxpr(step)(params, opt_state, batch)
    prims = primitives_in(closed)
    # the step really contains the hard cases
    expected = {
        "dot_general",
        "gather",
        "scatter-add",
        "rsqrt",
        "tanh",
        "integer_pow",
        "reduce_max",
        "select_n",
        "jit",
        "pow",
        "sqrt",
    }
    assert expected <= prims, expected - prims
    if scan:
        assert "scan" in prims
    missing = sorted(p for p in prims if not has_rule(p))
    assert not missing, f"primitives without a scaled rule: {missing}"


def _leaf_errors(actual, expected):
    """Per leaf: max |a - e| / max |e| (relative to the leaf's magnitude)."""
    errs = []
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        assert a.shape == e.shape
        errs.append(float(np.max(np.abs(a - e)) / max(np.max(np.abs(e)), 1e-30)))
    return errs


@pytest.mark.parametrize("scan", [False, True])
def test_scalified_gpt_step_equals_plain_step(scan):
    # AdamW's first update is g / (|g| + eps): with eps near the size of the smallest
    # gradients it amplifies last-bit differences of XLA fusion (plain eager vs plain jit
    # differ by 4e-5 there). A larger eps keeps the comparison about scalify itself.
    # The bound per leaf is 1e-5 or, where larger, 3x the distance between the plain step
    # run eagerly and jitted: scalify cannot be held closer to the plain step than the
    # plain step is to itself under another fusion (that distance depends on the CPU's
    # vector width: 6.5e-6 on a sign-like bias update on an AVX2 machine).
    step, params, opt_state, batch = _gpt(scan, eps=1e-3)
    expected = step(params, opt_state, batch)
    noise = _leaf_errors(jax.jit(step)(params, opt_state, batch), expected)
    sp = ss.as_scaled_array(params, "rms")
    so = ss.as_scaled_array(opt_state, "rms")
    out = ss.scalify(step)(sp, so, batch)
    assert isinstance(out[0]["wte"], ss.ScaledArray)
    errs = _leaf_errors(ss.asarray(out), expected)
    bad = [(i, e, n) for i, (e, n) in enumerate(zip(errs, noise)) if e >= max(1e-5, 3 * n)]
    assert not bad, bad
    assert max(noise) < 1e-4, max(noise)  # the plain step's own spread stays small


@pytest.mark.parametrize("scan", [False, True])
def test_scalified_gpt_gradients_equal_plain_gradients(scan):
    step, params, _, batch = _gpt(scan)
    cfg = GPTConfig(
        vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_heads=4, n_layers=2, scan_layers=scan
    )
    grad_fn = jax.value_and_grad(functools.partial(gpt_loss, cfg=cfg))
    expected = grad_fn(params, batch)
    for scale in (None, "rms"):
        out = ss.scalify(grad_fn)(ss.as_scaled_array(params, scale), batch)
        errs = _leaf_errors(ss.asarray(out), expected)
        assert max(errs) < 1e-5, (scale, max(errs))


@pytest.mark.slow
def test_scalified_gpt_jitted_steps_track_plain_steps():
    step, params, opt_state, batch = _gpt(scan=True)
    plain, scaled = jax.jit(step), jax.jit(ss.scalify(step))
    sp, so = ss.as_scaled_array(params, "rms"), ss.as_scaled_array(opt_state, "rms")
    for _ in range(3):
        params, opt_state, loss = plain(params, opt_state, batch)
        sp, so, sloss = scaled(sp, so, batch)
        np.testing.assert_allclose(float(ss.asarray(sloss)), float(loss), rtol=1e-5)
    assert max(_leaf_errors(ss.asarray(sp), params)) < 1e-3


def test_scalified_mlp_step_equals_plain_step():
    step, params, opt_state, batch = _mlp()
    expected = step(params, opt_state, batch)
    out = ss.scalify(step)(
        ss.as_scaled_array(params, "rms"), ss.as_scaled_array(opt_state, "rms"), batch
    )
    assert max(_leaf_errors(ss.asarray(out), expected)) < 1e-5


def test_fp8_matmul_inputs_are_fp8_values_under_scalify():
    """Under scalify the e4m3 cast applies to the unit-scaled data: every value fed to
    the matmul is (an e4m3 number) x (a power-of-two scale)."""
    prec = PRECISIONS["fp8"]
    x = jnp.asarray(np.random.default_rng(0).normal(0, 1e-3, (8, 32)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).normal(0, 30.0, (32, 4)), jnp.float32)
    out = ss.scalify(prec.matmul)(ss.as_scaled_array(x, "rms"), ss.as_scaled_array(w, "rms"))
    sx = float(ss.as_scaled_array(x, "rms").scale)
    sw = float(ss.as_scaled_array(w, "rms").scale)
    import ml_dtypes

    qx = (np.asarray(x) / sx).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * sx
    qw = (np.asarray(w) / sw).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * sw
    np.testing.assert_allclose(np.asarray(ss.asarray(out), np.float64), qx @ qw, rtol=1e-5)
    # without scaling, 1e-3 values would mostly fall into e4m3's subnormals
    naive = np.asarray(prec.matmul(x, w), np.float64)
    assert np.max(np.abs(naive - qx @ qw)) > 10 * np.max(
        np.abs(np.asarray(ss.asarray(out)) - qx @ qw)
    )


@pytest.mark.slow
def test_fp16_master_weights_and_optimizer_state_track_fp32():
    step32, p32, s32, batch = _mlp()
    step16, p16, s16, batch16 = _mlp("fp16", jnp.float16)
    assert all(leaf.dtype == jnp.float16 for leaf in jax.tree.leaves(s16[0].nu))
    plain32 = jax.jit(step32)
    scaled16 = jax.jit(ss.scalify(step16))
    naive16 = jax.jit(step16)
    sp, so = ss.as_scaled_array(p16, "rms"), ss.as_scaled_array(s16, "rms")
    np16, ns16 = p16, s16
    for _ in range(6):
        p32, s32, l32 = plain32(p32, s32, batch)
        sp, so, l16 = scaled16(sp, so, batch16)
        np16, ns16, naive_loss = naive16(np16, ns16, batch16)
    l16 = float(ss.asarray(l16, jnp.float32))
    assert np.isfinite(l16)
    assert abs(l16 - float(l32)) < 0.02 * float(l32), (l16, float(l32))
    for leaf in jax.tree.leaves(ss.asarray((sp, so), jnp.float32)):
        assert np.all(np.isfinite(np.asarray(leaf)))
    assert all(
        leaf.dtype == jnp.float16 for leaf in jax.tree.leaves(so[0].nu, is_leaf=ss.is_scaled_array)
    )
    # the same recipe without scalify: Adam's second moment underflows in FP16
    assert not (abs(float(naive_loss) - float(l32)) < 0.02 * float(l32))


@pytest.mark.parametrize("precision", ["fp16", "fp8"])
def test_scalified_gpt_with_a_warmup_cosine_schedule_tracks_fp32(precision):
    """The learning rate is a traced scalar computed from the step count, 0 at step 0;
    FP16 weights and AdamW state under scalify stay FP16, finite and close to FP32, with
    the layers under `lax.scan`."""
    import optax

    cfg = GPTConfig(
        vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_heads=4, n_layers=2, scan_layers=True
    )
    sched = optax.warmup_cosine_decay_schedule(0.0, 2e-3, 3, 30)
    opt = optax.adamw(sched, eps=1e-6, weight_decay=0.01)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (6, BATCH * 2, SEQ + 1)).astype(np.int32)
    losses = {}
    for name in ("fp32", precision):
        prec = PRECISIONS[name]
        params = init_gpt(jax.random.PRNGKey(0), cfg, prec.param_dtype)
        state = opt.init(params)
        step = make_train_step(functools.partial(gpt_loss, cfg=cfg, precision=prec), opt)
        if name != "fp32":
            step = ss.scalify(step)
            params, state = ss.as_scaled_array(params, "rms"), ss.as_scaled_array(state, "rms")
        step = jax.jit(step)
        losses[name] = []
        for t in tokens:
            params, state, loss = step(params, state, {"inputs": t[:, :-1], "targets": t[:, 1:]})
            losses[name].append(float(ss.asarray(loss, jnp.float32)))
    np.testing.assert_allclose(losses[precision], losses["fp32"], rtol=0.01)
    assert params["wte"].dtype == np.float16
    for leaf in jax.tree.leaves(ss.asarray((params, state), jnp.float32)):
        assert np.all(np.isfinite(np.asarray(leaf)))
    if precision == "fp8":  # FP8 rounding really happened (step 0: the same parameters)
        assert losses["fp8"][0] != losses["fp32"][0]
