"""`ss.unit_scale`: the automatic unit-scaling transform on a jaxpr.

Small models, jit once per module-scope fixture: the whole file runs in well under a
minute on one CPU core.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scalescope as ss
import scalescope.unit as U
from scalescope.sample_models.gpt import GPTConfig, gpt_forward, gpt_loss, init_gpt
from scalescope.sample_models.losses import cross_entropy
from scalescope.unit.functional import attention_scale

WIDTHS = (512, 1024, 256, 512)
BATCH = 256


def _unit_normal_like(tree, seed=0):
    """Weights (2-D and more) re-drawn with unit std; vectors (biases, norm gains) kept."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return treedef.unflatten(
        [
            jax.random.normal(k, x.shape, jnp.float32) if x.ndim >= 2 else x
            for k, x in zip(keys, leaves, strict=True)
        ]
    )


def _mlp(params, x):
    for i, p in enumerate(params):
        x = x @ p["w"] + p["b"]
        if i < len(params) - 1:
            x = jax.nn.relu(x)
    return x


def _vjp_stats(fn, params, x, seed=1):
    """Std of ``fn``'s output and of each parameter gradient for a unit-normal cotangent."""
    out, vjp = jax.vjp(fn, params, x)
    ct = jax.random.normal(jax.random.PRNGKey(seed), out.shape, out.dtype)
    grads, _ = vjp(ct)
    return jnp.std(out), [jnp.std(g) for g in jax.tree.leaves(grads)]


def mlp_params_and_input():
    """Unit-normal weights, zero biases of an MLP with ``WIDTHS``, and a unit-normal input."""
    params = _unit_normal_like(
        [{"w": jnp.zeros((a, b)), "b": jnp.zeros((b,))} for a, b in zip(WIDTHS, WIDTHS[1:])]
    )
    x = jax.random.normal(jax.random.PRNGKey(2), (BATCH, WIDTHS[0]))
    return params, x


@pytest.fixture(scope="module")
def mlp_setup():
    return mlp_params_and_input()


def test_mlp_outputs_and_gradients_are_unit(mlp_setup):
    """Unconstrained scales (``constraint=None``) make both passes unit for any widths;
    the default ``"to_output_scale"`` uses ``fan_in^-1/2`` backward, off by
    ``sqrt(fan_out / fan_in)`` when the widths differ (as here)."""
    params, x = mlp_setup
    scaled = ss.unit_scale(_mlp, constraint=None)
    out_std, grad_stds = jax.jit(lambda p, x: _vjp_stats(scaled, p, x))(params, x)
    grad_stds = [float(s) for s in grad_stds]
    assert abs(out_std - 1) < 0.2
    assert all(abs(s - 1) < 0.2 for s in grad_stds), grad_stds
    # the plain MLP with the same unit weights is far from unit scale: the test discriminates
    plain_out, plain_grads = jax.jit(lambda p, x: _vjp_stats(_mlp, p, x))(params, x)
    assert float(plain_out) > 100
    assert max(float(s) for s in plain_grads) > 100
    kinds = [r.kind for r in scaled.rewrites]
    assert kinds.count("linear") == 3 and kinds.count("relu") == 2
    assert "residual" not in kinds


def test_default_constraint_is_lifted_where_no_residual_follows(mlp_setup):
    """As in the library, ops with no residual add after them are unconstrained: the
    default transform of a plain MLP is unit in both passes, like ``constraint=None``."""
    params, x = mlp_setup
    scaled = ss.unit_scale(_mlp)
    out_std, grad_stds = jax.jit(lambda p, x: _vjp_stats(scaled, p, x))(params, x)
    assert abs(float(out_std) - 1) < 0.2
    assert all(abs(float(s) - 1) < 0.2 for s in grad_stds), grad_stds

    def block(w1, w2, x):
        h = x + jnp.tanh(x @ w1)  # a residual block: its linear stays constrained
        return h @ w2  # after the last residual add: unconstrained

    w1 = jax.random.normal(jax.random.PRNGKey(0), (128, 128))
    w2 = jax.random.normal(jax.random.PRNGKey(1), (128, 32))
    scaled = ss.unit_scale(block)
    scaled(w1, w2, x[:, :128])
    first, second = (r for r in scaled.rewrites if r.kind == "linear")
    assert first.grad_scales[0] == first.output_scale  # tied (to_output_scale)
    assert second.output_scale == pytest.approx(128**-0.5)
    assert second.grad_scales[0] == pytest.approx(32**-0.5)  # its own, unit backward


def _library_mlp_layer(p, x, key):
    """The unit-scaling library's own `unit_scale` test model, in JAX: LayerNorm, a
    hand-written tanh GELU (``pow(x, 3.0)``), two linears with biases, inverted dropout
    (p = 0.2) and a sum loss."""

    def custom_gelu(v):
        inner = np.sqrt(2.0 / np.pi) * (v + 0.044715 * jnp.power(v, 3.0))
        return 0.5 * v * (1.0 + jnp.tanh(inner))

    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    v = (x - mean) / jnp.sqrt(var + 1e-5) * p["ln_w"] + p["ln_b"]
    v = custom_gelu(v @ p["w1"] + p["b1"])
    v = v @ p["w2"] + p["b2"]
    keep = jax.random.bernoulli(key, 0.8, v.shape)
    v = jnp.where(keep, v / 0.8, 0)
    return v, v.sum()


def test_library_mlp_layer_is_unit_scaled():
    """The library's test: output and the gradients of the input, the LayerNorm gain and
    both weights within 1 ± 0.2 (unit-std weights, zero biases)."""
    h = 256
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    p = {
        "ln_w": jnp.ones(h),
        "ln_b": jnp.zeros(h),
        "w1": jax.random.normal(k[0], (h, 4 * h)),
        "b1": jnp.zeros(4 * h),
        "w2": jax.random.normal(k[1], (4 * h, h)),
        "b2": jnp.zeros(h),
    }
    x = jax.random.normal(k[2], (64, h))
    scaled = ss.unit_scale(_library_mlp_layer)

    def stats(fn):
        (out, loss), back = jax.vjp(lambda p, x: fn(p, x, k[3]), p, x)
        gp, gx = back((jnp.zeros_like(out), jnp.ones_like(loss)))
        return [jnp.std(t) for t in (out, gx, gp["ln_w"], gp["w1"], gp["w2"])], out

    unit, out = jax.jit(lambda: stats(scaled))()
    assert all(abs(float(s) - 1) < 0.2 for s in unit), unit
    kinds = [r.kind for r in scaled.rewrites]
    assert kinds.count("gelu") == 1 and kinds.count("dropout") == 1
    assert "residual" not in kinds  # nor inside jax.random.uniform (an add of constants)
    plain, plain_out = jax.jit(lambda: stats(_library_mlp_layer))()
    assert min(float(s) for s in plain) > 10
    # the same elements are dropped: the random numbers are left as they are
    np.testing.assert_array_equal(np.asarray(out) == 0, np.asarray(plain_out) == 0)


def test_composes_with_jit_and_grad(mlp_setup):
    params, x = mlp_setup
    loss = ss.unit_scale(lambda p, x: jnp.mean(_mlp(p, x) ** 2))
    g_eager = jax.grad(loss)(params, x)
    g_jit = jax.jit(jax.grad(loss))(params, x)
    for a, b in zip(jax.tree.leaves(g_eager), jax.tree.leaves(g_jit), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-5)
    # the forward value is the unit-scaled one, not the plain one
    assert jnp.isfinite(jax.jit(loss)(params, x))
    assert float(jax.jit(loss)(params, x)) < 0.1 * float(jnp.mean(_mlp(params, x) ** 2))


def test_gelu_is_one_op_not_a_residual_add():
    def f(w, x):
        return jax.nn.gelu(x @ w, approximate=True)

    w = jax.random.normal(jax.random.PRNGKey(0), (256, 256))
    x = jax.random.normal(jax.random.PRNGKey(1), (128, 256))
    scaled = ss.unit_scale(f)
    y = scaled(w, x)
    kinds = [r.kind for r in scaled.rewrites]
    assert kinds.count("gelu") == 1
    assert "residual" not in kinds and "add" not in kinds
    gelu = next(r for r in scaled.rewrites if r.kind == "gelu")
    assert "tanh" in gelu.primitives and "integer_pow" in gelu.primitives
    assert len(gelu.primitives) >= 7
    np.testing.assert_allclose(y, U.gelu(U.linear(x, w), approximate=True), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("act", "kind"),
    [
        (lambda v: jax.nn.gelu(v, approximate=False), "gelu"),
        (jax.nn.silu, "silu"),
        (jax.nn.relu, "relu"),
        (jnp.tanh, "tanh"),
        (jax.nn.sigmoid, "logistic"),
        (lambda v: jax.nn.softmax(v, axis=-1), "softmax"),
    ],
)
def test_activation_patterns(act, kind):
    scaled = ss.unit_scale(act)
    x = jax.random.normal(jax.random.PRNGKey(0), (64, 32))
    y = scaled(x)
    assert [r.kind for r in scaled.rewrites] == [kind]
    r = scaled.rewrites[0]
    np.testing.assert_allclose(y, act(x) * r.output_scale, rtol=1e-5, atol=1e-6)


def _layer_norm(x):  # written out, as many models do
    mean = x.mean(-1, keepdims=True)
    var = jnp.maximum((x * x).mean(-1, keepdims=True) - mean * mean, 0.0)
    return (x - mean) * jax.lax.rsqrt(var + 1e-6)


def _hinge(w, x, y):
    return jnp.mean(jnp.maximum(0.0, 1.0 - y * (x @ w)[:, 0]))


def test_a_clamp_of_a_statistic_or_a_loss_term_is_no_relu():
    """``max(var, 0)`` in a norm and ``max(0, 1 - y f)`` in a hinge loss are not
    activations: scaled by ReLU's √2 they changed a LayerNorm's output RMS to 2^-1/4 and
    the loss's value. NumPy is the reference for what the functions compute."""
    import flax.linen as nn

    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (4, 16)) * 3 + 1
    ref = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-6)
    scaled = ss.unit_scale(_layer_norm)
    np.testing.assert_allclose(scaled(x), ref, rtol=1e-4, atol=1e-5)
    assert "relu" not in [r.kind for r in scaled.rewrites]
    for module, xx in ((nn.LayerNorm(), x), (nn.GroupNorm(num_groups=4), x.reshape(4, 1, 16))):
        params = module.init(key, xx)
        plain = module.apply(params, xx)
        np.testing.assert_allclose(ss.unit_scale(module.apply)(params, xx), plain, atol=1e-6)
    w = jax.random.normal(key, (16, 1))
    y = jnp.sign(jax.random.normal(jax.random.PRNGKey(1), (4,)))
    scaled = ss.unit_scale(_hinge)
    value = scaled(w, x, y)
    (linear,) = [r for r in scaled.rewrites if r.kind != "relu"]  # the matmul alone
    assert [r.kind for r in scaled.rewrites] == [linear.kind]
    f = np.asarray(x, np.float64) @ np.asarray(w, np.float64) * linear.output_scale
    hinge = np.maximum(0.0, 1.0 - np.asarray(y) * f[:, 0]).mean()
    np.testing.assert_allclose(value, hinge, rtol=1e-5)
    # the same hinge through jax.nn.relu (a named call): the loss's value is kept
    nn_hinge = ss.unit_scale(lambda w, x, y: jnp.mean(jax.nn.relu(1.0 - y * (x @ w)[:, 0])))
    np.testing.assert_allclose(nn_hinge(w, x, y), hinge, rtol=1e-5)
    assert "relu" not in [r.kind for r in nn_hinge.rewrites]
    # an activation feeding a matmul still is one: alone, also penalised in the loss
    # (one use is a total, the other is not), or centred first (h - mean(h) holds h)
    for act in (
        lambda w, x: jax.nn.relu(x @ w) @ w.T,
        lambda w, x: jnp.maximum(x @ w, 0.0) @ w.T,
        lambda w, x: (h := jnp.maximum(x @ w, 0.0)) @ w.T + jnp.sum(h * h),
        lambda w, x: jnp.maximum((h := x @ w) - h.mean(-1, keepdims=True), 0.0) @ w.T,
    ):
        mlp = ss.unit_scale(act)
        mlp(jnp.eye(16), x)
        assert "relu" in [r.kind for r in mlp.rewrites], [r.kind for r in mlp.rewrites]


def test_a_function_that_takes_gradients_is_refused():
    """A whole training step (loss, gradient and update): its backward pass is already
    written out, and Adam's ``b1·mu + (1-b1)·g`` read as a residual add was rescaled."""
    import optax

    tx = optax.adam(1e-2)

    def step(w, state, x, y):
        loss, g = jax.value_and_grad(_hinge)(w, x, y)
        update, state = tx.update(g, state, w)
        return optax.apply_updates(w, update), state, loss

    w, x, y = jnp.ones((16, 1)), jnp.ones((4, 16)), jnp.ones(4)
    with pytest.raises(ValueError, match=r"step computes gradients itself .*transpose") as err:
        ss.unit_scale(step)(w, tx.init(w), x, y)
    assert "jax.grad(ss.unit_scale(loss_fn))" in str(err.value)
    jax.grad(ss.unit_scale(_hinge))(w, x, y)  # what it says to do instead works


def test_residual_add_is_split_and_scaled():
    def f(w, x):
        return x + jnp.tanh(x @ w)

    scaled = ss.unit_scale(f, tau=1.0)
    w = jax.random.normal(jax.random.PRNGKey(0), (128, 128))
    x = jax.random.normal(jax.random.PRNGKey(1), (64, 128))
    y = scaled(w, x)
    res = next(r for r in scaled.rewrites if r.kind == "residual")
    assert res.grad_scales == pytest.approx((2**-0.5, 2**-0.5))
    branch = U.scale_fwd(jnp.tanh(U.linear(x, w)), U.transform.ELEMENTWISE_SCALES["tanh"][0])
    np.testing.assert_allclose(y, U.residual_add(branch, x), rtol=1e-5, atol=1e-5)


def _manual_attention(q, k, v, causal):
    """Attention as users write it: scaled scores, a -inf mask, softmax, weighted sum."""
    scores = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(q.shape[-1])
    if causal:
        seq = q.shape[1]
        scores = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), scores, -jnp.inf)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), v)


@pytest.mark.parametrize(
    ("attention", "causal"),
    [
        (lambda q, k, v: _manual_attention(q, k, v, True), True),
        (lambda q, k, v: _manual_attention(q, k, v, False), False),
        (lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True), True),
        # non-causal, JAX transposes the logits and their max apart (nnx.MultiHeadAttention)
        (lambda q, k, v: jax.nn.dot_product_attention(q, k, v), False),
    ],
    ids=["manual-causal", "manual", "jax.nn.dot_product_attention", "dot_product_attention"],
)
def test_attention_is_one_op(attention, causal):
    """``softmax(q k^T / sqrt(d) [mask]) v`` becomes U.scaled_dot_product_attention (with
    ``mult = sqrt(d)``): one scale on q, k, v gradients and the output, none on the two
    products or the softmax; value and gradients equal the functional op's."""
    b, t, h, d = 8, 32, 2, 16
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v = (jax.random.normal(key, (b, t, h, d)) for key in keys[:3])
    ct = jax.random.normal(keys[3], (b, t, h, d))
    scaled = ss.unit_scale(attention)

    def reference(q, k, v):
        heads_first = [jnp.swapaxes(x, 1, 2) for x in (q, k, v)]
        out = U.scaled_dot_product_attention(*heads_first, is_causal=causal, mult=d**0.5)
        return jnp.swapaxes(out, 1, 2)

    out, vjp = jax.vjp(scaled, q, k, v)
    ref, ref_vjp = jax.vjp(reference, q, k, v)
    assert [r.kind for r in scaled.rewrites] == ["attention"]
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    for g, r in zip(vjp(ct), ref_vjp(ct), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)
    assert scaled.rewrites[0].output_scale == pytest.approx(
        attention_scale(t, d, mult=d**0.5, is_causal=causal)
    )
    plain_std = float(jnp.std(attention(q, k, v)))
    assert abs(float(jnp.std(out)) - 1) < 0.2 < abs(plain_std - 1)


def test_positional_table_add_is_unit_add_and_bias_add_is_not():
    """An embedding plus a positional table (a parameter with two long axes) is U.add,
    output ``2^-1/2``; a bias (one long axis) keeps its value."""

    def embed(p, ids):
        x = jnp.take(p["wte"], ids, axis=0) + p["wpe"][: ids.shape[-1]]
        return x @ p["w"] + p["b"]

    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    p = {
        "wte": jax.random.normal(keys[0], (512, 128)),
        "wpe": jax.random.normal(keys[1], (64, 128)),
        "w": jax.random.normal(keys[2], (128, 128)),
        "b": jnp.zeros(128),
    }
    ids = jax.random.randint(keys[3], (32, 64), 0, 512)
    scaled = ss.unit_scale(embed)
    out = scaled(p, ids)
    kinds = [r.kind for r in scaled.rewrites]
    assert kinds.count("add") == 1 and kinds.count("linear") == 1
    add = next(r for r in scaled.rewrites if r.kind == "add")
    assert add.output_scale == pytest.approx(2**-0.5)
    assert abs(float(jnp.std(out)) - 1) < 0.1
    assert abs(float(jnp.std(embed(p, ids))) - 128**0.5 * 2**0.5) < 1.5  # plain: unscaled


def test_bad_input():
    with pytest.raises(TypeError, match="callable"):
        ss.unit_scale(3)
    with pytest.raises(ValueError, match="tau"):
        ss.unit_scale(jnp.sin, tau=-1.0)
    with pytest.raises(ValueError, match="constraint"):
        ss.unit_scale(jnp.sin, constraint="nope")


# -- the sample GPT, unmodified -----------------------------------------------------------

GPT_CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=64, n_heads=4, n_layers=2)


@pytest.fixture(scope="module")
def gpt_run():
    params = _unit_normal_like(init_gpt(jax.random.PRNGKey(0), GPT_CFG))
    tokens = jax.random.randint(jax.random.PRNGKey(3), (16, 16), 0, GPT_CFG.vocab_size)
    batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1)}
    loss = ss.unit_scale(lambda p, b: gpt_loss(p, b, GPT_CFG))
    value, grads = jax.jit(jax.value_and_grad(loss))(params, batch)

    def loss_and_logits(p, b):
        logits = gpt_forward(p, b["inputs"], GPT_CFG)
        return cross_entropy(logits, b["targets"]), logits

    _, us_logits = jax.jit(ss.unit_scale(loss_and_logits))(params, batch)
    plain_value, plain_grads = jax.jit(jax.value_and_grad(lambda p, b: gpt_loss(p, b, GPT_CFG)))(
        params, batch
    )
    return {
        "value": value,
        "grads": grads,
        "logits": us_logits,
        "batch": batch,
        "params": params,
        "rewrites": loss.rewrites,
        "plain_value": plain_value,
        "plain_grads": plain_grads,
    }


def test_gpt_loss_value_is_the_standard_cross_entropy(gpt_run):
    """The transform scales the forward pass (matmuls, activations, the readout), so the
    loss differs from the plain model's; the loss reduction itself keeps its standard
    value (only its gradient is scaled): it equals the standard mean cross entropy of
    the unit-scaled logits. The u-μP readout (output scale 1/d) makes those logits small,
    so the loss is close to log(vocab)."""
    r = gpt_run
    expected = cross_entropy(r["logits"], r["batch"]["targets"])
    np.testing.assert_allclose(r["value"], expected, rtol=1e-5)
    assert abs(float(r["value"]) - np.log(GPT_CFG.vocab_size)) < 0.5
    assert float(r["plain_value"]) > 2 * np.log(GPT_CFG.vocab_size)


def test_gpt_rewrites(gpt_run):
    kinds = [r.kind for r in gpt_run["rewrites"]]
    n = GPT_CFG.n_layers
    assert kinds.count("gelu") == n and kinds.count("attention") == n
    assert kinds.count("softmax") == 0 and kinds.count("matmul") == 0  # inside attention
    assert kinds.count("residual") == 2 * n  # exactly the residual adds, not GELU's add
    assert kinds.count("cross_entropy") == 1 and kinds.count("readout") == 1
    assert kinds.count("linear") == 4 * n
    assert kinds.count("embedding") == 1 and kinds.count("add") == 1  # + positional table


def test_gpt_gradients_near_unit(gpt_run):
    """Every parameter gradient of the unmodified sample GPT (unit-std weights, zero
    biases, unit LayerNorm gains) has std within [0.4, 2.25], and the readout-side ones
    (head, ln_f) 1 ± 0.2; the plain model is far outside that band.

    The ± 0.2 band of the MLP is not reachable for every GPT parameter under the default
    ``"to_output_scale"`` constraint, for reasons of the unit-scaling rules themselves:
    a linear's input gradient gets ``fan_in^-1/2`` instead of ``fan_out^-1/2`` (sqrt(3)
    too large for qkv, which the LayerNorm before it passes to its gain and bias; 1/2 for
    the MLP's down projection, which reaches the up projection's weight). See
    `test_gpt_gradients_unconstrained` for the band without that constraint.
    """
    stds = {
        jax.tree_util.keystr(k): float(jnp.std(v))
        for k, v in jax.tree_util.tree_flatten_with_path(gpt_run["grads"])[0]
    }
    assert all(0.4 < s < 2.25 for s in stds.values()), stds
    for name in ("['head']['w']", "['ln_f']['scale']", "['ln_f']['bias']"):
        assert abs(stds[name] - 1) < 0.2, (name, stds[name])
    plain = [float(jnp.std(v)) for v in jax.tree.leaves(gpt_run["plain_grads"])]
    assert not all(0.4 < s < 2.25 for s in plain)


def test_gpt_gradients_unconstrained(gpt_run):
    """With ``constraint=None`` each linear's backward pass is unit too, and every
    parameter gradient of the sample GPT has std within [0.5, 1.2] (median 1 ± 0.25).

    What keeps the rest from 1 ± 0.2 is the forward residual stream: the library's GELU
    and causal-attention scales leave the branch outputs at RMS 1.1-1.35 at this size,
    so the stream's RMS grows to ~1.25 and each plain LayerNorm's backward divides the
    gradient by it (unit scaling has no rule for a LayerNorm's input gradient)."""
    loss = ss.unit_scale(lambda p, b: gpt_loss(p, b, GPT_CFG), constraint=None)
    grads = jax.jit(jax.grad(loss))(gpt_run["params"], gpt_run["batch"])
    stds = [float(jnp.std(v)) for v in jax.tree.leaves(grads)]
    assert all(0.5 < s < 1.2 for s in stds), stds
    assert abs(float(np.median(stds)) - 1) < 0.25


# -- Flax ---------------------------------------------------------------------------------


def _check_unit_mlp(scaled, params, x, nonlinearity: str) -> None:
    """A two-layer MLP under unit_scale: unit output and gradients, both linears and the
    non-linearity rewritten."""
    out_std, grad_stds = jax.jit(lambda p, x: _vjp_stats(scaled, p, x))(params, x)
    grad_stds = [float(s) for s in grad_stds]
    assert abs(out_std - 1) < 0.2
    assert all(abs(s - 1) < 0.25 for s in grad_stds), grad_stds
    kinds = [r.kind for r in scaled.rewrites]
    assert kinds.count("linear") == 2 and kinds.count(nonlinearity) == 1


def test_flax_linen_mlp():
    nn = pytest.importorskip("flax.linen")

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.gelu(nn.Dense(512)(x))
            return nn.Dense(256)(x)

    model = MLP()
    x = jax.random.normal(jax.random.PRNGKey(0), (BATCH, 256))
    variables = _unit_normal_like(model.init(jax.random.PRNGKey(1), x))
    _check_unit_mlp(ss.unit_scale(model.apply), variables, x, "gelu")


def test_flax_nnx_mlp():
    nnx = pytest.importorskip("flax.nnx")

    class MLP(nnx.Module):
        def __init__(self, rngs):
            init = nnx.initializers.normal(1.0)
            self.fc = nnx.Linear(256, 512, kernel_init=init, rngs=rngs)
            self.out = nnx.Linear(512, 256, kernel_init=init, rngs=rngs)

        def __call__(self, x):
            return self.out(jax.nn.silu(self.fc(x)))

    graphdef, state = nnx.split(MLP(nnx.Rngs(0)))

    def apply(state, x):
        return nnx.merge(graphdef, state)(x)

    x = jax.random.normal(jax.random.PRNGKey(0), (BATCH, 256))
    _check_unit_mlp(ss.unit_scale(apply), state, x, "silu")


def test_gemma_style_nnx_decoder():
    """flax/examples/gemma's way of writing a decoder (RoPE, grouped-query attention as
    5-D einsums, attention and final-logit soft-capping, a ``(1 + scale)`` RMSNorm gain,
    tied embeddings): both attentions are one op each and the readout is found through
    the final soft-cap; the soft-caps' tanh and RoPE's ``x1·cos + x2·sin`` keep their
    values (no lone-tanh or U.add rewrite); the norm gains' gradients are unit-scaled
    through ``1 + scale``. Every parameter gradient of the unit-weight model is then
    within [0.15, 2.5]; they reached 15.8 before (the gains), and the plain model's are
    0.004-0.19."""
    import other_models as O
    from flax import nnx

    graphdef, params = nnx.split(O.Gemma(rngs=nnx.Rngs(0)), nnx.Param)
    params = _unit_normal_like(params)
    tokens = jax.random.randint(jax.random.PRNGKey(3), (16, O.G_SEQ + 1), 1, O.G_VOCAB)

    def loss(params, tokens):
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        positions = jnp.cumsum(inputs != 0, axis=-1) - 1
        causal = jnp.tril(jnp.ones((O.G_SEQ, O.G_SEQ), jnp.bool_))
        mask = (inputs != 0)[:, None, :] & causal[None]
        logits = nnx.merge(graphdef, params)(inputs, positions, mask)
        log_probs = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], -1))

    scaled = ss.unit_scale(loss)
    value, grads = jax.jit(jax.value_and_grad(scaled))(params, tokens)
    kinds = [r.kind for r in scaled.rewrites]
    assert kinds.count("attention") == 2 and kinds.count("readout") == 1, kinds
    assert "tanh" not in kinds and "add" not in kinds and "matmul" not in kinds, kinds
    assert kinds.count("residual") == 4 and kinds.count("cross_entropy") == 1
    assert np.isfinite(float(value))
    stds = [float(jnp.std(g)) for g in jax.tree.leaves(grads)]
    assert all(0.15 < s < 2.5 for s in stds), stds
    plain = [float(jnp.std(g)) for g in jax.tree.leaves(jax.jit(jax.grad(loss))(params, tokens))]
    assert sum(s < 0.15 for s in plain) > len(plain) // 2, plain


def test_flax_attention_is_one_op_and_keeps_its_biases():
    """Flax's attention module: one attention; its DenseGeneral biases, shaped
    (heads, head_dim), are biases (kept), not positional tables (U.add)."""
    nn = pytest.importorskip("flax.linen")
    module = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=64)
    x = jax.random.normal(jax.random.PRNGKey(0), (8, 32, 64))
    mask = nn.make_causal_mask(jnp.ones((8, 32)))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(
        module.init(jax.random.PRNGKey(1), x, mask=mask)
    )
    keys = jax.random.split(jax.random.PRNGKey(2), len(leaves))
    variables = treedef.unflatten(  # unit-normal kernels, zero biases
        [
            jax.random.normal(key, a.shape)
            if "kernel" in jax.tree_util.keystr(path)
            else jnp.zeros_like(a)
            for key, (path, a) in zip(keys, leaves, strict=True)
        ]
    )
    scaled = ss.unit_scale(lambda v, x: module.apply(v, x, mask=mask))
    out = scaled(variables, x)
    kinds = [r.kind for r in scaled.rewrites]
    assert kinds.count("attention") == 1 and kinds.count("linear") == 4
    assert "add" not in kinds and "softmax" not in kinds and "matmul" not in kinds
    assert abs(float(jnp.std(out)) - 1) < 0.3


def test_scan_layers_gpt_is_transformed():
    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=32, n_heads=2, n_layers=2, scan_layers=True)
    params = _unit_normal_like(init_gpt(jax.random.PRNGKey(0), cfg))
    tokens = jax.random.randint(jax.random.PRNGKey(3), (4, 8), 0, cfg.vocab_size)
    loss = ss.unit_scale(lambda p, b: gpt_loss(p, b, cfg))
    grads = jax.jit(jax.grad(loss))(params, {"inputs": tokens, "targets": tokens})
    kinds = [r.kind for r in loss.rewrites]
    assert kinds.count("residual") == 2 and kinds.count("gelu") == 1  # the body, once
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))


def _np_logsumexp(x, axis=-1):
    m = x.max(axis=axis, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(axis=axis, keepdims=True))).squeeze(axis)


def test_a_loss_written_with_logsumexp_is_a_cross_entropy():
    """optax's integer-label cross-entropy is ``mean(logsumexp(z) - z[y])``; logsumexp adds
    back its ``stop_gradient(max)`` shift. It is `cross_entropy`, as the log-softmax
    spelling: the value is the loss, the logits gradient ``V/sqrt(V-1)·(softmax - onehot)``
    (the mean not dividing it). Its add was taken for a residual one: the loss read 2.62
    for 3.78. A logsumexp that is not such a loss keeps its value."""
    import optax

    rng = np.random.default_rng(0)
    n, vocab = 64, 32
    logits = rng.normal(size=(n, vocab)).astype(np.float32)
    labels = rng.integers(0, vocab, n)
    want_ce = float(np.mean(_np_logsumexp(logits) - logits[np.arange(n), labels]))
    ce = ss.unit_scale(lambda z: optax.softmax_cross_entropy_with_integer_labels(z, labels).mean())
    value, grad = jax.value_and_grad(ce)(logits)
    np.testing.assert_allclose(float(value), want_ce, rtol=1e-5)
    soft = np.exp(logits - _np_logsumexp(logits)[:, None])
    want_grad = (soft - np.eye(vocab)[labels]) * vocab / np.sqrt(vocab - 1)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=1e-6)
    assert [r.kind for r in ce.rewrites] == ["cross_entropy"]
    lse = ss.unit_scale(lambda z: jnp.mean(jax.nn.logsumexp(z, -1)))
    np.testing.assert_allclose(float(lse(logits)), np.mean(_np_logsumexp(logits)), rtol=1e-5)
    assert lse.rewrites == []


def test_a_piecewise_activation_keeps_its_shape():
    """CELU is ``max(x, 0) + expm1(min(x, 0))``: its max is one branch, not a ReLU, and
    the sum is the activation, not two activations added. Scaling either made the
    negative side 0.71x the positive one."""
    x = np.linspace(-3.0, 3.0, 13, dtype=np.float32)
    out = np.asarray(ss.unit_scale(jax.nn.celu)(x), np.float64)
    want = np.where(x > 0, x, np.expm1(np.minimum(x, 0.0)))
    ratio = out[x != 0] / want[x != 0]
    np.testing.assert_allclose(ratio, ratio[0], rtol=1e-6)


def test_convolutions_are_unit_scaled_as_u_conv1d():
    """A convolution by a kernel parameter gets `U.conv1d`'s scales (any number of spatial
    axes): two unit-normal conv layers give unit output and gradients, not std 800."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(8, 64, 32)), jnp.float32)  # [batch, length, channels]
    k0, k1 = (jnp.asarray(rng.normal(size=(5, 32, 32)), jnp.float32) for _ in range(2))

    def conv(x, w):
        return jax.lax.conv_general_dilated(
            x, w, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC")
        )

    def model(k0, k1, x):
        return conv(jax.nn.gelu(conv(x, k0)), k1)

    scaled = ss.unit_scale(model)

    def reference(k0, k1, x):
        h = U.conv1d(x, k0, padding="SAME", constraint=None)
        h = U.gelu(h, constraint=None, approximate=True)
        return U.conv1d(h, k1, padding="SAME", constraint=None)

    np.testing.assert_allclose(scaled(k0, k1, x), reference(k0, k1, x), rtol=1e-4, atol=1e-4)
    assert [r.kind for r in scaled.rewrites].count("conv") == 2
    # 2-D, strided: unit output and input gradient, kernel gradient near unit
    x2 = jnp.asarray(rng.normal(size=(4, 16, 16, 8)), jnp.float32)
    w2 = jnp.asarray(rng.normal(size=(3, 3, 8, 16)), jnp.float32)
    conv2 = ss.unit_scale(
        lambda w, x: jax.lax.conv_general_dilated(
            x, w, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
    )
    out, vjp = jax.vjp(conv2, w2, x2)
    gw, gx = vjp(jnp.asarray(rng.normal(size=out.shape), jnp.float32))
    for name, v in (("out", out), ("x grad", gx), ("kernel grad", gw)):
        assert 0.7 < float(np.std(np.asarray(v))) < 1.4, (name, float(np.std(np.asarray(v))))


def test_a_one_hot_product_is_an_embedding_lookup():
    """``one_hot(ids) @ table`` is a lookup: `U.embedding`'s rule (the row itself, the
    table gradient ``(rows / lookups)^1/2``), as the ``jnp.take`` spelling gets; the
    linear rule gave output and table gradient std 0.03 at V = 1024."""
    rng = np.random.default_rng(2)
    vocab, d = 256, 16
    table = rng.normal(size=(vocab, d)).astype(np.float32)
    ids = jnp.asarray(rng.integers(0, vocab, (8, 4)))
    ct = rng.normal(size=(8, 4, d)).astype(np.float32)
    scaled = ss.unit_scale(lambda t, ids: jax.nn.one_hot(ids, vocab) @ t)
    out, vjp = jax.vjp(lambda t: scaled(t, ids), table)
    np.testing.assert_array_equal(np.asarray(out), table[np.asarray(ids)])
    want = np.zeros_like(table)
    np.add.at(want, np.asarray(ids).ravel(), ct.reshape(-1, d))
    want *= (vocab / ids.size) ** 0.5
    np.testing.assert_allclose(np.asarray(vjp(ct)[0]), want, rtol=1e-5, atol=1e-6)
    assert [r.kind for r in scaled.rewrites] == ["embedding"]


def test_attention_with_dropout_on_its_probabilities_is_one_op():
    """Flax's attention dropout multiplies the probabilities by ``keep / keep_prob``
    before the product with ``v``: still one attention (the output scaled by its one
    scale), not a softmax and two matmuls (output std 1.21 -> 0.81 at rate 0.1)."""
    b, t, h, d = 4, 16, 2, 8
    keys = jax.random.split(jax.random.PRNGKey(4), 4)
    q, k, v = (jax.random.normal(key, (b, t, h, d)) for key in keys[:3])

    def attention(q, k, v, key):
        keep = jax.random.bernoulli(key, 0.9, (b, h, t, t))  # drawn in the step, as Flax does
        scores = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(d)
        probs = jax.nn.softmax(scores, axis=-1) * (keep.astype(jnp.float32) / 0.9)
        return jnp.einsum("bhts,bshd->bthd", probs, v)

    scaled = ss.unit_scale(attention)
    out = scaled(q, k, v, keys[3])
    assert [r.kind for r in scaled.rewrites] == ["attention"]
    s = attention_scale(t, d, mult=d**0.5, is_causal=False)
    np.testing.assert_allclose(out, s * attention(q, k, v, keys[3]), rtol=1e-5, atol=1e-6)
    import flax.linen as nn

    x = jax.random.normal(keys[0], (2, 8, 16))
    m = nn.MultiHeadDotProductAttention(num_heads=2, dropout_rate=0.1, deterministic=False)
    params = m.init({"params": keys[1], "dropout": keys[2]}, x, x)
    mha = ss.unit_scale(lambda p, x, key: m.apply(p, x, x, rngs={"dropout": key}))
    mha(params, x, keys[3])
    kinds = [r.kind for r in mha.rewrites]
    assert kinds.count("attention") == 1 and "softmax" not in kinds and "matmul" not in kinds


def test_lookalikes_of_the_new_patterns_are_left_to_the_general_rules():
    """Neither a comparison without an iota (not a one-hot), nor a logsumexp minus any
    other function of the logits (not a cross-entropy), nor two slices of one tensor
    added (two values, not branches of a pointwise function) is taken for one."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(16, 32)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(32, 8)), jnp.float32)
    mask = ss.unit_scale(lambda w, x: (jnp.round(x) == 0).astype(jnp.float32) @ w)
    mask(w, x)
    assert [r.kind for r in mask.rewrites] == ["linear"]
    lse = ss.unit_scale(
        lambda z: jnp.mean(jax.nn.logsumexp(z, -1) - jax.jit(jnp.max, static_argnums=1)(z, -1))
    )
    np.testing.assert_allclose(
        np.asarray(jax.grad(lse)(x)),
        np.asarray(jax.grad(lambda z: jnp.mean(jax.nn.logsumexp(z, -1) - z.max(-1)))(x)),
        rtol=1e-5,
        atol=1e-7,
    )
    assert "cross_entropy" not in [r.kind for r in lse.rewrites]
    halves = ss.unit_scale(lambda w, x: (lambda h: h[:, :4] + h[:, 4:])(x @ w))
    halves(w, x)
    assert "add" in [r.kind for r in halves.rewrites]
