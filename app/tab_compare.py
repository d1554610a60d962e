"""The dashboard's compare tab: two runs side by side.

A mixin of `app.dashboard.Dashboard`: its methods build and draw this tab's widgets on the
one page object, and read the shell's state (``self.data``, ``self._findings``,
``self.open_op``, ``self._quiet``)."""

from __future__ import annotations

import pandas as pd
import panel as pn

from scalescope import analysis, viz

from .data import RunData
from .widgets import make_table, message_html


class CompareTab:
    """Builds (``_build_*``) and draws (``_draw_*``) this tab on the dashboard page."""

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
        self.compare_table = make_table(pd.DataFrame(), "compare", page_size=20)
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
            self.compare_msg.object = message_html(
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
                self.compare_msg.object = message_html(
                    "one of the runs has no recorded step yet", "warn"
                )
                self.compare_table.value = pd.DataFrame()  # not the last pair's table
                return
            names = (data.name, other.name) if data.name != other.name else ("a", "b")
            values, unmatched = analysis.compare_runs(
                data.stats, data.ops, other.stats, other.ops, self.compare_metric.value, names=names
            )
        if values.empty:
            self.compare_msg.object = message_html(
                "no op and step are recorded in both runs", "warn"
            )
            self.compare_table.value = pd.DataFrame()
            return
        diff = "log2_ratio" if "log2_ratio" in values.columns else "difference"
        per_op = analysis.largest_differences(values, names)
        fills = int(per_op[diff].isna().sum())
        fill_note = f" ({fills} with a mask fill or non-finite value, not ranked)" if fills else ""
        self.compare_msg.object = message_html(
            f"{per_op.shape[0]} matched ops at step {int(per_op['step'].iloc[0])}, largest {diff} "
            f"first{fill_note}; {len(unmatched)} ops only in one run"
        )
        self.compare_table.value = per_op.reset_index(drop=True)
