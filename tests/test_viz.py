"""Bokeh figure builders (scalescope.viz): structure of each figure, offline HTML export."""

from __future__ import annotations

import json
import math
import re
import subprocess
from html.parser import HTMLParser

import numpy as np
import pandas as pd
import pytest
from bokeh.layouts import column
from bokeh.models import (
    BoxAnnotation,
    ColorBar,
    CustomJSHover,
    CustomJSTickFormatter,
    GlyphRenderer,
    HoverTool,
    Image,
    LinearColorMapper,
    Span,
    TapTool,
)
from conftest import node_binary

from scalescope import viz

FORMAT_INFO = {
    "e4m3": {"max": 448.0, "min_normal": 2.0**-6, "min_subnormal": 2.0**-9},
    "e5m2": {"max": 57344.0, "min_normal": 2.0**-14, "min_subnormal": 2.0**-16},
    "fp16": {"max": 65504.0, "min_normal": 2.0**-14, "min_subnormal": 2.0**-24},
    "bf16": {"max": 3.3895313892515355e38, "min_normal": 2.0**-126, "min_subnormal": 2.0**-133},
}
HIST_LABELS = ["zero", "below", *(f"2^{e}" for e in range(-40, 24)), "above", "nonfinite"]
UNEVEN_STEPS = [0, 1, 2, 5, 10, 50, 100, 400]


def _matrix(n_ops: int = 6, steps=UNEVEN_STEPS, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    values = rng.random((n_ops, len(steps)))
    values[1, 3] = np.nan
    values[4, 0] = np.nan
    return pd.DataFrame(values, index=[10 * i + 3 for i in range(n_ops)], columns=list(steps))


def _images(fig) -> list[GlyphRenderer]:
    return [r for r in fig.renderers if isinstance(r.glyph, Image)]


def _mapper(fig) -> LinearColorMapper:
    return _images(fig)[0].glyph.color_mapper


# --- heatmap -----------------------------------------------------------------------------


def test_heatmap_one_image_with_the_matrix_values():
    matrix = _matrix()
    fig = viz.heatmap(matrix, metric="underflow_e4m3")
    assert fig.name == "heatmap"
    images = _images(fig)
    assert len(images) == 1
    assert len(fig.renderers) == 1  # no rect per cell, nothing else drawn
    data = images[0].data_source.data["image"]
    assert len(data) == 1
    image = np.asarray(data[0])
    assert image.shape == matrix.shape
    np.testing.assert_array_equal(image, matrix.to_numpy())  # NaN preserved in place
    assert np.isnan(image[1, 3]) and np.isnan(image[4, 0])
    glyph = images[0].glyph
    assert (glyph.x, glyph.y, glyph.dw, glyph.dh) == (-0.5, -0.5, matrix.shape[1], matrix.shape[0])


def test_heatmap_color_mapper_colour_bar_and_nan_colour():
    fig = viz.heatmap(_matrix(), metric="rms", name="rms-map")
    assert fig.name == "rms-map"
    mapper = _mapper(fig)
    assert mapper.nan_color not in mapper.palette
    bars = [c for c in fig.right if isinstance(c, ColorBar)]
    assert len(bars) == 1 and bars[0].color_mapper is mapper


@pytest.mark.parametrize(
    "metric, low, high",
    [
        ("underflow_e4m3", 0.0, 1.0),
        ("overflow_fp16", 0.0, 1.0),
        ("subnormal_e5m2", 0.0, 1.0),
        ("frac_zero", 0.0, 1.0),
        ("log2_rms", -8.0, 8.0),
        ("snr_e4m3", 0.0, 80.0),
        ("rms", -3.0, 0.5),
    ],
)
def test_heatmap_colour_range_per_metric_family(metric, low, high):
    values = np.array([[0.1, -3.0, np.nan], [0.5, np.inf, 0.2]])
    matrix = pd.DataFrame(values, index=[0, 1], columns=[0, 1, 2])
    mapper = _mapper(viz.heatmap(matrix, metric=metric))
    assert (mapper.low, mapper.high) == (low, high)


def test_heatmap_palettes_per_family():
    frac = _mapper(viz.heatmap(_matrix(), metric="underflow_e4m3")).palette
    snr = _mapper(viz.heatmap(_matrix(), metric="snr_e4m3")).palette
    log2 = _mapper(viz.heatmap(_matrix(), metric="log2_rms")).palette
    assert snr[0] == frac[-1] and snr[-1] == frac[0]  # low SNR takes the alarming end
    assert log2[0] != log2[-1] and len(log2) == 256
    assert viz.metric_family("overflow_bf16") == "fraction"
    assert viz.metric_family("scale") == "other"


def _shade(palette, value: float) -> int:
    """Index in the alarm palette of the colour a 0..1 mapper gives ``value``."""
    colour = palette[min(int(value * len(palette)), len(palette) - 1)]
    return viz.theme.ALARM_LOW_TO_HIGH.index(colour)


def test_heatmap_fraction_colours_are_fixed_and_spaced_by_decade():
    zeros = pd.DataFrame(np.zeros((2, 2)), index=[0, 1], columns=[0, 1])
    mapper = _mapper(viz.heatmap(zeros, metric="underflow_e4m3"))
    assert (mapper.low, mapper.high) == (0.0, 1.0)  # fixed, whatever the values
    # 1.5 % must not look like 99 %: a third of the palette apart, and 0 the lightest
    palette = list(mapper.palette)
    zero, small, large = _shade(palette, 0.0), _shade(palette, 0.015), _shade(palette, 0.99)
    assert zero == 0 and large >= 250 and 60 <= small <= large - 120
    # each decade from 0.1 % up takes about a third of the shades
    assert abs((_shade(palette, 0.1) - _shade(palette, 0.01)) - 85) <= 3
    fig = viz.heatmap(_matrix(), metric="frac_zero", low=0.0, high=1.0, palette=["#000", "#fff"])
    mapper = _mapper(fig)
    assert (mapper.low, mapper.high, list(mapper.palette)) == (0.0, 1.0, ["#000", "#fff"])


def test_heatmap_cell_maps_taps_back_to_op_and_step():
    matrix = _matrix()
    fig = viz.heatmap(matrix, metric="rms")
    ops = list(matrix.index)
    for row, op in enumerate(ops):
        for col, step in enumerate(UNEVEN_STEPS):
            for dx, dy in [(0, 0), (0.49, -0.49), (-0.5, 0.3)]:
                assert viz.heatmap_cell(fig, col + dx, row + dy) == (op, step)
                assert viz.heatmap_cell(matrix, col + dx, row + dy) == (op, step)
    assert viz.heatmap_cell(fig, 3.6, 0.8) == (ops[1], 10)
    for x, y in [(-0.6, 0), (len(UNEVEN_STEPS) - 0.5, 0), (0, -0.51), (0, len(ops) - 0.5)]:
        assert viz.heatmap_cell(fig, x, y) is None
    assert viz.heatmap_cell(fig, math.nan, 0) is None
    with pytest.raises(ValueError):
        viz.heatmap_cell(object(), 0, 0)


def test_heatmap_hover_and_tap_tools():
    matrix = _matrix()
    labels = pd.Series({3: "Block_0/dot_general", 13: "Block_0/tanh"})
    fig = viz.heatmap(matrix, metric="rms", labels=labels)
    hovers = [t for t in fig.tools if isinstance(t, HoverTool)]
    assert len(hovers) == 1
    hover = hovers[0]
    fields = [field for _, field in hover.tooltips]
    assert "$x{step}" in fields and "$y{label}" in fields and "@image{value}" in fields
    assert isinstance(hover.formatters["$x"], CustomJSHover)
    assert hover.formatters["$x"].args["steps"] == UNEVEN_STEPS
    op_args = hover.formatters["$y"].args
    assert op_args["ops"] == list(matrix.index)
    assert op_args["labels"][:3] == ["Block_0/dot_general", "Block_0/tanh", "op 23"]
    assert any(isinstance(t, TapTool) for t in fig.tools)


def test_heatmap_axes_uneven_steps_and_labels():
    matrix = _matrix()
    labels = pd.Series({3: "first"})
    fig = viz.heatmap(matrix, metric="rms", labels=labels)
    formatter = fig.xaxis[0].formatter
    assert isinstance(formatter, CustomJSTickFormatter)
    assert formatter.args["steps"] == UNEVEN_STEPS
    yaxis = fig.yaxis[0]
    assert list(yaxis.ticker.ticks) == list(range(len(matrix)))
    assert yaxis.major_label_overrides[0] == "first"
    assert fig.y_range.start > fig.y_range.end  # first op on top

    many = pd.DataFrame(np.ones((100, 3)), columns=[0, 1, 2])
    assert list(viz.heatmap(many, metric="rms").yaxis[0].ticker.ticks) == []


def test_heatmap_js_snippets_map_pixels_to_steps_and_labels():
    """Run the hover/tick formatter code in node, as BokehJS compiles it."""
    node = node_binary()
    fig = viz.heatmap(_matrix(), metric="rms", labels=pd.Series({3: "a", 13: "b"}))
    hover = next(t for t in fig.tools if isinstance(t, HoverTool))
    step_js, op_js = hover.formatters["$x"], hover.formatters["$y"]
    tick_js = fig.xaxis[0].formatter
    value_js = hover.formatters["@image"]

    def fn(model, params):
        names = [*model.args.keys(), *params]
        return f"(new Function({json.dumps(names)[1:-1]}, {json.dumps(model.code)}))"

    def call(model, params, *values):
        args = [json.dumps(v) for v in model.args.values()]
        return f"{fn(model, params)}({', '.join([*args, *values])})"

    hov = ["value", "format", "special_vars"]
    exprs = [
        call(step_js, hov, "3.4", '"step"', "{}"),
        call(step_js, hov, "-0.7", '"step"', "{}"),
        call(op_js, hov, "0.6", '"label"', "{}"),
        call(op_js, hov, "0.6", '"id"', "{}"),
        call(tick_js, ["tick", "index", "ticks"], "6", "0", "[]"),
        call(tick_js, ["tick", "index", "ticks"], "2.5", "0", "[]"),
        call(value_js, hov, "NaN", '"value"', "{}"),
        call(value_js, hov, "0.000012345", '"value"', "{}"),
        call(value_js, hov, "0.25", '"value"', "{}"),
    ]
    script = f"console.log(JSON.stringify([{', '.join(exprs)}]))"
    out = subprocess.run([node, "-e", script], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == ["5", "", "b", "13", "100", "", "no data", "1.234e-5", "0.25"]


def test_heatmap_empty_and_large():
    empty = viz.heatmap(pd.DataFrame(), metric="rms")
    assert empty.name == "heatmap" and not _images(empty)
    big = pd.DataFrame(np.random.default_rng(0).random((2000, 1000)), columns=np.arange(1000) * 10)
    fig = viz.heatmap(big, metric="snr_e4m3")
    assert len(_images(fig)) == 1
    assert viz.heatmap_cell(fig, 999, 1999) == (1999, 9990)
    small = viz.heatmap(big.iloc[:5, :5].astype(np.float32), metric="rms")
    assert np.asarray(_images(small)[0].data_source.data["image"][0]).dtype == np.float32


# --- timeseries ----------------------------------------------------------------------------


def test_timeseries_lines_markers_legend_and_log_drop():
    frame = pd.DataFrame(
        {"scale": [1.0, 2.0, 0.0, 4.0], "rms": [1.0, 0.5, -0.2, 0.1], "absmax": [3, 3, 3, 3]},
        index=[0, 10, 20, 50],
    )
    fig = viz.timeseries(frame, title="op 3")
    assert fig.name == "timeseries"
    assert [item.label.value for item in fig.legend[0].items] == ["scale", "rms", "absmax"]
    assert len(fig.renderers) == 6  # a line and markers per column
    sources = {r.data_source.name: r.data_source.data for r in fig.renderers}
    scale = np.asarray(sources["series-scale"]["value"])
    assert np.isnan(scale[2]) and scale[3] == 4.0
    assert np.isnan(np.asarray(sources["series-rms"]["value"])[2])
    assert any("2 value(s) <= 0" in t.text for t in fig.below if hasattr(t, "text"))
    linear = viz.timeseries(frame, log_y=False, name="ts")
    assert linear.name == "ts"
    assert np.asarray(
        {r.data_source.name: r.data_source.data for r in linear.renderers}["series-rms"]["value"]
    )[2] == pytest.approx(-0.2)


# --- exponent histogram -----------------------------------------------------------------------


def _counts() -> pd.Series:
    counts = pd.Series(0, index=HIST_LABELS, dtype=np.int64)
    counts["2^-12"] = 5
    counts["2^-3"] = 40
    counts["2^0"] = 100
    counts["2^9"] = 2
    counts["zero"] = 7
    counts["nonfinite"] = 1
    return counts


def test_histogram_bars_one_per_nonempty_bin():
    fig = viz.exponent_histogram(_counts(), FORMAT_INFO)
    assert fig.name == "histogram"
    bins = fig.select_one({"name": "histogram-bins"}).data_source.data
    assert list(bins["left"]) == [-12, -3, 0, 9]
    assert list(bins["right"]) == [-11, -2, 1, 10]
    assert list(bins["count"]) == [5, 40, 100, 2]
    special = fig.select_one({"name": "histogram-special"}).data_source.data
    by_bin = dict(zip(special["bin"], special["count"]))
    assert by_bin == {"zero": 7, "below": 0, "above": 0, "nonfinite": 1}
    lefts = dict(zip(special["bin"], special["left"]))
    assert lefts["zero"] < lefts["below"] < -40 and 23 < lefts["above"] < lefts["nonfinite"]
    labels = fig.xaxis[0].major_label_overrides
    assert {labels[x + 0.5] for x in lefts.values()} == {"zero", "below", "above", "nonfinite"}


def test_histogram_format_ranges():
    fig = viz.exponent_histogram(_counts(), FORMAT_INFO)
    boxes = {b.name: b for b in fig.center if isinstance(b, BoxAnnotation)}
    assert len(boxes) == 2 * len(FORMAT_INFO)
    normal, sub = boxes["e4m3-normal"], boxes["e4m3-subnormal"]
    assert (normal.left, normal.right) == (-6.0, pytest.approx(math.log2(448)))
    assert (sub.left, sub.right) == (-9.0, -6.0)
    assert sub.fill_alpha < normal.fill_alpha
    assert normal.fill_color == sub.fill_color != boxes["fp16-normal"].fill_color
    assert (boxes["fp16-subnormal"].left, boxes["fp16-normal"].left) == (-24.0, -14.0)
    spans = {s.name: s.location for s in fig.center if isinstance(s, Span)}
    assert spans["e4m3-max"] == pytest.approx(math.log2(448))
    assert spans["e5m2-max"] == pytest.approx(math.log2(57344))
    legend = [item.label.value for item in fig.legend[0].items]
    assert len(legend) == 4 and all(any(f in label for label in legend) for f in FORMAT_INFO)


def test_histogram_legend_beside_the_bars_and_labels_apart():
    fig = viz.exponent_histogram(_counts(), FORMAT_INFO)
    # the legend (a swatch per format) sits right of the plot, not over the bars
    assert fig.legend[0] in fig.right and fig.legend[0] not in fig.center
    swatches = [r for r in fig.renderers if r.name.endswith("-legend")]
    assert len(swatches) == len(FORMAT_INFO)
    assert all(r.glyph.fill_color for r in swatches)
    # no two ticks closer than 2 bins: their rotated labels never overlap
    ticks = sorted(fig.xaxis[0].ticker.ticks)
    assert min(np.diff(ticks)) >= 2, ticks


def test_histogram_format_subset_log_counts_and_format_objects():
    from scalescope.core.formats import FORMATS

    fig = viz.exponent_histogram(_counts(), FORMATS, formats=["e4m3"], log_counts=True)
    boxes = {b.name for b in fig.center if isinstance(b, BoxAnnotation)}
    assert boxes == {"e4m3-normal", "e4m3-subnormal"}
    assert fig.y_scale.__class__.__name__ == "LogScale"
    assert viz.format_bounds(FORMATS["e4m3"])["subnormal"] == (-9.0, -6.0)


# --- SNR ------------------------------------------------------------------------------------


def test_snr_bars_thresholds_and_inf_clip():
    snr = pd.Series({"e4m3": 31.0, "e5m2": 24.0, "bf16": 52.0, "fp32": np.inf})
    fig = viz.snr_chart(snr, thresholds={"e4m3": 25.0, "e5m2": 25.0})
    assert fig.name == "snr"
    data = fig.select_one({"name": "snr-bars"}).data_source.data
    assert list(data["format"]) == ["e4m3", "e5m2", "bf16", "fp32"]
    assert list(data["snr"][:3]) == [31.0, 24.0, 52.0] and data["snr"][3] == 70.0
    marks = fig.select_one({"name": "snr-thresholds"}).data_source.data
    assert list(marks["x"]) == ["e4m3", "e5m2"] and list(marks["y"]) == [25.0, 25.0]
    assert any("clipped at 70 dB" in t.text for t in fig.below if hasattr(t, "text"))
    assert (
        viz.snr_chart(snr, clip_db=200).select_one({"name": "snr-bars"}).data_source.data["snr"][3]
        == 200
    )


def test_snr_bars_say_when_they_are_zero_or_nan():
    snr = pd.Series({"e4m3": 0.0, "e5m2": np.nan, "bf16": 40.0})
    fig = viz.snr_chart(snr)
    text = fig.select_one({"name": "snr-flat-labels"}).data_source.data
    assert list(text["x"]) == ["e4m3", "e5m2"]
    assert list(text["text"]) == ["0.0 dB", "NaN (no finite element)"]
    assert viz.snr_chart(pd.Series({"bf16": 40.0})).select_one({"name": "snr-flat-labels"}) is None


def test_snr_lines_threshold_spans():
    frame = pd.DataFrame(
        {"e4m3": [30.0, 29.0, 20.0], "fp16": [np.inf, 70.0, 68.0]}, index=[0, 10, 100]
    )
    fig = viz.snr_chart(frame, thresholds={"e4m3": 25.0, "fp16": 40.0}, name="snr-steps")
    assert fig.name == "snr-steps"
    spans = {s.name: s for s in fig.center if isinstance(s, Span)}
    assert spans["threshold-e4m3"].location == 25.0
    assert spans["threshold-fp16"].location == 40.0
    assert spans["threshold-e4m3"].dimension == "width"
    assert [item.label.value for item in fig.legend[0].items] == ["e4m3", "fp16"]
    ys = [np.asarray(r.data_source.data["snr"]) for r in fig.renderers]
    assert any(y[0] == 80.0 for y in ys)  # inf clipped at ceil((70 + 10) / 10) * 10


# --- loss curve -------------------------------------------------------------------------------


def test_loss_curve_runs_dashes_and_first_nonfinite_step():
    steps = np.arange(10)
    good = pd.DataFrame({"loss": 3.0 - 0.1 * steps, "lr": 1e-3}, index=steps)
    good["val_loss"] = np.where(steps % 5 == 0, 3.1 - 0.1 * steps, np.nan)  # sparse, not NaN
    bad = good.copy()
    bad.loc[6:, "loss"] = np.nan
    bad.loc[4, "loss"] = 9.0
    fig = viz.loss_curve({"fp32": good, "fp8": bad})
    assert fig.name == "loss"
    lines = [r for r in fig.renderers if r.name != "nonfinite"]
    assert len(lines) == 4  # (loss, val_loss) x 2 runs; lr is not in columns
    assert [list(r.glyph.line_dash) for r in lines] == [[], [6]] * 2  # solid, dashed
    assert lines[0].glyph.line_color == lines[1].glyph.line_color != lines[2].glyph.line_color
    val = lines[1].data_source.data  # sparse val_loss: logged points joined, gaps skipped
    assert list(val["x"]) == [0, 5] and list(val["y"]) == pytest.approx([3.1, 2.6])
    assert list(lines[2].data_source.data["x"]) == [0, 1, 2, 3, 4, 5]  # diverged loss ends
    marks = fig.select_one({"name": "nonfinite"}).data_source.data
    assert list(marks["step"]) == [6] and list(marks["run"]) == ["fp8"]
    assert marks["y"][0] == 9.0  # the top of the finite range

    inf = good.copy()
    inf.loc[3, "loss"] = np.inf
    single = viz.loss_curve(inf, name="loss-1")
    assert single.name == "loss-1"
    assert list(single.select_one({"name": "nonfinite"}).data_source.data["step"]) == [3]
    assert viz.loss_curve(good).select_one({"name": "nonfinite"}) is None
    assert viz.loss_curve(good).select_one({"name": "no-loss"}) is None


def test_a_loss_curve_without_loss_says_so_and_bokeh_does_not_warn():
    """A run that logged no loss: the figure says so in its plot area, and holds a
    renderer, so Bokeh's empty-plot warning (W-1000) does not reach a report's stderr
    or the server's log; on a log axis the text sits where the axis can draw it."""
    from bokeh.core.validation.check import check_integrity

    for log_y in (False, True):
        fig = viz.loss_curve({"run": pd.DataFrame({"lr": [1e-3, 1e-3]})}, log_y=log_y)
        (said,) = fig.select({"name": "no-loss"})
        text = said.data_source.data["text"]
        assert text == ["no loss or val_loss logged (run.log(step, loss=...))"], text
        assert said.data_source.data["y"][0] > 0 or not log_y
        issues = check_integrity(fig.references())
        assert not [w for w in issues.warning if w.code == 1000], issues
    only = viz.loss_curve(pd.DataFrame({"lr": [1.0]}), columns=("grad_norm",))
    (said,) = only.select({"name": "no-loss"})
    assert said.data_source.data["text"] == ["no grad_norm logged (run.log(step, grad_norm=...))"]


# --- standalone HTML ----------------------------------------------------------------------------


class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[str] = []
        self.inline_js: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        self.links += [v or "" for k, v in attrs if k in ("src", "href")]
        self._in_script = tag == "script"

    def handle_endtag(self, tag):
        self._in_script = False

    def handle_data(self, data):
        if self._in_script:
            self.inline_js.append(data)


def test_standalone_html_is_offline_and_self_contained():
    layout = column(
        viz.heatmap(_matrix(), metric="log2_rms"),
        viz.timeseries(pd.DataFrame({"rms": [1.0, 2.0]}, index=[0, 5])),
        viz.exponent_histogram(_counts(), FORMAT_INFO),
        viz.snr_chart(pd.Series({"e4m3": 30.0, "fp32": np.inf}), thresholds={"e4m3": 25.0}),
        viz.loss_curve(pd.DataFrame({"loss": [2.0, np.nan]}, index=[0, 1])),
        name="report",
    )
    html = viz.standalone_html(layout, "precision audit")
    parser = _Links()
    parser.feed(html)
    assert not [link for link in parser.links if link.startswith(("http:", "https:", "//"))]
    assert "<title>precision audit</title>" in html
    inline = "".join(parser.inline_js)
    assert "Bokeh" in inline and len(inline) > 500_000  # BokehJS itself is inline
    for name in ("heatmap", "timeseries", "histogram", "snr", "loss", "report"):
        assert f'"name":"{name}"' in html.replace(" ", "")


# --- grouped heatmap rows ----------------------------------------------------------------

GROUP_NAMES = [
    ("fwd", "block_0/attn/dot_general"),
    ("fwd", "block_0/attn/q/dot_general"),
    ("fwd", "block_0/mlp/mul"),
    ("fwd", "layers/3/mlp/mul"),
    ("fwd", "layers/3/attn/exp"),
    ("fwd", "dot_general"),
    ("bwd", "block_0/mlp/mul"),
    ("bwd", "layers/3/mlp/add_any"),
    ("opt", "opt/mul"),
    ("fwd", "layers/12/mlp/mul"),
    ("fwd", "block_0/attn/exp"),  # joins block_0 after other groups: not contiguous
]


def _group_ops() -> pd.DataFrame:
    passes, names = zip(*GROUP_NAMES)
    index = pd.Index([7 + 3 * i for i in range(len(names))], name="op")
    return pd.DataFrame({"name": names, "pass": passes}, index=index)


def _reference_key(pass_: str, name: str, depth: int) -> str:
    """The group key written independently: a numeric path component is glued to its
    parent with a placeholder, then the scope is cut at ``depth``."""
    scope = name.rsplit("/", 1)[0] if "/" in name else ""
    if scope == pass_ or scope.startswith(pass_ + "/"):
        scope = scope[len(pass_) + 1 :]
    glued = [p.replace("\0", "/") for p in re.sub(r"/(\d+)(?=/|$)", "\0\\1", scope).split("/")]
    return "/".join([pass_, *[p for p in glued if p][:depth]])


def test_group_keys_match_a_reference():
    from scalescope import analysis as A

    ops = _group_ops()
    for depth in (0, 1, 2, 3):
        ref = [_reference_key(p, n, depth) for p, n in zip(ops["pass"], ops["name"])]
        assert A.group_keys(ops, depth).tolist() == ref, depth
    keys = A.group_keys(ops, 1)
    assert keys[7] == "fwd/block_0" and keys[16] == "fwd/layers/3" and keys[22] == "fwd"
    assert keys[31] == "opt" and keys[34] == "fwd/layers/12"
    assert A.group_keys(ops, 2)[10] == "fwd/block_0/attn"
    assert A.max_depth(ops) == 3
    # values constant by construction (a mask's fill, optimizer scalars) group apart from
    # their scope's: a collapsed row's worst member was a -1e9 fill at every step
    marked = ops.assign(origin="")
    marked.loc[[7, 31], "origin"] = ["fill", "constant"]
    keys = A.group_keys(marked, 1)
    assert keys[7] == "fwd/block_0 (constants)" and keys[31] == "opt (constants)"
    others = keys.drop([7, 31])
    assert others.tolist() == A.group_keys(ops, 1).drop([7, 31]).tolist()


def _reference_rows(matrix, measured, keys, metric):
    """Per group: the worst member value per column over measured cells (a measured NaN
    wins) and the first member (op order) holding it, with pandas on a long frame."""
    long = matrix.stack(future_stack=True).rename("value").reset_index()
    long.columns = ["op", "step", "value"]
    long["here"] = measured.stack(future_stack=True).to_numpy()
    long["group"] = keys.reindex(long["op"]).to_numpy()
    long = long[long["here"]]
    out, who = {}, {}
    for (group, step), cell in long.groupby(["group", "step"], sort=False):
        cell = cell.sort_values("op")
        nan = cell["value"].isna()
        if nan.any():
            out[group, step], who[group, step] = np.nan, int(cell.loc[nan, "op"].iloc[0])
            continue
        v = cell["value"].to_numpy()
        if metric.startswith("snr"):
            best = v.min()
        elif metric.startswith("log2"):
            best = max(v.max(), v.min(), key=abs)  # larger magnitude; max on a tie
        else:
            best = v.max()
        out[group, step] = best
        who[group, step] = int(cell["op"].to_numpy()[np.flatnonzero(v == best)[0]])
    return out, who


@pytest.mark.parametrize("metric", ["overflow_e4m3", "snr_e4m3", "log2_rms"])
def test_collapsed_group_rows_hold_the_worst_member(metric):
    from scalescope import analysis as A

    ops = _group_ops()
    rng = np.random.default_rng(1)
    steps = [0, 5, 10, 15]
    values = rng.normal(0, 3, (len(ops), len(steps)))
    values[2, 1] = np.nan  # a measured NaN: its group's cell is NaN
    values[4, 2] = 99.0  # unmeasured below: must not count
    matrix = pd.DataFrame(values, index=ops.index, columns=pd.Index(steps, name="step"))
    measured = pd.DataFrame(True, index=matrix.index, columns=matrix.columns)
    measured.iloc[4, 2] = False
    measured.iloc[3, :] = False  # never measured
    measured.iloc[6, 3] = False
    keys = A.group_keys(ops, 1)
    rows = A.group_matrix(matrix, keys, metric, expanded=[], measured=measured)
    ref, who = _reference_rows(matrix, measured, keys, metric)
    # every group of more than one op is one row; a single op stays an op row
    sizes = keys.value_counts()
    assert sorted(rows.keys[rows.collapsed]) == sorted(sizes.index[sizes > 1])
    assert len(rows.ops) == len(sizes)
    for r, key in enumerate(rows.keys):
        for c, step in enumerate(steps):
            got = rows.values[r, c]
            if not rows.collapsed[r]:  # a group of one op: that op's row, as it is
                assert rows.ops[r] == keys.index[keys == key][0]
                want = matrix.loc[rows.ops[r], step]
            else:
                want = ref.get((key, step), np.nan)
                assert rows.worst[r, c] == who.get((key, step), -1), (key, step)
            assert (np.isnan(want) and np.isnan(got)) or got == want, (key, step, got, want)
    # the figure shows those rows; hover names the worst member (by label)
    labels = A.op_labels(ops)
    fig = viz.heatmap(
        matrix, metric=metric, labels=labels, measured=measured, groups=keys, expanded=[]
    )
    image = np.asarray(_images(fig)[0].data_source.data["image"][0])
    np.testing.assert_array_equal(image, rows.values)
    fmt = next(t for t in fig.tools if isinstance(t, HoverTool)).formatters["$y"]
    worst = np.asarray(fmt.args["worst"].data["worst"][0])
    named = [[fmt.args["names"][w] if w >= 0 else None for w in row] for row in worst]
    expect = [[labels[w] if w >= 0 else None for w in row] for row in rows.worst]
    assert named == expect


def test_grouped_heatmap_expands_collapses_and_keeps_small_runs_per_op():
    from scalescope import analysis as A

    ops = _group_ops()
    keys = A.group_keys(ops, 1)
    matrix = _matrix(len(ops))
    matrix.index = ops.index
    # a small run: every group expanded, one row per op in op order, as before
    fig = viz.heatmap(matrix, metric="rms", groups=keys, labels=A.op_labels(ops))
    tag = fig.tags[0]["scalescope.heatmap"]
    assert tag["ops"] == list(ops.index) and not any(tag["collapsed"])
    assert viz.heatmap_cell(fig, 0, 2) == (ops.index[2], UNEVEN_STEPS[0])
    assert fig.yaxis[0].ticker.tags == ["rows"]  # rows tall enough: a label per row
    # collapse everything: one row per group (single ops stay), in place
    assert viz.update_heatmap(fig, matrix, metric="rms", groups=keys, expanded=[])
    tag = fig.tags[0]["scalescope.heatmap"]
    assert len(tag["ops"]) == keys.nunique()
    first = tag["groups"][0]
    assert first == "fwd/block_0" and tag["collapsed"][0] and tag["ops"][0] == -1
    assert viz.heatmap_group(fig, 0.2) == "fwd/block_0" and viz.heatmap_cell(fig, 0, 0) is None
    # expand one group: its members' rows replace its row, in op order
    assert viz.update_heatmap(fig, matrix, metric="rms", groups=keys, expanded=[first])
    tag = fig.tags[0]["scalescope.heatmap"]
    members = list(keys.index[keys == first])
    assert tag["ops"][: len(members)] == members and tag["expanded"] == [first]
    assert len(tag["ops"]) == keys.nunique() - 1 + len(members)
    assert viz.heatmap_group(fig, 0) is None
    image = np.asarray(_images(fig)[0].data_source.data["image"][0])
    assert image.shape == (len(tag["ops"]), len(UNEVEN_STEPS))
    np.testing.assert_array_equal(image[: len(members)], matrix.loc[members].to_numpy())
    # a figure without groups is not updated with groups (and the reverse)
    assert not viz.update_heatmap(
        viz.heatmap(matrix, metric="rms"), matrix, metric="rms", groups=keys
    )
    assert not viz.update_heatmap(fig, matrix, metric="rms")


def _layer_groups(n: int, per_layer: int) -> tuple[pd.Series, pd.DataFrame]:
    """Group keys and an all-ones matrix of ``n`` forward ops, ``per_layer`` per layer."""
    from scalescope import analysis as A

    ops = pd.DataFrame(
        {"name": [f"layers/{i // per_layer}/mlp/mul" for i in range(n)], "pass": ["fwd"] * n},
        index=pd.Index(range(n), name="op"),
    )
    matrix = pd.DataFrame(np.ones((n, 3)), index=ops.index, columns=[0, 1, 2])
    return A.group_keys(ops, 1), matrix


def test_grouped_heatmap_grows_to_label_every_row():
    """A few hundred rows (collapsed groups, or the ops of an expanded one): the figure
    grows so that every row, the expanded group's ops too, gets its own label."""
    n = 200
    keys, matrix = _layer_groups(n, per_layer=10)
    fig = viz.heatmap(matrix, metric="rms", groups=keys, expanded=set(keys))
    ticker = fig.yaxis[0].ticker
    assert ticker.tags == ["rows"] and ticker.ticks == list(range(n))
    assert (fig.height - 90) / n >= viz.heatmap_groups.MIN_ROW_PX
    labels = fig.yaxis[0].formatter.args["labels"]
    assert all(labels) and len(set(labels)) == n
    collapsed = viz.heatmap(matrix, metric="rms", groups=keys, expanded=[])
    assert collapsed.yaxis[0].ticker.ticks == list(range(20))  # every group labelled


def test_grouped_heatmap_labels_rows_or_groups_by_row_height():
    """Many rows: group labels (one per group start); few rows: a label per row. The
    browser's range callback does the same on zoom (run here in node)."""
    n = 900
    keys, matrix = _layer_groups(n, per_layer=30)
    fig = viz.heatmap(matrix, metric="rms", groups=keys, expanded=set(keys))
    ticker = fig.yaxis[0].ticker
    assert ticker.tags == ["groups"] and ticker.ticks[:3] == [0, 30, 60]
    fmt = fig.yaxis[0].formatter
    assert fmt.args["sections"][30] == "▾ fwd/layers/1 (30 ops)" and fmt.args["sections"][31] == ""
    node = node_binary()
    callback = fig.y_range.js_property_callbacks["change:start"][0]

    def zoom(start, end):
        args = {
            "y_range": {"start": start, "end": end},
            "fig": {"inner_height": 550, "height": 640},
            "ticker": {"tags": [], "ticks": []},
            "labels": callback.args["labels"],
            "starts": callback.args["starts"],
            "min_px": callback.args["min_px"],
        }
        names = list(args)
        body = f"(new Function({json.dumps(names)[1:-1]}, {json.dumps(callback.code)}))"
        values = ", ".join(json.dumps(args[k]) for k in names)
        script = (
            f"const a = [{values}]; {body}(...a); "
            "console.log(JSON.stringify([a[2].tags, a[2].ticks]))"
        )
        out = subprocess.run([node, "-e", script], capture_output=True, text=True, check=True)
        return json.loads(out.stdout)

    assert zoom(n - 0.5, -0.5)[0] == ["groups"]
    tags, ticks = zoom(49.5, 9.5)  # 40 rows in 550 px: a label per row
    assert tags == ["rows"] and ticks == list(range(10, 50))
