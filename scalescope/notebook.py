"""Inline notebook views: scalescope figures and tables displayed in Jupyter, offline.

What displays inline (each object keeps its data, so it stays usable in code):

* ``reader.hist(op, step)`` -> `HistSeries`, a ``pd.Series`` of bin counts that draws the
  exponent histogram with each format's range shaded;
* ``reader.heatmap(metric)`` -> `HeatmapView` (``.matrix``, ``.figure``);
* ``reader.advise()`` -> `Advice`, a ``pd.DataFrame`` of findings shown as a table
  coloured by severity;
* ``reader.compare(other)`` -> `ComparisonView` (``.values``, ``.unmatched``, loss curves
  and a per-op ratio heatmap);
* ``show(stats, table, op=...)`` -> `StatsView`: the same histograms straight from the
  in-memory statistics of `scalescope.instrument`, no run directory needed.

BokehJS is loaded once per kernel (`load_notebook`, called by the first display) with
every byte inline: no CDN request, so the figures work offline. Figures come from
`scalescope.viz` and frames from `scalescope.analysis`; nothing here draws on its own.
Bokeh and the views are imported lazily, so ``import scalescope`` stays light.
"""

from __future__ import annotations

import html
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

#: BokehJS bundles loaded into the notebook: all but MathJax (1.8 MB; no scalescope
#: figure renders TeX).
BOKEH_COMPONENTS = ("bokeh", "bokeh-gl", "bokeh-widgets", "bokeh-tables")

#: Hosts that BokehJS, Panel and web fonts load from by default; a notebook output that
#: names one of them (outside `BOKEHJS_LAZY_URLS`) would not work offline.
CDN_HOSTS = (
    "cdn.bokeh.org",
    "cdn.holoviz.org",
    "cdn.jsdelivr.net",
    "unpkg.com",
    "cdnjs.cloudflare.com",
    "fonts.googleapis.com",
    "fonts.gstatic.com",
)

#: URLs written inside BokehJS itself that are requested only when a page uses TeX
#: (MathJax) or a ``TablerIcon``; no scalescope figure does, so they load nothing.
BOKEHJS_LAZY_URLS = (
    "https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-svg.js",
    "https://cdn.jsdelivr.net/npm/@tabler/icons-webfont@latest",
)

#: Row colours of the advisor table, by severity.
SEVERITY_COLORS = {
    "critical": "#fcbba1",
    "high": "#fdd0a2",
    "medium": "#fff2b2",
    "low": "#e5f5e0",
}

#: Most rows an HTML table shows (the data keeps them all).
MAX_HTML_ROWS = 60

_LOADED = False
_URL = re.compile(r"https?://[^\s\"'<>()\\]+")
_ELEMENT_ID = re.compile(r'id="([^"]+)"')

# Waits until BokehJS is defined and the output's div is attached to the page, then runs
# Bokeh's embed script: a frontend may run an output's scripts before attaching it.
_EMBED_JS = """(function () {{
  var tries = 0;
  function ready() {{
    return window.Bokeh !== undefined && document.getElementById("{element}") !== null;
  }}
  function run() {{
    if (ready()) {{
{script}
    }} else if (tries++ < 3000) {{
      setTimeout(run, 10);
    }} else {{
      console.error("scalescope: BokehJS is not loaded; run ss.load_notebook(force=True)");
    }}
  }}
  run();
}})();"""


# -- loading and embedding --------------------------------------------------------------


def in_notebook() -> bool:
    """Whether this code runs in a Jupyter kernel (an IPython shell with a kernel)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def notebook_resources() -> Any:
    """Bokeh resources with every byte of BokehJS inline (`BOKEH_COMPONENTS`)."""
    from bokeh.resources import Resources

    return Resources(mode="inline", components=list(BOKEH_COMPONENTS))


def load_notebook(force: bool = False) -> bool:
    """Load BokehJS into the notebook, inline (no CDN): once per kernel.

    Every scalescope view calls this before it displays, so an explicit call is only
    needed to load early, or with ``force=True`` when the output holding BokehJS was
    cleared and the page reloaded. Outside a Jupyter kernel it does nothing. Returns
    whether it published the loader now.
    """
    global _LOADED
    if (_LOADED and not force) or not in_notebook():
        return False
    from bokeh.io import output_notebook

    output_notebook(resources=notebook_resources(), hide_banner=True)
    _LOADED = True
    return True


def figure_html(model: Any) -> str:
    """HTML that draws a Bokeh model in a notebook output cell once BokehJS is loaded:
    a div and a script, no external resource."""
    from bokeh.embed import components

    script, div = components(model, wrap_script=False)
    match = _ELEMENT_ID.search(div)
    if match is None:  # pragma: no cover - Bokeh always writes an id
        raise RuntimeError(f"figure_html: no element id in Bokeh's div {div[:200]!r}")
    body = "\n".join("      " + line for line in script.splitlines())
    js = _EMBED_JS.format(element=match.group(1), script=body)
    return (
        f'<div class="scalescope-figure">{div}</div>\n'
        f'<script type="text/javascript">\n{js}\n</script>'
    )


def cdn_urls(text: str) -> list[str]:
    """URLs on a CDN host (`CDN_HOSTS`) in ``text``, except `BOKEHJS_LAZY_URLS`: what an
    offline notebook output must not contain."""
    found = []
    for url in _URL.findall(text):
        host = url.split("/")[2].lower()
        if any(host == h or host.endswith("." + h) for h in CDN_HOSTS):
            if not any(url.startswith(lazy) for lazy in BOKEHJS_LAZY_URLS):
                found.append(url)
    return found


def _bundle(text: str, html_text: str) -> dict[str, str]:
    """The mime bundle of a view: loads BokehJS first (once per kernel)."""
    load_notebook()
    return {"text/plain": text, "text/html": html_text}


def _note(text: str) -> str:
    return f'<div class="scalescope-note" style="font-size:90%;color:#555">{text}</div>'


# -- histograms ---------------------------------------------------------------------------


def format_limits(formats: Sequence[str], meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Limits (max, min_normal, min_subnormal) of each format, for histogram shading: the
    run's recorded ``format_info`` where present, else `scalescope.formats`."""
    from .core import formats as _formats

    info = dict((meta or {}).get("format_info") or {})
    return {f: info.get(f) or _formats.get(f) for f in formats}


class HistSeries(pd.Series):
    """Exponent histogram counts (index: bin label) that display as a figure in Jupyter.

    A plain ``pd.Series`` in every other respect: arithmetic and selections return plain
    Series. ``format_info`` (format -> limits) decides the shaded ranges; ``.figure``
    builds the Bokeh figure (`scalescope.viz.exponent_histogram`).
    """

    _metadata = ["format_info", "log_counts"]

    @property
    def _constructor(self) -> type[pd.Series]:
        return pd.Series

    @property
    def _constructor_expanddim(self) -> type[pd.DataFrame]:
        return pd.DataFrame

    @property
    def title(self) -> str:
        where = f" at step {self.attrs['step']}" if self.attrs.get("step") is not None else ""
        it = self.attrs.get("iteration")
        where += f", iteration {it}" if it is not None else ""
        return f"{self.name}: exponent histogram{where}"

    @property
    def figure(self) -> Any:
        """The exponent histogram figure (a new Bokeh figure at each access)."""
        from . import viz

        info = getattr(self, "format_info", None) or {}
        return viz.exponent_histogram(
            pd.Series(self.to_numpy(), index=self.index),
            info,
            title=self.title,
            log_counts=bool(getattr(self, "log_counts", False)),
        )

    def to_html(self) -> str:
        """The figure as notebook HTML (see `figure_html`)."""
        return figure_html(self.figure)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return _bundle(pd.Series.__repr__(self), self.to_html())


def hist_series(
    counts: pd.Series,
    format_info: Mapping[str, Any],
    *,
    log_counts: bool = False,
    **attrs: Any,
) -> HistSeries:
    """``counts`` as a `HistSeries` (same values, index, name and attrs) shading the
    ranges of ``format_info``; ``attrs`` (step, op, iteration) are added to ``.attrs``."""
    out = HistSeries(counts.to_numpy(), index=counts.index, name=counts.name)
    out.attrs.update(counts.attrs)
    out.attrs.update(attrs)
    out.format_info = dict(format_info)
    out.log_counts = bool(log_counts)
    return out


# -- advisor ------------------------------------------------------------------------------

_ADVICE_COLUMNS = (
    "severity",
    "rule",
    "format",
    "label",
    "first_step",
    "steps",
    "evidence",
    "fix",
)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return html.escape(str(value))


def _table_html(
    frame: pd.DataFrame,
    columns: Sequence[str],
    row_colors: Sequence[str] | None = None,
    max_rows: int = MAX_HTML_ROWS,
    css_class: str = "scalescope-table",
) -> str:
    """A compact HTML table of ``columns`` (rows beyond ``max_rows`` are counted, not shown)."""
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in columns)
    rows = []
    for i, record in enumerate(frame[list(columns)].head(max_rows).itertuples(index=False)):
        style = f' style="background:{row_colors[i]}"' if row_colors is not None else ""
        cells = "".join(f"<td>{_cell(v)}</td>" for v in record)
        rows.append(f"<tr{style}>{cells}</tr>")
    more = len(frame) - max_rows
    tail = _note(f"... {more} more rows (all are in the data)") if more > 0 else ""
    return (
        f'<table class="{css_class}" style="font-size:85%;text-align:left">'
        f"<thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>{tail}"
    )


class _DisplayFrame(pd.DataFrame):
    """A DataFrame that only adds a Jupyter display: selections and arithmetic return
    plain DataFrames and Series."""

    @property
    def _constructor(self) -> type[pd.DataFrame]:
        return pd.DataFrame

    @property
    def _constructor_sliced(self) -> type[pd.Series]:
        return pd.Series


class Advice(_DisplayFrame):
    """The advisor's findings (`scalescope.analysis.advise`), displayed in Jupyter as a
    table coloured by severity. A plain ``pd.DataFrame`` in every other respect:
    selections and arithmetic return plain DataFrames."""

    def summary(self) -> pd.DataFrame:
        """Findings counted per rule and format (`scalescope.analysis.summary_by_rule`)."""
        from .analysis import summary_by_rule

        return summary_by_rule(pd.DataFrame(self))

    def _repr_html_(self) -> str:
        if self.empty:
            return _note("No findings: every recorded op stays within the advisor's thresholds.")
        from .analysis import SEVERITY_ORDER

        counts = self["severity"].value_counts()
        parts = [f"{int(counts[s])} {s}" for s in SEVERITY_ORDER if s in counts.index]
        head = (
            f"<div><b>{len(self)} finding(s)</b> on {self['op'].nunique()} op(s): "
            f"{', '.join(parts)}</div>"
        )
        columns = [c for c in _ADVICE_COLUMNS if c in self.columns]
        colors = [SEVERITY_COLORS.get(str(s), "") for s in self["severity"]]
        return head + _table_html(self, columns, colors, css_class="scalescope-advice")


def advice_frame(findings: pd.DataFrame) -> Advice:
    """``findings`` as an `Advice` frame (same data)."""
    return Advice(findings)


class ScaleGraph(_DisplayFrame):
    """A scale graph (`scalescope.scale_graph`: one row per op, value and gradient log2
    RMS) that draws itself in Jupyter as `scalescope.viz.scale_graph_figure`. A plain
    ``pd.DataFrame`` in every other respect. ``attrs["formats"]`` picks the ranges drawn,
    ``attrs["step"]`` goes in the title."""

    @property
    def figure(self) -> Any:
        """The scale graph figure (a new Bokeh figure at each access)."""
        from . import viz

        step = self.attrs.get("step")
        title = "scale graph" if step is None else f"scale graph, step {step}"
        formats = self.attrs.get("formats") or ("e4m3", "e5m2", "fp16", "bf16")
        return viz.scale_graph_figure(pd.DataFrame(self), formats, title=title)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return _bundle(pd.DataFrame.__repr__(self), figure_html(self.figure))


def scale_graph_frame(frame: pd.DataFrame, **attrs: Any) -> ScaleGraph:
    """``frame`` as a `ScaleGraph` (same data); ``attrs`` (step, formats) into ``.attrs``."""
    out = ScaleGraph(frame)
    out.attrs.update(attrs)
    return out


# -- heatmap ------------------------------------------------------------------------------


class HeatmapView:
    """An op x step heatmap of one metric of a run, displayed inline.

    ``matrix``: the data (`scalescope.analysis.matrix`: index op id, columns step);
    ``labels``: op id -> readable label; ``figure``: the Bokeh figure
    (`scalescope.viz.heatmap`). ``measured``: where each op has rows
    (`scalescope.analysis.measured_matrix`, same index and columns; None: unknown): NaN
    cells of ops not measured there are drawn blank, measured NaN cells grey. ``notes``:
    what the figure's numbers are (sampled statistics, ops measured in turns), shown above
    it. ``groups``: op id -> group key (`scalescope.analysis.group_keys`; None: one row
    per op); ``expanded``: the groups drawn op by op (None: all of them for a small run,
    none above `scalescope.analysis.COLLAPSE_ABOVE` ops: a collapsed group is one row of
    its worst op per step, named in the hover). The dashboard draws the same figure.
    """

    def __init__(
        self,
        matrix: pd.DataFrame,
        metric: str,
        labels: pd.Series,
        title: str,
        measured: pd.DataFrame | None = None,
        notes: Sequence[str] = (),
        groups: pd.Series | None = None,
        expanded: Sequence[str] | None = None,
    ):
        self.matrix, self.metric, self.labels, self.title = matrix, metric, labels, title
        self.measured, self.notes = measured, list(notes)
        self.groups, self.expanded = groups, expanded

    @property
    def figure(self) -> Any:
        from . import viz

        return viz.heatmap(
            self.matrix,
            metric=self.metric,
            labels=self.labels,
            title=self.title,
            measured=self.measured,
            groups=self.groups,
            expanded=self.expanded,
        )

    def to_html(self) -> str:
        notes = "".join(
            _note(f'<span class="scalescope-statistics-note">{html.escape(n)}</span>')
            for n in self.notes
        )
        return notes + figure_html(self.figure)

    def __repr__(self) -> str:
        n_ops, n_steps = self.matrix.shape
        return f"HeatmapView({self.title!r}: {n_ops} ops x {n_steps} steps)"

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return _bundle(repr(self), self.to_html())


def known_metrics(reader: Any) -> list[str]:
    """Metrics a run can show: its recorded statistics and the derived ones."""
    from .analysis import DERIVED_METRICS

    return [*reader.stat_names, *DERIVED_METRICS]


def run_heatmap(
    reader: Any,
    metric: str = "log2_rms",
    ops: Any = None,
    *,
    iterations: str = "max",
    max_steps: int = 500,
    group_depth: int = 1,
    expanded: Sequence[str] | None = None,
) -> HeatmapView:
    """`HeatmapView` of ``metric`` over a recorded run. ``ops``: an op id, ids, or a regex
    on ``pass/name`` (see ``RunReader.resolve_ops``); ``iterations``, ``max_steps``: see
    `scalescope.analysis.matrix`. Rows are grouped by module path at ``group_depth``
    (0: one row per op; ``iterations="all"`` is never grouped), ``expanded``: see
    `HeatmapView`."""
    from . import analysis as A

    known = known_metrics(reader)
    if not isinstance(metric, str) or metric not in known:
        raise KeyError(f"heatmap: unknown metric {metric!r}; this run has: {', '.join(known)}")
    ids = None if ops is None else reader.resolve_ops(ops)
    if ids is not None and len(ids) == 0:
        raise KeyError(f"heatmap: no recorded op matches {ops!r} in {reader.path}")
    sources = A.DERIVED_METRICS[metric][0] if metric in A.DERIVED_METRICS else (metric,)
    stats = reader.stats(list(sources), wide=True)
    matrix = A.matrix(stats, metric, ops=ids, iterations=iterations, max_steps=max_steps)
    measured = A.measured_matrix(stats, ops=ids, max_steps=max_steps)
    if iterations == "all":  # rows (op, iteration): an iteration is measured with its op
        ops = matrix.index.get_level_values("op")
        measured = measured.reindex(index=ops, columns=matrix.columns, fill_value=False)
        measured.index = matrix.index
    else:
        measured = measured.reindex(index=matrix.index, columns=matrix.columns, fill_value=False)
    title = f"{reader.name}: {metric}"
    notes = A.measurement_notes(reader)
    groups = None
    if group_depth and iterations != "all" and len(reader.ops):
        groups = A.group_keys(reader.ops, group_depth)
    if expanded is not None and groups is not None:
        if isinstance(expanded, str):
            expanded = [expanded]
        unknown = [g for g in expanded if g not in set(groups)]
        if unknown:
            shown = ", ".join(list(dict.fromkeys(groups))[:8])
            raise KeyError(f"heatmap: no group {unknown[0]!r} (expanded=); groups: {shown} ...")
    labels = A.op_labels(reader.ops)
    return HeatmapView(matrix, metric, labels, title, measured, notes, groups, expanded)


# -- comparison ---------------------------------------------------------------------------


class ComparisonView:
    """Two runs side by side, displayed inline: a summary table (final loss, advisor
    findings per severity, ops safe in each format), both loss curves, and a heatmap of
    the per-op ratio of ``metric`` (b / a, log2) over the matched ops.

    ``values`` / ``unmatched``: `scalescope.analysis.compare_readers`; ``summary``: the
    table; ``names``: the two run names used in column names (``op_<name>``).
    """

    def __init__(self, reader_a: Any, reader_b: Any, metric: str, names: tuple[str, str]):
        from . import analysis as A

        self.readers, self.metric, self.names = (reader_a, reader_b), metric, names
        self.values, self.unmatched = A.compare_readers(reader_a, reader_b, metric, names=names)
        self.summary = pd.DataFrame(
            [_run_summary(r) for r in self.readers], index=pd.Index(names, name="run")
        )

    def partner(self, op: int) -> int | None:
        """The op of run b matched with op ``op`` of run a (None: unmatched or no stats)."""
        a, b = self.names
        hit = self.values.loc[self.values[f"op_{a}"] == op, f"op_{b}"]
        return int(hit.iloc[0]) if len(hit) else None

    def ratio_matrix(self) -> pd.DataFrame:
        """Op (of run a) x step matrix of log2(b / a) of the metric, or of b - a for
        metrics that can be negative (`scalescope.analysis.matrix`)."""
        from . import analysis as A

        a, _ = self.names
        column = "log2_ratio" if "log2_ratio" in self.values.columns else "difference"
        frame = self.values.rename(columns={f"op_{a}": "op"})[["op", "step", "iteration", column]]
        return A.matrix(frame, column)

    @property
    def figure(self) -> Any:
        from bokeh.layouts import column

        from . import analysis as A
        from . import viz

        a, b = self.names
        loss = viz.loss_curve({a: self.readers[0].scalars, b: self.readers[1].scalars})
        ratio = self.ratio_matrix()
        what = "log2 ratio" if "log2_ratio" in self.values.columns else "difference"
        metric = "log2_ratio" if what == "log2 ratio" else "difference"
        heat = viz.heatmap(
            ratio,
            metric=metric,
            labels=A.op_labels(self.readers[0].ops),
            title=f"{self.metric}: {what} {b} vs {a}, per matched op",
            name="compare-heatmap",
        )
        return column(loss, heat)

    def to_html(self) -> str:
        a, b = self.names
        frame = self.summary.reset_index()
        head = (
            f"<div><b>{html.escape(a)}</b> vs <b>{html.escape(b)}</b>: "
            f"{self.values[f'op_{a}'].nunique() if len(self.values) else 0} matched ops with "
            f"statistics, {len(self.unmatched)} ops without a partner</div>"
        )
        return head + _table_html(frame, list(frame.columns)) + figure_html(self.figure)

    def __repr__(self) -> str:
        a, b = self.names
        return f"ComparisonView({a!r} vs {b!r}, metric {self.metric!r})\n{self.summary}"

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return _bundle(repr(self), self.to_html())


def _run_summary(reader: Any) -> dict[str, Any]:
    """One row of a comparison's summary: final loss, findings per severity, safe ops
    per audited format."""
    from . import analysis as A

    row: dict[str, Any] = {}
    scalars = reader.scalars
    if "loss" in scalars.columns and len(scalars):
        row["final loss"] = float(scalars["loss"].iloc[-1])
    findings = A.advise_run(reader)
    for severity in A.SEVERITY_ORDER:
        row[severity] = int((findings["severity"] == severity).sum())
    counts = A.verdict_counts(A.format_whatif_run(reader), reader.ops, as_text=True)
    for fmt in counts.columns:
        row[f"safe {fmt}"] = counts.loc["all", fmt]
    return row


def compare_runs(reader: Any, other: Any, metric: str = "value_rms") -> ComparisonView:
    """`ComparisonView` of two runs (``other``: a reader or a run path)."""
    from .store import RunReader, open_run

    if not isinstance(other, RunReader):
        other = open_run(other)
    names = (reader.name, other.name)
    if names[0] == names[1] or not all(names):
        names = ("a", "b")
    return ComparisonView(reader, other, metric, names)


# -- in-memory statistics of `instrument` ---------------------------------------------------


class StatsView:
    """Statistics of `scalescope.instrument` displayed inline (see `show`).

    ``summary``: one row per selected op (`scalescope.analysis.op_summary`);
    ``hists``: op id -> `HistSeries` (when an ``op`` was given and histograms were
    recorded); ``figure``: the histograms (with SNR per format) or None.
    """

    def __init__(self, summary: pd.DataFrame, hists: dict[int, HistSeries], title: str):
        self.summary, self.hists, self.title = summary, hists, title

    @property
    def figure(self) -> Any:
        if not self.hists:
            return None
        from bokeh.layouts import column, row

        from . import analysis as A
        from . import viz

        rows = []
        for op, hist in self.hists.items():
            fig = hist.figure
            fig.width = 640
            snr = self.summary.loc[op, [c for c in self.summary.columns if c.startswith("snr_")]]
            snr.index = [c[4:] for c in snr.index]
            bars = viz.snr_chart(
                snr.astype(np.float64),
                thresholds={f: A.DEFAULT_SNR_DB[f] for f in snr.index if f in A.DEFAULT_SNR_DB},
                title=f"{hist.name}: SNR",
                name=f"snr-{op}",
            )
            bars.width = 340
            rows.append(row(fig, bars))
        return column(*rows)

    def to_html(self) -> str:
        columns = [
            c
            for c in (
                "label",
                "shape",
                "dtype",
                "scaled",
                "rms",
                "absmax",
                "dynamic_range",
                "scale",
            )
            if c in self.summary.columns
        ]
        columns += [c for c in self.summary.columns if c.startswith(("underflow_", "overflow_"))]
        columns += [c for c in self.summary.columns if c.startswith("snr_")]
        frame = self.summary.reset_index()
        text = f"<div><b>{html.escape(self.title)}</b></div>" + _table_html(frame, ["op", *columns])
        fig = self.figure
        if fig is None:
            text += _note("Pass op=... (an id, a pass/name, or a regex) to draw histograms.")
            return text
        return text + figure_html(fig)

    def __repr__(self) -> str:
        return f"StatsView({self.title!r}: {len(self.summary)} ops)"

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return _bundle(repr(self), self.to_html())


def _close_labels(table: Any, text: str, n: int = 5) -> list[str]:
    import difflib

    return difflib.get_close_matches(text, list(dict.fromkeys(_shown_labels(table))), n, 0.4)


def _shown_labels(table: Any) -> list[str]:
    """The label the views show for each record of ``table``, in id order
    (``bwd/l2/dot_general#2``)."""
    from .core.policy import unique_labels

    return unique_labels([rec.pass_ for rec in table], [rec.name for rec in table])


def select_ops(table: Any, op: Any) -> list[Any]:
    """Records of ``table`` (an `OpTable`) that ``op`` names: an op id, a list of ids, a
    label as the views show it (``bwd/l2/dot_general#2``), an exact ``pass/name`` or
    ``name``, or else a regex searched in ``pass/name``. Raises a
    KeyError naming ``op`` (with close names) when nothing matches."""
    if isinstance(op, int | np.integer) and not isinstance(op, bool):
        if not 0 <= int(op) < len(table):
            raise KeyError(f"show: no op with id {op}; the op table has ids 0..{len(table) - 1}")
        return [table[int(op)]]
    if isinstance(op, str):
        from .core.policy import without_shape

        text = without_shape(op)  # a label as shown, shape and all
        shown = [rec for rec, lb in zip(table, _shown_labels(table)) if lb == text]
        if len(shown) == 1:
            return shown
        exact = [rec for rec in table if op in (rec.label, rec.name)]
        if exact:
            return exact
        try:
            found = table.find(op)
        except re.error:
            found = []
        if found:
            return found
        close = _close_labels(table, op)
        hint = f"; close names: {', '.join(close)}" if close else ""
        raise KeyError(
            f"show: no op named or matching {op!r} in the op table ({len(table)} ops){hint}"
        )
    if isinstance(op, Sequence):
        return [rec for item in op for rec in select_ops(table, item)]
    raise TypeError(f"show: op must be an id, a name or a regex, got {type(op).__name__}")


def _check_stats(stats: Any, table: Any) -> None:
    from .probe import OpTable

    if isinstance(stats, tuple):
        raise TypeError(
            "show: stats is a tuple; instrumented functions return (out, stats): "
            "pass the second element"
        )
    if not isinstance(stats, Mapping):
        raise TypeError(f"show: stats must be the dict of arrays, got {type(stats).__name__}")
    if not isinstance(table, OpTable):
        raise TypeError(
            f"show: table must be the OpTable of fn.op_table(*args), got {type(table).__name__}"
        )
    rows = {name: np.shape(stats[name])[0] for name in table.stat_names if name in stats}
    missing = [name for name in table.stat_names if name not in stats]
    if missing:
        raise KeyError(f"show: stats lacks {missing[:3]}; is it from the same function?")
    bad = {name: n for name, n in rows.items() if n != table.n_rows}
    if bad:
        name, n = next(iter(bad.items()))
        raise ValueError(
            f"show: stats[{name!r}] has {n} rows but the op table has {table.n_rows}; pass "
            "fn.op_table(*args) for the same arguments as the call that made stats"
        )


def _summary_frame(stats: Mapping[str, Any], table: Any) -> pd.DataFrame:
    from . import analysis as A
    from .probe import stats_frame

    frame = stats_frame(table, dict(stats)).assign(step=0)
    return A.op_summary(frame, table.to_frame())


def _instrument_hist(
    stats: Mapping[str, Any], table: Any, rec: Any, iteration: int | None
) -> pd.Series:
    rows = table.rows(rec)
    counts = np.asarray(stats["hist"])[rows]
    if iteration is not None:
        if not 0 <= iteration < len(counts):
            raise IndexError(
                f"show: iteration {iteration} out of range for {rec.label} ({len(counts)} rows)"
            )
        counts = counts[iteration : iteration + 1]
    return pd.Series(
        counts.sum(axis=0).astype(np.int64),
        index=pd.Index(table.hist_columns, name="bin"),
        name=rec.label,
    )


def show(
    stats: Mapping[str, Any],
    table: Any,
    op: Any = None,
    *,
    iteration: int | None = None,
    max_ops: int = 8,
    log_counts: bool = False,
) -> StatsView:
    """Display the in-memory statistics of `scalescope.instrument` inline.

    ``stats``: the second output of the instrumented function; ``table``: its
    ``fn.op_table(*args)`` for the same arguments. Without ``op``: a table of every
    recorded op (RMS, abs-max, scale, underflow/overflow/SNR per format). With ``op`` (an
    id, a list of ids, an exact ``pass/name`` or ``name``, or a regex on ``pass/name``):
    that table for the matching ops plus, for the first ``max_ops``, the exponent
    histogram with each format's range shaded and the SNR per format. ``iteration``
    picks one loop iteration (default: all summed). Returns a `StatsView`, which holds
    the data (``summary``, ``hists``) and displays itself.
    """
    _check_stats(stats, table)
    if isinstance(max_ops, bool) or not isinstance(max_ops, int) or max_ops < 1:
        raise ValueError(f"show: max_ops must be a positive int, got {max_ops!r}")
    summary = _summary_frame(stats, table)
    if op is None:
        return StatsView(summary, {}, f"{len(summary)} recorded ops")
    records = select_ops(table, op)
    sources = list(dict.fromkeys(rec.stats_op for rec in records if rec.stats_op >= 0))
    if not sources:
        notes = sorted({rec.note for rec in records})
        raise ValueError(f"show: op {op!r} has no statistics ({', '.join(notes)})")
    hists: dict[int, HistSeries] = {}
    if table.hist_columns:
        limits = format_limits(table.formats)
        for src in sources[:max_ops]:
            counts = _instrument_hist(stats, table, table[src], iteration)
            hists[src] = hist_series(
                counts, limits, log_counts=log_counts, op=src, iteration=iteration, step=None
            )
    title = f"{len(sources)} op(s) matching {op!r}"
    if len(sources) > max_ops:
        title += f" (histograms of the first {max_ops})"
    if not table.hist_columns:
        title += " (recorded with histograms=False)"
    return StatsView(summary.loc[sources], hists, title)
