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
from typing import Any

import pandas as pd
import panel as pn

from .data import RunData, RunSet
from .tab_advisor import AdvisorTab
from .tab_compare import CompareTab
from .tab_detail import DetailTab
from .tab_formats import FormatsTab
from .tab_heatmap import HeatmapTab
from .tab_overview import OverviewTab
from .tab_scale_graph import ScaleGraphTab
from .widgets import NOTED_VIEWS, message_html, statistics_note, verdict_html, verified_html

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


class Dashboard(
    OverviewTab, HeatmapTab, DetailTab, AdvisorTab, FormatsTab, ScaleGraphTab, CompareTab
):
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
            self.status.object += message_html(f"{view}: {type(err).__name__}: {err}", "error")
            raise
        self.versions[view] = token

    def _draw_status(self, data: RunData | None) -> None:
        if data is None:
            broken = "; ".join(f"{k}: {v}" for k, v in self.runs.broken.items())
            self.status.object = message_html(
                f"no readable run under {self.runs.root}. {broken}", "warn"
            )
            return
        with data.lock:
            meta, steps = data.reader.meta, data.steps
            n_ops = data.n_recorded_ops if len(steps) else 0
            scalars = data.scalars
            note = statistics_note(data.notes())
            statistics = data.reader.statistics
            status = data.reader.status
            damage = list(data.reader.damage)
            damage += [f"unreadable part {p} skipped ({why})" for p, why in data.reader.skipped]
        for pane in self.notes.values():
            if pane.object != note:
                pane.object = note
        last = int(steps[-1]) if len(steps) else None
        loss_step = int(scalars.index.max()) if len(scalars) else None
        parts = [
            f"<b>{html.escape(data.name)}</b>",
            f"status: <span class='ss-run-status'>{html.escape(status)}</span>",
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
            text += message_html(
                "no recorded step yet: the run is being created, this page updates when its "
                "first statistics are written",
                "warn",
            )
        if damage:
            text += message_html(
                "this run is damaged; the views show what could be read: " + "; ".join(damage),
                "error",
            )
        broken = self.runs.broken
        if broken:
            text += message_html(
                "not shown (unreadable): " + "; ".join(f"{k}: {v}" for k, v in broken.items()),
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
