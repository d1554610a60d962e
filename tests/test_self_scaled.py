"""Code that scales values into a narrow format itself, ``clip(x / s, -448, 448)`` then a
cast (Flax's ``fp8_ops`` delayed scaling, qwix, AQT): the probe measures the clip's input,
so that what the clip saturates is the cast's overflow; the advisor judges such values by
their formats only (their RMS sits near the format's max by design), and the safe-division
idiom of their scale update (``where(amax > 0, 448 / amax, scale)``) raises nothing while
the step's outputs stay finite. Checked on Flax's own ``Fp8DirectDotGeneralOp``: a healthy
run has no finding, a jump of the inputs the delayed scale cannot follow is named at its
step, with the share clipped that NumPy computes from the step's inputs and scale."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT as OWG
from probe_reference import reference

import scalescope as ss

E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)


def _op_stats(fn, args, **kw):
    """(op table, {op id: statistics row}) of ``instrument(fn, **kw)`` on ``args``."""
    inst = ss.instrument(fn, **kw)
    _, stats = jax.jit(inst)(*args)
    table = inst.op_table(*args)
    rows = {}
    for op in table:
        if op.recorded:
            r = table.rows(op).start
            rows[op.id] = {k: np.asarray(v)[r] for k, v in stats.items()}
    return table, rows


def _fake_quant(x, s):
    """Flax's ``qdq``: divide by the scale, clip at E4M3's max, cast, cast back."""
    q = jnp.clip(x / s, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return q.astype(jnp.float32) * s


@pytest.mark.parametrize("scalify", [False, True])
def test_a_clip_at_a_formats_max_before_its_cast_is_measured_before_the_clip(scalify):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((32, 32)) * 300.0).astype(np.float32)  # ~14 % beyond 448
    s = np.float32(0.5)
    args = (ss.as_scaled_array(jnp.asarray(x), "rms") if scalify else jnp.asarray(x), s)
    table, rows = _op_stats(_fake_quant, args, scalify=scalify)
    clip = [op for op in table if op.primitive == "min"]
    assert len(clip) == 1, [op.name for op in table]
    clip = clip[0]
    assert clip.origin == "scaled_cast" and clip.cast_to == "e4m3"
    casts = [op for op in table if op.primitive == "convert_element_type" and op.recorded]
    assert [op.origin for op in casts if op.dtype == "float8_e4m3fn"] == ["scaled_cast"]
    got, ref = rows[clip.id], reference(x / s)
    assert ref["overflow_e4m3"] > 0.1  # what the clip saturates, the cast's overflow
    for key in ("overflow_e4m3", "underflow_e4m3", "absmax"):
        assert np.isclose(float(got[key]), ref[key], rtol=1e-6, atol=1e-7), key
    assert abs(float(got["snr_e4m3"]) - ref["snr_e4m3"]) < 1e-3
    if scalify:
        assert float(got["scale"]) == 1.0  # the value as the code clips it


def test_a_clip_at_a_formats_max_that_no_cast_reads_is_an_ordinary_value():
    """ReLU6 clips at 6, E2M1's max: without a cast to E2M1 after it, it is measured as
    computed (its abs-max is 6, nothing overflows) and judged as any value."""
    x = jnp.asarray(np.linspace(-10.0, 10.0, 64, dtype=np.float32))
    table, rows = _op_stats(lambda v: jnp.minimum(jnp.maximum(v, 0.0), 6.0) * 2.0, (x,))
    (clip,) = [op for op in table if op.primitive == "min"]
    assert clip.origin == "" and clip.cast_to == ""
    assert float(rows[clip.id]["absmax"]) == 6.0


def _guarded(x):
    return jnp.where(x > 0, 1.0 / x, 0.0) * 2.0


def _unguarded(x):
    return jnp.where(x >= 0, 1.0 / x, 0.0) * 2.0  # selects 1/0 = inf at x == 0


def _advise(tmp_path, fn, name):
    x = jnp.asarray(np.array([0.0, 1.0, 2.0, -3.0], np.float32))
    with ss.Run(tmp_path / name, every=1) as run:
        step = run.track(fn, scalify=False)
        for _ in range(2):
            step(x)
    reader = ss.open_run(tmp_path / name)
    return reader.ops, reader.advise()


def test_nan_inf_a_where_discards_raises_no_finding(tmp_path):
    """``where(x > 0, 1 / x, 0)``: the division's inf at x == 0 never reaches the output
    (the division is "guarded": every reader is a where); the same division whose where
    keeps the inf is a NaN/inf finding."""
    ops, found = _advise(tmp_path, _guarded, "guarded")
    (div,) = ops.index[ops["primitive"].eq("div")]
    assert ops.loc[div, "origin"] == "guarded"
    assert not len(found[found["rule"] == "nonfinite"]), found
    ops, found = _advise(tmp_path, _unguarded, "unguarded")
    bad = found[found["rule"] == "nonfinite"]
    assert len(bad) and (bad["severity"] == "critical").any(), found


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(32, dot_general_cls=nn.Fp8DirectDotGeneralOp, name="fc1")(x)
        return nn.Dense(8, dot_general_cls=nn.Fp8DirectDotGeneralOp, name="fc2")(nn.gelu(h))


STEPS, JUMP_AT, JUMP = 12, 6, 1e4


def _flax_fp8():
    """A Flax FP8 MLP trained the way Flax's tests train its FP8 ops: the FP8 meta
    (scales, amax histories) is replaced by its "gradient"."""
    model = _MLP()
    x = jax.random.normal(jax.random.PRNGKey(0), (16, 16))
    y = jax.random.randint(jax.random.PRNGKey(1), (16,), 0, 8)
    variables = model.init(jax.random.PRNGKey(2), x)
    tx = optax.adam(1e-2)

    def loss_fn(params, meta, x, y):
        logits = model.apply({"params": params, OWG: meta}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def step(params, meta, opt_state, x, y):
        loss, (g, new_meta) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, meta, x, y)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), new_meta, opt_state, loss

    keys = jax.random.split(jax.random.PRNGKey(10), STEPS)
    batches = [(x + 0.1 * jax.random.normal(k, x.shape), y) for k in keys]
    state = (variables["params"], variables[OWG], tx.init(variables["params"]))
    return step, state, batches


def _train(tmp_path, name, jump: float):
    step, (params, meta, opt), batches = _flax_fp8()
    metas = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with ss.Run(tmp_path / name, every=1) as run:
            tracked = run.track(step, scalify=False)
            for i, (xb, yb) in enumerate(batches):
                xb = xb * (jump if i >= JUMP_AT else 1.0)
                metas.append(meta)
                params, meta, opt, loss = tracked(params, meta, opt, xb, yb)
                run.log(i, loss=float(loss))
    return ss.open_run(tmp_path / name), batches, metas


def test_flax_fp8_delayed_scaling_healthy_run_raises_nothing(tmp_path):
    reader, _, _ = _train(tmp_path, "healthy", 1.0)
    ops = reader.ops
    clips = ops[ops["primitive"].eq("min") & ops["origin"].eq("scaled_cast")]
    assert len(clips) == 6  # x and kernel forward (E4M3), the gradient (E5M2), per layer
    found = reader.advise()
    # before: medium drift and delayed findings on every cast (their RMS sits near 448
    # by design) and a NaN/inf finding on every scale update (448 / 0 at step 0)
    assert not found["rule"].isin(["drift", "trend", "delayed", "nonfinite"]).any(), found
    assert found["severity"].isin(["low"]).all(), found
    assert reader.verdict().status == "healthy"


def test_flax_fp8_inputs_the_delayed_scale_cannot_follow_are_named_at_their_step(tmp_path):
    reader, batches, metas = _train(tmp_path, "jump", JUMP)
    ops, found = reader.ops, reader.advise()
    clip = ops[
        ops["primitive"].eq("min")
        & ops["name"].str.contains("fc1")
        & ops["pass"].eq("fwd")
        & ops["shape"].astype(str).eq(str((16, 16)))
    ]
    assert len(clip) == 1, ops[ops["primitive"].eq("min")]
    over = found[(found["op"] == clip.index[0]) & (found["rule"] == "overflow")]
    assert len(over) == 1, found
    row = over.iloc[0]
    assert row["format"] == "e4m3" and row["first_step"] == JUMP_AT
    assert row["severity"] == "high"
    # the share Flax's clip saturates at the jump: its scale comes from the amax history
    # of the steps before (max amax / 448), the inputs are 10^4 times larger
    fc1 = metas[JUMP_AT]["fc1"]["Fp8DirectDotGeneralOp_0"]
    s = np.float32(np.max(np.asarray(fc1["input_amax_history"])) / E4M3_MAX)
    v = np.asarray(batches[JUMP_AT][0] * JUMP, np.float32) / s
    assert row["value"] == pytest.approx(np.mean(np.abs(v) > E4M3_MAX), abs=1e-6)
    assert "clips them" in row["evidence"] and "amax history" in row["fix"]
    verdict = reader.verdict()
    assert verdict.status in ("failing", "at risk") and verdict.step == JUMP_AT
    assert "e4m3 overflow" in verdict.reasons[0].cause
    # its SNR there is the clip's loss, which the overflow names: not a cause of its own
    snr = found[(found["op"] == clip.index[0]) & (found["rule"] == "snr")]
    assert (snr["severity"] == "low").all()


def test_flax_fp8_meta_in_its_max_gradient_dtype_runs_under_scalify():
    """Flax keeps FP8 meta in ``fp32_max_grad`` (an extended dtype whose gradients combine
    by max; Flax's own ``test_fp8_meta_dtype``): the casts into and out of it
    (``to_edtype`` / ``from_edtype``) had no scaled rule, and scalify stopped there."""
    from flax.linen import fp8_ops

    fm32 = fp8_ops.fp32_max_grad

    def outer(x, history, scale):
        history = jax.lax.convert_element_type(history, fm32)
        scale = jax.lax.convert_element_type(scale, fm32)

        def body(c, _):
            return fp8_ops.in_qdq(jnp.float32, jnp.float8_e4m3fn, c, scale, history), None

        out, _ = jax.lax.scan(body, jnp.array([x], jnp.float32), None, length=3)
        return out[0]

    grad = jax.grad(outer, (0, 1, 2))
    args = (jnp.float32(3.0), jnp.array([2.0, 0.0, 0.0]), jnp.array([1.0]))
    want = jax.jit(grad)(*args)
    scaled = (args[0], ss.as_scaled_array(args[1], "rms"), ss.as_scaled_array(args[2], "rms"))
    got = ss.asarray(jax.jit(ss.scalify(grad))(*scaled))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_fnuz_casts_are_judged_in_their_own_format():
    """Flax's NANOO FP8 ops cast to E4M3FNUZ (max 240): the cast is marked as such, a
    recording that does not measure that format says so, and one that does counts
    values between 240 and 448 as overflow (E4M3FN's limits would pass them)."""
    x = jnp.asarray(np.linspace(-400.0, 400.0, 257, dtype=np.float32))
    fn = lambda v: (v * 1.0).astype(jnp.float8_e4m3fnuz).astype(jnp.float32)  # noqa: E731
    with pytest.warns(UserWarning, match="casts values to e4m3fnuz, which this recording"):
        table, _ = _op_stats(fn, (x,), scalify=False)
    (mul,) = [op for op in table if op.primitive == "mul"]
    assert mul.cast_to == "e4m3fnuz"
    table, rows = _op_stats(fn, (x,), scalify=False, formats=("e4m3", "e4m3fnuz"))
    got, ref = rows[mul.id], reference(np.asarray(x), ("e4m3fnuz",))
    assert float(got["overflow_e4m3"]) == 0.0 and ref["overflow_e4m3fnuz"] > 0.35
    assert np.isclose(float(got["overflow_e4m3fnuz"]), ref["overflow_e4m3fnuz"], atol=1e-7)


def test_every_op_of_a_flax_fp8_layer_is_placed_at_the_layers_line():
    """Flax's FP8 ops trace parts of their bodies lazily (a custom VJP's output
    dequantisation, with flax's own frames only) and JAX reuses what it traced for the
    next layer with the same shapes (its gradient's ``where``/``roll`` kept the first
    layer's frames): every op named after a layer now has that layer's line."""
    import inspect

    step, (params, meta, opt), batches = _flax_fp8()
    lines, first = inspect.getsourcelines(_MLP.__call__)
    at = {
        layer: f"{__file__}:{first + i}"
        for i, text in enumerate(lines)
        for layer in ("fc1", "fc2")
        if f'name="{layer}"' in text
    }
    table = ss.instrument(step, scalify=False).op_table(params, meta, opt, *batches[0])
    placed = 0
    for op in table:
        layer = op.name.split("/")[1] if op.name.startswith("_MLP/") else ""
        if layer in at and op.pass_ in ("fwd", "bwd"):
            assert op.source == at[layer], (op.name, op.pass_, op.source, at[layer])
            placed += 1
    assert placed > 50


def test_a_padding_mask_whose_share_follows_the_batch_is_no_finding(tmp_path):
    """``where(mask, scores, -inf)`` before a softmax (Flax's SST-2 example): the -inf
    share follows each batch's lengths, so it is not the same at every step, yet it is a
    mask (the probe saw the fill) and no NaN/inf finding."""

    def step(w, x, lengths):
        scores = (x @ w)[..., 0]
        mask = jnp.arange(x.shape[1])[None, :] < lengths[:, None]
        p = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
        return w - 0.1 * jax.grad(lambda w: (p * (x @ w)[..., 0]).sum())(w)

    w, x = jnp.ones((4, 1)), jnp.ones((2, 7, 4))
    with ss.Run(tmp_path / "mask", every=1) as run:
        tracked = run.track(step, scalify=False)
        for lengths in ([3, 7], [5, 2], [7, 6]):
            w = tracked(w, x, jnp.asarray(lengths))
    reader = ss.open_run(tmp_path / "mask")
    ops, found = reader.ops, reader.advise()
    assert ops["origin"].eq("fill").any()
    assert not (found["rule"] == "nonfinite").any(), found


def test_the_fix_of_a_self_scaled_cast_follows_its_recorded_abs_max(tmp_path):
    """A fixed calibration range (qwix's ``fixed,-4,4``: a scale of 4/448) on values a
    million times smaller underflows E4M3 because the code's scale is too large for
    them: the fix names that scale and the abs-max it leaves (NumPy's ratio), not a
    format or recipe with the claim that the scale already fits. A range too small
    clips, and the SNR finding's fix says so."""

    def step(w, x, s):
        q = _fake_quant(x, s)
        return w - 0.01 * jax.grad(lambda w: jnp.mean((q @ w) ** 2))(w)

    rng = np.random.default_rng(0)
    base = rng.standard_normal((32, 16)).astype(np.float32)
    cases = {
        "small": (base * 1e-6, np.float32(4.0 / E4M3_MAX)),
        "large": (base * 8.0, np.float32(4.0 / E4M3_MAX)),
    }
    for name, (x, s) in cases.items():
        with ss.Run(tmp_path / name) as run:
            tracked, w = run.track(step, scalify=False), jnp.ones((16, 4)) * 0.1
            for _ in range(3):
                w = tracked(w, jnp.asarray(x), s)
        found = ss.open_run(tmp_path / name).advise()
        peak = float(np.max(np.abs(x / s))) / E4M3_MAX  # what the code's scale leaves
        if name == "small":
            (fix,) = set(found[found["rule"] == "underflow"]["fix"])
            assert "does not fit the value" in fix and "already" not in fix, fix
            assert f"abs-max at {peak:.2g}x e4m3's max: too large a scale" in fix, (fix, peak)
        else:
            snr = found[found["rule"] == "snr"]
            assert len(snr), found[["rule", "format", "fix"]]
            assert all(f"it clips: the value's abs-max is {peak:.3g}x" in f for f in snr["fix"])
