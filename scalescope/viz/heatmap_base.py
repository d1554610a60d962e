"""What the op x step heatmaps share, plain (`scalescope.viz.heatmap`) and grouped
(`scalescope.viz.heatmap_groups`): the figure tag, the hover and its JavaScript
formatters, the colour range per metric, the hatched "not measured" background and the
NaN cells. Both figure modules import this one; neither imports the other's internals."""

from __future__ import annotations

from typing import Any

import numpy as np
from bokeh.models import CustomJSHover, HoverTool, Title

from . import theme

#: Key of the dict stored in ``fig.tags`` that `heatmap_cell` reads.
TAG = "scalescope.heatmap"

PAN_ZOOM_TOOLS = "pan,wheel_zoom,box_zoom,reset,save"

# Round a data coordinate to the row/column index whose unit square contains it.
JS_INDEX = "const i = Math.floor(value + 0.5);"

JS_STEP = JS_INDEX + "return (i >= 0 && i < steps.length) ? String(steps[i]) : '';"

JS_VALUE = """
if (value == null || Number.isNaN(value)) {
  if (!measured) return 'no data';
  if (nan != null) {
    const c = Math.floor(special_vars.x + 0.5), r = Math.floor(special_vars.y + 0.5);
    if (nan.data.image[0][r * n_cols + c]) return 'NaN (non-finite data)';
  }
  return 'not measured';
}
if (!Number.isFinite(value)) return value > 0 ? 'inf' : '-inf';
const a = Math.abs(value);
return (a != 0 && (a < 1e-3 || a >= 1e5)) ? value.toExponential(3) : String(+value.toPrecision(4));
"""

JS_TICK = (
    "const i = Math.round(tick);"
    "return (Math.abs(tick - i) < 1e-6 && i >= 0 && i < steps.length) ? String(steps[i]) : '';"
)


def color_range(metric: str, values: np.ndarray) -> tuple[float, float]:
    """Default colour range of ``metric`` for these values (see `theme.metric_family`).

    Fixed per family, the same in every run and view, so that a colour means one value:
    fractions ``0 .. 1`` (their palette is spaced by decade, `theme.FRACTION_PALETTE`, so
    a 1.5 % underflow reads light orange and 99 % dark red); SNR `theme.SNR_RANGE` dB
    (``inf``, an exact cast, takes the top colour); ``log2_*`` ``-8 .. 8``, centred on 0
    so that drift up and down read symmetrically. Other metrics (rms, abs-max, scale):
    finite min .. max of the values.
    """
    family = theme.metric_family(metric)
    if family == "log2":
        return -theme.LOG2_HALF_RANGE, theme.LOG2_HALF_RANGE
    if family == "fraction":
        return 0.0, 1.0
    if family == "snr":
        return theme.SNR_RANGE
    finite = np.asarray(values, dtype=float)
    finite = finite[np.isfinite(finite)]
    if not finite.size:
        return 0.0, 1.0
    low, high = float(finite.min()), float(finite.max())
    if low == high:
        pad = abs(low) * 0.05 or 1.0
        low, high = low - pad, high + pad
    return low, high


def cell_hover(
    renderer: Any,
    metric: str,
    row_fmt: Any,
    row_tips: list[tuple[str, str]],
    steps: list[int],
    measured: bool,
    nan: Any,
) -> HoverTool:
    """The heatmap's hover: ``row_tips`` (resolved by ``row_fmt`` from ``$y``), then the
    step and the value of the cell under the pointer (shared by the grouped figure)."""
    step_fmt = CustomJSHover(args={"steps": steps}, code=JS_STEP)
    value_fmt = CustomJSHover(
        args={"measured": measured, "nan": nan, "n_cols": len(steps)},
        code=JS_VALUE,
        name="heatmap-value-format",
    )
    return HoverTool(
        renderers=[renderer],
        tooltips=[*row_tips, ("step", "$x{step}"), (metric, "@image{value}")],
        formatters={"$y": row_fmt, "$x": step_fmt, "@image": value_fmt},
        name="heatmap-hover",
    )


def nan_cells(values: np.ndarray, mask: np.ndarray | None) -> np.ndarray | None:
    """uint8 image: 1 where a measured cell holds NaN (None when there is none)."""
    if mask is None or not values.size:
        return None
    cells = np.isnan(values) & mask
    return cells.astype(np.uint8) if cells.any() else None


def blank_background(fig, n_rows: int, n_cols: int, name: str) -> None:
    """A faint hatch behind the image: it shows through the transparent cells of ops that
    were not measured at a step, so they read as "no measurement", not as a value. (A
    hatched quad: Bokeh 3.9 fails to draw a plot's own ``background_hatch_pattern``.)"""
    quad = fig.quad(
        left=[-0.5],
        right=[n_cols - 0.5],
        bottom=[-0.5],
        top=[n_rows - 0.5],
        fill_alpha=0.0,
        line_alpha=0.0,
        hatch_pattern=theme.UNMEASURED_HATCH,
        hatch_color=theme.UNMEASURED_HATCH_COLOR,
        hatch_scale=8,
        hatch_weight=0.6,
        name=f"{name}-blank",
    )
    quad.nonselection_glyph = quad.glyph.clone()


def note(fig, text: str) -> None:
    fig.add_layout(
        Title(text=text, text_font_size="8pt", text_font_style="italic", name="heatmap-note"),
        "below",
    )
