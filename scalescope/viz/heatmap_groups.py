"""The grouped op x step heatmap: rows grouped by module path and pass, collapsible.

`scalescope.viz.heatmap` builds it when given ``groups`` (op id -> group key,
`scalescope.analysis.group_keys`): each collapsed group is one row holding, at each step,
its worst member's value for the metric (`scalescope.analysis.group_matrix`); an expanded
group shows one row per member op. Still one ``image`` glyph, so tens of thousands of ops
collapsed into a few hundred rows send a few hundred rows.

Row labels stay readable at every zoom: the figure grows with its rows (up to
`MAX_HEIGHT_PX`) so that every row, collapsed group or op of an expanded one, is at least
`MIN_ROW_PX` tall and labelled; a JavaScript callback on the y range writes one label per
row while rows are that tall, otherwise one label per group (at its first row, thinned so
that labels do not overlap). Hover always names the
row (the op, or the group and its size), the op id, the worst member at that step (for a
collapsed row) and the step. Everything that depends on the rows is set by `fill_rows`,
so `update_heatmap` changes the rows of a figure in place (expand, collapse, search, a
new metric or a new step of a live run: one message, no new figure).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import numpy as np
import pandas as pd
from bokeh.models import (
    BasicTicker,
    ColorBar,
    ColumnDataSource,
    CustomJS,
    CustomJSHover,
    CustomJSTickFormatter,
    FixedTicker,
    HoverTool,
    Label,
    LinearColorMapper,
    NoOverlap,
    Range1d,
    TapTool,
)
from bokeh.plotting import figure

from scalescope.analysis import GroupedMatrix, group_matrix, metric_direction

from . import theme
from .heatmap_base import (
    JS_TICK,
    PAN_ZOOM_TOOLS,
    TAG,
    blank_background,
    cell_hover,
    color_range,
    nan_cells,
    note,
)

#: Rows at least this tall (pixels) get a label each; shorter rows get group labels.
MIN_ROW_PX = 11
#: The grouped figure grows to give every row `MIN_ROW_PX` (so every collapsed group and
#: every op of an expanded group is labelled) up to this height (pixels).
MAX_HEIGHT_PX = 3000


def _grouped_height(n_rows: int) -> int:
    """Tall enough for a label on every row, within `MAX_HEIGHT_PX`."""
    return int(min(MAX_HEIGHT_PX, max(260, 90 + MIN_ROW_PX * n_rows)))


_JS_ROW = """
const i = Math.floor(value + 0.5);
if (!(i >= 0 && i < ops.length)) return '';
if (format == 'id') return ops[i] >= 0 ? String(ops[i]) : '-';
if (format == 'worst') {
  if (ops[i] >= 0) return '-';
  const c = Math.floor(special_vars.x + 0.5);
  const w = (c >= 0 && c < n_cols) ? worst.data.worst[0][i * n_cols + c] : -1;
  if (w >= 0 && w < names.length) return names[w];
  return mean ? 'mean of ' + sizes[i] + ' ops' : 'no value';
}
return labels[i];
"""

_JS_YTICK = """
const i = Math.round(tick);
if (Math.abs(tick - i) > 1e-6 || i < 0 || i >= labels.length) return '';
return ticker.tags[0] === 'rows' ? labels[i] : (sections[i] || '');
"""

_JS_RANGE = """
const r = y_range, n = labels.length;
const lo = Math.min(r.start, r.end), hi = Math.max(r.start, r.end);
const h = fig.inner_height > 0 ? fig.inner_height : fig.height - 90;
const a = Math.max(0, Math.ceil(lo)), b = Math.min(n - 1, Math.floor(hi));
const ticks = [];
if (h / Math.max(hi - lo, 1e-9) >= min_px) {
  for (let i = a; i <= b; i++) ticks.push(i);
  ticker.tags = ['rows'];
} else {
  const shown = starts.filter((s) => s >= a && s <= b);
  const stride = Math.max(1, Math.ceil(shown.length * min_px / Math.max(h, 1)));
  for (let k = 0; k < shown.length; k += stride) ticks.push(shown[k]);
  ticker.tags = ['groups'];
}
ticker.ticks = ticks;
"""


def _row_ticks(n_rows: int, starts: np.ndarray, height: int) -> tuple[list[int], str]:
    """The y ticks and label mode for the whole figure (`_JS_RANGE` in Python)."""
    frame = max(height - 90, 1)
    if n_rows and frame / n_rows >= MIN_ROW_PX:
        return list(range(n_rows)), "rows"
    stride = max(1, -(-len(starts) * MIN_ROW_PX // frame))
    return [int(s) for s in starts[::stride]], "groups"


def row_labels(rows: GroupedMatrix, labels: pd.Series | None) -> tuple[list[str], list[str]]:
    """Per row: its label (the op's, or ``group (n ops)`` for a collapsed group) and its
    section label (the group's, on the group's first row; '' on the others)."""
    names = {} if labels is None else labels.to_dict()
    out = []
    for op, key, size, closed in zip(rows.ops, rows.keys, rows.sizes, rows.collapsed):
        if closed:
            out.append(f"▸ {key} ({size} ops)")
        else:
            name = names.get(int(op))
            out.append(str(name) if name is not None and pd.notna(name) else f"op {op}")
    sections = [""] * len(out)
    for start in rows.group_starts:
        size, key = rows.sizes[start], rows.keys[start]
        sections[start] = out[start] if rows.collapsed[start] else f"▾ {key} ({size} ops)"
    return out, sections


def grouped_heatmap(
    matrix: pd.DataFrame,
    *,
    metric: str,
    groups: pd.Series,
    expanded: Collection[str] | None = None,
    labels: pd.Series | None = None,
    palette: Sequence[str] | None = None,
    low: float | None = None,
    high: float | None = None,
    title: str | None = None,
    name: str = "heatmap",
    measured: pd.DataFrame | np.ndarray | None = None,
) -> figure:
    """`scalescope.viz.heatmap` with grouped rows (see the module docstring)."""
    rows = group_matrix(matrix, groups, metric, expanded, measured)
    steps = [int(s) for s in matrix.columns]
    n_rows, n_cols = len(rows.ops), len(steps)
    mask = rows.measured
    mapper = LinearColorMapper(
        palette=list(palette or theme.palette_for(metric)),
        nan_color=theme.NAN_COLOR if mask is None else theme.BLANK_COLOR,
    )
    fig = figure(
        name=name,
        title=title or metric,
        width=900,
        height=_grouped_height(n_rows),
        x_range=Range1d(-0.5, max(n_cols, 1) - 0.5),
        y_range=Range1d(max(n_rows, 1) - 0.5, -0.5),  # row 0 on top
        tools=PAN_ZOOM_TOOLS,
        toolbar_location="above",
    )
    fig.grid.visible = False
    fig.xaxis.ticker = BasicTicker(min_interval=1, desired_num_ticks=10)
    fig.xaxis.formatter = CustomJSTickFormatter(args={"steps": steps}, code=JS_TICK)
    fig.xaxis.axis_label = "step"
    fig.add_layout(ColorBar(color_mapper=mapper, title=metric, width=12), "right")
    fig.tags = [{TAG: {"metric": metric, "steps": steps, "measured": mask is not None}}]
    if n_rows == 0 or n_cols == 0:
        fig.tags[0][TAG].update(ops=[], groups=[], collapsed=[], grouped=True)
        fig.add_layout(Label(x=0, y=0, text="no data", text_align="center"))
        return fig
    ticker = FixedTicker(ticks=[], tags=["rows"], name=f"{name}-yticker")
    fig.yaxis.ticker = ticker
    fig.yaxis.major_label_policy = NoOverlap()
    fig.yaxis.major_label_text_font_size = "8pt"
    fig.yaxis.formatter = CustomJSTickFormatter(
        args={"labels": [], "sections": [], "ticker": ticker}, code=_JS_YTICK
    )
    if mask is not None and not mask.all():
        blank_background(fig, n_rows, n_cols, fig.name)
    image = fig.image(
        image=[np.zeros((1, 1), np.float32)],
        x=-0.5,
        y=-0.5,
        dw=n_cols,
        dh=n_rows,
        color_mapper=mapper,
        name=f"{name}-image",
    )
    image.nonselection_glyph = image.glyph.clone()
    nan_source = None
    if nan_cells(rows.values, mask) is not None:
        nan_source = _add_nan(fig, n_rows, n_cols).data_source
    fig.add_tools(_hover(image, metric, mask is not None, nan_source, n_cols, steps, name))
    fig.add_tools(TapTool(behavior="inspect"))
    _label_callback(fig, ticker, name)
    if (matrix.dtypes == np.float32).all():
        rows.values = rows.values.astype(np.float32)
    fill_rows(fig, rows, metric=metric, labels=labels, palette=palette, low=low, high=high)
    if mask is not None and not mask.all():
        note(fig, "hatched: not measured at that step")
    return fig


def _hover(
    image: Any,
    metric: str,
    measured: bool,
    nan_source: Any,
    n_cols: int,
    steps: list[int],
    name: str,
) -> HoverTool:
    """Hover naming the row (op, or group and size), the op id, a collapsed row's worst
    op at that step, the step and the value (row data filled in by `fill_rows`)."""
    worst = ColumnDataSource(data={"worst": [np.zeros((1, 1), np.int32)]}, name=f"{name}-worst")
    row_fmt = CustomJSHover(
        args={
            "ops": [],
            "labels": [],
            "sizes": [],
            "names": [],
            "worst": worst,
            "n_cols": n_cols,
            "mean": False,
        },
        code=_JS_ROW,
        name=f"{name}-row-format",
    )
    rows = [("row", "$y{label}"), ("op id", "$y{id}"), ("worst op", "$y{worst}")]
    return cell_hover(image, metric, row_fmt, rows, steps, measured, nan_source)


def _label_callback(fig: Any, ticker: Any, name: str) -> None:
    """Relabel the y axis in the browser when the y range changes (`_JS_RANGE`)."""
    callback = CustomJS(
        args={
            "y_range": fig.y_range,
            "fig": fig,
            "ticker": ticker,
            "labels": [],
            "starts": [],
            "min_px": MIN_ROW_PX,
        },
        code=_JS_RANGE,
        name=f"{name}-range-callback",
    )
    fig.y_range.js_on_change("start", callback)
    fig.y_range.js_on_change("end", callback)


def _add_nan(fig: Any, n_rows: int, n_cols: int) -> Any:
    """The grey cells of measured NaN statistics, over the value image."""
    nan_mapper = LinearColorMapper(palette=[theme.BLANK_COLOR, theme.NAN_COLOR], low=0, high=1)
    nan = fig.image(
        image=[np.zeros((1, 1), np.uint8)],
        x=-0.5,
        y=-0.5,
        dw=n_cols,
        dh=n_rows,
        color_mapper=nan_mapper,
        name=f"{fig.name}-nan",
    )
    nan.nonselection_glyph = nan.glyph.clone()
    return nan


def _model(fig: Any, name: str) -> Any:
    """The renderer ``<figure name>-<name>`` (looked up directly: `select` walks every
    reference, label lists included)."""
    return next((r for r in fig.renderers if r.name == f"{fig.name}-{name}"), None)


def fill_rows(
    fig: Any,
    rows: GroupedMatrix,
    *,
    metric: str,
    labels: pd.Series | None = None,
    palette: Sequence[str] | None = None,
    low: float | None = None,
    high: float | None = None,
) -> None:
    """Put ``rows`` into a figure built by `grouped_heatmap`: image values, NaN cells,
    hatch, ranges, row labels, hover, ticks and tags. The steps may differ from the
    figure's (a live run's new step): the x range then shows them all, unless it was
    zoomed in."""
    n_rows, n_cols = rows.values.shape
    float32 = rows.values.dtype == np.float32
    values = rows.values.astype(np.float32 if float32 else np.float64, copy=False)
    mask = rows.measured
    image, nan, quad = _model(fig, "image"), _model(fig, "nan"), _model(fig, "blank")
    mapper = image.glyph.color_mapper
    auto_low, auto_high = color_range(metric, values)
    mapper.update(
        palette=list(palette or theme.palette_for(metric)),
        low=auto_low if low is None else low,
        high=auto_high if high is None else high,
    )
    image.glyph.update(dh=n_rows, dw=n_cols)
    image.data_source.data = {"image": [values]}
    cells = nan_cells(values, mask)
    if nan is not None:
        nan.glyph.update(dh=n_rows, dw=n_cols)
        nan.data_source.data = {
            "image": [cells if cells is not None else np.zeros(values.shape, np.uint8)]
        }
    if quad is not None:
        quad.data_source.data = dict(quad.data_source.data) | {
            "top": [n_rows - 0.5],
            "right": [n_cols - 0.5],
        }
    _set_steps(fig, [int(c) for c in rows.columns])

    texts, sections = row_labels(rows, labels)
    starts = rows.group_starts
    worst_ids = np.unique(rows.worst[rows.worst >= 0])
    worst = np.searchsorted(worst_ids, rows.worst).astype(np.int32)
    worst[rows.worst < 0] = -1
    names = {} if labels is None else labels.to_dict()
    worst_names = [str(names.get(int(op), f"op {op}")) for op in worst_ids]
    hover = next(t for t in fig.tools if t.name == "heatmap-hover")
    row_fmt = hover.formatters["$y"]
    row_fmt.args["worst"].data = {"worst": [worst]}
    row_fmt.args = dict(row_fmt.args) | {
        "ops": rows.ops.tolist(),
        "labels": texts,
        "sizes": rows.sizes.tolist(),
        "names": worst_names,
        "mean": metric_direction(metric) == "mean",
    }
    *head, (_, value) = hover.tooltips
    hover.tooltips = [*head, (metric, value)]
    for bar in fig.right:
        if isinstance(bar, ColorBar):
            bar.title = metric

    height = _grouped_height(n_rows)
    ticks, mode = _row_ticks(n_rows, starts, height)
    ticker = fig.yaxis[0].ticker
    ticker.update(tags=[mode], ticks=ticks)
    formatter = fig.yaxis[0].formatter
    formatter.args = dict(formatter.args) | {"labels": texts, "sections": sections}
    fig.yaxis[0].axis_label = (
        f"{int(rows.sizes[rows.collapsed].sum() + (~rows.collapsed).sum())} ops in "
        f"{len(rows.groups)} "
        f"groups, {int(rows.collapsed.sum())} rows collapsed; hover for names"
    )
    for cb in fig.y_range.js_property_callbacks.get("change:start", []):
        cb.args = dict(cb.args) | {"labels": texts, "starts": starts.tolist()}
    tag = dict(fig.tags[0][TAG])  # a new dict: Bokeh sends tags only when they differ
    tag.update(
        metric=metric,
        ops=rows.ops.tolist(),
        groups=rows.keys.tolist(),
        collapsed=rows.collapsed.tolist(),
        expanded=sorted(rows.expanded),
        grouped=True,
    )
    fig.tags = [{TAG: tag}]
    # The range last: its change runs the label callback in the browser, which must see
    # the new labels and group starts.
    fig.height = height
    top = max(n_rows, 1) - 0.5
    # bounds first: BokehJS clamps a new start to the bounds it holds
    fig.y_range.bounds = (-0.5, top)
    fig.y_range.update(start=top, end=-0.5, reset_start=top, reset_end=-0.5)


def _set_steps(fig: Any, steps: list[int]) -> None:
    """Point every step-dependent part of the figure at ``steps`` (when they changed)."""
    tag = fig.tags[0][TAG]
    old = tag.get("steps", [])
    if old == steps and fig.x_range.bounds == (-0.5, max(len(steps), 1) - 0.5):
        return
    n_cols = len(steps)
    right = max(n_cols, 1) - 0.5
    x = fig.x_range
    whole = x.start <= -0.5 + 1e-9 and x.end >= max(len(old), 1) - 0.5 - 1e-9
    x.bounds = (-0.5, right)  # first: BokehJS clamps a new end to the bounds it holds
    x.update(reset_start=-0.5, reset_end=right)
    if whole:
        x.update(start=-0.5, end=right)
    fig.xaxis[0].formatter.args = {"steps": steps}
    hover = next(t for t in fig.tools if t.name == "heatmap-hover")
    hover.formatters["$x"].args = {"steps": steps}
    for key in ("$y", "@image"):
        hover.formatters[key].args = dict(hover.formatters[key].args) | {"n_cols": n_cols}
    fig.tags = [{TAG: {**tag, "steps": steps}}]


def update_grouped(
    fig: Any,
    matrix: pd.DataFrame,
    *,
    metric: str,
    groups: pd.Series,
    expanded: Collection[str] | None,
    labels: pd.Series | None,
    palette: Sequence[str] | None,
    low: float | None,
    high: float | None,
    title: str | None,
    measured: pd.DataFrame | np.ndarray | None,
) -> bool:
    """`update_heatmap` of a grouped figure: any rows, the same steps (False otherwise)."""
    tag = fig.tags[0][TAG]
    if not matrix.size:
        return False
    if bool(tag.get("measured")) != (measured is not None) or _model(fig, "image") is None:
        return False
    rows = group_matrix(matrix, groups, metric, expanded, measured)
    # Measured NaN cells or unmeasured ones need the grey image or the hatch: a figure
    # built without them is rebuilt.
    if nan_cells(rows.values, rows.measured) is not None and _model(fig, "nan") is None:
        return False
    if rows.measured is not None and not rows.measured.all() and _model(fig, "blank") is None:
        return False
    fill_rows(fig, rows, metric=metric, labels=labels, palette=palette, low=low, high=high)
    fig.title.text = title or metric
    return True
