"""Exponent histogram of one value, with each format's normal and subnormal range shaded.

The x axis is ``log2|x|``. The bin ``"2^e"`` counts elements with ``floor(log2|x|) == e``,
i.e. ``|x|`` in ``[2^e, 2^(e+1))``, so its bar spans ``[e, e + 1)`` on this axis (left edge
at ``x = e``). Format ranges are drawn at their exact ``log2`` bounds on the same axis, so
a bar that sticks out of a shaded box is exactly the part of the tensor that leaves that
format's normal range. The four special bins (zero, below, above, nonfinite) get their
own bars beyond either end of the exponent range, labelled on the axis.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
from bokeh.models import BoxAnnotation, ColumnDataSource, FixedTicker, HoverTool, Range1d, Span
from bokeh.plotting import figure

from . import theme

_EXP_LABEL = re.compile(r"^2\^(-?\d+)$")
_TOOLS = "pan,wheel_zoom,box_zoom,reset,save"

#: Special bins: (label, side, offset in bins from the exponent range), drawn as bars at
#: ``lo - offset`` (left) or ``hi + offset`` (right) with a one-bin gap to the range.
SPECIAL_BINS = (
    ("zero", "left", 4),
    ("below", "left", 2),
    ("above", "right", 2),
    ("nonfinite", "right", 4),
)
_SPECIAL_COLORS = {
    "zero": "#9e9e9e",
    "below": "#6a51a3",
    "above": "#6a51a3",
    "nonfinite": "#e31a1c",
}

NORMAL_ALPHA = 0.14
SUBNORMAL_ALPHA = 0.06


def _exponent(label: Any) -> int | None:
    match = _EXP_LABEL.match(str(label))
    return int(match.group(1)) if match else None


def _limit(info: Any, key: str) -> float:
    """``info[key]`` for a dict, ``info.key`` for an object such as `scalescope.Format`."""
    return float(info[key] if isinstance(info, Mapping) else getattr(info, key))


def format_bounds(info: Any) -> dict[str, tuple[float, float]]:
    """``log2`` bounds of a format's ranges on the histogram's x axis.

    ``normal``: ``[log2 min_normal, log2 max]``; ``subnormal``:
    ``[log2 min_subnormal, log2 min_normal)``.
    """
    lo_norm = math.log2(_limit(info, "min_normal"))
    return {
        "normal": (lo_norm, math.log2(_limit(info, "max"))),
        "subnormal": (math.log2(_limit(info, "min_subnormal")), lo_norm),
    }


def _split(counts: pd.Series) -> tuple[dict[int, float], dict[str, float], int, int]:
    """Exponent bins, special bins and the exponent range ``lo..hi`` of the histogram."""
    exps: dict[int, float] = {}
    special: dict[str, float] = {}
    for label, count in counts.items():
        e = _exponent(label)
        value = float(count) if pd.notna(count) else 0.0
        if e is not None:
            exps[e] = value
        elif str(label) in {s for s, _, _ in SPECIAL_BINS}:
            special[str(label)] = value
    lo, hi = (min(exps), max(exps)) if exps else (-40, 23)
    return exps, special, lo, hi


def _special_x(label: str, lo: int, hi: int) -> int:
    """Left edge of a special bin's bar."""
    for name, side, offset in SPECIAL_BINS:
        if name == label:
            return lo - offset if side == "left" else hi + offset
    raise KeyError(label)


def _bars(exps: dict[int, float], special: dict[str, float], lo: int, hi: int, total: float):
    """Two sources: non-empty exponent bins, and the special bins (every one, even empty)."""
    nonempty = sorted(e for e, c in exps.items() if c > 0)
    bins = {
        "left": nonempty,
        "right": [e + 1 for e in nonempty],
        "count": [exps[e] for e in nonempty],
        "bin": [f"2^{e}" for e in nonempty],
    }
    names = [s for s, _, _ in SPECIAL_BINS]
    edges = [_special_x(s, lo, hi) for s in names]
    extra = {
        "left": edges,
        "right": [x + 1 for x in edges],
        "count": [special.get(s, 0.0) for s in names],
        "bin": names,
        "color": [_SPECIAL_COLORS[s] for s in names],
    }
    for data in (bins, extra):
        data["fraction"] = [c / total if total else 0.0 for c in data["count"]]
    return ColumnDataSource(bins), ColumnDataSource(extra)


def _axis(fig, lo: int, hi: int) -> None:
    """Ticks at every 4th exponent (labelled ``2^e``) and at the special bars (named);
    no exponent tick within two bins of a special one, so no two labels overlap."""
    exps = [e for e in range(lo + 1, hi + 1) if e % 4 == 0]
    specials = {_special_x(s, lo, hi) + 0.5: s for s, _, _ in SPECIAL_BINS}
    fig.xaxis.ticker = FixedTicker(ticks=sorted([*exps, *specials]))
    fig.xaxis.major_label_overrides = {**{e: f"2^{e}" for e in exps}, **specials}
    fig.xaxis.major_label_orientation = math.pi / 4
    fig.xaxis.axis_label = "log2 |x|  (bin 2^e spans [e, e+1))"


def _shade_format(fig, fmt: str, info: Any, color: str) -> None:
    """Normal and subnormal boxes and a max line for one format, toggled by its legend entry."""
    bounds = format_bounds(info)
    normal = BoxAnnotation(
        left=bounds["normal"][0],
        right=bounds["normal"][1],
        fill_color=color,
        fill_alpha=NORMAL_ALPHA,
        line_alpha=0,
        name=f"{fmt}-normal",
    )
    subnormal = BoxAnnotation(
        left=bounds["subnormal"][0],
        right=bounds["subnormal"][1],
        fill_color=color,
        fill_alpha=SUBNORMAL_ALPHA,
        line_alpha=0,
        name=f"{fmt}-subnormal",
    )
    top = Span(
        location=bounds["normal"][1],
        dimension="height",
        line_color=color,
        line_dash="dashed",
        line_width=2,
        name=f"{fmt}-max",
    )
    fig.add_layout(subnormal)
    fig.add_layout(normal)
    fig.add_layout(top)
    # An empty glyph gives the format a legend entry; hiding it hides the shading too.
    entry = fig.quad(
        left=[],
        right=[],
        top=[],
        bottom=[],
        fill_color=color,
        fill_alpha=0.4,
        line_color=color,
        legend_label=f"{fmt}: normal | subnormal | max",
        name=f"{fmt}-legend",
    )
    for annotation in (normal, subnormal, top):
        entry.js_link("visible", annotation, "visible")


def exponent_histogram(
    counts: pd.Series,
    format_info: Mapping[str, Any],
    *,
    formats: Sequence[str] | None = None,
    title: str | None = None,
    log_counts: bool = False,
    name: str = "histogram",
) -> figure:
    """Histogram of ``floor(log2|x|)`` with the ranges of low-precision formats shaded.

    ``counts``: element counts indexed by bin label (``"zero"``, ``"below"``, ``"2^-40"``
    ... ``"2^23"``, ``"above"``, ``"nonfinite"``). One bar per non-empty exponent bin
    (spanning ``[e, e+1)``, see the module docstring), plus the four special bins, named on
    the axis. ``format_info``: format name -> dict (or `scalescope.Format`) with ``max``,
    ``min_normal``, ``min_subnormal``. For each of ``formats`` (default: all) the normal
    range ``[log2 min_normal, log2 max]`` and subnormal range ``[log2 min_subnormal,
    log2 min_normal)`` are shaded in the format's colour (subnormal lighter) and its max is
    a dashed line; the legend names them and hides them on click. Counts on a linear axis,
    or log with ``log_counts``.
    """
    exps, special, lo, hi = _split(counts)
    total = float(sum(exps.values()) + sum(special.values()))
    left_edge = _special_x("zero", lo, hi) - 1
    right_edge = _special_x("nonfinite", lo, hi) + 2
    fig = figure(
        name=name,
        title=title or "exponent histogram",
        width=800,
        height=340,
        x_range=Range1d(left_edge, right_edge, bounds=(left_edge, right_edge)),
        y_axis_type="log" if log_counts else "linear",
        tools=_TOOLS,
        toolbar_location="above",
    )
    fig.yaxis.axis_label = "elements"
    fig.xgrid.visible = False
    formats = list(format_info) if formats is None else list(formats)
    for i, fmt in enumerate(formats):
        _shade_format(fig, fmt, format_info[fmt], theme.format_color(fmt, i))

    bins, extra = _bars(exps, special, lo, hi, total)
    bottom = 0.5 if log_counts else 0.0
    if log_counts:  # empty special bins cannot sit on a log axis
        extra.data["count"] = [c if c > 0 else np.nan for c in extra.data["count"]]
    bars = fig.quad(
        left="left",
        right="right",
        top="count",
        bottom=bottom,
        source=bins,
        fill_color="#252525",
        line_color="white",
        name=f"{name}-bins",
    )
    marks = fig.quad(
        left="left",
        right="right",
        top="count",
        bottom=bottom,
        source=extra,
        fill_color="color",
        line_color="white",
        name=f"{name}-special",
    )
    fig.add_tools(
        HoverTool(
            renderers=[bars, marks],
            tooltips=[
                ("bin", "@bin"),
                ("count", "@count{0,0}"),
                ("fraction", "@fraction{0.[0000]%}"),
            ],
        )
    )
    _axis(fig, lo, hi)
    if formats:  # beside the plot, never over the bars; a swatch per format
        legend = fig.legend[0]
        legend.click_policy = "hide"
        legend.label_text_font_size = "8pt"
        legend.location = "top_left"
        fig.add_layout(legend, "right")
        fig.width += 190
    return fig
