"""Colours, palettes and metric families shared by every scalescope figure.

One place decides how a metric is coloured, so the dashboard, the notebooks and the
report agree: the same format always has the same colour, and "alarming" is always the
dark red end of a sequential palette.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from bokeh.palettes import Category10_10, RdBu11, Viridis256, YlOrRd9, interp_palette

#: Colour of each audited format (histogram shading, SNR bars and lines).
FORMAT_COLORS: dict[str, str] = {
    "e4m3": "#d62728",
    "e5m2": "#ff7f0e",
    "fp16": "#2ca02c",
    "bf16": "#1f77b4",
    "fp32": "#7f7f7f",
}

#: Colours for series without a fixed colour (runs, metrics of one op).
SERIES_COLORS: tuple[str, ...] = tuple(Category10_10)

#: Colour of heatmap cells with no value: a NaN statistic (non-finite data), or, when the
#: heatmap is not told where ops were measured, an op not recorded at that step.
NAN_COLOR = "#d9d9d9"

#: Colour of heatmap cells of an op not measured at that step (transparent: blank).
BLANK_COLOR = "rgba(0, 0, 0, 0)"
#: Hatch behind a heatmap, seen through its blank cells.
UNMEASURED_HATCH = "/"
UNMEASURED_HATCH_COLOR = "#d0d0d0"

#: Colour of markers that flag a non-finite value (NaN/inf loss).
ALARM_COLOR = "#e31a1c"

#: Sequential, light (fine) -> dark red (alarming); 256 colours.
ALARM_LOW_TO_HIGH: tuple[str, ...] = tuple(interp_palette(tuple(reversed(YlOrRd9)), 256))
#: Sequential, dark red (alarming) -> light (fine): for SNR, where *low* is bad.
ALARM_HIGH_TO_LOW: tuple[str, ...] = tuple(reversed(ALARM_LOW_TO_HIGH))
#: Diverging, blue (negative) -> white (0) -> red (positive); 256 colours.
DIVERGING: tuple[str, ...] = tuple(interp_palette(tuple(reversed(RdBu11)), 256))
#: Neutral sequential palette for metrics without a family.
SEQUENTIAL: tuple[str, ...] = tuple(Viridis256)

#: Default half-width of the colour range of ``log2_*`` metrics (centred on 0).
LOG2_HALF_RANGE = 8.0
#: Fixed colour range of SNR metrics (dB): the same in every run and view, so a value
#: reads the same colour everywhere (an exact cast, inf, takes the top colour).
SNR_RANGE = (0.0, 80.0)
#: Fractions are coloured on a fixed 0..1 range with colours spaced by decade from
#: `FRACTION_FLOOR` to 1: 1.5 % and 99 % differ as much as 0.15 % and 1.5 %.
FRACTION_FLOOR = 1e-3


def _fraction_palette(n: int = 4096) -> tuple[str, ...]:
    """``n`` colours for a linear 0..1 mapper whose shade grows with log10 of the value
    (`FRACTION_FLOOR` and below: the lightest; 1: the darkest)."""
    top = len(ALARM_LOW_TO_HIGH) - 1
    lo = math.log10(FRACTION_FLOOR)
    out = []
    for i in range(n):
        value = (i + 0.5) / n
        shade = (math.log10(value) - lo) / -lo if value > FRACTION_FLOOR else 0.0
        out.append(ALARM_LOW_TO_HIGH[min(top, max(0, round(shade * top)))])
    return tuple(out)


#: The fraction palette (see `FRACTION_FLOOR`).
FRACTION_PALETTE: tuple[str, ...] = _fraction_palette()

_FRACTION_PREFIXES = ("underflow_", "overflow_", "subnormal_", "block_flush_", "frac_")


def format_color(fmt: str, i: int = 0) -> str:
    """Fixed colour of a known format, otherwise the ``i``-th series colour."""
    return FORMAT_COLORS.get(fmt, SERIES_COLORS[i % len(SERIES_COLORS)])


def series_color(i: int) -> str:
    """Colour of the ``i``-th series (cycles through Category10)."""
    return SERIES_COLORS[i % len(SERIES_COLORS)]


def metric_family(metric: str) -> str:
    """Family of a metric name, which decides its palette and colour range.

    ``"fraction"`` (``underflow_*``, ``overflow_*``, ``subnormal_*``, ``block_flush_*``,
    ``frac_*``),
    ``"snr"`` (``snr_*``, in dB), ``"log2"`` (``log2_*``, centred on 0) or ``"other"``.
    """
    if metric.startswith(_FRACTION_PREFIXES):
        return "fraction"
    if metric.startswith("snr_"):
        return "snr"
    if metric.startswith("log2_"):
        return "log2"
    return "other"


def palette_for(metric: str) -> Sequence[str]:
    """Default palette of a metric (see `metric_family`)."""
    return {
        "fraction": FRACTION_PALETTE,
        "snr": ALARM_HIGH_TO_LOW,
        "log2": DIVERGING,
    }.get(metric_family(metric), SEQUENTIAL)
