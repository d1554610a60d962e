"""`Run`: record a training run into a run directory without blocking the training loop.

``run.track(step)`` compiles two variants of the step: the plain one, and an instrumented
one that also returns the probe's statistics. Every ``every``-th call runs the
instrumented variant; its statistics start an asynchronous device-to-host copy and go on
a queue. A background thread turns them into NumPy, buffers them and writes Parquet parts
(see `layout`), so the loop waits neither for the copy nor for the disk.

Crash bound: parts are flushed when ``flush_steps`` recorded steps are buffered or the
oldest buffered item is ``flush_seconds`` old. A process killed with SIGKILL loses only
what is not yet in a part: at most ``2 * flush_steps + 1`` recorded steps (the buffer,
the hand-off queue of ``flush_steps`` items, and the part being written), and nothing
older than ``flush_seconds`` plus the time to write one part. Every step in a part on
disk reads back whole.
"""

from __future__ import annotations

import atexit
import datetime as _dt
import logging
import os
import platform
import socket
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pandas as pd
import pyarrow as pa

from ..core import formats as _formats
from ..core import recipes as _recipes
from ..core.policy import as_policy
from ..core.scaled_array import ScaledArray, asarray
from ..probe.kernel import HIST_COLUMNS, HIST_HI, HIST_LO, StatSpec
from ..probe.optable import OpTable
from . import flight
from . import layout as L
from .background import Writer
from .processes import (
    agree_across_processes,
    is_global,
    start_copy,
)
from .tracked import Tracked, argument_positions
from .tracked import static_names as tracked_static_names

try:  # advisory lock so two writers never share a process slot; absent on Windows
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None

log = logging.getLogger("scalescope")

DEFAULT_FORMATS = ("e4m3", "e5m2", "fp16", "bf16")


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def _versions() -> dict[str, str]:
    import ml_dtypes

    from .._version import __version__

    out = {
        "scalescope": __version__,
        "jax": jax.__version__,
        "numpy": np.__version__,
        "ml_dtypes": ml_dtypes.__version__,
        "pyarrow": pa.__version__,
        "python": platform.python_version(),
    }
    try:
        import jaxlib

        out["jaxlib"] = jaxlib.__version__
    except (ImportError, AttributeError):
        pass
    return out


def _device_info() -> dict[str, Any]:
    devices = jax.devices()
    return {
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "process_count": jax.process_count(),
        "host": socket.gethostname(),
    }


def _format_info(names: Sequence[str]) -> dict[str, dict[str, Any]]:
    out = {}
    for name in names:
        f = _formats.get(name)
        out[f.name] = {
            "dtype": str(np.dtype(f.dtype)),
            "max": float(f.max),
            "min_normal": float(f.min_normal),
            "min_subnormal": float(f.min_subnormal),
            "mantissa_bits": int(f.mantissa_bits),
            "exponent_bits": int(f.exponent_bits),
        }
    return out


# ---------------------------------------------------------------------------------------
# Run


class Run:
    """A run directory being recorded (see docs/store.md).

    ``every``: tracked functions record every ``every``-th call (steps 0, every, 2·every…).
    ``budget``: instead, keep the time spent recording (and, on CPU, checking each step for
    the flight recorder) at or under this fraction of the training time (0.05: 5 %): each
    recorded step measures a rotating subset of the values, split into ``groups`` groups of
    about equal cost, and values with findings are measured more often (see `budget`);
    ``every`` is then the shortest gap between two recorded steps. Statistics stay exact; a
    value simply has no row at the steps that did not measure it. ``formats``,
    ``histograms``, ``select``, ``sample``, ``fallback``: passed to `instrument`.
    ``isolate`` means what it means for `instrument` (a recorded step's outputs are bit for
    bit those of the plain step) and `Run` gets it more cheaply: True (default) runs the
    plain program for the outputs, then the statistics as a program of their own; False
    records inside one program that also gives the outputs (cheaper; outputs may differ in
    the last bits). ``config``: any JSON-able dict kept in the metadata (model sizes,
    precision, seed). ``flush_steps`` / ``flush_seconds``: when the writer writes a part
    (see the module docstring for the crash bound). ``start_step``: the first step number of
    tracked functions; by default 0, or one past the last step already in the run when
    appending. ``process_index``: this writer's JAX process (default `jax.process_index()`);
    only process 0 writes the metadata and the op table.

    Several JAX processes (``jax.distributed``) record one run into one directory: every
    process creates its `Run` at the same point of the program (the constructor checks
    the processes' indices and agrees on the first step with one collective), each writes
    its own parts (``part-NNNNNN-pK.parquet``). Statistics of a step jitted over a global
    mesh are global, the same in every process: process 0 writes them, the others only
    their logged scalars. ``budget=`` needs one process. See docs/store.md.

    Opening an existing run appends to it when it records the same formats and, at the
    first recorded step, the same op table; otherwise it refuses with `RunMismatchError`.

    The flight recorder (``detect``, default on; see `flight`): every tracked step, recorded
    or not, also computes in its own program whether an output holds NaN/Inf, the loss
    and an update norm; the host reads those three numbers once the step has run (with
    ``"record"``, in a thread, the next call acting on them; ``"stop"`` and ``"skip"``
    read them before the call returns). A step that
    is non-finite, or whose loss or norm spikes (``triggers``: a `flight.Triggers`), is
    replayed fully instrumented from its own inputs and kept as an incident
    (`RunReader.incidents`): the first op whose output went non-finite, its source line,
    its inputs' statistics, the formats it exceeds. ``on_nonfinite`` says what the step
    then returns: ``"record"`` its outputs; ``"stop"`` raises `NonFiniteStep` naming the
    op; ``"skip"`` the outputs of the last healthy step (the update is skipped).
    ``healthy`` turns False at the first incident and ``on_incident(incident)`` is called
    with each one (e.g. so that checkpoint code refuses to save); reading ``healthy`` or
    ``incidents`` first acts on every step called so far. On a step spread over several
    devices the incident also names the devices (and processes) holding the NaN/Inf.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        every: int = 1,
        formats: Sequence[str] = DEFAULT_FORMATS,
        histograms: bool = True,
        select: Any = None,
        sample: int | None = None,
        isolate: bool = True,
        fallback: str = "raise",
        budget: float | None = None,
        groups: int = 16,
        config: Mapping[str, Any] | None = None,
        flush_steps: int = 10,
        flush_seconds: float = 2.0,
        start_step: int | None = None,
        process_index: int | None = None,
        on_nonfinite: str = "record",
        detect: bool = True,
        triggers: flight.Triggers | None = None,
        on_incident: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        _check_int("every", every, 1)
        if on_nonfinite not in flight.ON_NONFINITE:
            raise ValueError(
                f"Run: on_nonfinite must be one of {', '.join(flight.ON_NONFINITE)}, "
                f"got {on_nonfinite!r}"
            )
        if triggers is not None and not isinstance(triggers, flight.Triggers):
            raise TypeError(f"Run: triggers must be a Triggers, got {type(triggers).__name__}")
        if on_incident is not None and not callable(on_incident):
            raise TypeError(f"Run: on_incident must be callable, got {on_incident!r}")
        self.on_nonfinite, self.detect = on_nonfinite, bool(detect)
        self.triggers = triggers if triggers is not None else flight.Triggers()
        self.on_incident = on_incident
        self._incidents: list[dict[str, Any]] = []
        # the steps tracked into this run, judged as they run (let go at close: a Tracked
        # refers to its run)
        self._tracked: list[Tracked] = []
        # calls that traced another graph than the run's and ran unrecorded, and the
        # first of them (the views say so beside the verdict)
        self._unrecorded: dict[str, int] = {}
        self._unrecorded_by: dict[str, int] = {}  # function name -> its unrecorded calls
        self._ended_by = ""  # the exception that ended a `with Run(...)` block, if one did
        _check_int("flush_steps", flush_steps, 1)
        if not flush_seconds > 0:
            raise ValueError(f"Run: flush_seconds must be positive, got {flush_seconds!r}")
        if start_step is not None:
            _check_int("start_step", start_step, 0)
        if budget is not None and not (
            isinstance(budget, int | float) and not isinstance(budget, bool) and 0 < budget < 1
        ):
            raise ValueError(
                f"Run: budget must be a fraction of the training time in (0, 1) (0.05 for "
                f"5 %), got {budget!r}"
            )
        _check_int("groups", groups, 1)
        self.budget = None if budget is None else float(budget)
        self.groups = groups
        self.path = Path(path)
        self.every = every
        try:
            fmts, recs = _recipes.split(formats)
        except KeyError as err:
            raise KeyError(f"Run: formats: {err.args[0]}") from None
        except ValueError as err:  # said here, not at the first tracked step
            raise ValueError(f"Run: {err}") from None
        # Plain formats and block-scaled recipes are kept apart: views treat each list
        # with its own statistics.
        self.formats = tuple(f.name for f in fmts)
        self.recipes = tuple(r.name for r in recs)
        self.histograms = bool(histograms)
        self.select, self.sample, self.isolate, self.fallback = select, sample, isolate, fallback
        spec = StatSpec(fmts, self.histograms, recipes=recs)
        self.stat_names = spec.stat_names()
        self.hist_columns = tuple(HIST_COLUMNS) if self.histograms else ()
        self.process_count = jax.process_count()
        if process_index is None:
            process_index = jax.process_index()
        elif self.process_count == 1:  # several processes check their claims together
            _check_int("process_index", process_index, 0)
        self.process = int(process_index)
        if self.budget is not None and self.process_count > 1:
            raise ValueError(
                f"Run: budget= needs one JAX process ({self.process_count} here): each "
                "process would pick its own steps to record, and a step jitted over a "
                "global mesh runs only when every process runs the same program; use every="
            )
        self.config = dict(config or {})
        self._closed = False
        self._compiling: list[threading.Thread] = []  # `Tracked` background compiles
        self._lock_file = None
        self._lock_before = ""
        self._meta_pending = False  # an append's session, written once its graph matches
        self._graph: dict[str, Any] | None = None
        self._ops: pd.DataFrame | None = None
        if self.process_count > 1:
            # Before any process writes to the run: one collective checks the process
            # claims and agrees on the first step (process 0 reads the existing parts).
            last = self._last_step() if jax.process_index() == 0 else -1
            self.start_step = agree_across_processes(self.process, last, start_step)
            self._meta = self._open_dir()
        else:
            self._meta = self._open_dir()
            last = self._last_step()
            self.start_step = start_step if start_step is not None else last + 1
        # the number the run's next tracked call gets, shared by every function tracked
        # into it whose graph is the run's (so no two calls record under one step)
        self._next_step = self.start_step
        seq = self._next_seq()
        self._writer = Writer(self.path, self.process, seq, flush_steps, float(flush_seconds))
        self.flush_steps, self.flush_seconds = flush_steps, float(flush_seconds)
        _OPEN_RUNS.add(self)

    # -- directory ------------------------------------------------------------------

    def _open_dir(self) -> dict[str, Any]:
        """Create or open the run directory and take this process's lock; a folder that
        cannot be written is a `RunWriteError` naming it and the reason."""
        try:
            return self._open_dir_unchecked()
        except L.RunError:
            raise
        except OSError as err:
            reason = err.strerror or str(err)
            where = f" ({err.filename})" if err.filename else ""
            raise L.RunWriteError(
                f"Run: cannot record into {self.path}: {reason}{where}", self.path
            ) from err

    def _open_dir_unchecked(self) -> dict[str, Any]:
        path = self.path
        if path.exists() and not path.is_dir():
            raise L.NotARunError(f"Run: {path} is a file, not a directory")
        if (path / L.RUN_FILE).exists():
            meta = L.read_metadata(path)
            self._check_compatible(meta)
            if meta.get("graph"):
                self._graph = meta["graph"]
            appending = True
        else:
            if path.is_dir():
                # Another process of the run may be first, even write run.json meanwhile.
                allowed = {L.STATS_DIR, L.SCALARS_DIR, L.SCALE_GRAPH_DIR, L.RUN_FILE, L.OPS_FILE}
                foreign = sorted(
                    p.name for p in path.iterdir() if p.name[0] != "." and p.name not in allowed
                )
                if foreign:
                    listing = ", ".join(foreign[:5])
                    raise L.NotARunError(
                        f"Run: {path} exists and is not a scalescope run (it holds {listing}); "
                        "record into a new or empty directory"
                    )
            meta = self._new_metadata()
            appending = False
        (path / L.STATS_DIR).mkdir(parents=True, exist_ok=True)
        (path / L.SCALARS_DIR).mkdir(parents=True, exist_ok=True)
        self._lock()
        # a closed marker left by this process's previous session no longer holds
        (path / L.closed_marker_name(self.process)).unlink(missing_ok=True)
        if self.process == 0:
            meta["status"] = "recording"
            session = {"started": _now(), "pid": os.getpid(), "host": socket.gethostname()}
            if appending:  # the run keeps its first config; later sessions list their own
                session["config"] = self.config
            if self.process_count > 1:
                session["processes"] = self.process_count
            meta.setdefault("sessions", []).append(session)
            # appending: run.json changes only once the graph is known to be the run's
            # (`_register`); a refused append leaves the run as it was
            self._meta_pending = appending
            if not appending:
                L.write_json_atomic(path / L.RUN_FILE, meta)
        if appending and (path / L.OPS_FILE).is_file():
            self._ops = pd.read_parquet(path / L.OPS_FILE).set_index("op")
        return meta

    def _new_metadata(self) -> dict[str, Any]:
        return {
            "format": L.FORMAT_NAME,
            "version": L.FORMAT_VERSION,
            "name": self.path.resolve().name,
            "created": _now(),
            "versions": _versions(),
            "device": _device_info(),
            "config": self.config,
            "every": self.every,
            "formats": list(self.formats),
            "format_info": _format_info(self.formats),
            "recipes": list(self.recipes),
            "histograms": self.histograms,
            "hist_columns": list(self.hist_columns),
            "hist_exponents": [HIST_LO, HIST_HI],
            "stat_names": list(self.stat_names),
            "select": None if self.select is None else repr(self.select),
            "sample": self.sample,
            "statistics": "exact" if self.sample is None else "sampled",
            "budget": self.budget,
            "isolate": self.isolate,
            "graph": None,
        }

    def _check_compatible(self, meta: dict[str, Any]) -> None:
        mine = {
            "formats": list(self.formats),
            "recipes": list(self.recipes),
            "histograms": self.histograms,
            "stat_names": list(self.stat_names),
        }
        for key, value in mine.items():
            theirs = meta.get(key, [] if key == "recipes" else None)  # runs before recipes
            if theirs != value:
                raise L.RunMismatchError(
                    f"Run: {self.path} was recorded with {key}={theirs!r}, this Run "
                    f"asks for {value!r}; the statistics would not line up. Record into a "
                    "new directory, or open it with the same settings to append."
                )

    def _lock(self) -> None:
        if fcntl is None:  # pragma: no cover
            return
        lock_path = self.path / L.lock_name(self.process)
        f = open(lock_path, "a+")  # noqa: SIM115 - held open for the life of the Run
        for attempt in range(20):  # a reader takes it for an instant (`abandoned_writer`)
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if attempt < 19:
                    time.sleep(0.05)
        else:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            raise L.RunError(
                f"Run: {self.path} is being recorded by {holder} (as process "
                f"{self.process}); close that Run first"
            ) from None
        f.seek(0)
        self._lock_before = f.read()  # put back by a session that records nothing
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
        self._lock_file = f

    def _restore_lock(self) -> None:
        f = self._lock_file
        if f is not None and self._lock_before:
            f.seek(0)
            f.truncate()
            f.write(self._lock_before)
            f.flush()

    def _last_step(self) -> int:
        last = -1
        for directory in (L.STATS_DIR, L.SCALARS_DIR):
            for part in L.list_parts(self.path / directory):
                try:
                    import pyarrow.parquet as pq

                    steps = pq.read_table(part, columns=["step"]).column("step")
                    if len(steps):
                        last = max(last, int(pa.compute.max(steps).as_py()))
                except Exception:  # noqa: BLE001 - a corrupt part is the reader's warning
                    continue
        return last

    def _next_seq(self) -> int:
        seqs = [
            key[0]
            for directory in (L.STATS_DIR, L.SCALARS_DIR)
            for p in L.list_parts(self.path / directory)
            if (key := L.parse_part_name(p.name)) is not None and key[1] == self.process
        ]
        return max(seqs, default=-1) + 1

    # -- graph ----------------------------------------------------------------------

    def _register(self, table: OpTable, scalified: bool) -> None:
        """Check the op table against the run's (append) or store it (new run)."""
        records, fingerprint = _graph_of(table)
        frame = L.ops_frame(records)
        difference = self._graph_difference(table, records, fingerprint)
        if difference is not None:
            raise L.RunMismatchError(
                f"Run: {self.path} holds a run of a different graph ({difference}); "
                "record into a new directory. Appending needs the same function, shapes "
                "and dtypes."
            )
        self._write_meta_if_pending()
        if self._graph is None:
            self._graph = {
                "fingerprint": fingerprint,
                "n_ops": len(table),
                "n_rows": table.n_rows,
                "scalify": scalified,
            }
            if self.process == 0:
                L.write_parquet_atomic(self.path / L.OPS_FILE, L.ops_table(frame))
                self._meta["graph"] = self._graph
                L.write_json_atomic(self.path / L.RUN_FILE, self._meta)
            self._ops = frame
        row_op = np.asarray(table.row_op)
        self._writer.put(
            (
                "layout",
                {
                    "row_op": row_op,
                    "row_iter": np.asarray(table.row_iter),
                    "stat_names": tuple(table.stat_names),
                    "hist": self.histograms,
                    "row_group": table.row_group,
                    "row_cast": [table.ops[o].cast_to for o in row_op],
                    "row_scaled": np.array([table.ops[o].scaled for o in row_op], bool),
                    "prev_log2": np.full(len(row_op), np.nan),
                },
            )
        )

    def _write_meta_if_pending(self) -> None:
        """Write the appending session's metadata (its session entry, status recording)
        now that its graph is the run's."""
        if self._meta_pending:
            L.write_json_atomic(self.path / L.RUN_FILE, self._meta)
            self._meta_pending = False

    def _graph_difference(
        self, table: OpTable, records: list | None = None, fingerprint: str | None = None
    ) -> str | None:
        """None when ``table`` is the run's graph (or the run has none yet), else where
        the two first differ (``records``/``fingerprint``: `_graph_of` the table, when
        already computed)."""
        if records is None or fingerprint is None:
            records, fingerprint = _graph_of(table)
        if self._graph is None or self._graph["fingerprint"] == fingerprint:
            return None
        old = self._ops if self._ops is not None else pd.DataFrame()
        return L.first_difference(old, L.ops_frame(records)) if len(old) else "op tables differ"

    # -- public ---------------------------------------------------------------------

    def track(
        self,
        fn: Callable[..., Any],
        *,
        scalify: bool = True,
        every: int | None = None,
        policy: Any = None,
        donate_argnums: int | Sequence[int] = (),
        static_argnums: int | Sequence[int] = (),
        static_argnames: str | Sequence[str] = (),
    ) -> Tracked:
        """A jitted version of ``fn`` (same signature, same outputs) that records the
        statistics of every op every ``every`` calls (default: the Run's ``every``).

        ``scalify=False`` records ``fn`` as it is (an FP32 or naive low-precision
        baseline). ``policy``: a precision policy (`scalescope.Policy`, its dict or JSON)
        applied to every step as `scalescope.emulate` applies it; recorded values are
        those of the emulated step, and the run's metadata keeps the policy. The plain
        and the recording variants are compiled separately, the recording one at the
        first recorded call; under a budget, in the background from the first call (steps
        run plain until it is ready; ``warmup`` compiles both at once). Calls are numbered
        from the run's ``start_step``; a function tracked after another one continues
        after the calls made so far, so no step is recorded twice.

        ``donate_argnums``: the positions of arguments whose arrays the step may overwrite
        with its outputs, as in ``jax.jit`` (the training state, so that it is not held
        twice); the caller's arrays are deleted by each call. Nothing is kept to replay
        a bad step from then: its incident names the step and trigger, not the op, and
        ``on_nonfinite="skip"`` cannot hand back the state before it.

        ``static_argnums``: the positions of arguments passed whole as static values, as
        in ``jax.jit``: a Python number or a config the step branches on (``if
        config.decode:``), which is otherwise traced as ``jax.jit`` traces numbers. Each
        must be hashable; a new value traces the step again (recorded if its graph is the
        run's). Non-array arguments are static without it. ``static_argnames``: the same
        by parameter name (a keyword-only config).
        """
        self._check_open()
        if not callable(fn):
            raise TypeError(f"Run.track: fn must be callable, got {type(fn).__name__}")
        donate = argument_positions(fn, donate_argnums, "donate_argnums")
        named, static_names = tracked_static_names(fn, static_argnames)
        static = tuple(sorted({*argument_positions(fn, static_argnums, "static_argnums"), *named}))
        if set(donate) & set(static):
            raise ValueError(
                f"Run.track: argument(s) {sorted(set(donate) & set(static))} are in both "
                "donate_argnums and static_argnums: a static value holds no array to donate"
            )
        if donate and self.on_nonfinite == "skip":
            raise ValueError(
                f"Run.track: donate_argnums={donate} with Run(on_nonfinite='skip'): "
                "skipping a bad step hands back the state before it, which donation "
                "frees; use on_nonfinite='record' or 'stop', or no donate_argnums"
            )
        if every is not None:
            _check_int("every", every, 1)
        if policy is not None:
            policy = as_policy(policy)
            self._meta["policy"] = [[r.pattern, r.spec] for r in policy.rules]
            if self.process == 0 and not self._meta_pending:
                L.write_json_atomic(self.path / L.RUN_FILE, self._meta)
        tracked = Tracked(
            self,
            fn,
            scalify=scalify,
            every=every or self.every,
            policy=policy,
            donate=donate,
            static=static,
            static_names=static_names,
        )
        self._tracked.append(tracked)
        return tracked

    def log(self, step: int, **scalars: Any) -> None:
        """Record scalars (loss, learning rate, grad norm...) at ``step``. Device arrays are
        copied asynchronously; nothing here waits for the device (but for a ``step`` given
        as a device array, which is read)."""
        self._check_open()
        step = _step_number(step)
        _check_int("step", step, 0)
        values = {}
        for name, value in scalars.items():
            if isinstance(value, ScaledArray):
                value = asarray(value)
            if np.ndim(value) != 0:
                raise ValueError(
                    f"Run.log: {name!r} at step {step} must be a scalar, got shape "
                    f"{np.shape(value)}"
                )
            if not isinstance(value, jax.Array | np.ndarray | np.generic | int | float):
                raise TypeError(
                    f"Run.log: {name!r} at step {step} must be a number, got {type(value).__name__}"
                )
            if L.is_figure(name):
                raise ValueError(
                    f"Run.log: {name!r} at step {step}: names starting with "
                    f"{L.FIGURE_PREFIX!r} or {L.HEALTH_PREFIX!r} are the run's own figures; "
                    "choose another name"
                )
            values[name] = value
        if values:
            start_copy(values)
            self._writer.put(("scalars", int(step), values))

    def scale_graph(self, step: int, loss_fn: Callable[..., Any], *args: Any) -> pd.DataFrame:
        """Record the scale graph at ``step``: each op of ``loss_fn(*args)`` (a scalar
        loss) with the log2 RMS of its value and of its gradient (`scalescope.scale_graph`),
        written at once as ``scale_graph/step-N.parquet`` (by process 0 when several
        processes record the run; each must call it, as for any collective). It runs one
        forward and backward pass of ``loss_fn`` of its own (compiled on each call): call
        it at the steps you want to compare, not at every step. Returns the frame."""
        self._check_open()
        _check_int("step", step, 0)
        from ..probe.scale_graph import scale_graph

        frame = scale_graph(loss_fn, *args)
        if self.process != 0:
            return frame  # every process computes the same global graph; process 0 writes it
        table = frame.reset_index()
        table["shape"] = [list(s) for s in table["shape"]]
        table.insert(0, "step", int(step))
        path = self.path / L.SCALE_GRAPH_DIR / L.scale_graph_name(int(step))
        L.write_parquet_atomic(path, pa.Table.from_pandas(table, preserve_index=False))
        return frame

    def _submit(self, step: int, stats: dict[str, jax.Array], mask: Any = None) -> None:
        if self.process != 0 and is_global(stats):
            return  # the same global statistics in every process: process 0 writes them
        start_copy(stats)
        self._writer.put(("stats", step, stats, mask))

    def _submit_figures(self, step: int, names: list[str], figures: jax.Array) -> None:
        """Scalars the run computes itself (`updates`), one per name, from one device
        array: copied asynchronously and written with the logged scalars."""
        if self.process != 0 and is_global(figures):
            return
        start_copy(figures)
        self._writer.put(("figures", int(step), names, figures))

    @property
    def healthy(self) -> bool:
        """False once a step of this session was an incident (see the class docstring):
        what checkpoint code can check before saving. Reading it judges the last step
        (which waits for it)."""
        return not self.incidents

    @property
    def incidents(self) -> list[dict[str, Any]]:
        """The incidents of this session so far, the last step judged first."""
        self._settle()
        return self._incidents

    def _settle(self) -> None:
        """Take in every tracked step's judgements so far (see `Tracked.settle`)."""
        if not self._closed:
            for tracked in self._tracked:
                tracked.settle()

    def _incident(self, incident: dict[str, Any]) -> None:
        """Keep an incident: in memory, in the run's incidents file (rewritten whole,
        atomically: a few incidents per run), then tell ``on_incident``."""
        incident = {**incident, "process": self.process, "time": flight.now()}
        self._incidents.append(incident)
        path = self.path / L.incidents_name(self.process)
        kept = L.read_incidents_file(path) if path.is_file() else []
        L.write_json_atomic(path, [*kept, incident])
        if self.process == 0 and self._meta_pending:
            self._write_meta_if_pending()
        where = incident.get("name")
        if where and incident.get("source"):
            where = f"{where} at {incident['source']}"
        log.warning(
            "scalescope: incident at step %s (%s): %s",
            incident["step"],
            incident["trigger"],
            "; ".join(t for t in (where, incident.get("detail")) if t) or "no op named",
        )
        if self.on_incident is not None:
            self.on_incident(incident)

    def flush(self) -> None:
        """Block until everything recorded so far is written to parts on disk (the last
        step judged first)."""
        self._check_open()
        self._settle()
        self._writer.sync("flush")

    @property
    def parts_written(self) -> int:
        return self._writer.parts

    def close(self) -> None:
        """Write what is buffered, mark the run closed and release the directory."""
        if self._closed:
            return
        unsettled = None
        try:
            self._settle()  # the last step's incident, if it is one, is kept
        except Exception as err:  # raised once the run is closed: nothing is left open
            unsettled = err
        for tracked in self._tracked:
            tracked.stop_watching()
        self._tracked.clear()
        self._closed = True
        _OPEN_RUNS.discard(self)
        for thread in self._compiling:  # no compile may outlive the run (nor the process)
            if thread.is_alive():
                log.warning(
                    "scalescope: %s closed while its statistics program was still compiling "
                    "(under a budget it compiles in the background): the steps so far ran "
                    "unrecorded. Call tracked.warmup(...) before training to compile it first.",
                    self.path,
                )
                thread.join()
        try:
            self._writer.sync("close")
        finally:
            damage = self._writer.damage()
            if self.process == 0 and self._meta_pending and damage is None:
                # an append that recorded nothing: run.json stays as it was, and the lock
                # names who last recorded (a killed writer stays the one blamed)
                self._restore_lock()
            elif self.process == 0:
                if damage is not None:
                    self._meta.setdefault("damage", []).append(damage)
                if self._unrecorded:
                    before = self._meta.get("unrecorded_calls") or {}
                    functions = dict(before.get("functions") or {})
                    for name, n in self._unrecorded_by.items():
                        functions[name] = int(functions.get(name, 0)) + n
                    self._meta["unrecorded_calls"] = {
                        "count": before.get("count", 0) + self._unrecorded["count"],
                        "first_step": before.get("first_step", self._unrecorded["first_step"]),
                        **({"functions": functions} if functions else {}),
                    }
                if self._ended_by and self._meta.get("sessions"):
                    self._meta["sessions"][-1]["ended_by"] = self._ended_by
                parts = dict(self._meta.get("parts") or {})
                for directory, n in self._writer.written.items():
                    parts[directory] = int(parts.get(directory, 0)) + n
                self._meta["parts"] = parts  # process 0's, over every session
                # data lost once is lost for good: the run stays damaged
                self._meta["status"] = "damaged" if self._meta.get("damage") else "closed"
                self._meta["closed"] = _now()
                L.write_json_atomic(self.path / L.RUN_FILE, self._meta)
            else:  # readers wait for every process's marker before calling the run closed
                marker = {"process": self.process, "closed": _now()}
                if damage is not None:
                    marker["damage"] = damage
                L.write_json_atomic(self.path / L.closed_marker_name(self.process), marker)
            if self._lock_file is not None:
                self._lock_file.close()
                self._lock_file = None
        if unsettled is not None:
            raise unsettled

    def _note_unrecorded(self, step: int, function: str) -> None:
        """A call of the tracked ``function`` at ``step`` traced another graph than the
        run's and ran unrecorded."""
        self._unrecorded.setdefault("first_step", step)
        self._unrecorded["count"] = self._unrecorded.get("count", 0) + 1
        self._unrecorded_by[function] = self._unrecorded_by.get(function, 0) + 1

    def _check_open(self) -> None:
        if self._closed:
            raise L.RunError(f"Run {self.path} is closed")
        self._writer.raise_error()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:  # kept in the session's entry: the training stopped here
            self._ended_by = f"{exc_type.__name__}: {exc}"[:300]
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "recording"
        return f"Run({str(self.path)!r}, every={self.every}, {state})"


def _graph_of(table: OpTable) -> tuple[list, str]:
    """An op table's records and the fingerprint that identifies its graph in a run."""
    records = table.to_records()
    return records, L.graph_fingerprint(records, table.stat_names, table.hist_columns)


def _step_number(step: Any) -> Any:
    """``step`` as a Python int when it is a 0-d integer array (a Flax ``TrainState.step``:
    reading a device array waits for it); anything else as it is, for `_check_int`."""
    if (
        isinstance(step, jax.Array | np.ndarray)
        and step.ndim == 0
        and np.issubdtype(step.dtype, np.integer)
    ):
        return int(step)
    return step


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise ValueError(f"Run: {name} must be an integer >= {low}, got {value!r}")


_OPEN_RUNS: weakref.WeakSet[Run] = weakref.WeakSet()


@atexit.register
def _close_open_runs() -> None:
    """Flush runs the program forgot to close, so a normal exit loses nothing."""
    for run in list(_OPEN_RUNS):
        try:
            run.close()
        except Exception as err:  # noqa: BLE001
            log.error("scalescope: closing %s at exit failed: %s", run.path, err)
