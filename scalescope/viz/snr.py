"""Quantisation SNR (dB) per format: bars for one op/step, lines over steps."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from bokeh.models import ColumnDataSource, HoverTool, Span, Title
from bokeh.plotting import figure

from . import theme

_TOOLS = "pan,wheel_zoom,box_zoom,reset,save"


def default_clip(snr: pd.Series | pd.DataFrame, thresholds: dict[str, float] | None) -> float:
    """Top of the chart, where ``inf`` (an exact cast) is drawn: 10 dB above every finite
    value and threshold, rounded up to a multiple of 10; 100 dB when there is nothing finite."""
    values = np.asarray(snr, dtype=float).ravel()
    values = np.concatenate([values, np.asarray(list((thresholds or {}).values()), dtype=float)])
    finite = values[np.isfinite(values)]
    if not finite.size:
        return 100.0
    return float(math.ceil((finite.max() + 10.0) / 10.0) * 10.0)


def _clipped(values: np.ndarray, clip: float) -> tuple[np.ndarray, np.ndarray]:
    """Values with ``+inf`` replaced by ``clip`` (and ``-inf`` dropped), and where that happened."""
    values = np.asarray(values, dtype=float)
    exact = np.isposinf(values)
    shown = np.where(exact, clip, values)
    shown[np.isneginf(shown)] = np.nan
    return shown, exact


def _note(fig, text: str) -> None:
    fig.add_layout(Title(text=text, text_font_size="8pt", text_font_style="italic"), "below")


def _bar_label(value: float, exact: bool) -> str:
    """What a bar stands for: ``inf (exact)``, ``NaN (no finite element)``, or dB."""
    if exact:
        return "inf (exact)"
    if not np.isfinite(value):
        return "NaN (no finite element)"
    return f"{value:.1f} dB"


def _bars(fig, snr: pd.Series, thresholds: dict[str, float], clip: float) -> bool:
    """One bar per format (+ a threshold mark across its bar); True if any bar is clipped."""
    formats = [str(f) for f in snr.index]
    shown, exact = _clipped(snr.to_numpy(dtype=float), clip)
    source = ColumnDataSource(
        {
            "format": formats,
            "snr": shown,
            "label": [_bar_label(v, e) for v, e in zip(shown, exact)],
            "threshold": [thresholds.get(f, np.nan) for f in formats],
            "color": [theme.format_color(f, i) for i, f in enumerate(formats)],
        },
        name="snr-source",
    )
    bars = fig.vbar(
        x="format",
        top="snr",
        width=0.7,
        source=source,
        fill_color="color",
        line_color="color",
        name="snr-bars",
    )
    tips = [("format", "@format"), ("SNR", "@label"), ("threshold", "@threshold{0.0} dB")]
    fig.add_tools(HoverTool(renderers=[bars], tooltips=tips))
    # a bar of height 0 or NaN is invisible: its value is written where it would stand
    flat = [i for i, v in enumerate(shown) if not np.isfinite(v) or v <= 0]
    if flat:
        fig.text(
            x=[formats[i] for i in flat],
            y=[0.0] * len(flat),
            text=[source.data["label"][i] for i in flat],
            text_align="center",
            text_baseline="bottom",
            text_font_size="9pt",
            name="snr-flat-labels",
        )
    marked = [f for f in formats if f in thresholds]
    if marked:
        fig.rect(
            x=marked,
            y=[thresholds[f] for f in marked],
            width=0.9,
            height=3,
            height_units="screen",
            color="black",
            name="snr-thresholds",
        )
    return bool(exact.any())


def _lines(fig, snr: pd.DataFrame, thresholds: dict[str, float], clip: float) -> bool:
    """One line per format over steps, a dashed threshold `Span` per format; True if clipped."""
    steps = np.asarray(snr.index, dtype=float)
    any_exact = False
    for i, fmt in enumerate(snr.columns):
        color = theme.format_color(str(fmt), i)
        shown, exact = _clipped(snr[fmt].to_numpy(dtype=float), clip)
        any_exact |= bool(exact.any())
        source = ColumnDataSource({"step": steps, "snr": shown, "format": [str(fmt)] * len(steps)})
        fig.line("step", "snr", source=source, color=color, line_width=2, legend_label=str(fmt))
        fig.scatter("step", "snr", source=source, color=color, size=4, legend_label=str(fmt))
    for i, (fmt, level) in enumerate(thresholds.items()):
        fig.add_layout(
            Span(
                location=float(level),
                dimension="width",
                line_color=theme.format_color(str(fmt), i),
                line_dash="dashed",
                line_width=1.5,
                name=f"threshold-{fmt}",
            )
        )
    fig.add_tools(HoverTool(tooltips=[("format", "@format"), ("step", "@step"), ("SNR", "@snr")]))
    if len(snr.columns):
        fig.legend.click_policy = "hide"
        fig.legend.location = "bottom_left"
    return any_exact


def snr_chart(
    snr: pd.Series | pd.DataFrame,
    *,
    thresholds: dict[str, float] | None = None,
    clip_db: float | None = None,
    title: str | None = None,
    name: str = "snr",
) -> figure:
    """Quantisation SNR in dB per format, higher is better.

    ``snr``: a Series (index = format names) drawn as bars, or a DataFrame (index = step,
    columns = formats) drawn as lines over steps. ``thresholds`` (format -> dB): a black
    mark across the format's bar, or a dashed line in the format's colour. An ``inf`` SNR
    (the cast is exact) is drawn clipped at ``clip_db`` (default `default_clip`), and a
    note under the plot says so.
    """
    thresholds = dict(thresholds or {})
    clip = default_clip(snr, thresholds) if clip_db is None else float(clip_db)
    bars = isinstance(snr, pd.Series)
    ranges = {"x_range": [str(f) for f in snr.index]} if bars else {}
    fig = figure(
        name=name,
        title=title or "quantisation SNR",
        width=600 if bars else 700,
        height=320,
        tools=_TOOLS,
        toolbar_location="above",
        **ranges,
    )
    fig.yaxis.axis_label = "SNR (dB)"
    if bars:
        fig.y_range.start = 0
        fig.xgrid.visible = False
        clipped = _bars(fig, snr, thresholds, clip)
    else:
        fig.xaxis.axis_label = "step"
        clipped = _lines(fig, snr, thresholds, clip)
    if clipped:
        _note(fig, f"inf SNR (exact cast) drawn clipped at {clip:g} dB")
    return fig
