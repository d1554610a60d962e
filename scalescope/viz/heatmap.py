"""Op x step heatmap of one metric, drawn as a single Bokeh ``image``.

Coordinates (what a hover or a ``Tap`` event sees)
-------------------------------------------------
The image is placed so that matrix cell ``(row r, column c)`` is the unit square centred
on ``(x=c, y=r)``: column ``c`` spans ``[c - 0.5, c + 0.5)`` on the x axis and row ``r``
spans ``[r - 0.5, r + 0.5)`` on the y axis (the y range is reversed, so row 0, the first
op, is at the top). ``x`` is therefore a *column index*, not a step: steps may be
unevenly spaced, so the x axis only *labels* the integer ticks with the real step
numbers. `heatmap_cell` turns a data-space ``(x, y)`` (from ``bokeh.events.Tap``:
``event.x``, ``event.y``) back into ``(op id, step)``, using the op ids and steps stored
in ``fig.tags`` -- no round trip to the browser is needed.

Hover uses the same mapping in the browser: ``CustomJSHover`` formatters round ``$x`` /
``$y`` to the nearest integer and look the step / op label up in arrays passed as
``args``; the value comes from ``@image`` (Bokeh resolves it through the image index).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
from bokeh.models import (
    BasicTicker,
    ColorBar,
    CustomJSHover,
    CustomJSTickFormatter,
    FixedTicker,
    HoverTool,
    Label,
    LinearColorMapper,
    Range1d,
    TapTool,
)
from bokeh.plotting import figure

from . import theme

#: Key of the dict stored in ``fig.tags`` that `heatmap_cell` reads.
TAG = "scalescope.heatmap"

#: Op labels are written on the y axis only when there are fewer rows than this.
MAX_LABELLED_ROWS = 60

_PAN_ZOOM_TOOLS = "pan,wheel_zoom,box_zoom,reset,save"

# Round a data coordinate to the row/column index whose unit square contains it.
_JS_INDEX = "const i = Math.floor(value + 0.5);"

_JS_STEP = _JS_INDEX + "return (i >= 0 && i < steps.length) ? String(steps[i]) : '';"

_JS_OP = (
    _JS_INDEX
    + "if (!(i >= 0 && i < ops.length)) return '';"
    + "return format == 'id' ? String(ops[i]) : labels[i];"
)

_JS_VALUE = """
if (value == null || Number.isNaN(value)) return 'no data';
if (!Number.isFinite(value)) return value > 0 ? 'inf' : '-inf';
const a = Math.abs(value);
return (a != 0 && (a < 1e-3 || a >= 1e5)) ? value.toExponential(3) : String(+value.toPrecision(4));
"""

_JS_TICK = (
    "const i = Math.round(tick);"
    "return (Math.abs(tick - i) < 1e-6 && i >= 0 && i < steps.length) ? String(steps[i]) : '';"
)


def color_range(metric: str, values: np.ndarray) -> tuple[float, float]:
    """Default colour range of ``metric`` for these values (see `theme.metric_family`).

    Fractions: ``0 .. max`` of the finite data (at most 1; 1 when all are 0 or missing),
    so a 0.5 % underflow is still visible. SNR (dB): finite min .. max (``inf``, an exact
    cast, takes the top colour). ``log2_*``: ``-8 .. 8``, centred on 0 so that drift up
    and down read symmetrically. Other metrics: finite min .. max.
    """
    family = theme.metric_family(metric)
    if family == "log2":
        return -theme.LOG2_HALF_RANGE, theme.LOG2_HALF_RANGE
    finite = np.asarray(values, dtype=float)
    finite = finite[np.isfinite(finite)]
    if family == "fraction":
        top = float(finite.max()) if finite.size else 0.0
        return 0.0, min(top, 1.0) if top > 0 else 1.0
    if not finite.size:
        return (0.0, 100.0) if family == "snr" else (0.0, 1.0)
    low, high = float(finite.min()), float(finite.max())
    if low == high:
        pad = abs(low) * 0.05 or 1.0
        low, high = low - pad, high + pad
    return low, high


def _op_labels(ops: Sequence[int], labels: pd.Series | None) -> list[str]:
    """One readable label per op id: ``labels[op]`` where given, else ``"op <id>"``."""
    names = {} if labels is None else labels.to_dict()
    return [str(names[op]) if op in names and pd.notna(names[op]) else f"op {op}" for op in ops]


def _figure_height(n_rows: int) -> int:
    """Tall enough for one readable label per row when rows are labelled."""
    if n_rows < MAX_LABELLED_ROWS:
        return max(260, 90 + 16 * n_rows)
    return 640


def _hover(metric: str, ops: list[int], steps: list[int], labels: list[str]) -> HoverTool:
    """Tooltip with op label, op id, step and value, resolved per pixel in the browser."""
    op_fmt = CustomJSHover(args={"ops": ops, "labels": labels}, code=_JS_OP)
    step_fmt = CustomJSHover(args={"steps": steps}, code=_JS_STEP)
    value_fmt = CustomJSHover(code=_JS_VALUE)
    return HoverTool(
        tooltips=[
            ("op", "$y{label}"),
            ("op id", "$y{id}"),
            ("step", "$x{step}"),
            (metric, "@image{value}"),
        ],
        formatters={"$y": op_fmt, "$x": step_fmt, "@image": value_fmt},
        name="heatmap-hover",
    )


def _label_axes(fig, steps: list[int], labels: list[str]) -> None:
    """Real step numbers on the x axis; op labels on the y axis when there are few rows."""
    fig.xaxis.ticker = BasicTicker(min_interval=1, desired_num_ticks=10)
    fig.xaxis.formatter = CustomJSTickFormatter(args={"steps": steps}, code=_JS_TICK)
    fig.xaxis.axis_label = "step"
    n = len(labels)
    if n < MAX_LABELLED_ROWS:
        fig.yaxis.ticker = FixedTicker(ticks=list(range(n)))
        fig.yaxis.major_label_overrides = {i: label for i, label in enumerate(labels)}
        fig.yaxis.major_label_text_font_size = "8pt"
    else:
        fig.yaxis.ticker = FixedTicker(ticks=[])
        fig.yaxis.major_label_text_font_size = "0pt"
        fig.yaxis.axis_label = f"op ({n} rows; hover for names)"


def heatmap(
    matrix: pd.DataFrame,
    *,
    metric: str,
    labels: pd.Series | None = None,
    palette: Sequence[str] | None = None,
    low: float | None = None,
    high: float | None = None,
    title: str | None = None,
    name: str = "heatmap",
) -> figure:
    """Op x step heatmap of ``metric``: one ``image`` glyph, colour bar, hover and tap.

    ``matrix``: one row per op (index: op id), one column per recorded step (ascending
    int labels, possibly unevenly spaced), float values, NaN where there is no value
    (drawn in `theme.NAN_COLOR`). ``labels`` maps op id -> readable name. Palette and
    range default per metric family (`theme.palette_for`, `color_range`); ``low`` /
    ``high`` override either end. Values are sent as float64, or float32 when every column
    is float32 (half the bytes). A single ``image`` (not one rect per cell) keeps a
    2000 x 1000 matrix fast to draw. See the module docstring for how ``(x, y)`` maps to
    ``(op, step)``; `heatmap_cell` does that mapping in Python.
    """
    ops = [int(op) for op in matrix.index]
    steps = [int(step) for step in matrix.columns]
    names = _op_labels(ops, labels)
    # float32 stays float32 (half the bytes in a browser or a standalone report).
    dtype = np.float32 if (matrix.dtypes == np.float32).all() and matrix.size else np.float64
    values = matrix.to_numpy(dtype=dtype, copy=True) if matrix.size else np.zeros((0, 0))
    n_rows, n_cols = len(ops), len(steps)

    auto_low, auto_high = color_range(metric, values)
    mapper = LinearColorMapper(
        palette=list(palette or theme.palette_for(metric)),
        low=auto_low if low is None else low,
        high=auto_high if high is None else high,
        nan_color=theme.NAN_COLOR,
    )
    fig = figure(
        name=name,
        title=title or metric,
        width=900,
        height=_figure_height(n_rows),
        x_range=Range1d(-0.5, max(n_cols, 1) - 0.5, bounds="auto"),
        y_range=Range1d(max(n_rows, 1) - 0.5, -0.5, bounds="auto"),  # row 0 on top
        tools=_PAN_ZOOM_TOOLS,
        toolbar_location="above",
    )
    fig.tags = [{TAG: {"metric": metric, "ops": ops, "steps": steps}}]
    fig.grid.visible = False
    _label_axes(fig, steps, names)
    fig.add_layout(ColorBar(color_mapper=mapper, title=metric, width=12), "right")

    if n_rows == 0 or n_cols == 0:
        fig.add_layout(Label(x=0, y=0, text="no data", text_align="center"))
        return fig
    renderer = fig.image(
        image=[values],
        x=-0.5,
        y=-0.5,
        dw=n_cols,
        dh=n_rows,
        color_mapper=mapper,
        name=f"{name}-image",
    )
    renderer.nonselection_glyph = renderer.glyph.clone()  # a tap must not fade the image
    fig.add_tools(_hover(metric, ops, steps, names), TapTool(behavior="inspect"))
    return fig


def _cell_axes(fig_or_matrix: Any) -> tuple[list[int], list[int]]:
    """Op ids and steps of a heatmap figure (from its tags) or of a matrix."""
    if isinstance(fig_or_matrix, pd.DataFrame):
        return [int(i) for i in fig_or_matrix.index], [int(c) for c in fig_or_matrix.columns]
    for tag in getattr(fig_or_matrix, "tags", None) or ():
        if isinstance(tag, dict) and TAG in tag:
            return list(tag[TAG]["ops"]), list(tag[TAG]["steps"])
    raise ValueError("not a scalescope heatmap figure (no heatmap tag) nor a DataFrame")


def heatmap_cell(fig_or_matrix: Any, x: float, y: float) -> tuple[int, int] | None:
    """``(op id, step)`` of the heatmap cell at data coordinates ``(x, y)``.

    ``x`` / ``y`` are what a Bokeh ``Tap`` event on the figure carries (``event.x``,
    ``event.y``): the column index and row index, each cell being the unit square centred
    on integers. Pass the figure returned by `heatmap` or the matrix it was built from.
    Returns None when the point is outside the image (or not a number).
    """
    ops, steps = _cell_axes(fig_or_matrix)
    if x is None or y is None or not (math.isfinite(x) and math.isfinite(y)):
        return None
    col, row = math.floor(x + 0.5), math.floor(y + 0.5)
    if 0 <= row < len(ops) and 0 <= col < len(steps):
        return ops[row], steps[col]
    return None


def update_heatmap(
    fig: Any,
    matrix: pd.DataFrame,
    *,
    metric: str,
    palette: Sequence[str] | None = None,
    low: float | None = None,
    high: float | None = None,
    title: str | None = None,
) -> bool:
    """Show ``matrix`` (another metric of the same ops and steps) in an existing heatmap
    figure, in place: only the image values, colour range, palette and titles change, so
    a live dashboard sends one array instead of a new figure.

    Returns False, changing nothing, when the figure's ops or steps differ from the
    matrix's (or it is empty): build a new figure with `heatmap` then.
    """
    ops, steps = _cell_axes(fig)
    if [int(i) for i in matrix.index] != ops or [int(c) for c in matrix.columns] != steps:
        return False
    renderers = [r for r in fig.renderers if getattr(r, "name", "") == f"{fig.name}-image"]
    if not renderers or not matrix.size:
        return False
    dtype = np.float32 if (matrix.dtypes == np.float32).all() else np.float64
    values = matrix.to_numpy(dtype=dtype, copy=True)
    image = renderers[0]
    mapper = image.glyph.color_mapper
    auto_low, auto_high = color_range(metric, values)
    mapper.update(
        palette=list(palette or theme.palette_for(metric)),
        low=auto_low if low is None else low,
        high=auto_high if high is None else high,
    )
    image.data_source.data = {"image": [values]}
    for bar in fig.select(type=ColorBar):
        bar.title = metric
    for hover in fig.select(type=HoverTool):
        *head, (_, value) = hover.tooltips
        hover.tooltips = [*head, (metric, value)]
    fig.title.text = title or metric
    for tag in fig.tags:
        if isinstance(tag, dict) and TAG in tag:
            tag[TAG]["metric"] = metric
    return True
