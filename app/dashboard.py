"""One dashboard page (one per browser session) over the runs of a `RunSet`.

Seven views in tabs: overview (loss curve, NaN/Inf alarms, worst ops, advisor summary),
heatmap (op x step of any metric, with filters; a click opens the op), op detail (scale /
RMS / abs-max over steps, exponent histogram, SNR per format and recipe, the block scales
of each recorded recipe against its element format's range), advisor table, the format
and recipe what-if ("Formats & recipes": safe ops per pass, each op's verdicts side by
side, its cheapest safe recipe), the comparison of two runs, and the scale graph (each
op's value and gradient RMS at a step recorded with `Run.scale_graph`, with a step
slider). Every figure comes from `scalescope.viz`, every frame from `scalescope.analysis`
(through `RunData`'s cache). A periodic callback reads new parts of the run; views
showing data older than the run are redrawn when visible.

The advisor's findings (overview, advisor, op detail) come from `RunData.advice`: on a
served page they are computed in the background and a view shows the newest ones there
are ("the advisor is reading ..." before the first), redrawn when newer ones land; a page
model without a periodic callback (tests, notebooks) waits for them.

Every view computed from statistics (overview, heatmap, op detail, advisor, formats)
opens with a note when its numbers are estimates (a run recorded with ``sample=``) or when
ops were measured in turns under an overhead budget (``budget=``); the op tables show
when each op was last measured, and heatmap cells of an op not measured at a step are
blank.
"""

from __future__ import annotations

import contextlib
import html
import re
from typing import Any

import numpy as np
import pandas as pd
import panel as pn
from bokeh.events import Tap

from scalescope import analysis, viz
from scalescope.analysis.advisor import pct
from scalescope.viz.heatmap import TAG as HEATMAP_TAG

from .data import RunData, RunSet

#: How often a page looks for new data (ms): new steps show within ~2 s of being written.
POLL_MS = 1000

#: How long a served page's callback waits for the advisor before drawing without it (s).
ADVISOR_WAIT = 0.5
#: How long a new page waits (in all) for the runs' verdicts to open on the worst (s).
OPEN_WAIT = 3.0
#: Views that show the advisor's findings (redrawn when newer findings land).
FINDINGS_VIEWS = ("Overview", "Op detail", "Advisor")

#: The views, by key (`Dashboard.versions`, `Dashboard.notes`, ``tabs.active`` indices).
TABS = ("Overview", "Heatmap", "Op detail", "Advisor", "Formats", "Compare", "Scale graph")
#: Tab titles that differ from the view's key.
TAB_TITLES = {"Formats": "Formats & recipes"}

_FINDING_COLUMNS = [
    "severity",
    "rule",
    "format",
    "label",
    "pass",
    "primitive",
    "first_step",
    "steps",
    "evidence",
    "source",
    "fix",
]


def _table(
    frame: pd.DataFrame, name: str, page_size: int = 20, **kwargs: Any
) -> pn.widgets.Tabulator:
    """A read-only, sortable table."""
    return pn.widgets.Tabulator(
        frame,
        disabled=True,
        pagination="local",
        page_size=page_size,
        show_index=False,
        sizing_mode="stretch_width",
        layout="fit_data_table",
        css_classes=[f"ss-{name}"],
        **kwargs,
    )


def _WRAP(*columns: str, width: int = 380) -> dict[str, Any]:  # noqa: N802 - a constant's role
    """Tabulator options that wrap the text of ``columns`` in cells ``width`` px wide."""
    return {
        "formatters": {c: {"type": "textarea"} for c in columns},
        "widths": {c: width for c in columns},
    }


def causes_table(causes: pd.DataFrame) -> pd.DataFrame:
    """The findings grouped by cause (`scalescope.analysis.causes`) as the Overview shows
    them: severity, cause, impact and worst value with their units, first step, the worst
    op, its source line and the fix."""
    return pd.DataFrame(
        {
            "severity": causes["severity"],
            "cause": causes["cause"],
            "impact (share of the value lost)": [analysis.impact_text(v) for v in causes["impact"]],
            "worst": causes["worst"],
            "first_step": causes["first_step"],
            "worst op": causes["label"],
            "source": causes["source"],
            "fix": causes["fix"],
        }
    )


#: Views whose figures are computed from statistics: they carry the statistics note.
NOTED_VIEWS = ("Overview", "Heatmap", "Op detail", "Advisor", "Formats")


def _statistics_note(notes: list[str]) -> str:
    """The note on sampled statistics / ops measured in turns ("" when there is none)."""
    if not notes:
        return ""
    items = " &nbsp;·&nbsp; ".join(html.escape(n) for n in notes)
    return (
        "<div class='ss-statistics-note' style='color:#8a5a00;background:#fff6e0;"
        f"padding:3px 8px;border-left:3px solid #e0a000'>{items}</div>"
    )


_THRESHOLDS = analysis.Thresholds()  # the dashboard's views use the defaults
_FORMATS_HEAD = (
    "<h3>Safe ops per pass, format and recipe</h3><p>An op is safe in a format when, over "
    f"the recorded steps, it never overflows, underflows at most "
    f"{pct(_THRESHOLDS.underflow)}, keeps its SNR above the format's threshold and "
    "holds no NaN/inf. A block-scaled recipe (recorded with <code>formats=</code>) is safe "
    f"when it clips at most {pct(_THRESHOLDS.recipe_overflow)} of the elements (SNR judges "
    "clipping), "
    f"underflows at most {pct(_THRESHOLDS.underflow)}, flushes no block to zero, "
    "keeps its SNR above its element format's threshold and holds no NaN/inf.</p>"
)
_CHEAPEST_HEAD = (
    "<h3>Cheapest safe recipe</h3><p>Ops per pass for which each recipe is the cheapest "
    "that keeps them safe (fewer bits per element, then per-tensor before per-block "
    "scales, then larger blocks); <i>none</i>: no recorded recipe does.</p>"
)


def whatif_table(whatif: pd.DataFrame, labels: pd.Series, last: pd.Series) -> pd.DataFrame:
    """The per-op table of the Formats & recipes view, one row per op of a
    `scalescope.analysis.format_whatif` frame: ``op``, ``label``, ``last measured``,
    ``cheapest recipe`` (with recipes); per format ``F safe``, ``F snr``, ``F why``; per
    recipe, side by side, ``R safe``, ``R underflow``, ``R clipped`` (overflow_R),
    ``R snr``, ``R flushed`` (flushed blocks), ``R why``."""
    flat = pd.DataFrame(index=whatif.index)
    flat["label"] = labels.reindex(whatif.index).to_numpy()
    flat["last measured"] = last.reindex(whatif.index).to_numpy()
    recipes = analysis.whatif_recipes(whatif)
    if recipes:
        flat[analysis.CHEAPEST] = whatif[analysis.CHEAPEST].to_numpy()
    for name in analysis.whatif_groups(whatif):
        flat[f"{name} safe"] = whatif[(name, "safe")]
        if name in recipes:
            flat[f"{name} underflow"] = whatif[(name, "underflow")]
            flat[f"{name} clipped"] = whatif[(name, "overflow")]
        flat[f"{name} snr"] = whatif[(name, "snr")].round(1)
        if name in recipes:
            flat[f"{name} flushed"] = whatif[(name, "block_flush")]
        flat[f"{name} why"] = whatif[(name, "reason")]
    return flat.reset_index()


_VERDICT_STYLE = {
    "healthy": "background:#d9f0d3;color:#1b5e20",
    "at risk": "background:#feb24c;color:#3d2600",
    "failing": "background:#b10026;color:#fff",
}


def verdict_html(v: analysis.Verdict) -> str:
    """A verdict as the dashboard shows it above every view: the headline in the
    verdict's colour, then each reason (cause, op, source line, fix)."""
    style = _VERDICT_STYLE[v.status]
    cls = "ss-verdict ss-verdict-" + v.status.replace(" ", "-")
    out = (
        f"<div class='{cls}' style='{style};font-size:1.2em;font-weight:bold;"
        f"padding:6px 10px;border-radius:4px'>{html.escape(v.headline)}</div>"
    )
    if v.reasons:
        items = "".join(
            f"<li>{html.escape(r.line())}<br><code style='white-space:pre-wrap'>"
            f"fix: {html.escape(r.fix)}</code></li>"
            for r in v.reasons
        )
        out += f"<ol class='ss-verdict-reasons' style='margin:4px 0'>{items}</ol>"
    return out


def verified_html(reader: Any) -> str:
    """The policies this run was trained under or checked against (``scalescope
    verify``), one line each below the verdict; "" when there are none."""
    lines = []
    if reader.meta.get("policy"):
        lines.append("trained under policy " + analysis.policy_text(reader.meta["policy"], 2))
    lines += [analysis.verification_line(r) for r in reader.verifications()]
    if not lines:
        return ""
    items = "".join(f"<li>{html.escape(line)}</li>" for line in lines)
    return f"<ul class='ss-verified' style='margin:4px 0'>{items}</ul>"


def _message(text: str, kind: str = "info") -> str:
    colors = {"info": "#555", "warn": "#a15c00", "error": "#b00020"}
    return f'<div class="ss-msg ss-{kind}" style="color:{colors[kind]}">{html.escape(text)}</div>'


def _when_text(when: pd.Series, n_recorded: int) -> str:
    """``step L (n of N recorded steps, every ~K)`` for an op's row of `RunData.measured`."""
    if pd.isna(when["last_measured"]):
        return "never"
    text = f"step {int(when['last_measured'])} ({int(when['n_measured'])} of {n_recorded} "
    text += "recorded steps"
    gap = when["gap"]
    if pd.notna(gap) and gap > 1:
        text += f", every ~{gap:g}"
    return text + ")"


class Dashboard:
    """Widgets and views of one page; `layout` is what Panel serves."""

    def __init__(
        self,
        runs: RunSet,
        run: str | None = None,
        poll_ms: int = POLL_MS,
        live: bool | None = None,
    ) -> None:
        self.runs = runs
        # served with a periodic callback (``live``, by default when served): never wait
        # for the advisor, redraw when it ends
        self.live = pn.state.curdoc is not None and poll_ms > 0 if live is None else live
        self._labels: dict[str, str] = {}  # run -> its verdict, as the selector shows it
        if run is None:  # open on the run that needs attention most
            verdicts = runs.verdicts(wait=OPEN_WAIT if self.live else None)
            self._labels = {n: v.status for n, v in verdicts.items() if v is not None}
            run = runs.worst(verdicts)
        self.run_select = pn.widgets.Select(
            label="Run", options=self._run_options(), value=run, width=320
        )
        self.status = pn.pane.HTML("", sizing_mode="stretch_width")
        self.verdict_pane = pn.pane.HTML("", name="verdict", sizing_mode="stretch_width")
        self._muted = False  # True while several widgets change for one redraw
        self.versions: dict[str, Any] = {}  # view -> what it shows (`_token`)
        self._worst_by_user = False  # the worst-ops metric was picked in the page
        self.notes = {
            view: pn.pane.HTML(
                "", sizing_mode="stretch_width", name=f"statistics-note-{view.lower()}"
            )
            for view in NOTED_VIEWS
        }
        self._build_overview()
        self._build_heatmap()
        self._build_detail()
        self._build_advisor()
        self._build_formats()
        self._build_compare()
        self._build_scale_graph()
        for view, column in (
            ("Overview", self.overview),
            ("Heatmap", self.heatmap_view),
            ("Op detail", self.detail),
            ("Advisor", self.advisor),
            ("Formats", self.formats),
        ):
            column.insert(0, self.notes[view])
        views = (
            self.overview,
            self.heatmap_view,
            self.detail,
            self.advisor,
            self.formats,
            self.compare,
            self.scale_graph_view,
        )
        self.tabs = pn.Tabs(
            *((TAB_TITLES.get(key, key), view) for key, view in zip(TABS, views)),
            dynamic=False,
            sizing_mode="stretch_width",
        )
        header = pn.Row(
            pn.pane.HTML("<b style='font-size:1.3em'>scalescope</b>", width=120),
            self.run_select,
            self.status,
            sizing_mode="stretch_width",
        )
        self.layout = pn.Column(header, self.verdict_pane, self.tabs, sizing_mode="stretch_width")
        self.run_select.param.watch(lambda e: self._muted or self.redraw(), "value")
        self.tabs.param.watch(lambda e: self._muted or self.redraw_visible(), "active")
        self.redraw()
        if pn.state.curdoc is not None and poll_ms > 0:
            pn.state.add_periodic_callback(self.poll, period=poll_ms)

    @contextlib.contextmanager
    def _quiet(self):
        """Change several widgets without each one redrawing (a figure replaced twice in
        one callback would linger in the browser's document)."""
        muted, self._muted = self._muted, True
        try:
            yield
        finally:
            self._muted = muted

    # -- run and refresh -------------------------------------------------------------------

    @property
    def data(self) -> RunData | None:
        name = self.run_select.value
        return self.runs.get(name) if name in self.runs.names else None

    def _run_options(self) -> dict[str, str]:
        """The run selector's options: each run's name, with its verdict once known."""
        out = {}
        for name in self.runs.names:
            status = self._labels.get(name)
            out[f"{name} \u2014 {status}" if status else name] = name
        return out

    def _update_labels(self) -> None:
        """Mark each run's verdict in the selector as soon as its findings are known."""
        changed = False
        for name in self.runs.names:
            v = self.runs.get(name).latest_verdict() if self.live else None
            if v is None and not self.live:
                v = self.runs.get(name).verdict(self.runs.get(name).findings())
            status = None if v is None else v.status
            if status is not None and self._labels.get(name) != status:
                self._labels[name] = status
                changed = True
        if changed:
            with self._quiet():
                value = self.run_select.value
                self.run_select.options = self._run_options()
                self.run_select.value = value

    def poll(self) -> None:
        """Pick up new runs and new steps; redraw what is visible if it is out of date."""
        if self.runs.rescan():
            with self._quiet():
                value = self.run_select.value
                self.run_select.options = self._run_options()
                self.run_select.value = value
            self.compare_select.options = self.runs.names
            if self.run_select.value is None and self.runs.names:
                self.run_select.value = self.runs.names[0]
        self._update_labels()
        data = self.data
        if data is None:
            return
        data.refresh()
        view = TABS[self.tabs.active]
        if view in FINDINGS_VIEWS:
            data.advice.kick()  # a live run: newer findings once the last ones are old enough
        if self.versions.get("status") != data.version or self.versions.get(view) != self._token(
            view, data
        ):
            self.redraw_visible()

    def redraw(self) -> None:
        """Forget what every view shows (another run was picked) and draw the visible."""
        self.versions.clear()
        self._worst_by_user = False
        self.redraw_visible()

    @staticmethod
    def _token(view: str, data: RunData) -> Any:
        """What a view shows of ``data``: its version, and the advisor's for the views
        that show findings."""
        if view in FINDINGS_VIEWS:
            return (data.version, data.advice.version)
        return data.version

    def _findings(self, data: RunData) -> pd.DataFrame | None:
        """The advisor's findings to show: on a served page the newest there are (None
        while the first are computed: the view says so and is redrawn when they land),
        else those of the run as it is."""
        if not len(data.steps):
            return pd.DataFrame()
        if self.live:
            found = data.advice.latest(wait=ADVISOR_WAIT)
            if found is None and data.advice.error and not data.advice.running:
                return pd.DataFrame()  # it failed: the views say so (`_advice_note`)
            return found
        return data.findings()

    def _advisor_pending(self, data: RunData) -> str:
        rows = sum(len(f) for f in data.reader.part_frames())
        return (
            f"the advisor is reading {rows:,} rows of statistics in the background; "
            "its findings appear here when it is done"
        )

    def redraw_visible(self) -> None:
        data = self.data
        self._draw_status(data)
        if data is None:
            return
        self._draw_verdict(data)
        view = TABS[self.tabs.active]
        token = self._token(view, data)
        if self.versions.get(view) == token:
            return
        draw = {
            "Overview": self._draw_overview,
            "Heatmap": self._draw_heatmap,
            "Op detail": self._draw_detail,
            "Advisor": self._draw_advisor,
            "Formats": self._draw_formats,
            "Compare": self._draw_compare,
            "Scale graph": self._draw_scale_graph,
        }[view]
        try:
            draw(data)
        except Exception as err:  # noqa: BLE001 - show it in the page, keep the server up
            self.status.object += _message(f"{view}: {type(err).__name__}: {err}", "error")
            raise
        self.versions[view] = token

    def _draw_status(self, data: RunData | None) -> None:
        if data is None:
            broken = "; ".join(f"{k}: {v}" for k, v in self.runs.broken.items())
            self.status.object = _message(
                f"no readable run under {self.runs.root}. {broken}", "warn"
            )
            return
        with data.lock:
            meta, steps = data.reader.meta, data.steps
            n_ops = data.n_recorded_ops if len(steps) else 0
            scalars = data.scalars
            note = _statistics_note(data.notes())
            statistics = data.reader.statistics
        for pane in self.notes.values():
            if pane.object != note:
                pane.object = note
        last = int(steps[-1]) if len(steps) else None
        loss_step = int(scalars.index.max()) if len(scalars) else None
        parts = [
            f"<b>{html.escape(data.name)}</b>",
            f"status: <span class='ss-run-status'>{html.escape(str(meta.get('status')))}</span>",
            f"recorded steps: <span class='ss-step-count'>{len(steps)}</span>",
            "last recorded step: "
            f"<span class='ss-last-step'>{last if last is not None else '-'}</span>",
            f"last logged step: {loss_step if loss_step is not None else '-'}",
            f"ops: {n_ops}",
            f"scalify: {bool((meta.get('graph') or {}).get('scalify', False))}",
            f"statistics: <span class='ss-statistics'>{html.escape(statistics)}</span>",
        ]
        text = " &nbsp;·&nbsp; ".join(parts)
        if not len(steps):
            text += _message(
                "no recorded step yet: the run is being created, this page updates when its "
                "first statistics are written",
                "warn",
            )
        self.status.object = f"<div class='ss-status'>{text}</div>"
        self.versions["status"] = data.version

    def _draw_verdict(self, data: RunData) -> None:
        """The run's verdict, above every view: its headline and the causes behind it,
        each with its op, source line and fix."""
        token = (data.name, data.version, data.advice.version)
        if self.versions.get("verdict") == token:
            return
        findings = self._findings(data)
        if findings is None:
            self.verdict_pane.object = (
                "<div class='ss-verdict ss-verdict-pending'>verdict: the advisor is reading "
                "the statistics...</div>"
            )
            return  # drawn again when the findings land (the views' token moves on)
        v = data.verdict(findings)
        key = self.run_select.value  # the run's name in the RunSet (not its own name)
        if self._labels.get(key) != v.status:
            self._labels[key] = v.status
            with self._quiet():
                self.run_select.options = self._run_options()
                self.run_select.value = key
        self.verdict_pane.object = verdict_html(v) + verified_html(data.reader)
        self.versions["verdict"] = token

    # -- overview --------------------------------------------------------------------------

    def _build_overview(self) -> None:
        self.loss_pane = pn.pane.Bokeh(None)
        self._loss_of: tuple[str, int] | None = None  # (run, version) the loss figure shows
        self.alarms = pn.pane.HTML("", name="alarms", sizing_mode="stretch_width")
        self.advisor_note = pn.pane.HTML("", sizing_mode="stretch_width")
        self.worst_by = pn.widgets.Select(label="Worst ops by", options=["log2_rms"], width=220)
        self.worst_table = _table(pd.DataFrame(), "worst-ops", page_size=10)
        self.rule_table = _table(
            pd.DataFrame(), "advisor-summary", page_size=10, **_WRAP("cause", "fix")
        )
        self.worst_by.param.watch(self._on_worst_by, "value")
        self.overview = pn.Column(
            self.alarms,
            self.loss_pane,
            pn.pane.HTML("<h3>Causes</h3>"),
            self.advisor_note,
            self.rule_table,
            pn.pane.HTML("<h3>Worst ops</h3>"),
            self.worst_by,
            self.worst_table,
            sizing_mode="stretch_width",
            name="overview",
        )

    def _on_worst_by(self, event: Any) -> None:
        if self._muted:
            return
        self._worst_by_user = True  # picked in the page: kept across redraws
        self._draw_worst()

    def _draw_overview(self, data: RunData) -> None:
        with data.lock:
            scalars = data.scalars
            options = data.summary_metrics() if len(data.steps) else []
        findings = self._findings(data)
        if self._loss_of != (data.name, data.version):  # not again when findings land
            self.loss_pane.object = viz.loss_curve({data.name: scalars})
            self._loss_of = (data.name, data.version)
        self.alarms.object = self._alarm_html(
            scalars, findings if findings is not None else pd.DataFrame()
        )
        if findings is None:
            self.advisor_note.object = _message(self._advisor_pending(data))
            self.rule_table.value = pd.DataFrame({"advisor": ["reading the statistics..."]})
        else:
            self.advisor_note.object = self._advice_note(data)
            if len(findings):
                self.rule_table.value = causes_table(analysis.causes(findings))
            else:
                self.rule_table.value = pd.DataFrame({"advisor": ["no findings"]})
        if options:
            value = self.worst_by.value
            if not (self._worst_by_user and value in options):
                # opens on the statistic of the worst finding (highest severity, then
                # magnitude), not on one that may be zero everywhere
                value = analysis.worst_finding_metric(findings, options)
            with self._quiet():
                self.worst_by.param.update(options=options, value=value)
        self._draw_worst()

    def _advice_note(self, data: RunData) -> str:
        """Says when the findings shown are older than the run, or why there are none."""
        advice = data.advice
        if advice.error:
            return _message(f"the advisor failed: {advice.error}", "error")
        if advice.stale and advice.step is not None:
            return _message(
                f"findings as of step {advice.step}; the advisor re-reads a live run at most "
                f"every {max(advice.MIN_INTERVAL, advice.SPACING * advice.took):.0f} s"
            )
        return ""

    def _draw_worst(self) -> None:
        by = self.worst_by.value
        data = self.data
        if data is None or not len(data.steps) or by not in data.summary_metrics():
            self.worst_table.value = pd.DataFrame({"ops": ["no recorded op yet"]})
            return
        with data.lock:
            worst = data.worst_ops(by, n=20)
            last = data.last_measured(worst.index).to_numpy()
        worst = worst.assign(last_measured=last)
        cols = ["label", "pass", "primitive", by, "last_measured", "source"]
        self.worst_table.value = worst.reset_index()[["op", *dict.fromkeys(cols)]]

    @staticmethod
    def _alarm_html(scalars: pd.DataFrame, findings: pd.DataFrame) -> str:
        alarms = []
        for col in scalars.columns:
            bad = scalars.index[~np.isfinite(scalars[col].to_numpy(np.float64))]
            # In the wide frame a NaN also means "not logged at this step" (val_loss is
            # logged every few steps): NaN alarms only for the loss, inf for any scalar.
            bad = [s for s in bad if not np.isnan(scalars.loc[s, col]) or col == "loss"]
            if bad:
                alarms.append(f"{col} is non-finite from step {int(bad[0])}")
        # The advisor's nonfinite findings, not every op holding an inf: a causal mask's
        # -inf logits are there by construction (see Thresholds.mask_min_steps).
        hit = findings[findings["rule"] == "nonfinite"] if len(findings) else findings
        if len(hit):
            first = hit.sort_values(["first_step", "op"]).iloc[0]
            alarms.append(
                f"{hit['op'].nunique()} op(s) hold NaN/Inf; the first, at step "
                f"{int(first['first_step'])}: {first['label']} ({first['source']})"
            )
        if not alarms:
            return (
                "<div class='ss-alarms ss-ok' style='color:#2a7a2a'>"
                "no NaN/Inf in the loss or in any recorded op</div>"
            )
        items = "".join(f"<li>{html.escape(a)}</li>" for a in alarms)
        return f"<div class='ss-alarms' style='color:#b00020'><b>Alarms</b><ul>{items}</ul></div>"

    # -- heatmap ---------------------------------------------------------------------------

    def _build_heatmap(self) -> None:
        self.metric = pn.widgets.Select(label="Metric", options=["log2_rms"], width=200)
        self.pass_filter = pn.widgets.MultiChoice(label="Pass", options=[], width=220)
        self.prim_filter = pn.widgets.MultiChoice(label="Primitive", options=[], width=260)
        self.name_filter = pn.widgets.TextInput(
            label="Search pass/name",
            placeholder="e.g. attn/q, or attn|mlp as a regex",
            width=240,
        )
        self.search_regex = pn.widgets.Checkbox(label="regex", value=False, width=70)
        self.group_depth = pn.widgets.Select(
            label="Group by module depth",
            options={"off (one row per op)": 0, "1": 1},
            value=1,
            width=170,
        )
        self.expanded = pn.widgets.MultiChoice(
            label="Expanded groups (click a ▸ row to expand it)", options=[], width=420
        )
        self.expand_all = pn.widgets.Button(label="Expand all", width=100)
        self.collapse_all = pn.widgets.Button(label="Collapse all", width=100)
        self.heatmap_msg = pn.pane.HTML("", sizing_mode="stretch_width")
        self.heatmap_pane = pn.pane.Bokeh(None)
        self._heatmap_fig = None
        self._expanded: frozenset[str] | None = None  # None: collapsed for big runs
        for w in (self.metric, self.pass_filter, self.prim_filter, self.name_filter):
            w.param.watch(lambda e: self._muted or self._draw_heatmap_now(), "value")
        self.search_regex.param.watch(lambda e: self._muted or self._draw_heatmap_now(), "value")
        self.group_depth.param.watch(lambda e: self._muted or self._set_expanded(None), "value")
        self.expanded.param.watch(
            lambda e: self._muted or self._set_expanded(frozenset(e.new)), "value"
        )
        self.expand_all.on_click(lambda e: self._set_expanded(frozenset(self.expanded.options)))
        self.collapse_all.on_click(lambda e: self._set_expanded(frozenset()))
        self.heatmap_view = pn.Column(
            pn.Row(
                self.metric,
                self.pass_filter,
                self.prim_filter,
                self.name_filter,
                pn.Column(pn.Spacer(height=18), self.search_regex),
            ),
            pn.Row(
                self.group_depth,
                self.expanded,
                pn.Column(pn.Spacer(height=18), pn.Row(self.expand_all, self.collapse_all)),
            ),
            self.heatmap_msg,
            self.heatmap_pane,
            sizing_mode="stretch_width",
        )

    def _set_expanded(self, expanded: frozenset[str] | None) -> None:
        """Show these groups op by op (None: the default, collapsed for a big run)."""
        self._expanded = expanded
        self._draw_heatmap_now()

    def toggle_group(self, key: str) -> None:
        """Expand a collapsed group of the heatmap (collapse an expanded one)."""
        shown = set(self._expanded if self._expanded is not None else self.expanded.value)
        shown.symmetric_difference_update({key})
        self._set_expanded(frozenset(shown))

    def _draw_heatmap(self, data: RunData) -> None:
        with data.lock:
            metrics = data.metrics() if len(data.steps) else ["log2_rms"]
            ops = data.ops
            depth = data.max_depth()
        with self._quiet():
            value = self.metric.value if self.metric.value in metrics else metrics[0]
            self.metric.param.update(options=metrics, value=value)
            self.pass_filter.options = sorted(set(ops["pass"])) if len(ops) else []
            self.prim_filter.options = sorted(set(ops["primitive"])) if len(ops) else []
            depths = {"off (one row per op)": 0} | {str(d): d for d in range(1, depth + 1)}
            chosen = self.group_depth.value if self.group_depth.value in depths.values() else 1
            self.group_depth.param.update(options=depths, value=chosen)
        self._draw_heatmap_now()

    def _search(self) -> tuple[str, str | None]:
        """The search text and, for a regex that does not compile, why."""
        text = (self.name_filter.value or "").strip()
        if text and self.search_regex.value:
            try:
                re.compile(text)
            except re.error as err:
                return text, f"bad search regex {text!r}: {err}"
        return text, None

    def _draw_heatmap_now(self, force: bool = False) -> None:
        data = self.data
        if data is None:
            return
        if not len(data.steps):
            self.heatmap_msg.object = _message("no recorded step yet", "warn")
            return
        text, error = self._search()
        if error:
            self.heatmap_msg.object = _message(error, "error")
            return
        metric = self.metric.value
        depth = int(self.group_depth.value or 0)
        with data.lock:
            ops = data.filtered_ops(
                tuple(self.pass_filter.value),
                tuple(self.prim_filter.value),
                "",
                text,
                bool(self.search_regex.value),
            )
            if not len(ops):
                self.heatmap_msg.object = _message(
                    f"no op matches the filters{f' and {text!r}' if text else ''}", "warn"
                )
                return
            mat = data.matrix(metric, ops)
            measured = data.measured_matrix(ops)
            labels = data.heatmap_labels
            groups = data.group_keys(depth) if depth else None
        n_steps = len(data.steps)
        note = f"{len(mat)} ops x {mat.shape[1]} columns"
        if mat.shape[1] < n_steps:
            note += f" ({n_steps} recorded steps merged into windows, worst measured value kept)"
        if not measured.to_numpy().all():
            note += "; blank (hatched): not measured there, grey: NaN"
        if groups is not None:
            note += (
                "; a ▸ row is a collapsed group showing its worst op at each step "
                "(hover names it): click it to expand"
            )
        cast = data.ops.get("cast_to")
        if cast is not None and cast.fillna("").astype(str).ne("").any():
            note += "; → e4m3: the run casts that op to that format"
        note += "; click a cell to open that op at that step"
        expanded = self._expanded
        if expanded is not None and groups is not None:
            expanded = expanded & set(groups.reindex(ops))
        # One message for the note, colour range and image: the browser would otherwise
        # re-colour the old image once per property change before the new one arrives.
        with pn.io.hold():
            self.heatmap_msg.object = _message(note)
            fig = self._heatmap_fig
            kwargs = {"metric": metric, "measured": measured}
            if groups is not None:
                kwargs |= {"groups": groups, "expanded": expanded, "labels": labels}
            if fig is None or force or not viz.update_heatmap(fig, mat, **kwargs):
                fig = viz.heatmap(mat, **({"labels": labels} | kwargs))
                fig.on_event(Tap, self._on_tap)
                self._heatmap_fig = fig
                self.heatmap_pane.object = fig
            self._show_groups(fig)

    def _show_groups(self, fig: Any) -> None:
        """The expanded-groups choice follows the figure's groups."""
        info = fig.tags[0].get(HEATMAP_TAG, {}) if fig.tags else {}
        grouped = bool(info.get("grouped"))
        options = list(dict.fromkeys(info.get("groups", []))) if grouped else []
        value = [g for g in info.get("expanded", []) if g in options]
        with self._quiet():
            if list(self.expanded.options) != options:
                self.expanded.options = options
            if list(self.expanded.value) != value:
                self.expanded.value = value
        for w in (self.expanded, self.expand_all, self.collapse_all):
            w.disabled = not grouped

    def _on_tap(self, event: Tap) -> None:
        group = viz.heatmap_group(self._heatmap_fig, event.y)
        if group is not None:
            self.toggle_group(group)
            return
        cell = viz.heatmap_cell(self._heatmap_fig, event.x, event.y)
        if cell is None:
            return
        op, step = cell
        self.open_op(op, step)

    def open_op(self, op: int, step: int | None = None) -> None:
        """Show ``op`` (at ``step``) in the op detail view."""
        self._pending_step = step
        with self._quiet():
            self.tabs.active = TABS.index("Op detail")
        data = self.data
        if data is not None:
            self._draw_detail(data, op)
            self.versions["Op detail"] = data.version

    # -- op detail -------------------------------------------------------------------------

    def _build_detail(self) -> None:
        self.op_select = pn.widgets.Select(label="Op", options={}, width=520)
        self.step_select = pn.widgets.Select(label="Step", options=[], width=140)
        self.op_info = pn.pane.HTML("", sizing_mode="stretch_width", name="op-info")
        self.series_pane = pn.pane.Bokeh(None)
        self.hist_pane = pn.pane.Bokeh(None)
        self.snr_pane = pn.pane.Bokeh(None)
        self.scale_pane = pn.pane.Bokeh(None, visible=False)
        self.op_findings = _table(pd.DataFrame(), "op-findings", page_size=5)
        self._pending_step: int | None = None
        self.op_select.param.watch(lambda e: self._muted or self._draw_op(), "value")
        self.step_select.param.watch(lambda e: self._muted or self._draw_op_step(), "value")
        self.detail = pn.Column(
            pn.Row(self.op_select, self.step_select),
            self.op_info,
            pn.Row(self.series_pane, self.snr_pane),
            self.hist_pane,
            self.scale_pane,
            self.op_findings,
            sizing_mode="stretch_width",
        )

    def _draw_detail(self, data: RunData, op: int | None = None) -> None:
        with data.lock:
            if not len(data.steps):
                self.op_info.object = _message("no recorded step yet", "warn")
                return
            labels = data.labels
            recorded = data.recorded_ops()
        findings = self._findings(data)
        if findings is None:
            findings = pd.DataFrame({"op": pd.Series(dtype=np.int64)})
        options = {str(labels[op]): int(op) for op in recorded}
        current = self.op_select.value if op is None else int(op)
        if current not in options.values():
            current = int(findings["op"].iloc[0] if len(findings) else recorded[0])
        with self._quiet():
            self.op_select.param.update(options=options, value=current)
        self._draw_op()

    def _draw_op(self) -> None:
        data, op = self.data, self.op_select.value
        if data is None or op is None:
            return
        with data.lock:
            rows = data.op_stats(op)
            info = data.ops.loc[op]
            label = data.labels.get(op, f"op {op}")
            recorded = data.steps
            when = data.measured().reindex([op]).iloc[0]
            recipes = data.recipes
        steps = sorted(int(s) for s in rows["step"].unique())
        step = self._pending_step if self._pending_step in steps else (steps[-1] if steps else None)
        self._pending_step = None
        fields = {
            "label": label,
            "name": info["name"],
            "pass": info["pass"],
            "primitive": info["primitive"],
            "shape": "x".join(map(str, info["shape"])) or "scalar",
            "dtype": info["dtype"],
            "scaled": bool(info["scaled"]),
            "cast to": info.get("cast_to", "") or "-",
            "source": info.get("source", "") or "-",
            "last measured": _when_text(when, len(recorded)),
        }
        cells = "".join(
            f"<tr><th style='text-align:left;padding-right:1em'>{k}</th>"
            f"<td>{html.escape(str(v))}</td></tr>"
            for k, v in fields.items()
        )
        self.op_info.object = f"<table class='ss-op-info'>{cells}</table>"
        how = {"scale": "max", "rms": "max", "absmax": "max"}
        if "absmin" in rows.columns:  # the span from abs-min to abs-max: the dynamic range
            how["absmin"] = "min"
        per_step = rows.groupby("step").agg(how)
        title = f"{label}: scale, rms, abs-max" + (", abs-min" if "absmin" in how else "")
        self.series_pane.object = viz.timeseries(per_step, title=title, recorded=recorded)
        self.scale_pane.visible = bool(recipes)
        self.scale_pane.object = (
            viz.scale_ranges(
                analysis.block_scales(rows, recipes),
                analysis.recipe_elements(recipes),
                absmax=per_step["absmax"],
                title=f"{label}: block scales vs element exponent range",
            )
            if recipes
            else None
        )
        findings = self._findings(data)
        if findings is None:
            self.op_findings.value = pd.DataFrame({"advisor": ["reading the statistics..."]})
        else:
            mine = findings[findings["op"] == op] if len(findings) else findings
            self.op_findings.value = (
                mine[[c for c in _FINDING_COLUMNS if c != "label"]].reset_index(drop=True)
                if len(mine)
                else pd.DataFrame({"advisor": ["no finding for this op"]})
            )
        with self._quiet():
            self.step_select.param.update(options=steps, value=step)
        self._draw_op_step()

    def _draw_op_step(self) -> None:
        data, op, step = self.data, self.op_select.value, self.step_select.value
        if data is None or op is None or step is None:
            return
        with data.lock:
            rows = data.op_stats(op)
            meta = data.reader.meta
            formats = data.formats + data.recipes
            hist = data.reader.hist(op, step) if data.reader.hist_columns else None
        at = rows[rows["step"] == step]
        snr_cols = {f: f"snr_{f}" for f in formats if f"snr_{f}" in at.columns}
        if snr_cols and len(at):
            snr = pd.Series({f: float(at[c].min()) for f, c in snr_cols.items()})
            self.snr_pane.object = viz.snr_chart(
                snr,
                thresholds={f: _THRESHOLDS.snr_for(f, meta) for f in snr.index},
                title=f"SNR per format and recipe at step {step}",
            )
        label = (
            self.op_select.labels[self.op_select.values.index(op)]
            if op in self.op_select.values
            else op
        )
        if hist is not None:
            self.hist_pane.object = viz.exponent_histogram(
                hist, meta.get("format_info", {}), title=f"{label} at step {step}: log2 |x|"
            )
        else:
            self.hist_pane.object = None
            self.op_info.object += _message("this run was recorded without histograms", "info")

    # -- advisor, formats --------------------------------------------------------------------

    def _build_advisor(self) -> None:
        self.advisor_msg = pn.pane.HTML("", sizing_mode="stretch_width")
        self.advisor_table = _table(
            pd.DataFrame(), "advisor", page_size=25, **_WRAP("evidence", "fix")
        )
        self.advisor_table.on_click(self._on_finding_click)
        self.advisor = pn.Column(self.advisor_msg, self.advisor_table, sizing_mode="stretch_width")
        self._shown_findings = pd.DataFrame()

    def _draw_advisor(self, data: RunData) -> None:
        findings = self._findings(data)
        if findings is None:
            self._shown_findings = pd.DataFrame()
            self.advisor_msg.object = _message(self._advisor_pending(data))
            self.advisor_table.value = pd.DataFrame({"advisor": ["reading the statistics..."]})
            return
        self._shown_findings = findings
        if findings.empty:
            self.advisor_msg.object = self._advice_note(data) or _message(
                "the advisor has no finding for this run"
            )
            self.advisor_table.value = pd.DataFrame({"advisor": ["no findings"]})
            return
        counts = findings["severity"].value_counts()
        text = ", ".join(f"{counts[s]} {s}" for s in analysis.SEVERITY_ORDER if s in counts)
        self.advisor_msg.object = _message(
            f"{len(findings)} findings ({text}). Click a row to open the op."
        ) + self._advice_note(data)
        with data.lock:
            last = data.last_measured(findings["op"]).to_numpy()
        table = findings[["op", *_FINDING_COLUMNS]].copy()
        table.insert(table.columns.get_loc("steps") + 1, "last_measured", last)
        self.advisor_table.value = table

    def _on_finding_click(self, event: Any) -> None:
        shown = self._shown_findings
        if shown.empty or event.row is None or event.row >= len(shown):
            return
        self.open_op(int(shown["op"].iloc[event.row]), int(shown["first_step"].iloc[event.row]))

    def _build_formats(self) -> None:
        self.verdicts = _table(pd.DataFrame(), "verdicts", page_size=10)
        self.cheapest_table = _table(pd.DataFrame(), "cheapest", page_size=10)
        self.cheapest_head = pn.pane.HTML(_CHEAPEST_HEAD, visible=False)
        self.cheapest_table.visible = False
        self.whatif_table = _table(pd.DataFrame(), "whatif", page_size=25)
        self.formats = pn.Column(
            pn.pane.HTML(_FORMATS_HEAD, sizing_mode="stretch_width"),
            self.verdicts,
            self.cheapest_head,
            self.cheapest_table,
            pn.pane.HTML("<h3>Per op</h3>"),
            self.whatif_table,
            sizing_mode="stretch_width",
        )

    def _draw_formats(self, data: RunData) -> None:
        with data.lock:
            if not len(data.steps):
                return
            whatif = data.whatif()
            ops = data.ops
            labels = data.labels
            last = data.last_measured(whatif.index)
        self.verdicts.value = analysis.verdict_counts(whatif, ops, as_text=True).reset_index()
        cheapest = analysis.cheapest_counts(whatif, ops)
        has_recipes = bool(len(cheapest.columns))
        self.cheapest_head.visible = self.cheapest_table.visible = has_recipes
        if has_recipes:
            self.cheapest_table.value = cheapest.reset_index()
        self.whatif_table.value = whatif_table(whatif, labels, last)

    # -- scale graph -----------------------------------------------------------------------

    def _build_scale_graph(self) -> None:
        self.scale_graph_step = pn.widgets.DiscreteSlider(
            label="Step", options=[0], value=0, width=420, visible=False
        )
        self.scale_graph_note = pn.pane.HTML("", sizing_mode="stretch_width")
        self.scale_graph_pane = pn.pane.Bokeh(None)
        self._scale_graph_run: str | None = None  # the run the slider's steps belong to
        self.scale_graph_view = pn.Column(
            pn.pane.HTML(
                "<h3>Scale graph</h3><p>Each op's value (circle) and gradient (triangle) as "
                "log2 RMS, with each format's normal range shaded and its subnormal floor "
                "dashed: where a value or its gradient leaves a format's range.</p>"
            ),
            self.scale_graph_note,
            self.scale_graph_step,
            self.scale_graph_pane,
            sizing_mode="stretch_width",
        )
        self.scale_graph_step.param.watch(
            lambda e: self._muted or self.data is None or self._draw_scale_graph(self.data),
            "value",
        )

    def _draw_scale_graph(self, data: RunData) -> None:
        with data.lock:
            steps = data.reader.scale_graph_steps
        if not steps:
            self.scale_graph_step.visible = False
            self.scale_graph_pane.object = None
            self.scale_graph_note.object = _message(
                "no scale graph in this run: record one with run.scale_graph(step, loss_fn, *args)",
                "warn",
            )
            return
        with self._quiet():
            self.scale_graph_step.options = steps
            fresh = self._scale_graph_run != data.name
            if fresh or self.scale_graph_step.value not in steps:
                self.scale_graph_step.value = steps[-1]  # a run opens at its latest graph
            self._scale_graph_run = data.name
            self.scale_graph_step.visible = len(steps) > 1
        step = self.scale_graph_step.value
        with data.lock:
            frame = data.reader.scale_graph(step)
        self.scale_graph_note.object = f"<p>step {step}: {len(frame)} ops</p>"
        self.scale_graph_pane.object = viz.scale_graph_figure(
            frame, title=f"scale graph, step {step}"
        )

    # -- compare ---------------------------------------------------------------------------

    def _build_compare(self) -> None:
        self.compare_select = pn.widgets.Select(
            label="Compare with", options=self.runs.names, width=260
        )
        self.compare_metric = pn.widgets.Select(
            label="Metric",
            options=["log2_rms", "value_rms", "frac_zero"],
            value="value_rms",
            width=200,
        )
        self.compare_msg = pn.pane.HTML("", sizing_mode="stretch_width")
        self.compare_loss = pn.pane.Bokeh(None)
        self.compare_table = _table(pd.DataFrame(), "compare", page_size=20)
        for w in (self.compare_select, self.compare_metric):
            w.param.watch(lambda e: self._muted or self._draw_compare_now(), "value")
        self.compare = pn.Column(
            pn.Row(self.compare_select, self.compare_metric),
            self.compare_msg,
            self.compare_loss,
            self.compare_table,
            sizing_mode="stretch_width",
        )

    def _draw_compare(self, data: RunData) -> None:
        others = [n for n in self.runs.names if n != self.run_select.value]
        value = self.compare_select.value
        with self._quiet():
            self.compare_select.param.update(
                options=others, value=value if value in others else (others[0] if others else None)
            )
        self._draw_compare_now()

    def _draw_compare_now(self) -> None:
        data, other_name = self.data, self.compare_select.value
        if data is None or other_name is None:
            self.compare_msg.object = _message(
                "serve a folder holding two or more runs to compare them (e.g. fp32 and fp8)",
                "info",
            )
            return
        other = self.runs.get(other_name)
        other.refresh()
        with data.lock, other.lock:
            self.compare_loss.object = viz.loss_curve(
                {data.name: data.scalars, other.name: other.scalars}
            )
            if not len(data.steps) or not len(other.steps):
                self.compare_msg.object = _message(
                    "one of the runs has no recorded step yet", "warn"
                )
                return
            names = (data.name, other.name) if data.name != other.name else ("a", "b")
            values, unmatched = analysis.compare_runs(
                data.stats, data.ops, other.stats, other.ops, self.compare_metric.value, names=names
            )
        if values.empty:
            self.compare_msg.object = _message("no op and step are recorded in both runs", "warn")
            self.compare_table.value = pd.DataFrame()
            return
        diff = "log2_ratio" if "log2_ratio" in values.columns else "difference"
        per_op = analysis.largest_differences(values, names)
        fills = int(per_op[diff].isna().sum())
        fill_note = f" ({fills} with a mask fill or non-finite value, not ranked)" if fills else ""
        self.compare_msg.object = _message(
            f"{per_op.shape[0]} matched ops at step {int(per_op['step'].iloc[0])}, largest {diff} "
            f"first{fill_note}; {len(unmatched)} ops only in one run"
        )
        self.compare_table.value = per_op.reset_index(drop=True)
