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

Cells without a value
---------------------
Given ``measured`` (`scalescope.analysis.measured_matrix`), a NaN cell is drawn in one of
two ways: *blank* (transparent over a faintly hatched background) where the op was not
measured at that step -- a run under an overhead budget measures ops in turns -- and
grey (`theme.NAN_COLOR`) where it was measured but the statistic is NaN (non-finite
data), from a second, small ``uint8`` image (``<name>-nan``) drawn only when such cells
exist. Hover says "not measured" or "NaN (non-finite data)". Nothing is interpolated.
Without ``measured`` every NaN cell is grey ("no data").
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
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
from .heatmap_base import (
    JS_INDEX,
    JS_TICK,
    PAN_ZOOM_TOOLS,
    TAG,
    blank_background,
    cell_hover,
    color_range,
    nan_cells,
    note,
)
from .heatmap_groups import grouped_heatmap, update_grouped

__all__ = ["TAG", "color_range", "heatmap", "heatmap_cell", "heatmap_group", "update_heatmap"]

#: Op labels are written on the y axis only when there are fewer rows than this.
MAX_LABELLED_ROWS = 60

_JS_OP = (
    JS_INDEX
    + "if (!(i >= 0 && i < ops.length)) return '';"
    + "return format == 'id' ? String(ops[i]) : labels[i];"
)


def _op_labels(ops: Sequence[int], labels: pd.Series | None) -> list[str]:
    """One readable label per op id: ``labels[op]`` where given, else ``"op <id>"``."""
    names = {} if labels is None else labels.to_dict()
    return [str(names[op]) if op in names and pd.notna(names[op]) else f"op {op}" for op in ops]


def _figure_height(n_rows: int) -> int:
    """Tall enough for one readable label per row when rows are labelled."""
    if n_rows < MAX_LABELLED_ROWS:
        return max(260, 90 + 16 * n_rows)
    return 640


def _hover(
    metric: str,
    ops: list[int],
    steps: list[int],
    labels: list[str],
    renderer: Any,
    measured: bool,
    nan: Any,
) -> HoverTool:
    """Tooltip with op label, op id, step and value, resolved per pixel in the browser
    (over the value image only; ``nan``: the source of the NaN-cell image, or None)."""
    op_fmt = CustomJSHover(args={"ops": ops, "labels": labels}, code=_JS_OP)
    rows = [("op", "$y{label}"), ("op id", "$y{id}")]
    return cell_hover(renderer, metric, op_fmt, rows, steps, measured, nan)


def _label_axes(fig, steps: list[int], labels: list[str]) -> None:
    """Real step numbers on the x axis; op labels on the y axis when there are few rows."""
    fig.xaxis.ticker = BasicTicker(min_interval=1, desired_num_ticks=10)
    fig.xaxis.formatter = CustomJSTickFormatter(args={"steps": steps}, code=JS_TICK)
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


def _measured_mask(matrix: pd.DataFrame, measured: Any) -> np.ndarray | None:
    """``measured`` as a bool array of ``matrix``'s shape (a frame is aligned on the
    matrix's ops and steps; absent cells count as not measured)."""
    if measured is None:
        return None
    if isinstance(measured, pd.DataFrame):
        measured = measured.reindex(index=matrix.index, columns=matrix.columns)
        return measured.fillna(False).to_numpy(dtype=bool)
    mask = np.asarray(measured, dtype=bool)
    if mask.shape != matrix.shape:
        raise ValueError(f"measured: shape {mask.shape} differs from the matrix's {matrix.shape}")
    return mask


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
    measured: pd.DataFrame | np.ndarray | None = None,
    groups: pd.Series | None = None,
    expanded: Collection[str] | None = None,
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

    ``measured``: where each op was measured (`scalescope.analysis.measured_matrix`, or a
    bool array of the matrix's shape): NaN cells not measured are drawn blank, measured
    NaN cells grey (see the module docstring). None: every NaN cell grey.

    ``groups``: op id -> group key (`scalescope.analysis.group_keys`): rows grouped by
    module path and pass, a collapsed group drawn as one row of its worst member's values;
    ``expanded``: the groups shown op by op (None: all of them for a small run, none for
    more than `scalescope.analysis.COLLAPSE_ABOVE` ops). See
    `scalescope.viz.heatmap_groups`.
    """
    if groups is not None:
        return grouped_heatmap(
            matrix,
            metric=metric,
            groups=groups,
            expanded=expanded,
            labels=labels,
            palette=palette,
            low=low,
            high=high,
            title=title,
            name=name,
            measured=measured,
        )
    ops = [int(op) for op in matrix.index]
    steps = [int(step) for step in matrix.columns]
    names = _op_labels(ops, labels)
    # float32 stays float32 (half the bytes in a browser or a standalone report).
    dtype = np.float32 if (matrix.dtypes == np.float32).all() and matrix.size else np.float64
    values = matrix.to_numpy(dtype=dtype, copy=True) if matrix.size else np.zeros((0, 0))
    n_rows, n_cols = len(ops), len(steps)
    mask = _measured_mask(matrix, measured)

    auto_low, auto_high = color_range(metric, values)
    mapper = LinearColorMapper(
        palette=list(palette or theme.palette_for(metric)),
        low=auto_low if low is None else low,
        high=auto_high if high is None else high,
        nan_color=theme.NAN_COLOR if mask is None else theme.BLANK_COLOR,
    )
    fig = figure(
        name=name,
        title=title or metric,
        width=900,
        height=_figure_height(n_rows),
        x_range=Range1d(-0.5, max(n_cols, 1) - 0.5, bounds="auto"),
        y_range=Range1d(max(n_rows, 1) - 0.5, -0.5, bounds="auto"),  # row 0 on top
        tools=PAN_ZOOM_TOOLS,
        toolbar_location="above",
    )
    fig.tags = [{TAG: {"metric": metric, "ops": ops, "steps": steps, "measured": mask is not None}}]
    fig.grid.visible = False
    _label_axes(fig, steps, names)
    fig.add_layout(ColorBar(color_mapper=mapper, title=metric, width=12), "right")

    if n_rows == 0 or n_cols == 0:
        fig.add_layout(Label(x=0, y=0, text="no data", text_align="center"))
        return fig
    if mask is not None and not mask.all():
        blank_background(fig, n_rows, n_cols, name)
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
    nan = nan_cells(values, mask)
    nan_source = None
    if nan is not None:
        nan_source = _nan_image(fig, nan, name).data_source
    fig.add_tools(
        _hover(metric, ops, steps, names, renderer, mask is not None, nan_source),
        TapTool(behavior="inspect"),
    )
    if mask is not None and not mask.all():
        note(fig, f"hatched: not measured at that step ({int((~mask).sum())} cells)")
    return fig


def _nan_image(fig, cells: np.ndarray, name: str) -> Any:
    """The grey cells of measured NaN statistics, over the value image."""
    mapper = LinearColorMapper(palette=[theme.BLANK_COLOR, theme.NAN_COLOR], low=0, high=1)
    n_rows, n_cols = cells.shape
    nan = fig.image(
        image=[cells], x=-0.5, y=-0.5, dw=n_cols, dh=n_rows, color_mapper=mapper, name=f"{name}-nan"
    )
    nan.nonselection_glyph = nan.glyph.clone()
    return nan


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
    if 0 <= row < len(ops) and 0 <= col < len(steps) and ops[row] >= 0:
        return ops[row], steps[col]
    return None


def heatmap_group(fig: Any, y: float) -> str | None:
    """The group key of the collapsed group row at data coordinate ``y`` of a grouped
    heatmap figure (`heatmap` with ``groups``); None for an op row, outside the image or
    on a figure without groups."""
    for tag in getattr(fig, "tags", None) or ():
        if isinstance(tag, dict) and TAG in tag:
            info = tag[TAG]
            break
    else:
        return None
    if y is None or not math.isfinite(y) or not info.get("grouped"):
        return None
    row = math.floor(y + 0.5)
    if 0 <= row < len(info["ops"]) and info["collapsed"][row]:
        return str(info["groups"][row])
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
    measured: pd.DataFrame | np.ndarray | None = None,
    groups: pd.Series | None = None,
    expanded: Collection[str] | None = None,
    labels: pd.Series | None = None,
) -> bool:
    """Show ``matrix`` (another metric of the same ops and steps) in an existing heatmap
    figure, in place: only the image values, colour range, palette and titles change, so
    a live dashboard sends one array instead of a new figure.

    Returns False, changing nothing, when the figure's ops or steps differ from the
    matrix's (or it is empty), when ``measured`` is given for a figure built without it
    (or the reverse), or when measured NaN cells appear in a figure that has no image for
    them: build a new figure with `heatmap` then.

    A grouped figure (built with ``groups``) takes ``groups``, ``expanded`` and
    ``labels`` again and may change its rows (other ops, groups expanded or collapsed):
    only its steps and whether it knows where ops were measured must stay the same.
    """
    info = next((t[TAG] for t in fig.tags if isinstance(t, dict) and TAG in t), {})
    if info.get("grouped"):
        if groups is None:
            return False
        return update_grouped(
            fig,
            matrix,
            metric=metric,
            groups=groups,
            expanded=expanded,
            labels=labels,
            palette=palette,
            low=low,
            high=high,
            title=title,
            measured=measured,
        )
    if groups is not None:
        return False
    ops, steps = _cell_axes(fig)
    if [int(i) for i in matrix.index] != ops or [int(c) for c in matrix.columns] != steps:
        return False
    renderers = [r for r in fig.renderers if getattr(r, "name", "") == f"{fig.name}-image"]
    if not renderers or not matrix.size:
        return False
    tag = next(t[TAG] for t in fig.tags if isinstance(t, dict) and TAG in t)
    mask = _measured_mask(matrix, measured)
    if bool(tag.get("measured")) != (mask is not None):
        return False
    dtype = np.float32 if (matrix.dtypes == np.float32).all() else np.float64
    values = matrix.to_numpy(dtype=dtype, copy=True)
    nan = nan_cells(values, mask)
    nan_images = [r for r in fig.renderers if getattr(r, "name", "") == f"{fig.name}-nan"]
    if nan is not None and not nan_images:
        return False
    for r in nan_images:
        cells = nan if nan is not None else np.zeros(values.shape, np.uint8)
        r.data_source.data = {"image": [cells]}
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
