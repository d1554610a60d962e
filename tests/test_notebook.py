"""Inline notebook views (scalescope.notebook): the reader's hist/advise keep their pandas
values and add an inline figure or a coloured table; heatmap/compare carry the analysis
frames; `ss.show` draws the in-memory statistics of `instrument`; BokehJS loads once,
inline, and no output names a CDN."""

from __future__ import annotations

import ast
import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

import scalescope as ss
from scalescope import analysis as A
from scalescope import notebook as nb

E4M3 = ml_dtypes.float8_e4m3fn
ROOT = Path(__file__).resolve().parent.parent


def _step(params, x):
    def loss_fn(params):
        with jax.named_scope("layer0"):
            h = jnp.tanh(ss.ops.cast_on_forward(x @ params["w0"], E4M3))
        with jax.named_scope("layer1"):
            y = h @ params["w1"]
        return jnp.mean(y**2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    with jax.named_scope("opt"):
        params = jax.tree.map(lambda p, g: p - 0.05 * g, params, grads)
    return params, loss


def _inputs(naive: bool):
    k0, k1, k2 = jax.random.split(jax.random.key(0), 3)
    params = {
        "w0": jax.random.normal(k0, (16, 32)) / 4,
        "w1": jax.random.normal(k1, (32, 4)) / 6,
    }
    x = jax.random.normal(k2, (8, 16)) * (2.0**8 if naive else 1.0)
    return params, x


def _record(path: Path, naive: bool, steps: int = 3) -> ss.RunReader:
    params, x = _inputs(naive)
    if not naive:
        params = ss.as_scaled_array(params)
    with ss.Run(path, every=1, config={"steps": steps}) as run:
        tracked = run.track(_step, scalify=not naive)
        for i in range(steps):
            params, loss = tracked(params, x)
            run.log(i, loss=loss)
    return ss.open_run(path)


def build_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """A directory built once per test session and shared by its xdist workers (the
    first worker builds it under a file lock, the others wait and reuse it)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's directory, common to the workers
    path = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (path / "BUILT").exists():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
            build(path)
            (path / "BUILT").touch()
    return path


def _record_both(root: Path) -> None:
    _record(root / "clean", naive=False)
    _record(root / "naive", naive=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[ss.RunReader, ss.RunReader]:
    """A clean (scalified) run and a naive one whose E4M3 cast overflows."""
    root = build_once(tmp_path_factory, "notebook-view-runs", _record_both)
    return ss.open_run(root / "clean"), ss.open_run(root / "naive")


@pytest.fixture(scope="module")
def probe():
    """In-memory statistics of `instrument` on a small scalified function."""

    def layer(x, w):
        return jax.nn.gelu(x @ w)

    x = ss.as_scaled_array(2.0**-20 * jax.random.normal(jax.random.key(1), (8, 16)), "rms")
    w = ss.as_scaled_array(jax.random.normal(jax.random.key(2), (16, 4)), "rms")
    fn = ss.instrument(layer)
    _, stats = jax.jit(fn)(x, w)
    return stats, fn.op_table(x, w)


def _assert_inline_figure(bundle: dict, name: str) -> str:
    assert set(bundle) == {"text/plain", "text/html"}
    html = bundle["text/html"]
    assert 'class="scalescope-figure"' in html and "Bokeh.embed.embed_items" in html
    assert f'"name":"{name}"' in html  # the viz builder's model name
    assert nb.cdn_urls(html) == [] and 'src="http' not in html and 'href="http' not in html
    return html


# -- reader.hist ------------------------------------------------------------------------


def test_hist_is_still_the_series_of_counts(runs):
    reader = runs[0]
    op = int(reader.ops.index[reader.ops["primitive"] == "dot_general"][0])
    step = int(reader.steps[-1])
    h = reader.hist(op, step)
    # the counts straight from the Parquet parts (what hist returned before)
    cols = [c for c in pq.read_schema(next((reader.path / "stats").glob("*.parquet"))).names]
    cols = [c for c in cols if c.startswith("hist_")]
    parts = [pd.read_parquet(p) for p in sorted((reader.path / "stats").glob("*.parquet"))]
    frame = pd.concat(parts)
    rows = frame[(frame["op"] == op) & (frame["step"] == step) & (frame["process"] == 0)]
    np.testing.assert_array_equal(h.to_numpy(), rows[cols].to_numpy().sum(axis=0))
    plain = pd.Series(h.to_numpy(), index=pd.Index(reader.hist_columns, name="bin"), name=h.name)
    pd.testing.assert_series_equal(h, plain, check_series_type=False)
    assert isinstance(h, pd.Series) and isinstance(h, nb.HistSeries)
    assert h.attrs == {"step": step, "op": op, "iteration": None}
    # derived results are plain pandas objects, so nothing downstream changes
    assert type(h * 2) is pd.Series and type(h.head()) is pd.Series
    assert type(h.to_frame()) is pd.DataFrame
    assert h.equals(reader.hist(op))  # step=-1: the last recorded step


def test_hist_displays_the_exponent_histogram_inline(runs):
    h = runs[0].hist("fwd/layer0/dot_general")
    html = _assert_inline_figure(h._repr_mimebundle_(), "histogram")
    assert "fwd/layer0/dot_general: exponent histogram at step 2" in html
    assert "e4m3-normal" in html  # the format ranges are shaded
    assert h._repr_mimebundle_()["text/plain"] == pd.Series.__repr__(h)


def test_hist_bad_op_names_the_op(runs):
    with pytest.raises(KeyError, match="no op named 'fwd/nope'"):
        runs[0].hist("fwd/nope")


# -- reader.advise ------------------------------------------------------------------------


def test_advise_is_the_advisor_frame_shown_by_severity(runs):
    reader = runs[1]
    advice = reader.advise()
    assert isinstance(advice, pd.DataFrame) and isinstance(advice, nb.Advice)
    pd.testing.assert_frame_equal(pd.DataFrame(advice), A.advise_run(reader))
    assert type(advice[advice["severity"] == "critical"]) is pd.DataFrame
    assert type(advice["op"]) is pd.Series
    html = advice._repr_html_()
    assert html.startswith(f"<div><b>{len(advice)} finding(s)</b>")
    for severity in set(advice["severity"]):
        assert nb.SEVERITY_COLORS[severity] in html
    assert "scalify=True" in html  # the fix column
    pd.testing.assert_frame_equal(advice.summary(), A.summary_by_rule(A.advise_run(reader)))


def test_advise_without_findings_says_so(runs):
    empty = nb.advice_frame(A.advise_run(runs[0]).iloc[:0])
    assert empty.empty and "No findings" in empty._repr_html_()


# -- reader.heatmap -----------------------------------------------------------------------


def test_heatmap_carries_the_analysis_matrix(runs):
    reader = runs[1]
    view = reader.heatmap("underflow_e4m3")
    pd.testing.assert_frame_equal(view.matrix, A.matrix(reader.stats(wide=True), "underflow_e4m3"))
    fwd = reader.heatmap("log2_rms", ops=r"^fwd/")
    expected = A.matrix(reader.stats(wide=True), "log2_rms", ops=reader.resolve_ops(r"^fwd/"))
    pd.testing.assert_frame_equal(fwd.matrix, expected)
    assert fwd.figure.name == "heatmap" and fwd.figure.title.text == "naive: log2_rms"
    _assert_inline_figure(fwd._repr_mimebundle_(), "heatmap")


def test_heatmap_of_a_budget_run_leaves_unmeasured_cells_blank(runs, tmp_path):
    from budget_runs import sparsify

    reader = ss.open_run(
        sparsify(
            runs[1].path,
            tmp_path / "budget",
            period=2,
            statistics="sampled",
            budget=0.05,
            sample=64,
        )
    )
    view = reader.heatmap("log2_rms")
    stats = reader.stats(wide=True)
    pd.testing.assert_frame_equal(view.matrix, A.matrix(stats, "log2_rms"))
    assert view.measured.equals(A.measured_matrix(stats))
    assert np.isnan(view.matrix.to_numpy()[~view.measured.to_numpy()]).all()
    assert view.figure.select_one({"name": "heatmap-blank"}) is not None
    html = view.to_html()
    assert "sampled statistics: estimates from at most 64 elements per value" in html
    assert "rotating subset (budget 5%): ops measured every ~2 recorded steps" in html
    # a run measured in full, exact: nothing blank, no note
    full = runs[1].heatmap("log2_rms")
    assert full.measured.to_numpy().all() and full.notes == []
    assert "scalescope-statistics-note" not in full.to_html()


def test_heatmap_bad_arguments_name_them(runs):
    with pytest.raises(KeyError, match="unknown metric 'rmss'.*log2_rms"):
        runs[0].heatmap("rmss")
    with pytest.raises(KeyError, match="no recorded op matches '\\^nothing/'"):
        runs[0].heatmap("rms", ops="^nothing/")
    with pytest.raises(KeyError, match="no group 'fwd/nope' \\(expanded=\\); groups: "):
        runs[0].heatmap("rms", expanded=["fwd/nope"])
    with pytest.raises(TypeError, match="ops: an op id"):
        runs[0].heatmap("rms", ops=1.5)


# -- reader.compare -----------------------------------------------------------------------


def test_compare_carries_the_comparison_and_draws_both_runs(runs):
    clean, naive = runs
    view = clean.compare(naive.path)  # a path works as well as a reader
    expected = A.compare_readers(clean, naive, "value_rms")
    pd.testing.assert_frame_equal(view.values, expected.values)
    pd.testing.assert_frame_equal(view.unmatched, expected.unmatched)
    assert list(view.summary.index) == ["clean", "naive"]
    assert view.summary.loc["naive", "critical"] > 0 == view.summary.loc["clean", "critical"]
    pairs = expected.values.drop_duplicates("op_clean")
    op_a, op_b = int(pairs["op_clean"].iloc[0]), int(pairs["op_naive"].iloc[0])
    assert view.partner(op_a) == op_b and view.partner(10_000) is None
    ratio = view.ratio_matrix()
    assert set(ratio.index) <= set(expected.values["op_clean"])
    html = _assert_inline_figure(view._repr_mimebundle_(), "compare-heatmap")
    assert '"name":"loss"' in html and "<b>clean</b> vs <b>naive</b>" in html


# -- ss.show on in-memory statistics --------------------------------------------------------


def test_show_draws_instrument_stats_without_a_run(probe):
    stats, table = probe
    overview = ss.show(stats, table)
    assert overview.hists == {} and overview.figure is None
    assert len(overview.summary) == sum(rec.recorded for rec in table)
    assert "Pass op=" in overview.to_html()
    assert "dynamic_range" in overview.to_html()  # next to the abs-max

    view = ss.show(stats, table, op="dot_general")
    (op,) = view.hists
    assert table[op].primitive == "dot_general"
    np.testing.assert_array_equal(
        view.hists[op].to_numpy(), np.asarray(stats["hist"])[table.rows(op)].sum(axis=0)
    )
    assert list(view.hists[op].index) == list(table.hist_columns)
    row = view.summary.loc[op]
    assert row["rms"] == pytest.approx(float(np.asarray(stats["rms"])[table.rows(op)][0]))
    html = _assert_inline_figure(view._repr_mimebundle_(), "histogram")
    assert '"name":"snr-' in html  # SNR per format next to the histogram


def test_show_selects_ops_by_id_list_and_regex(probe):
    stats, table = probe
    by_id = ss.show(stats, table, op=[0, "fwd/tanh"])
    assert list(by_id.hists) == [0, table.find("tanh")[0].id]
    by_regex = ss.show(stats, table, op=r"^fwd/", max_ops=2)
    assert len(by_regex.hists) == 2 and len(by_regex.summary) > 2
    # an output is an alias: it shows the op holding its statistics
    out = [rec for rec in table if rec.note == "output"][0]
    assert list(ss.show(stats, table, op=out.id).hists) == [out.stats_op]


def test_show_bad_inputs_give_clear_errors(probe):
    stats, table = probe
    with pytest.raises(KeyError, match="no op named or matching 'dot_genral'.*fwd/dot_general"):
        ss.show(stats, table, op="dot_genral")
    with pytest.raises(KeyError, match="no op with id 999"):
        ss.show(stats, table, op=999)
    with pytest.raises(TypeError, match="pass the second element"):
        ss.show((None, stats), table)
    with pytest.raises(TypeError, match="OpTable"):
        ss.show(stats, "table")
    short = {k: np.asarray(v)[:-1] for k, v in stats.items()}
    with pytest.raises(ValueError, match="rows but the op table has"):
        ss.show(short, table)
    with pytest.raises(ValueError, match="max_ops"):
        ss.show(stats, table, op=0, max_ops=0)


# -- BokehJS: once, inline, offline ----------------------------------------------------------


def test_bokehjs_loads_once_per_kernel_inline(monkeypatch):
    import bokeh.io
    import bokeh.io.notebook

    published: list[dict] = []
    monkeypatch.setattr(
        bokeh.io.notebook, "publish_display_data", lambda data, **kw: published.append(data)
    )
    monkeypatch.setattr(nb, "in_notebook", lambda: True)
    monkeypatch.setattr(nb, "_LOADED", False)
    try:
        assert nb.load_notebook() is True
        assert nb.load_notebook() is False  # once per kernel
        (bundle,) = published
        js = bundle["application/vnd.bokehjs_load.v0+json"]
        assert len(js) > 1_000_000  # BokehJS itself, inline
        assert nb.cdn_urls(js) == [] and "cdn.bokeh.org" not in js
        assert nb.load_notebook(force=True) is True and len(published) == 2
    finally:
        bokeh.io.reset_output()


def test_load_notebook_outside_a_kernel_does_nothing(monkeypatch):
    monkeypatch.setattr(nb, "_LOADED", False)
    assert nb.in_notebook() is False and nb.load_notebook() is False


def test_cdn_urls_finds_cdn_hosts_only():
    text = (
        '<script src="https://cdn.bokeh.org/bokeh/release/bokeh-3.9.2.min.js"></script>'
        "https://docs.bokeh.org/en/latest https://unpkg.com/x.js "
        "https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-svg.js"
    )
    assert nb.cdn_urls(text) == [
        "https://cdn.bokeh.org/bokeh/release/bokeh-3.9.2.min.js",
        "https://unpkg.com/x.js",
    ]


def test_the_store_imports_no_view_at_module_level():
    """Layering: scalescope/store reaches analysis, viz and notebook only lazily."""
    for path in (ROOT / "scalescope" / "store").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.ImportFrom):
                module = ("." * node.level) + (node.module or "")
                assert not any(v in module for v in ("analysis", "viz", "notebook")), path
            if isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.startswith(("scalescope.analysis", "scalescope.viz")), (
                        path
                    )
