"""Line charts over steps: one op's metrics (`timeseries`), training loss (`loss_curve`)
and one op's block scales under each recipe (`scale_ranges`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
from bokeh.models import ColumnDataSource, HoverTool, Title
from bokeh.plotting import figure

from . import theme

_TOOLS = "pan,wheel_zoom,box_zoom,reset,save"
_DASHES = ("solid", "dashed", "dotted", "dotdash", "dashdot")


def _note(fig, text: str) -> None:
    """Small italic note under the plot (what was clipped or dropped, and why)."""
    fig.add_layout(Title(text=text, text_font_size="8pt", text_font_style="italic"), "below")


def _series_source(steps: np.ndarray, values: np.ndarray, series: str) -> ColumnDataSource:
    return ColumnDataSource(
        {"step": steps, "value": values, "series": [series] * len(steps)},
        name=f"series-{series}",
    )


def _gaps(steps: np.ndarray, recorded: np.ndarray | None) -> tuple[np.ndarray, float]:
    """Gaps between consecutive points, in recorded steps when ``recorded`` (the run's
    recorded steps) is given, else in step numbers; and their median (1 with < 2 points)."""
    pos = np.searchsorted(recorded, steps).astype(float) if recorded is not None else steps
    gaps = np.diff(pos)
    return gaps, float(np.median(gaps)) if len(gaps) else 1.0


def _break_at(steps: np.ndarray, values: np.ndarray, cut: np.ndarray):
    """Insert a NaN point after each index where ``cut`` holds (a line breaks there)."""
    if not cut.any():
        return steps, values
    at = np.flatnonzero(cut) + 1
    mid = (steps[at - 1] + steps[at]) / 2
    return np.insert(steps, at, mid), np.insert(values, at, np.nan)


def timeseries(
    frame: pd.DataFrame,
    *,
    title: str | None = None,
    log_y: bool = True,
    name: str = "timeseries",
    recorded: Sequence[int] | np.ndarray | None = None,
) -> figure:
    """Metrics of one op over steps (e.g. scale, rms, absmax): a line + markers per column.

    ``frame``: index = the steps the op was measured at, one column per metric. With
    ``log_y`` (default, since scale and RMS span many octaves) values <= 0 cannot be drawn:
    they are dropped (the line breaks there) and a note under the plot says how many.
    Click a legend entry to hide its series.

    An op measured at only some steps (a run under an overhead budget measures ops in
    turns) gets a marker at every measured step and no line across long gaps: the line
    breaks where two measurements are more than twice the op's median gap apart, gaps
    counted in ``recorded`` steps (the run's recorded steps; without them every point is
    joined, as for an op measured at every step). When the op skipped recorded steps, the
    line is dashed (it joins measurements, not values seen in between) and a note says so.
    """
    fig = figure(
        name=name,
        title=title,
        width=700,
        height=320,
        y_axis_type="log" if log_y else "linear",
        tools=_TOOLS,
        toolbar_location="above",
    )
    fig.xaxis.axis_label = "step"
    steps = np.asarray(frame.index, dtype=float)
    rec = None if recorded is None else np.unique(np.asarray(recorded, dtype=float))
    gaps, typical = _gaps(steps, rec)
    cut = (gaps > 2 * typical) if rec is not None else np.zeros(len(gaps), bool)
    sparse = rec is not None and (typical > 1 or cut.any())
    dropped = 0
    for i, column in enumerate(frame.columns):
        values = pd.to_numeric(frame[column], errors="coerce").to_numpy(dtype=float, copy=True)
        if log_y:
            bad = ~(values > 0)  # also NaN, which is dropped anyway
            dropped += int(np.count_nonzero(bad & ~np.isnan(values)))
            values[bad] = np.nan
        color = theme.series_color(i)
        line_steps, line_values = _break_at(steps, values, cut)
        fig.line(
            x=line_steps,
            y=line_values,
            color=color,
            line_width=2,
            line_dash="dashed" if sparse else "solid",
            legend_label=str(column),
            name=f"{name}-line-{column}",
        )
        source = _series_source(steps, values, str(column))
        fig.scatter("step", "value", source=source, color=color, size=5, legend_label=str(column))
    fig.add_tools(
        HoverTool(
            tooltips=[("", "@series"), ("step", "@step{0}"), ("value", "@value{0.[000]e0}")],
            renderers=[
                r
                for r in fig.renderers
                if isinstance(r.data_source, ColumnDataSource) and "series" in r.data_source.data
            ],
        )
    )
    if len(frame.columns):
        fig.legend.click_policy = "hide"
        fig.legend.location = "top_left"
    if dropped:
        _note(fig, f"{dropped} value(s) <= 0 not drawn on the log axis")
    if sparse:
        text = f"measured at {len(steps)} of {len(rec)} recorded steps (markers)"
        text += "; dashed: joins measurements across unmeasured steps"
        if cut.any():
            text += f"; broken over gaps > {2 * typical:g} steps"
        _note(fig, text)
    return fig


def _as_runs(runs: dict[str, pd.DataFrame] | pd.DataFrame) -> dict[str, pd.DataFrame]:
    return {"run": runs} if isinstance(runs, pd.DataFrame) else dict(runs)


def _first_nonfinite(series: pd.Series):
    """Step at which a logged scalar first became NaN or inf, or None.

    Scalars frames use NaN both for "not logged at this step" (``val_loss`` every K steps)
    and for a NaN loss, so a NaN counts only when the column never becomes finite again
    (a diverged run); ``inf`` always counts.
    """
    values = pd.to_numeric(series, errors="coerce").to_numpy(dtype=float)
    bad = np.isinf(values)
    nan = np.isnan(values)
    if nan.any():
        first = int(np.argmax(nan))
        bad[first] |= not np.isfinite(values[first:]).any()
    hits = np.flatnonzero(bad)
    return series.index[hits[0]] if hits.size else None


def loss_curve(
    runs: dict[str, pd.DataFrame] | pd.DataFrame,
    *,
    columns: Sequence[str] = ("loss", "val_loss"),
    log_y: bool = False,
    name: str = "loss",
    incidents: Mapping[str, pd.DataFrame] | None = None,
) -> figure:
    """Training curves of one or more runs: one colour per run, one dash style per column.

    ``incidents``: run name -> the flight recorder's incidents (`RunReader.incidents`),
    each marked with a red triangle at its step (hover: trigger, op, source).

    ``runs``: run name -> scalars frame indexed by step (columns ``loss``, ``val_loss``,
    ...), or one frame. The first of ``columns`` is solid, the next dashed (``val_loss``),
    and so on; absent columns are skipped. The first step at which a column becomes NaN or
    inf is marked with a red x drawn at the top of the finite y range (a NaN has no
    height), so a diverged run is visible at a glance.
    """
    runs = _as_runs(runs)
    fig = figure(
        name=name,
        title="loss",
        width=700,
        height=320,
        y_axis_type="log" if log_y else "linear",
        tools=_TOOLS,
        toolbar_location="above",
    )
    fig.xaxis.axis_label = "step"
    marks: dict[str, list] = {"step": [], "run": [], "column": []}
    tops = []
    for i, (run, frame) in enumerate(runs.items()):
        color = theme.series_color(i)
        frame = frame.sort_index()
        for j, column in enumerate(c for c in columns if c in frame.columns):
            values = pd.to_numeric(frame[column], errors="coerce").to_numpy(dtype=float)
            # Only finite points are drawn, joined across steps where the column was not
            # logged (val_loss every K steps) -- a NaN/inf gets the red x instead.
            keep = np.isfinite(values) & ((values > 0) if log_y else True)
            tops.append(values[keep].max() if keep.any() else np.nan)
            label = f"{run} {column}" if len(runs) > 1 else str(column)
            fig.line(
                x=np.asarray(frame.index, dtype=float)[keep],
                y=values[keep],
                color=color,
                line_width=2,
                line_dash=_DASHES[j % len(_DASHES)],
                legend_label=label,
            )
            step = _first_nonfinite(frame[column])
            if step is not None:
                marks["step"].append(step)
                marks["run"].append(run)
                marks["column"].append(column)
    _mark_nonfinite(fig, marks, tops)
    _mark_incidents(fig, incidents or {}, tops)
    if fig.renderers:
        fig.legend.click_policy = "hide"
        fig.legend.location = "top_right"
    else:  # said in the plot (an empty figure is also one Bokeh warns about)
        first = columns[0] if columns else "loss"
        fig.text(
            x=[0],
            y=[1 if log_y else 0],
            text=[f"no {' or '.join(columns) or 'loss'} logged (run.log(step, {first}=...))"],
            text_align="center",
            text_baseline="middle",
            text_color="#777777",
            name="no-loss",
        )
    return fig


def _mark_nonfinite(fig, marks: dict[str, list], tops: list[float]) -> None:
    """Red x at the top of the finite y range for each run/column's first non-finite step."""
    if not marks["step"]:
        return
    _marks_at_top(
        fig,
        marks,
        tops,
        name="nonfinite",
        legend="non-finite",
        marker="x",
        tooltips=[("run", "@run"), ("", "@column became NaN/inf"), ("step", "@step")],
        note="red x: first step where a value became NaN/inf (drawn at the top)",
        line_width=3,
    )


def _mark_incidents(fig, incidents: Mapping[str, pd.DataFrame], tops: list[float]) -> None:
    """Red triangle at the top of the finite y range at each incident's step."""
    rows = [(run, r) for run, frame in incidents.items() for r in frame.to_dict("records")]
    if not rows:
        return
    columns = {
        "step": [int(r["step"]) for _, r in rows],
        "run": [run for run, _ in rows],
        "trigger": [str(r["trigger"]) for _, r in rows],
        "op": [str(r.get("label") or r.get("name") or "-") for _, r in rows],
        "source": [str(r.get("source") or "") for _, r in rows],
    }
    _marks_at_top(
        fig,
        columns,
        tops,
        name="incidents",
        legend="incident",
        marker="inverted_triangle",
        tooltips=[
            ("incident", "@trigger at step @step"),
            ("op", "@op"),
            ("source", "@source"),
            ("run", "@run"),
        ],
        note="red triangle: an incident (the step was replayed; see the incidents table)",
    )


def _marks_at_top(
    fig,
    columns: dict[str, list],
    tops: list[float],
    *,
    name: str,
    legend: str,
    marker: str,
    tooltips: list[tuple[str, str]],
    note: str,
    **style: Any,
) -> None:
    """Alarm-coloured markers at ``columns["step"]``, drawn at the top of the finite y
    range (a NaN has no height), with a hover and a note under the figure."""
    finite_tops = [t for t in tops if np.isfinite(t)]
    top = max(finite_tops) if finite_tops else 1.0
    source = ColumnDataSource({**columns, "y": [top] * len(columns["step"])}, name=f"{name}-source")
    renderer = fig.scatter(
        "step",
        "y",
        source=source,
        marker=marker,
        size=14,
        color=theme.ALARM_COLOR,
        legend_label=legend,
        name=name,
        **style,
    )
    fig.add_tools(HoverTool(renderers=[renderer], tooltips=tooltips))
    _note(fig, note)


def _element_log2(info: Any) -> tuple[float, float]:
    """``(log2 smallest subnormal, log2 max)`` of an element format (a `Format` or a
    dict with ``min_subnormal`` and ``max``): the exponents one block can hold."""
    get = info.get if isinstance(info, Mapping) else lambda k: getattr(info, k)
    return float(np.log2(get("min_subnormal"))), float(np.log2(get("max")))


def scale_ranges(
    scales: pd.DataFrame,
    elements: Mapping[str, Any],
    *,
    absmax: pd.Series | None = None,
    title: str | None = None,
    name: str = "scale-ranges",
) -> figure:
    """Block scales of one op's recipes over steps, against their element formats'
    exponent ranges, on a ``log2 |x|`` axis (data units).

    ``scales``: index = step, columns ``scale_log2_min_<R>`` / ``scale_log2_max_<R>``
    (the smallest and largest ``log2 X`` over the op's blocks, as recorded) for each
    recipe R of ``elements`` (recipe -> its element format: a `scalescope.Format` or a
    dict with ``min_subnormal`` and ``max``); recipes without both columns are skipped.

    Per recipe, one colour: dotted lines at the smallest and largest block scale, and a
    shaded band from ``min log2 X + log2 min_subnormal`` (dashed) to ``max log2 X + log2
    max`` (solid): a block holds ``|x|`` in ``X * [min_subnormal, max]``, the element's
    exponent range shifted by its scale, so the band is what the recipe represents across
    the op. ``absmax``: the op's abs-max per step, drawn as a black line (``log2``): the
    band's top sits at or just above it (the scale follows the abs-max); an element
    format's narrow range (E2M1: 3.6 binades) shows as a band whose bottom climbs above
    the values of a block with a large spread (they flush). NaN (no block has a scale)
    breaks the lines. Click a legend entry to hide it.
    """
    fig = figure(
        name=name,
        title=title or "block scales vs element exponent range",
        width=900,
        height=320,
        tools=_TOOLS,
        toolbar_location="above",
    )
    fig.xaxis.axis_label = "step"
    fig.yaxis.axis_label = "log2 |x|"
    steps = np.asarray(scales.index, dtype=float)
    drawn = 0
    for recipe, info in elements.items():
        lo_col, hi_col = f"scale_log2_min_{recipe}", f"scale_log2_max_{recipe}"
        if lo_col not in scales.columns or hi_col not in scales.columns:
            continue
        color = theme.series_color(drawn)
        drawn += 1
        lo = pd.to_numeric(scales[lo_col], errors="coerce").to_numpy(dtype=float)
        hi = pd.to_numeric(scales[hi_col], errors="coerce").to_numpy(dtype=float)
        e_lo, e_hi = _element_log2(info)
        source = ColumnDataSource(
            {
                "step": steps,
                "scale_min": lo,
                "scale_max": hi,
                "bottom": lo + e_lo,
                "top": hi + e_hi,
                "recipe": [str(recipe)] * len(steps),
            },
            name=f"{name}-{recipe}",
        )
        label = f"{recipe}: |x| range"
        fig.varea(
            "step", "bottom", "top", source=source, color=color, alpha=0.12, legend_label=label
        )
        fig.line("step", "top", source=source, color=color, line_width=2, legend_label=label)
        fig.line(
            "step", "bottom", source=source, color=color, line_dash="dashed", legend_label=label
        )
        scale_label = f"{recipe}: block scales"
        for col in ("scale_min", "scale_max"):
            fig.line(
                "step",
                col,
                source=source,
                color=color,
                line_dash="dotted",
                line_width=1.5,
                legend_label=scale_label,
            )
            fig.scatter("step", col, source=source, color=color, size=4, legend_label=scale_label)
    if absmax is not None and len(absmax):
        with np.errstate(divide="ignore", invalid="ignore"):
            top = np.log2(pd.to_numeric(absmax, errors="coerce").to_numpy(dtype=float))
        top[~np.isfinite(top)] = np.nan
        fig.line(
            x=np.asarray(absmax.index, dtype=float),
            y=top,
            color="black",
            line_width=1.5,
            legend_label="log2 abs-max",
            name=f"{name}-absmax",
        )
    fig.add_tools(
        HoverTool(
            tooltips=[
                ("recipe", "@recipe"),
                ("step", "@step{0}"),
                ("log2 X", "@scale_min{0.0} .. @scale_max{0.0}"),
                ("|x| range", "2^@bottom{0.0} .. 2^@top{0.0}"),
            ],
            renderers=[
                r
                for r in fig.renderers
                if isinstance(r.data_source, ColumnDataSource) and "recipe" in r.data_source.data
            ],
        )
    )
    if fig.renderers:  # beside the plot: a band reaches every corner
        fig.legend.click_policy = "hide"
        fig.add_layout(fig.legend[0], "right")
    if not drawn:
        _note(fig, "no block-scaled recipe recorded for this op")
    return fig
