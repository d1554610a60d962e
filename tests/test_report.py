"""`scalescope report`: the standalone HTML opens offline in headless chromium with every
section drawn and no console error; the JSON verdicts agree with the advisor and the
format what-if; ``--fail-on`` is a CI gate (0 on a clean run, 1 naming the rule on a
failing one, 2 with a message on a malformed rule or bad input); a run of thousands of
ops gives a file under 20 MB."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pandas as pd
import pytest
from conftest import cli_process, watch_offline
from synthetic_run import synthetic_run as _synthetic_run

import scalescope as ss
from scalescope import analysis as A
from scalescope import report
from scalescope.report import collect as report_collect
from scalescope.report import heatmaps as report_heatmaps
from scalescope.report import verdicts as report_verdicts

HERE = Path(__file__).parent
WRITER = HERE / "dashboard_writer.py"
LOCAL = ("file:", "data:", "blob:", "about:")
SECTIONS = (
    "report-title",
    "report-fail-on",
    "report-summary",
    "report-findings",
    "report-heatmaps",
    "report-heatmap-log2_rms",
    "report-worst-ops",
    "report-op-0",
    "report-histogram-0",
    "report-loss",
    "report-scale-graph",
    "report-compare",
    "report-metadata",
)
GATE = "overflow_e4m3>0,underflow_e5m2>0.01,nonfinite>0"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return cli_process("report", *args)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    for name, extra in (("clean", []), ("naive", ["--naive"])):
        cmd = [sys.executable, str(WRITER), str(root / name), "--steps", "6", *extra]
        subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    rng = np.random.default_rng(0)
    x, w = (rng.standard_normal(s).astype(np.float32) for s in ((16, 8), (8, 4)))
    with ss.Run(root / "naive") as run:  # a scale graph in the failing run only
        run.scale_graph(3, lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2), w, x)
    return root


@pytest.fixture(scope="module")
def naive_report(runs) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """The report of the failing run, compared with the clean one, through the CLI."""
    out = runs / "out"
    proc = _cli(
        str(runs / "naive"),
        "-o",
        str(out / "naive.html"),
        "--json",
        str(out / "naive.json"),
        "--fail-on",
        GATE,
        "--compare",
        str(runs / "clean"),
    )
    return out / "naive.html", out / "naive.json", proc


# ---------------------------------------------------------------------------------------
# --fail-on


def test_fail_on_is_a_ci_gate(runs, naive_report, capsys):
    clean = _cli(str(runs / "clean"), "--fail-on", GATE)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "TRIPPED" not in clean.stdout and "Traceback" not in clean.stderr
    assert "ok: overflow_e4m3>0: worst 0.0%" in clean.stdout

    _, _, naive = naive_report
    assert naive.returncode == 1, naive.stdout + naive.stderr
    out = naive.stdout
    # each tripped rule is named with its value, op and step; the other one is ok
    assert (
        "TRIPPED: overflow_e4m3>0: worst 8.0% (0.08008); first trips at "
        "fwd/layer0/dot_general [16x64] (op 3), step 0" in out
    ), out
    # nonfinite names the earliest op with NaN: the E4M3 cast, before NaN spreads
    assert "TRIPPED: nonfinite>0: worst 100.0% (1); first trips at fwd/layer0/convert" in out
    assert "(op 4), step 0 (7.2%" in out
    assert "ok: underflow_e5m2>0.01: worst n/a [no op is cast to e5m2" in out
    assert "--fail-on tripped: overflow_e4m3>0, nonfinite>0" in naive.stderr
    assert "Traceback" not in naive.stderr and "Warning" not in naive.stderr, naive.stderr

    # in-process: an SNR floor, findings counts, a what-if scope
    naive_run = runs / "naive"
    # the NaN spreads to as many ops as the JAX release's softmax and loss have
    critical = int((ss.open_run(naive_run).advise()["severity"] == "critical").sum())
    assert critical > 10
    cases = {
        "snr_e4m3<10": 0,
        "snr_e4m3<=20": 1,
        "findings_high>1": 0,
        f"findings_critical>={critical}": 1,
        f"findings_critical>{critical}": 0,
        "findings_drift>0": 1,
        "underflow_e5m2:all>0": 1,  # an input flushes to zero in e5m2 (not cast there)
        "overflow_e5m2:all>0": 0,
    }
    for rule, code in cases.items():
        got = report.write_report(naive_run, None, fail_on=rule, quiet=True)
        assert got == code, (rule, capsys.readouterr().out)
    capsys.readouterr()
    assert report.write_report(naive_run, None, fail_on="snr_e4m3<=20", quiet=True) == 1
    line = capsys.readouterr().out
    assert "TRIPPED: snr_e4m3<=20: worst 14.7 dB; first trips at fwd/layer0/dot_general" in line


@pytest.mark.parametrize(
    "rules, words",
    [
        ("overflow_e4m3>>0", "bad operator '>>'"),
        ("overflow_e4m3=0", "bad operator '='"),
        ("overflow_e4m3 0", "no operator found"),
        ("overflow_e3m3>0", "unknown format or recipe 'e3m3'"),
        ("overfloww_e4m3>0", "unknown metric 'overfloww_e4m3'"),
        ("nonfinite>abc", "'abc' is not a finite number"),
        ("nonfinite>nan", "'nan' is not a finite number"),
        ("nonfinite>", "no number after it"),
        ("underflow_e5m2>2", "not a fraction in [0, 1]"),
        ("snr_e4m3>20", "use < or <="),
        ("nonfinite<0.5", "use > or >="),
        ("snr_e4m3<5%", "percentage only makes sense for a fraction"),
        ("overflow_e4m3>0,,nonfinite>0", "empty rule"),
        ("findings_severe>0", "unknown findings selector 'severe'"),
        ("overflow_e4m3:some>0", "unknown scope ':some'"),
        (">0", "no metric before the operator"),
        ("", "no rule given"),
    ],
)
def test_malformed_rule_is_refused_with_a_message(rules, words):
    with pytest.raises(ValueError) as err:
        report.parse_fail_on(rules)
    assert words in str(err.value), str(err.value)


def test_malformed_rule_exits_2_before_reading_the_run(runs):
    proc = _cli(str(runs / "clean"), "-o", str(runs / "never.html"), "--fail-on", "nonfinite>abc")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == (
        "scalescope report: error: --fail-on rule 'nonfinite>abc': 'abc' is not a finite number\n"
    )
    assert not (runs / "never.html").exists()


def test_rules_parse_percentages_scopes_and_counts():
    rules = report.parse_fail_on(
        [" underflow_e5m2 > 1% , snr_fp16:all<=60", "findings_critical>=1"]
    )
    assert [(r.kind, r.format, r.scope, r.operator, r.threshold) for r in rules] == [
        ("underflow", "e5m2", "cast", ">", 0.01),
        ("snr", "fp16", "all", "<=", 60.0),
        ("findings", "", "", ">=", 1.0),
    ]
    assert rules[2].select == "critical"
    assert rules[0].trips(0.02) and not rules[0].trips(0.01) and not rules[0].trips(None)


def test_bad_inputs_exit_2_without_traceback(runs, tmp_path, capsys):
    from scalescope import cli

    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    cases = [
        ([str(tmp_path / "file.txt"), "-o", str(tmp_path / "a.html")], "is a file"),
        ([str(tmp_path / "empty"), "-o", str(tmp_path / "a.html")], "not a scalescope run"),
        ([str(runs / "clean"), "--fail-on", "overflow_fp32>0"], "does not audit fp32"),
        (
            [
                str(runs / "clean"),
                "--json",
                str(tmp_path / "a.json"),
                "--compare",
                str(tmp_path / "nope"),
            ],
            "does not exist",
        ),
        ([str(runs / "clean")], "nothing to do"),
    ]
    for args, words in cases:
        assert cli.main(["report", *args]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("scalescope report: error: ") and words in err, err
    assert not (tmp_path / "a.html").exists()
    # and through the console script's module, without a traceback
    proc = _cli(str(tmp_path / "missing"), "-o", str(tmp_path / "a.html"))
    assert proc.returncode == 2 and "does not exist" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------------------
# JSON


def test_json_verdicts_agree_with_the_advisor_and_the_whatif(runs, naive_report):
    _, json_path, proc = naive_report
    assert proc.returncode == 1, proc.stderr

    def strict(constant):
        raise AssertionError(f"{constant} in the JSON report")

    doc = json.loads(json_path.read_text(), parse_constant=strict)  # plain JSON: no NaN/inf
    assert doc["schema"] == "scalescope-report" and doc["version"] == 1
    reader = ss.open_run(runs / "naive")
    # findings: exactly the advisor's rows
    advised = report_verdicts._plain(reader.advise().to_dict("records"))
    assert doc["findings"] == advised
    key = {(f["op"], f["rule"], f["format"]) for f in doc["findings"]}
    assert ("op", "overflow", "e4m3") not in key and (3, "overflow", "e4m3") in key
    assert doc["summary"]["findings"]["total"] == len(advised)
    # per-op verdicts: the format what-if's, op by op
    whatif = A.format_whatif_run(reader)
    assert [o["op"] for o in doc["ops"]] == whatif.index.tolist()
    for o in doc["ops"]:
        for fmt, v in o["formats"].items():
            assert v["safe"] == bool(whatif.loc[o["op"], (fmt, "safe")])
            assert v["reason"] == whatif.loc[o["op"], (fmt, "reason")]
            snr = whatif.loc[o["op"], (fmt, "snr")]
            assert v["snr"] == (float(snr) if np.isfinite(snr) else None)
    counts = A.verdict_counts(whatif, reader.ops)
    for fmt in reader.formats:
        assert doc["summary"]["verdicts"]["all"][fmt]["safe"] == counts.loc["all", (fmt, "safe")]
    # the gate and the comparison are recorded too
    tripped = {r["rule"]: r["tripped"] for r in doc["fail_on"]}
    assert tripped == {"overflow_e4m3>0": True, "underflow_e5m2>0.01": False, "nonfinite>0": True}
    assert doc["compare"]["run"] == "clean" and doc["compare"]["matched"] > 20
    # ranked by the values' RMS (data RMS x scale), not by how they are stored
    rows = doc["compare"]["largest_differences"]
    values = A.compare_readers(reader, ss.open_run(runs / "clean"), "value_rms").values
    assert rows
    for row in rows[:5]:
        (hit,) = values[(values["op_naive"] == row["op_a"]) & (values["step"] == row["step"])][
            ["value_naive", "value_clean"]
        ].to_numpy()
        assert list(hit) == pytest.approx([row["rms_a"], row["rms_b"]])
    assert doc["run"]["name"] == "naive" and doc["run"]["steps"]["count"] == 6


# ---------------------------------------------------------------------------------------
# the page in chromium


@pytest.mark.browser
def test_report_opens_offline_with_every_section(browser, naive_report):
    html_path, _, proc = naive_report
    assert proc.returncode == 1, proc.stderr
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    blocked, errors, requests = watch_offline(page, LOCAL)
    try:
        page.goto(html_path.as_uri())
        page.wait_for_function(
            "() => window.Bokeh && Bokeh.documents.length > 0 && Bokeh.documents[0].is_idle",
            timeout=60_000,
        )
        for name in SECTIONS:
            found = page.evaluate(f"() => Bokeh.documents[0].get_model_by_name({name!r}) != null")
            assert found, name
        # the worst format metric's heatmap and the non-finite one are there too
        names = page.evaluate(
            "() => [...Bokeh.documents[0].all_models].map(m => m.name)"
            ".filter(n => n && n.startsWith('report-heatmap-'))"
        )
        assert {"report-heatmap-frac_nonfinite", "report-heatmap-overflow_e4m3"} <= set(names)
        # a histogram figure is rendered: its view exists and its canvas holds ink
        painted = page.evaluate(
            """async () => {
            const m = Bokeh.documents[0].get_model_by_name('report-histogram-0');
            const view = Bokeh.index.get_one(m);
            await view.ready;
            const canvas = view.canvas_view.compose().canvas;
            const ctx = canvas.getContext('2d');
            const px = ctx.getImageData(0, 0, canvas.width, canvas.height).data;
            let ink = 0;
            for (let i = 0; i < px.length; i += 4)
                if (px[i] < 100 && px[i + 1] < 100 && px[i + 2] < 100 && px[i + 3] > 0) ink++;
            const bins = Bokeh.documents[0].get_model_by_name('report-histogram-0-bins');
            const special = Bokeh.documents[0].get_model_by_name('report-histogram-0-special');
            const total = [...bins.data_source.data.count, ...special.data_source.data.count]
                .reduce((a, b) => a + b, 0);
            return [view.has_finished(), ink, total];
        }"""
        )
        assert painted[0] and painted[1] > 500 and painted[2] == 16 * 64, painted
        # the text sections hold their content (Divs render in a shadow root)
        assert page.get_by_text("Advisor findings").count() == 1
        assert page.get_by_text("Run metadata").count() == 1
        assert page.get_by_text("TRIPPED").count() >= 2
        assert page.get_by_text("ss.ops.cast_on_forward(x @ params").count() >= 1  # source
        assert not blocked, blocked
        assert not errors, errors
        assert requests == [html_path.as_uri()], requests
    finally:
        page.close()


# ---------------------------------------------------------------------------------------
# thousands of ops


def test_report_of_thousands_of_ops_stays_small(tmp_path):
    n_ops, n_steps = 3000, 250
    _synthetic_run(tmp_path / "big", n_ops, n_steps)
    reader = ss.open_run(tmp_path / "big")
    assert len(reader.ops) == n_ops and len(reader.steps) == n_steps
    t0 = time.perf_counter()
    code = report.write_report(
        reader, tmp_path / "big.html", tmp_path / "big.json", fail_on="nonfinite>0", quiet=True
    )
    elapsed = time.perf_counter() - t0
    assert code == 0
    size = (tmp_path / "big.html").stat().st_size
    print(f"\n{n_ops} ops x {n_steps} steps: HTML {size / 1e6:.2f} MB in {elapsed:.1f} s")
    assert size < 20e6, size
    doc = json.loads((tmp_path / "big.json").read_text())
    assert len(doc["ops"]) == n_ops
    assert doc["summary"]["findings"]["total"] == len(reader.advise())
    assert doc["summary"]["findings"]["by_severity"]["high"] > 0  # the E4M3 overflows
    # heatmap rows grouped by module (collapsed to each group's worst op) and steps
    # merged: at most max_ops x max_steps cells per heatmap
    html = (tmp_path / "big.html").read_text()
    ops = reader.ops
    n_groups = (ops["pass"] + "/" + ops["name"].str.split("/").str[0]).nunique()
    assert f"{n_ops} ops in {n_groups} module groups" in html
    assert f"x {n_steps} steps (windows of 2)" in html
    # more groups than max_ops: neighbouring ops merged as before
    report.write_report(reader, tmp_path / "merged.html", quiet=True, max_ops=50)
    merged = (tmp_path / "merged.html").read_text()
    assert f"{n_ops} ops (groups of 60) x {n_steps} steps (windows of 2)" in merged


def test_report_heatmap_rows_are_collapsed_module_groups_naming_the_worst_op(tmp_path):
    """A run above max_ops: each heatmap row is a (pass, block) group whose cell is its
    worst op's value (checked against pandas here), and the hover names that op."""
    from bokeh.models import HoverTool, InlineStyleSheet

    n_ops, n_steps = 700, 4
    _synthetic_run(tmp_path / "big", n_ops, n_steps)
    reader = ss.open_run(tmp_path / "big")
    data = report_collect._collect(reader, A.Thresholds())
    data.css = InlineStyleSheet(css="")
    figs = report_heatmaps._heatmaps(data, max_ops=600, max_steps=200)
    fig = next(f for f in figs if getattr(f, "name", "") == "report-heatmap-log2_rms")
    tag = fig.tags[0]["scalescope.heatmap"]
    ops = reader.ops
    keys = ops["pass"] + "/" + ops["name"].str.split("/").str[0]
    groups = list(dict.fromkeys(keys))
    assert tag["groups"] == groups and all(tag["collapsed"])
    wide = reader.stats(wide=True)
    frame = pd.DataFrame(
        {
            "group": keys.reindex(wide["op"]).to_numpy(),
            "op": wide["op"],
            "step": wide["step"],
            "v": np.log2(wide["rms"].to_numpy(np.float64)),
        }
    )
    hi = frame.groupby(["group", "step"])["v"].max()
    lo = frame.groupby(["group", "step"])["v"].min()
    ref = hi.where(hi.abs() >= lo.abs(), lo).unstack("step").loc[groups]
    image = np.asarray(
        fig.select_one({"name": "report-heatmap-log2_rms-image"}).data_source.data["image"][0]
    )
    np.testing.assert_allclose(image, ref.to_numpy(), rtol=1e-6)
    fmt = next(t for t in fig.tools if isinstance(t, HoverTool)).formatters["$y"]
    worst = np.asarray(fmt.args["worst"].data["worst"][0])
    frame["abs"] = frame["v"].abs()
    top = frame.sort_values(["group", "step", "abs", "op"], ascending=[1, 1, 0, 1])
    first = top.drop_duplicates(["group", "step"]).set_index(["group", "step"])["op"]
    labels = A.op_labels(ops)
    for r, group in enumerate(groups):
        for c, step in enumerate(range(n_steps)):
            assert fmt.args["names"][worst[r, c]] == labels[first[group, step]], (group, step)


def test_merged_heatmap_rows_keep_the_worst_value():
    mat = pd.DataFrame(
        [[0.0, 0.1], [0.5, np.nan], [0.2, 0.0], [0.0, 0.3], [0.9, 0.0]],
        index=pd.Index([10, 11, 12, 13, 14], name="op"),
        columns=pd.Index([0, 5], name="step"),
    )
    labels = pd.Series([f"op{i}" for i in mat.index], index=mat.index)
    out, names, width = report_heatmaps._merge_rows(mat, labels, "overflow_e4m3", max_ops=2)
    assert width == 3 and out.index.tolist() == [10, 13]
    np.testing.assert_array_equal(out.to_numpy()[1], [0.9, 0.3])
    assert np.isnan(out.to_numpy()[0, 1]) and out.to_numpy()[0, 0] == 0.5
    assert names.tolist() == ["op10 ... op12 (3 ops)", "op13 ... op14 (2 ops)"]


# ---------------------------------------------------------------------------------------
# sampled statistics, ops measured in turns (overhead budget)

SAMPLED_NOTE = "sampled statistics: estimates from at most 256 elements per value"


@pytest.fixture(scope="module")
def budget_run(runs) -> Path:
    """The failing run as a budget would have recorded it: each op measured every 3rd
    recorded step, statistics estimated from at most 256 elements per value."""
    from budget_runs import sparsify

    return sparsify(
        runs / "naive",
        runs / "naive-budget",
        period=3,
        statistics="sampled",
        budget=0.05,
        sample=256,
    )


def test_report_of_a_sampled_budget_run_says_so(budget_run, runs, tmp_path):
    reader = ss.open_run(budget_run)
    page, doc = report.build_report(reader, compare=ss.open_run(runs / "clean"))
    assert doc["statistics"] == "sampled" and doc["budget"] == 0.05 and doc["sample"] == 256
    assert doc["measurement_period"] == 3.0
    assert doc["notes"] == [
        SAMPLED_NOTE,
        "rotating subset (budget 5%): ops measured every ~3 recorded steps",
    ]
    assert doc["run"]["statistics"] == "sampled" and doc["compare"]["statistics"] == "exact"
    # per op: when it was last measured, from the reader
    last = reader.last_measured()
    measured = reader.measured()
    for o in doc["ops"]:
        assert o["last_measured"] == int(last[o["op"]]) and o["n_measured"] == 2, o["op"]
        assert o["n_measured"] == measured.loc[o["op"], "n_measured"]
    # the note sits in every section computed from statistics: title, verdicts,
    # findings, heatmaps, worst ops, comparison
    assert page.count(SAMPLED_NOTE) == 6, page.count(SAMPLED_NOTE)
    assert page.count("ops measured every ~3 recorded steps") == 6
    assert "last measured" in page
    # heatmaps leave the cells of unmeasured ops blank over a hatch
    assert '"name":"report-heatmap-log2_rms-blank"' in page.replace(" ", "")
    json.dumps(doc, allow_nan=False)  # plain JSON


def test_report_shows_the_latest_scale_graph_when_the_run_has_one(runs):
    page, _ = report.build_report(ss.open_run(runs / "naive"))
    assert "report-scale-graph" in page and "at step 3 (recorded at steps 3)" in page
    clean, _ = report.build_report(ss.open_run(runs / "clean"))
    assert "report-scale-graph" not in clean


def test_report_of_an_exact_run_has_no_note(runs):
    page, doc = report.build_report(ss.open_run(runs / "clean"))
    assert doc["statistics"] == "exact" and doc["budget"] is None and doc["notes"] == []
    assert doc["measurement_period"] == 1.0
    assert "sampled statistics" not in page and "rotating subset" not in page
    assert "-blank" not in page  # every op measured at every step: nothing blank
    assert all(o["n_measured"] == 6 and o["last_measured"] == 5 for o in doc["ops"])


def test_merged_heatmap_rows_skip_unmeasured_cells():
    mat = pd.DataFrame(
        [[0.1, np.nan, np.nan], [np.nan, np.nan, 0.2], [0.3, np.nan, np.nan]],
        index=pd.Index([0, 1, 2], name="op"),
        columns=pd.Index([0, 1, 2], name="step"),
    )
    measured = pd.DataFrame(
        [[True, False, False], [False, True, True], [True, False, False]],
        index=mat.index,
        columns=mat.columns,
    )
    labels = pd.Series(["a", "b", "c"], index=mat.index)
    out, _, width = report_heatmaps._merge_rows(mat, labels, "overflow_e4m3", 1, measured)
    assert width == 3
    # step 0: the worst of the two measured ops; step 1: op 1 was measured and is NaN
    # (non-finite data), which stays NaN; step 2: op 1's value, not NaN from the others
    np.testing.assert_array_equal(out.to_numpy()[0], [0.3, np.nan, 0.2])
    merged = report_heatmaps._merge_measured(measured, width)
    assert merged.to_numpy().tolist() == [[True, True, True]]
    nothing = measured & False
    out, _, _ = report_heatmaps._merge_rows(mat, labels, "overflow_e4m3", 1, nothing)
    assert np.isnan(out.to_numpy()).all()  # no op measured: blank, not 0


@pytest.mark.browser
def test_budget_report_opens_offline_with_notes_and_blank_cells(browser, budget_run, tmp_path):
    # Through the CLI, as users write reports: a process that imported Panel (the
    # dashboard tests in this worker) would embed Panel's extension resources.
    html_path = tmp_path / "budget.html"
    proc = _cli(str(budget_run), "-o", str(html_path))
    assert proc.returncode == 0, proc.stderr
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    blocked, errors, requests = watch_offline(page, LOCAL)
    try:
        page.goto(html_path.as_uri())
        page.wait_for_function(
            "() => window.Bokeh && Bokeh.documents.length > 0 && Bokeh.documents[0].is_idle",
            timeout=60_000,
        )
        blank = page.evaluate(
            """() => {
            const m = Bokeh.documents[0].get_model_by_name('report-heatmap-log2_rms-image');
            const a = m.data_source.data.image[0];
            let nan = 0; for (const v of a) if (Number.isNaN(v)) nan++;
            const q = Bokeh.documents[0].get_model_by_name('report-heatmap-log2_rms-blank');
            return [nan, a.length, q != null];
        }"""
        )
        assert blank[2] and blank[0] >= blank[1] * 2 // 3, blank  # 2 of 3 cells unmeasured
        assert page.get_by_text(SAMPLED_NOTE).count() >= 5
        assert not blocked, blocked
        assert not errors, (errors, [r for r in requests if not r.startswith("data:")])
    finally:
        page.close()


def test_python_m_scalescope_is_the_command():
    """``python -m scalescope ...`` runs the ``scalescope`` command (it was "No module
    named scalescope.__main__")."""
    proc = subprocess.run(
        [sys.executable, "-m", "scalescope", "report", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: scalescope report"), proc.stdout[:200]
