"""Ops measured at some recorded steps only (a run under an overhead budget) and runs with
estimated statistics: the reader says when each op was last measured and whether the
statistics are exact; heatmap matrices leave unmeasured cells blank (dense and merged
paths, nothing filled from neighbours); the heatmap figure draws them blank and measured
NaN cells grey; line plots of a sparsely measured op keep a marker per measurement and
break across long gaps."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from bokeh.models import GlyphRenderer, HoverTool, Image, Quad
from conftest import node_binary

import scalescope as ss
from scalescope import analysis as A
from scalescope import viz
from scalescope.store import layout as L

N_OPS, N_STEPS, PERIOD = 5, 9, 3
STAT_NAMES = ["rms", "absmax", "overflow_e4m3", "snr_e4m3"]


def _op_records(n_ops: int) -> list[dict]:
    records = []
    for i in range(n_ops):
        alias = i == n_ops - 1  # the last op aliases op 1 (a reshape of it, say)
        records.append(
            {
                "op": i,
                "name": f"block/op{i}",
                "pass": "fwd",
                "primitive": "reshape" if alias else "mul",
                "shape": [4, 4],
                "dtype": "float32",
                "scaled": True,
                "note": "alias" if alias else "",
                "stats_op": 1 if alias else i,
                "row_start": i,
                "n_rows": 1,
                "loop": [],
                "in_while": False,
                "in_cond": False,
                "source": f"model.py:{i}",
            }
        )
    return records


def _value(op: np.ndarray, step: np.ndarray) -> np.ndarray:
    return (100.0 * op + step + 1).astype(np.float32)


def write_run(
    path: Path,
    *,
    keep=None,
    meta: dict | None = None,
    steps_per_part: int = 3,
    group: bool = False,
) -> Path:
    """A small run directory: ops 0..3 with statistics (op 4 aliases op 1), steps
    0..N_STEPS-1, ``rms = 100 * op + step + 1``; ``keep(op, step)`` says which rows are
    written (default: all)."""
    path.mkdir(parents=True)
    info = {
        "format": L.FORMAT_NAME,
        "version": L.FORMAT_VERSION,
        "name": path.name,
        "status": "closed",
        "every": 1,
        "formats": ["e4m3"],
        "stat_names": STAT_NAMES,
        "hist_columns": [],
        "sample": None,
        "graph": {"scalify": True},
    }
    info.update(meta or {})
    L.write_json_atomic(path / L.RUN_FILE, info)
    ops = L.ops_frame(_op_records(N_OPS))
    if group:
        ops["group"] = np.where(ops["stats_op"] >= 0, ops.index % 2, -1).astype(np.int64)
    L.write_parquet_atomic(path / L.OPS_FILE, L.ops_table(ops))
    n_stats = N_OPS - 1
    for seq, first in enumerate(range(0, N_STEPS, steps_per_part)):
        steps = np.arange(first, min(first + steps_per_part, N_STEPS))
        op = np.tile(np.arange(n_stats), len(steps))
        step = np.repeat(steps, n_stats)
        mask = np.ones(len(op), bool) if keep is None else np.asarray(keep(op, step), bool)
        op, step = op[mask], step[mask]
        rms = _value(op, step)
        cols = {
            "step": step.astype(np.int64),
            "op": op.astype(np.int32),
            "iteration": np.zeros(len(op), np.int32),
            "process": np.zeros(len(op), np.int32),
            "rms": rms,
            "absmax": rms * 2,
            "overflow_e4m3": (rms / 1000).astype(np.float32),
            "snr_e4m3": (40 - rms / 100).astype(np.float32),
        }
        L.write_parquet_atomic(path / L.STATS_DIR / L.part_name(seq, 0), pa.table(cols))
    return path


def rotating(op, step):
    """Each op measured every PERIOD-th step, in turns; op 3 never measured."""
    op, step = np.asarray(op), np.asarray(step)
    return ((op + step) % PERIOD == 0) & (op != 3)


# ---------------------------------------------------------------------------------------
# reader


def test_reader_says_when_each_op_was_last_measured(tmp_path):
    reader = ss.open_run(write_run(tmp_path / "budget", keep=rotating, group=True))
    assert "group" in reader.ops.columns  # the new op-table column is tolerated
    measured = reader.measured()
    assert measured.index.tolist() == list(range(N_OPS))
    assert list(measured.columns) == ["first_measured", "last_measured", "n_measured", "gap"]
    for op in range(3):
        steps = [s for s in range(N_STEPS) if (op + s) % PERIOD == 0]
        row = measured.loc[op]
        assert (row["first_measured"], row["last_measured"]) == (steps[0], steps[-1]), op
        assert row["n_measured"] == len(steps) and row["gap"] == PERIOD
    # never measured: NaN, 0 steps; an alias reports the op it aliases
    assert np.isnan(measured.loc[3, "last_measured"]) and measured.loc[3, "n_measured"] == 0
    assert measured.loc[4].equals(measured.loc[1].rename(4))
    last = reader.last_measured()
    assert isinstance(last, pd.Series) and last.loc[0] == 6 and last.loc[1] == 8
    assert np.isnan(last.loc[3])
    assert reader.measurement_period() == PERIOD
    # the stats rows are exactly the measured ones: no (op, step) row is made up
    wide = reader.stats(wide=True)
    assert len(wide) == int(rotating(*np.divmod(np.arange(4 * N_STEPS), N_STEPS)).sum())


def test_full_run_is_measured_everywhere_and_caches_follow_refresh(tmp_path):
    path = write_run(tmp_path / "full", steps_per_part=N_STEPS)
    reader = ss.open_run(path)
    measured = reader.measured()
    assert (measured.loc[:3, "n_measured"] == N_STEPS).all()
    assert (measured.loc[:3, "gap"] == 1).all() and reader.measurement_period() == 1.0
    assert measured is reader.measured()  # cached
    # a new part (steps 9 and 10, op 0 only) is picked up by refresh
    cols = {
        "step": np.array([9, 10], np.int64),
        "op": np.array([0, 0], np.int32),
        "iteration": np.zeros(2, np.int32),
        "process": np.zeros(2, np.int32),
    } | {name: np.ones(2, np.float32) for name in STAT_NAMES}
    L.write_parquet_atomic(path / L.STATS_DIR / L.part_name(5, 0), pa.table(cols))
    assert reader.refresh() == 1
    last = reader.last_measured()
    assert last.loc[0] == 10 and last.loc[1] == N_STEPS - 1
    assert reader.measured().loc[0, "n_measured"] == N_STEPS + 2


def test_empty_run_has_no_measurement(tmp_path):
    path = tmp_path / "empty"
    write_run(path, keep=lambda op, step: np.zeros(len(op), bool))
    reader = ss.open_run(path)
    assert reader.last_measured().isna().all() and reader.measurement_period() is None


@pytest.mark.parametrize(
    "meta, statistics, budget, sample",
    [
        ({}, "exact", None, None),  # an old run: no keys
        ({"sample": 4096}, "sampled", None, 4096),  # an old run recorded with sample=
        ({"statistics": "exact", "budget": None}, "exact", None, None),
        ({"statistics": "sampled", "sample": 256, "budget": 0.05}, "sampled", 0.05, 256),
        ({"statistics": "exact", "budget": 0.1}, "exact", 0.1, None),
    ],
)
def test_reader_statistics_and_budget_from_metadata(tmp_path, meta, statistics, budget, sample):
    reader = ss.open_run(write_run(tmp_path / "r", meta=meta))
    assert reader.statistics == statistics
    assert reader.budget == budget and reader.sample == sample
    notes = A.measurement_notes(reader)
    assert any("sampled statistics" in n for n in notes) == (statistics == "sampled")
    assert any("rotating subset" in n for n in notes) == (budget is not None)
    if sample:
        assert f"at most {sample:,} elements per value" in notes[0]


def test_notes_text():
    assert A.sampled_note("exact", 256) == ""
    assert A.sampled_note("sampled", 1024) == (
        "sampled statistics: estimates from at most 1,024 elements per value"
    )
    assert "subset of the elements" in A.sampled_note("sampled", None)
    assert A.budget_note(None, 3.0) == ""
    assert A.budget_note(0.05, 20.0) == (
        "rotating subset (budget 5%): ops measured every ~20 recorded steps"
    )
    assert "every recorded step" in A.budget_note(0.5, 1.0)
    assert "too few steps" in A.budget_note(0.01, None)


# ---------------------------------------------------------------------------------------
# matrices: blank, never interpolated


def _frame(keep, n_ops: int = 4, n_steps: int = 9, op_stride: int = 1) -> pd.DataFrame:
    op = np.tile(np.arange(n_ops), n_steps)
    step = np.repeat(np.arange(n_steps), n_ops)
    mask = np.asarray(keep(op, step), bool)
    op, step = op[mask], step[mask]
    rms = _value(op, step).astype(np.float64)
    return pd.DataFrame(
        {
            "step": step,
            "op": op * op_stride,
            "iteration": 0,
            "rms": rms,
            "overflow_e4m3": rms / 1000,
            "snr_e4m3": 40 - rms / 100,
        }
    )


def _take_path(path: str, monkeypatch) -> int:
    """Make `matrix` take its dense NumPy path or its groupby path (the one it takes
    when the op x step grid is much larger than the frame, as under a small budget);
    the op-id stride to use (the groupby path also gets ids far apart)."""
    from scalescope.analysis import frames

    dense = frames._dense_matrix

    def only(*args, **kwargs):
        if path == "groupby":
            return None
        out = dense(*args, **kwargs)
        assert out is not None  # the dense path did build the matrix
        return out

    monkeypatch.setattr(frames, "_dense_matrix", only)
    return 1 if path == "dense" else 400_000


@pytest.mark.parametrize("path", ["dense", "groupby"])
def test_matrix_leaves_unmeasured_cells_blank(path, monkeypatch):
    """Every cell with no row is NaN; every other holds its own row's value."""
    stride = _take_path(path, monkeypatch)
    stats = _frame(rotating, op_stride=stride)
    mat = A.matrix(stats, "rms")
    measured = A.measured_matrix(stats)
    assert mat.index.equals(measured.index) and mat.columns.equals(measured.columns)
    assert mat.columns.tolist() == list(range(N_STEPS))
    for op in range(3):
        for step in range(N_STEPS):
            value = mat.loc[op * stride, step]
            if rotating(op, step):
                assert value == _value(np.array(op), np.array(step)), (op, step)
                assert measured.loc[op * stride, step]
            else:
                assert np.isnan(value), (op, step, value)  # not a neighbour's value
                assert not measured.loc[op * stride, step]
    assert 3 * stride not in mat.index  # an op never measured has no row


@pytest.mark.parametrize("path", ["dense", "groupby"])
@pytest.mark.parametrize(
    "metric, worst",
    [("rms", "mean"), ("overflow_e4m3", "max"), ("snr_e4m3", "min"), ("log2_rms", "abs")],
)
def test_merged_windows_aggregate_measured_steps_only(path, metric, worst, monkeypatch):
    """Windows of 3 steps: a window without a row of the op is NaN; one with rows keeps
    the worst (or mean) of those rows, not of a filled-in grid."""
    stride = _take_path(path, monkeypatch)

    def keep(op, step):
        # op 0: steps 0, 4 (windows 0 and 3); op 1: steps 1, 2, 8; op 2: every step
        return np.where(
            op == 0,
            np.isin(step, [0, 4]),
            np.where(op == 1, np.isin(step, [1, 2, 8]), op == 2),
        )

    stats = _frame(keep, n_ops=3, op_stride=stride)
    mat = A.matrix(stats, metric, max_steps=3)
    measured = A.measured_matrix(stats, max_steps=3)
    assert mat.columns.tolist() == [0, 3, 6] == measured.columns.tolist()
    values = A.metric_values(stats, metric)
    agg = {"mean": np.mean, "max": np.max, "min": np.min}
    window = stats["step"] // 3 * 3
    for op in range(3):
        for first in (0, 3, 6):
            rows = values[(stats["op"] == op * stride) & (window == first)].to_numpy()
            got = mat.loc[op * stride, first]
            if not len(rows):
                assert np.isnan(got) and not measured.loc[op * stride, first], (op, first)
                continue
            want = rows[np.argmax(np.abs(rows))] if worst == "abs" else agg[worst](rows)
            assert got == pytest.approx(want), (op, first)
            assert measured.loc[op * stride, first]


def test_measured_matrix_follows_the_op_filter_and_checks_arguments():
    stats = _frame(rotating)
    sub = A.measured_matrix(stats, ops=[1, 2])
    assert sub.index.tolist() == [1, 2]
    assert sub.equals(A.measured_matrix(stats).loc[[1, 2], sub.columns])
    empty = A.measured_matrix(stats, ops=[99])
    assert empty.shape == (0, 0)
    with pytest.raises(ValueError):
        A.measured_matrix(stats, max_steps=0)


def test_matrix_of_a_budget_run_matches_its_rows(tmp_path):
    reader = ss.open_run(write_run(tmp_path / "budget", keep=rotating))
    mat = A.matrix_run(reader, "rms")
    wide = reader.stats(["rms"], wide=True)
    ref = wide.pivot(index="op", columns="step", values="rms")
    np.testing.assert_array_equal(mat.to_numpy(), ref.reindex_like(mat).to_numpy(np.float64))
    assert np.isnan(mat.to_numpy()).sum() == mat.size - len(wide)


# ---------------------------------------------------------------------------------------
# the heatmap figure


def _renderers(fig, glyph) -> list[GlyphRenderer]:
    return [r for r in fig.renderers if isinstance(r.glyph, glyph)]


def test_heatmap_draws_unmeasured_blank_and_measured_nan_grey():
    stats = _frame(rotating)
    mat = A.matrix(stats, "rms")
    mat.loc[0, 0] = np.nan  # a measured cell whose statistic is NaN (non-finite data)
    measured = A.measured_matrix(stats)
    fig = viz.heatmap(mat, metric="rms", measured=measured)
    images = _renderers(fig, Image)
    assert [r.name for r in images] == ["heatmap-image", "heatmap-nan"]
    value, nan = images
    assert value.glyph.color_mapper.nan_color == viz.theme.BLANK_COLOR  # transparent
    cells = np.asarray(nan.data_source.data["image"][0])
    assert cells.dtype == np.uint8 and cells.shape == mat.shape
    assert cells.sum() == 1 and cells[0, 0] == 1  # only the measured NaN is grey
    assert nan.glyph.color_mapper.palette[1] == viz.theme.NAN_COLOR
    # the hatched quad behind shows through the blank cells
    (blank,) = _renderers(fig, Quad)
    assert blank.name == "heatmap-blank" and blank.glyph.hatch_pattern
    assert fig.renderers.index(blank) < fig.renderers.index(value)
    assert any("not measured" in getattr(t, "text", "") for t in fig.below)
    # hover reads the value image only, and tells the two kinds of NaN apart
    (hover,) = [t for t in fig.tools if isinstance(t, HoverTool)]
    assert hover.renderers == [value]
    args = hover.formatters["@image"].args
    assert args["measured"] is True and args["nan"] is nan.data_source
    assert args["n_cols"] == mat.shape[1]


def test_heatmap_without_measured_nan_has_no_grey_image_and_updates_in_place():
    stats = _frame(rotating)
    mat, measured = A.matrix(stats, "rms"), A.measured_matrix(stats)
    fig = viz.heatmap(mat, metric="rms", measured=measured)
    assert [r.name for r in _renderers(fig, Image)] == ["heatmap-image"]
    other = A.matrix(stats, "snr_e4m3")
    assert viz.update_heatmap(fig, other, metric="snr_e4m3", measured=measured)
    assert not viz.update_heatmap(fig, other, metric="snr_e4m3")  # built with measured
    with_nan = other.copy()
    with_nan.iloc[0, 0] = np.nan
    # measured NaN cells need the grey image the figure lacks: rebuild
    assert not viz.update_heatmap(fig, with_nan, metric="snr_e4m3", measured=measured)
    grey = viz.heatmap(with_nan, metric="snr_e4m3", measured=measured)
    assert viz.update_heatmap(grey, other, metric="snr_e4m3", measured=measured)
    cells = np.asarray(_renderers(grey, Image)[1].data_source.data["image"][0])
    assert cells.sum() == 0
    # a fully measured matrix: no hatch, nothing blank
    full = _frame(lambda op, step: np.ones(len(op), bool))
    fig = viz.heatmap(A.matrix(full, "rms"), metric="rms", measured=A.measured_matrix(full))
    assert not _renderers(fig, Quad)
    assert not any("not measured" in getattr(t, "text", "") for t in fig.below)
    with pytest.raises(ValueError, match="shape"):
        viz.heatmap(mat, metric="rms", measured=np.ones((1, 1), bool))


def test_heatmap_hover_says_not_measured_or_nan():
    """Run the value formatter in node, as BokehJS compiles it."""
    node = node_binary()
    stats = _frame(rotating)
    mat = A.matrix(stats, "rms")
    mat.loc[0, 0] = np.nan
    fig = viz.heatmap(mat, metric="rms", measured=A.measured_matrix(stats))
    hover = next(t for t in fig.tools if isinstance(t, HoverTool))
    fmt = hover.formatters["@image"]
    cells = np.asarray(fmt.args["nan"].data["image"][0]).ravel().tolist()
    names = ["measured", "nan", "n_cols", "value", "format", "special_vars"]
    body = f"(new Function({json.dumps(names)[1:-1]}, {json.dumps(fmt.code)}))"
    nan = json.dumps({"data": {"image": [cells]}})

    def call(value, x, y):
        special = json.dumps({"x": x, "y": y})
        return f'{body}(true, {nan}, {mat.shape[1]}, {value}, "value", {special})'

    exprs = [call("NaN", 0.1, -0.2), call("NaN", 1.0, 0.0), call("2.5", 1.0, 0.0)]
    script = f"console.log(JSON.stringify([{', '.join(exprs)}]))"
    out = subprocess.run([node, "-e", script], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == ["NaN (non-finite data)", "not measured", "2.5"]


# ---------------------------------------------------------------------------------------
# line plots over steps


def _line_xy(fig, column: str) -> tuple[np.ndarray, np.ndarray]:
    (line,) = [r for r in fig.renderers if r.name == f"timeseries-line-{column}"]
    return np.asarray(line.data_source.data["x"]), np.asarray(line.data_source.data["y"])


def test_timeseries_of_a_sparse_op_marks_each_measurement_and_breaks_long_gaps():
    recorded = np.arange(0, 40)
    measured = [0, 3, 6, 9, 30, 33]  # every 3rd step, then a gap of 21
    frame = pd.DataFrame({"rms": np.arange(1.0, 7.0)}, index=measured)
    fig = viz.timeseries(frame, recorded=recorded)
    markers = next(r for r in fig.renderers if r.data_source.name == "series-rms")
    assert list(markers.data_source.data["step"]) == measured  # one marker per measurement
    x, y = _line_xy(fig, "rms")
    assert len(x) == len(measured) + 1 and np.isnan(y[4]) and 9 < x[4] < 30  # one break
    line = next(r for r in fig.renderers if r.name == "timeseries-line-rms")
    assert line.glyph.line_dash == [6]  # dashed: it joins measurements, not seen values
    note = " ".join(getattr(t, "text", "") for t in fig.below)
    assert "measured at 6 of 40 recorded steps" in note and "gaps > 6" in note
    # an op measured at every recorded step: one solid, unbroken line, no note
    full = pd.DataFrame({"rms": np.ones(5)}, index=range(5))
    fig = viz.timeseries(full, recorded=range(5))
    x, y = _line_xy(fig, "rms")
    assert not np.isnan(y).any()
    line = next(r for r in fig.renderers if r.name == "timeseries-line-rms")
    assert line.glyph.line_dash == []
    assert not [t for t in fig.below if "measured" in getattr(t, "text", "")]


def test_unrecorded_calls_are_said_by_function():
    """The note beside a verdict names the tracked functions whose calls ran unrecorded:
    one by name, several with their counts, none (a run written before it kept them) by
    the count alone."""
    from scalescope.analysis.measured import unrecorded_note, unrecorded_text

    one = {"count": 3, "first_step": 0, "functions": {"eval_step": 3}}
    two = {"count": 5, "first_step": 2, "functions": {"train_step": 3, "eval_step": 2}}
    old = {"count": 2, "first_step": 1}
    assert unrecorded_text(one) == (
        "3 calls of eval_step from step 0 traced another graph and ran unrecorded"
    )
    assert unrecorded_text(two).startswith("5 calls (train_step: 3, eval_step: 2) from step 2")
    assert unrecorded_text(old) == "2 calls from step 1 traced another graph and ran unrecorded"
    assert unrecorded_note(one).startswith(
        "3 calls of eval_step (the first at step 0) traced another graph than the run's"
    )
    assert unrecorded_text(None) == unrecorded_note({"count": 0}) == ""
