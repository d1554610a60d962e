"""Tests of the sample models: shapes, layouts, training, precision recipes, jaxpr structure."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from scalescope.sample_models import (
    PRECISIONS,
    GPTConfig,
    MLPConfig,
    Precision,
    cross_entropy,
    get_precision,
    gpt_forward,
    gpt_loss,
    init_gpt,
    init_mlp,
    make_optimizer,
    make_train_step,
    mlp_accuracy,
    mlp_forward,
    mlp_loss,
    stack_blocks,
    unstack_blocks,
)

CFG = GPTConfig(vocab_size=65, seq_len=16, d_model=32, n_heads=4, n_layers=2)
SCAN_CFG = dataclasses.replace(CFG, scan_layers=True)
MLP_CFG = MLPConfig(in_dim=20, hidden=(16, 16), n_classes=5)

# Configs and precisions are frozen dataclasses, hence hashable static arguments.
forward = jax.jit(gpt_forward, static_argnums=(2, 3))
loss_and_grad = jax.jit(jax.value_and_grad(gpt_loss), static_argnums=(2, 3))


@pytest.fixture(scope="module")
def gpt_batch() -> dict[str, jax.Array]:
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, CFG.seq_len + 1), 0, CFG.vocab_size)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


@pytest.fixture(scope="module")
def mlp_batch() -> dict[str, jax.Array]:
    kx, ky = jax.random.split(jax.random.PRNGKey(2))
    return {
        "x": jax.random.normal(kx, (8, MLP_CFG.in_dim)),
        "y": jax.random.randint(ky, (8,), 0, MLP_CFG.n_classes),
    }


def _all_finite(tree) -> bool:
    return all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in jax.tree.leaves(tree))


def _eqns(jaxpr):
    """Every equation of a jaxpr, recursing into sub-jaxprs (jit, scan, custom_vjp...)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, list | tuple) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


def _train(step, params, opt_state, batch, n_steps: int) -> list[float]:
    step = jax.jit(step)
    losses = []
    for _ in range(n_steps):
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    return losses


# --- precision ------------------------------------------------------------------------


def test_get_precision_presets_and_unknown_name():
    assert get_precision("fp32") is PRECISIONS["fp32"]
    fp8 = get_precision("fp8")
    assert np.dtype(fp8.fwd_dtype) == np.dtype(ml_dtypes.float8_e4m3fn)
    assert np.dtype(fp8.bwd_dtype) == np.dtype(ml_dtypes.float8_e5m2)
    assert np.dtype(get_precision("fp16").param_dtype) == np.float16
    with pytest.raises(ValueError, match="unknown precision 'fp4'.*fp16"):
        get_precision("fp4")


def test_matmul_casts_operands_forward_and_gradient_backward():
    kx, kw, kg = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(kx, (4, 8))
    w = jax.random.normal(kw, (8, 3))
    ct = jax.random.normal(kg, (4, 3)) * 0.3
    fp8 = PRECISIONS["fp8"]

    def q(a, dtype):
        return np.asarray(a).astype(dtype).astype(np.float32)

    out, vjp = jax.vjp(fp8.matmul, x, w)
    assert out.dtype == x.dtype
    np.testing.assert_allclose(out, q(x, fp8.fwd_dtype) @ q(w, fp8.fwd_dtype), rtol=1e-5)
    assert not np.allclose(out, np.asarray(x) @ np.asarray(w), rtol=1e-3)
    dx, dw = vjp(ct)
    ct_q = q(ct, fp8.bwd_dtype)
    np.testing.assert_allclose(dx, ct_q @ q(w, fp8.fwd_dtype).T, rtol=1e-5)
    np.testing.assert_allclose(dw, q(x, fp8.fwd_dtype).T @ ct_q, rtol=1e-5)
    # fp32 is exact matmul.
    np.testing.assert_allclose(PRECISIONS["fp32"].matmul(x, w), x @ w, rtol=1e-6)


def test_matmul_accumulates_in_the_input_dtype():
    x = jnp.ones((2, 4), jnp.float16)
    w = jnp.ones((4, 3), jnp.float32)
    assert Precision("mixed").matmul(x, w).dtype == jnp.float16


# --- GPT ------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [CFG, SCAN_CFG, dataclasses.replace(CFG, tie_embeddings=True)])
def test_gpt_logits_shape_and_dtype(cfg, gpt_batch):
    params = init_gpt(jax.random.PRNGKey(0), cfg)
    logits = forward(params, gpt_batch["inputs"], cfg)
    assert logits.shape == (2, cfg.seq_len, cfg.vocab_size)
    assert logits.dtype == jnp.float32
    assert ("head" in params) != cfg.tie_embeddings
    # A freshly initialised model is close to uniform over the vocabulary.
    loss = cross_entropy(logits, gpt_batch["targets"])
    assert abs(float(loss) - np.log(cfg.vocab_size)) < 0.2


def test_gpt_param_layouts():
    unrolled = init_gpt(jax.random.PRNGKey(0), CFG)
    scanned = init_gpt(jax.random.PRNGKey(0), SCAN_CFG)
    assert isinstance(unrolled["blocks"], list) and len(unrolled["blocks"]) == CFG.n_layers
    assert scanned["blocks"]["attn"]["qkv"]["w"].shape == (CFG.n_layers, 32, 96)
    assert scanned["blocks"]["mlp"]["fc"]["w"].shape == (CFG.n_layers, 32, 128)
    # Same key, same weights, whichever layout.
    chex_equal = jax.tree.map(np.array_equal, stack_blocks(unrolled), scanned)
    assert all(jax.tree.leaves(chex_equal))
    round_trip = jax.tree.map(np.array_equal, unstack_blocks(scanned), unrolled)
    assert all(jax.tree.leaves(round_trip))
    with pytest.raises(ValueError, match="stack_blocks"):
        forward(unrolled, jnp.zeros((1, 4), jnp.int32), SCAN_CFG)
    with pytest.raises(ValueError, match="unstack_blocks"):
        forward(scanned, jnp.zeros((1, 4), jnp.int32), CFG)


def test_gpt_is_causal(gpt_batch):
    params = init_gpt(jax.random.PRNGKey(0), CFG)
    tokens = gpt_batch["inputs"]
    changed = tokens.at[:, -1].set((tokens[:, -1] + 1) % CFG.vocab_size)
    a = forward(params, tokens, CFG)
    b = forward(params, changed, CFG)
    np.testing.assert_allclose(a[:, :-1], b[:, :-1], atol=1e-6)
    assert not np.allclose(a[:, -1], b[:, -1])


def test_scanned_and_unrolled_agree(gpt_batch):
    # Perturb biases and LN params so that every parameter matters to the comparison.
    params = init_gpt(jax.random.PRNGKey(0), CFG)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(3), len(leaves))
    leaves = [p + 0.05 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys, strict=True)]
    params = jax.tree.unflatten(treedef, leaves)
    stacked = stack_blocks(params)

    logits_u = forward(params, gpt_batch["inputs"], CFG)
    logits_s = forward(stacked, gpt_batch["inputs"], SCAN_CFG)
    np.testing.assert_allclose(logits_s, logits_u, atol=1e-5, rtol=1e-5)

    loss_u, grads_u = loss_and_grad(params, gpt_batch, CFG, PRECISIONS["fp32"])
    loss_s, grads_s = loss_and_grad(stacked, gpt_batch, SCAN_CFG, PRECISIONS["fp32"])
    np.testing.assert_allclose(loss_s, loss_u, atol=1e-5, rtol=1e-5)
    for g_s, g_u in zip(
        jax.tree.leaves(unstack_blocks(grads_s)), jax.tree.leaves(grads_u), strict=True
    ):
        np.testing.assert_allclose(g_s, g_u, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("cfg", [CFG, SCAN_CFG])
def test_gpt_training_decreases_loss(cfg, gpt_batch):
    params = init_gpt(jax.random.PRNGKey(0), cfg)
    optimizer = make_optimizer(learning_rate=3e-3)
    step = make_train_step(lambda p, b: gpt_loss(p, b, cfg), optimizer)
    losses = _train(step, params, optimizer.init(params), gpt_batch, 8)
    assert all(np.isfinite(losses))
    assert losses[-1] < losses[0] - 0.3
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False))


@pytest.mark.parametrize("name", ["fp16", "fp8"])
def test_low_precision_gpt_step_is_finite(name, gpt_batch):
    precision = get_precision(name)
    params = init_gpt(jax.random.PRNGKey(0), SCAN_CFG, dtype=precision.param_dtype)
    assert all(leaf.dtype == jnp.float16 for leaf in jax.tree.leaves(params))
    optimizer = make_optimizer()
    step = jax.jit(make_train_step(lambda p, b: gpt_loss(p, b, SCAN_CFG, precision), optimizer))
    new_params, _, loss = step(params, optimizer.init(params), gpt_batch)
    assert np.isfinite(float(loss))
    assert _all_finite(new_params)
    assert all(leaf.dtype == jnp.float16 for leaf in jax.tree.leaves(new_params))
    moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), params, new_params)
    assert all(jax.tree.leaves(moved))


def test_fp8_forward_differs_from_fp32_but_stays_close(gpt_batch):
    params = init_gpt(jax.random.PRNGKey(0), CFG)
    ref = forward(params, gpt_batch["inputs"], CFG)
    fp8 = Precision("fp8-f32", fwd_dtype=ml_dtypes.float8_e4m3fn)
    out = forward(params, gpt_batch["inputs"], CFG, fp8)
    assert not np.allclose(out, ref, atol=1e-6)
    np.testing.assert_allclose(out, ref, atol=0.05)


def test_grad_jaxpr_of_scanned_gpt_has_scan(gpt_batch):
    params = init_gpt(jax.random.PRNGKey(0), SCAN_CFG)
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: gpt_loss(p, gpt_batch, SCAN_CFG)))(params).jaxpr
    scans = [e for e in _eqns(jaxpr) if e.primitive.name == "scan"]
    assert len(scans) >= 2  # forward (jvp) and backward (transpose)
    assert all(e.params["length"] == SCAN_CFG.n_layers for e in scans)
    names = {str(e.source_info.name_stack) for e in scans}
    assert any("blocks" in n for n in names)


def test_grad_jaxpr_of_unrolled_gpt_has_batched_dot_general(gpt_batch):
    params = init_gpt(jax.random.PRNGKey(0), CFG)
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: gpt_loss(p, gpt_batch, CFG)))(params).jaxpr
    eqns = list(_eqns(jaxpr))
    prims = {e.primitive.name for e in eqns}
    assert "scan" not in prims
    assert {"gather", "scatter-add", "rsqrt", "tanh"} <= prims
    batched = [
        e for e in eqns if e.primitive.name == "dot_general" and e.params["dimension_numbers"][1][0]
    ]
    # Scores and values, forward and both operand gradients, in each of the two blocks.
    assert len(batched) >= 2 * 2 * CFG.n_layers
    names = {str(e.source_info.name_stack) for e in batched}
    assert any("block_0" in n and "attn" in n for n in names)
    assert any("block_1" in n and "attn" in n for n in names)


def test_named_scopes_in_unrolled_forward(gpt_batch):
    params = init_gpt(jax.random.PRNGKey(0), CFG)
    jaxpr = jax.make_jaxpr(lambda p: gpt_forward(p, gpt_batch["inputs"], CFG))(params).jaxpr
    names = {str(e.source_info.name_stack) for e in _eqns(jaxpr)}
    for scope in ("embed", "block_0/ln_1", "block_0/attn", "block_1/ln_2", "block_1/mlp"):
        assert any(n.startswith(scope) for n in names), scope
    assert any(n.startswith("ln_f") for n in names) and any(n.startswith("head") for n in names)


# --- MLP ------------------------------------------------------------------------------


def test_mlp_shapes_and_scopes(mlp_batch):
    params = init_mlp(jax.random.PRNGKey(0), MLP_CFG)
    assert [layer["w"].shape for layer in params["layers"]] == [(20, 16), (16, 16), (16, 5)]
    logits = mlp_forward(params, mlp_batch["x"], MLP_CFG)
    assert logits.shape == (8, MLP_CFG.n_classes)
    jaxpr = jax.make_jaxpr(lambda p: mlp_loss(p, mlp_batch, MLP_CFG))(params).jaxpr
    names = {str(e.source_info.name_stack) for e in _eqns(jaxpr)}
    assert {"dense_0", "dense_1", "dense_2"} <= {n.split("/")[0] for n in names}
    acc = float(mlp_accuracy(params, mlp_batch, MLP_CFG))
    expected = np.mean(np.argmax(np.asarray(logits), -1) == np.asarray(mlp_batch["y"]))
    assert acc == pytest.approx(expected)


def test_mlp_training_decreases_loss_and_fits(mlp_batch):
    params = init_mlp(jax.random.PRNGKey(0), MLP_CFG)
    optimizer = make_optimizer(learning_rate=1e-2, schedule_steps=50)
    step = jax.jit(make_train_step(lambda p, b: mlp_loss(p, b, MLP_CFG), optimizer))
    opt_state = optimizer.init(params)
    losses = []
    for _ in range(50):
        params, opt_state, loss = step(params, opt_state, mlp_batch)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]
    assert float(mlp_accuracy(params, mlp_batch, MLP_CFG)) == 1.0


def test_mlp_fp8_step_is_finite(mlp_batch):
    precision = PRECISIONS["fp8"]
    params = init_mlp(jax.random.PRNGKey(0), MLP_CFG, dtype=precision.param_dtype)
    optimizer = make_optimizer()
    step = jax.jit(make_train_step(lambda p, b: mlp_loss(p, b, MLP_CFG, precision), optimizer))
    new_params, _, loss = step(params, optimizer.init(params), mlp_batch)
    assert np.isfinite(float(loss)) and _all_finite(new_params)
    assert new_params["layers"][0]["w"].dtype == jnp.float16


def test_train_step_is_not_jitted_inside():
    calls = []

    def loss_fn(params, batch):
        calls.append(1)  # a Python side effect: runs on every call only if nothing caches a trace
        return jnp.sum((params["w"] * batch) ** 2)

    optimizer = make_optimizer(learning_rate=0.1, weight_decay=0.0)
    step = make_train_step(loss_fn, optimizer)
    params = {"w": jnp.ones(3)}
    opt_state = optimizer.init(params)
    new_params, opt_state, loss = step(params, opt_state, jnp.ones(3))
    assert float(loss) == 3.0
    assert bool(jnp.all(new_params["w"] < 1.0))
    step(new_params, opt_state, jnp.ones(3))
    assert len(calls) == 2


def test_fp8_recipe_recentres_cast_inputs_that_static_propagation_lets_drift():
    """Probe the FP8 casts of an MLP step fed inputs of RMS 2^8 (unnormalised features):
    static scale propagation carries that magnitude into the E4M3 cast of the first
    matmul's input; the `fp8` recipe re-centres each cast input to unit RMS."""
    import functools

    import scalescope as ss

    cfg = MLPConfig(in_dim=64, hidden=(128, 128), n_classes=10)
    rng = np.random.default_rng(0)
    batch = {
        "x": jnp.asarray(rng.normal(size=(64, 64)) * 2.0**8, jnp.float16),
        "y": jnp.asarray(rng.integers(0, 10, 64), jnp.int32),
    }
    drift = {}
    for name in ("fp8", "fp8-static"):
        prec = get_precision(name)
        params = init_mlp(jax.random.key(0), cfg, prec.param_dtype)
        opt = make_optimizer()
        step = make_train_step(functools.partial(mlp_loss, cfg=cfg, precision=prec), opt)
        args = (ss.as_scaled_array(params, "rms"), ss.as_scaled_array(opt.init(params), "rms"))
        inst = ss.instrument(step, formats=("e4m3", "e5m2"), histograms=False)
        _, stats = jax.jit(inst)(*args, batch)
        table = inst.op_table(*args, batch)
        cast = [op for op in table if op.recorded and op.cast_to in ("e4m3", "e5m2")]
        assert {op.cast_to for op in cast} == {"e4m3", "e5m2"}
        rms = np.concatenate([np.asarray(stats["rms"][table.rows(op)]) for op in cast])
        with np.errstate(divide="ignore"):  # a flushed cast's RMS 0: infinitely far
            drift[name] = np.abs(np.log2(rms))
    assert np.all(drift["fp8"] < 1.5), drift["fp8"]
    # Static propagation: the input cast sits 2^8 off unit scale (and past E4M3's 448
    # its values turn NaN, poisoning what follows).
    assert not np.all(drift["fp8-static"] < 4), drift["fp8-static"]


def test_fp8_recipe_recentres_the_gradient_entering_both_attention_products():
    """Under the `fp8` recipe, each backward product of the two attention einsums takes
    a re-centred gradient (`dynamic_rescale_l2_grad`): static propagation lets it grow
    spiky, and its product with v (the probabilities' gradient, FP16 data) overflowed
    to inf at step 36 of the 2x128 GPT on random tokens (an incident the flight
    recorder named). Checked on the backward's jaxpr: the gradient operand of every
    such product comes from a `dynamic_rescale`, through layout ops only."""
    import functools

    cfg = GPTConfig(vocab_size=65, seq_len=8, d_model=16, n_heads=2, n_layers=1)
    prec = get_precision("fp8")
    params = init_gpt(jax.random.key(0), cfg, prec.param_dtype)
    batch = {"inputs": jnp.zeros((2, 8), jnp.int32), "targets": jnp.zeros((2, 8), jnp.int32)}
    grad = jax.grad(functools.partial(gpt_loss, cfg=cfg, precision=prec))
    eqns = jax.make_jaxpr(grad)(params, batch).jaxpr.eqns
    producer = {id(v): e for e in eqns for v in e.outvars}
    layout = {"reshape", "transpose", "convert_element_type", "copy"}

    def source(var) -> str | None:
        e = producer.get(id(var))
        while e is not None and e.primitive.name in layout:
            e = producer.get(id(e.invars[0]))
        return None if e is None else e.primitive.name

    products = {}
    for e in eqns:
        stack = str(e.source_info.name_stack)
        spec = next((s for s in ("bhts,bshd->bthd", "bthd,bshd->bhts") if s in stack), None)
        if e.primitive.name == "dot_general" and spec and stack.startswith("transpose("):
            products.setdefault(spec, []).append([source(v) for v in e.invars])
    assert sorted(products) == ["bhts,bshd->bthd", "bthd,bshd->bhts"], products
    for spec, sources in products.items():
        assert len(sources) == 2, (spec, sources)  # the gradient of each operand
        for operands in sources:
            assert "dynamic_rescale" in operands, (spec, operands)


def test_with_state_dtype_keeps_fp32_adam_state_for_fp16_weights_under_scalify(mlp_batch):
    """FP8 recipe, FP16 master weights, FP32 optimizer state: the state is created and
    stays FP32 through scalified steps, the weights stay FP16, and the result stays close
    to the FP16-state steps (same recipe, better-rounded optimizer)."""
    import functools

    import scalescope as ss
    from scalescope.sample_models.train_step import with_state_dtype

    prec = get_precision("fp8")
    params = init_mlp(jax.random.PRNGKey(0), MLP_CFG, prec.param_dtype)
    loss_fn = functools.partial(mlp_loss, cfg=MLP_CFG, precision=prec)
    results = {}
    for name, opt in {
        "float16": make_optimizer(),
        "float32": with_state_dtype(make_optimizer(), jnp.float32),
    }.items():
        state = opt.init(params)
        dtypes = {leaf.dtype for leaf in jax.tree.leaves(state) if leaf.ndim > 0}
        assert dtypes == {jnp.dtype(name)}, dtypes
        step = jax.jit(ss.scalify(make_train_step(loss_fn, opt)))
        p, s = ss.as_scaled_array(params, "rms"), ss.as_scaled_array(state, "rms")
        for _ in range(3):
            p, s, loss = step(p, s, mlp_batch)
        p, s = ss.asarray(p), ss.asarray(s)
        assert np.isfinite(float(ss.asarray(loss))) and _all_finite(p) and _all_finite(s)
        assert all(leaf.dtype == jnp.float16 for leaf in jax.tree.leaves(p))
        assert {leaf.dtype for leaf in jax.tree.leaves(s) if leaf.ndim > 0} == dtypes
        results[name] = p
    for a, b in zip(
        jax.tree.leaves(results["float16"]), jax.tree.leaves(results["float32"]), strict=True
    ):
        np.testing.assert_allclose(np.float32(a), np.float32(b), atol=2e-2)


def test_with_state_dtype_of_the_params_dtype_is_the_plain_optimizer():
    from scalescope.sample_models.train_step import with_state_dtype

    params = {"w": jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32), "n": jnp.arange(3)}
    grads = {"w": jnp.linspace(0.5, -0.2, 6, dtype=jnp.float32), "n": jnp.zeros(3, int)}
    plain, wrapped = make_optimizer(), with_state_dtype(make_optimizer(), jnp.float32)
    u0, _ = plain.update(grads, plain.init(params), params)
    u1, _ = wrapped.update(grads, wrapped.init(params), params)
    np.testing.assert_array_equal(u0["w"], u1["w"])


def test_step_recentres_fp16_parameters_and_moments():
    """Scalify's input normalisation leaves FP16 data alone, so the sample step re-centres
    FP16 parameters and optimizer moments itself after the update: their data leaves the
    step at unit RMS whatever the data came in at (here 2^-10, the drift that ruined the
    FP16 recipe's long runs), and the values equal the plain step's."""
    import scalescope as ss

    optimizer = make_optimizer(learning_rate=1e-3)

    def loss_fn(p, b):
        return jnp.mean((b @ p["w16"].astype(jnp.float32) + p["w32"]) ** 2)

    rng = np.random.default_rng(0)
    params = {
        "w16": jnp.asarray(rng.normal(size=(8, 4)), jnp.float16),
        "w32": jnp.asarray(rng.normal(size=(4,)), jnp.float32),
    }
    batch = jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)
    opt_state = optimizer.init(params)
    # FP16 data far below unit, its scale compensating: the same values
    scaled = {
        "w16": ss.ScaledArray((params["w16"] * 2.0**-10).astype(jnp.float16), jnp.float32(2.0**10)),
        "w32": ss.as_scaled_array(params["w32"], "rms"),
    }
    step = jax.jit(ss.scalify(make_train_step(loss_fn, optimizer)))
    new, new_state, loss = step(scaled, ss.as_scaled_array(opt_state, "rms"), batch)
    plain_new, _, plain_loss = jax.jit(make_train_step(loss_fn, optimizer))(
        params, opt_state, batch
    )
    np.testing.assert_allclose(float(ss.asarray(loss)), float(plain_loss), rtol=1e-3)
    data = new["w16"].data.astype(np.float32)
    assert new["w16"].data.dtype == jnp.float16
    assert abs(np.log2(np.sqrt(np.mean(np.square(data))))) < 1  # re-centred
    np.testing.assert_allclose(
        np.asarray(ss.asarray(new["w16"]), np.float32),
        np.asarray(plain_new["w16"], np.float32),
        rtol=2e-3,
        atol=2e-3,
    )
    mu16 = new_state[0].mu["w16"]
    assert abs(np.log2(np.sqrt(np.mean(np.square(mu16.data.astype(np.float32)))))) < 1
