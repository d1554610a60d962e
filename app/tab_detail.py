"""The dashboard's op detail tab: one op's statistics over steps, its histogram, SNR and
block scales.

A mixin of `app.dashboard.Dashboard`: its methods build and draw this tab's widgets on the
one page object, and read the shell's state (``self.data``, ``self._findings``,
``self.open_op``, ``self._quiet``)."""

from __future__ import annotations

import html

import numpy as np
import pandas as pd
import panel as pn

from scalescope import analysis, viz

from .data import RunData
from .widgets import FINDING_COLUMNS, THRESHOLDS, make_table, message_html, when_text


class DetailTab:
    """Builds (``_build_*``) and draws (``_draw_*``) this tab on the dashboard page."""

    def _build_detail(self) -> None:
        self.op_select = pn.widgets.Select(label="Op", options={}, width=520)
        self.step_select = pn.widgets.Select(label="Step", options=[], width=140)
        self.op_info = pn.pane.HTML("", sizing_mode="stretch_width", name="op-info")
        self.series_pane = pn.pane.Bokeh(None)
        self.hist_pane = pn.pane.Bokeh(None)
        self.snr_pane = pn.pane.Bokeh(None)
        self.scale_pane = pn.pane.Bokeh(None, visible=False)
        self.op_findings = make_table(pd.DataFrame(), "op-findings", page_size=5)
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
                self.op_info.object = message_html("no recorded step yet", "warn")
                self._clear_detail()  # not another run's op under the message
                return
            labels = data.labels
            recorded = data.recorded_ops()
        findings = self._findings(data)
        if findings is None:
            findings = pd.DataFrame({"op": pd.Series(dtype=np.int64)})
        options = {str(labels[op]): int(op) for op in recorded}
        current = self.op_select.value if op is None else int(op)
        if op is None and getattr(self, "_detail_run", None) != data.path:
            # another run: its op ids mean other ops; keep the op by its label, if it has it
            before = dict(zip(self.op_select.values, self.op_select.labels, strict=False))
            current = options.get(before.get(current, ""), -1)
        if current not in options.values():
            current = int(findings["op"].iloc[0] if len(findings) else recorded[0])
        self._detail_run = data.path
        with self._quiet():
            self.op_select.param.update(options=options, value=current)
        self._draw_op()

    def _clear_detail(self) -> None:
        """Take every figure and table of the tab off the page."""
        for pane in (self.series_pane, self.hist_pane, self.snr_pane, self.scale_pane):
            pane.object = None
        self.op_findings.value = pd.DataFrame()
        with self._quiet():
            self.op_select.param.update(options={}, value=None)
            self.step_select.param.update(options=[], value=None)

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
            "last measured": when_text(when, len(recorded)),
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
                mine[[c for c in FINDING_COLUMNS if c != "label"]].reset_index(drop=True)
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
                thresholds={f: THRESHOLDS.snr_for(f, meta) for f in snr.index},
                title=f"SNR per format and recipe at step {step}",
            )
        else:  # none recorded for this op: not the last op's chart
            self.snr_pane.object = None
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
            self.op_info.object += message_html("this run was recorded without histograms", "info")

    # -- advisor, formats --------------------------------------------------------------------
