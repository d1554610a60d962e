"""`ss.unit_scale(fn, constraint=None, calibrate=args)`: constants measured once on
example arguments (LSUV-style), then static.

Calibration runs the transformed function eagerly, op by op, so its tests sit in a
module of their own: the test workers can run it beside `test_unit_scale.py`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from test_unit_scale import (
    GPT_CFG,
    WIDTHS,
    _mlp,
    _unit_normal_like,
    _vjp_stats,
    mlp_params_and_input,
)

import scalescope as ss
from scalescope.sample_models.gpt import gpt_loss, init_gpt, stack_blocks


@pytest.fixture(scope="module")
def mlp_setup():
    return mlp_params_and_input()


@pytest.fixture(scope="module")
def calibrated_gpt():
    params = _unit_normal_like(init_gpt(jax.random.PRNGKey(0), GPT_CFG))

    def batch(seed):
        tokens = jax.random.randint(jax.random.PRNGKey(seed), (16, 16), 0, GPT_CFG.vocab_size)
        return {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1)}

    def plain_loss(p, b):
        return gpt_loss(p, b, GPT_CFG)

    calib, held_out = batch(3), batch(7)
    loss = ss.unit_scale(plain_loss, constraint=None, calibrate=(params, calib))
    grad = jax.jit(jax.value_and_grad(loss))
    return {"loss": loss, "grad": grad, "params": params, "calib": calib, "held_out": held_out}


def _grad_stds(grads) -> dict[str, float]:
    return {
        jax.tree_util.keystr(k): float(jnp.std(v))
        for k, v in jax.tree_util.tree_flatten_with_path(grads)[0]
    }


def test_calibrated_gpt_gradients_are_unit(calibrated_gpt):
    """Calibrated on one batch, every parameter gradient of the unmodified sample GPT has
    std 1 ± 0.1 on that batch (the uncalibrated transform gives 0.58-0.96, see
    `test_gpt_gradients_unconstrained`), and every weight matrix's 1 ± 0.2 on another
    batch (vectors, such as biases, vary more from batch to batch)."""
    c = calibrated_gpt
    value, grads = c["grad"](c["params"], c["calib"])
    stds = _grad_stds(grads)
    assert all(abs(s - 1) < 0.1 for s in stds.values()), stds
    _, held = c["grad"](c["params"], c["held_out"])
    weights = {k: float(jnp.std(g)) for k, g in zip(stds, jax.tree.leaves(held)) if g.ndim >= 2}
    assert len(weights) == 4 * GPT_CFG.n_layers + 3  # qkv, proj, fc, proj; wte, wpe, head
    assert all(abs(s - 1) < 0.2 for s in weights.values()), weights
    # the readout keeps its u-μP scale: logits stay small and the loss near log(vocab)
    assert abs(float(value) - np.log(GPT_CFG.vocab_size)) < 0.5


def test_calibrated_multipliers_are_measured_where_the_transform_scales(calibrated_gpt):
    """One forward multiplier per rewritten output (linears but the readout, attention,
    GELU, the positional add, the residual adds) and one backward multiplier per value a
    rewritten op reads; all finite and positive, and not all 1."""
    cal = calibrated_gpt["loss"].calibration
    n = GPT_CFG.n_layers
    # per layer: qkv, attention, proj, residual, fc, gelu, proj, residual; + the table add
    assert len(cal.forward) == 8 * n + 1, cal.forward
    assert len(cal.backward) > len(cal.forward)
    values = [*cal.forward.values(), *cal.backward.values()]
    assert all(np.isfinite(v) and v > 0 for v in values)
    assert max(abs(np.log2(v)) for v in values) > 0.2
    assert cal.mode == "apply"


def test_calibrated_mlp_is_exactly_unit_on_its_data(mlp_setup):
    """On the calibration data the output's std is 1 to within the difference between
    RMS and std; for another unit-normal cotangent than calibration's, every weight
    gradient's std is 1 ± 0.05 and every bias gradient's 1 ± 0.1."""
    params, x = mlp_setup
    scaled = ss.unit_scale(_mlp, constraint=None, calibrate=(params, x))
    out_std, grad_stds = jax.jit(lambda p, x: _vjp_stats(scaled, p, x))(params, x)
    assert abs(float(out_std) - 1) < 0.03
    leaves = jax.tree.leaves(params)
    for leaf, s in zip(leaves, grad_stds, strict=True):
        assert abs(float(s) - 1) < (0.05 if leaf.ndim >= 2 else 0.1), grad_stds
    # eager and jitted calls agree: the multipliers are constants of the program
    np.testing.assert_allclose(scaled(params, x), jax.jit(scaled)(params, x), rtol=1e-5, atol=1e-6)


def test_calibrate_bad_input(mlp_setup):
    params, x = mlp_setup
    with pytest.raises(ValueError, match="constraint=None"):
        ss.unit_scale(_mlp, calibrate=(params, x))
    with pytest.raises(TypeError, match="tuple of example positional arguments"):
        ss.unit_scale(_mlp, constraint=None, calibrate=x)
    with pytest.raises(ValueError, match="no floating-point array"):
        ss.unit_scale(lambda n: n * 2.0, constraint=None, calibrate=(jnp.arange(3),))
    scaled = ss.unit_scale(_mlp, constraint=None, calibrate=(params, x))
    with pytest.raises(ValueError, match="structured as calibrate="):
        scaled(params[:1], x[:, : WIDTHS[0]])
    # another rank or dtype would take the multipliers measured on other values: refused,
    # naming the argument; another batch size is the same program
    with pytest.raises(ValueError, match=r"argument\[0\]\[1\] of rank 3 .* had rank 2"):
        scaled(params, x[None])
    with pytest.raises(ValueError, match="dtype bfloat16"):
        scaled(params, x.astype(jnp.bfloat16))
    assert np.isfinite(np.asarray(scaled(params, x[:3]))).all()


def test_calibrating_a_scanned_layer_stack_matches_the_unrolled_one(calibrated_gpt):
    """A `lax.scan` over stacked layers is unrolled while calibrating, and each iteration
    gets multipliers of its own (scanned along with the layers' parameters): the
    calibrated scanned GPT computes the same loss and gradients as the calibrated
    unrolled one, to float32 rounding."""
    c = calibrated_gpt
    scan_cfg = dataclasses.replace(GPT_CFG, scan_layers=True)
    stacked = stack_blocks(c["params"])
    scanned = ss.unit_scale(
        lambda p, b: gpt_loss(p, b, scan_cfg), constraint=None, calibrate=(stacked, c["calib"])
    )
    assert len(scanned.calibration.forward) == len(c["loss"].calibration.forward)
    value_u, grads_u = c["grad"](c["params"], c["calib"])
    value_s, grads_s = jax.jit(jax.value_and_grad(scanned))(stacked, c["calib"])
    np.testing.assert_allclose(value_s, value_u, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(stack_blocks(grads_u)), jax.tree.leaves(grads_s), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)


def test_calibrate_leaves_cond_branches_at_the_library_constants():
    """A cond's branches are traced while calibrating (the branch is a value): they keep
    the library's constants, the ops around them are calibrated, and the result is
    finite. A while loop cannot be differentiated, so calibration says that it
    differentiates ``fn``."""

    def fn(params, x):
        h = jnp.tanh(x @ params["w_in"])
        h = lax.cond(x[0, 0] > 0, lambda h: jax.nn.relu(h @ params["w"]), lambda h: -h, h)
        return jnp.mean(h @ params["w_out"])

    def looping(params, x):
        h = lax.while_loop(lambda c: c[1] < 2, lambda c: (c[0] @ params["w"], c[1] + 1), (x, 0))
        return jnp.mean(h[0])

    k = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {
        "w_in": jax.random.normal(k[0], (64, 128)),
        "w": jax.random.normal(k[1], (128, 128)),
        "w_out": jax.random.normal(k[2], (128, 32)),
    }
    x = jax.random.normal(k[3], (32, 64))
    scaled = ss.unit_scale(fn, constraint=None, calibrate=(params, x))
    paths = [path for path, _ in (*scaled.calibration.forward, *scaled.calibration.backward)]
    assert paths and all(len(path) == 0 for path in paths)  # nothing inside the branches
    grads = jax.jit(jax.grad(scaled))(params, x)
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
    assert abs(float(jnp.std(grads["w_in"])) - 1) < 0.1  # read outside the branches
    with pytest.raises(ValueError, match="(?s)while_loop.*calibrate= differentiates fn"):
        ss.unit_scale(looping, constraint=None, calibrate=(params, jnp.ones((32, 128))))
