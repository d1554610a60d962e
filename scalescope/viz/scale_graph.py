"""The scale graph figure: each op's forward and gradient log2 RMS on one axis, with the
formats' normal and subnormal ranges drawn (unit scaling's analysis plot)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
from bokeh.models import BoxAnnotation, ColumnDataSource, HoverTool, Legend, LegendItem, Span
from bokeh.plotting import figure

from ..core import formats as F
from . import theme

_TOOLS = "pan,wheel_zoom,box_zoom,reset,save"


def _labels(frame: pd.DataFrame) -> list[str]:
    """Unique row labels in computation order: ``<op> <name>``."""
    return [f"{op} {name}" for op, name in zip(frame.index, frame["name"], strict=True)]


def scale_graph_figure(
    frame: pd.DataFrame,
    formats: Sequence[str] = ("e4m3", "e5m2", "fp16", "bf16"),
    *,
    title: str = "scale graph",
    height: int | None = None,
):
    """One row per op (computation order, top to bottom): a circle at the log2 RMS of
    its value, a triangle at the log2 RMS of its gradient. Each format's normal range is
    a band and its subnormal floor a dashed line, in the format's colour."""
    missing = {"name", "fwd_log2_rms", "grad_log2_rms"} - set(frame.columns)
    if missing:
        raise ValueError(f"scale_graph_figure: frame lacks columns {sorted(missing)}")
    labels = _labels(frame)
    rows = len(labels)
    fig = figure(
        title=title,
        y_range=list(reversed(labels)) or ["(no ops)"],
        height=height or max(200, 40 + 14 * rows),
        sizing_mode="stretch_width",
        x_axis_label="log2 RMS",
        tools=_TOOLS,
        name="scale-graph",
    )
    source = ColumnDataSource(
        {
            "label": labels,
            "name": list(frame["name"]),
            "primitive": list(frame.get("primitive", frame["name"])),
            "fwd": np.asarray(frame["fwd_log2_rms"], float),
            "grad": np.asarray(frame["grad_log2_rms"], float),
        }
    )
    legend = []
    for fmt_name in formats:
        fmt = F.get(fmt_name)
        color = theme.FORMAT_COLORS.get(fmt.name, "#7f7f7f")
        lo, hi = float(np.log2(fmt.min_normal)), float(np.log2(fmt.max))
        fig.add_layout(BoxAnnotation(left=lo, right=hi, fill_color=color, fill_alpha=0.06))
        floor = Span(location=float(np.log2(fmt.min_subnormal)), dimension="height")
        floor.line_color, floor.line_dash, floor.line_alpha = color, "dashed", 0.6
        fig.add_layout(floor)
        # a legend swatch for the band (an empty line: bands have no legend of their own)
        edge = fig.line(x=[], y=[], line_color=color, line_width=8, line_alpha=0.3)
        legend.append(LegendItem(label=f"{fmt.name} normal range", renderers=[edge]))
    fwd = fig.scatter("fwd", "label", source=source, size=7, color=theme.SERIES_COLORS[0])
    grad = fig.scatter(
        "grad", "label", source=source, size=7, marker="triangle", color=theme.SERIES_COLORS[1]
    )
    legend = [
        LegendItem(label="value", renderers=[fwd]),
        LegendItem(label="gradient", renderers=[grad]),
        *legend,
    ]
    fig.add_layout(Legend(items=legend, location="top_left", click_policy="hide"), "right")
    fig.add_tools(
        HoverTool(
            renderers=[fwd, grad],
            tooltips=[
                ("op", "@label"),
                ("value log2 RMS", "@fwd{0.0}"),
                ("gradient log2 RMS", "@grad{0.0}"),
            ],
        )
    )
    return fig


__all__ = ["scale_graph_figure"]
