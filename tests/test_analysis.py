"""scalescope.analysis on synthetic frames (numbers chosen here, not computed by the code
under test), plus one tiny recorded run."""

from __future__ import annotations

import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd
import pytest

import scalescope as ss
from scalescope import analysis as A

FORMATS = ("e4m3", "e5m2", "fp16", "bf16")


# -- synthetic frames --------------------------------------------------------------------


def make_ops(*rows: dict) -> pd.DataFrame:
    """Op table; each row: name, pass (default fwd), primitive (default: last name
    component), shape, dtype, scaled, source, cast_to, cast_at. Ids are 0, 1, 2..."""
    recs = []
    for i, row in enumerate(rows):
        name = row["name"]
        recs.append(
            {
                "op": i,
                "name": name,
                "pass": row.get("pass", "fwd"),
                "primitive": row.get("primitive", name.split("/")[-1]),
                "shape": tuple(row.get("shape", (4, 4))),
                # scaled values default to E4M3 data (scalified FP8: the drift bound
                # is +-4 there, `A.drift_bounds`)
                "dtype": row.get("dtype", "float8_e4m3fn" if row.get("scaled") else "float32"),
                "scaled": row.get("scaled", False),
                "source": row.get("source", f"model.py:{10 + i}"),
                "note": row.get("note", ""),
                "stats_op": i,
                "loop": (),
                "in_while": False,
                "in_cond": False,
                "cast_to": row.get("cast_to", ""),
                "cast_at": row.get("cast_at", ""),
            }
        )
    return pd.DataFrame(recs).set_index("op")


def default_metrics() -> dict[str, float]:
    out = {
        "count": 16.0,
        "scale": 1.0,
        "rms": 1.0,
        "absmax": 2.0,
        "mean": 0.0,
        "std": 1.0,
        "frac_zero": 0.0,
        "frac_nonfinite": 0.0,
    }
    for f in FORMATS:
        out |= {f"underflow_{f}": 0.0, f"subnormal_{f}": 0.0, f"overflow_{f}": 0.0}
        out[f"snr_{f}"] = math.inf
    return out


def make_stats(rows: list[dict]) -> pd.DataFrame:
    """Wide stats frame; each row: op, step, iteration (default 0) and metric overrides."""
    recs = []
    for row in rows:
        rec = {"step": row["step"], "op": row["op"], "iteration": row.get("iteration", 0)}
        rec |= default_metrics()
        rec |= {k: v for k, v in row.items() if k not in ("step", "op", "iteration")}
        recs.append(rec)
    return pd.DataFrame(recs)


def series(op: int, steps, **columns) -> list[dict]:
    """Rows of one op over ``steps``; a column given as a list varies per step."""
    rows = []
    for i, step in enumerate(steps):
        row = {"op": op, "step": step}
        for key, value in columns.items():
            row[key] = value[i] if isinstance(value, list | tuple) else value
        rows.append(row)
    return rows


def findings_of(findings: pd.DataFrame, rule: str, op: int | None = None) -> pd.DataFrame:
    sel = findings[findings["rule"] == rule]
    return sel if op is None else sel[sel["op"] == op]


STEPS = [0, 100, 200, 300, 400]


# -- advisor rules -----------------------------------------------------------------------


def test_nonfinite_first_step_and_origin():
    ops = make_ops({"name": "a/mul"}, {"name": "a/add"}, {"name": "a/tanh"})
    stats = make_stats(
        series(0, STEPS, frac_nonfinite=[0, 0, 0.25, 0, 1.0])
        + series(1, STEPS, frac_nonfinite=[0, 0, 0, 0.5, 0.5])
        + series(2, STEPS)
    )
    found = A.advise(stats, ops)
    nf = findings_of(found, "nonfinite").set_index("op")
    assert sorted(nf.index) == [0, 1]
    assert nf.loc[0, "first_step"] == 200 and nf.loc[0, "steps"] == 2
    assert nf.loc[0, "value"] == 1.0 and nf.loc[0, "severity"] == "critical"
    assert nf.loc[1, "first_step"] == 300
    assert nf.loc[0, "format"] == ""
    assert "earliest op with non-finite values." in nf.loc[0, "evidence"]
    assert "fwd/a/mul [4x4] (step 200)" in nf.loc[1, "evidence"]


def test_nonfinite_threshold_is_configurable():
    ops = make_ops({"name": "mul"})
    stats = make_stats(series(0, STEPS, frac_nonfinite=[0.02, 0.02, 0.025, 0.02, 0.02]))
    assert len(A.advise(stats, ops, thresholds=A.Thresholds(nonfinite=0.03))) == 0
    assert len(A.advise(stats, ops, thresholds=A.Thresholds(nonfinite=0.01))) == 1


def test_nonfinite_skips_masks_but_not_values_that_went_bad():
    """A causal mask holds the same fraction of -inf at every step: not a finding. The
    same steady fraction over too few steps, a changing one, or all-NaN is."""
    ops = make_ops({"name": "mask"}, {"name": "bad"}, {"name": "dead"})
    stats = make_stats(
        series(0, STEPS, frac_nonfinite=0.4921875)
        + series(1, STEPS, frac_nonfinite=[0, 0, 0.1, 0.1, 0.3])
        + series(2, STEPS, frac_nonfinite=1.0)
    )
    found = findings_of(A.advise(stats, ops), "nonfinite")
    assert sorted(found["op"]) == [1, 2]
    strict = A.Thresholds(mask_min_steps=6)  # 5 recorded steps: too few to call it a mask
    assert sorted(findings_of(A.advise(stats, ops, thresholds=strict), "nonfinite")["op"]) == [
        0,
        1,
        2,
    ]
    with pytest.raises(ValueError, match="mask_min_steps"):
        A.Thresholds(mask_min_steps=1)


def test_overflow_any_fires_only_on_checked_formats():
    ops = make_ops(
        {"name": "cast_tiny", "cast_to": "e4m3"},
        {"name": "cast_clean", "cast_to": "e4m3"},
        {"name": "not_cast"},
    )
    stats = make_stats(
        series(0, STEPS, overflow_e4m3=[0, 0, 1e-6, 0, 0])
        + series(1, STEPS)
        + series(2, STEPS, overflow_e4m3=0.5)
    )
    found = A.advise(stats, ops)
    over = findings_of(found, "overflow")
    assert over["op"].tolist() == [0]
    row = over.iloc[0]
    assert row["format"] == "e4m3" and row["first_step"] == 200 and row["steps"] == 1
    assert row["value"] == pytest.approx(1e-6) and row["severity"] == "high"
    assert "0.0001%" in row["evidence"] and "448" in row["evidence"]
    # the same op audited explicitly: op 2 now fires, only for e4m3
    audited = findings_of(A.advise(stats, ops, audit=("e4m3",)), "overflow")
    assert sorted(audited["op"]) == [0, 2]
    assert set(audited["format"]) == {"e4m3"}
    assert findings_of(A.advise(stats, ops, audit="e5m2"), "overflow")["op"].tolist() == [0]


def test_underflow_threshold():
    ops = make_ops({"name": "above", "cast_to": "e5m2"}, {"name": "below", "cast_to": "e5m2"})
    stats = make_stats(
        series(0, STEPS, underflow_e5m2=[0.0101, 0.02, 0, 0, 0])
        + series(1, STEPS, underflow_e5m2=0.0099)
    )
    under = findings_of(A.advise(stats, ops), "underflow")
    assert under["op"].tolist() == [0]
    row = under.iloc[0]
    assert row["format"] == "e5m2" and row["steps"] == 2 and row["first_step"] == 0
    assert row["value"] == pytest.approx(0.02) and row["threshold"] == 0.01
    assert row["severity"] == "low" and "2.0%" in row["evidence"]  # medium from 5 %


@pytest.mark.parametrize("scaled", [False, True])
def test_underflow_of_a_value_wider_than_the_format_calls_for_block_scaling(scaled):
    """e4m3 spans log2(448 / 2^-9) = 17.81 octaves from its max to its smallest
    subnormal. A value whose dynamic range (log2 absmax - log2 absmin) is wider loses
    elements at any one scale: the finding says so and the fix is a block-scaled recipe
    or a format with more range, never a rescale; 17.5 octaves is not wider."""
    span = math.log2(448) + 9
    ops = make_ops(
        {"name": "wide", "cast_to": "e4m3", "scaled": scaled},
        {"name": "narrow", "cast_to": "e4m3", "scaled": scaled},
    )
    stats = make_stats(
        series(
            0,
            STEPS,
            underflow_e4m3=[0.05, 0.08, 0.05, 0.05, 0.05],  # worst at step 100
            dynamic_range=[20.0, 24.0, 20.0, 20.0, 20.0],
        )
        + series(1, STEPS, underflow_e4m3=0.05, dynamic_range=17.5, rms=2.0**-6)
    )
    under = findings_of(A.advise(stats, ops), "underflow").set_index("op")
    wide, narrow = under.loc[0], under.loc[1]
    assert f"{24.0:.1f} octaves" in wide["evidence"] and f"{span:.1f}" in wide["evidence"]
    assert "mxfp8_e4m3 recipe" in wide["fix"] and "e5m2" in wide["fix"]
    assert "dynamic_rescale" not in wide["fix"]
    assert "octaves" not in narrow["evidence"] and "mxfp8_e4m3 recipe" not in narrow["fix"]
    if scaled:  # an ordinary underflow of a value off unit scale: rescale it
        assert "dynamic_rescale_l2" in narrow["fix"]


def test_snr_threshold_default_and_custom():
    thr = A.Thresholds().snr_db["e4m3"]
    ops = make_ops(
        {"name": "low", "cast_to": "e4m3"},
        {"name": "ok", "cast_to": "e4m3"},
        {"name": "nan", "cast_to": "e4m3"},
    )
    stats = make_stats(
        series(0, STEPS, snr_e4m3=thr - 0.1)
        + series(1, STEPS, snr_e4m3=thr + 0.1)
        + series(2, STEPS, snr_e4m3=math.nan)
    )
    snr = findings_of(A.advise(stats, ops), "snr")
    assert snr["op"].tolist() == [0]
    assert snr.iloc[0]["value"] == pytest.approx(thr - 0.1)
    assert snr.iloc[0]["steps"] == 5
    loose = A.Thresholds(snr_db={"e4m3": thr - 1})
    assert findings_of(A.advise(stats, ops, thresholds=loose), "snr").empty
    assert loose.snr_db["fp16"] == A.DEFAULT_SNR_DB["fp16"]  # partial override


def test_default_snr_thresholds_are_gaussian_snr_minus_6db():
    # SNR of N(0,1) data: 6.02 * mantissa bits + 13.5 dB (measured: 31.5, 25.5, 73.7, 55.6)
    expected = {"e4m3": 31.5, "e5m2": 25.5, "fp16": 73.7, "bf16": 55.6}
    for fmt, snr in expected.items():
        assert A.Thresholds().snr_db[fmt] == pytest.approx(snr - 6, abs=0.25)
    assert A.snr_from_mantissa(3) == pytest.approx(25.6, abs=0.1)


E4M3 = "float8_e4m3fn"


def test_drift_only_on_scaled_or_cast_ops():
    ops = make_ops(
        {"name": "scaled_up", "scaled": True, "dtype": E4M3},
        {"name": "scaled_in", "scaled": True, "dtype": E4M3},
        {"name": "plain_big"},
        {"name": "cast_small", "cast_to": "e4m3"},
        {"name": "scaled_zero", "scaled": True, "dtype": E4M3},
        {"name": "scaled_f32", "scaled": True, "dtype": "float32"},
        {"name": "fp16_low", "scaled": True, "dtype": "float16"},
        {"name": "fp16_gone", "scaled": True, "dtype": "float16"},
        {"name": "cast_fp16", "cast_to": "fp16"},
    )
    stats = make_stats(
        series(0, STEPS, rms=[1.0, 1.0, 2**4.1, 2**4.5, 1.0])
        + series(1, STEPS, rms=2**3.9)
        + series(2, STEPS, rms=2.0**10)
        + series(3, STEPS, rms=2.0**-5)
        + series(4, STEPS, rms=0.0)
        + series(5, STEPS, rms=2.0**9)  # FP32 data: drift costs nothing, not flagged
        + series(6, STEPS, rms=2.0**-7)  # FP16 keeps 17 binades down to its subnormals
        + series(7, STEPS, rms=2.0**-21)  # 3 binades from them: flagged
        + series(8, STEPS, rms=2.0**12)  # a cast to FP16 4 binades under its max
    )
    drift = findings_of(A.advise(stats, ops), "drift").set_index("op")
    assert sorted(drift.index) == [0, 3, 7, 8]
    assert drift.loc[0, "first_step"] == 200 and drift.loc[0, "steps"] == 2
    assert drift.loc[0, "value"] == pytest.approx(4.5) and drift.loc[0, "threshold"] == 4.0
    assert drift.loc[3, "value"] == pytest.approx(-5.0) and drift.loc[3, "steps"] == 5
    assert "-5.0" in drift.loc[3, "evidence"] and "step 0" in drift.loc[3, "evidence"]
    # the same margins from FP16's own edges: 2^-24 (subnormal) and 65504
    assert drift.loc[7, "threshold"] == pytest.approx(-19.0)
    assert drift.loc[8, "threshold"] == pytest.approx(np.log2(65504) - np.log2(448) + 4)
    assert A.drift_bounds("e4m3") == (-4.0, pytest.approx(4.0))
    assert A.drift_bounds("e5m2") == (-11.0, pytest.approx(11.0, abs=0.2))
    assert A.drift_bounds("bf16")[0] < -100 and A.drift_bounds("unknown") == (-np.inf, np.inf)


def test_a_drift_is_no_worse_than_its_casts_format_finding():
    """A value cast to E4M3 5 binades under the drift bound is a high drift; where E4M3
    measures what the cast loses (20 % flushed: a medium underflow), that finding stands
    for it: the drift is medium too, so the gate's high findings and the verdict's
    causes (healthy) agree. A drift with no format finding on its op stays high."""
    ops = make_ops(
        {"name": "judged", "cast_to": "e4m3"},
        {"name": "alone", "cast_to": "e4m3"},
    )
    stats = make_stats(
        series(0, STEPS, rms=2.0**-9, underflow_e4m3=0.2) + series(1, STEPS, rms=2.0**-9)
    )
    found = A.advise(stats, ops)
    drift = findings_of(found, "drift").set_index("op")["severity"]
    assert drift.to_dict() == {0: "medium", 1: "high"}
    assert findings_of(found, "underflow", 0)["severity"].tolist() == ["medium"]
    causes = A.causes(found)
    assert causes.loc[causes["rule"] == "underflow", "severity"].tolist() == ["medium"]
    judged_only = found[found["op"] == 0]
    assert "high" not in set(judged_only["severity"])
    assert A.verdict(judged_only).status == "healthy"


def test_trend_fires_for_steady_drift_not_for_flat():
    ops = make_ops(
        {"name": "rising", "scaled": True},
        {"name": "flat", "scaled": True},
        {"name": "short", "scaled": True},
        {"name": "rising_plain"},
    )
    # log2 rms 0, 0.5, ..., 2 over steps 0..400: slope 1/200 per step, +5 at step 1000,
    # crossing +4 at step 800
    rising = [2.0 ** (s / 200) for s in STEPS]
    stats = make_stats(
        series(0, STEPS, rms=rising)
        + series(1, STEPS, rms=2.0)
        + series(2, STEPS[:3], rms=rising[:3])
        + series(3, STEPS, rms=rising)
    )
    found = A.advise(stats, ops, meta={"config": {"steps": 1000}})
    trend = findings_of(found, "trend")
    assert trend["op"].tolist() == [0]
    row = trend.iloc[0]
    assert row["value"] == pytest.approx(5.0) and row["threshold"] == 4.0
    assert row["severity"] == "low" and row["steps"] == 5 and row["first_step"] == 0
    assert "step ~800" in row["evidence"] and "step 1000" in row["evidence"]
    assert findings_of(found, "drift").empty
    # a nearer horizon (projected +3) does not cross
    assert findings_of(A.advise(stats, ops, horizon=600), "trend").empty
    # log2 rms 0 .. +2.5 over steps 0..400: +5 at step 800 (the default horizon without
    # meta: twice the last step), +3.125 at step 500
    faster = make_stats(series(0, STEPS, rms=[2.0 ** (s / 160) for s in STEPS]))
    ops1 = ops.iloc[:1]
    assert findings_of(A.advise(faster, ops1), "trend")["value"].tolist() == [pytest.approx(5.0)]
    assert findings_of(A.advise(faster, ops1, meta={"config": {"steps": 500}}), "trend").empty


def test_trend_skips_ops_already_out_of_bound():
    ops = make_ops({"name": "out", "scaled": True})
    stats = make_stats(series(0, STEPS, rms=[2.0 ** (s / 80) for s in STEPS]))  # 0 .. +5
    found = A.advise(stats, ops, horizon=1000)
    assert findings_of(found, "trend").empty
    assert len(findings_of(found, "drift")) == 1


def test_loop_iterations_take_the_worst():
    ops = make_ops({"name": "body", "cast_to": "e4m3", "scaled": True})
    rows = []
    for it, (ov, rms) in enumerate([(0.0, 1.0), (0.25, 2.0**-6), (0.0, 1.0)]):
        rows += [dict(r, iteration=it) for r in series(0, [0, 10], overflow_e4m3=ov, rms=rms)]
    found = A.advise(make_stats(rows), ops)
    assert findings_of(found, "overflow").iloc[0]["value"] == 0.25
    assert findings_of(found, "drift").iloc[0]["value"] == pytest.approx(-6.0)
    assert findings_of(found, "overflow").iloc[0]["steps"] == 2


def test_severity_ordering_and_columns():
    ops = make_ops(
        {"name": "trendy", "scaled": True},
        {"name": "snr", "cast_to": "e4m3"},
        {"name": "under", "cast_to": "e4m3"},
        {"name": "over", "cast_to": "e4m3"},
        {"name": "nan"},
        {"name": "late_over", "cast_to": "e4m3"},
    )
    # magnitudes that keep each rule in one severity: overflow high (0.5 %: critical
    # from 1 %), underflow and snr medium (5 %, 6 dB under the threshold), trend low
    thr = A.Thresholds().snr_db["e4m3"]
    stats = make_stats(
        series(0, STEPS, rms=[2.0 ** (s / 200) for s in STEPS])
        + series(1, STEPS, snr_e4m3=[40, 40, thr - 6, thr - 6, thr - 6])
        + series(2, STEPS, underflow_e4m3=[0, 0.05, 0.05, 0.05, 0.05])
        + series(3, STEPS, overflow_e4m3=[0, 0, 0, 0.005, 0.005])
        + series(4, STEPS, frac_nonfinite=[0, 0, 0, 0, 1.0])
        + series(5, STEPS, overflow_e4m3=[0, 0.005, 0, 0, 0])
    )
    found = A.advise(stats, ops, horizon=1000)
    assert list(found.columns) == A.FINDING_COLUMNS
    assert found["rule"].tolist() == ["nonfinite", "overflow", "overflow", "underflow", "snr"] + [
        "trend"
    ]
    assert found["op"].tolist() == [4, 5, 3, 2, 1, 0]
    rank = found["severity"].map({s: i for i, s in enumerate(A.SEVERITY_ORDER)})
    assert rank.is_monotonic_increasing
    summary = A.summary_by_rule(found)
    assert summary["rule"].tolist() == ["nonfinite", "overflow", "underflow", "snr", "trend"]
    assert summary.set_index("rule").loc["overflow", "findings"] == 2
    assert summary.set_index("rule").loc["snr", "worst"] == pytest.approx(thr - 6)
    assert summary["severity"].tolist() == ["critical", "high", "medium", "medium", "low"]


def test_fix_text_by_pass_and_scalify():
    ops = make_ops(
        {"name": "f", "pass": "fwd", "cast_to": "e4m3", "source": "model.py:7"},
        {"name": "b", "pass": "bwd", "cast_to": "e5m2", "source": "model.py:9"},
        {"name": "o", "pass": "opt", "cast_to": "fp16", "source": "train.py:3"},
    )
    stats = make_stats(
        series(0, [0], overflow_e4m3=0.1)
        + series(1, [0], overflow_e5m2=0.1)
        + series(2, [0], overflow_fp16=0.1)
    )
    # an overflow under scalify: rescale by the abs-max (the l2 rescale keeps outliers)
    scaled = A.advise(stats, ops, meta={"graph": {"scalify": True}}).set_index("op")["fix"]
    assert scaled[0] == "x = ss.ops.dynamic_rescale_max(x)  # after model.py:7"
    assert scaled[1] == "x = ss.ops.dynamic_rescale_max_grad(x)  # before model.py:9"
    assert scaled[2] == "x = ss.ops.dynamic_rescale_max(x)  # after train.py:3"
    naive = A.advise(stats, ops, meta={"graph": {"scalify": False}}).set_index("op")["fix"]
    assert naive[0] == (
        "run.track(step, scalify=True)  # scale-propagated casts instead of naive e4m3 casts"
        " at model.py:7; or a block-scaled recipe such as e4m3_tensor"
        ' (record formats=("e4m3_tensor",) to check it)'
    )
    assert "naive e5m2 casts at model.py:9" in naive[1]
    assert all("\n" not in fix for fix in list(scaled) + list(naive))
    # without meta, an op's own `scaled` flag decides
    ops_scaled = ops.assign(scaled=True)
    assert "dynamic_rescale_max_grad" in A.advise(stats, ops_scaled).set_index("op")["fix"][1]


def _made_then_cast(x):
    h = jax.nn.relu(x * 300.0)
    c = h.astype(jnp.float8_e4m3fn)  # the cast, a line of its own
    return c.astype(jnp.float32).sum()


def test_a_naive_cast_fix_names_the_casts_line_not_only_the_values():
    """The overflow of a value cast to FP8 on another line than the one that made it
    (``h = relu(...)``, then ``h.astype(e4m3)``): the fix names the cast's line, where
    the user changes it, and the value's. Before, only the value's line (an Equinox
    model's relu line for the cast a line above)."""
    first = inspect.getsourcelines(_made_then_cast)[1]
    made, cast = f"{__file__}:{first + 1}", f"{__file__}:{first + 2}"
    table = ss.instrument(_made_then_cast, scalify=False).op_table(jnp.ones((4, 8)))
    (value,) = [r for r in table if r.cast_to == "e4m3"]
    assert (value.primitive, value.source, value.cast_at) == ("max", made, cast)
    ops = make_ops(
        {"name": "max", "pass": "fwd", "cast_to": "e4m3", "source": made, "cast_at": cast},
        {"name": "same", "pass": "fwd", "cast_to": "e4m3", "source": cast, "cast_at": cast},
    )
    stats = make_stats(series(0, [0], overflow_e4m3=0.1) + series(1, [0], overflow_e4m3=0.1))
    fix = A.advise(stats, ops, meta={"graph": {"scalify": False}}).set_index("op")["fix"]
    assert f"naive e4m3 casts at {cast} (of fwd/max" in fix[0] and f"at {made})" in fix[0]
    assert f"naive e4m3 casts at {cast};" in fix[1]  # made and cast on one line: said once


def test_severity_is_graded_by_magnitude():
    """The same rule is low, medium or high by how far past its threshold the op goes:
    99 % of a backward value flushed to zero in E5M2 is high, 10 % medium, just over
    the 1 % threshold low (SEVERITY_STEPS)."""
    thr = A.Thresholds().snr_db["e4m3"]
    ops = make_ops(
        {"name": "grad_flushed", "pass": "bwd", "cast_to": "e5m2"},
        {"name": "some_flushed", "pass": "bwd", "cast_to": "e5m2"},
        {"name": "few_flushed", "pass": "bwd", "cast_to": "e5m2"},
        {"name": "over_much", "cast_to": "e4m3"},
        {"name": "over_one", "cast_to": "e4m3"},
        {"name": "snr_bit", "cast_to": "e4m3"},
        {"name": "snr_bits", "cast_to": "e4m3"},
        {"name": "snr_noise", "cast_to": "e4m3"},
        {"name": "drift_near", "scaled": True},
        {"name": "drift_far", "scaled": True},
        {"name": "drift_gone", "scaled": True},
        {"name": "nan"},
    )
    stats = make_stats(
        series(0, STEPS, underflow_e5m2=0.99)
        + series(1, STEPS, underflow_e5m2=0.1)
        + series(2, STEPS, underflow_e5m2=0.015)
        + series(3, STEPS, overflow_e4m3=0.02)
        + series(4, STEPS, overflow_e4m3=1e-6)
        + series(5, STEPS, snr_e4m3=thr - 1)
        + series(6, STEPS, snr_e4m3=thr - 6)
        + series(7, STEPS, snr_e4m3=thr - 20)
        + series(8, STEPS, rms=2.0**4.5)
        + series(9, STEPS, rms=2.0**-6)
        + series(10, STEPS, rms=2.0**9)
        + series(11, STEPS, frac_nonfinite=[0, 0, 0, 0, 1e-6])
    )
    found = A.advise(stats, ops, meta={"graph": {"scalify": True}})
    severity = {(int(r.op), r.rule): r.severity for r in found.itertuples()}
    expected = {
        (0, "underflow"): "high",
        (1, "underflow"): "medium",
        (2, "underflow"): "low",
        (3, "overflow"): "critical",  # 2 % of the values turn inf/NaN in a plain cast
        (4, "overflow"): "high",  # a single element in a million: still inf/NaN
        (5, "snr"): "low",
        (6, "snr"): "medium",
        (7, "snr"): "high",
        (8, "drift"): "low",
        (9, "drift"): "medium",
        (10, "drift"): "high",
        (11, "nonfinite"): "critical",  # a single NaN in a million is critical
    }
    for key, want in expected.items():
        assert severity.get(key) == want, (key, severity.get(key), want)
    # the level orders findings by severity, then magnitude within it
    level = pd.Series(A.severity_level(found), index=list(zip(found["op"], found["rule"])))
    assert level[(11, "nonfinite")] > level[(0, "underflow")] > level[(4, "overflow")]
    assert level[(1, "underflow")] < level[(6, "snr")] or level[(6, "snr")] < 2
    assert 2 <= level[(7, "snr")] < 3 and 1 <= level[(9, "drift")] < 2
    assert A.severity_of(A.severity_level(found)).tolist() == found["severity"].tolist()
    # a recipe clips by design: graded from low (just over recipe_overflow) upwards
    frame = pd.DataFrame(
        {
            "rule": ["overflow", "overflow", "overflow", "delayed", "delayed", "trend"],
            "format": ["nvfp4", "nvfp4", "nvfp4", "", "", ""],
            "value": [2e-4, 5e-3, 0.05, 1.0, 5.0, 9.0],
            "threshold": [1e-4, 1e-4, 1e-4, 0.0, 0.0, 4.0],
        }
    )
    assert A.severity_of(A.severity_level(frame)).tolist() == [
        "low",
        "medium",
        "high",
        "low",
        "high",
        "medium",  # a trend 5 binades past the bound at the horizon: never high
    ]
    # delayed scaling clipping 5 binades at a single recorded step (a warm-up
    # transient): medium; at two steps or more: high
    frame = frame.assign(steps=[3, 3, 3, 3, 1, 3])
    assert A.severity_of(A.severity_level(frame)).tolist()[3:5] == ["low", "medium"]


def test_loss_scaling_is_offered_only_as_far_as_the_largest_gradient_allows():
    """One loss scale lifts every gradient: the power offered for a gradient 13 binades
    low stops where the largest gradient held in the same format would reach its max
    (E5M2: 57344 = 2**15.8); none is offered when that gradient already fills it. A
    forward value, however large, does not count."""
    ops = make_ops(
        {"name": "g", "pass": "bwd", "cast_to": "e5m2", "source": "model.py:9"},
        {"name": "big", "pass": "bwd", "cast_to": "e5m2"},
        {"name": "h", "cast_to": "e5m2"},
    )

    def fix_with(big_absmax, writers_order=False):
        stats = make_stats(
            series(0, STEPS, rms=2.0**-13, absmax=2.0**-10, underflow_e5m2=0.3)
            + series(1, STEPS, rms=1.0, absmax=big_absmax)
            + series(2, STEPS, rms=1.0, absmax=2.0**15.5)  # forward: no say
        )
        if writers_order:  # step by step: the advisor's dense path
            stats = stats.sort_values(["step", "op"], ignore_index=True)
        found = A.advise(stats, ops, meta={"graph": {"scalify": False}})
        return found[(found["op"] == 0) & (found["rule"] == "underflow")].iloc[0]["fix"]

    assert "; or loss scaling by 2**13 (" in fix_with(2.0)  # 2**14.8 of room
    capped = fix_with(2.0**10)  # 2**5.8 of room
    assert (
        "; or loss scaling by 2**5 (the loss times 2**5, the gradients divided by it: this "
        "gradient's RMS is 2**-13; a larger scale would overflow the largest gradient in e5m2)"
    ) in capped, capped
    assert fix_with(2.0**10, writers_order=True) == capped
    assert "loss scaling" not in fix_with(2.0**15.5)  # no room left
    assert fix_with(2.0**15.5).startswith("run.track(step, scalify=True)")


def test_fix_texts_name_the_line_and_the_function():
    """Each rule's fix: drift -> dynamic_rescale_l2 (_grad backward) at the op's line,
    overflow in a scaled run -> dynamic_rescale_max, a naive cast's underflow -> scalify,
    loss scaling (a gradient off unit scale) or a recipe (the one the recorded recipe
    statistics show safe), an underflow at unit scale -> more range, a NaN -> the earliest
    op."""
    ops = make_ops(
        {"name": "h", "scaled": True, "cast_to": "e4m3", "source": "model.py:7"},
        {"name": "g", "pass": "bwd", "scaled": True, "cast_to": "e5m2", "source": "model.py:9"},
        {"name": "x", "scaled": True, "cast_to": "e4m3", "source": "model.py:11"},
        {"name": "y", "scaled": True, "cast_to": "e4m3", "source": "model.py:12"},
        {"name": "n1", "source": "model.py:20"},
        {"name": "n2", "source": "model.py:21"},
    )
    stats = make_stats(
        series(0, STEPS, rms=2.0**6)  # drift up (forward)
        + series(1, STEPS, rms=2.0**-13, underflow_e5m2=0.3)  # backward: drift and underflow
        + series(2, STEPS, overflow_e4m3=0.01)  # outliers at unit scale
        + series(3, STEPS, underflow_e4m3=0.05)  # unit scale, yet 5 % flush: more range
        + series(4, STEPS, frac_nonfinite=[0, 0, 0.5, 1, 1])
        + series(5, STEPS, frac_nonfinite=[0, 0, 0, 1, 1])
    )
    found = A.advise(stats, ops, meta={"graph": {"scalify": True}})
    fix = {(int(r.op), r.rule): r.fix for r in found.itertuples()}
    assert fix[(0, "drift")] == "x = ss.ops.dynamic_rescale_l2(x)  # after model.py:7"
    assert fix[(1, "drift")] == "x = ss.ops.dynamic_rescale_l2_grad(x)  # before model.py:9"
    # off unit scale where it underflows: rescaling is the fix
    assert fix[(1, "underflow")] == "x = ss.ops.dynamic_rescale_l2_grad(x)  # before model.py:9"
    assert fix[(2, "overflow")] == "x = ss.ops.dynamic_rescale_max(x)  # after model.py:11"
    assert fix[(3, "underflow")].startswith("cast model.py:12 to e5m2, or use the mxfp8_e4m3")
    assert fix[(4, "nonfinite")] == (
        'jax.config.update("jax_debug_nans", True)  # stops at the first NaN: model.py:20'
    )
    assert fix[(5, "nonfinite")] == (
        "fix the earliest op with NaN/inf first: fwd/n1 [4x4] at model.py:20"
    )

    # the same run with naive casts: scalify, or a recipe (suggested: none recorded)
    naive_ops = ops.assign(scaled=False)
    naive = A.advise(stats, naive_ops, meta={"graph": {"scalify": False}})
    row = naive[(naive["op"] == 1) & (naive["rule"] == "underflow")].iloc[0]
    # a gradient 13 binades below unit scale: loss scaling by 2**13 lifts it
    assert row["fix"].startswith(
        "run.track(step, scalify=True)  # scale-propagated casts instead of naive e5m2 casts "
        "at model.py:9; or loss scaling by 2**13 (the loss times 2**13, the gradients divided "
        "by it: this gradient's RMS is 2**-13); or a block-scaled recipe such as mxfp8_e4m3"
    )
    # a forward value's underflow is no loss-scaling matter
    fwd = naive[(naive["op"] == 3) & (naive["rule"] == "underflow")].iloc[0]
    assert "loss scaling" not in fwd["fix"] and "naive e4m3 casts at model.py:12" in fwd["fix"]
    assert row["severity"] == "medium"  # 30 % flushed (high from 75 %)
    # recipe statistics recorded: the fix names the cheapest recipe safe for that op
    recipe_cols = {
        "overflow_mxfp8_e4m3": 0.0,
        "underflow_mxfp8_e4m3": 0.0,
        "snr_mxfp8_e4m3": 40.0,
        "block_flush_mxfp8_e4m3": 0.0,
        "overflow_nvfp4": 0.0,
        "underflow_nvfp4": 0.2,
        "snr_nvfp4": 12.0,  # under the recipes' 13.5 dB: not safe
        "block_flush_nvfp4": 0.1,
    }
    with_recipes = stats.assign(**recipe_cols)
    naive = A.advise(with_recipes, naive_ops, meta={"graph": {"scalify": False}})
    row = naive[(naive["op"] == 1) & (naive["rule"] == "underflow")].iloc[0]
    assert row["fix"].endswith(
        "the gradients divided by it: this gradient's RMS is 2**-13); or the mxfp8_e4m3 recipe "
        "(safe for this op in the recorded statistics)"
    )
    # no recorded recipe is safe: only scalify is offered, and it says so
    unsafe = with_recipes.assign(underflow_mxfp8_e4m3=0.8)
    naive = A.advise(unsafe, naive_ops, meta={"graph": {"scalify": False}})
    row = naive[(naive["op"] == 1) & (naive["rule"] == "underflow")].iloc[0]
    assert row["fix"].startswith(
        "run.track(step, scalify=True)  # scale-propagated casts instead of naive e5m2 casts "
        "at model.py:9 (no recorded recipe (mxfp8_e4m3, nvfp4) is safe for it); or loss scaling"
    )
    assert all("\n" not in f for f in naive["fix"])


def test_worst_finding_metric_picks_the_most_severe_then_largest():
    findings = pd.DataFrame(
        {
            "rule": ["drift", "underflow", "overflow", "snr"],
            "format": ["", "e5m2", "e4m3", "e4m3"],
            "value": [5.0, 0.99, 1e-6, 20.0],
            "threshold": [4.0, 0.01, 0.0, 25.5],
        }
    )
    # underflow 99 % (high, near its top) beats an overflow of 1e-6 (high, at its bottom)
    # and a drift 1 binade out (medium)
    assert A.worst_finding(findings) == 1
    assert A.worst_finding_metric(findings) == "underflow_e5m2"
    # a higher severity wins (2 % overflowing: critical); within one, the larger magnitude
    assert A.worst_finding_metric(findings.assign(value=[5.0, 0.99, 0.02, 20.0])) == (
        "overflow_e4m3"
    )
    # both high: 0.5 % overflowing is near critical (1 %), 77 % flushed just past 75 %
    two = findings.assign(value=[5.0, 0.77, 0.005, 20.0])
    assert A.worst_finding_metric(two) == "overflow_e4m3"
    assert A.worst_finding_metric(two.assign(value=[5.0, 0.97, 1e-5, 20.0])) == "underflow_e5m2"
    assert A.worst_finding_metric(findings.assign(value=[5.0, 0.03, 0.005, 20.0])) == (
        "overflow_e4m3"  # high (0.5 % overflow) over medium (3 % underflow)
    )
    # a metric the view does not offer is skipped; no finding: the default
    # (SNR 5.5 dB under its threshold is further into medium than a drift 1 binade out)
    assert A.worst_finding_metric(findings, options=["log2_rms", "snr_e4m3"]) == "snr_e4m3"
    assert A.worst_finding_metric(findings, options=["frac_zero", "log2_rms"]) == "log2_rms"
    assert A.worst_finding_metric(findings.iloc[:0]) == "log2_rms"
    assert A.worst_finding_metric(None, options=["frac_zero"]) == "frac_zero"
    nan = pd.DataFrame({"rule": ["nonfinite"], "format": [""], "value": [1e-9], "threshold": [0.0]})
    assert A.worst_finding_metric(pd.concat([findings, nan])) == "frac_nonfinite"
    assert A.finding_metric("delayed") == "absmax"


def test_advise_reads_a_writer_order_run_as_a_sorted_one():
    """A run in the writer's order (every op at every step, step by step) is read as
    steps x ops views; the same rows in any other order are sorted and reduced: both
    give the same findings, for every rule (NaN, a mask, ops that did not run, drift,
    trends, delayed-scaling growth, format statistics across their thresholds)."""
    rng = np.random.default_rng(7)
    n_ops, steps = 30, [10 * k for k in range(25)]
    specs = []
    for i in range(n_ops):
        specs.append(
            {
                "name": f"layer{i % 3}/op{i}",
                "pass": ("fwd", "bwd", "opt")[i % 3],
                "cast_to": ("e4m3", "e5m2", "", "fp16")[i % 4],
                "scaled": i % 2 == 0,
            }
        )
    ops = make_ops(*specs)
    rows = []
    walk = np.cumsum(rng.normal(0, 0.4, (len(steps), n_ops)), axis=0)
    walk[:, 5] = np.linspace(0, 3.9, len(steps))  # a trend that stays in bound
    walk[:, 6] = np.linspace(0, 7, len(steps))  # drifts out
    for k, step in enumerate(steps):
        for op in range(n_ops):
            amax = 2.0 ** (walk[k, op] + 2)
            if op == 7:
                amax = 2.0 ** (k / 2)  # outgrows delayed scaling
            row = {
                "op": op,
                "step": step,
                "rms": 2.0 ** walk[k, op] if op != 8 else 0.0,
                "absmax": amax,
                "scale": 2.0 ** (op % 3),
                "count": 0.0 if (op == 9 and k % 4 == 0) else 16.0,
                "frac_nonfinite": 0.25 if op == 10 else (float(k > 20) if op == 11 else 0.0),
            }
            for fmt in FORMATS:
                row[f"underflow_{fmt}"] = float(rng.choice([0.0, 0.005, 0.03, 0.6]))
                row[f"overflow_{fmt}"] = float(rng.choice([0.0, 0.0, 1e-6, 0.02]))
                row[f"snr_{fmt}"] = float(rng.uniform(5, 80)) if op != 12 else math.nan
            rows.append(row)
    dense = make_stats(rows)
    for col in dense.columns:  # stored as float32, as recorded
        if col not in ("step", "op", "iteration"):
            dense[col] = dense[col].astype(np.float32)
    meta = {"graph": {"scalify": True}, "config": {"steps": 600}}
    a = A.advise(dense, ops, meta=meta, audit=("bf16",))
    b = A.advise(dense.sample(frac=1.0, random_state=1), ops, meta=meta, audit=("bf16",))
    assert set(a["rule"]) == {
        "nonfinite",
        "overflow",
        "underflow",
        "snr",
        "drift",
        "trend",
        "delayed",
    }
    pd.testing.assert_frame_equal(a, b)
    assert 10 not in set(a.loc[a["rule"] == "nonfinite", "op"])  # the mask
    short = A.Thresholds(delayed_history=3)  # the delayed pre-filter steps aside
    pd.testing.assert_frame_equal(
        A.advise(dense, ops, meta=meta, thresholds=short),
        A.advise(dense.iloc[::-1], ops, meta=meta, thresholds=short),
    )


def test_advise_argument_errors():
    ops = make_ops({"name": "x", "cast_to": "e4m3"})
    stats = make_stats(series(0, STEPS))
    with pytest.raises(KeyError, match="audit"):
        A.advise(stats, ops, audit=("fp12",))
    with pytest.raises(KeyError, match="ops"):
        A.advise(make_stats(series(7, STEPS)), ops)
    long = stats.melt(id_vars=["step", "op", "iteration"], var_name="metric")
    with pytest.raises(ValueError, match="wide"):
        A.advise(long, ops)
    with pytest.raises(ValueError, match="underflow"):
        A.Thresholds(underflow=-1)
    assert A.advise(stats.iloc[:0], ops).columns.tolist() == A.FINDING_COLUMNS


def test_advise_on_old_op_table_without_cast_to():
    ops = make_ops({"name": "x"}).drop(columns=["cast_to", "scaled"])
    stats = make_stats(series(0, STEPS, overflow_e4m3=0.1, frac_nonfinite=[0, 0, 0, 0, 0.5]))
    found = A.advise(stats, ops)
    assert found["rule"].tolist() == ["nonfinite"]


# -- frames ------------------------------------------------------------------------------


def test_op_labels_unique_and_readable():
    ops = make_ops(
        {"name": "block_0/attn/dot_general", "shape": (16, 64, 384)},
        {"name": "block_0/attn/dot_general", "shape": (16, 64, 384)},
        {"name": "block_0/attn/dot_general", "pass": "bwd", "shape": (16, 64, 384)},
        {"name": "opt/mul", "pass": "opt", "shape": ()},
        {"name": "input/w", "pass": "input", "shape": (8, 4)},
    )
    labels = A.op_labels(ops)
    assert labels.is_unique
    assert labels.tolist() == [
        "fwd/block_0/attn/dot_general#1 [16x64x384]",
        "fwd/block_0/attn/dot_general#2 [16x64x384]",
        "bwd/block_0/attn/dot_general [16x64x384]",
        "opt/mul []",
        "input/w [8x4]",
    ]


def test_derived_log2_metrics():
    stats = make_stats(
        [{"op": 0, "step": 0, "rms": 8.0, "absmax": 0.0, "scale": 0.25}]
        + [{"op": 0, "step": 1, "rms": math.nan}]
    )
    assert A.log2_rms(stats).tolist()[0] == 3.0 and math.isnan(A.log2_rms(stats).tolist()[1])
    assert A.log2_absmax(stats).iloc[0] == -math.inf
    assert A.log2_scale(stats).iloc[0] == -2.0
    wide = A.with_derived(stats)
    assert wide["value_rms"].iloc[0] == 2.0
    assert A.metric_direction("snr_e4m3") == "min"
    assert A.metric_direction("overflow_fp16") == "max"
    assert A.metric_direction("log2_rms") == "abs"
    assert A.metric_direction("rms") == "mean"


def test_matrix_shape_and_iterations():
    rows = []
    for it, rms in enumerate([1.0, 2.0, 6.0]):
        rows += [dict(r, iteration=it) for r in series(1, [0, 5], rms=rms)]
    rows += series(0, [0, 5, 9], rms=[1.0, 2.0, 4.0])
    stats = make_stats(rows)
    m = A.matrix(stats, "rms")
    assert m.shape == (2, 3)
    assert m.index.tolist() == [0, 1] and m.columns.tolist() == [0, 5, 9]
    assert m.loc[1, 0] == 6.0 and math.isnan(m.loc[1, 9])
    assert A.matrix(stats, "rms", iterations="min").loc[1, 5] == 1.0
    assert A.matrix(stats, "rms", iterations="mean").loc[1, 5] == 3.0
    full = A.matrix(stats, "rms", iterations="all")
    assert full.shape == (4, 3) and full.loc[(1, 2), 0] == 6.0
    assert A.matrix(stats, "log2_rms", ops=[0]).loc[0].tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError, match="iterations"):
        A.matrix(stats, "rms", iterations="median")
    with pytest.raises(KeyError, match="nope"):
        A.matrix(stats, "nope")
    with pytest.raises(ValueError, match="max_steps"):
        A.matrix(stats, "rms", max_steps=0)


def test_matrix_downsampling_keeps_the_worst():
    steps = list(range(1000))
    overflow = [0.0] * 1000
    overflow[537] = 0.5
    snr = [40.0] * 1000
    snr[12] = 3.0
    log2 = [0.0] * 1000
    log2[700] = -7.0
    log2[701] = 5.0
    rms = [1.0 if s % 2 else 3.0 for s in steps]
    stats = make_stats(
        series(0, steps, overflow_e4m3=overflow, snr_e4m3=snr, rms=[2.0**v for v in log2])
        + series(1, steps, rms=rms)
    )
    m = A.matrix(stats, "overflow_e4m3", max_steps=100)
    assert m.shape == (2, 100)
    assert m.columns[:3].tolist() == [0, 10, 20]
    assert m.loc[0, 530] == 0.5 and m.loc[0].drop(530).max() == 0.0
    assert A.matrix(stats, "snr_e4m3", max_steps=100).loc[0, 10] == 3.0
    assert A.matrix(stats, "log2_rms", max_steps=100).loc[0, 700] == -7.0
    assert A.matrix(stats, "rms", max_steps=100).loc[1, 10] == 2.0  # mean otherwise
    assert A.matrix(stats, "rms", max_steps=1000).shape == (2, 1000)


def test_matrix_keeps_nan():
    stats = make_stats(series(0, [0, 1, 2, 3], rms=[1.0, math.nan, 1.0, 1.0]))
    m = A.matrix(stats, "rms", max_steps=2)
    assert math.isnan(m.loc[0, 0]) and m.loc[0, 2] == 1.0


def _reference_matrix(stats, metric, how, max_steps):
    """Plain-Python reference: reduce loop iterations per (op, step), then windows."""
    import numpy as np

    def reduce(values, kind):
        values = [float(v) for v in values]
        if any(math.isnan(v) for v in values):
            return math.nan
        if kind == "max":
            return max(values)
        if kind == "min":
            return min(values)
        if kind == "mean":
            return sum(values) / len(values)
        hi, lo = max(values), min(values)
        return hi if abs(hi) >= abs(lo) else lo

    steps = sorted(set(stats["step"]))
    width = max(1, math.ceil(len(steps) / max_steps))
    firsts = [steps[(i // width) * width] for i in range(len(steps))]
    window_of = dict(zip(steps, firsts))
    direction = A.metric_direction(metric)
    values = A.metric_values(stats, metric)
    out = {}
    for op in sorted(set(stats["op"])):
        per_window: dict[int, list[float]] = {}
        for step in steps:
            sel = values[(stats["op"] == op).to_numpy() & (stats["step"] == step).to_numpy()]
            if len(sel):
                per_window.setdefault(window_of[step], []).append(reduce(sel, how))
        out[op] = {w: reduce(v, direction) for w, v in per_window.items()}
    frame = pd.DataFrame.from_dict(out, orient="index").reindex(columns=sorted(set(firsts)))
    return frame.to_numpy(np.float64)


@pytest.mark.parametrize("loops", [1, 3])
@pytest.mark.parametrize("metric", ["snr_e4m3", "overflow_e4m3", "log2_rms", "rms"])
def test_matrix_matches_a_plain_reference(metric, loops):
    """The dense NumPy path (one row per cell, or loop iterations) against a reference
    written with plain Python reductions, with gaps, NaNs, negatives and windows."""
    import numpy as np

    rng = np.random.default_rng(loops)
    rows = []
    for op in range(5):
        steps = sorted(rng.choice(40, size=int(rng.integers(10, 40)), replace=False).tolist())
        for step in steps:
            for it in range(loops):
                value = float(rng.normal())
                if rng.random() < 0.03:
                    value = math.nan
                rows.append(
                    {
                        "op": op,
                        "step": step,
                        "iteration": it,
                        "snr_e4m3": 30 + 10 * value,
                        "overflow_e4m3": abs(value) / 10,
                        "rms": 2.0 ** (4 * value),
                    }
                )
    stats = make_stats(rows)
    for max_steps in (500, 7):
        for how in ("max", "min", "mean"):
            got = A.matrix(stats, metric, iterations=how, max_steps=max_steps).to_numpy()
            want = _reference_matrix(stats, metric, how, max_steps)
            np.testing.assert_allclose(got, want, rtol=1e-12, equal_nan=True)


# -- summary and what-if -----------------------------------------------------------------


def test_op_summary_and_worst_ops():
    ops = make_ops({"name": "a", "cast_to": "e4m3"}, {"name": "b"}, {"name": "c"}, {"name": "zero"})
    stats = make_stats(
        series(0, STEPS, frac_nonfinite=[0, 0, 0, 0.1, 0], snr_e4m3=[30, 20, 25, 40, 40])
        + series(1, STEPS, overflow_fp16=[0, 0.2, 0, 0, 0], rms=[1, 1, 1, 1, 4.0])
        + series(2, STEPS[1:], rms=0.5)
        + series(3, STEPS, rms=0.0)  # all-zero: log2 rms -inf, ranked after finite ones
    )
    # dynamic range at the last step, the widest of two loop iterations of op 2
    stats["dynamic_range"] = 3.0
    last2 = stats.index[(stats["op"] == 2) & (stats["step"] == 400)][0]
    stats.loc[last2, "dynamic_range"] = 9.0
    stats = pd.concat([stats, stats.loc[[last2]].assign(iteration=1, dynamic_range=12.5)])
    summary = A.op_summary(stats, ops)
    assert summary.loc[2, "dynamic_range"] == 12.5 and summary.loc[0, "dynamic_range"] == 3.0
    assert summary.index.tolist() == [0, 1, 2, 3]
    assert summary.loc[0, "first_nonfinite_step"] == 300
    assert math.isnan(summary.loc[1, "first_nonfinite_step"])
    assert summary.loc[0, "frac_nonfinite"] == 0.1
    assert summary.loc[0, "snr_e4m3"] == 20
    assert summary.loc[1, "overflow_fp16"] == 0.2
    assert summary.loc[1, "rms"] == 4.0 and summary.loc[1, "log2_rms"] == 2.0
    assert summary.loc[2, "first_step"] == 100 and summary.loc[2, "last_step"] == 400
    assert summary.loc[0, "cast_to"] == "e4m3" and summary.loc[0, "label"] == "fwd/a [4x4]"
    assert A.worst_ops(summary, "snr_e4m3", n=1).index.tolist() == [0]
    assert A.worst_ops(summary, "overflow_fp16", n=1).index.tolist() == [1]
    assert A.worst_ops(summary, "log2_rms").index.tolist() == [1, 2, 0, 3]
    assert A.worst_ops(summary, "first_nonfinite_step").index.tolist() == [0, 1, 2, 3]
    with pytest.raises(KeyError, match="by"):
        A.worst_ops(summary, "nope")


def test_format_whatif_reasons_and_last_steps():
    ops = make_ops({"name": "over"}, {"name": "under"}, {"name": "noisy"}, {"name": "fine"})
    stats = make_stats(
        series(0, STEPS, overflow_e4m3=[0.003, 0, 0, 0, 0])
        + series(1, STEPS, underflow_e4m3=0.041)
        + series(2, STEPS, snr_e4m3=12.3)
        + series(3, STEPS, snr_e4m3=30.0)
    )
    w = A.format_whatif(stats, ops, ["e4m3", "fp16"])
    assert w.columns.get_level_values(0).unique().tolist() == ["e4m3", "fp16"]
    reason = w[("e4m3", "reason")]
    assert reason[0] == "overflow 0.3%"
    assert reason[1] == "underflow 4.1%"
    thr = A.Thresholds().snr_db["e4m3"]
    assert reason[2] == f"snr 12.3 dB < {thr:g} dB"
    assert reason[3] == "ok"
    assert w[("e4m3", "safe")].tolist() == [False, False, False, True]
    assert w[("fp16", "safe")].all()
    assert w.loc[3, ("e4m3", "snr")] == 30.0
    recent = A.format_whatif(stats, ops, "e4m3", last_steps=2)
    assert recent[("e4m3", "safe")].tolist() == [True, False, False, True]
    both = A.format_whatif(stats, ops, "e4m3, fp16")  # one string, as formats= takes it
    assert both.columns.get_level_values(0).unique().tolist() == ["e4m3", "fp16"]
    with pytest.raises(KeyError, match="formats"):
        A.format_whatif(stats, ops, ["fp12"])
    with pytest.raises(ValueError, match="last_steps"):
        A.format_whatif(stats, ops, last_steps=0)


def test_verdict_counts():
    ops = make_ops(
        {"name": "a", "pass": "fwd"},
        {"name": "b", "pass": "fwd"},
        {"name": "c", "pass": "bwd"},
        {"name": "d", "pass": "opt"},
    )
    stats = make_stats(
        series(0, [0], overflow_e4m3=0.1)
        + series(1, [0])
        + series(2, [0], underflow_e4m3=0.5, underflow_e5m2=0.5)
        + series(3, [0])
    )
    counts = A.verdict_counts(A.format_whatif(stats, ops, ["e4m3", "e5m2"]), ops)
    assert counts.index.tolist() == ["fwd", "bwd", "opt", "all"]
    assert counts.loc["fwd", ("e4m3", "safe")] == 1 and counts.loc["fwd", ("e4m3", "total")] == 2
    assert counts.loc["bwd", ("e5m2", "safe")] == 0
    assert counts.loc["all", ("e4m3", "safe")] == 2 and counts.loc["all", ("e5m2", "safe")] == 3
    text = A.verdict_counts(A.format_whatif(stats, ops, ["e4m3"]), ops, as_text=True)
    assert text.loc["fwd", "e4m3"] == "1/2" and text.loc["all", "e4m3"] == "2/4"


# -- comparison --------------------------------------------------------------------------


def test_compare_runs_across_op_tables_with_inserted_converts():
    ops_a = make_ops(
        {"name": "input/x", "pass": "input", "primitive": "input"},
        {"name": "dot_general"},
        {"name": "tanh"},
        {"name": "dot_general"},
        {"name": "only_in_a"},
    )
    ops_b = make_ops(
        {"name": "input/x", "pass": "input", "primitive": "input"},
        {"name": "convert_element_type", "dtype": "float8_e4m3fn"},
        {"name": "dot_general"},
        {"name": "tanh"},
        {"name": "convert_element_type", "dtype": "float8_e4m3fn"},
        {"name": "dot_general"},
    )
    stats_a = make_stats([{"op": i, "step": s, "rms": 1.0 + i} for i in range(5) for s in (0, 10)])
    stats_b = make_stats(
        [{"op": i, "step": s, "rms": 4.0 * (1 + i)} for i in range(6) for s in (0, 10, 20)]
    )
    values, unmatched = A.compare_runs(stats_a, ops_a, stats_b, ops_b, "rms", names=("fp32", "fp8"))
    pairs = values[["op_fp32", "op_fp8"]].drop_duplicates().values.tolist()
    assert pairs == [[0, 0], [1, 2], [2, 3], [3, 5]]
    assert sorted(values["step"].unique()) == [0, 10]
    row = values[(values["op_fp32"] == 3) & (values["step"] == 10)].iloc[0]
    assert row["value_fp32"] == 4.0 and row["value_fp8"] == 24.0
    assert row["difference"] == 20.0 and row["log2_ratio"] == pytest.approx(math.log2(6))
    assert row["label"] == "fwd/dot_general#2 [4x4]"
    assert set(zip(unmatched["run"], unmatched["op"])) == {("fp32", 4), ("fp8", 1), ("fp8", 4)}
    # default names; a metric that may be negative has no log2 ratio
    cmp = A.compare_runs(stats_a, ops_a, stats_b, ops_b, "mean")
    assert {"value_a", "value_b", "difference"} <= set(cmp.values.columns)
    assert "log2_ratio" not in cmp.values.columns
    with pytest.raises(ValueError, match="names"):
        A.compare_runs(stats_a, ops_a, stats_b, ops_b, "rms", names=("x", "x"))


def test_compare_ignores_mask_fill_values():
    """The only big difference between the runs is an attention mask's fill value
    (finfo(float32).min in one run, -1e30 in the other): a real, smaller difference ranks
    first, the mask op never (its differences are NaN, flagged ``mask_fill``)."""
    ops = make_ops({"name": "attn/scores"}, {"name": "mlp/dot_general"}, {"name": "ln/mul"})
    f32_min = -3.4028234663852886e38

    def run(fill: float, mlp_rms: float) -> pd.DataFrame:
        rows = []
        for s in (0, 10):
            # the masked scores: the fill dominates absmax, RMS (and any statistic of it)
            rows.append(dict(op=0, step=s, absmax=abs(fill), rms=abs(fill) / 2, mean=fill / 4))
            rows.append(dict(op=1, step=s, rms=mlp_rms, mean=0.1 * mlp_rms))
            rows.append(dict(op=2, step=s, rms=1.0, mean=0.0))
        return make_stats(rows)

    stats_a, stats_b = run(f32_min, 1.0), run(-1e30, 8.0)
    for metric in ("rms", "absmax", "mean", "log2_rms", "value_absmax"):
        values, _ = A.compare_runs(stats_a, ops, stats_b, ops, metric)
        masked = values[values["op_a"] == 0]
        assert masked["mask_fill"].all() and not values[values["op_a"] != 0]["mask_fill"].any()
        diff = "log2_ratio" if "log2_ratio" in values.columns else "difference"
        assert masked[diff].isna().all(), metric
        ranked = A.largest_differences(values)
        assert ranked["op_a"].tolist()[0] == 1, (metric, ranked)
        assert ranked["op_a"].tolist()[-1] == 0 and np.isnan(ranked[diff].iloc[-1])
        assert masked["value_a"].notna().all()  # the values stay, only the ranking skips them
    # a fill in the metric itself (a value column of magnitude >= 1e30), without absmax
    plain_a = stats_a.drop(columns=["absmax"])
    plain_b = stats_b.drop(columns=["absmax"])
    values, _ = A.compare_runs(plain_a, ops, plain_b, ops, "mean", names=("x", "y"))
    assert values.loc[values["op_x"] == 0, "mask_fill"].all()
    assert A.largest_differences(values, ("x", "y"))["op_x"].tolist()[0] == 1
    assert A.FILL_MAGNITUDE == 1e30


# -- a tiny recorded run -----------------------------------------------------------------


def test_advise_on_tiny_recorded_run(tmp_path):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import scalescope as ss

    def step(w, x):
        def loss(w):
            h = x * 100.0  # 500 > 448: overflows e4m3, NaN after the cast
            return jnp.mean(jnp.tanh(ss.ops.cast_on_forward(h, jnp.float8_e4m3fn) @ w) ** 2)

        value, grad = jax.value_and_grad(loss)(w)
        with jax.named_scope("opt"):
            w = w - 0.1 * grad
        return w, value

    path = tmp_path / "run"
    with ss.Run(path, every=1) as run:
        fn = run.track(step, scalify=False)
        w, x = jnp.ones((8, 4)) * 0.1, jnp.ones((4, 8)) * 5.0
        for i in range(3):
            w, value = fn(w, x)
            run.log(i, loss=value)
    reader = ss.open_run(path)
    found = A.advise_run(reader)
    over = found[(found["rule"] == "overflow") & (found["format"] == "e4m3")]
    assert len(over) == 1
    row = over.iloc[0]
    assert row["pass"] == "fwd" and row["first_step"] == 0 and row["value"] == 1.0
    assert row["primitive"] == "mul"
    assert "scalify=True" in row["fix"]
    nonfinite = found[found["rule"] == "nonfinite"]
    assert len(nonfinite) > 0 and nonfinite["first_step"].min() == 0
    assert found.iloc[0]["severity"] == "critical"
    # the other views run on the same run
    assert A.op_summary_run(reader).loc[row["op"], "overflow_e4m3"] == 1.0
    assert not A.format_whatif_run(reader, "e4m3").loc[row["op"], ("e4m3", "safe")]
    assert A.matrix_run(reader, "log2_rms").shape[1] == 3
