"""scalescope.unit.nn: Flax NNX modules on the unit-scaled ops. A small decoder at init has
a loss near ln(vocab) and unit-scale parameter gradients; the layers use the library's
depth rule; the modules agree with the functional ops."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")

import scalescope.unit as U  # noqa: E402
from scalescope.unit import nn as unn  # noqa: E402

VOCAB, HIDDEN, LAYERS, HEADS = 65, 64, 2, 4


@pytest.fixture(scope="module")
def model():
    return unn.TransformerDecoder(
        hidden_size=HIDDEN, vocab_size=VOCAB, layers=LAYERS, heads=HEADS, rngs=nnx.Rngs(0)
    )


@pytest.fixture(scope="module")
def ids():
    return jax.random.randint(jax.random.PRNGKey(1), (8, 64), 0, VOCAB)


@pytest.fixture(scope="module")
def loss_and_grads(model, ids):
    graphdef, params = nnx.split(model, nnx.Param)

    @jax.jit
    def value_and_grad(params, ids):
        return jax.value_and_grad(lambda p: nnx.merge(graphdef, p).loss(ids))(params)

    loss, grads = value_and_grad(params, ids)
    leaves = jax.tree_util.tree_leaves_with_path(grads)
    return float(loss), {jax.tree_util.keystr(p): np.asarray(g) for p, g in leaves}


def test_initial_loss_near_log_vocab(loss_and_grads):
    loss, _ = loss_and_grads
    assert math.log(VOCAB) / 2 < loss < 2 * math.log(VOCAB)


def test_every_parameter_gradient_is_unit_scaled(loss_and_grads):
    _, grads = loss_and_grads
    # embedding, projection, and per layer qkv, o, linear_1, linear_gate, linear_2
    assert len(grads) == 2 + 5 * LAYERS
    for name, g in grads.items():
        assert 1 / 5 <= float(np.std(g)) <= 5, (name, float(np.std(g)))


def test_loss_is_next_token_cross_entropy(model, ids):
    logits = np.asarray(model(ids), np.float64)
    assert logits.shape == (8, 64, VOCAB)
    x = logits[:, :-1].reshape(-1, VOCAB)
    m = x.max(-1, keepdims=True)
    logp = x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))
    ref = -logp[np.arange(x.shape[0]), np.asarray(ids)[:, 1:].reshape(-1)].mean()
    assert abs(float(model.loss(ids)) - ref) < 1e-4 * ref


def test_decoder_is_causal(model, ids):
    changed = ids.at[:, 40].set((ids[:, 40] + 1) % VOCAB)
    a, b = np.asarray(model(ids)), np.asarray(model(changed))
    np.testing.assert_allclose(a[:, :40], b[:, :40], rtol=1e-5, atol=1e-6)
    assert not np.allclose(a[:, 40:], b[:, 40:])


def test_depth_rule_taus(model):
    rule = U.transformer_residual_scaling_rule()
    for i, layer in enumerate(model.layers):
        assert layer.mhsa_tau == pytest.approx(rule(2 * i, 2 * LAYERS))
        assert layer.mlp_tau == pytest.approx(rule(2 * i + 1, 2 * LAYERS))
    assert model.layers[0].mhsa_tau == pytest.approx(1 / math.sqrt(2))
    assert model.layers[1].mlp_tau == pytest.approx(1 / math.sqrt(5))


def test_unit_variance_initialisation(model):
    for kernel in (model.embedding.embedding, model.layers[0].mlp.linear_1.kernel):
        assert abs(float(jnp.std(kernel[...])) - 1) < 0.05
    assert model.projection.kernel[...].shape == (HIDDEN, VOCAB)  # (in, out)


def test_modules_match_functional_ops():
    rngs = nnx.Rngs(2)
    x = jax.random.normal(jax.random.PRNGKey(3), (4, 16, 32))
    lin = unn.Linear(32, 48, bias=True, rngs=rngs)
    np.testing.assert_allclose(
        np.asarray(lin(x)), np.asarray(U.linear(x, lin.kernel[...], lin.bias[...])), rtol=1e-6
    )
    assert float(jnp.abs(lin.bias[...]).max()) == 0.0
    ro = unn.LinearReadout(32, 10, rngs=rngs)
    np.testing.assert_allclose(
        np.asarray(ro(x)), np.asarray(x @ ro.kernel[...]) / 32, rtol=1e-5, atol=1e-6
    )
    ln = unn.LayerNorm(32, elementwise_affine=True)
    assert ln.scale[...].shape == (32,) and ln.bias[...].shape == (32,)
    np.testing.assert_allclose(np.asarray(ln(x)), np.asarray(U.layer_norm(x)), atol=1e-6)
    assert unn.LayerNorm(32).scale is None and unn.RMSNorm(32).scale is None
    np.testing.assert_allclose(np.asarray(unn.RMSNorm(32)(x)), np.asarray(U.rms_norm(x)))
    emb = unn.Embedding(10, 8, rngs=rngs)
    np.testing.assert_array_equal(
        np.asarray(emb(jnp.array([3, 1]))), np.asarray(emb.embedding[...])[[3, 1]]
    )


@pytest.mark.parametrize("block", ["mlp", "mhsa"])
def test_blocks_are_unit_scaled(block):
    rngs = nnx.Rngs(4)
    module = unn.MLP(64, rngs=rngs) if block == "mlp" else unn.MHSA(64, 4, rngs=rngs)
    x = jax.random.normal(jax.random.PRNGKey(5), (8, 32, 64))
    y, back = jax.vjp(module, x)
    (gx,) = back(jax.random.normal(jax.random.PRNGKey(6), y.shape))
    assert abs(float(jnp.std(y)) - 1) < 0.2
    assert 0.2 < float(jnp.std(gx)) < 1.5  # attention's q/k gradients are small at init


def test_bad_arguments():
    with pytest.raises(ValueError, match="multiple of heads"):
        unn.MHSA(30, 4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="Linear: constraint"):
        unn.Linear(4, 4, constraint="nope", rngs=nnx.Rngs(0))


def test_import_scalescope_does_not_need_flax():
    code = (
        "import sys, scalescope, scalescope.unit as U; "
        "assert 'flax' not in sys.modules, 'flax imported'; "
        "assert scalescope.unit is U and callable(U.linear)"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=root)
