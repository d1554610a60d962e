"""`open_run`: read a run directory, while it is being written or after.

The reader keeps the scalar statistics of every part it has read in memory (histograms
stay on disk and are read per request), and `RunReader.refresh` reads only the parts
that appeared since the last call. A part that cannot be read is skipped with a warning
naming the file; the rest of the run stays readable.

Not every op has a row at every recorded step: a run recorded under an overhead budget
(``ss.Run(path, budget=0.05)``) measures a rotating subset of ops at each recorded step.
`RunReader.measured` says, per op, when it was last measured and how often; the views
leave the other (op, step) cells blank. `RunReader.statistics` says whether the numbers
are exact or estimates from element subsampling (``sample=``).

The reader is pure storage: frames and series of what was recorded, and no import from
the analysis or the views above it. The conveniences of ``ss.open_run`` (``advise``,
``heatmap``, ``compare``, ``delayed_scaling``, figures that draw themselves in Jupyter)
are a subclass defined above them, `scalescope.run_view.RunView`.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from ..core.policy import unique_labels, without_shape
from . import layout as L

OpsArg = int | str | Sequence[int] | None
StepsArg = int | slice | Sequence[int] | None


class RunWarning(UserWarning):
    """Something in a run directory was skipped (a corrupt or foreign part)."""


class RunReader:
    """A run directory opened for reading (see `open_run`)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.meta: dict[str, Any] = L.read_metadata(self.path)
        self._seen: set[str] = set()
        self._stats_parts: list[tuple[Path, pd.DataFrame]] = []
        self._scalar_parts: list[pd.DataFrame] = []
        self._stats_cache: pd.DataFrame | None = None
        self._measured_cache: dict[Any, pd.DataFrame] = {}
        self._scalars_cache: pd.DataFrame | None = None
        self._figure_parts: list[pd.DataFrame] = []  # `updates` figures (reserved names)
        self._health_parts: list[pd.DataFrame] = []  # the flight recorder's, per step
        self._ops: pd.DataFrame | None = None
        #: Parts that could not be read (path, reason): skipped with a warning, listed by
        #: the report and the dashboard, and a gate failure unless damage is allowed.
        self.skipped: list[tuple[Path, str]] = []
        self._found: dict[str, int] = {}  # parts of process 0 on disk, per directory
        #: Counts the changes `refresh` has read (new parts, the op table, new metadata):
        #: what a cache of results computed from this reader is keyed by.
        self.version = 0
        self._incidents_seen: tuple = ()
        self.refresh()

    # -- metadata ---------------------------------------------------------------------

    @property
    def name(self) -> str:
        return str(self.meta.get("name", self.path.name))

    @property
    def status(self) -> str:
        """``recording`` while a writer has it open (or was killed), ``closed`` after.
        A run several processes record reads ``closed`` only once every process has
        closed (process 0 marks ``run.json``, the others leave a marker), so its last
        parts are on disk; ``recording`` until then."""
        status = str(self.meta.get("status", "unknown"))
        sessions = self.meta.get("sessions") or [{}]
        processes = int(sessions[-1].get("processes", 1))
        if status in ("closed", "damaged") and processes > 1:
            markers = (self.path / L.closed_marker_name(k) for k in range(1, processes))
            if not all(m.is_file() for m in markers):
                return "recording"
        if status == "recording" and self._abandoned() is not None:
            return "damaged"
        return "damaged" if status == "closed" and self.damage else status

    def _abandoned(self) -> str | None:
        """The writer of a ``recording`` run that is gone without closing it (killed),
        as `layout.abandoned_writer` sees it on this host; None while it records."""
        holder = L.abandoned_writer(self.path)
        if holder is None:
            return None
        try:  # it may have closed the run since this reader read its metadata
            if L.read_metadata(self.path).get("status") != "recording":
                return None
        except (OSError, ValueError, L.RunError):
            return None
        return holder

    @property
    def damage(self) -> list[str]:
        """What the run lost, one note per failed writer session (`Run` marks a run
        ``damaged`` when a write failed: disk full, file size limit, ...), and a writer
        that ended without closing the run (killed: what it had not written is lost);
        the closed markers of other processes count too. Empty for an intact run."""
        notes = [str(n) for n in self.meta.get("damage") or []]
        for directory, written in (self.meta.get("parts") or {}).items():
            missing = int(written) - self._found.get(directory, 0)
            if missing > 0:
                notes.append(
                    f"{missing} of the {written} {directory}/ parts process 0 wrote are "
                    "missing (deleted or moved): the steps they held are lost"
                )
        if self.meta.get("status") == "recording" and (holder := self._abandoned()):
            notes.append(
                f"the writer ({holder}) ended without closing the run: the steps it had "
                "not yet written are lost"
            )
        sessions = self.meta.get("sessions") or [{}]
        for k in range(1, int(sessions[-1].get("processes", 1))):
            try:
                marker = json.loads((self.path / L.closed_marker_name(k)).read_text())
            except (OSError, ValueError):  # no marker yet: that process still records
                continue
            if isinstance(marker, dict) and marker.get("damage"):
                notes.append(str(marker["damage"]))
        return notes

    @property
    def config(self) -> dict[str, Any]:
        return dict(self.meta.get("config", {}))

    @property
    def formats(self) -> tuple[str, ...]:
        return tuple(self.meta.get("formats", ()))

    @property
    def recipes(self) -> tuple[str, ...]:
        """Block-scaled recipes recorded (``formats=`` entries such as ``"nvfp4"``)."""
        return tuple(self.meta.get("recipes", ()))

    @property
    def stat_names(self) -> tuple[str, ...]:
        return tuple(self.meta.get("stat_names", ()))

    @property
    def hist_columns(self) -> tuple[str, ...]:
        """Labels of the histogram bins (``zero``, ``below``, ``2^-40`` ... ``nonfinite``)."""
        return tuple(self.meta.get("hist_columns", ()))

    @property
    def statistics(self) -> str:
        """``"exact"`` or ``"sampled"`` (each value measured on a subset of at most
        `sample` elements: the statistics are estimates). Runs recorded before the
        metadata said so: ``"sampled"`` when they were recorded with ``sample=``."""
        value = self.meta.get("statistics")
        if value in ("exact", "sampled"):
            return str(value)
        return "sampled" if self.meta.get("sample") is not None else "exact"

    @property
    def sample(self) -> int | None:
        """The per-value element cap the run was recorded with (None: every element)."""
        value = self.meta.get("sample")
        return None if value is None else int(value)

    @property
    def unrecorded_calls(self) -> dict[str, int] | None:
        """``{"count", "first_step", "functions"}`` of the tracked calls that traced
        another graph than the run's and ran unrecorded (the flight recorder still checked
        them), ``functions`` counting them by tracked function (absent in runs written
        before 2026-12-03), or None when every call was the run's graph (written when the
        run closes)."""
        value = self.meta.get("unrecorded_calls")
        return dict(value) if value else None

    @property
    def ended_by(self) -> str:
        """The exception that ended the last recording session's ``with Run(...)``
        block (``"KeyboardInterrupt: "``), "" when it ended normally."""
        sessions = self.meta.get("sessions") or [{}]
        return str(sessions[-1].get("ended_by") or "")

    @property
    def budget(self) -> float | None:
        """The overhead budget the run was recorded under (e.g. 0.05: a rotating subset
        of ops measured per recorded step), or None (every op at every recorded step)."""
        value = self.meta.get("budget")
        return None if value is None else float(value)

    @property
    def ops(self) -> pd.DataFrame:
        """The op table, indexed by op id (empty until the first recorded step)."""
        if self._ops is None:
            return L.ops_frame([])
        return self._ops

    @property
    def steps(self) -> np.ndarray:
        """Recorded steps, ascending."""
        frame = self._frame()
        return np.unique(frame["step"].to_numpy()) if len(frame) else np.zeros(0, np.int64)

    def verifications(self) -> list[dict[str, Any]]:
        """Outcomes of ``scalescope verify`` on this run, oldest first: each the policy
        (``[[pattern, target], ...]``), ``steps``, both loss curves, the measured ``gap``
        and ``verdict``, and the what-if's ``predicted`` verdict (see
        `scalescope.Verification`)."""
        return L.read_verifications(self.path)

    @property
    def scale_graph_steps(self) -> list[int]:
        """Steps with a recorded scale graph (`Run.scale_graph`), ascending."""
        return list(L.list_scale_graphs(self.path))

    def scale_graph(self, step: int | None = None) -> pd.DataFrame:
        """The scale graph recorded at ``step`` (None or -1: the latest): one row per op
        (indexed by op id), with the log2 RMS of its value and of its gradient
        (`scalescope.scale_graph`); ``attrs["step"]`` is the step. A plain DataFrame
        (``ss.open_run`` readers return one that draws itself in Jupyter)."""
        graphs = L.list_scale_graphs(self.path)
        if not graphs:
            raise L.RunError(
                f"{self.path}: no scale graph recorded; record one with "
                "run.scale_graph(step, loss_fn, *args)"
            )
        if step is None or step == -1:  # as `hist`'s step=-1: the latest
            step = max(graphs)
        if step not in graphs:
            raise KeyError(f"no scale graph at step {step}; recorded at steps {list(graphs)}")
        frame = pd.read_parquet(graphs[step])
        frame["shape"] = [tuple(int(d) for d in s) for s in frame["shape"]]
        out = frame.drop(columns=["step"]).set_index("op")
        out.attrs["step"] = step
        return out

    # -- the flight recorder's incidents ------------------------------------------------

    def incidents(self) -> pd.DataFrame:
        """The flight recorder's incidents (`scalescope.Run`'s ``detect``), one row per
        incident, by step: ``step``, ``trigger`` (nonfinite, loss_spike, norm_spike),
        ``op`` (id, -1 when none was found), ``name`` (``pass/name``; an input
        ``input/x``), ``source`` (file:line), ``detail`` (what was found: the share of
        non-finite elements, the op's and its inputs' statistics), ``value`` (non-finite
        elements, or the spiking loss/norm),
        ``formats`` (the formats its finite values exceed), ``devices`` (on a step spread
        over several devices: those holding the op's NaN/Inf, ``{"device", "process",
        "nonfinite"}`` each; None otherwise), ``process``. Empty for a run
        without incidents. An unreadable incidents file is a `RunError` naming it."""
        rows: list[dict[str, Any]] = []
        for path in sorted(self.path.glob("incidents*.json")):
            rows += L.read_incidents_file(path)
        columns = list(L.INCIDENT_COLUMNS)
        if not rows:
            return pd.DataFrame({c: pd.Series(dtype=object) for c in columns})
        frame = pd.DataFrame(rows)
        for col in columns:
            if col not in frame:
                frame[col] = None
        frame = frame.sort_values(["step", "process"], kind="stable").reset_index(drop=True)
        return frame[columns + [c for c in frame.columns if c not in columns]]

    # -- incremental reading -----------------------------------------------------------

    def refresh(self) -> int:
        """Read the parts written since the last call; returns how many were new."""
        before = self.meta, self._ops
        try:
            self.meta = L.read_metadata(self.path)
        except L.RunError as err:  # keep the last good metadata while it is replaced
            warnings.warn(f"{err}; keeping the previous metadata", RunWarning, stacklevel=2)
        if self._ops is None:
            self._ops = self._read_ops()
            if self._ops is not None:
                self._measured_cache.clear()
        new = 0
        self._found = {
            d: sum(L.parse_part_name(p.name)[1] == 0 for p in L.list_parts(self.path / d))
            for d in (L.STATS_DIR, L.SCALARS_DIR)
        }
        for part in L.list_parts(self.path / L.STATS_DIR):
            if str(part) in self._seen:
                continue
            self._seen.add(str(part))
            frame = self._read_part(part, [*L.KEY_COLUMNS, *self.stat_names])
            if frame is not None:
                self._stats_parts.append((part, frame))
                self._stats_cache = None
                self._measured_cache.clear()
                new += 1
        for part in L.list_parts(self.path / L.SCALARS_DIR):
            if str(part) in self._seen:
                continue
            self._seen.add(str(part))
            frame = self._read_part(part, list(L.SCALAR_COLUMNS))
            if frame is not None:
                names = frame["name"].astype(str)
                own = names.str.startswith(L.FIGURE_PREFIX).to_numpy()
                health = names.str.startswith(L.HEALTH_PREFIX).to_numpy()
                if own.any():  # the run's own figures are not logged scalars
                    self._figure_parts.append(frame[own])
                if health.any():
                    self._health_parts.append(frame[health])
                if own.any() or health.any():
                    frame = frame[~(own | health)].reset_index(drop=True)
                self._scalar_parts.append(frame)
                self._scalars_cache = None
                new += 1
        incidents = self._incidents_signature()
        changed = incidents != self._incidents_seen
        self._incidents_seen = incidents
        if new or changed or self._ops is not before[1] or self.meta != before[0]:
            self.version += 1
        return new

    def _incidents_signature(self) -> tuple:
        """Names, sizes and times of the incidents files: a new incident moves it."""
        out = []
        for path in sorted(self.path.glob("incidents*.json")):
            try:
                st = path.stat()
            except OSError:
                continue
            out.append((path.name, st.st_size, st.st_mtime_ns))
        return tuple(out)

    def part_frames(self, start: int = 0) -> list[pd.DataFrame]:
        """The statistics of the parts read so far, one frame per part in the order they
        were read (from the ``start``-th on): key columns and scalar statistics, as
        stored. A view that keeps its own incremental state reads only the new ones."""
        return [frame for _, frame in self._stats_parts[start:]]

    def _read_ops(self) -> pd.DataFrame | None:
        """The op table (None before the first recorded step). Every statistic row is
        named through it, so a run whose table is gone or unreadable cannot be read: a
        `RunError` naming the file, not a run of 0 ops."""
        path = self.path / L.OPS_FILE
        if not path.is_file():
            if self.meta.get("graph"):  # written before run.json says the graph is known
                raise L.RunError(
                    f"{path} is missing: the run's op table (what every statistic row "
                    "refers to) was deleted or never copied; the run cannot be read"
                )
            return None
        try:
            frame = pd.read_parquet(path)
            if "op" not in frame.columns:
                raise ValueError("no 'op' column")
        except Exception as err:  # noqa: BLE001 - any reader failure means a bad file
            raise L.RunError(
                f"{path} is unreadable ({type(err).__name__}: {err}): the run's op table "
                "is corrupt; the run cannot be read"
            ) from None
        frame = frame.set_index("op")
        for col in L.LIST_COLUMNS:
            if col in frame.columns:
                frame[col] = [tuple(int(v) for v in x) for x in frame[col]]
        return frame

    def _read_part(self, part: Path, columns: list[str]) -> pd.DataFrame | None:
        try:
            schema = pq.read_schema(part)
            missing = [c for c in columns if c not in schema.names]
            if missing:
                raise ValueError(f"missing columns {missing}")
            return pq.read_table(part, columns=columns).to_pandas()
        except Exception as err:  # noqa: BLE001 - corrupt, truncated or foreign file
            warnings.warn(f"skipping unreadable part {part}: {err}", RunWarning, stacklevel=3)
            self.skipped.append((part, f"{type(err).__name__}: {err}"))
            return None

    def _frame(self) -> pd.DataFrame:
        if self._stats_cache is None:
            frames = [f for _, f in self._stats_parts]
            if frames:
                frame = pd.concat(frames, ignore_index=True)
                frame = frame.sort_values(["step", "process", "op", "iteration"], kind="stable")
                self._stats_cache = frame.reset_index(drop=True)
            else:
                self._stats_cache = pd.DataFrame(
                    {c: pd.Series(dtype="int64") for c in L.KEY_COLUMNS}
                    | {c: pd.Series(dtype="float32") for c in self.stat_names}
                )
        return self._stats_cache

    # -- when each op was measured -------------------------------------------------------

    def measured(self, process: int | None = 0) -> pd.DataFrame:
        """When each op was measured: one row per op of the op table (index: op id;
        aliases get the rows of the op they alias), columns ``first_measured`` and
        ``last_measured`` (step numbers as float, NaN for an op never measured),
        ``n_measured`` (number of recorded steps with a row of the op) and ``gap`` (median
        number of recorded steps between two consecutive measurements: 1 when the op is
        measured at every recorded step, ~K under a budget that measures it every K-th;
        NaN with fewer than two measurements).

        Computed from the rows already in memory and cached until `refresh` reads new
        parts. ``process``: rows of that JAX process (None: all)."""
        key = ("measured", process)
        if key not in self._measured_cache:
            self._measured_cache[key] = self._measured(process)
        return self._measured_cache[key]

    def last_measured(self, process: int | None = 0) -> pd.Series:
        """Per op id, the last step at which the op has a row (NaN: never measured).
        See `measured`."""
        return self.measured(process)["last_measured"]

    def measurement_period(self, process: int | None = 0) -> float | None:
        """Median number of recorded steps between two consecutive measurements of an op,
        over all ops (1.0 when every op is measured at every recorded step; ~K when a
        budget measures each op every K-th recorded step); None before any op has been
        measured twice."""
        key = ("period", process)
        if key not in self._measured_cache:
            gaps = self._measured_pairs(process)[2]
            self._measured_cache[key] = float(np.median(gaps)) if len(gaps) else None
        return self._measured_cache[key]

    def _measured_pairs(self, process: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(op, step index, gaps)``: the distinct (op, recorded-step index) pairs sorted
        by op then step, and the index gaps between consecutive pairs of one op."""
        key = ("pairs", process)
        if key in self._measured_cache:
            return self._measured_cache[key]
        frame = self._frame()
        op = frame["op"].to_numpy(np.int64)
        step = frame["step"].to_numpy(np.int64)
        if process is not None:
            keep = frame["process"].to_numpy() == process
            op, step = op[keep], step[keep]
        steps = np.unique(step)
        index = np.searchsorted(steps, step)
        order = np.lexsort((index, op))
        op, index = op[order], index[order]
        new = np.ones(len(op), bool)
        new[1:] = (op[1:] != op[:-1]) | (index[1:] != index[:-1])
        op, index = op[new], index[new]
        same = op[1:] == op[:-1]
        gaps = (index[1:] - index[:-1])[same]
        out = (op, index, gaps)
        self._measured_cache[key] = out
        self._measured_cache[("steps", process)] = steps
        return out

    def _measured(self, process: int | None) -> pd.DataFrame:
        op, index, gaps = self._measured_pairs(process)
        steps = self._measured_cache[("steps", process)]
        ids, starts, counts = np.unique(op, return_index=True, return_counts=True)
        per_op = pd.DataFrame(
            {
                "first_measured": steps[index[starts]].astype(np.float64),
                "last_measured": steps[index[starts + counts - 1]].astype(np.float64),
                "n_measured": counts.astype(np.int64),
            },
            index=pd.Index(ids, name="op"),
        )
        gap_op = op[1:][op[1:] == op[:-1]]
        per_op["gap"] = pd.Series(gaps, dtype=np.float64).groupby(gap_op).median()
        return measured_by_op(per_op, self.ops)

    # -- queries ------------------------------------------------------------------------

    def resolve_ops(self, ops: OpsArg) -> np.ndarray:
        """Op ids holding the statistics of ``ops``: an id, a list of ids, or a regex
        matched against ``pass/name`` and the labels the views show (``...#2``). Aliases
        resolve to the op they alias."""
        table = self.ops
        if ops is None:
            return np.asarray(table.index[table["note"] == ""], np.int64)
        if isinstance(ops, str):
            try:
                rx = re.compile(ops)
            except re.error as err:
                raise ValueError(f"ops: not a valid regex ({ops!r}): {err}") from err
            plain = table["pass"] + "/" + table["name"]
            shown = self.labels().reindex(table.index)  # the labels the views show
            ids = table.index[plain.str.contains(rx) | shown.str.contains(rx)]
        else:
            if isinstance(ops, bool | float) or not isinstance(ops, int | np.integer | Iterable):
                raise TypeError(
                    f"ops: an op id, a list of ids or a regex on op labels, got {ops!r}"
                )
            ids = [ops] if isinstance(ops, int | np.integer) else list(ops)
            unknown = [i for i in ids if i not in table.index]
            if unknown:
                raise KeyError(f"ops: no op with id {unknown[0]} in {self.path} ({len(table)} ops)")
        src = table.loc[list(ids), "stats_op"].to_numpy()
        return np.unique(src[src >= 0]).astype(np.int64)

    def stats(
        self,
        metric: str | Sequence[str] | None = None,
        ops: OpsArg = None,
        steps: StepsArg = None,
        *,
        process: int | None = 0,
        wide: bool = False,
    ) -> pd.DataFrame:
        """Statistics as a long DataFrame: step, op, iteration, name, pass, primitive,
        metric, value (float64). ``wide=True``: one column per metric instead.

        ``metric``: names from ``stat_names`` (default all). ``ops``: see `resolve_ops`.
        ``steps``: a step, a list of steps, or a slice of step numbers (``slice(100,
        None)``); a negative number counts from the last recorded step, as in `hist`
        (``-1``: the last; ``slice(-3, None)``: the last three). ``process``: rows
        written by that JAX process (None: all).
        """
        names = self._metrics(metric)
        frame = self._frame()
        mask = np.ones(len(frame), bool)
        if process is not None:
            mask &= frame["process"].to_numpy() == process
        if ops is not None:
            mask &= np.isin(frame["op"].to_numpy(), self.resolve_ops(ops))
        if steps is not None:
            steps = _from_the_end(steps, np.asarray(self.steps, np.int64))
            mask &= _step_mask(frame["step"].to_numpy(), steps)
        keys = ["step", "op", "iteration"] + ([] if process is not None else ["process"])
        sub = frame.loc[mask, keys + names].reset_index(drop=True)
        table = self.ops
        info = table[["name", "pass", "primitive"]] if len(table) else None
        if info is not None:
            sub = sub.join(info, on="op")
        else:
            sub = sub.assign(name=pd.Series(dtype=str), **{"pass": ""}, primitive="")
        ident = keys + ["name", "pass", "primitive"]
        if wide:
            return sub[ident + names]
        long = sub.melt(id_vars=ident, value_vars=names, var_name="metric", value_name="value")
        long["value"] = long["value"].astype(np.float64)
        return long

    def _metrics(self, metric: str | Sequence[str] | None) -> list[str]:
        known = list(self.stat_names)
        if metric is not None and (
            isinstance(metric, int | float | np.number) or not isinstance(metric, Iterable)
        ):
            raise TypeError(
                f"metric: a statistic's name or a list of them, got {metric!r} (ops are "
                "picked with ops=, e.g. stats('rms', ops=[64]))"
            )
        names = known if metric is None else [metric] if isinstance(metric, str) else list(metric)
        bad = [m for m in names if m not in known]
        if bad:
            raise KeyError(f"unknown metric {bad[0]!r}; this run records: {', '.join(known)}")
        return names

    @property
    def scalars(self) -> pd.DataFrame:
        """Logged scalars: one row per step (index ``step``), one column per name.

        Several processes logging the same name at the same step (each process of a
        data-parallel run logs its loss) give one value: the lowest process's (process 0
        when it logged it), the last one it logged. `scalar_rows` keeps them all."""
        if self._scalars_cache is None:
            self._scalars_cache = one_value_per_step(self.scalar_rows())
        return self._scalars_cache

    def held_updates(self) -> pd.DataFrame:
        """What the formats a precision policy holds the state in kept of each update
        (`scalescope.store.updates`), one row per recorded step and held leaf: ``step``,
        ``op`` (the leaf's input op), ``moved``, ``lost``, ``d2``, ``e2``. Empty for a
        run without such a policy."""
        cols = ["step", "op", *L.FIGURE_FIELDS]
        if not self._figure_parts:
            return pd.DataFrame({c: pd.Series(dtype="int64" if c in cols[:2] else "float64")
                                 for c in cols})  # fmt: skip
        long = pd.concat(self._figure_parts, ignore_index=True)
        long = long[long["process"] == long["process"].min()]
        parts = long["name"].astype(str).str.slice(len(L.FIGURE_PREFIX)).str.split("/")
        op = pd.to_numeric(parts.str[0], errors="coerce")
        long = long.assign(op=op, field=parts.str[1])
        long = long[op.notna().to_numpy() & long["field"].isin(L.FIGURE_FIELDS).to_numpy()]
        wide = long.pivot_table(index=["step", "op"], columns="field", values="value",
                                aggfunc="last")  # fmt: skip
        wide = wide.reindex(columns=list(L.FIGURE_FIELDS)).reset_index()
        wide.columns.name = None
        return wide.astype({"step": np.int64, "op": np.int64})

    def health(self) -> pd.DataFrame:
        """The flight recorder's check of every tracked step (`scalescope.Run`'s
        ``detect``), one row per step: ``step``, ``nonfinite`` (NaN/Inf output
        elements), ``loss`` (the step's loss output, NaN where it has none) and ``norm``
        (of the update, or of the outputs). Empty for a run without it (``detect=False``,
        or written before 2026-12-03)."""
        cols = ["step", "nonfinite", "loss", "norm"]
        if not self._health_parts:
            return pd.DataFrame({c: pd.Series(dtype="int64" if c == "step" else "float64")
                                 for c in cols})  # fmt: skip
        long = pd.concat(self._health_parts, ignore_index=True)
        long = long[long["process"] == long["process"].min()]
        field = long["name"].astype(str).str.slice(len(L.HEALTH_PREFIX))
        wide = long.assign(field=field).pivot_table(
            index="step", columns="field", values="value", aggfunc="last"
        )
        wide = wide.reindex(columns=cols[1:]).reset_index()
        wide.columns.name = None
        return wide.astype({"step": np.int64})

    @property
    def loss_logged(self) -> bool:
        """Whether a scalar ``loss`` was logged (`Run.log`); when not, `scalar_rows` gives
        the flight recorder's loss of each step under that name."""
        return any((f["name"] == "loss").any() for f in self._scalar_parts)

    def scalar_rows(self, process: int | None = None) -> pd.DataFrame:
        """Logged scalars as written, one row per logged value: ``step, name, value,
        process``, in the order each process logged them. ``process``: that JAX
        process's rows only (None: all). A run that logs no ``loss`` gets the tracked
        step's own loss output as read by the flight recorder (`health`) under that
        name, so that the verdict, the report and the dashboard have a loss curve
        (`loss_logged` tells the two apart)."""
        parts = list(self._scalar_parts)
        if self._health_parts and not self.loss_logged:
            parts += [
                f[f["name"] == L.HEALTH_PREFIX + "loss"].assign(name="loss")
                for f in self._health_parts
            ]
        if not parts:
            return pd.DataFrame(
                {
                    "step": pd.Series(dtype="int64"),
                    "name": pd.Series(dtype=str),
                    "value": pd.Series(dtype="float64"),
                    "process": pd.Series(dtype="int32"),
                }
            )
        long = pd.concat(parts, ignore_index=True)
        if process is not None:
            long = long[long["process"] == process]
        return long.reset_index(drop=True)

    @property
    def processes(self) -> list[int]:
        """The JAX processes with parts in the run (statistics or scalars), ascending:
        ``[0]`` for a single-process run. With a step jitted over a global mesh, process 0
        writes the statistics and every process its logged scalars."""
        found = {int(p) for _, f in self._stats_parts for p in pd.unique(f["process"])}
        found |= {int(p) for f in self._scalar_parts for p in pd.unique(f["process"])}
        return sorted(found)

    def labels(self) -> pd.Series:
        """The unique label of each op id, as the findings, heatmaps and dashboard show it
        (``bwd/dense_1/dot_general#2``; `scalescope.core.policy.unique_labels`)."""
        table = self.ops.sort_index()
        passes, names = table["pass"].astype(str).tolist(), table["name"].astype(str).tolist()
        names = unique_labels(passes, names)
        return pd.Series(names, index=table.index, name="label", dtype=object)

    def op_id(self, op: int | str) -> int:
        """The id of ``op``: an id, its label as the views show it
        (``bwd/dense_1/dot_general#2``, with or without the shape after it), or an exact
        ``pass/name`` or ``name`` that only one op has."""
        table = self.ops
        if isinstance(op, int | np.integer) and not isinstance(op, bool):
            if op not in table.index:
                raise KeyError(f"no op with id {op} in {self.path} ({len(table)} ops)")
            return int(op)
        if not isinstance(op, str):
            raise TypeError(f"op: an op id or label, got {op!r}")
        labels = self.labels()
        hits = labels.index[labels == without_shape(op)]  # a label as shown, shape and all
        if len(hits) == 1:
            return int(hits[0])
        plain = table["pass"] + "/" + table["name"]
        hits = table.index[(plain == op) | (table["name"] == op)]
        if len(hits) != 1:
            if not hits.empty:
                shown = ", ".join(f"{labels[i]} (op {i})" for i in hits[:4])
                raise KeyError(
                    f"{len(hits)} ops named {op!r} in {self.path}: {shown}"
                    f"{' ...' if len(hits) > 4 else ''}; use one of those labels or an id"
                )
            raise KeyError(f"no op named {op!r} in {self.path}; use an id or a label")
        return int(hits[0])

    def hist(self, op: int | str, step: int = -1, iteration: int | None = None) -> pd.Series:
        """Exponent histogram (counts per bin, indexed by bin label) of ``op`` at ``step``
        (negative: counted from the last recorded step). Rows of all loop iterations are
        summed unless ``iteration`` picks one. ``attrs``: step, op, iteration. A plain
        Series (``ss.open_run`` readers return a `scalescope.notebook.HistSeries`, which
        draws itself in Jupyter with each format's range shaded)."""
        if not self.hist_columns:
            raise ValueError(f"{self.path} was recorded with histograms=False")
        if isinstance(step, bool) or not isinstance(step, int | np.integer):
            raise TypeError(f"hist: step must be a step number (an int), got {step!r}")
        op_id = self.op_id(op)
        rec = self.ops.loc[op_id]
        src = int(rec["stats_op"])
        if src < 0:
            raise ValueError(f"op {op!r} has no statistics ({rec['note']})")
        recorded = self.steps
        if len(recorded) == 0:
            raise KeyError(f"{self.path} has no recorded steps yet")
        if step < 0:
            if -step > len(recorded):
                raise KeyError(f"step {step}: only {len(recorded)} steps are recorded")
            step = int(recorded[step])
        if step not in recorded:
            near = recorded[np.argsort(np.abs(recorded - step))[:3]]
            raise KeyError(f"step {step} is not recorded; nearest: {sorted(near.tolist())}")
        cols = L.hist_column_names(len(self.hist_columns))
        rows = []
        for part, frame in self._stats_parts:
            sel = (frame["step"] == step) & (frame["op"] == src) & (frame["process"] == 0)
            if iteration is not None:
                sel &= frame["iteration"] == iteration
            if sel.any():
                table = pq.read_table(part, columns=cols).to_pandas()
                rows.append(table.loc[sel.to_numpy()].to_numpy())
        if not rows:
            if iteration is not None:
                raise KeyError(f"op {op!r} has no row for iteration {iteration} at step {step}")
            last = self.last_measured().get(src, np.nan)
            when = "never measured" if last != last else f"last measured at step {int(last)}"
            why = "a budget measures ops in turns; " if self.budget is not None else ""
            raise KeyError(f"op {op!r} was not measured at step {step} ({why}{when})")
        counts = np.concatenate(rows).sum(axis=0)
        label = str(self.labels()[op_id])
        series = pd.Series(counts, index=pd.Index(self.hist_columns, name="bin"), name=label)
        series.attrs.update(step=step, op=op_id, iteration=iteration)
        return series

    def op_rows(
        self,
        op: int | str,
        process: int | None = 0,
        iteration: int | None = None,
    ) -> pd.DataFrame:
        """The recorded rows of ``op`` (an id or ``pass/name``, as for `hist`) in part
        order: ``step``, ``count``, ``absmax``, ``scale`` and, when the run records
        histograms, one column per exponent bin (labelled as in `hist`). ``process``: rows
        of that JAX process (None: all); ``iteration``: rows of that loop iteration only
        (None: all). This is what `scalescope.analysis.delayed_scaling_run` replays."""
        rec = self.ops.loc[self.op_id(op)]
        src = int(rec["stats_op"])
        if src < 0:
            raise ValueError(f"op {op!r} has no statistics ({rec['note']})")
        cols = L.hist_column_names(len(self.hist_columns))
        keys = ["step", "count", "absmax", "scale"]
        pieces = []
        for part, frame in self._stats_parts:
            sel = frame["op"].to_numpy() == src
            if process is not None:
                sel &= frame["process"].to_numpy() == process
            if iteration is not None:
                sel &= frame["iteration"].to_numpy() == iteration
            if not sel.any():
                continue
            rows = frame.loc[sel, keys].reset_index(drop=True)
            if cols:  # histograms stay on disk: read this part's bins
                hist = pq.read_table(part, columns=cols).to_pandas().to_numpy()[sel]
                rows = rows.join(pd.DataFrame(hist, columns=list(self.hist_columns)))
            pieces.append(rows)
        if not pieces and iteration is not None:
            raise KeyError(f"op {op!r} has no row for iteration {iteration}")
        if not pieces and process is not None:
            others = sorted(
                {int(p) for _, f in self._stats_parts for p in f.loc[f["op"] == src, "process"]}
            )
            if others:  # rows, but none of that process: say whose they are
                raise KeyError(
                    f"op {op!r} has no row from process {process}; its rows come from "
                    f"process{'es' if len(others) > 1 else ''} "
                    f"{', '.join(map(str, others))} (process=None: all)"
                )
        return pd.concat(pieces, ignore_index=True) if pieces else pd.DataFrame(columns=keys)

    def __repr__(self) -> str:
        return (
            f"RunReader({str(self.path)!r}: {len(self.ops)} ops, {len(self.steps)} recorded "
            f"steps, {self.status})"
        )


def one_value_per_step(long: pd.DataFrame) -> pd.DataFrame:
    """Logged scalar rows (``step, name, value, process``, in logging order within each
    process) as one row per step and one column per name: per (step, name), the value of
    the lowest process that logged it, its last. NaN and Inf are kept (a loss turning
    NaN is what a user looks for): no aggregation that skips them."""
    if long.empty:
        return pd.DataFrame(index=pd.Index([], name="step", dtype="int64"))
    lowest = long.groupby(["step", "name"])["process"].transform("min")
    own = long[long["process"] == lowest]
    last = own.drop_duplicates(subset=["step", "name"], keep="last")
    wide = last.pivot(index="step", columns="name", values="value")
    wide.columns.name = None
    return wide.sort_index()


def _from_the_end(steps: StepsArg, recorded: np.ndarray) -> StepsArg:
    """``steps`` with each negative number made the recorded step it counts back to
    (-1: the last of ``recorded``, sorted); a slice's bounds clamp as Python's do."""

    def one(k: Any) -> int:
        k = int(k)
        if k >= 0:
            return k
        if -k > len(recorded):
            raise KeyError(f"steps={k}: only {len(recorded)} steps are recorded")
        return int(recorded[k])

    def bound(k: Any, past: float) -> Any:
        if k is None or int(k) >= 0:
            return k
        return int(recorded[int(k)]) if -int(k) <= len(recorded) else past

    if isinstance(steps, slice):
        return slice(bound(steps.start, -np.inf), bound(steps.stop, -np.inf), steps.step)
    if isinstance(steps, int | np.integer):
        return one(steps)
    return [one(k) for k in steps]


def _step_mask(values: np.ndarray, steps: StepsArg) -> np.ndarray:
    if isinstance(steps, slice):
        if steps.step not in (None, 1):
            raise ValueError("steps: a slice of step numbers cannot have a stride")
        lo = -np.inf if steps.start is None else steps.start
        hi = np.inf if steps.stop is None else steps.stop
        return (values >= lo) & (values < hi)
    if isinstance(steps, int | np.integer):
        return values == steps
    return np.isin(values, np.asarray(list(steps), np.int64))


def measured_by_op(per_op: pd.DataFrame, table: pd.DataFrame) -> pd.DataFrame:
    """``per_op`` (``first_measured``, ``last_measured``, ``n_measured``, ``gap`` per
    measured statistics row's op) for every op of the op ``table``: an alias gets the row
    of the op whose statistics it shares (``stats_op``), an op never measured 0 counts."""
    if len(table) and "stats_op" in table.columns:
        out = per_op.reindex(table["stats_op"].to_numpy(np.int64))
        out.index = pd.Index(table.index.to_numpy(np.int64), name="op")
        extra = per_op.index.difference(out.index)  # rows of ops the table lacks
        if len(extra):
            out = pd.concat([out, per_op.loc[extra]]).sort_index()
    else:
        out = per_op
    out["n_measured"] = out["n_measured"].fillna(0).astype(np.int64)
    return out[["first_measured", "last_measured", "n_measured", "gap"]]


def open_run(path: str | os.PathLike) -> RunReader:
    """Open a run directory for reading; clear errors for a missing path, a file, or a
    directory that is not a run (pointing at `list_runs` when it holds runs)."""
    return RunReader(path)


def list_runs(
    directory: str | os.PathLike, max_depth: int = 3, *, unreadable: bool = False
) -> list[Path]:
    """Run directories under ``directory`` (itself included when it is a run), sorted.
    Does not descend into runs. ``unreadable``: include runs whose ``run.json`` cannot
    be read (`layout.is_run`), for a view that reports them."""
    root = Path(directory)
    if not root.exists():
        raise FileNotFoundError(f"list_runs: {root} does not exist")
    if not root.is_dir():
        raise NotADirectoryError(f"list_runs: {root} is not a directory")
    found: list[Path] = []

    def walk(path: Path, depth: int) -> None:
        if (path / L.RUN_FILE).is_file() and L.is_run(path, unreadable=unreadable):
            found.append(path)
            return
        if depth >= max_depth:
            return
        try:
            children = sorted(p for p in path.iterdir() if p.is_dir() and p.name[0] != ".")
        except OSError:
            return
        for child in children:
            walk(child, depth + 1)

    walk(root, 0)
    return sorted(found)
