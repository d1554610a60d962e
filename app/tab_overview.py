"""The dashboard's overview tab: the loss curve, NaN/Inf alarms, the worst ops and the
advisor's summary.

A mixin of `app.dashboard.Dashboard`: its methods build and draw this tab's widgets on the
one page object, and read the shell's state (``self.data``, ``self._findings``,
``self.open_op``, ``self._quiet``)."""

from __future__ import annotations

import html
from typing import Any

import numpy as np
import pandas as pd
import panel as pn

from scalescope import analysis, viz

from .data import RunData
from .widgets import causes_table, make_table, message_html, wrap_columns


class OverviewTab:
    """Builds (``_build_*``) and draws (``_draw_*``) this tab on the dashboard page."""

    def _build_overview(self) -> None:
        self.loss_pane = pn.pane.Bokeh(None)
        self._loss_of: tuple[str, int] | None = None  # (run, version) the loss figure shows
        self.alarms = pn.pane.HTML("", name="alarms", sizing_mode="stretch_width")
        self.advisor_note = pn.pane.HTML("", sizing_mode="stretch_width")
        self.worst_by = pn.widgets.Select(label="Worst ops by", options=["log2_rms"], width=220)
        self.worst_table = make_table(pd.DataFrame(), "worst-ops", page_size=10)
        self.rule_table = make_table(
            pd.DataFrame(), "advisor-summary", page_size=10, **wrap_columns("cause", "fix")
        )
        self.worst_by.param.watch(self._on_worst_by, "value")
        self.incident_table = make_table(
            pd.DataFrame(), "incidents", page_size=5, **wrap_columns("detail")
        )
        self.incident_table.on_click(self._on_incident_click)
        self.incident_table.visible = False
        self._shown_incidents = pd.DataFrame()
        self.overview = pn.Column(
            self.alarms,
            self.incident_table,
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
            incidents = data.incidents()
        findings = self._findings(data)
        if self._loss_of != (data.name, data.version):  # not again when findings land
            self.loss_pane.object = viz.loss_curve(
                {data.name: scalars}, incidents={data.name: incidents}
            )
            self._loss_of = (data.name, data.version)
        self.alarms.object = self._alarm_html(
            scalars, findings if findings is not None else pd.DataFrame(), incidents
        )
        self._shown_incidents = incidents
        self.incident_table.visible = bool(len(incidents))
        if len(incidents):
            cols = ["step", "trigger", "op", "label", "source", "detail"]
            shown = incidents if "label" in incidents else incidents.assign(label=incidents["name"])
            self.incident_table.value = shown[cols].reset_index(drop=True)
        if findings is None:
            self.advisor_note.object = message_html(self._advisor_pending(data))
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
            return message_html(f"the advisor failed: {advice.error}", "error")
        if advice.stale and advice.step is not None:
            return message_html(
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

    def _on_incident_click(self, event: Any) -> None:
        """A click on an incident opens its op at its step in the op detail view."""
        shown = self._shown_incidents
        if shown.empty or event.row is None or event.row >= len(shown):
            return
        row = shown.iloc[event.row]
        if int(row["op"]) >= 0:
            self.open_op(int(row["op"]), int(row["step"]))

    @staticmethod
    def _alarm_html(
        scalars: pd.DataFrame, findings: pd.DataFrame, incidents: pd.DataFrame | None = None
    ) -> str:
        alarms = []
        for r in [] if incidents is None else incidents.to_dict("records"):
            name = r.get("label") or r["name"]
            where = f"{name} ({r['source']})" if name else "no recorded op"
            alarms.append(f"incident at step {int(r['step'])} ({r['trigger']}): {where}")
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
