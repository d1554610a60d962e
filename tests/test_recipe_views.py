"""Views treat a block-scaled recipe like a format: the what-if's verdict per recipe (each
criterion alone, the overflow tolerance), the cheapest safe recipe, the advisor's audit,
the op summary, the block-scale figure, and the report's JSON verdicts and ``--fail-on``
on a small recorded run. Synthetic numbers are chosen here, not computed by the code."""

from __future__ import annotations

import html
import json
import math

import jax.numpy as jnp
import numpy as np
import pandas as pd
import pytest

import scalescope as ss
from scalescope import analysis as A
from scalescope import report, viz

#: Recipes of the synthetic frames, deliberately not in cost order.
RECIPES = ("mxfp8_e4m3", "nvfp4", "mxfp4", "e4m3_tensor")
STEPS = [0, 10, 20, 30, 40]


def make_ops(*names: str, passes: tuple[str, ...] = ()) -> pd.DataFrame:
    """Op table, ids 0, 1, 2...; pass ``fwd`` unless ``passes`` says otherwise."""
    rows = [
        {
            "op": i,
            "name": name,
            "pass": passes[i] if i < len(passes) else "fwd",
            "primitive": name,
            "shape": (64, 64),
            "dtype": "float32",
            "scaled": False,
            "source": f"model.py:{i + 1}",
            "cast_to": "",
        }
        for i, name in enumerate(names)
    ]
    return pd.DataFrame(rows).set_index("op")


def defaults() -> dict[str, float]:
    """A well-behaved value: exact in e4m3, every recipe within its limits."""
    out = {"count": 4096.0, "rms": 1.0, "absmax": 3.0, "scale": 1.0, "frac_nonfinite": 0.0}
    out |= {"underflow_e4m3": 0.0, "subnormal_e4m3": 0.0, "overflow_e4m3": 0.0}
    out["snr_e4m3"] = 40.0
    for r in RECIPES:
        out |= {f"underflow_{r}": 0.0, f"overflow_{r}": 0.0, f"snr_{r}": 30.0}
        out |= {f"block_flush_{r}": 0.0, f"scale_log2_min_{r}": -3.0, f"scale_log2_max_{r}": 2.0}
    return out


def make_stats(*ops: dict) -> pd.DataFrame:
    """Rows of each op over `STEPS`; an op's dict overrides metrics, a list value per step."""
    rows = []
    for op, over in enumerate(ops):
        for i, step in enumerate(STEPS):
            row = {"step": step, "op": op, "iteration": 0, **defaults()}
            row |= {k: v[i] if isinstance(v, list) else v for k, v in over.items()}
            rows.append(row)
    return pd.DataFrame(rows)


def at(step_index: int, value: float, base: float = 0.0) -> list[float]:
    """``value`` at one recorded step, ``base`` at the others."""
    return [value if i == step_index else base for i in range(len(STEPS))]


# -- what-if ---------------------------------------------------------------------------


def test_formats_and_recipes_are_told_apart():
    stats = make_stats({})
    assert A.recorded_formats(stats) == ["e4m3"]
    assert A.recorded_recipes(stats) == list(RECIPES)
    w = A.format_whatif(stats, make_ops("a"))
    assert A.whatif_groups(w) == ["e4m3", *RECIPES]
    assert A.whatif_recipes(w) == ["mxfp4", "nvfp4", "e4m3_tensor", "mxfp8_e4m3"]
    assert set(w["nvfp4"].columns) == set(A.RECIPE_FIELDS)
    assert set(w["e4m3"].columns) == set(A.WHATIF_FIELDS)


def test_each_criterion_alone_makes_a_recipe_unsafe():
    """One bad recorded step is enough; the reason names the failing statistic. A recipe
    is judged by the noise it adds (SNR), its flushing and NaN/inf; clipping and flushed
    blocks by design are in the SNR."""
    ops = make_ops("fine", "under", "clipped", "noisy", "flushed", "nonfinite", "edge")
    stats = make_stats(
        {},
        {"underflow_nvfp4": at(2, 0.8)},
        {"overflow_nvfp4": at(3, 0.035)},  # NVFP4's clipping of Gaussian data: by design
        {"snr_nvfp4": at(1, 12.0, 30.0)},
        {"block_flush_nvfp4": at(4, 1 / 64)},
        {"frac_nonfinite": at(0, 0.5)},
        # exactly at every limit: underflow 75 %, SNR at the recipes' 13.5 dB
        {"underflow_nvfp4": 0.75, "overflow_nvfp4": 1.0, "snr_nvfp4": 13.5},
    )
    w = A.format_whatif(stats, ops)
    assert w[("nvfp4", "reason")].tolist() == [
        "ok",
        "underflow 80.0%",
        "ok",
        "snr 12.0 dB < 13.5 dB",
        "ok",
        "nonfinite 50.0%",
        "ok",
    ]
    assert w[("nvfp4", "safe")].tolist() == [True, False, True, False, True, False, True]
    # the other recipes see only the nonfinite op; worst values per field
    assert w[("mxfp4", "safe")].tolist() == [True] * 5 + [False, True]
    assert w.loc[4, ("nvfp4", "block_flush")] == 1 / 64
    assert w.loc[3, ("nvfp4", "snr")] == 12.0 and w.loc[2, ("nvfp4", "overflow")] == 0.035
    # several failures are joined, and last_steps drops the old ones
    both = make_stats({"underflow_mxfp4": at(0, 0.9, 0.8), "snr_mxfp4": at(0, 10.0, 30.0)})
    w = A.format_whatif(both, make_ops("a"))
    assert w.loc[0, ("mxfp4", "reason")] == "underflow 90.0%; snr 10.0 dB < 13.5 dB"
    recent = A.format_whatif(both, make_ops("a"), last_steps=2)
    assert recent.loc[0, ("mxfp4", "reason")] == "underflow 80.0%"


def test_recipe_clipping_is_judged_by_the_snr_unless_bounded():
    """The OCP MX rule clips ~0.9 % of N(0, 1) elements and NVFP4 ~3.5 % by design, and
    both train (docs/advisor.md): by default the SNR alone judges clipping. A bound can
    be set; a format tolerates no overflow at all."""
    hair, clipped = 2.0**-20, 0.0086
    ops = make_ops("hair", "clipped")
    stats = make_stats(
        {"overflow_e4m3_tensor": hair, "overflow_e4m3": hair},
        {"overflow_e4m3_tensor": clipped},
    )
    w = A.format_whatif(stats, ops)
    assert w[("e4m3_tensor", "safe")].tolist() == [True, True]
    assert not w.loc[0, ("e4m3", "safe")]  # formats: any overflow
    bounded = A.format_whatif(stats, ops, thresholds=A.Thresholds(recipe_overflow=1e-4))
    assert bounded[("e4m3_tensor", "safe")].tolist() == [True, False]
    assert bounded.loc[1, ("e4m3_tensor", "reason")] == "overflow 0.9%"
    strict = A.format_whatif(stats, ops, thresholds=A.Thresholds(recipe_overflow=0))
    assert strict[("e4m3_tensor", "safe")].tolist() == [False, False]
    with pytest.raises(ValueError, match="recipe_overflow"):
        A.Thresholds(recipe_overflow=2)


def test_recipe_snr_threshold_is_the_recipes():
    t = A.Thresholds()
    assert t.snr_for("mxfp8_e4m3") == t.snr_for("nvfp4") == t.recipe_snr_db == 13.5
    assert t.snr_for("e4m3") == 25.5 and t.snr_for("e5m2") == 19.5  # formats: their own
    custom = A.Thresholds(snr_db={"nvfp4": 16.0}, recipe_snr_db=10.0)
    assert custom.snr_for("nvfp4") == 16.0 and custom.snr_for("mxfp4") == 10.0
    assert t.overflow_for("nvfp4") == 1.0 and t.overflow_for("e4m3") == 0.0
    assert t.underflow_for("nvfp4") == 0.75 and t.underflow_for("e4m3") == 0.01


def test_the_recipe_rule_in_words_is_the_rule_applied():
    """The report and the dashboard print the rule beside the recipe verdicts: it used
    to say 1 % underflow, no flushed block and the element format's SNR while the
    verdicts applied 75 %, flushed blocks through the SNR and 13.5 dB."""
    text = A.recipe_rule_text(A.Thresholds())
    assert "13.5 dB" in text and "at most 75.0%" in text and "judged through the SNR" in text
    assert "no block" not in text
    # a gradient's stricter limits, as `Thresholds.recipe_limits` applies them
    assert "22.5 dB with 8-bit elements" in text
    assert "at most 50.0% flushed" in text
    bounded = A.recipe_rule_text(A.Thresholds(recipe_overflow=0.01, recipe_snr_db=10.0))
    assert "clips at most 1.0% of the elements" in bounded and "10 dB" in bounded
    from scalescope.app import widgets

    assert A.recipe_rule_text(widgets.THRESHOLDS) in html.unescape(widgets.FORMATS_HEAD)
    # what format_whatif decides at those limits (the unit test above): flushing 6.7 %
    # and a flushed block, SNR over 13.5 dB: safe, as the text says
    ops = make_ops("op")
    stats = make_stats({"underflow_nvfp4": 0.067, "block_flush_nvfp4": 0.028, "snr_nvfp4": 20.0})
    assert A.format_whatif(stats, ops).loc[0, ("nvfp4", "safe")]


def test_cheapest_safe_recipe_fewest_bits_then_per_tensor_then_larger_blocks():
    order = sorted(ss.core.recipes.RECIPES, key=A.recipe_cost)
    assert order == [
        "mxfp4",
        "nvfp4",
        "e4m3_tensor",
        "fp8_block128x128",
        "fp8_block128",
        "mxfp8_e4m3",
        "mxfp8_e5m2",
        "mxfp8_e4m3_rceil",
        "mxfp8_e5m2_rceil",
    ]
    fp4_bad = {"snr_mxfp4": 10.0, "snr_nvfp4": 10.0}
    ops = make_ops(
        "all", "no_mxfp4", "no_fp4", "mx_only", "none", passes=("fwd",) * 3 + ("bwd",) * 2
    )
    stats = make_stats(
        {},
        {"snr_mxfp4": 10.0},
        {**fp4_bad},
        {**fp4_bad, "snr_e4m3_tensor": 10.0},
        {**fp4_bad, "snr_e4m3_tensor": 10.0, "underflow_mxfp8_e4m3": 0.8},
    )
    w = A.format_whatif(stats, ops)
    cheapest = w[A.CHEAPEST]  # a Series: the column's second level is ""
    assert isinstance(cheapest, pd.Series)
    assert cheapest.tolist() == ["mxfp4", "nvfp4", "e4m3_tensor", "mxfp8_e4m3", ""]
    assert A.cheapest_recipe(w).tolist() == cheapest.tolist()
    counts = A.cheapest_counts(w, ops)
    assert list(counts.columns) == ["mxfp4", "nvfp4", "e4m3_tensor", "mxfp8_e4m3", "none"]
    assert counts.loc["fwd"].tolist() == [1, 1, 1, 0, 0]
    assert counts.loc["bwd"].tolist() == [0, 0, 0, 1, 1]
    assert counts.loc["all"].tolist() == [1, 1, 1, 1, 1]
    # verdict counts: every format and recipe, not the recommendation column
    verdicts = A.verdict_counts(w, ops, as_text=True)
    assert list(verdicts.columns) == ["e4m3", *RECIPES]
    assert verdicts.loc["all", "mxfp4"] == "1/5" and verdicts.loc["all", "mxfp8_e4m3"] == "4/5"
    # formats only: no recipe, no recommendation; one recipe asked for by name
    assert A.whatif_groups(A.format_whatif(stats, ops, "e4m3")) == ["e4m3"]
    assert A.CHEAPEST not in A.format_whatif(stats, ops, "e4m3").columns.get_level_values(0)
    assert A.cheapest_counts(A.format_whatif(stats, ops, "e4m3"), ops).columns.empty
    one = A.format_whatif(stats, ops, ["nvfp4"])
    assert one[A.CHEAPEST].tolist() == ["nvfp4", "nvfp4", "", "", ""]
    with pytest.raises(KeyError, match="recorded recipes: mxfp8_e4m3, nvfp4"):
        A.format_whatif(stats, ops, ["fp8_block128"])


def test_a_gradient_in_a_recipe_is_held_to_more():
    """A weight gradient sums each gradient element over every token, so a systematic
    error adds up: FLOOR clips a block's largest element (a logits gradient's target
    entry) and E2M1 flushes the small ones. Measured (docs/advisor.md): MXFP8 at 18.9 and
    20.1 dB on a logits gradient cost +2.6 % and +13 %, at 23.5 and 24.5 dB nothing
    measurable; NVFP4 flushing 53-65 % of one cost +0.8 % (six seeds), +3.5 % and +47 %."""
    t = A.Thresholds()
    assert t.recipe_limits("mxfp8_e4m3") == (13.5, 0.75)
    assert t.recipe_limits("mxfp8_e4m3", gradient=True) == (22.5, 0.5)
    assert t.recipe_limits("mxfp8_e5m2", gradient=True) == (22.5, 0.5)  # clipping, not mantissa
    assert t.recipe_limits("e4m3_tensor", gradient=True) == (22.5, 0.5)
    assert t.recipe_limits("nvfp4", gradient=True) == (13.5, 0.5)
    assert t.recipe_limits("e4m3", gradient=True) == (25.5, 0.01)  # formats: unchanged
    assert A.Thresholds(recipe_grad_underflow=0.6).recipe_limits("nvfp4", gradient=True)[1] == 0.6
    with pytest.raises(ValueError, match="recipe_grad_underflow"):
        A.Thresholds(recipe_grad_underflow=1.5)
    assert A.Thresholds(recipe_grad_snr_db=30).recipe_limits("mxfp8_e4m3", gradient=True)[0] == 30
    # the same statistics forward and backward: only the gradient fails
    logits_grad = {"snr_mxfp8_e4m3": 20.1, "underflow_nvfp4": 0.55, "snr_nvfp4": 18.3}
    ops = make_ops("logits", "logits_grad", "attn_grad", passes=("fwd", "bwd", "bwd"))
    stats = make_stats(logits_grad, logits_grad, {"snr_mxfp8_e4m3": 23.5, "underflow_nvfp4": 0.487})
    w = A.format_whatif(stats, ops)
    assert w[("mxfp8_e4m3", "safe")].tolist() == [True, False, True]
    assert w[("nvfp4", "safe")].tolist() == [True, False, True]
    assert w.loc[1, ("mxfp8_e4m3", "reason")] == "snr 20.1 dB < 22.5 dB"
    assert w.loc[1, ("nvfp4", "reason")] == "underflow 55.0%"
    assert w.loc[1, A.CHEAPEST] not in ("nvfp4", "mxfp8_e4m3")
    # the advisor's audit of a recipe holds the gradient to the same limits
    found = A.advise(stats, ops, audit=["mxfp8_e4m3", "nvfp4"])
    assert sorted(zip(found["op"], found["rule"], found["format"])) == [
        (1, "snr", "mxfp8_e4m3"),
        (1, "underflow", "nvfp4"),
    ]
    assert found.set_index("rule").loc["snr", "threshold"] == 22.5


def test_advisor_audits_a_recipe_with_its_thresholds():
    ops = make_ops("hair", "clipped", "noisy")
    stats = make_stats({"overflow_nvfp4": 2.0**-20}, {"overflow_nvfp4": 0.03}, {"snr_nvfp4": 12.0})
    found = A.advise(stats, ops, audit="nvfp4")
    assert set(found["format"]) == {"nvfp4"}
    assert found[found["rule"] == "overflow"].empty  # clipping is judged by the SNR
    bounded = A.advise(stats, ops, audit="nvfp4", thresholds=A.Thresholds(recipe_overflow=1e-4))
    over = bounded[bounded["rule"] == "overflow"]
    assert over["op"].tolist() == [1] and over["threshold"].tolist() == [1e-4]
    snr = found[found["rule"] == "snr"]
    assert snr["op"].tolist() == [2] and snr["threshold"].tolist() == [13.5]
    assert len(A.advise(stats, ops)) == 0  # recipes are audited on request only


def test_op_summary_has_each_recipes_worst():
    stats = make_stats(
        {"block_flush_nvfp4": at(1, 0.25), "scale_log2_min_nvfp4": at(2, -9.0, -3.0)}
    )
    su = A.op_summary(stats, make_ops("a"))
    assert su.loc[0, "block_flush_nvfp4"] == 0.25
    assert su.loc[0, "scale_log2_min_nvfp4"] == -9.0 and su.loc[0, "scale_log2_max_nvfp4"] == 2.0
    assert su.loc[0, "snr_mxfp4"] == 30.0 and su.loc[0, "snr_e4m3"] == 40.0
    assert A.metric_direction("block_flush_nvfp4") == "max"
    assert A.metric_direction("scale_log2_min_nvfp4") == "min"
    assert A.metric_direction("scale_log2_max_nvfp4") == "max"


def test_scale_ranges_figure_draws_each_recipes_band():
    stats = make_stats({"scale_log2_min_nvfp4": [-5.0, -6.0, math.nan, -6.0, -7.0]})
    scales = A.block_scales(stats, ["nvfp4", "mxfp8_e4m3", "fp8_block128"])
    assert list(scales.columns) == [
        "scale_log2_min_nvfp4",
        "scale_log2_max_nvfp4",
        "scale_log2_min_mxfp8_e4m3",
        "scale_log2_max_mxfp8_e4m3",
    ]
    elements = A.recipe_elements(["nvfp4", "mxfp8_e4m3", "fp8_block128"])
    assert elements["nvfp4"].name == "e2m1" and elements["mxfp8_e4m3"].name == "e4m3"
    absmax = stats.groupby("step")["absmax"].max()
    fig = viz.scale_ranges(scales, elements, absmax=absmax, name="scales")
    assert fig.name == "scales"
    nvfp4 = fig.select_one({"name": "scales-nvfp4"}).data
    # the band: min scale + log2(0.5) (E2M1's smallest subnormal), max scale + log2(6)
    np.testing.assert_allclose(nvfp4["bottom"], [-6.0, -7.0, np.nan, -7.0, -8.0])
    np.testing.assert_allclose(nvfp4["top"], [2.0 + math.log2(6.0)] * 5)
    assert fig.select_one({"name": "scales-fp8_block128"}) is None  # no columns: skipped
    assert fig.select_one({"name": "scales-absmax"}) is not None
    empty = viz.scale_ranges(scales[[]], elements)
    assert any("no block-scaled recipe" in getattr(t, "text", "") for t in empty.below)


# -- a recorded run: the report ----------------------------------------------------------


def _step(w, x):
    y = x * w
    return w, jnp.sum(y * y)


@pytest.fixture(scope="module")
def recipe_run(tmp_path_factory):
    """Three steps of an elementwise product recorded with two recipes. Row 1 of x holds
    a block of 16 tiny values next to large ones: NVFP4's E4M3 block scale of that block
    rounds to 0, the block flushes."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    x[1, :16] *= 1e-7
    x[1, 16:] *= 100.0
    w = np.ones((4, 64), np.float32)
    path = tmp_path_factory.mktemp("recipes") / "run"
    with ss.Run(path, every=1, formats=("e4m3", "e5m2", "nvfp4", "mxfp8_e4m3_rceil")) as run:
        tracked = run.track(_step, scalify=False)
        for i in range(3):
            w, loss = tracked(w, x)
            run.log(i, loss=loss)
    return path


def test_report_verdicts_and_fail_on_with_recipes(recipe_run, tmp_path, capsys):
    from scalescope import cli

    out = tmp_path / "r.json"
    rules = "block_flush_nvfp4>0,snr_mxfp8_e4m3_rceil<10,underflow_nvfp4:all>100%"
    assert cli.main(["report", str(recipe_run), "--json", str(out), "--fail-on", rules]) == 1
    printed = capsys.readouterr()
    assert "TRIPPED: block_flush_nvfp4>0: worst" in printed.out, printed.out
    assert "ok: snr_mxfp8_e4m3_rceil<10" in printed.out
    assert "--fail-on tripped: block_flush_nvfp4>0\n" in printed.err

    doc = json.loads(out.read_text())
    reader = ss.open_run(recipe_run)
    whatif = A.format_whatif_run(reader)
    assert doc["run"]["recipes"] == ["nvfp4", "mxfp8_e4m3_rceil"]
    assert doc["thresholds"]["recipe_overflow"] == 1.0
    assert doc["thresholds"]["recipe_snr_db"] == 13.5
    html_out = tmp_path / "r.html"
    cli.main(["report", str(recipe_run), "-o", str(html_out)])
    page = html.unescape(html.unescape(html_out.read_text()))  # a Div inside Bokeh JSON
    assert A.recipe_rule_text(A.Thresholds()) in page
    counts = A.verdict_counts(whatif, reader.ops)
    for name in ("e4m3", "nvfp4", "mxfp8_e4m3_rceil"):
        assert doc["summary"]["verdicts"]["all"][name] == {
            "safe": int(counts.loc["all", (name, "safe")]),
            "total": int(counts.loc["all", (name, "total")]),
        }
    cheapest = doc["summary"]["cheapest_recipe"]["all"]
    assert list(cheapest) == ["nvfp4", "mxfp8_e4m3_rceil", "none"]
    assert sum(cheapest.values()) == len(doc["ops"])
    flushed = []
    for o in doc["ops"]:
        v = o["formats"]["nvfp4"]
        assert v["safe"] == bool(whatif.loc[o["op"], ("nvfp4", "safe")])
        assert v["reason"] == whatif.loc[o["op"], ("nvfp4", "reason")]
        assert o["cheapest_recipe"] == (whatif.loc[o["op"], A.CHEAPEST] or None)
        assert "block_flush" not in o["formats"]["e4m3"]
        if v["block_flush"]:
            flushed.append(o["label"])  # shown; judged through the SNR
            assert "block_flush" not in v["reason"]
    assert "input/x [4x64]" in flushed  # one of x's 16 blocks: 1/16
    x_op = next(o for o in doc["ops"] if o["label"] == "input/x [4x64]")
    assert x_op["formats"]["nvfp4"]["block_flush"] == 1 / 16

    # an unknown recipe, and a recipe this run does not record: exit 2, named
    assert cli.main(["report", str(recipe_run), "--fail-on", "underflow_mxfp9>0"]) == 2
    err = capsys.readouterr().err
    assert "unknown format or recipe 'mxfp9'" in err and "recipes: e4m3_tensor, " in err, err
    assert cli.main(["report", str(recipe_run), "--fail-on", "block_flush_mxfp9>0"]) == 2
    assert "unknown recipe 'mxfp9' in 'block_flush_mxfp9'; recipes: " in capsys.readouterr().err
    assert cli.main(["report", str(recipe_run), "--fail-on", "underflow_mxfp4>1%"]) == 2
    err = capsys.readouterr().err
    assert "does not record recipe mxfp4 (recorded recipes: nvfp4, mxfp8_e4m3_rceil" in err


def test_fail_on_parses_recipe_metrics():
    rules = report.parse_fail_on("block_flush_nvfp4>0, underflow_MXFP8_E4M3>1%, snr_mxfp4<10")
    assert [(r.kind, r.format, r.scope, r.recipe, r.threshold) for r in rules] == [
        ("block_flush", "nvfp4", "all", True, 0.0),
        ("underflow", "mxfp8_e4m3", "all", True, 0.01),
        ("snr", "mxfp4", "all", True, 10.0),
    ]
    assert report.parse_fail_on("overflow_e4m3>0")[0].recipe is False
    for text, words in (
        ("block_flush_e4m3>0", "applies to block-scaled recipes, not the format 'e4m3'"),
        ("overflow_nvfp4:cast>0", "a recipe rule checks every op"),
        ("block_flush_nvfp4>150%", "not a fraction in [0, 1]"),
        ("snr_nvfp4>3", "use < or <="),
    ):
        with pytest.raises(ValueError, match=None) as err:
            report.parse_fail_on(text)
        assert words in str(err.value), (text, str(err.value))


def test_report_page_names_the_cheapest_recipe_and_draws_block_scales(recipe_run):
    reader = ss.open_run(recipe_run)
    page, verdicts = report.build_report(reader, worst=1)
    assert "Cheapest safe recipe per pass" in page
    assert "report-scales-0" in page
    assert "Verdicts: ops safe per pass and format or recipe" in page
    assert set(verdicts["summary"]["verdicts"]["all"]) == {
        "e4m3",
        "e5m2",
        "nvfp4",
        "mxfp8_e4m3_rceil",
    }
