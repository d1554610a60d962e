"""The background writer of a `Run`: one thread per process owns the buffers of
recorded statistics and logged scalars and writes them as part files (atomically; a
failed write is noted as what it lost, see `damage`)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from . import budget as _budget
from . import layout as L
from .processes import to_host

log = logging.getLogger("scalescope")

#: Logged scalars buffered before they are written as a part.
_SCALAR_FLUSH_ROWS = 4096


class Writer:
    """Owns the buffers and the part files of one process; runs in its own thread."""

    def __init__(self, path: Path, process: int, seq: int, flush_steps: int, flush_s: float):
        self.path, self.process, self.seq = path, process, seq
        self.flush_steps, self.flush_s = flush_steps, flush_s
        self.queue: queue.Queue = queue.Queue(maxsize=flush_steps)
        self.error: BaseException | None = None
        self.layout: dict[str, Any] | None = None
        # (step, statistics, rows measured or None for all)
        self.stats_buf: list[tuple[int, dict[str, np.ndarray], np.ndarray | None]] = []
        self.on_findings: Callable[[set[int]], None] | None = None  # budget feedback
        self.on_cost: Callable[[float], None] | None = None  # seconds spent per item
        self.hot: set[int] = set()
        self.scalar_buf: list[tuple[int, str, float]] = []
        self.oldest: float | None = None
        self.parts = 0
        #: parts written per directory (stats/, scalars/): `Run.close` keeps the count in
        #: run.json, so a reader notices parts deleted later
        self.written = {L.STATS_DIR: 0, L.SCALARS_DIR: 0}
        self.last_flushed_step = -1
        # what a failed write lost: steps whose statistics, (step, name) whose scalars
        self.lost_steps: set[int] = set()
        self.lost_scalars: set[tuple[int, str]] = set()
        self.lost_figures: set[int] = set()  # steps whose own figures were lost
        self.thread = threading.Thread(target=self._loop, name="scalescope-writer", daemon=True)
        self.thread.start()

    # -- called from the training thread --------------------------------------------

    def put(self, item: tuple) -> None:
        while True:
            self.raise_error()
            try:
                self.queue.put(item, timeout=0.5)
                return
            except queue.Full:
                if not self.thread.is_alive():
                    self.raise_error()
                    raise L.RunError("the scalescope writer thread stopped") from None

    def sync(self, kind: str) -> None:
        """Wait until the thread has handled everything queued so far (``flush``: and
        written it; ``close``: and stopped). A close waits also after a failed write, so
        that what the failure lost is known when the run is marked damaged."""
        done = threading.Event()
        if kind == "close" and self.error is not None:
            while self.thread.is_alive():  # it drains the queue after a failure
                try:
                    self.queue.put((kind, done), timeout=0.5)
                    break
                except queue.Full:
                    continue
        else:
            self.put((kind, done))
        while not done.wait(0.5):
            if not self.thread.is_alive():
                break
        self.raise_error()

    def raise_error(self) -> None:
        """Raise the writer thread's failure in the caller's thread: a `RunWriteError`
        (also an `OSError`) when a file could not be written, else a `RunError`."""
        err = self.error
        if err is None:
            return
        message = f"writing the run at {self.path} failed: {err}"
        if isinstance(err, OSError):
            raise L.RunWriteError(message, getattr(err, "path", None) or self.path) from err
        raise L.RunError(message) from err

    # -- the thread -----------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            timeout = None
            if self.oldest is not None:
                timeout = max(0.0, self.oldest + self.flush_s - time.monotonic())
            try:
                item = self.queue.get(timeout=timeout)
            except queue.Empty:
                self._guarded(self._flush)
                continue
            kind = item[0]
            if kind in ("flush", "close"):
                self._guarded(self._flush)
                item[1].set()
                if kind == "close":
                    return
                continue
            t0 = time.perf_counter()
            self._guarded(self._take, item)
            if self.on_cost is not None and kind == "stats":
                self.on_cost(time.perf_counter() - t0)

    def _guarded(self, fn: Callable[..., None], *args: Any) -> None:
        if self.error is not None:
            self._lose(*args)  # drain the queue so the training loop never blocks
            return
        try:
            fn(*args)
        except BaseException as err:  # noqa: BLE001 - reported to the training thread
            self._lose(*args)
            self._lose_buffers()
            self.error = err  # after the losses are noted: whoever sees it sees them
            log.error("scalescope: writing %s failed: %s", self.path, err)

    def _lose(self, item: tuple | None = None) -> None:
        """Note the data of ``item`` (a queued record) as lost."""
        if item is None:
            return
        if item[0] == "stats":
            self.lost_steps.add(int(item[1]))
        elif item[0] == "scalars":
            self.lost_scalars.update((int(item[1]), str(name)) for name in item[2])
        elif item[0] == "figures":
            self.lost_figures.add(int(item[1]))

    def _lose_buffers(self) -> None:
        """Note what the buffers held as lost and empty them (a failed flush)."""
        self.lost_steps.update(int(step) for step, _, _ in self.stats_buf)
        for step, name, _ in self.scalar_buf:
            if L.is_figure(name):
                self.lost_figures.add(int(step))
            else:
                self.lost_scalars.add((int(step), str(name)))
        self.stats_buf, self.scalar_buf, self.oldest = [], [], None

    def damage(self) -> str | None:
        """What a failed write lost, in words (None: nothing failed)."""
        if self.error is None:
            return None
        lost = []
        if self.lost_steps:
            lost.append(f"the statistics of {_steps_text(self.lost_steps)}")
        if self.lost_scalars:
            steps = {step for step, _ in self.lost_scalars}
            lost.append(f"{len(self.lost_scalars)} logged scalars of {_steps_text(steps)}")
        if self.lost_figures:
            lost.append(
                "the run's own figures (step health, held updates) of "
                f"{_steps_text(self.lost_figures)}"
            )
        what = " and ".join(lost) if lost else "nothing recorded so far"
        who = f"process {self.process}: " if self.process else ""
        if isinstance(self.error, L.RunWriteError):
            failed = str(self.error)  # names the file and the reason
        else:
            failed = f"writing failed ({type(self.error).__name__}: {self.error})"
        return f"{who}{failed}; lost {what}"

    def _take(self, item: tuple) -> None:
        kind = item[0]
        if kind == "layout":
            self.layout = item[1]
            return
        if self.oldest is None:
            self.oldest = time.monotonic()
        if kind == "stats":
            _, step, stats, mask = item
            host = {k: to_host(v) for k, v in stats.items()}
            rows = None
            if mask is not None:
                if self.layout is None:
                    raise L.RunError("statistics arrived before the op table")
                rows = np.asarray(mask, bool)[self.layout["row_group"]]
                self._feedback(host, rows, np.asarray(mask, bool))
            self.stats_buf.append((step, host, rows))
            if len(self.stats_buf) >= self.flush_steps:
                self._flush()
        elif kind == "scalars":
            _, step, values = item
            for name, value in values.items():
                self.scalar_buf.append((step, name, float(to_host(value))))
            if len(self.scalar_buf) >= _SCALAR_FLUSH_ROWS:
                self._flush()
        elif kind == "figures":
            _, step, names, figures = item
            values = np.asarray(to_host(figures), np.float64).reshape(-1)
            self.scalar_buf.extend(  # a name None: a value not kept (a step without a loss)
                (step, n, float(v)) for n, v in zip(names, values, strict=True) if n is not None
            )
            if len(self.scalar_buf) >= _SCALAR_FLUSH_ROWS:
                self._flush()

    def _feedback(self, host: dict[str, np.ndarray], rows: np.ndarray, mask: np.ndarray) -> None:
        """Tell the budget which groups showed findings (they get measured more often)."""
        if self.on_findings is None:
            return
        lay = self.layout
        found = _budget.hot_groups(
            host, lay["row_group"], rows, lay["row_cast"], lay["row_scaled"], lay["prev_log2"]
        )
        self.hot = (self.hot - set(np.flatnonzero(mask).tolist())) | found
        self.on_findings(set(self.hot))

    def _flush(self) -> None:
        if self.stats_buf:
            table = self._stats_table()
            L.write_parquet_atomic(self._part_path(L.STATS_DIR), table)
            self.written[L.STATS_DIR] += 1
            self.last_flushed_step = max(self.last_flushed_step, self.stats_buf[-1][0])
        if self.scalar_buf:
            steps, names, values = zip(*self.scalar_buf, strict=True)
            table = pa.table(
                {
                    "step": pa.array(steps, pa.int64()),
                    "name": pa.array(names, pa.string()),
                    "value": pa.array(values, pa.float64()),
                    "process": pa.array([self.process] * len(steps), pa.int32()),
                }
            )
            L.write_parquet_atomic(self._part_path(L.SCALARS_DIR), table)
            self.written[L.SCALARS_DIR] += 1
        if self.stats_buf or self.scalar_buf:
            self.seq += 1
            self.parts += 1
        self.stats_buf, self.scalar_buf, self.oldest = [], [], None

    def _part_path(self, directory: str) -> Path:
        return self.path / directory / L.part_name(self.seq, self.process)

    def _stats_table(self) -> pa.Table:
        if self.layout is None:
            raise L.RunError("statistics arrived before the op table")
        lay = self.layout
        row_op, row_iter = lay["row_op"].astype(np.int32), lay["row_iter"].astype(np.int32)
        n = len(row_op)
        # Rows a budgeted step did not measure are left out: no row, no value (a blank).
        keep = [np.ones(n, bool) if rows is None else rows for _, _, rows in self.stats_buf]
        counts = [int(k.sum()) for k in keep]
        total = sum(counts)
        cols: dict[str, Any] = {
            "step": np.repeat(np.array([s for s, _, _ in self.stats_buf], np.int64), counts),
            "op": np.concatenate([row_op[k] for k in keep]),
            "iteration": np.concatenate([row_iter[k] for k in keep]),
            "process": np.full(total, self.process, np.int32),
        }
        for name in lay["stat_names"]:
            cols[name] = np.concatenate(
                [b[name].reshape(-1)[k] for (_, b, _), k in zip(self.stats_buf, keep, strict=True)]
            )
        if lay["hist"]:
            h = np.concatenate(
                [b["hist"][k] for (_, b, _), k in zip(self.stats_buf, keep, strict=True)]
            ).astype(np.int32)
            for i, col in enumerate(L.hist_column_names(h.shape[1])):
                cols[col] = h[:, i]
        return pa.table(cols)


def _steps_text(steps: set[int]) -> str:
    """``step 7`` or ``5 steps (3..12)``."""
    if len(steps) == 1:
        return f"step {next(iter(steps))}"
    return f"{len(steps)} steps ({min(steps)}..{max(steps)})"
