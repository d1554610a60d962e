"""The dashboard's formats & recipes tab: safe ops per pass, verdicts side by side, the
cheapest safe recipe.

A mixin of `app.dashboard.Dashboard`: its methods build and draw this tab's widgets on the
one page object, and read the shell's state (``self.data``, ``self._findings``,
``self.open_op``, ``self._quiet``)."""

from __future__ import annotations

import pandas as pd
import panel as pn

from scalescope import analysis

from .data import RunData
from .widgets import CHEAPEST_HEAD, FORMATS_HEAD, make_table, whatif_table


class FormatsTab:
    """Builds (``_build_*``) and draws (``_draw_*``) this tab on the dashboard page."""

    def _build_formats(self) -> None:
        self.verdicts = make_table(pd.DataFrame(), "verdicts", page_size=10)
        self.cheapest_table = make_table(pd.DataFrame(), "cheapest", page_size=10)
        self.cheapest_head = pn.pane.HTML(CHEAPEST_HEAD, visible=False)
        self.cheapest_table.visible = False
        self.whatif_table = make_table(pd.DataFrame(), "whatif", page_size=25)
        self.formats = pn.Column(
            pn.pane.HTML(FORMATS_HEAD, sizing_mode="stretch_width"),
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
