"""The delayed-scaling replay (`scalescope.analysis.delayed`), `RunReader.delayed_scaling`
and the advisor's ``delayed`` rule.

Expected values come from an independent replay written here with plain Python loops
(an amax history as a list), and clipped fractions from NumPy counts on the data
itself; the recorded runs are read back through the real reader."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from scalescope import analysis as A
from scalescope.analysis.delayed import delayed_scaling

E4M3_MAX = 448.0
E5M2_MAX = 57344.0
HIST_LO, HIST_HI = -40, 23
HIST_LABELS = ["zero", "below", *(f"2^{e}" for e in range(HIST_LO, HIST_HI + 1))]
HIST_LABELS += ["above", "nonfinite"]


# -- the independent replay ----------------------------------------------------------------


def reference_replay(amaxes, history, algo, margin, fmt_max):
    """TE / Flax delayed scaling, one step at a time: the scale used at a step comes from
    the history before that step's amax is pushed; a reference that is 0, NaN or inf (a
    NaN anywhere in the history makes the max NaN) keeps the previous scale."""
    past: list[float] = []
    scale, threshold = 1.0, fmt_max
    out = []
    for amax in amaxes:
        window = past[-history:]
        if not window:
            ref = math.nan
        elif algo == "most_recent":
            ref = window[-1]
        elif any(math.isnan(a) for a in window):
            ref = math.nan
        else:
            ref = max(window)
        if math.isfinite(ref) and ref > 0:
            scale = fmt_max / ref / 2.0**margin
            threshold = ref * 2.0**margin
        if math.isnan(amax):
            headroom = math.nan
        elif amax == 0 or math.isinf(amax):
            headroom = -math.inf if amax else math.inf
        else:
            headroom = math.log2(threshold / amax)
        out.append(dict(amax=amax, amax_ref=ref, scale=scale, threshold=threshold,
                        headroom_log2=headroom))  # fmt: skip
        past.append(amax)
    return pd.DataFrame(out)


def hist_row(data: np.ndarray) -> dict[str, int]:
    """The exponent histogram of ``data`` (bins of floor(log2|d|), as the probe counts)."""
    a = np.abs(np.asarray(data, np.float64))
    row = dict.fromkeys(HIST_LABELS, 0)
    row["zero"] = int((a == 0).sum())
    row["nonfinite"] = int((~np.isfinite(a)).sum())
    e = np.floor(np.log2(a[np.isfinite(a) & (a > 0)])).astype(int)
    row["below"] = int((e < HIST_LO).sum())
    row["above"] = int((e > HIST_HI).sum())
    for k in e[(e >= HIST_LO) & (e <= HIST_HI)]:
        row[f"2^{k}"] += 1
    return row


def numpy_bounds(data: np.ndarray, threshold_data: float) -> tuple[float, float, float]:
    """(surely clipped, possibly clipped, actually clipped) fractions of ``data`` against
    a threshold in data units, counted per binade with NumPy."""
    a = np.abs(np.asarray(data, np.float64)).ravel()
    e = np.full(a.shape, -np.inf)
    nz = a > 0
    e[nz] = np.floor(np.log2(a[nz]))
    e_thr = math.floor(math.log2(threshold_data))
    return (
        float(np.mean(e > e_thr)),
        float(np.mean(e >= e_thr)),
        float(np.mean(a > threshold_data)),
    )


SEQUENCES = {
    "growing": [2.0**k for k in range(8)],
    "spiking": [1.0, 1.0, 8.0, 1.0, 1.0, 1.0, 0.5, 3.0, 1.0],
    "constant": [3.0] * 7,
    "zeros": [0.0, 0.0, 5.0, 0.0, 2.0, 7.0, 0.0],
    "inf": [1.0, math.inf, 2.0, 4.0, 1.0, 16.0, 2.0],
    "nan": [1.0, 2.0, math.nan, 4.0, 1.0, 3.0, 9.0, 2.0],
}


def frame_of(amaxes, steps=None, scale=1.0) -> pd.DataFrame:
    steps = list(range(0, 10 * len(amaxes), 10)) if steps is None else steps
    absmax = [a / scale for a in amaxes]
    return pd.DataFrame({"step": steps, "absmax": absmax, "scale": scale})


COLUMNS = ["amax", "amax_ref", "scale", "threshold", "headroom_log2"]


@pytest.mark.parametrize("name", list(SEQUENCES))
@pytest.mark.parametrize("history", [1, 3, 1024])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 1])
def test_replay_matches_a_plain_loop(name, history, algo, margin):
    amaxes = SEQUENCES[name]
    got = delayed_scaling(frame_of(amaxes, scale=0.5), history=history, algo=algo, margin=margin)
    want = reference_replay(amaxes, history, algo, margin, E4M3_MAX)
    assert list(got.columns) == [
        "step",
        "amax",
        "amax_ref",
        "scale",
        "threshold",
        "clipped_min",
        "clipped_max",
        "headroom_log2",
        "gap",
    ]
    assert got["step"].tolist() == list(range(0, 10 * len(amaxes), 10))
    for col in COLUMNS:
        np.testing.assert_allclose(got[col], want[col], rtol=1e-15, err_msg=col)
    # the threshold is fmt.max / scale (computed exactly as amax_ref * 2**margin)
    np.testing.assert_allclose(got["threshold"], E4M3_MAX / got["scale"], rtol=1e-14)
    # no histogram columns: exactly 0 where nothing clips, unknown (NaN) elsewhere
    fits = np.asarray(amaxes) <= want["threshold"].to_numpy()
    for col in ("clipped_min", "clipped_max"):
        assert (got.loc[fits, col] == 0).all()
        assert got.loc[~fits, col].isna().all()
    assert np.isnan(got["gap"].iloc[0]) and (got["gap"].iloc[1:] == 10).all()
    assert got.attrs == dict(history=history, algo=algo, margin=margin, fmt="e4m3")


def test_replay_first_step_and_kept_scale():
    got = delayed_scaling(frame_of(SEQUENCES["inf"]), history=2)
    # the first step: empty history, scale 1.0, threshold e4m3's max
    assert math.isnan(got["amax_ref"][0]) and got["scale"][0] == 1.0
    assert got["threshold"][0] == E4M3_MAX
    # steps 2, 3: inf in the history keeps the scale of step 1 (from amax 1.0)
    assert got["amax_ref"][2] == math.inf and got["amax_ref"][3] == math.inf
    assert got["scale"][2] == got["scale"][3] == E4M3_MAX
    assert got["threshold"][4] == 4.0  # inf has left the window of 2
    zeros = delayed_scaling(frame_of([0.0, 0.0, 3.0]), history=8)
    assert zeros["scale"].tolist() == [1.0, 1.0, 1.0]  # amax_ref 0 keeps scale 1.0
    constant = delayed_scaling(frame_of([3.0] * 5))
    assert (constant["clipped_max"] == 0).all()  # never clipped through rounding
    assert (constant["headroom_log2"].iloc[1:] == 0).all()


@pytest.mark.parametrize("history", [1, 3, 7, 1024])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_replay_of_a_long_noisy_sequence(history, algo):
    """Longer than the history (the sliding-window path), with NaN, inf and zeros."""
    rng = np.random.default_rng(history)
    amaxes = np.exp2(rng.normal(0, 2, 2500))
    amaxes[rng.integers(0, 2500, 20)] = np.nan
    amaxes[rng.integers(0, 2500, 5)] = np.inf
    amaxes[rng.integers(0, 2500, 20)] = 0.0
    got = delayed_scaling(frame_of(list(amaxes)), history=history, algo=algo, margin=0.5)
    want = reference_replay(list(amaxes), history, algo, 0.5, E4M3_MAX)
    for col in COLUMNS:
        np.testing.assert_allclose(got[col], want[col], rtol=1e-15, err_msg=col)


def test_replay_format_and_unsorted_steps():
    frame = frame_of([1.0, 4.0, 2.0]).iloc[::-1]
    got = delayed_scaling(frame, fmt="e5m2", history=4)
    assert got["step"].tolist() == [0, 10, 20]
    assert got["threshold"].tolist() == [E5M2_MAX, 1.0, 4.0]
    assert got["scale"].tolist() == [1.0, E5M2_MAX, E5M2_MAX / 4]
    assert got.attrs["fmt"] == "e5m2"


# -- clipped bounds from the histogram -----------------------------------------------------


def test_clipped_bounds_match_numpy_counts_on_the_data():
    """A value of data x * g_t (g growing, a spike, a drop) recorded with scale 0.25: the
    bounds from its histogram equal NumPy's per-binade counts against the replayed
    threshold, and bracket the exact clipped fraction."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(4096).astype(np.float32)
    x[:7] = 0.0
    gains = [1.0, 1.3, 1.7, 5.0, 1.0, 1.2, 3.1, 0.4, 6.5]
    scale = 0.25
    data = [x * np.float32(g) for g in gains]
    frame = pd.DataFrame(
        [dict(step=s, absmax=float(np.abs(d).max()), scale=scale, **hist_row(d))
         for s, d in enumerate(data)]
    )  # fmt: skip
    for history, algo in ((1, "max"), (3, "max"), (2, "most_recent")):
        got = delayed_scaling(frame, history=history, algo=algo)
        amaxes = [float(np.abs(d).max()) * scale for d in data]
        want = reference_replay(amaxes, history, algo, 0, E4M3_MAX)
        clipped_steps = 0
        for t, d in enumerate(data):
            thr = want["threshold"][t]
            if amaxes[t] <= thr:
                assert got["clipped_min"][t] == got["clipped_max"][t] == 0.0
                continue
            clipped_steps += 1
            lo, hi, exact = numpy_bounds(d, thr / scale)
            assert got["clipped_min"][t] == pytest.approx(lo, abs=1e-15)
            assert got["clipped_max"][t] == pytest.approx(hi, abs=1e-15)
            assert lo <= exact <= hi and exact > 0
            assert got["headroom_log2"][t] < 0
        assert clipped_steps >= 3


def test_clipped_bounds_with_loop_iterations_and_edge_bins():
    """Rows of one step are iterations sharing one history: the amax is their max and the
    clipped counts add up, each row against the threshold in its own data units; the
    ``above`` bin counts as entirely above a threshold below it, non-finite never."""
    a = np.array([0.5, 1.0, 3.0, 6.0, 0.0, np.inf], np.float32)
    b = np.array([1.0, 2.0**30, 3.0], np.float32)  # 2^30: the ``above`` bin
    rows = [
        dict(step=0, iteration=0, absmax=6.0, scale=1.0, **hist_row(a)),
        dict(step=0, iteration=1, absmax=3.0, scale=2.0, **hist_row(b[[0, 2]])),
        dict(step=1, iteration=0, absmax=6.0, scale=1.0, **hist_row(a)),
        dict(step=1, iteration=1, absmax=2.0**30, scale=2.0, **hist_row(b)),
    ]
    got = delayed_scaling(pd.DataFrame(rows), history=4)
    assert got["amax"].tolist() == [6.0, 2.0**31]
    assert got["threshold"].tolist() == [E4M3_MAX, 6.0]
    assert got["clipped_min"][0] == 0.0
    # step 1, threshold 6: row a (data units 6) clips nothing surely, 6.0's binade [4, 8)
    # holds the threshold; row b (data units 3) clips 2^30 surely, 3.0's binade [2, 4)
    # holds the threshold. 9 elements in all.
    assert got["clipped_min"][1] == pytest.approx(1 / 9)
    assert got["clipped_max"][1] == pytest.approx(3 / 9)


def test_rows_that_did_not_run_are_skipped():
    frame = frame_of([1.0, 2.0, 4.0]).assign(count=[16, 0, 16])
    got = delayed_scaling(frame, history=1)
    assert got["step"].tolist() == [0, 20]
    assert got["amax_ref"][1] == 1.0


def test_empty_frame_gives_empty_replay():
    got = delayed_scaling(frame_of([]))
    assert got.empty and list(got.columns)[0] == "step"


# -- argument errors -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(history=0), "history: expected an int >= 1, got 0"),
        (dict(history=2.5), "history: .*got 2.5"),
        (dict(history=True), "history: .*got True"),
        (dict(algo="mean"), "algo: expected one of 'max', 'most_recent', got 'mean'"),
        (dict(margin="1"), "margin: expected a finite real number, got '1'"),
        (dict(margin=math.nan), "margin: .*got nan"),
        (dict(margin=True), "margin: .*got True"),
        (dict(fmt="e9m9"), "fmt: unknown format 'e9m9'"),
    ],
)
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        delayed_scaling(frame_of([1.0, 2.0]), **kwargs)


def test_bad_frames():
    with pytest.raises(TypeError, match="frame: expected a pandas DataFrame"):
        delayed_scaling([1.0, 2.0])
    with pytest.raises(ValueError, match=r"frame: missing column\(s\) \['absmax'\]"):
        delayed_scaling(pd.DataFrame({"step": [0], "scale": [1.0]}))
    with pytest.raises(ValueError, match=r"frame: rows of 2 ops \[3, 4\]"):
        delayed_scaling(frame_of([1.0, 2.0]).assign(op=[3, 4]))
    with pytest.raises(ValueError, match="frame: step must hold integers, got 0.5"):
        delayed_scaling(frame_of([1.0, 2.0], steps=[0, 0.5]))
    partial = frame_of([1.0]).assign(zero=0, below=0, **{"2^0": 1, "2^2": 0})
    with pytest.raises(ValueError, match=r"incomplete exponent histogram.*'above'.*'2\^1'"):
        delayed_scaling(partial)


# -- the advisor ---------------------------------------------------------------------------


def advisor_frames(amaxes: dict[int, list[float]], steps=None, **extra):
    """Op table and wide stats of float ops with the given value amax per step."""
    ops = pd.DataFrame(
        [dict(op=i, name=f"layer/op{i}", **{"pass": "fwd"}, primitive="mul", shape=(8,),
              dtype="float32", scaled=False, source=f"model.py:{i}", note="", stats_op=i,
              cast_to="e4m3" if i == 0 else "")
         for i in amaxes]
    ).set_index("op")  # fmt: skip
    rows = []
    for op, values in amaxes.items():
        for k, v in enumerate(values):
            step = k * 10 if steps is None else steps[k]
            rows.append(dict(step=step, op=op, iteration=0, count=16.0, scale=1.0, absmax=v,
                             rms=1.0, frac_nonfinite=0.0) | extra)  # fmt: skip
    return pd.DataFrame(rows), ops


def test_advisor_fires_on_fast_growth_only():
    grow = [1.0 * 2.0**k for k in range(6)]
    stationary = [3.0, 2.9, 3.1, 3.0, 3.05, 2.95]
    first_big = [1000.0, 1000.0, 999.0, 1000.0]  # clips at step 0 (scale 1): not growth
    single = [1.0]
    stats, ops = advisor_frames({0: grow, 1: stationary, 2: first_big, 3: single})
    found = A.advise(stats, ops)
    hit = found[found["rule"] == "delayed"]
    assert hit["op"].tolist() == [0]
    row = hit.iloc[0]
    assert row["severity"] == "low" and row["format"] == ""
    assert "clips in e4m3" in row["evidence"]
    assert row["first_step"] == 10 and row["steps"] == 5
    assert row["value"] == pytest.approx(1.0)  # amax is 2x (log2: 1) the threshold
    assert "steps 10, 20, 30, 40, 50" in row["evidence"]
    assert "grows ×2 per recorded step" in row["evidence"]
    assert "history=1024" in row["evidence"]
    assert "most_recent" in row["fix"] and "e4m3_tensor" in row["fix"]
    assert "scalify=True)  # at model.py:0" in row["fix"]
    scalified = A.advise(stats, ops, meta={"graph": {"scalify": True}})
    fix = scalified[scalified["rule"] == "delayed"].iloc[0]["fix"]
    # the value's abs-max outgrows the history: rescale by the abs-max each step
    assert fix.endswith("or x = ss.ops.dynamic_rescale_max(x)  # after model.py:0")
    summary = A.summary_by_rule(found).set_index("rule")
    assert summary.loc["delayed", "findings"] == 1


def test_advisor_history_threshold_and_gap():
    spike = [1.0, 8.0, 1.0, 1.0, 4.0]  # 4.0 clips under a short history only
    stats, ops = advisor_frames({0: spike}, steps=[0, 100, 200, 300, 400])
    long = A.advise(stats, ops)
    assert long["steps"].tolist() == [1]
    short = A.advise(stats, ops, thresholds=A.Thresholds(delayed_history=1))
    hit = short[short["rule"] == "delayed"].iloc[0]
    assert hit["steps"] == 2 and "steps 100, 400" in hit["evidence"]
    assert "recorded every 100 steps" in hit["evidence"]
    assert "amax history < 1" in hit["fix"]
    with pytest.raises(ValueError, match="Thresholds.delayed_history: expected an int >= 1"):
        A.Thresholds(delayed_history=0)


def test_advisor_binade_criterion_and_skipped_rows():
    exact = A.Thresholds(delayed_log2=0)  # any sure clipping (clipped_min > 0)
    # 1.5 -> 1.9: amax above the history max, but its binade [1, 2) holds the threshold
    # 1.5: clipped_min is 0 (only clipped_max > 0), no finding
    stats, ops = advisor_frames({0: [1.5, 1.9, 1.9]})
    assert A.advise(stats, ops, thresholds=exact).empty
    # 1.9 -> 2.1: the binade [2, 4) is entirely above 1.9: elements clip for sure, but
    # by 10 %: flagged only without the default x1.41 margin
    stats, ops = advisor_frames({0: [1.9, 2.1, 2.1]})
    assert A.advise(stats, ops, thresholds=exact)["first_step"].tolist() == [10]
    assert A.advise(stats, ops).empty
    # 1.0 -> 1.5 (same binade), 1.5 -> 3.0 (x2, a binade above): flagged at step 20
    stats, ops = advisor_frames({0: [1.0, 1.5, 3.0]})
    assert A.advise(stats, ops)["first_step"].tolist() == [20]
    with pytest.raises(ValueError, match="Thresholds.delayed_log2"):
        A.Thresholds(delayed_log2=-1)
    # a step where the op did not run (count 0, NaN statistics) neither clips nor
    # poisons the history
    stats, ops = advisor_frames({0: [1.0, math.nan, 4.0]})
    stats.loc[1, "count"] = 0.0
    hit = A.advise(stats, ops)
    assert hit["first_step"].tolist() == [20]
    # with the run's histogram range: data beyond 2^24 all lands in ``above``
    stats, ops = advisor_frames({0: [2.0**25, 2.0**27]})
    meta = {"hist_columns": HIST_LABELS}
    assert A.advise(stats, ops, meta=meta).empty
    assert len(A.advise(stats, ops)) == 1


def test_advisor_iterations_take_the_largest_amax():
    stats, ops = advisor_frames({0: [1.0, 1.0, 1.0]})
    loop = stats.assign(iteration=1, absmax=[1.0, 1.0, 8.0])
    found = A.advise(pd.concat([stats, loop], ignore_index=True), ops)
    assert found["first_step"].tolist() == [20]


# -- recorded runs -------------------------------------------------------------------------


def _record(path, gain: float, steps: int, every: int):
    """A run of ``step``: the value x * s (and a scan of two iterations, x * s * w) with
    s multiplied by ``gain`` each training step."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import scalescope as ss

    x = jax.random.normal(jax.random.key(0), (64, 32))
    ws = jnp.asarray([1.0, 3.0])

    def step(s, x):
        with jax.named_scope("value"):
            y = x * s

        def body(c, w):
            z = x * (s * w)
            return c + jnp.sum(z), None

        total, _ = jax.lax.scan(body, jnp.zeros(()), ws)
        return s * gain, jnp.sum(y) + total

    s = jnp.asarray(1.5, jnp.float32)
    scales = []
    with ss.Run(path, every=every) as run:
        tracked = run.track(step, scalify=False)
        for i in range(steps):
            scales.append(float(s))
            s, loss = tracked(s, x)
            run.log(i, loss=loss)
    return ss.open_run(path), np.asarray(x), scales


def _op(reader, shape, loop):
    ops = reader.ops
    same = ops["shape"].map(lambda s: tuple(s) == shape) & ops["loop"].map(lambda v: v == loop)
    sel = ops[(ops["primitive"] == "mul") & same]
    assert len(sel) == 1, sel
    return int(sel.index[0])


def test_reader_replay_on_a_recorded_run(tmp_path):
    reader, x, scales = _record(tmp_path / "grow", gain=1.5, steps=9, every=2)
    assert list(reader.steps) == [0, 2, 4, 6, 8]
    op = _op(reader, (64, 32), ())
    got = reader.delayed_scaling(op, history=2)
    assert got.attrs["op"] == op and got.attrs["label"].startswith("fwd/")
    data = [x * np.float32(scales[t]) for t in reader.steps]
    amaxes = [float(np.abs(d).max()) for d in data]
    want = reference_replay(amaxes, 2, "max", 0, E4M3_MAX)
    for col in COLUMNS:
        np.testing.assert_allclose(got[col], want[col], rtol=1e-6, err_msg=col)
    assert (got["gap"].iloc[1:] == 2).all()  # the history sees every 2nd step
    for t, d in enumerate(data[1:], start=1):
        lo, hi, exact = numpy_bounds(d, want["threshold"][t])
        assert got["clipped_min"][t] == pytest.approx(lo, abs=1e-12)
        assert got["clipped_max"][t] == pytest.approx(hi, abs=1e-12)
        assert lo <= exact <= hi and exact > 0  # 1.5^2 per recorded step: clips
    assert reader.ops.loc[op, "name"] == "value/mul"
    pd.testing.assert_frame_equal(
        reader.delayed_scaling("fwd/value/mul"), reader.delayed_scaling(op)
    )

    # the scan: iteration 1 alone, or both iterations sharing one history
    scan_op = _op(reader, (64, 32), (2,))
    one = reader.delayed_scaling(scan_op, history=1, iteration=1)
    both = reader.delayed_scaling(scan_op, history=1)
    tripled = [x * (np.float32(scales[t]) * np.float32(3.0)) for t in reader.steps]
    three = [float(np.abs(d).max()) for d in tripled]
    np.testing.assert_allclose(one["amax"], three, rtol=1e-6)
    np.testing.assert_allclose(both["amax"], three, rtol=1e-6)
    t = 1
    thr = both["threshold"][t]
    lo0, hi0, _ = numpy_bounds(data[t], thr)
    lo1, hi1, _ = numpy_bounds(tripled[t], thr)
    assert both["clipped_min"][t] == pytest.approx((lo0 + lo1) / 2, abs=1e-12)
    assert both["clipped_max"][t] == pytest.approx((hi0 + hi1) / 2, abs=1e-12)
    with pytest.raises(KeyError, match="no row for iteration 5"):
        reader.delayed_scaling(scan_op, iteration=5)
    # a process that recorded nothing of it: an error naming whose rows there are, not an
    # empty replay that reads "never clips"
    with pytest.raises(KeyError, match="no row from process 3; its rows come from process 0"):
        reader.delayed_scaling(op, process=3)
    pd.testing.assert_frame_equal(
        reader.delayed_scaling(op, process=None), reader.delayed_scaling(op)
    )
    with pytest.raises(ValueError, match="algo"):
        reader.delayed_scaling(op, algo="mean")
    with pytest.raises(KeyError, match="no op"):
        reader.delayed_scaling("no/such/op")


def test_advisor_on_recorded_runs(tmp_path):
    grow, _, _ = _record(tmp_path / "grow", gain=2.0, steps=4, every=1)
    # nothing is cast: delayed scaling is a what-if, judged only when a format is audited
    assert not (grow.advise()["rule"] == "delayed").any()
    found = grow.advise(audit=("e4m3",))
    hit = found[found["rule"] == "delayed"]
    op = _op(grow, (64, 32), ())
    assert op in set(hit["op"])
    row = hit.set_index("op").loc[op]
    assert row["first_step"] == 1 and row["steps"] == 3
    assert "grows ×2 per recorded step" in row["evidence"]
    still, _, _ = _record(tmp_path / "still", gain=1.0, steps=4, every=1)
    assert not (still.advise(audit=("e4m3",))["rule"] == "delayed").any()
    # the report carries the finding (a rule without a per-format metric) and its count
    from scalescope.cli import main

    out = tmp_path / "audit.json"
    argv = ["report", str(tmp_path / "grow"), "--json", str(out), "--audit", "e4m3"]
    assert main([*argv, "--fail-on", "findings_delayed>0"]) == 1
    report = json.loads(out.read_text())
    rules = {r["rule"]: r["findings"] for r in report["summary"]["findings"]["by_rule"]}
    assert rules["delayed"] == len(hit)
    assert report["thresholds"]["delayed_history"] == 1024
