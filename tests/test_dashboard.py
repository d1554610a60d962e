"""The dashboard: `scalescope serve` on bad paths, the page model in-process, and the
served page in Debian's chromium driven by Playwright (every view renders offline with
no console error; the metric select changes the heatmap; a click on a heatmap cell opens
the op; a run being written shows new steps without reload)."""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pandas as pd
import pytest
from conftest import cli_process, served_dashboard, watch_offline

import scalescope as ss
from scalescope import analysis as A

HERE = Path(__file__).parent
WRITER = HERE / "dashboard_writer.py"
LOCAL = ("http://127.0.0.1", "ws://127.0.0.1", "file:", "data:", "blob:", "about:")
#: The views by key (the tab of "Formats" is titled "Formats & recipes").
TABS = ("Overview", "Heatmap", "Op detail", "Advisor", "Formats", "Compare", "Scale graph")
#: Both fixture runs also record two block-scaled recipes.
FORMATS = "e4m3,e5m2,fp16,bf16,mxfp8_e4m3,nvfp4"


def _write(run: Path, *args: str, **kw) -> subprocess.Popen | None:
    cmd = [sys.executable, str(WRITER), str(run), *args]
    if kw.get("background"):
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    return None


@contextlib.contextmanager
def _server(path: Path):
    with served_dashboard(path) as (url, _):
        yield url


# ---------------------------------------------------------------------------------------
# command line and page model, no browser


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    _write(root / "naive", "--naive", "--steps", "6", "--formats", FORMATS)
    _write(root / "scalified", "--steps", "6", "--formats", FORMATS)
    for name in ("naive", "scalified"):
        _add_scale_graphs(root / name, steps=(0, 5))
    return root


def _scale_graph_loss(w, x):
    return jnp.mean(jnp.tanh(x @ w) ** 2)


def _add_scale_graphs(run: Path, steps) -> None:
    """Scale graphs of a small loss at ``steps``, recorded into an existing run."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 8)).astype(np.float32)
    with ss.Run(run, formats=tuple(FORMATS.split(","))) as r:
        for i, step in enumerate(steps):
            w = rng.standard_normal((8, 4)).astype(np.float32) * 2.0**i
            r.scale_graph(step, _scale_graph_loss, w, x)


def _serve_process(*args: str) -> subprocess.CompletedProcess:
    return cli_process("serve", *args, timeout=120)


def test_serve_rejects_bad_paths_with_a_message(tmp_path, capsys):
    """The first case as a user runs it (its own process: exit status 2, no traceback);
    the others through the same `main` in this process (a process start costs ~4 s)."""
    from scalescope.cli import main

    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    proc = _serve_process(str(tmp_path / "missing"), "--port", "5")
    assert proc.returncode == 2, proc.stderr
    assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    for name, words in (("file.txt", "is a file"), ("empty", "no runs under")):
        assert main(["serve", str(tmp_path / name), "--port", "5"]) == 2
        err = capsys.readouterr().err
        assert words in err, err


def test_serve_on_a_taken_port_or_a_foreign_address_exits_2(runs, capsys):
    """The server binds in a thread: without a check first, a taken port printed a
    traceback there while the command announced the other server's URL and never ended
    (so that case runs in a process of its own, under a timeout)."""
    from scalescope.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _serve_process(str(runs), "--port", str(port), "--address", "127.0.0.1")
        assert proc.returncode == 2, proc.stdout + proc.stderr
        words = f"cannot listen on 127.0.0.1:{port}: the port is in use"
        assert words in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and "dashboard on" not in proc.stdout
    address = "192.0.2.1"
    assert main(["serve", str(runs), "--port", str(port), "--address", address]) == 2
    out, err = capsys.readouterr()
    assert f"cannot listen on {address}:{port}: the address is not one of" in err, err
    assert "dashboard on" not in out


def test_page_model_draws_every_view_and_follows_the_store(runs, tmp_path):
    from scalescope.app import Dashboard, RunSet

    dash = Dashboard(RunSet(runs), run="naive", poll_ms=0)
    for i, view in enumerate(TABS):
        dash.tabs.active = i
        assert view in dash.versions, view
    assert "ss-step-count'>6<" in dash.status.object
    assert "loss is non-finite from step 0" in dash.alarms.object
    assert "op(s) hold NaN/Inf; the first, at step 0: fwd/layer0/" in dash.alarms.object
    assert dash.heatmap_pane.object is not None and dash.hist_pane.object is not None
    # the advisor table holds the overflow of the E4M3 cast of layer0, forward
    findings = dash.advisor_table.value
    hit = findings[(findings["rule"] == "overflow") & (findings["format"] == "e4m3")]
    assert len(hit) and set(hit["pass"]) == {"fwd"} and hit["label"].str.contains("layer0").all()
    # a tap on a cell opens that op at that step
    fig = dash._heatmap_fig
    ops, steps = (
        fig.tags[0]["scalescope.heatmap"]["ops"],
        fig.tags[0]["scalescope.heatmap"]["steps"],
    )

    class Tap:
        x, y = 2.0, 3.0

    dash._on_tap(Tap())
    assert TABS[dash.tabs.active] == "Op detail"
    assert dash.op_select.value == ops[3] and dash.step_select.value == steps[2]
    # the scale graph tab: the latest recorded step, a slider over the recorded ones
    dash.tabs.active = TABS.index("Scale graph")
    assert list(dash.scale_graph_step.options) == [0, 5] and dash.scale_graph_step.value == 5
    fig = dash.scale_graph_pane.object
    assert fig is not None and fig.name == "scale-graph" and "step 5" in fig.title.text
    dash.scale_graph_step.value = 0
    assert "step 0" in dash.scale_graph_pane.object.title.text
    # a run still being created (metadata only) is listed and explained, not an error
    with ss.Run(tmp_path / "new"):
        fresh = Dashboard(RunSet(tmp_path), poll_ms=0)
        assert "no recorded step yet" in fresh.status.object


def test_overview_opens_on_the_worst_findings_metric(runs):
    """The worst-ops table opens on the statistic of the worst finding (highest severity,
    then magnitude), not on a fixed one; a metric picked in the page is kept."""
    from scalescope.app import Dashboard, RunSet

    for run in ("naive", "scalified"):
        dash = Dashboard(RunSet(runs), run=run, poll_ms=0)
        data = dash.data
        findings = data.findings()
        options = list(dash.worst_by.options)
        assert options == data.summary_metrics()
        want = A.worst_finding_metric(findings, options)
        assert dash.worst_by.value == want, (run, want)
        if run == "naive":  # NaN in the data: critical, ranked by frac_nonfinite
            assert want == "frac_nonfinite"
        shown = dash.worst_table.value
        assert want in shown.columns and len(shown)
        # the table is analysis.worst_ops over op_summary, read from the grids
        summary = A.op_summary(ss.open_run(runs / run).stats(wide=True), data.ops)
        ref = A.worst_ops(summary, want, n=20)
        assert shown["op"].tolist() == ref.index.tolist()
        np.testing.assert_allclose(shown[want].to_numpy(float), ref[want].to_numpy(float))
    # a metric picked in the page survives a redraw of the Overview
    dash.worst_by.value = "frac_zero" if "frac_zero" in options else options[-1]
    picked = dash.worst_by.value
    dash.versions.clear()
    dash.redraw_visible()
    assert dash.worst_by.value == picked


def test_overview_of_a_run_without_nan_opens_on_its_worst_finding(grouped_root):
    """No NaN anywhere (frac_nonfinite is zero everywhere): the worst ops open on the
    statistic of the worst finding, here a critical overflow."""
    from scalescope.app import Dashboard, RunSet

    dash = Dashboard(RunSet(grouped_root), poll_ms=0)
    findings = dash.data.findings()
    assert not (findings["rule"] == "nonfinite").any()
    worst = findings.iloc[A.worst_finding(findings)]
    assert worst["severity"] == "critical" and worst["rule"] == "overflow"
    assert dash.worst_by.value == "overflow_e4m3"
    assert "overflow_e4m3" in dash.worst_table.value.columns


def test_served_page_draws_the_overview_before_the_advisor_ends(runs, monkeypatch):
    """A served page does not wait for the advisor: the Overview is drawn with what it
    has (loss, worst ops) and says the advisor is reading; the next poll after the advisor
    ends draws its summary and opens the worst ops on the worst finding's metric."""

    from scalescope.app import Dashboard, RunSet
    from scalescope.app import data as app_data

    gate = threading.Event()
    frame = app_data.advisor_frame

    def slow(*args):
        assert gate.wait(120)
        return frame(*args)

    monkeypatch.setattr(app_data, "advisor_frame", slow)
    dash = Dashboard(RunSet(runs), run="naive", poll_ms=0, live=True)
    data = dash.data
    assert data.advice.running and data.advice.findings is None
    assert "the advisor is reading" in dash.advisor_note.object
    assert dash.rule_table.value["advisor"].tolist() == ["reading the statistics..."]
    assert dash.loss_pane.object is not None and len(dash.worst_table.value)
    assert dash.worst_by.value == "log2_rms"
    gate.set()
    findings = data.findings()  # waits for the background run
    dash.poll()  # the page's periodic callback: the advisor's version moved on
    assert "cause" in dash.rule_table.value.columns and dash.advisor_note.object == ""
    assert dash.worst_by.value == A.worst_finding_metric(findings, dash.worst_by.options)
    assert dash.worst_by.value == "frac_nonfinite"


def test_overview_columns_from_the_grids_match_the_op_summary(runs):
    from scalescope.app import RunSet

    for run in ("naive", "scalified"):
        data = RunSet(runs).get(run)
        summary = A.op_summary(ss.open_run(runs / run).stats(wide=True), data.ops)
        assert data.grid.distinct
        for metric in data.summary_metrics():
            got = data.op_worst(metric)
            want = summary[metric].astype(float)
            assert got.index.tolist() == want.index.tolist(), metric
            np.testing.assert_allclose(got.to_numpy(), want.to_numpy(), rtol=1e-6, err_msg=metric)
        assert "stats" not in data._cache  # no wide frame was built for them


def test_measured_from_the_grid_is_the_readers(runs, budget_root, grouped_root):
    """When each op was measured, read from the heatmap grid's mask (no pass over every
    row): the reader's own frame, for full, budgeted and grouped runs."""
    from scalescope.app import RunSet

    for root, run in ((runs, "naive"), (runs, "scalified"), (budget_root, "budget")):
        data = RunSet(root).get(run)
        pd.testing.assert_frame_equal(data.measured(), ss.open_run(root / run).measured())
    data = RunSet(grouped_root).get("big")
    pd.testing.assert_frame_equal(data.measured(), ss.open_run(grouped_root / "big").measured())


def test_advice_runs_in_the_background_and_waits_between_live_steps(grouped_root, tmp_path):
    """The advisor runs off the callback thread over the columns it reads; its findings
    are those of `advise_run`; new steps of a live run do not restart it before
    `Advice.MIN_INTERVAL`, the older findings stay shown meanwhile."""
    import shutil

    from scalescope.app import RunSet

    run = tmp_path / "live"
    shutil.copytree(grouped_root / "big", run)
    data = RunSet(run).get("live")
    advice = data.advice
    assert advice.findings is None and advice.version == 0
    found = advice.latest(wait=60)  # starts it, waits for it
    assert found is not None and advice.version == 1 and not advice.stale
    pd.testing.assert_frame_equal(found, A.advise_run(ss.open_run(run)))
    took = advice.took
    _bench().append_steps(run, 1, 0.0, tmp_path / "stamps")
    assert data.refresh() and advice.stale
    advice.MIN_INTERVAL = 3600.0  # a live run: not re-advised before the interval
    assert advice.latest() is found and not advice.running and advice.version == 1
    advice.MIN_INTERVAL = 0.0
    advice.SPACING = 0.0
    newer = advice.latest(wait=60)
    assert advice.version == 2 and newer is not found and advice.step == 12
    pd.testing.assert_frame_equal(newer, A.advise_run(ss.open_run(run)))
    assert data.findings() is newer  # current: nothing newer to compute
    assert took >= 0 and "stats" not in data._cache


# ---------------------------------------------------------------------------------------
# browser


@contextlib.contextmanager
def _page(browser, url: str):
    """A page that aborts every request leaving 127.0.0.1 and collects console errors."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    blocked, errors, _ = watch_offline(page, LOCAL)
    page.goto(url)
    _idle(page)
    try:
        yield page, blocked, errors
    finally:
        page.close()


def _idle(page, timeout: float = 60_000) -> None:
    page.wait_for_function(
        "() => window.Bokeh && Bokeh.documents.length > 0 && Bokeh.documents[0].is_idle",
        timeout=timeout,
    )


def _model(page, name: str) -> bool:
    return page.evaluate(f"() => Bokeh.documents[0].get_model_by_name({name!r}) != null")


def _tab(page, tab: str):
    return page.locator(".bk-tab").filter(has_text=re.compile(f"^{tab}$")).first


def _open(page, tab: str) -> None:
    _tab(page, tab).click()


def _image_sum(page) -> float | None:
    return page.evaluate(
        """() => {
        const m = Bokeh.documents[0].get_model_by_name('heatmap-image');
        if (m == null) return null;
        const a = m.data_source.data.image[0];
        let s = 0; for (const v of a) if (Number.isFinite(v)) s += v;
        return s;
    }"""
    )


@pytest.mark.browser
def test_every_view_renders_offline_without_console_errors(browser, runs):
    expected = {
        "Overview": ["loss"],
        "Heatmap": ["heatmap"],
        "Op detail": ["timeseries", "histogram", "snr"],
        "Advisor": [],
        "Formats & recipes": [],
        "Compare": [],
        "Scale graph": ["scale-graph"],
    }
    with _server(runs) as url, _page(browser, url) as (page, blocked, errors):
        for tab, models in expected.items():
            _open(page, tab)
            for name in models:
                page.wait_for_function(
                    f"() => Bokeh.documents[0].get_model_by_name({name!r}) != null",
                    timeout=30_000,
                )
            _idle(page)
        page.wait_for_selector(".ss-step-count")
        assert page.locator(".ss-step-count").first.inner_text() == "6"
        _open(page, "Advisor")
        page.get_by_text("overflow").first.wait_for(timeout=30_000)
        _open(page, "Formats & recipes")  # the recipes' table renders beside the formats'
        page.get_by_text("Cheapest safe recipe").first.wait_for(timeout=30_000)
        assert not blocked, blocked
        assert not errors, errors


@pytest.mark.browser
def test_metric_switch_redraws_the_heatmap_and_a_click_opens_the_op(browser, runs):
    with _server(runs / "naive") as url, _page(browser, url) as (page, blocked, errors):
        _open(page, "Heatmap")
        page.wait_for_function(
            "() => Bokeh.documents[0].get_model_by_name('heatmap-image') != null", timeout=30_000
        )
        before = _image_sum(page)
        metric = page.get_by_label("Metric", exact=True).first  # the heatmap's (first tab)
        metric.select_option(label="frac_zero")
        page.wait_for_function(
            "() => Bokeh.documents[0].get_model_by_name('heatmap').title.text == 'frac_zero'",
            timeout=30_000,
        )
        _idle(page)
        after = _image_sum(page)
        assert before is not None and after is not None and before != after
        # click in the middle of the heatmap's canvas: the op detail view opens on a cell
        # click inside the plot frame of the heatmap: the largest visible canvas, left of
        # its colour bar
        boxes = [c.bounding_box() for c in page.locator("canvas").all() if c.is_visible()]
        box = max((b for b in boxes if b), key=lambda b: b["width"] * b["height"])
        box = {"x": box["x"] + 0.4 * box["width"], "y": box["y"] + 0.5 * box["height"]}
        page.mouse.click(box["x"], box["y"])
        page.wait_for_function(
            "() => Bokeh.documents[0].get_model_by_name('histogram') != null", timeout=30_000
        )
        page.locator(".ss-op-info").first.wait_for(timeout=30_000)
        assert "bk-active" in _tab(page, "Op detail").get_attribute("class")
        assert "primitive" in page.locator(".ss-op-info").first.inner_text()
        assert not blocked and not errors, (blocked, errors)


@pytest.mark.browser
def test_live_run_shows_new_steps_without_reload(browser, tmp_path):
    run = tmp_path / "live"
    _write(run, "--steps", "2")
    with _server(run) as url, _page(browser, url) as (page, blocked, errors):
        # The count is filled in once the page's first update arrives (the locator
        # reaches into Panel's shadow roots; a plain querySelector would not).
        count = page.locator(".ss-step-count").first
        deadline = time.time() + 60
        while not count.inner_text().strip() and time.time() < deadline:
            time.sleep(0.2)
        first = int(count.inner_text())
        assert first == 2
        writer = _write(run, "--steps", "40", "--delay", "0.3", background=True)
        try:
            seen, deadline = first, time.time() + 300  # the writer compiles first
            while seen < 5 and time.time() < deadline and writer.poll() in (None, 0):
                time.sleep(0.5)
                seen = int(page.locator(".ss-step-count").first.inner_text())
            assert seen >= 5, (seen, writer.poll(), writer.stderr.read() if writer.poll() else "")
        finally:
            writer.kill()
            writer.wait()
        assert not blocked and not errors, (blocked, errors)


def test_page_model_shows_recipes_beside_formats(runs):
    """The "Formats & recipes" tab: verdict counts and the cheapest safe recipe per pass,
    each op's recipes side by side; the heatmap offers recipe statistics; the op detail
    draws the block scales."""
    from scalescope.app import Dashboard, RunSet

    dash = Dashboard(RunSet(runs), run="scalified", poll_ms=0)
    assert dash.tabs._names[TABS.index("Formats")] == "Formats & recipes"
    dash.tabs.active = TABS.index("Formats")
    whatif = A.format_whatif_run(ss.open_run(runs / "scalified"))
    table = dash.whatif_table.value
    for recipe in ("mxfp8_e4m3", "nvfp4"):
        for field in ("safe", "underflow", "clipped", "snr", "flushed", "why"):
            assert f"{recipe} {field}" in table.columns, (recipe, field)
    assert "e4m3 why" in table.columns and "e4m3 flushed" not in table.columns
    assert table["op"].tolist() == whatif.index.tolist()
    assert table["cheapest recipe"].tolist() == whatif[A.CHEAPEST].tolist()
    np.testing.assert_array_equal(
        table["nvfp4 flushed"].to_numpy(float), whatif[("nvfp4", "block_flush")].to_numpy(float)
    )
    np.testing.assert_array_equal(
        table["nvfp4 clipped"].to_numpy(float), whatif[("nvfp4", "overflow")].to_numpy(float)
    )
    assert {"e4m3", "mxfp8_e4m3", "nvfp4"} <= set(dash.verdicts.value.columns)
    cheapest = dash.cheapest_table.value
    assert dash.cheapest_table.visible
    assert list(cheapest.columns) == ["pass", "nvfp4", "mxfp8_e4m3", "none"]  # cheapest first
    assert cheapest.iloc[-1, 1:].sum() == len(whatif)
    dash.tabs.active = TABS.index("Heatmap")
    for metric in ("block_flush_nvfp4", "scale_log2_min_nvfp4", "snr_mxfp8_e4m3"):
        assert metric in dash.metric.options, metric
    dash.tabs.active = TABS.index("Op detail")
    assert dash.scale_pane.visible and dash.scale_pane.object.name == "scale-ranges"
    assert {"nvfp4", "mxfp8_e4m3"} <= set(dash.snr_pane.object.x_range.factors)


def test_matrix_of_the_page_matches_the_reader(runs):
    """The heatmap's values are the reader's statistics (independently pivoted here)."""
    from scalescope.app import RunSet

    data = RunSet(runs).get("scalified")
    ops = data.filtered_ops((), (), "")
    mat = data.matrix("frac_zero", ops)
    wide = ss.open_run(runs / "scalified").stats(wide=True)
    ref = wide.groupby(["op", "step"])["frac_zero"].max().unstack("step")
    np.testing.assert_allclose(mat.to_numpy(), ref.loc[mat.index].to_numpy(np.float32))


# ---------------------------------------------------------------------------------------
# sampled statistics, ops measured in turns (overhead budget)

SAMPLED_NOTE = "sampled statistics: estimates from at most 256 elements per value"
NOTED = ("Overview", "Heatmap", "Op detail", "Advisor", "Formats")


@pytest.fixture(scope="module")
def budget_root(runs, tmp_path_factory) -> Path:
    """A folder with one run: the naive run as a budget would have recorded it (each op
    every 3rd recorded step, statistics from at most 256 elements per value)."""
    from budget_runs import sparsify

    root = tmp_path_factory.mktemp("budget")
    sparsify(
        runs / "naive",
        root / "budget",
        period=3,
        statistics="sampled",
        budget=0.05,
        sample=256,
    )
    return root


def test_page_model_notes_sampled_statistics_and_last_measured(budget_root, runs):
    from scalescope.app import Dashboard, RunSet

    dash = Dashboard(RunSet(budget_root), run="budget", poll_ms=0)
    for i, view in enumerate(TABS):
        dash.tabs.active = i
        assert view in dash.versions, view
    # every view computed from statistics says the numbers are estimates, measured in turns
    columns = (dash.overview, dash.heatmap_view, dash.detail, dash.advisor, dash.formats)
    for view, column in zip(NOTED, columns):
        note = dash.notes[view]
        assert note in column.objects, view
        assert SAMPLED_NOTE in note.object, view
        assert "ops measured every ~3 recorded steps" in note.object, view
    assert "ss-statistics'>sampled<" in dash.status.object
    reader = ss.open_run(budget_root / "budget")
    last = reader.last_measured()
    # op tables: when each op was last measured
    advisor = dash.advisor_table.value
    assert (advisor["last_measured"].to_numpy() == last.loc[advisor["op"]].to_numpy()).all()
    worst = dash.worst_table.value
    assert (worst["last_measured"].to_numpy() == last.loc[worst["op"]].to_numpy()).all()
    whatif = dash.whatif_table.value
    assert (whatif["last measured"].to_numpy() == last.loc[whatif["op"]].to_numpy()).all()
    op = dash.op_select.value
    assert f"step {int(last[op])} (2 of 6 recorded steps, every ~3)" in dash.op_info.object
    # the op's lines: a marker per measurement, dashed between them
    series = dash.series_pane.object
    assert any("measured at 2 of 6 recorded steps" in getattr(t, "text", "") for t in series.below)
    # abs-min under abs-max: the gap between the two lines is the op's dynamic range
    rows = RunSet(budget_root).get("budget").op_stats(op)
    assert len(rows) and "abs-min" in series.title.text
    for column, how in (("absmax", "max"), ("absmin", "min")):
        (line,) = [r for r in series.renderers if r.name == f"timeseries-line-{column}"]
        want = getattr(rows.groupby("step")[column], how)().to_numpy(float)
        got = np.asarray(line.data_source.data["y"], float)
        np.testing.assert_array_equal(got[~np.isnan(got)], want[want > 0])
    # heatmap: cells of unmeasured ops blank (NaN over a hatch), the rest the rows' values
    fig = dash._heatmap_fig
    assert fig.select_one({"name": "heatmap-blank"}) is not None
    image = np.asarray(fig.select_one({"name": "heatmap-image"}).data_source.data["image"][0])
    data = RunSet(budget_root).get("budget")
    ops = data.filtered_ops((), (), "")
    measured = data.measured_matrix(ops).to_numpy()
    assert image.shape == measured.shape and np.isnan(image[~measured]).all()
    assert "blank (hatched): not measured there" in dash.heatmap_msg.object

    # an exact run measured in full shows no such note
    exact = Dashboard(RunSet(runs), run="scalified", poll_ms=0)
    for i in range(len(TABS)):
        exact.tabs.active = i
    assert all(exact.notes[view].object == "" for view in NOTED)
    assert "ss-statistics'>exact<" in exact.status.object
    assert exact._heatmap_fig.select_one({"name": "heatmap-blank"}) is None


@pytest.mark.browser
def test_budget_run_page_shows_the_note_and_blank_cells_offline(browser, budget_root):
    with _server(budget_root) as url, _page(browser, url) as (page, blocked, errors):
        _open(page, "Heatmap")
        page.wait_for_function(
            "() => Bokeh.documents[0].get_model_by_name('heatmap-blank') != null", timeout=30_000
        )
        _idle(page)
        note = page.locator(".ss-statistics-note").filter(visible=True).first
        note.wait_for(timeout=30_000)
        assert SAMPLED_NOTE in note.inner_text()
        _open(page, "Op detail")
        page.wait_for_function(
            "() => Bokeh.documents[0].get_model_by_name('timeseries') != null", timeout=30_000
        )
        _idle(page)
        assert "last measured" in page.locator(".ss-op-info").first.inner_text()
        assert not blocked and not errors, (blocked, errors)


# ---------------------------------------------------------------------------------------
# grouped heatmap rows, search, a step arriving (a synthetic run of a few hundred ops)

N_OPS = 400  # above COLLAPSE_ABOVE: the heatmap opens with its groups collapsed


def _bench():
    import importlib.util

    path = HERE.parent / "benchmarks" / "bench_dashboard.py"
    spec = importlib.util.spec_from_file_location("bench_dashboard", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def grouped_root(tmp_path_factory) -> Path:
    """A run of 400 ops in 4 layers (``layers/<k>/attn/q/dot_general`` ...) x 12 steps,
    written with the store's layout by the dashboard benchmark's writer."""
    root = tmp_path_factory.mktemp("grouped")
    _bench().write_run(root / "big", N_OPS, 12, every=1, layers=4)
    return root


def _rows(dash) -> dict:
    return dash._heatmap_fig.tags[0]["scalescope.heatmap"]


def test_heatmap_groups_expand_collapse_and_search(grouped_root):
    from scalescope.app import Dashboard, RunSet

    dash = Dashboard(RunSet(grouped_root), poll_ms=0)
    dash.tabs.active = TABS.index("Heatmap")
    data = dash.data
    ops = data.ops
    keys = (ops["pass"] + "/" + ops["name"].str.extract(r"^(layers/\d+)/")[0]).rename("group")
    groups = list(dict.fromkeys(keys))  # order of first op
    rows = _rows(dash)
    # collapsed by default: one row per (pass, layer), in order of their first op
    assert rows["groups"] == groups and all(rows["collapsed"]) and set(rows["ops"]) == {-1}
    assert list(dash.expanded.options) == groups and dash.expanded.value == []
    # each collapsed cell: the worst member for the metric (log2_rms: larger magnitude)
    wide = ss.open_run(grouped_root / "big").stats(wide=True)
    l2 = np.log2(wide["rms"].to_numpy(np.float64))
    frame = pd.DataFrame(
        {"group": keys.reindex(wide["op"]).to_numpy(), "step": wide["step"], "v": l2}
    )
    hi = frame.groupby(["group", "step"])["v"].max()
    lo = frame.groupby(["group", "step"])["v"].min()
    ref = hi.where(hi.abs() >= lo.abs(), lo).unstack("step").loc[groups]
    image = np.asarray(
        dash._heatmap_fig.select_one({"name": "heatmap-image"}).data_source.data["image"][0]
    )
    np.testing.assert_allclose(image, ref.to_numpy(), rtol=1e-6)
    # a click on a collapsed row expands it, in place; the widget follows
    fig = dash._heatmap_fig

    class Tap:
        x, y = 1.0, 1.0

    dash._on_tap(Tap())
    assert dash._heatmap_fig is fig
    members = list(keys.index[keys == groups[1]])
    rows = _rows(dash)
    assert rows["ops"][1 : 1 + len(members)] == members and dash.expanded.value == [groups[1]]
    assert len(rows["ops"]) == len(groups) - 1 + len(members)
    # expand all, collapse all, the MultiChoice
    dash.expand_all.clicks += 1
    assert sorted(_rows(dash)["ops"]) == sorted(ops.index)
    dash.collapse_all.clicks += 1
    assert len(_rows(dash)["ops"]) == len(groups)
    dash.expanded.value = [groups[0], groups[2]]
    assert (
        sum(not c for c in _rows(dash)["collapsed"])
        == (keys == groups[0]).sum() + (keys == groups[2]).sum()
    )
    dash.collapse_all.clicks += 1
    # group depth: deeper groups (layers/<k>/attn, ...), off: one row per op
    dash.group_depth.value = 2
    assert set(_rows(dash)["groups"]) > {"fwd/layers/0/attn", "fwd/layers/0/mlp"}
    dash.group_depth.value = 0
    assert _rows(dash)["ops"] == sorted(ops.index)
    dash.group_depth.value = 1
    # search: a substring of pass/name (case-insensitive), or a regex
    label = ops["pass"] + "/" + ops["name"]
    dash.name_filter.value = "FWD/layers/2/attn/q/"
    want = set(ops.index[label.str.contains("fwd/layers/2/attn/q/", regex=False)])
    shown = _rows(dash)
    assert set(shown["ops"]) == want and not any(shown["collapsed"])  # few: expanded
    dash.search_regex.value = True
    dash.name_filter.value = r"^bwd/layers/[13]/mlp/"
    want = set(ops.index[label.str.contains(r"^bwd/layers/[13]/mlp/")])
    assert set(_rows(dash)["ops"]) == want
    dash.name_filter.value = "attn("  # a bad regex: a message, no exception
    assert "bad search regex" in dash.heatmap_msg.object and "attn(" in dash.heatmap_msg.object
    assert dash.heatmap_pane.object is None  # not the last search's figure under it
    dash.name_filter.value = "no such op"
    assert "no op matches" in dash.heatmap_msg.object and dash.heatmap_pane.object is None
    dash.name_filter.value = ""
    assert len(_rows(dash)["ops"]) == len(groups)
    assert dash.heatmap_pane.object is dash._heatmap_fig


def test_a_new_step_reaches_the_open_heatmap_in_place(grouped_root, tmp_path):
    """A part appended to a run the page shows: the grids take its rows in, the same
    figure gets the new column (the value the reader reads)."""
    import shutil

    from scalescope.app import Dashboard, RunSet

    run = tmp_path / "live"
    shutil.copytree(grouped_root / "big", run)
    dash = Dashboard(RunSet(run), poll_ms=0)
    dash.tabs.active = TABS.index("Heatmap")
    dash.expand_all.clicks += 1
    fig = dash._heatmap_fig
    steps = list(_rows(dash)["steps"])
    _bench().append_steps(run, 2, 0.0, tmp_path / "stamps")
    dash.poll()
    assert dash._heatmap_fig is fig and _rows(dash)["steps"] == [*steps, 12, 13]
    assert "ss-last-step'>13<" in dash.status.object
    wide = ss.open_run(run).stats(wide=True)
    ref = wide.pivot(index="op", columns="step", values="rms")
    image = np.asarray(fig.select_one({"name": "heatmap-image"}).data_source.data["image"][0])
    order = _rows(dash)["ops"]
    np.testing.assert_allclose(
        image[:, -2:], np.log2(ref.loc[order, [12, 13]].to_numpy()), rtol=1e-6
    )


@pytest.mark.browser
def test_grouped_heatmap_draws_and_a_group_expands_in_the_browser(browser, grouped_root):
    rows_js = """() => { const m = Bokeh.documents[0].get_model_by_name('heatmap-image');
        const dh = m.glyph.dh; return (dh != null && typeof dh === 'object') ? dh.value : dh; }"""
    with _server(grouped_root) as url, _page(browser, url) as (page, blocked, errors):
        _open(page, "Heatmap")
        page.wait_for_function(
            "() => Bokeh.documents[0].get_model_by_name('heatmap-image') != null", timeout=30_000
        )
        _idle(page)
        before = page.evaluate(rows_js)
        assert before == 12  # 4 layers x fwd, bwd, opt: collapsed
        # click the first row (a collapsed group): it expands into its ops
        where = page.evaluate(
            """() => { const m = Bokeh.documents[0].get_model_by_name('heatmap');
            const v = Bokeh.index.find_one(m); const el = (v.canvas_view ?? v).el;
            const box = el.getBoundingClientRect();
            return {x: box.left + v.frame.x_scale.compute(3),
                    y: box.top + v.frame.y_scale.compute(0)}; }"""
        )
        page.mouse.move(where["x"], where["y"])
        page.mouse.down()
        page.mouse.up()
        page.wait_for_function(f"() => ({rows_js})() > {before}", timeout=30_000)
        _idle(page)
        tag = page.evaluate(
            "() => Bokeh.documents[0].get_model_by_name('heatmap').tags[0]['scalescope.heatmap']"
        )
        assert tag["ops"][0] >= 0 and len(tag["ops"]) == page.evaluate(rows_js)
        assert not blocked and not errors, (blocked, errors)


def _small(w, x):
    return w * 0.5, jnp.mean(jnp.tanh(x @ w) ** 2)


def _shifted(b, w, x):  # one more input first: every op id moves by one
    return w * 0.5 + b, jnp.mean(jnp.tanh(x @ w) ** 2)


def test_switching_runs_keeps_the_detail_op_by_label_not_by_id(tmp_path):
    """Op ids mean other ops in another run: the detail view keeps the op by its label
    where the other run has it (it used to open whatever op had the same id)."""
    from scalescope.app import Dashboard, RunSet

    w, x = jnp.full((4, 4), 0.3), jnp.ones((2, 4))
    # two runs of one folder name in two experiments: a switch is told by the path
    for name, step, args in (("a/r", _small, (w, x)), ("b/r", _shifted, (jnp.float32(0), w, x))):
        with ss.Run(tmp_path / name, every=1) as run:
            run.track(step, scalify=False)(*args)
    with ss.Run(tmp_path / "empty") as run:  # nothing recorded, no loss logged
        run.log(0, acc=0.5)
    runs = RunSet(tmp_path)
    dash = Dashboard(runs, run="a/r", poll_ms=0)
    dash.tabs.active = TABS.index("Op detail")
    first = dict(zip(dash.op_select.labels, dash.op_select.values, strict=True))
    label = next(lb for lb in first if lb.startswith("fwd/tanh"))
    dash.op_select.value = first[label]
    assert dash.series_pane.object is not None
    dash.run_select.value = "b/r"
    other = dict(zip(dash.op_select.labels, dash.op_select.values, strict=True))
    assert other[label] != first[label]  # the same op under another id
    assert dash.op_select.value == other[label]
    # a run with no recorded step: a message, not the last run's figures under it; and
    # not a green verdict (the background advisor's path and the page's own)
    dash.tabs.active = TABS.index("Heatmap")
    dash.run_select.value = "empty"
    assert dash.heatmap_pane.object is None and "no recorded step" in dash.heatmap_msg.object
    dash.tabs.active = TABS.index("Op detail")
    assert dash.series_pane.object is None and dash.hist_pane.object is None
    assert "no recorded step" in dash.op_info.object and not dash.op_select.options
    empty = runs.get("empty")
    v = empty.latest_verdict(wait=60)
    assert v.unjudged == "no step recorded; no loss logged", v
    assert empty.verdict(pd.DataFrame()).unjudged == v.unjudged
