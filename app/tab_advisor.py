"""The dashboard's advisor tab: every finding, its source line and fix.

A mixin of `app.dashboard.Dashboard`: its methods build and draw this tab's widgets on the
one page object, and read the shell's state (``self.data``, ``self._findings``,
``self.open_op``, ``self._quiet``)."""

from __future__ import annotations

from typing import Any

import pandas as pd
import panel as pn

from scalescope import analysis

from .data import RunData
from .widgets import FINDING_COLUMNS, make_table, message_html, wrap_columns


class AdvisorTab:
    """Builds (``_build_*``) and draws (``_draw_*``) this tab on the dashboard page."""

    def _build_advisor(self) -> None:
        self.advisor_msg = pn.pane.HTML("", sizing_mode="stretch_width")
        self.advisor_table = make_table(
            pd.DataFrame(), "advisor", page_size=25, **wrap_columns("evidence", "fix")
        )
        self.advisor_table.on_click(self._on_finding_click)
        self.advisor = pn.Column(self.advisor_msg, self.advisor_table, sizing_mode="stretch_width")
        self._shown_findings = pd.DataFrame()

    def _draw_advisor(self, data: RunData) -> None:
        findings = self._findings(data)
        if findings is None:
            self._shown_findings = pd.DataFrame()
            self.advisor_msg.object = message_html(self._advisor_pending(data))
            self.advisor_table.value = pd.DataFrame({"advisor": ["reading the statistics..."]})
            return
        self._shown_findings = findings
        if findings.empty:
            self.advisor_msg.object = self._advice_note(data) or message_html(
                "the advisor has no finding for this run"
            )
            self.advisor_table.value = pd.DataFrame({"advisor": ["no findings"]})
            return
        counts = findings["severity"].value_counts()
        text = ", ".join(f"{counts[s]} {s}" for s in analysis.SEVERITY_ORDER if s in counts)
        self.advisor_msg.object = message_html(
            f"{len(findings)} findings ({text}). Click a row to open the op."
        ) + self._advice_note(data)
        with data.lock:
            last = data.last_measured(findings["op"]).to_numpy()
        table = findings[["op", *FINDING_COLUMNS]].copy()
        table.insert(table.columns.get_loc("steps") + 1, "last_measured", last)
        self.advisor_table.value = table

    def _on_finding_click(self, event: Any) -> None:
        shown = self._shown_findings
        if shown.empty or event.row is None or event.row >= len(shown):
            return
        self.open_op(int(shown["op"].iloc[event.row]), int(shown["first_step"].iloc[event.row]))
