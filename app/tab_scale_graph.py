"""The dashboard's scale graph tab: each op's value and gradient RMS at a recorded step.

A mixin of `app.dashboard.Dashboard`: its methods build and draw this tab's widgets on the
one page object, and read the shell's state (``self.data``, ``self._findings``,
``self.open_op``, ``self._quiet``)."""

from __future__ import annotations

import panel as pn

from scalescope import viz

from .data import RunData
from .widgets import message_html


class ScaleGraphTab:
    """Builds (``_build_*``) and draws (``_draw_*``) this tab on the dashboard page."""

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
            self.scale_graph_note.object = message_html(
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
