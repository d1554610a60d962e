"""The runs a dashboard serves, and the frames it draws from them, cached per run.

`RunSet` resolves the PATH given to ``scalescope serve`` (one run, or a directory of
runs) once, and only ever opens runs under it. `RunData` wraps one `RunReader` with a
lock (Bokeh sessions run callbacks on the server's threads) and caches every derived
frame (wide statistics, matrices, advisor findings, format and recipe what-if) until
`RunData.refresh` reads new parts; all sessions of the server share one `RunData` per run.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from scalescope import analysis
from scalescope.core.recipes import RECIPE_STATS
from scalescope.store import RunError, RunReader, list_runs, open_run

from .grid import StatGrid

#: Metrics offered by the heatmap, before the per-format ones.
BASE_METRICS = ("log2_rms", "log2_scale", "log2_absmax", "frac_zero", "frac_nonfinite")
#: Per-format metrics offered for every audited format.
FORMAT_METRICS = ("underflow", "overflow", "snr")
#: Per-recipe metrics offered for every recorded block-scaled recipe (after the formats').
RECIPE_METRICS = RECIPE_STATS


class ServeError(Exception):
    """PATH cannot be served (missing, not a run, no runs under it); the message says
    why and what to do."""


class RunData:
    """One run and its cached frames (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = threading.RLock()
        self.reader: RunReader = open_run(path)
        self.version = 0
        self._cache: dict[Any, Any] = {}
        self.grid = StatGrid(self.reader)  # heatmap grids, extended part by part
        self._by_ops: dict[Any, Any] = {}  # frames of the op table only (kept on refresh)

    @property
    def name(self) -> str:
        return self.reader.name

    def refresh(self) -> bool:
        """Read parts that appeared since the last call; True when there were any (the
        caches are then dropped and `version` moves on)."""
        with self.lock:
            new = self.reader.refresh()
            if new:
                self.version += 1
                self._cache.clear()
            return bool(new)

    def cached(self, key: Any, build: Callable[[], Any]) -> Any:
        """``build()`` once per `version` and key."""
        with self.lock:
            if key not in self._cache:
                self._cache[key] = build()
            return self._cache[key]

    # -- frames --------------------------------------------------------------------------

    @property
    def ops(self) -> pd.DataFrame:
        return self.reader.ops

    @property
    def steps(self) -> np.ndarray:
        """Recorded steps of process 0 (from the grids: no pass over all rows)."""
        with self.lock:
            self.grid.sync()
            return self.grid.steps.copy()

    @property
    def n_recorded_ops(self) -> int:
        """Ops with at least one row of statistics."""
        with self.lock:
            return len(self.grid.recorded_ops())

    @property
    def _columns(self) -> pd.DataFrame:
        """An empty frame with the statistics' columns (what formats and metrics need,
        without building the wide frame)."""
        return pd.DataFrame(columns=["step", "op", "iteration", *self.reader.stat_names])

    def _of_ops(self, key: Any, build: Callable[[pd.DataFrame], Any]) -> Any:
        """``build(ops)`` once per op table (it does not change when steps arrive)."""
        with self.lock:
            ops = self.ops
            if self._by_ops.get("table") is not ops:
                self._by_ops = {"table": ops}
            if key not in self._by_ops:
                self._by_ops[key] = build(ops)
            return self._by_ops[key]

    def group_keys(self, depth: int) -> pd.Series:
        """Heatmap group of each op at ``depth`` (`scalescope.analysis.group_keys`)."""
        return self._of_ops(("groups", depth), lambda ops: analysis.group_keys(ops, depth))

    def max_depth(self) -> int:
        """Deepest useful group depth (`scalescope.analysis.max_depth`)."""
        return self._of_ops("max_depth", analysis.max_depth)

    @property
    def stats(self) -> pd.DataFrame:
        """Wide statistics of process 0."""
        return self.cached("stats", lambda: self.reader.stats(wide=True))

    @property
    def scalars(self) -> pd.DataFrame:
        return self.cached("scalars", lambda: self.reader.scalars)

    @property
    def labels(self) -> pd.Series:
        return self._of_ops("labels", analysis.op_labels)

    @property
    def formats(self) -> list[str]:
        return self.cached("formats", lambda: analysis.recorded_formats(self._columns))

    @property
    def recipes(self) -> list[str]:
        """Block-scaled recipes recorded in the statistics (``nvfp4``, ...)."""
        return self.cached("recipes", lambda: analysis.recorded_recipes(self._columns))

    def metrics(self) -> list[str]:
        """Heatmap metrics this run has, in menu order: the base ones, each format's,
        then each recipe's (`RECIPE_METRICS`)."""
        columns = set(self.reader.stat_names)
        have = columns | {
            m for m, (src, _) in analysis.DERIVED_METRICS.items() if set(src) <= columns
        }
        names = [m for m in BASE_METRICS if m in have]
        for kind in FORMAT_METRICS:
            names += [f"{kind}_{f}" for f in self.formats if f"{kind}_{f}" in have]
        for kind in RECIPE_METRICS:
            names += [f"{kind}_{r}" for r in self.recipes if f"{kind}_{r}" in have]
        return names

    def filtered_ops(
        self,
        passes: tuple[str, ...],
        primitives: tuple[str, ...],
        regex: str,
        search: str = "",
        search_regex: bool = False,
    ):
        """Op ids with recorded rows that match the filters (empty tuple: no filter).
        ``regex`` is searched in the op label; ``search`` in ``pass/name``, as a regex
        when ``search_regex`` else as a plain substring (case-insensitive); a bad pattern
        raises `re.error`."""
        key = ("filter", passes, primitives, regex, search, search_regex)

        def build() -> np.ndarray:
            table = self.ops
            recorded = self.grid.recorded_ops()
            table = table.loc[table.index.intersection(recorded)]
            mask = np.ones(len(table), bool)
            if passes:
                mask &= table["pass"].isin(passes).to_numpy()
            if primitives:
                mask &= table["primitive"].isin(primitives).to_numpy()
            if regex:
                labels = self.labels.reindex(table.index).astype(str)
                mask &= labels.str.contains(regex, regex=True).to_numpy()
            if search:
                names = (table["pass"].astype(str) + "/" + table["name"].astype(str)).str
                mask &= names.contains(search, case=False, regex=search_regex).to_numpy()
            return table.index.to_numpy(np.int64)[mask]

        return self.cached(key, build)

    def matrix(self, metric: str, ops: np.ndarray, max_steps: int = 500) -> pd.DataFrame:
        """Op x step matrix of ``metric`` over ``ops`` (float32: half the bytes to send)."""
        key = ("matrix", metric, ops.tobytes(), max_steps)
        return self.cached(key, lambda: self.grid.matrix(metric, ops, max_steps))

    def measured_matrix(self, ops: np.ndarray, max_steps: int = 500) -> pd.DataFrame:
        """Where each of ``ops`` was measured, aligned with `matrix` (True: a row at that
        step or window): the heatmap draws the other NaN cells blank."""
        key = ("measured_matrix", ops.tobytes(), max_steps)
        return self.cached(key, lambda: self.grid.measured(ops, max_steps))

    def measured(self) -> pd.DataFrame:
        """Per op: first/last measured step, number of steps measured, median gap
        (`scalescope.store.RunReader.measured`)."""
        return self.cached("measured", lambda: self.reader.measured())

    def last_measured(self, ops: Any) -> pd.Series:
        """Last measured step of each op id in ``ops`` (nullable ints, for tables)."""
        last = self.measured()["last_measured"].reindex(np.asarray(ops, np.int64))
        return last.astype("Int64")

    def notes(self) -> list[str]:
        """What every view computed from statistics says next to its figures: sampled
        statistics, ops measured in turns (`scalescope.analysis.measurement_notes`)."""
        return self.cached("notes", lambda: analysis.measurement_notes(self.reader))

    def findings(self) -> pd.DataFrame:
        return self.cached("findings", lambda: analysis.advise_run(self.reader))

    def summary(self) -> pd.DataFrame:
        return self.cached("summary", lambda: analysis.op_summary(self.stats, self.ops))

    def whatif(self) -> pd.DataFrame:
        return self.cached(
            "whatif", lambda: analysis.format_whatif(self.stats, self.ops, meta=self.reader.meta)
        )

    def op_stats(self, op: int) -> pd.DataFrame:
        """Wide rows of one op, all steps and loop iterations."""
        stats = self.stats
        return stats[stats["op"].to_numpy() == op]


class RunSet:
    """The runs under the PATH given to ``scalescope serve``.

    PATH is a run (served alone) or a directory holding runs (found up to three levels
    down, re-scanned by `rescan`, so a run that a training starts later appears). Only
    runs under PATH are ever opened.
    """

    def __init__(self, path: str | Path) -> None:
        self.root = Path(path).expanduser().resolve()
        if not self.root.exists():
            raise ServeError(
                f"{self.root} does not exist: give a run directory or a folder of runs"
            )
        if not self.root.is_dir():
            raise ServeError(f"{self.root} is a file, not a run directory or a folder of runs")
        self.lock = threading.Lock()
        self._runs: dict[str, RunData] = {}
        self._broken: dict[str, str] = {}
        self.rescan()
        if not self._runs and not self._broken:
            raise ServeError(
                f"no runs under {self.root}: record one with `scalescope train ... --run DIR` "
                "or `ss.Run(DIR)`, then serve DIR or its parent folder"
            )

    def rescan(self) -> bool:
        """Look for runs that appeared under the root; True when one did."""
        found = list_runs(self.root)
        added = False
        with self.lock:
            for path in found:
                key = self.key(path)
                if key in self._runs:
                    continue
                try:
                    self._runs[key] = RunData(path)
                    self._broken.pop(key, None)
                    added = True
                except RunError as err:  # e.g. run.json being replaced right now
                    self._broken[key] = str(err)
        return added

    def key(self, path: Path) -> str:
        """How a run is named in the dashboard: its path relative to the root."""
        rel = path.resolve().relative_to(self.root)
        return str(rel) if str(rel) != "." else path.name

    @property
    def names(self) -> list[str]:
        with self.lock:
            return sorted(self._runs)

    @property
    def broken(self) -> dict[str, str]:
        with self.lock:
            return dict(self._broken)

    def get(self, name: str) -> RunData:
        with self.lock:
            if name not in self._runs:
                raise KeyError(f"no run {name!r} under {self.root}")
            return self._runs[name]
