"""`ss.emulate`: each value a policy's rule reaches is replaced by its quantise-dequantise
in the rule's format or recipe, bit for bit the independent NumPy reference
(tests/recipe_reference.py, ml_dtypes for the formats), in the forward pass and on a
cotangent; nothing else changes."""

from __future__ import annotations

import sys
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
import recipe_reference as R

import scalescope as ss
from scalescope.core import recipes as _recipes

FORMATS = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2,
           "fp16": np.float16, "bf16": ml_dtypes.bfloat16}  # fmt: skip
TARGETS = list(FORMATS) + list(_recipes.names())


def _format_ref(v: np.ndarray, target: str) -> np.ndarray:
    """Round to nearest even on the format's grid, saturating at its max (ml_dtypes
    rounds float32 once); non-finite elements unchanged."""
    dtype = FORMATS[target]
    top = float(ml_dtypes.finfo(dtype).max)
    out = np.clip(v, -top, top).astype(dtype).astype(np.float32)
    return np.where(np.isfinite(v), out, v)


def _ref(v: np.ndarray, target: str, axis: int = -1) -> np.ndarray:
    v = np.asarray(v, np.float32)
    if target in FORMATS:
        return _format_ref(v, target)
    return R.dequantise(v, target, axis)


def _same(got, want, what: str) -> None:
    got, want = np.asarray(got), np.asarray(want)
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    assert same.all(), (
        f"{what}: {int((~same).sum())} of {same.size} differ, first at "
        f"{np.argwhere(~same)[0]}: got {got[~same][0]!r}, want {want[~same][0]!r}"
    )


def _data(rng, shape, spread=2.0) -> np.ndarray:
    """Normal data over a few decades, with ties of the formats' grids sprinkled in."""
    v = rng.standard_normal(shape) * np.exp(rng.standard_normal(shape) * spread)
    return v.astype(np.float32)


@pytest.fixture(scope="module")
def operands():
    rng = np.random.default_rng(7)
    x = jnp.asarray(_data(rng, (6, 40)))
    ws = [jnp.asarray(_data(rng, (40, 36))) for _ in TARGETS]
    c = jnp.asarray(_data(rng, (6, 36), 0.5))
    return x, ws, c


@pytest.fixture(scope="module")
def mlp_step():
    """A two-layer MLP's AdamW training step: (params, opt_state, loss)."""
    rng = np.random.default_rng(1)
    params = {"w1": jnp.asarray(_data(rng, (16, 32), 0.3)) * 0.3,
              "w2": jnp.asarray(_data(rng, (32, 4), 0.3)) * 0.3}  # fmt: skip
    x, y = jnp.asarray(_data(rng, (8, 16), 0.3)), jnp.asarray(_data(rng, (8, 4), 0.3))
    opt = optax.adamw(1e-2)

    def loss(p, x, y):
        with jax.named_scope("mlp"):
            h = jax.nn.gelu(x @ p["w1"])
            return jnp.mean((h @ p["w2"] - y) ** 2)

    def step(p, s, x, y):
        value, g = jax.value_and_grad(loss)(p, x, y)
        with jax.named_scope("opt"):
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s, value

    return step, (params, opt.init(params), x, y)


def _products(x, ws):
    out = []
    for i, w in enumerate(ws):
        with jax.named_scope(f"t{i}"):
            out.append(x @ w)
    return out


def test_forward_values_match_the_reference_for_every_target(operands):
    x, ws, _ = operands
    policy = {f"fwd/t{i}/dot_general": t for i, t in enumerate(TARGETS)}
    emulated = jax.jit(ss.emulate(_products, policy))(x, ws)
    plain = jax.jit(_products)(x, ws)
    for target, got, value in zip(TARGETS, emulated, plain):
        _same(got, _ref(np.asarray(value), target), f"forward {target}")
        assert not np.array_equal(np.asarray(got), np.asarray(value)), target


def test_gradients_match_the_reference_and_only_the_targeted_one_changes(operands):
    x, ws, c = operands

    def loss(ws):
        return sum(jnp.sum(jnp.tanh(y) * c) for y in _products(x, ws))

    def grads(ws):
        return jax.grad(loss)(ws)

    table = ss.instrument(grads).op_table(ws)
    bwd = {op.name: op for op in table if op.pass_ == "bwd" and op.primitive == "dot_general"}
    assert sorted(bwd) == sorted(f"t{i}/dot_general" for i in range(len(TARGETS)))
    plain = jax.jit(grads)(ws)
    # every target at once: each gradient holds its own rounding
    policy = {f"bwd/t{i}/dot_general": t for i, t in enumerate(TARGETS)}
    emulated = jax.jit(ss.emulate(grads, policy))(ws)
    for i, target in enumerate(TARGETS):
        g = np.asarray(plain[i])
        op = bwd[f"t{i}/dot_general"]  # dW^T = dY^T X, transposed into dW: blocks along dW's rows
        want = _ref(g, target) if op.shape == g.shape else _ref(g.T, target).T
        _same(emulated[i], want, f"cotangent {target}")
    # one gradient targeted: the others and the loss's other values are bit for bit plain
    one = jax.jit(ss.emulate(grads, {"bwd/t3/dot_general": TARGETS[3]}))(ws)
    for i in range(len(TARGETS)):
        changed = not np.array_equal(np.asarray(one[i]), np.asarray(plain[i]))
        assert changed == (i == 3), i


def test_a_gemm_operand_is_blocked_along_the_axis_the_gemm_contracts(operands):
    x, ws, _ = operands
    w = ws[0]
    out = jax.jit(ss.emulate(lambda x, w: x @ w, {"input/w": "mxfp8_e4m3"}))(x, w)
    wq = R.dequantise(np.asarray(w), "mxfp8_e4m3", axis=0)  # w is contracted along axis 0
    _same(out, jax.jit(lambda x, w: x @ w)(x, jnp.asarray(wq)), "x @ q(w)")
    assert not np.array_equal(wq, R.dequantise(np.asarray(w), "mxfp8_e4m3", axis=-1))


def test_an_empty_policy_and_fp32_targets_leave_a_training_step_bit_for_bit(mlp_step):
    step, args = mlp_step
    plain = jax.jit(step)(*args)
    for policy in ({}, {"**": "fp32"}):
        got = jax.jit(ss.emulate(step, policy))(*args)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(plain), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_policy_on_an_optimizer_moment_changes_the_state_it_reaches(mlp_step):
    step, args = mlp_step
    table = ss.instrument(step).op_table(*args)
    labels = ss.Policy({}).describe(table, strict=False)  # no rules: nothing reached
    assert labels == []
    emulated = ss.emulate(step, {"opt/**": "bf16"})
    reached = emulated.describe(*args)[0]["ops"]
    assert reached and all(label.startswith("opt/") for label in reached)
    got = jax.jit(emulated)(*args)
    plain = jax.jit(step)(*args)
    # the loss comes before the optimizer: unchanged; the new parameters: rounded
    assert float(got[-1]) == float(plain[-1])
    new = jax.tree.leaves(got[0])
    assert any(not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(new, jax.tree.leaves(plain[0])))  # fmt: skip


def test_scalified_values_are_quantised_on_their_data():
    rng = np.random.default_rng(3)
    x = ss.as_scaled_array(jnp.asarray(_data(rng, (8, 32), 1.0)), scale=4.0)
    w = ss.as_scaled_array(jnp.asarray(_data(rng, (32, 16), 1.0)), scale=0.5)

    def f(x, w):
        return x @ w

    plain = jax.jit(ss.scalify(f))(x, w)
    got = jax.jit(ss.emulate(f, {"fwd/dot_general": "e4m3"}, scalify=True))(x, w)
    assert isinstance(got, ss.ScaledArray)
    assert float(got.scale) == float(plain.scale)
    _same(got.data, _format_ref(np.asarray(plain.data), "e4m3"), "scaled data")


def test_gradients_pass_straight_through_an_emulated_function():
    x = jnp.linspace(-3.0, 3.0, 64).reshape(2, 32)
    f = ss.emulate(lambda x: jnp.sin(x), {"fwd/sin": "e4m3"})
    g = jax.grad(lambda x: jnp.sum(f(x)))(x)
    np.testing.assert_allclose(np.asarray(g), np.cos(np.asarray(x)), rtol=1e-6)


def test_instrument_with_a_policy_measures_the_emulated_step(operands):
    x, ws, _ = operands

    def f(x, w):
        return jnp.tanh(x @ w)

    policy = {"fwd/dot_general": "nvfp4"}
    out, stats = jax.jit(ss.instrument(f, policy=policy))(x, ws[0])
    want = jax.jit(ss.emulate(f, policy))(x, ws[0])
    _same(out, want, "instrumented output")
    table = ss.instrument(f, policy=policy).op_table(x, ws[0])
    (dot,) = table.find("dot_general")
    (tanh,) = table.find("tanh")
    plain = np.asarray(x @ ws[0])  # the dot is measured as computed, before the rounding
    assert float(stats["absmax"][table.rows(dot)][0]) == pytest.approx(np.abs(plain).max())
    # what reads it reads the rounded value
    rounded = np.tanh(R.dequantise(plain, "nvfp4").astype(np.float64))
    assert float(stats["absmax"][table.rows(tanh)][0]) == pytest.approx(np.abs(rounded).max())


def test_bad_policies_are_errors_naming_the_rule(operands):
    x, ws, _ = operands
    f = ss.emulate(lambda x, w: jnp.tanh(x @ w), {"fwd/mlp/dot_general": "e4m3"})
    with pytest.raises(ss.PolicyError, match=r"fwd/mlp/dot_general.*reaches no op.*fwd/"):
        f(x, ws[0])
    with pytest.raises(ss.PolicyError, match="unknown format or recipe 'mxfp9'"):
        ss.emulate(lambda x: x, {"fwd/**": "mxfp9"})
    with pytest.raises(ss.PolicyError, match="expected a Policy"):
        ss.emulate(lambda x: x, 3)


def test_a_value_held_for_matmuls_no_matmul_can_be_seen_to_read_is_a_warning():
    ws = jnp.ones((3, 8, 8), jnp.float32) * 0.1
    x = jnp.ones((2, 8), jnp.float32)

    def f(ws, x):
        def body(h, w):
            with jax.named_scope("layer"):
                return jnp.tanh(h @ w), None

        return jnp.sum(jax.lax.scan(body, x, ws)[0])

    with pytest.warns(UserWarning, match=r"read by no matmul .*\(input/ws\)"):
        out = ss.emulate(f, {"input/ws": "nvfp4@matmul"})(ws, x)
    assert float(out) == float(f(ws, x))  # the rule changed nothing, as the warning says


def test_a_rule_may_choose_the_block_axis(operands):
    x, ws, _ = operands
    w = ws[1]
    f = ss.emulate(lambda x, w: (x @ w) * 1.0, {"fwd/dot_general": "mxfp8_e4m3:0"})
    y = np.asarray(jax.jit(lambda x, w: x @ w)(x, w))
    _same(jax.jit(f)(x, w), R.dequantise(y, "mxfp8_e4m3", axis=0), "blocks along axis 0")
    rule = ss.Policy({"a": "nvfp4:-2@matmul"}).rules[0]
    assert (rule.target, rule.axis, rule.reads, rule.spec) == (
        "nvfp4",
        -2,
        "matmul",
        "nvfp4:-2@matmul",
    )
    with pytest.raises(ss.PolicyError, match="a block axis applies to a recipe"):
        ss.Policy({"a": "e4m3:0"})
    with pytest.raises(ss.PolicyError, match="':x' is not a block axis"):
        ss.Policy({"a": "nvfp4:x"})
    with pytest.raises(ss.PolicyError, match="has 2 axes; its rule blocks along axis 5"):
        ss.emulate(lambda x, w: x @ w, {"fwd/dot_general": "nvfp4:5"})(x, w)


def test_a_tracked_policy_run_is_judged_in_the_formats_it_rounds_to(mlp_step, tmp_path):
    """A run recorded under a policy marks each value a rule reaches as cast to the rule's
    target (and records that recipe's statistics), so the advisor judges it as it judges a
    real cast: before, the verdict of FP8 master weights whose values all flushed to zero
    was "healthy", no format rule having anything to judge."""
    step, (params, state, x, y) = mlp_step
    params = {**params, "w2": params["w2"] * 1e-3}  # |w2| < E4M3's smallest subnormal
    policy = {"input/p/w2": "e4m3", "input/p/w1": "mxfp8_e4m3@matmul"}
    formats = ("e4m3", "e5m2", "fp16", "bf16", "mxfp8_e4m3")
    readers = {}
    for name, pol in (("plain", None), ("policy", policy)):
        with ss.Run(tmp_path / name, every=1, formats=formats) as run:
            tracked = run.track(step, scalify=False, policy=pol)
            p, s = params, state
            for i in range(3):
                p, s, loss = tracked(p, s, x, y)
                run.log(i, loss=float(loss))
        readers[name] = ss.open_run(tmp_path / name)
    ops = readers["policy"].ops.set_index("name")
    assert ops.loc["input/p/w2", "cast_to"] == "e4m3"
    assert ops.loc["input/p/w1", "cast_to"] == "mxfp8_e4m3"
    assert set(ops["cast_to"]) == {"", "e4m3", "mxfp8_e4m3"}  # nothing else is marked
    assert not (readers["plain"].ops["cast_to"] != "").any()

    def w2_underflow(reader):
        f = reader.advise()
        return f[(f["rule"] == "underflow") & (f["name"] == "input/p/w2")]

    found = w2_underflow(readers["policy"])
    assert len(found) == 1 and found["format"].iloc[0] == "e4m3"
    assert found["severity"].iloc[0] in ("high", "critical")
    assert readers["policy"].verdict().status != "healthy"
    assert w2_underflow(readers["plain"]).empty and readers["plain"].verdict().status == "healthy"
    # a target the run does not record cannot be judged: said when the step is tracked
    with ss.Run(tmp_path / "unjudged") as run:
        with pytest.warns(UserWarning, match=r"rounds values to mxfp8_e4m3, which .* does not"):
            run.track(step, scalify=False, policy=policy)


def test_a_value_held_for_matmuls_is_judged_only_where_a_matmul_reads_it(mlp_step, tmp_path):
    """``bwd/**: e5m2@matmul`` reaches every backward value, yet rounds only those a
    matmul reads: the others (GELU's backward products, the gradient sums) are neither
    rounded nor judged in E5M2. Before, every value the rule reached was marked cast to
    E5M2, and their unrounded statistics made the findings and the verdict's first cause."""
    step, (params, state, x, y) = mlp_step
    with ss.Run(tmp_path / "r", every=1) as run:
        tracked = run.track(step, scalify=False, policy={"bwd/**": "e5m2@matmul"})
        with warnings.catch_warnings():  # the rule works through the matmuls: no warning
            warnings.filterwarnings("error", message=".*read by no matmul")
            tracked(params, state, x, y)
    ops = ss.open_run(tmp_path / "r").ops
    bwd = ops[(ops["pass"] == "bwd") & (ops["note"] == "")]
    read = bwd["gemm"].astype(bool)
    assert read.any() and (~read).sum() >= 3  # the rule reaches both kinds
    assert set(bwd.loc[read, "cast_to"]) == {"e5m2"}
    assert set(bwd.loc[~read, "cast_to"]) == {""}, bwd.loc[~read, ["name", "cast_to"]]


def test_a_tracked_policy_run_plans_its_two_programs_once(mlp_step, tmp_path, monkeypatch):
    """A run under a policy builds the policy's plan (the plain probe's op table of the
    step) once for its recording program and its plain one, not once each; a standalone
    `emulate` keeps a plan of its own."""
    step, (params, state, x, y) = mlp_step
    plain_probes = []
    build = sys.modules["scalescope.probe.instrument"].instrument

    def counted(*args, **kwargs):
        if kwargs.get("formats") == ():  # a probe without statistics: a plan's
            plain_probes.append(kwargs)
        return build(*args, **kwargs)

    for module in ("scalescope.probe.instrument", "scalescope.probe.emulate"):
        monkeypatch.setattr(sys.modules[module], "instrument", counted)
    policy = {"input/p/w1": "e4m3"}
    with ss.Run(tmp_path / "run", every=1) as run:
        tracked = run.track(step, scalify=False, policy=policy)
        p, s = params, state
        for _ in range(2):
            p, s, _ = tracked(p, s, x, y)
    assert len(plain_probes) == 1 and plain_probes[0]["formats"] == ()
    ss.emulate(step, policy).op_table(params, state, x, y)
    assert len(plain_probes) == 2


def test_held_weights_whose_updates_round_away_are_a_stall(mlp_step, tmp_path):
    """Weights held in E4M3 (FP8 master weights) at |w| ~ 1 with AdamW's updates of 1e-2,
    under half E4M3's spacing there: most updates round away and the weights stop
    moving, while the weights' own statistics sit well inside E4M3. The run's held-update
    figures match NumPy + ml_dtypes on the step's own inputs and outputs, the advisor
    reports a high ``stall`` and the verdict is not healthy. Held in FP16 the same
    updates are kept (no stall); held ``@matmul`` the weights are not held at all; Adam's
    moments are held state that is not measured."""
    step, (params, state, x, y) = mlp_step
    params = {k: v * 10 for k, v in params.items()}
    formats = ("e4m3", "fp16", "bf16")
    seen = {}
    for name, pol in (
        # Adam's nu held in bf16 too: state, but not weights (the loss does not read it),
        # so not measured: an EMA's step is a small part of its value by design
        ("e4m3", {"input/p/**": "e4m3", "input/s/**/nu/**": "bf16"}),
        ("fp16", {"input/p/**": "fp16"}),
        ("matmul", {"input/p/**": "e4m3@matmul"}),
    ):
        with ss.Run(tmp_path / name, every=1, formats=formats) as run:
            tracked = run.track(step, scalify=False, policy=pol)
            p, s = params, state
            for i in range(3):
                before = p
                p, s, loss = tracked(p, s, x, y)
                run.log(i, loss=float(loss))
                if i == 0:
                    seen[name] = (before, p)
            with pytest.raises(ValueError, match="run's own figures"):
                run.log(3, **{"scalescope.held_update/0/lost": 1.0})
        seen[name] += (ss.open_run(tmp_path / name),)
    before, after, reader = seen["e4m3"]
    assert list(reader.scalars.columns) == ["loss"]  # the figures are not logged scalars
    held = reader.held_updates()
    ops = reader.ops["name"]
    assert sorted(ops[held["op"].unique()]) == ["input/p/w1", "input/p/w2"]
    assert held.groupby("op")["step"].apply(list).tolist() == [[0, 1, 2], [0, 1, 2]]
    for op, leaf in ((held["op"][ops[held["op"]].to_numpy() == f"input/p/{k}"].iloc[0], k)
                     for k in ("w1", "w2")):  # fmt: skip
        old, new = np.asarray(before[leaf]), np.asarray(after[leaf])
        base, kept = _format_ref(old, "e4m3"), _format_ref(new, "e4m3")
        moved = (new - base) != 0
        row = held[(held["op"] == op) & (held["step"] == 0)].iloc[0]
        assert row["moved"] == moved.sum() and row["lost"] == (moved & (kept == base)).sum()
        np.testing.assert_allclose(row["e2"], np.sum((kept - new) ** 2.0), rtol=1e-4)
        assert row["lost"] > 0.5 * row["moved"]
    found = reader.advise()
    stall = found[found["rule"] == "stall"]
    assert set(stall["name"]) == {"input/p/w1", "input/p/w2"}
    assert set(stall["format"]) == {"e4m3"} and "high" in set(stall["severity"])
    assert "e4m3@matmul" in stall["fix"].iloc[0]
    assert reader.verdict().status != "healthy"
    # the dashboard's advisor (a snapshot of the run, in a thread) says the same
    from scalescope.app.data import RunData

    data = RunData(tmp_path / "e4m3")
    shown = data.findings()
    assert (shown["rule"] == "stall").sum() == len(stall)
    assert data.verdict(shown).status == reader.verdict().status
    # the weights' own E4M3 statistics raise nothing high: only the update shows it
    assert not found[(found["rule"] != "stall") & found["severity"].isin(["high", "critical"])]\
        .shape[0]  # fmt: skip
    fp16 = seen["fp16"][2]
    assert len(fp16.held_updates()) == 6
    assert not (fp16.advise()["rule"] == "stall").any()
    assert seen["matmul"][2].held_updates().empty
