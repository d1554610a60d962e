"""The verdict on real training runs: the fast variant of the labelled corpus
(`benchmarks/bench_verdicts.py --fast`: the sample MLP on Fashion-MNIST, raw 0..255
inputs in naive FP8 against scalified FP8) tells the broken run from the healthy one,
the sample GPT's constants by construction (its causal mask, AdamW's bias corrections)
are neither flagged nor ranked, and every place that shows a verdict agrees: the report
and its gate, the CLI, the dashboard (which opens on the run that needs attention most,
in the page model and in the browser)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import XLA_TEST_FLAGS, watch_offline

import scalescope as ss
from scalescope import analysis as A
from scalescope.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_verdicts  # noqa: E402

BROKEN = "mlp-fp8-naive-x255"
CASES = ("mlp-fp8", BROKEN)
ARGS = ["--fast", "--steps", "200", "--every", "10", "--seed", "0"]
LOCAL = ("http://127.0.0.1", "ws://127.0.0.1", "file:", "data:", "blob:", "about:")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, list[dict]]:
    """The corpus, run as its script in a process whose XLA optimises the generated code
    (the tests' `XLA_TEST_FLAGS` left out): it trains four runs of 200 steps, and its FP8 MLP
    steps run twice as slow unoptimised (fixture cold: 107 s with the test flags, 71 s
    without; 2-core VM). Its programs are its own, so nothing shared is lost."""
    root = tmp_path_factory.mktemp("corpus")
    out = root / "rows.json"
    argv = [*ARGS, "--cases", ",".join(CASES), "--out", str(root), "--json", str(out)]
    flags = os.environ.get("XLA_FLAGS", "").replace(XLA_TEST_FLAGS, "").strip()
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    script = Path(bench_verdicts.__file__)
    proc = subprocess.run(
        [sys.executable, str(script), *argv], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root, json.loads(out.read_text())


@pytest.fixture(scope="module")
def served(corpus, tmp_path_factory) -> Path:
    """The healthy and the broken run side by side; the healthy one sorts first."""
    root, _ = corpus
    out = tmp_path_factory.mktemp("served")
    for name in CASES:
        shutil.copytree(root / name, out / name)
    assert sorted(CASES)[0] == "mlp-fp8"
    return out


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory) -> Path:
    """The sample GPT (tiny), fp32: a causal mask and AdamW's scalars."""
    run = tmp_path_factory.mktemp("gpt") / "fp32"
    argv = ["train", "gpt", "--precision", "fp32", "--steps", "12", "--every", "4"]
    argv += ["--layers", "1", "--d-model", "16", "--seq-len", "8", "--batch", "4"]
    assert main([*argv, "--data", "vendored", "--quiet", "--run", str(run)]) == 0
    return run


@pytest.mark.data
def test_the_fast_corpus_tells_healthy_from_broken(corpus):
    _, rows = corpus
    by = {r["case"]: r for r in rows}
    healthy = by["mlp-fp8"]
    assert healthy["label"] == "healthy", healthy
    assert healthy["verdict"] == "healthy" and healthy["high"] == healthy["critical"] == 0
    assert healthy["medium"] <= bench_verdicts.MAX_MEDIUM, healthy
    assert healthy["trend"] == "", healthy  # its loss falls: no "diverged" note
    broken = by[BROKEN]
    assert broken["label"] == "broken" and broken["gap_pct"] > bench_verdicts.GAP_PCT, broken
    assert broken["verdict"] in ("failing", "at risk"), broken
    assert broken["cause_rank"] in (1, 2, 3), broken  # E4M3 overflow of the first layer
    assert broken["verdict_step"] is not None
    assert broken["departs_step"] is None or broken["verdict_step"] <= broken["departs_step"]
    assert all(r["ok"] for r in rows), rows
    # the flight recorder raises no alarm over the healthy run's 200 steps (noise is a
    # defect), and catches the broken one's first non-finite step, if it has one
    root, _ = corpus
    assert ss.open_run(root / "mlp-fp8").incidents().empty
    reader = ss.open_run(root / BROKEN)
    loss = reader.scalars["loss"]
    bad = loss.index[~np.isfinite(loss.to_numpy(np.float64))]
    incidents = reader.incidents()
    if len(bad):
        assert incidents["trigger"].tolist()[:1] == ["nonfinite"], incidents
        assert int(incidents["step"].iloc[0]) <= int(bad[0]), (incidents, bad[0])


def test_constants_by_construction_are_never_worst_nor_flagged(gpt_run):
    reader = ss.open_run(gpt_run)
    ops = reader.ops
    constants = set(A.constant_ops(ops).tolist())
    origin = ops["origin"]
    # the causal mask's fill (and softmax's s - max(s) of it) and AdamW's bias corrections
    fills = ops.index[origin == "fill"]
    assert any("attn" in ops.loc[op, "name"] for op in fills), ops.loc[fills, "name"]
    assert {"pow", "sub"} <= set(ops.loc[ops.index[origin == "constant"], "primitive"])
    summary = A.op_summary(reader.stats(wide=True), ops)
    recorded = set(summary.index)
    assert constants & recorded
    for metric in ("log2_rms", "absmax"):
        worst = A.worst_ops(summary, metric, n=20, exclude=A.constant_ops(ops))
        assert not constants & set(worst.index)
    # with them left in, a constant would rank first (tied, on JAX 0.11, with softmax's
    # guarded -inf initial): the exclusion keeps it out
    size = summary["log2_rms"].abs()
    assert size[sorted(constants & recorded)].max() == size.max()
    found = reader.advise(audit=("e4m3", "fp16"))
    judged = found[found["rule"].isin(["drift", "trend", "delayed"])]
    assert not constants & set(judged["op"]), judged
    # a format they are cast to (here: audited) still judges them: finfo.min in fp16
    overflow = found[(found["rule"] == "overflow") & (found["format"] == "fp16")]
    assert constants & set(overflow["op"])


@pytest.mark.data
def test_report_gate_and_views_agree_on_the_verdict(corpus, tmp_path, capsys):
    root, rows = corpus
    by = {r["case"]: r for r in rows}
    for name, code in (("mlp-fp8", 0), (BROKEN, 1)):
        out = tmp_path / f"{name}.json"
        html = tmp_path / f"{name}.html"
        argv = ["report", str(root / name), "-o", str(html), "--json", str(out)]
        assert main([*argv, "--fail-on", "verdict>=at-risk"]) == code
        text = capsys.readouterr().out
        report = json.loads(out.read_text())
        assert report["verdict"]["status"] == by[name]["verdict"]
        assert f"verdict: {by[name]['verdict']}" in text  # printed before the gate's lines
        assert ("TRIPPED: verdict>=at-risk" in text) == bool(code)
        page = html.read_text()
        # the verdict heads the page, before the counts and the findings
        assert page.index('id=\\"verdict\\"') < page.index("ops with statistics")
    broken = ss.open_run(root / BROKEN)
    v = broken.verdict()
    report = json.loads((tmp_path / f"{BROKEN}.json").read_text())
    assert v.as_dict() == report["verdict"]
    assert v.reasons and all(r.fix and r.op and r.source for r in v.reasons)
    # the loss's NaN first, then causes of the report, the worst among them
    assert v.reasons[0].cause == "the loss turned NaN/inf" and v.reasons[0].op
    causes = [c["cause"] for c in report["causes"]]
    assert all(r.cause in causes for r in v.reasons[1:]), (causes, v.reasons)
    assert report["causes"][0]["cause"] in [r.cause for r in v.reasons]
    # one op count: the report's, the what-if's and the dashboard's
    from scalescope.app.data import RunData

    whatif = A.format_whatif_run(broken)
    data = RunData(root / BROKEN)
    assert report["run"]["ops"]["with_stats"] == len(whatif) == data.n_recorded_ops
    assert main(["report", str(root / "mlp-fp8"), "--fail-on", "verdict>=bad"]) == 2
    assert "unknown verdict 'bad'" in capsys.readouterr().err


def test_train_prints_the_verdict_first(gpt_run, capsys):
    # the fixture's own output: `scalescope train` prints the verdict before the summary
    v = ss.open_run(gpt_run).verdict()
    assert v.status == "healthy", v
    run = gpt_run.parent / "again"
    # the fixture's options (the learning-rate schedule is compiled from --steps): its
    # programs come from the compilation cache
    argv = ["train", "gpt", "--precision", "fp32", "--steps", "12", "--every", "4"]
    argv += ["--layers", "1", "--d-model", "16", "--seq-len", "8", "--batch", "4"]
    capsys.readouterr()
    assert main([*argv, "--data", "vendored", "--quiet", "--run", str(run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("verdict: healthy"), lines


@pytest.mark.data
def test_dashboard_page_opens_on_the_failing_run(served):
    from scalescope.app.dashboard import Dashboard
    from scalescope.app.data import RunSet

    dash = Dashboard(RunSet(served), poll_ms=0, live=False)
    assert dash.run_select.value == BROKEN
    assert "ss-verdict-at-risk" in dash.verdict_pane.object or (
        "ss-verdict-failing" in dash.verdict_pane.object
    )
    labels = dict(dash.run_select.options)
    assert labels["mlp-fp8 \u2014 healthy"] == "mlp-fp8"
    assert any(v == BROKEN and "healthy" not in k for k, v in labels.items())
    # a page asked for a run opens on it
    assert Dashboard(RunSet(served), run="mlp-fp8", poll_ms=0, live=False).run_select.value == (
        "mlp-fp8"
    )


@pytest.mark.browser
@pytest.mark.data
def test_served_dashboard_shows_the_failing_runs_verdict_first(browser, served):
    from conftest import served_dashboard
    from test_dashboard import _idle

    with served_dashboard(served) as (url, log):
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        blocked, errors, _ = watch_offline(page, LOCAL)
        page.goto(url)
        _idle(page)
        # A live page opens on the worst run whose verdict is known within a few seconds
        # (the advisors start with the server): reload until the broken run's is.
        select = page.locator("select").first
        deadline = time.monotonic() + 90
        while not select.input_value().startswith(BROKEN) and time.monotonic() < deadline:
            time.sleep(1)
            page.reload()
            _idle(page)
        banner = page.locator(".ss-verdict").first
        banner.wait_for(timeout=60_000)
        text = banner.inner_text()
        assert text.startswith("verdict: at risk") or text.startswith("verdict: failing"), text
        # above the tabs, and the run selector marks both runs' verdicts
        tabs = page.locator(".bk-tab").first.bounding_box()
        assert banner.bounding_box()["y"] < tabs["y"]
        assert select.input_value().startswith(f"{BROKEN} \u2014 ")
        options = select.locator("option").all_inner_texts()
        assert any("healthy" in o for o in options), options
        page.close()
        time.sleep(3)  # the server notices the closed tab
        assert not blocked, blocked
        assert not errors, errors
    assert "Traceback" not in log(), log()
