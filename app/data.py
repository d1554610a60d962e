"""The runs a dashboard serves, and the frames it draws from them, cached per run.

`RunSet` resolves the PATH given to ``scalescope serve`` (one run, or a directory of
runs) once, and only ever opens runs under it. `RunData` wraps one `RunReader` with a
lock (Bokeh sessions run callbacks on the server's threads) and caches every derived
frame (wide statistics, matrices, format and recipe what-if) until `RunData.refresh`
reads new parts; all sessions of the server share one `RunData` per run.

The advisor over a large run takes seconds (20 000 ops x 1000 recorded steps: 20 M
rows), so it does not hold up a page: `Advice` runs it in a background thread over the
columns it reads (not the wide frame), keeps the last findings while a newer version is
computed, and re-advises a live run at most every `Advice.MIN_INTERVAL` seconds (and no
more often than `Advice.SPACING` times its own duration). The Overview's worst-ops table
reads the op x step grids of the heatmap (`StatGrid`), not the wide frame either.
"""

from __future__ import annotations

import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from scalescope import analysis
from scalescope.core.recipes import RECIPE_STATS
from scalescope.store import RunError, RunReader, list_runs, open_run
from scalescope.store.reader import measured_by_op

from .grid import StatGrid

#: Metrics offered by the heatmap, before the per-format ones.
BASE_METRICS = (
    "log2_rms",
    "log2_scale",
    "log2_absmax",
    "dynamic_range",
    "frac_zero",
    "frac_nonfinite",
)
#: Per-format metrics offered for every audited format.
FORMAT_METRICS = ("underflow", "overflow", "snr")
#: Per-recipe metrics offered for every recorded block-scaled recipe (after the formats').
RECIPE_METRICS = RECIPE_STATS


#: Overview "worst ops by" columns taken at each op's last recorded step (else: the worst
#: over all recorded steps), as in `scalescope.analysis.op_summary`.
LAST_STEP_METRICS = ("rms", "log2_rms", "absmax", "scale")


class ServeError(Exception):
    """PATH cannot be served (missing, not a run, no runs under it); the message says
    why and what to do."""


class Advice:
    """The advisor's findings of one run (`scalescope.analysis.advise`), computed in a
    background thread so that no page waits for them (see the module docstring).

    `latest` returns the newest findings there are and starts a computation when they are
    older than the run; `current` waits for the findings of the run as it is now.
    ``version`` counts finished computations (a view redraws when it moves on)."""

    #: Shortest time (s) between the end of one computation and the start of the next
    #: on a live run, and the least multiple of its last duration.
    MIN_INTERVAL = 10.0
    SPACING = 3.0

    def __init__(self, data: RunData) -> None:
        self.data = data
        self.version = 0
        self.findings: pd.DataFrame | None = None
        self.bundle: analysis.RunAnalysis | None = None  # the analysis the findings are of
        self.of_version = -1  # RunData.version the findings are of
        self.step: int | None = None  # last recorded step they cover
        self.error: str | None = None
        self.took = 0.0  # seconds the last computation took
        self._ended = 0.0
        self._thread: threading.Thread | None = None
        self._cond = threading.Condition()

    @property
    def running(self) -> bool:
        return self._thread is not None

    @property
    def stale(self) -> bool:
        """Older than the run (or none yet)."""
        return self.of_version != self.data.version

    def _due(self) -> bool:
        if self.findings is None:
            return True
        wait = max(self.MIN_INTERVAL, self.SPACING * self.took)
        return time.monotonic() - self._ended >= wait

    def kick(self, force: bool = False) -> bool:
        """Start a computation when the findings are stale, none is running and the
        last one ended long enough ago (``force``: now); True when one is running."""
        if self._thread is None and self.stale and (force or self._due()):
            # the snapshot takes the run's lock: never while holding our condition (a
            # callback holding the run's lock may be waiting for it)
            snapshot = self.data.advisor_snapshot()
            with self._cond:
                if self._thread is None and self.of_version != snapshot[0]:
                    self._thread = threading.Thread(
                        target=self._run, args=(snapshot,), name="scalescope-advisor", daemon=True
                    )
                    self._thread.start()
        return self._thread is not None

    def _run(self, snapshot: tuple[Any, ...]) -> None:
        version, frames, columns, ops, meta, scalars, held = snapshot
        t0 = time.monotonic()
        try:
            stats = advisor_frame(frames, columns)
            bundle = analysis.RunAnalysis(_Snapshot(stats, ops, meta, scalars, held))
            found = bundle.findings
            bundle.verdict  # noqa: B018 - computed here, off the page's thread
            step = int(stats["step"].max()) if len(stats) else None
            error = None
        except Exception as err:  # noqa: BLE001 - shown in the page, the server stays up
            bundle, found, step, error = None, None, None, f"{type(err).__name__}: {err}"
        with self._cond:
            if found is not None:
                self.findings, self.step, self.bundle = found, step, bundle
            self.error = error
            self.of_version = version
            self.took = time.monotonic() - t0
            self._ended = time.monotonic()
            self.version += 1
            self._thread = None
            self._cond.notify_all()

    def latest(self, wait: float = 0.0) -> pd.DataFrame | None:
        """The newest findings (None before the first computation ends), starting a
        computation when due (`kick`); waits up to ``wait`` seconds for a running one."""
        self.kick(force=self.findings is None)
        with self._cond:
            if self._thread is not None and wait > 0:
                self._cond.wait_for(lambda: self._thread is None, timeout=wait)
            return self.findings

    def current(self) -> pd.DataFrame:
        """The findings of the run as it is now (waits for them; raises what the advisor
        raised)."""
        while True:
            with self._cond:
                if not self.stale and self._thread is None:
                    if self.error is not None:
                        raise RuntimeError(f"the advisor failed: {self.error}")
                    return self.findings
            self.kick(force=True)
            with self._cond:
                self._cond.wait_for(lambda: self._thread is None, timeout=60)


class _Snapshot:
    """A run as read at one moment, the face of a reader a `RunAnalysis` reads: a
    background advisor run works on it while the live reader moves on."""

    version = None  # never cached by `scalescope.analysis.analyse`

    def __init__(
        self, stats: pd.DataFrame, ops: pd.DataFrame, meta: Any, scalars: Any, held: Any = None
    ) -> None:
        self._stats, self.ops, self.meta, self._scalars = stats, ops, meta, scalars
        self._held = held

    def stats(self, wide: bool = True) -> pd.DataFrame:
        return self._stats

    @property
    def steps(self) -> np.ndarray:
        """The recorded steps (a run with none is not judged: `Verdict.unjudged`)."""
        return np.unique(self._stats["step"].to_numpy()) if len(self._stats) else np.array([])

    def scalar_rows(self) -> pd.DataFrame:
        return self._scalars

    def held_updates(self) -> pd.DataFrame | None:
        return self._held


def advisor_frame(frames: list[pd.DataFrame], columns: list[str]) -> pd.DataFrame:
    """Process 0's rows of the parts ``frames``, only ``columns`` (what the advisor reads:
    `scalescope.analysis.advisor_columns`), as one frame in the parts' order."""
    parts = []
    for frame in frames:
        process = frame["process"].to_numpy()
        parts.append(frame if (process == 0).all() else frame[process == 0])
    if not parts:
        return pd.DataFrame({c: pd.Series(dtype=np.float64) for c in columns})
    return pd.DataFrame(
        {c: np.concatenate([p[c].to_numpy() for p in parts]) for c in columns}, copy=False
    )


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
        self.advice = Advice(self)  # the advisor's findings, computed in the background

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

    def run_analysis(self) -> analysis.RunAnalysis:
        """The run's `scalescope.analysis.RunAnalysis` as read now (one per reader state,
        shared with a report or notebook of the same reader)."""
        with self.lock:
            return analysis.analyse(self.reader)

    @property
    def stats(self) -> pd.DataFrame:
        """Wide statistics of process 0 (the analysis bundle's)."""
        with self.lock:
            return self.run_analysis().stats

    @property
    def scalars(self) -> pd.DataFrame:
        return self.cached("scalars", lambda: self.reader.scalars)

    @property
    def labels(self) -> pd.Series:
        return self._of_ops("labels", analysis.op_labels)

    @property
    def heatmap_labels(self) -> pd.Series:
        """`labels`, with the format each op the run casts is cast to (``→ e4m3``): the
        heatmap marks the values a format judges."""

        def build(ops: pd.DataFrame) -> pd.Series:
            labels = analysis.op_labels(ops)
            if "cast_to" not in ops.columns:
                return labels
            cast = ops["cast_to"].fillna("").astype(str).reindex(labels.index).fillna("")
            marked = [f"{lab} → {c}" if c else lab for lab, c in zip(labels, cast)]
            return pd.Series(marked, index=labels.index, name=labels.name, dtype=object)

        return self._of_ops("heatmap_labels", build)

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
        """Per op: first/last measured step, number of steps measured, median gap: the
        frame of `scalescope.store.RunReader.measured` (process 0), read from the
        heatmap grid's "where measured" mask instead of a pass over every row."""
        return self.cached("measured", self._measured)

    def _measured(self) -> pd.DataFrame:
        with self.lock:
            self.grid.sync()
            ids, steps, present = self.grid.ops, self.grid.steps, self.grid.present
            table = self.ops
        n = present.sum(axis=1)
        has = n > 0
        ids, present, n = ids[has], present[has], n[has]
        first = present.argmax(axis=1)
        last = present.shape[1] - 1 - present[:, ::-1].argmax(axis=1)
        gap = np.where(n >= 2, 1.0, np.nan)  # measured at every step in between: 1
        for row in np.flatnonzero((n >= 2) & (last - first + 1 != n)):
            gap[row] = np.median(np.diff(np.flatnonzero(present[row])))
        per_op = pd.DataFrame(
            {
                "first_measured": steps[first].astype(np.float64),
                "last_measured": steps[last].astype(np.float64),
                "n_measured": n.astype(np.int64),
                "gap": gap,
            },
            index=pd.Index(ids.astype(np.int64), name="op"),
        )
        return measured_by_op(per_op, table)  # aliases get the rows they alias

    def last_measured(self, ops: Any) -> pd.Series:
        """Last measured step of each op id in ``ops`` (nullable ints, for tables)."""
        last = self.measured()["last_measured"].reindex(np.asarray(ops, np.int64))
        return last.astype("Int64")

    def notes(self) -> list[str]:
        """What every view computed from statistics says next to its figures: sampled
        statistics, ops measured in turns (`scalescope.analysis.measurement_notes`)."""
        with self.lock:
            return self.run_analysis().notes

    def findings(self) -> pd.DataFrame:
        """The advisor's findings of the run as it is now (waits for them; `advice`'s
        `Advice.latest` gives the newest without waiting)."""
        return self.advice.current()

    def verdict(self, findings: pd.DataFrame) -> analysis.Verdict:
        """The run's verdict from ``findings`` (the advisor's, as shown) and its logged
        loss (`scalescope.analysis.verdict`): the verdict of the analysis the findings
        came from, computed beside them."""
        bundle = self.advice.bundle
        if bundle is not None and bundle.findings is findings:
            return bundle.verdict
        with self.lock:
            loss = analysis.logged_loss(self.reader.scalar_rows())
        return analysis.unjudged_if_unrecorded(analysis.verdict(findings, loss), self, loss)

    def latest_verdict(self, wait: float = 0.0) -> analysis.Verdict | None:
        """The verdict of the newest findings there are (None before the first), starting
        the advisor when due; waits up to ``wait`` seconds for it."""
        findings = self.advice.latest(wait=wait)
        return None if findings is None else self.verdict(findings)

    def advisor_snapshot(
        self,
    ) -> tuple[int, list[pd.DataFrame], list[str], pd.DataFrame, Any, pd.DataFrame, Any]:
        """What a background advisor run reads, taken under the lock: the version, the
        parts read so far, the columns the advisor needs, the op table, metadata, logged
        scalars and the held-update figures."""
        with self.lock:
            ops = self.ops
            columns = analysis.advisor_columns(
                ["step", "op", "iteration", *self.reader.stat_names], ops
            )
            return (
                self.version,
                self.reader.part_frames(),
                columns,
                ops,
                self.reader.meta,
                self.reader.scalar_rows(),
                self.reader.held_updates(),
            )

    def summary(self) -> pd.DataFrame:
        return self.cached("summary", lambda: analysis.op_summary(self.stats, self.ops))

    def summary_metrics(self) -> list[str]:
        """Columns of `scalescope.analysis.op_summary` the Overview ranks ops by, in menu
        order: frac_nonfinite, log2_rms, rms, absmax, scale, each format's overflow,
        underflow and snr, each recipe's statistics, first_nonfinite_step."""
        names = set(self.reader.stat_names)
        out = [c for c in ("frac_nonfinite", "rms", "absmax", "scale") if c in names]
        if "rms" in names:
            out.insert(1 if "frac_nonfinite" in names else 0, "log2_rms")
        for fmt in self.formats:
            out += [f"{k}_{fmt}" for k in FORMAT_METRICS if f"{k}_{fmt}" in names]
        for recipe in self.recipes:
            out += [f"{k}_{recipe}" for k in RECIPE_METRICS if f"{k}_{recipe}" in names]
        if "frac_nonfinite" in names:
            out.append("first_nonfinite_step")
        return out

    def op_worst(self, metric: str) -> pd.Series:
        """One value per recorded op (index: op id) of an `op_summary` column: the value
        at the op's last recorded step for `LAST_STEP_METRICS`, the first step holding a
        NaN/inf for ``first_nonfinite_step``, else the worst over the recorded steps
        (`scalescope.analysis.metric_direction`, NaN skipped). From the heatmap's grid
        (one metric, no wide frame) when the run has no loop iterations; else from
        `summary`."""
        return self.cached(("op_worst", metric), lambda: self._op_worst(metric))

    def _op_worst(self, metric: str) -> pd.Series:
        with self.lock:
            self.grid.sync()
            if not self.grid.distinct:  # loop iterations: op_summary's own reductions
                return self.summary()[metric]
            ops = self.grid.ops
            present = self.grid.present
            source = "frac_nonfinite" if metric == "first_nonfinite_step" else metric
            grid = self.grid.grid(source)
            steps = self.grid.steps
        rows = present.any(axis=1)
        if metric == "first_nonfinite_step":
            with np.errstate(invalid="ignore"):
                bad = grid > 0
            values = np.where(bad.any(axis=1), steps[bad.argmax(axis=1)], np.nan)
        elif metric in LAST_STEP_METRICS:
            last = present.shape[1] - 1 - present[:, ::-1].argmax(axis=1)
            values = grid[np.arange(len(ops)), last].astype(np.float64)
        else:
            with np.errstate(invalid="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN rows: NaN
                if analysis.metric_direction(metric) == "min":
                    values = np.nanmin(grid, axis=1).astype(np.float64)
                else:
                    values = np.nanmax(grid, axis=1).astype(np.float64)
        return pd.Series(values[rows], index=pd.Index(ops[rows], name="op"), name=metric)

    def worst_ops(self, metric: str, n: int = 20) -> pd.DataFrame:
        """The ``n`` ops worst by ``metric`` (`summary_metrics`;
        `scalescope.analysis.worst_ops` order): index op id, columns label, pass,
        primitive, source and the metric."""
        values = self.op_worst(metric)
        table = self.ops.reindex(values.index)
        frame = pd.DataFrame(
            {
                "label": self.labels.reindex(values.index).to_numpy(),
                "pass": table["pass"].to_numpy(),
                "primitive": table["primitive"].to_numpy(),
                "source": table["source"].to_numpy() if "source" in table else "",
                metric: values.to_numpy(),
            },
            index=values.index,
        )
        return analysis.worst_ops(frame, metric, n=n, exclude=self.constant_ops())

    def constant_ops(self) -> np.ndarray:
        """Op ids constant by construction (`scalescope.analysis.constant_ops`: the op
        table's origins; for a run recorded without them, ops whose abs-max reaches
        `scalescope.analysis.FILL_MAGNITUDE`), never ranked among the worst ops."""

        def build() -> np.ndarray:
            found = analysis.constant_ops(self.ops)
            if "origin" in self.ops.columns or "absmax" not in self.reader.stat_names:
                return found
            amax = self.op_worst("absmax")
            fills = amax.index.to_numpy(np.int64)[amax.to_numpy() >= analysis.FILL_MAGNITUDE]
            return np.union1d(found, fills)

        return self.cached("constant_ops", build)

    def recorded_ops(self) -> np.ndarray:
        """Op ids with at least one row of statistics (process 0), ascending."""
        with self.lock:
            return self.grid.recorded_ops()

    def incidents(self) -> pd.DataFrame:
        """The flight recorder's incidents (the analysis bundle's)."""
        with self.lock:
            return self.run_analysis().incidents

    def whatif(self) -> pd.DataFrame:
        """The format and recipe what-if (the analysis bundle's)."""
        with self.lock:
            return self.run_analysis().whatif

    def op_stats(self, op: int) -> pd.DataFrame:
        """Wide rows of one op (process 0), all steps and loop iterations, as
        ``reader.stats(wide=True)`` has them: read from the parts (no wide frame)."""
        return self.cached(("op_stats", int(op)), lambda: self._op_stats(int(op)))

    def _op_stats(self, op: int) -> pd.DataFrame:
        if "stats" in self._cache:
            stats = self._cache["stats"]
            return stats[stats["op"].to_numpy() == op]
        frames = self.reader.part_frames()
        names = list(self.reader.stat_names)
        rows = [f.loc[(f["op"].to_numpy() == op) & (f["process"].to_numpy() == 0)] for f in frames]
        keys = ["step", "op", "iteration"]
        if rows:
            sub = pd.concat(rows, ignore_index=True)[keys + names]
        else:
            sub = pd.DataFrame(columns=keys + names)
        info = self.ops.reindex([op])
        for col in ("name", "pass", "primitive"):
            sub.insert(len(keys) + ("name", "pass", "primitive").index(col), col, info[col].iloc[0])
        return sub


#: Runs whose advisor `RunSet.warm` starts at once (the others start when opened).
WARM_RUNS = 16


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
        self._outside: set[str] = set()  # links to runs outside the root, warned once
        self.rescan()
        if not self._runs and not self._broken:
            raise ServeError(
                f"no runs under {self.root}: record one with `scalescope train ... --run DIR` "
                "or `ss.Run(DIR)`, then serve DIR or its parent folder"
            )

    def rescan(self) -> bool:
        """Look for runs that appeared under the root; True when one did."""
        found = list_runs(self.root, unreadable=True)  # an unreadable run is listed as such
        added = False
        with self.lock:
            for path in found:
                if not path.resolve().is_relative_to(self.root):
                    self._outside_once(path)
                    continue
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

    def _outside_once(self, path: Path) -> None:
        """Warn (once per path) that a run reached through a link outside the served
        folder is not served: PATH bounds what the dashboard reads."""
        if str(path) in self._outside:
            return
        self._outside.add(str(path))
        print(
            f"scalescope serve: warning: not serving {path}: it links to "
            f"{path.resolve()}, outside {self.root}",
            file=sys.stderr,
            flush=True,
        )

    def warm(self, name: str | None = None) -> None:
        """Start the advisor (in the background) on run ``name``, by default on every
        run (a page opens on the one whose verdict is worst, and marks each run's
        verdict in the run selector), so that the findings are ready sooner."""
        for key in [name] if name is not None else self.names[:WARM_RUNS]:
            self.get(key).advice.kick(force=True)

    def verdicts(self, wait: float | None = 0.0) -> dict[str, analysis.Verdict | None]:
        """Each run's verdict as far as known (None: its findings are not computed yet);
        ``wait``: seconds to wait in all for the advisor, None to compute every run's
        findings now (no served page: tests, notebooks)."""
        names = self.names
        if wait is None:
            return {n: self.get(n).verdict(self.get(n).findings()) for n in names}
        deadline = time.monotonic() + max(wait, 0.0)
        out: dict[str, analysis.Verdict | None] = {}
        for n in names:
            left = max(deadline - time.monotonic(), 0.0) if n in names[:WARM_RUNS] else 0.0
            out[n] = self.get(n).latest_verdict(wait=left)
        return out

    def worst(self, verdicts: dict[str, analysis.Verdict | None]) -> str | None:
        """The run that needs attention most among ``verdicts`` (`verdicts`'s), by
        `scalescope.analysis.worst_first`; the first run while a run's verdict is unknown
        and no known one is at risk or failing."""
        known = [(n, v) for n, v in verdicts.items() if v is not None]
        if not known:
            return self.names[0] if self.names else None
        name, v = known[analysis.worst_first([v for _, v in known])[0]]
        return name if v.rank > 0 or len(known) == len(verdicts) else self.names[0]

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
