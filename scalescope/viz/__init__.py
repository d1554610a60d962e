"""Bokeh figure builders: one place for every scalescope figure.

The dashboard (Panel), the notebooks and the standalone HTML report all draw through these
functions, so a figure looks the same everywhere. Plain Bokeh only (no Panel import here),
no CDN or web fonts. Inputs are plain pandas/numpy objects, never a run directory. Every
builder returns a Bokeh model with a stable ``name=`` that browser tests look up with
``Bokeh.documents[0].get_model_by_name(name)``.
"""

from .export import standalone_html
from .heatmap import color_range, heatmap, heatmap_cell, heatmap_group, update_heatmap
from .histogram import exponent_histogram, format_bounds
from .lines import loss_curve, scale_ranges, timeseries
from .scale_graph import scale_graph_figure
from .snr import snr_chart
from .theme import FORMAT_COLORS, metric_family, palette_for

__all__ = [
    "FORMAT_COLORS",
    "color_range",
    "exponent_histogram",
    "format_bounds",
    "heatmap",
    "heatmap_cell",
    "heatmap_group",
    "loss_curve",
    "metric_family",
    "palette_for",
    "scale_graph_figure",
    "scale_ranges",
    "snr_chart",
    "standalone_html",
    "timeseries",
    "update_heatmap",
]
