"""The dashboard's heatmap tab: op x step of any metric, grouped by module and filtered;
a click opens the op.

A mixin of `app.dashboard.Dashboard`: its methods build and draw this tab's widgets on the
one page object, and read the shell's state (``self.data``, ``self._findings``,
``self.open_op``, ``self._quiet``)."""

from __future__ import annotations

import re
from typing import Any

import panel as pn
from bokeh.events import Tap

from scalescope import viz
from scalescope.viz.heatmap import TAG as HEATMAP_TAG

from .data import RunData
from .widgets import message_html


class HeatmapTab:
    """Builds (``_build_*``) and draws (``_draw_*``) this tab on the dashboard page."""

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
            self.heatmap_msg.object = message_html("no recorded step yet", "warn")
            self.heatmap_pane.object = None  # not another run's figure under it
            return
        text, error = self._search()
        if error:
            self.heatmap_msg.object = message_html(error, "error")
            self.heatmap_pane.object = None  # not the last search's figure under it
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
                self.heatmap_msg.object = message_html(
                    f"no op matches the filters{f' and {text!r}' if text else ''}", "warn"
                )
                self.heatmap_pane.object = None  # not the last filters' figure
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
            self.heatmap_msg.object = message_html(note)
            fig = self._heatmap_fig
            kwargs = {"metric": metric, "measured": measured}
            if groups is not None:
                kwargs |= {"groups": groups, "expanded": expanded, "labels": labels}
            if fig is None or force or not viz.update_heatmap(fig, mat, **kwargs):
                fig = viz.heatmap(mat, **({"labels": labels} | kwargs))
                fig.on_event(Tap, self._on_tap)
                self._heatmap_fig = fig
            if self.heatmap_pane.object is not fig:  # new, or back after a search of none
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
