"""The verdict and what it reads: relevance (constants by construction are not judged),
causes (one finding per cause) and the run verdict, on frames whose numbers are chosen
here."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pandas as pd
import pytest
from test_analysis import make_ops, make_stats, series

from scalescope import analysis as A

STEPS = [0, 10, 20, 30, 40]


def _advise(ops, rows, **kw):
    return A.advise(make_stats(rows), ops, **kw)


# -- relevance ----------------------------------------------------------------------------


def test_constants_by_construction_raise_no_drift_trend_or_delayed():
    ops = make_ops(
        {"name": "opt/sub", "pass": "opt", "scaled": True},  # 1 - b1**count, scaled fp16
        {"name": "attn/select_n", "scaled": True},  # a -1e9 mask fill, scaled fp16
        {"name": "mlp/mul", "scaled": True},  # a real value drifting the same way
    )
    ops["origin"] = ["constant", "fill", ""]
    rows = []
    for op in range(3):
        rows += series(op, STEPS, rms=2.0**-9, absmax=[2.0**k for k in range(5)])
    found = _advise(ops, rows, audit=("e4m3",))
    assert set(found["op"]) == {2}
    assert set(found.loc[found["op"] == 2, "rule"]) >= {"drift", "delayed"}


def test_old_runs_fall_back_to_the_fill_magnitude():
    ops = make_ops({"name": "attn/select_n", "scaled": True}, {"name": "mlp/mul", "scaled": True})
    rows = series(0, STEPS, rms=2.0**120, absmax=3.0e38)  # finfo(float32).min fill
    rows += series(1, STEPS, rms=2.0**9, absmax=2.0**10)
    stats = make_stats(rows)
    assert A.constant_ops(ops, stats).tolist() == [0]
    found = A.advise(stats, ops)
    assert found["op"].unique().tolist() == [1]
    summary = A.op_summary(stats, ops)
    assert A.worst_ops(summary, "log2_rms", exclude=A.constant_ops(ops, stats)).index[0] == 1


def test_a_cast_fill_is_still_judged_by_its_format():
    # a finfo.min mask cast to fp16 turns into -inf: that is a finding
    ops = make_ops({"name": "attn/select_n", "cast_to": "fp16"})
    ops["origin"] = ["fill"]
    found = _advise(ops, series(0, STEPS, rms=1e38, absmax=3e38, overflow_fp16=0.5))
    assert found["rule"].tolist() == ["overflow"] and found["severity"].iloc[0] == "critical"


def test_a_fill_mask_is_a_mask_from_its_first_recorded_step():
    # -inf mask entries at two recorded steps: a fill the probe saw is a mask already; an
    # op of unknown origin needs `Thresholds.mask_min_steps` (3) steps to be one
    ops = make_ops({"name": "attn/select_n"}, {"name": "attn/sub"})
    ops["origin"] = ["fill", ""]
    rows = series(0, [0, 2], frac_nonfinite=0.49) + series(1, [0, 2], frac_nonfinite=0.49)
    found = _advise(ops, rows)
    assert found.loc[found["rule"] == "nonfinite", "op"].tolist() == [1]
    # a fill whose share changes went bad: judged
    moved = series(0, [0, 2], frac_nonfinite=[0.49, 0.6])
    assert _advise(ops.iloc[:1], moved)["rule"].tolist() == ["nonfinite"]


def test_delayed_concerns_cast_values_or_an_audited_format():
    ops = make_ops({"name": "a/mul", "cast_to": "e4m3"}, {"name": "b/mul"})
    rows = []
    for op in range(2):
        rows += series(op, STEPS, absmax=[2.0**k for k in range(5)])
    found = _advise(ops, rows)
    assert found.loc[found["rule"] == "delayed", "op"].tolist() == [0]
    audited = _advise(ops, rows, audit=("e5m2",))
    assert sorted(audited.loc[audited["rule"] == "delayed", "op"]) == [0, 1]
    evidence = audited[(audited["rule"] == "delayed") & (audited["op"] == 1)]["evidence"]
    assert "e5m2" in evidence.iloc[0]


def test_delayed_scaling_concerns_fp8_casts_not_bf16_or_fp16():
    """BF16 and FP16 values are cast without a per-tensor scale: an amax that grows
    (a zero-initialised norm scale in warm-up, on Flax's Gemma in BF16) is no "delayed
    scaling" finding there, as it is for an FP8 cast."""
    ops = make_ops(
        {"name": "a/mul", "cast_to": "bf16"},
        {"name": "b/mul", "cast_to": "fp16"},
        {"name": "c/mul", "cast_to": "e5m2"},
    )
    rows = []
    for op in range(3):
        rows += series(op, STEPS, absmax=[2.0**k for k in range(5)])
    found = _advise(ops, rows)
    assert found.loc[found["rule"] == "delayed", "op"].tolist() == [2]
    assert _advise(ops, rows, audit=("bf16",)).query("rule == 'delayed'")["op"].tolist() == [2]


# -- impact -------------------------------------------------------------------------------


def test_impact_is_the_share_of_signal_lost():
    ops = make_ops(
        {"name": "a/x", "pass": "bwd", "cast_to": "e5m2"},
        {"name": "b/x", "cast_to": "e4m3"},
        {"name": "c/x", "cast_to": "e4m3"},
        {"name": "d/x", "cast_to": "e4m3"},
    )
    rows = series(0, [0, 10], underflow_e5m2=[0.5, 0.9], snr_e5m2=[20.0, 3.0])
    rows += series(1, [0, 10], snr_e4m3=[10.0, 12.0])
    rows += series(2, [0, 10], overflow_e4m3=[0.0, 1e-3], absmax=[1.0, 900.0])
    rows += series(3, [0, 10], underflow_e4m3=[0.05, 0.4], snr_e4m3=[20.0, 3.0])
    found = _advise(ops, rows).set_index(["op", "rule"])
    # a gradient: each flushed element is a piece of an update lost
    assert found.loc[(0, "underflow"), "impact"] == pytest.approx(0.9)
    assert found.loc[(1, "snr"), "impact"] == pytest.approx(0.1)
    assert found.loc[(2, "overflow"), "impact"] == 1.0  # inf/NaN in the step
    # a forward value: the cast's noise power over signal power at the worst step
    assert found.loc[(3, "underflow"), "impact"] == pytest.approx(10**-0.3)
    assert np.isfinite(found.loc[(3, "snr"), "impact"])


@pytest.mark.parametrize(
    ("fmt", "peak", "saturated"),
    [
        ("e4m3", 460.0, True),
        ("e4m3", 464.5, False),
        ("e5m2", 61000.0, True),
        ("fp16", 65530.0, False),
    ],
)
def test_an_overflow_that_rounds_to_the_max_loses_no_step(fmt, peak, saturated):
    # values past the max but under max + ulp/2 round to the max (no inf/NaN): the edge is
    # where ml_dtypes' own cast turns them inf (NaN in e4m3fn)
    dtype = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2, "fp16": np.float16}
    with np.errstate(over="ignore"):
        finite = bool(np.isfinite(np.float32(peak).astype(dtype[fmt]).astype(np.float32)))
    assert finite == saturated
    ops = make_ops({"name": "a/x", "cast_to": fmt})
    rows = series(0, [0, 10], **{f"overflow_{fmt}": [0.0, 1e-3], "absmax": [1.0, peak]})
    found = _advise(ops, rows)
    row = found[found["rule"] == "overflow"].iloc[0]
    if saturated:
        assert row["severity"] == "medium" and row["impact"] < 1e-3, row.to_dict()
        assert "no headroom" in row["evidence"]
        assert A.verdict(found).status == "healthy"
    else:
        assert row["severity"] == "high" and row["impact"] == 1.0, row.to_dict()
        assert A.verdict(found).status == "failing"


# -- causes -------------------------------------------------------------------------------


def test_module_of_folds_layers():
    assert A.module_of("blocks/mlp/add_any", "bwd") == "blocks/mlp"
    assert A.module_of("block_0/attn/dot_general", "fwd") == "block_*/attn"
    assert A.module_of("block_11/attn/dot_general", "fwd") == "block_*/attn"
    assert A.module_of("blocks/3/attn/qkv/w/mul", "opt") == "blocks/*/attn"
    assert A.module_of("Block_2/MlpBlock_0/Dense_1/dot_general", "fwd") == "Block_*/MlpBlock_*"
    assert A.module_of("fc1/dot_general", "fwd") == "fc1"
    assert A.module_of("mul", "opt") == ""


def test_causes_group_layers_and_rank_by_severity_then_impact():
    ops = make_ops(
        {"name": "block_0/mlp/add_any", "pass": "bwd", "cast_to": "e5m2"},
        {"name": "block_1/mlp/add_any", "pass": "bwd", "cast_to": "e5m2"},
        {"name": "block_0/attn/dot_general", "pass": "bwd", "cast_to": "e5m2"},
        {"name": "block_0/mlp/dot_general", "cast_to": "e4m3"},
    )
    rows = series(0, STEPS, underflow_e5m2=0.99, snr_e5m2=1.0, rms=2.0**-20)  # drifts too
    rows += series(1, STEPS, underflow_e5m2=[0.0, 0.5, 0.6, 0.7, 0.8], snr_e5m2=3.0)
    rows += series(2, STEPS, underflow_e5m2=0.4, snr_e5m2=10.0)
    rows += series(3, STEPS, underflow_e4m3=0.015, snr_e4m3=30.0)
    table = A.causes(_advise(ops, rows))
    assert list(table.columns) == A.CAUSE_COLUMNS
    found = _advise(ops, rows)
    assert {"drift", "underflow", "snr"} <= set(found.loc[found["op"] == 0, "rule"])
    # the SNR each cast loses, and its drift, are the same cause as its underflow
    assert table["cause"].tolist() == [
        "e5m2 underflow in 2 bwd ops of block_*/mlp",
        "e5m2 underflow in 1 bwd op of block_*/attn",
        "e4m3 underflow in 1 fwd op of block_*/mlp",
    ]
    first = table.iloc[0]
    assert first["n_ops"] == 2 and first["op"] == 0 and first["first_step"] == 0
    assert first["worst"] == "99% flushed" and first["severity"] == "high"
    assert first["impact"] == pytest.approx(0.99)
    assert first["ops"][0].startswith("bwd/block_0/mlp/add_any")
    assert table.iloc[-1]["severity"] == "low"
    assert A.causes(_advise(ops, series(0, STEPS))).empty


# -- the verdict --------------------------------------------------------------------------


def _findings(severity_rows):
    ops = make_ops(*[{"name": f"m{i}/x", "pass": "bwd", "cast_to": "e5m2"} for i in range(3)])
    rows = []
    for op, (under, snr) in enumerate(severity_rows):
        rows += series(op, STEPS, underflow_e5m2=under, snr_e5m2=snr)
    return _advise(ops, rows)


def test_a_healthy_headline_counts_findings_as_the_report_does():
    """Two low findings of one cause: the headline said "1 minor finding" beside the
    report's "2 findings" (it counted causes)."""
    ops = make_ops(*[{"name": f"m/x{i}", "pass": "bwd", "cast_to": "e5m2"} for i in range(2)])
    rows = []
    for op in range(2):
        rows += series(op, STEPS, underflow_e5m2=0.015, snr_e5m2=30.0)
    findings = _advise(ops, rows)
    v = A.verdict(findings)
    assert len(findings) == 2 and sum(v.counts.values()) == 1, (findings, v.counts)
    assert v.headline == "verdict: healthy (2 minor findings)"
    assert v.findings == {"low": 2}


def test_verdict_levels():
    healthy = A.verdict(_findings([(0.015, 30.0)]))  # a low finding
    assert healthy.status == "healthy" and healthy.step is None and not healthy.reasons
    assert healthy.headline == "verdict: healthy (1 minor finding)"
    # medium (59 % of a gradient flushed, a run that trained as well as fp32): a warning
    assert A.verdict(_findings([(0.59, 20.0)])).status == "healthy"
    # high, part of the value left: at risk
    risk = A.verdict(_findings([(0.8, 20.0)]))
    assert risk.status == "at risk" and risk.step == 0
    assert risk.reasons[0].cause == "e5m2 underflow in 1 bwd op of m0"
    # high, nearly all of a gradient lost: failing, the cause first
    failing = A.verdict(_findings([(0.1, 20.0), (0.99, 1.0)]))
    assert failing.status == "failing"
    assert failing.reasons[0].cause == "e5m2 underflow in 1 bwd op of m1"
    assert failing.reasons[0].fix and failing.reasons[0].source == "model.py:11"
    assert failing.headline.startswith("verdict: failing from step 0: e5m2 underflow")
    assert failing.rank == 2 and failing.as_dict()["status"] == "failing"
    assert "fix:" in str(failing)
    # the threshold is a parameter
    lenient = A.verdict(_findings([(0.99, 1.0)]), thresholds=A.VerdictThresholds(1.0))
    assert lenient.status == "at risk"


def test_verdict_a_nan_loss_fails_the_run():
    loss = pd.Series([2.0, 1.9, math.nan, math.nan], index=[0, 1, 2, 3], name="loss")
    v = A.verdict(_findings([(0.0, 30.0)]), loss)
    assert v.status == "failing" and v.step == 2
    assert v.reasons[0].cause == "the loss turned NaN/inf"
    assert A.verdict(_findings([(0.0, 30.0)]), loss.iloc[:2]).status == "healthy"


def test_a_nan_loss_starts_with_the_cause_that_makes_nan_not_the_earliest_cause():
    """A loss NaN from step 300, a value holding NaN/inf from step 300 (a division), and
    a gradient losing nearly everything since step 0 (failing too): the NaN reason names
    the division and the next reason is it. It named the gradient, whose fix cannot
    remove a NaN."""
    ops = make_ops(
        {"name": "m/x", "pass": "bwd", "cast_to": "e5m2", "source": "model.py:48"},
        {"name": "ln/div", "source": "model.py:44"},
    )
    rows = series(0, STEPS, underflow_e5m2=0.99, snr_e5m2=1.0)
    rows += series(1, STEPS, frac_nonfinite=[0, 0, 0, 0.5, 1])
    loss = pd.Series([2.0, 1.9, 1.8, math.nan, math.nan], index=STEPS, name="loss")
    v = A.verdict(_advise(ops, rows), loss)
    assert v.status == "failing" and v.reasons[0].cause == "the loss turned NaN/inf"
    assert v.reasons[0].source == "model.py:44", v.reasons
    assert "NaN" in v.reasons[1].cause or "non-finite" in v.reasons[1].cause, v.reasons[1]
    assert v.reasons[1].source == "model.py:44"
    # the gradient is still among the reasons
    assert any(r.source == "model.py:48" for r in v.reasons[2:])


def test_logged_loss_keeps_logged_nans():
    rows = pd.DataFrame(
        {
            "step": [0, 0, 1, 1],
            "name": ["loss", "lr", "loss", "lr"],
            "value": [1.0, 0.1, np.nan, 0.1],
        }
    )
    got = A.logged_loss(rows)
    assert got.index.tolist() == [0, 1] and np.isnan(got.iloc[1])


def test_parse_status_and_worst_first():
    assert A.parse_status("at-risk") == "at risk" == A.parse_status("At_Risk")
    with pytest.raises(ValueError, match="unknown verdict 'bad'"):
        A.parse_status("bad")
    vs = [A.Verdict("healthy"), A.Verdict("failing", step=30), A.Verdict("at risk", step=5)]
    vs.append(A.Verdict("failing", step=10))
    assert A.worst_first(vs) == [3, 1, 2, 0]
    with pytest.raises(ValueError, match="failing_impact"):
        A.VerdictThresholds(failing_impact=2)


@pytest.mark.parametrize("outputs", ["finite", "nonfinite", "unrecorded"])
def test_nan_dropped_downstream_loses_no_step(outputs):
    # a schedule's unused branch is inf at step 0 only (optax.join_schedules evaluates
    # both): a where drops it, the step's outputs stay finite
    ops = make_ops({"name": "opt/div", "pass": "opt"}, {"name": "a/y"}, {"name": "output/0"})
    ops.loc[2, ["stats_op", "note"]] = [1, "output"]
    rows = series(0, [0, 10, 20], frac_nonfinite=[1.0, 0.0, 0.0])
    if outputs != "unrecorded":
        bad = 0.25 if outputs == "nonfinite" else 0.0
        rows += series(1, [0, 10, 20], frac_nonfinite=[bad, 0.0, 0.0])
    found = _advise(ops, rows)
    row = found[(found["rule"] == "nonfinite") & (found["op"] == 0)].iloc[0]
    if outputs == "finite":
        assert row["severity"] == "low" and row["impact"] == 0.0, row.to_dict()
        assert "dropped downstream" in row["evidence"]
        assert A.verdict(found).status == "healthy"
    else:  # it reaches the outputs, or nothing says it does not
        assert row["severity"] == "critical" and row["impact"] == 1.0, row.to_dict()
        assert A.verdict(found).status == "failing"


def _train(path, tx, loss_fn, w, steps=3):
    """``steps`` optax steps of ``loss_fn`` from ``w``, tracked by a Run at ``path``
    recording every step and logging the loss; returns ``(w, last loss, the run)``."""
    import jax
    import optax

    import scalescope as ss

    def step(w, state):
        loss, g = jax.value_and_grad(loss_fn)(w)
        updates, state = tx.update(g, state, w)
        return optax.apply_updates(w, updates), state, loss

    state = tx.init(w)
    with ss.Run(path, every=1) as run:
        tracked = run.track(step)
        for i in range(steps):
            w, state, loss = tracked(w, state)
            run.log(i, loss=loss)
    return w, loss, ss.open_run(path)


@pytest.mark.parametrize("reaches", [False, True])
def test_a_schedules_inf_branch_is_judged_by_what_reaches_the_parameters(tmp_path, reaches):
    # optax.join_schedules evaluates every schedule: the rsqrt branch is 4/0 at step 0,
    # dropped by its where (a healthy run); used directly, the inf reaches the weights
    import jax.numpy as jnp
    import optax

    rsqrt = lambda s: 1e-3 * jnp.sqrt(4.0 / s)  # noqa: E731
    joined = optax.join_schedules([optax.constant_schedule(1e-3), rsqrt], [4])
    tx = optax.sgd(optax.join_schedules([rsqrt, rsqrt], [10]) if reaches else joined)
    x = jnp.linspace(-1.0, 1.0, 32).reshape(8, 4)
    loss_fn = lambda w: jnp.mean((x @ w - 1.0) ** 2)  # noqa: E731
    _, _, view = _train(tmp_path / "run", tx, loss_fn, jnp.ones((4,)))
    found = view.advise()
    nonfinite = found[found["rule"] == "nonfinite"]
    v = view.verdict()
    if reaches:
        assert len(nonfinite), found
        assert v.status == "failing", v
    else:
        # made from the step count and dropped by its select while the weights stay
        # finite: by design, no finding (it was a low one on every such healthy run)
        assert v.status == "healthy", v
        assert not len(nonfinite), nonfinite


def test_a_healthy_verdict_says_how_many_ops_were_measured_when_not_all_were():
    """Under a budget ops are measured in turns: "healthy" after 14 of 254 ops were
    measured must say so (it read as a clean bill for the whole model)."""
    from scalescope.analysis.bundle import coverage_text, unjudged_if_unrecorded

    class Reader:  # three values (op 3 is an alias of op 1, op 4 has no statistics)
        steps = np.array([0, 1])
        ops = pd.DataFrame({"stats_op": [0, 1, 2, 1, -1]})

        def __init__(self, last):
            self.last = last

        def measured(self):
            return pd.DataFrame({"last_measured": self.last})

    partial = Reader([1.0, np.nan, 0.0, np.nan, np.nan])
    assert coverage_text(partial) == "2 of 3 ops measured so far"
    assert coverage_text(Reader([1.0, 1.0, 0.0, 1.0, np.nan])) == ""
    v = unjudged_if_unrecorded(A.verdict(pd.DataFrame()), partial)
    assert v.headline == "verdict: healthy (2 of 3 ops measured so far)"
    assert v.as_dict()["coverage"] == "2 of 3 ops measured so far"


def test_a_healthy_verdict_says_the_flight_recorder_caught_incidents():
    """fp32 Adam at lr=3 diverges (loss 1.35 -> 76) with five loss spikes caught and no
    precision finding: the verdict stays a precision verdict, but "healthy" alone read
    as if training were. Its headline says the incidents; a failing one is unchanged."""
    from scalescope.analysis.bundle import incident_text, unjudged_if_unrecorded

    class Reader:
        steps = np.array([0, 10])

        def __init__(self, triggers):
            self.triggers = triggers

        def incidents(self):
            return pd.DataFrame({"step": range(len(self.triggers)), "trigger": self.triggers})

    spikes = Reader(["loss_spike"] * 4 + ["norm_spike"])
    said = "5 incidents (loss_spike, norm_spike), no precision cause found"
    assert incident_text(spikes) == said and incident_text(Reader([])) == ""
    v = unjudged_if_unrecorded(A.verdict(pd.DataFrame()), spikes)
    assert v.status == "healthy" and v.headline == f"verdict: healthy ({said})"
    assert v.as_dict()["incidents"] == said
    loss = pd.Series([1.0, np.nan], index=[0, 10], name="loss")
    failing = unjudged_if_unrecorded(A.verdict(pd.DataFrame(), loss), spikes, loss)
    assert failing.status == "failing" and failing.incidents == ""


def test_loss_trend_text_reads_divergence_not_noise():
    """A run that diverges for no precision reason (Llama at lr=3: 4.56 -> 288 -> 7.49)
    has no finding; its healthy verdict must say the loss went up. Healthy curves (a
    falling loss, a warmup bump, noise), a loss that can be negative and too few values
    say nothing."""
    from scalescope.analysis.bundle import loss_trend_text

    rng = np.random.default_rng(0)
    steps = np.arange(0, 400, 10)
    diverged = np.full(len(steps), 7.49)
    diverged[:3] = [4.56, 120.0, 288.0]
    said = loss_trend_text(pd.Series(diverged, index=steps))
    assert said == "the logged loss diverged: 4.56 at step 0, peak 288 at step 20, 7.49 at the end"
    rising = pd.Series(np.geomspace(1.0, 50.0, 20))  # still rising: the end is the peak
    assert loss_trend_text(rising) == "the logged loss diverged: 1 at step 0, 40.7 at the end"
    falling = 4.6 * np.exp(-steps / 150) + 1.0 + 0.05 * rng.standard_normal(len(steps))
    bump = falling.copy()
    bump[2:6] *= 1.8  # a warmup bump, below ten times the first value
    for quiet in (falling, bump, -diverged, diverged[:9]):
        assert loss_trend_text(pd.Series(quiet, index=steps[: len(quiet)])) == ""
    spiked = falling.copy()
    spiked[5] = 60.0  # one spike above ten times the first value
    assert "peak 60 at step 50" in loss_trend_text(pd.Series(spiked, index=steps))
    assert loss_trend_text(None) == "" and loss_trend_text(pd.Series([], dtype=float)) == ""


@pytest.mark.parametrize("lr", [0.05, 1.5])
def test_a_healthy_verdict_says_the_logged_loss_diverged(tmp_path, capsys, lr):
    """fp32 SGD on least squares: at lr=1.5 the loss grows each step with no precision
    cause; the verdict stays healthy (precision is fine) and its headline says the loss
    diverged. At lr=0.05 it falls and the headline says nothing of it."""
    import jax
    import jax.numpy as jnp

    import scalescope as ss

    x = jnp.linspace(-1.0, 1.0, 32).reshape(8, 4) + jnp.eye(8, 4)
    y = jnp.arange(8.0) / 8

    def step(w, lr):
        loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
        return w - lr * g, loss

    w = jnp.zeros((4,))
    with ss.Run(tmp_path / "run", every=1) as run:
        tracked = run.track(step)
        for i in range(12):
            w, loss = tracked(w, jnp.float32(lr))
            run.log(i, loss=loss)
    v = ss.open_run(tmp_path / "run").verdict()
    assert v.status == "healthy", v
    # the CI gate fails on it when asked (diverged>0), and says why
    from scalescope.cli import main

    gate = ["report", str(tmp_path / "run"), "-o", str(tmp_path / "r.html")]
    code = main([*gate, "--fail-on", "diverged>0"])
    printed = capsys.readouterr().out
    if lr > 1:
        assert v.trend.startswith("the logged loss diverged: "), v
        assert v.headline.endswith(f"({v.trend}, no precision cause found)"), v.headline
        assert v.as_dict()["trend"] == v.trend
        assert code == 1 and f"TRIPPED: diverged>0: the logged loss diverged ({v.trend})" in printed
    else:
        assert v.trend == "" and "diverged" not in v.headline, v.headline
        assert code == 0 and "ok: diverged>0: the logged loss did not diverge" in printed
    assert main([*gate, "--fail-on", "diverged>-1"]) == 2  # a count cannot be negative


@pytest.mark.parametrize("eps", [1e-8, 1e-4])
def test_a_float16_adam_nan_is_fixed_by_fp32_optimizer_or_an_eps_float16_holds(tmp_path, eps):
    """float16 parameters under AdamW: eps=1e-8 is 0 in float16 (NumPy says so below),
    so where a gradient is 0 the update divides 0 by 0 at step 0. The fix named is fp32
    optimizer arithmetic or an eps float16 holds (``jax_debug_nans`` only stopped there);
    the same run with eps=1e-4 trains, finite (what the fix claims, checked)."""
    import jax
    import jax.numpy as jnp
    import optax

    assert np.float16(1e-8) == 0 and np.float16(1e-4) > 0
    key = jax.random.PRNGKey(0)
    w = (0.2 * jax.random.normal(key, (16, 8))).astype(jnp.float16)
    x = jax.random.normal(key, (32, 16)).astype(jnp.float16)
    x = x.at[:, :4].set(0)  # inputs that are 0: their weights' gradients are exactly 0
    loss_fn = lambda w: jnp.mean(jnp.tanh(x @ w).astype(float) ** 2)  # noqa: E731
    w, loss, view = _train(tmp_path / "run", optax.adamw(1e-3, eps=eps), loss_fn, w)
    v = view.verdict()
    if eps < 1e-7:
        assert not np.isfinite(np.asarray(w, np.float32)).all()
        assert v.status == "failing", v
        fixes = " ".join(r.fix for r in v.reasons)
        assert "keep the optimizer in fp32" in fixes, v
        assert "float16 holds (its smallest value is 6e-08" in fixes, v
        assert "jax_debug_nans" not in fixes, v
    else:
        assert np.isfinite(np.asarray(w, np.float32)).all() and np.isfinite(float(loss))
        assert v.status == "healthy", v


def test_a_loss_name_never_logged_is_an_error_naming_the_logged_ones():
    rows = pd.DataFrame({"step": [0, 1], "name": ["train_loss", "acc"], "value": [1.0, 0.5]})
    with pytest.raises(
        KeyError, match="no scalar 'nope' was logged; this run logs: acc, train_loss"
    ):
        A.logged_loss(rows, "nope")
    assert A.logged_loss(rows, "train_loss").tolist() == [1.0]
    assert A.logged_loss(rows).empty  # the default name: a run may log no loss


def _loss_scaled_fp16_run(
    path, scaler: str, steps: int = 40, weight: float = 1.0, dtype: str = "float16"
):
    """A float16 MLP trained with dynamic loss scaling, the standard FP16 recipe: the
    loss times the scale (from 2^15, doubled after 8 good steps), float16 gradients
    divided by it. The seed of the backward pass is the scale in float16, so at 2^16
    (over float16's 65504) every gradient is inf. ``scaler``: ``"skip"`` discards such
    a step and halves the scale; ``"apply"`` applies it anyway; ``"stuck"`` skips but
    never halves (every step overflows); ``"2**k"``: a static scale, no skip (``2**0``:
    no loss scaling). ``weight`` multiplies the loss (in ``dtype``). Returns
    ``(losses, the run)``."""
    import jax
    import jax.numpy as jnp
    import optax

    import scalescope as ss

    key1, key2, key3 = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(key1, (64, 16))
    y = jnp.tanh(x @ jax.random.normal(key2, (16, 4)))
    params = {"w1": 0.25 * jax.random.normal(key3, (16, 32)), "w2": jnp.zeros((32, 4))}
    tx = optax.adam(1e-2)

    def loss_fn(p):
        p16 = jax.tree.map(lambda a: a.astype(dtype), p)
        h = jnp.tanh(x.astype(dtype) @ p16["w1"])
        return jnp.mean((h @ p16["w2"] - y.astype(dtype)) ** 2) * jnp.asarray(weight, dtype)

    def step(params, state, scale, good):
        def scaled(p):
            loss = loss_fn(p)
            return loss.astype(jnp.float32) * scale, loss

        (_, loss), g = jax.value_and_grad(scaled, has_aux=True)(params)
        g = jax.tree.map(lambda a: a / scale, g)
        finite = jnp.all(jnp.stack([jnp.isfinite(a).all() for a in jax.tree.leaves(g)]))
        updates, new_state = tx.update(g, state, params)
        new_params = optax.apply_updates(params, updates)
        if scaler in ("skip", "stuck"):
            new_params = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_params, params)
            new_state = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_state, state)
        good = jnp.where(finite, good + 1, 0)
        grow = good >= 8
        shrink = 0.5 if scaler != "stuck" else 1.0
        scale = jnp.where(finite, jnp.where(grow, 2 * scale, scale), shrink * scale)
        if scaler.startswith("2**"):
            scale = jnp.float32(2.0 ** int(scaler[3:]))
        return new_params, new_state, scale, jnp.where(grow, 0, good), loss.astype(jnp.float32)

    state, scale, good = tx.init(params), jnp.float32(2.0**15), jnp.int32(0)
    if scaler == "stuck":
        scale = jnp.float32(2.0**16)
    elif scaler.startswith("2**"):
        scale = jnp.float32(2.0 ** int(scaler[3:]))
    losses = []
    with ss.Run(path, every=1) as run:
        tracked = run.track(step, scalify=False)  # naive FP16, as most write it
        for i in range(steps):
            params, state, scale, good, loss = tracked(params, state, scale, good)
            run.log(i, loss=loss)
            losses.append(float(loss) / weight)
    return np.asarray(losses), ss.open_run(path)


@pytest.mark.parametrize("scaler", ["skip", "apply", "stuck"])
def test_a_loss_scalers_skipped_overflow_is_no_alarm(tmp_path, capsys, scaler):
    """A dynamic loss scaler probes upward and overflows by design (here at 4 of 40
    steps): the step is skipped, the outputs stay finite and the run trains. That
    overflow is judged low (dropped downstream), not "failing". The same overflow
    applied to the weights (NaN) still fails, and so does a scaler whose every step
    overflows (it never trains: nothing is dropped at a minority of steps)."""
    losses, view = _loss_scaled_fp16_run(tmp_path / "run", scaler)
    v = view.verdict()
    found = view.advise()
    over = found[(found["rule"] == "overflow") & (found["format"] == "fp16")]
    assert len(over), found  # the seed of the backward pass overflows float16 each time
    if scaler == "skip":
        assert np.isfinite(losses).all() and losses[-1] < 0.5 * losses[0], losses
        assert v.status == "healthy", v
        assert (over["severity"] == "low").all(), over
        assert over["evidence"].str.contains("dropped downstream").all(), over
    elif scaler == "apply":
        assert not np.isfinite(losses[-1]), losses
        assert v.status == "failing", v
        # a NaN loss is a diverged one for the CI gate too (it said "did not diverge")
        from scalescope.cli import main

        nan_step = int(np.flatnonzero(~np.isfinite(losses))[0])
        capsys.readouterr()
        gate = ["report", str(tmp_path / "run"), "-o", str(tmp_path / "r.html")]
        assert main([*gate, "--fail-on", "diverged>0"]) == 1
        said = f"the logged loss diverged (the logged loss turned NaN/inf at step {nan_step})"
        said = f"TRIPPED: diverged>0: {said}"
        assert said in capsys.readouterr().out
    else:
        assert losses[-1] == losses[0], losses  # every step skipped: nothing learnt
        assert v.status != "healthy", v
        assert (over["severity"] != "low").any(), over


def test_sunk_fp16_gradients_are_offered_the_loss_scale_that_trains(tmp_path):
    """A float16 loss weighted by 2**-15 with no loss scaling: its gradients sink to
    float16's subnormals and are flushed as they are computed, so the probe sees the
    scale's drift (2**-23) rather than a cast's underflow, and the run lags fp32. The
    fix offers loss scaling by the largest power the backward pass's seed (the loss's
    cotangent, 1) allows in float16: 2**15, not the 2**23 the RMS asks for (65504 is
    under 2**16). Trained with it, the run follows fp32 (what the fix claims, checked)."""
    import re

    weight = 2.0**-15
    plain, view = _loss_scaled_fp16_run(tmp_path / "none", "2**0", weight=weight)
    fp32, _ = _loss_scaled_fp16_run(tmp_path / "fp32", "2**0", weight=weight, dtype="float32")
    v = view.verdict()
    assert v.status != "healthy", v
    fixes = " ".join(r.fix for r in v.reasons)
    k = re.search(r"loss scaling by 2\*\*(\d+)", fixes)
    assert k is not None and int(k.group(1)) == 15, fixes
    scaled, view2 = _loss_scaled_fp16_run(tmp_path / "scaled", "2**15", weight=weight)
    gap = lambda run: abs(run[-1] - fp32[-1]) / fp32[-1]  # noqa: E731
    assert gap(plain) > 0.05 and gap(scaled) < 0.02, (plain[-1], scaled[-1], fp32[-1])
    assert view2.verdict().status == "healthy", view2.verdict()


def test_a_run_at_risk_whose_loss_diverged_has_failed():
    """A high cause puts a run at risk; beside a logged loss that went up and stayed up
    (qwix's static activation scale overrun from step 10: 83 % clipped, the loss from
    2.0 to 660) the run has failed, from the step the loss passed twice its first value,
    and the first reason says so. A falling loss, or a spike it recovered from, leaves
    it at risk; a divergence with no precision cause stays healthy, with the note."""
    findings = _findings([(0.8, 20.0)])  # high, part of the value left
    steps = np.arange(30)
    diverged = pd.Series(np.where(steps < 10, 2.0 - 0.01 * steps, 600.0), index=steps, name="loss")
    v = A.verdict(findings, diverged)
    assert v.status == "failing" and v.step == 10, v
    assert v.reasons[0].cause == "the loss diverged" and v.reasons[0].severity == "critical"
    assert "2 at step 0" in v.reasons[0].evidence
    assert v.reasons[1].cause == "e5m2 underflow in 1 bwd op of m0"
    falling = pd.Series(2.0 - 0.01 * steps, index=steps, name="loss")
    spike = falling.copy()
    spike[12] = 40.0
    for loss in (falling, spike, None):
        assert A.verdict(findings, loss).status == "at risk"
    assert A.verdict(_findings([(0.59, 20.0)]), diverged).status == "healthy"


@pytest.mark.parametrize("sparse", [False, True])
def test_a_guarded_nan_no_path_carries_on_is_no_finding_beside_one_that_spreads(sparse):
    """A schedule's unused branch (0: inf, 1: its product, 2: the select keeping the other
    branch, finite) beside a cast that overflows (3) into the loss (4, an output): only
    the overflow's NaN is a finding, though the outputs are not finite. The ops' inputs
    (`ops.parquet`'s ``inputs``) tell it; a run stored without them keeps the old
    judgement. ``sparse``: one op is not recorded at every step (the advisor's sparse
    cells), and a reader not recorded at a step may carry the NaN on."""
    ops = make_ops(
        {"name": "opt/pow", "pass": "opt"},
        {"name": "opt/mul", "pass": "opt"},
        {"name": "opt/select_n", "pass": "opt"},
        {"name": "fwd/convert_element_type"},
        {"name": "fwd/reduce_sum"},
        {"name": "output/loss", "primitive": "output"},
        {"name": "fwd/tanh"},
    )
    ops["origin"] = ["constant", "constant", "constant", "", "", "", ""]
    ops["stats_op"] = [0, 1, 2, 3, 4, 4, 6]
    ops["inputs"] = [(), (0,), (1,), (), (3,), (), ()]
    bad = [1.0, 0.0, 0.0, 0.0, 0.0]  # step 0 only
    rows = series(0, STEPS, frac_nonfinite=bad) + series(1, STEPS, frac_nonfinite=bad)
    rows += series(2, STEPS, frac_nonfinite=0.0)
    rows += series(3, STEPS, frac_nonfinite=[0.5, 0.6, 0.5, 0.7, 0.4])  # no mask: it varies
    rows += series(4, STEPS, frac_nonfinite=1.0)
    rows += series(6, STEPS[1:] if sparse else STEPS, frac_nonfinite=0.0)
    nan_ops = lambda f: sorted(f.loc[f["rule"] == "nonfinite", "op"])  # noqa: E731
    assert nan_ops(_advise(ops, rows)) == [3, 4]
    assert nan_ops(_advise(ops.drop(columns="inputs"), rows)) == [0, 1, 3, 4]
    if sparse:  # the select not recorded at step 0: it may have kept the inf
        kept = [r for r in rows if not (r["op"] == 2 and r["step"] == 0)]
        assert nan_ops(_advise(ops, kept)) == [0, 1, 3, 4]
