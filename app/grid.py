"""Dense op x recorded-step grids of a run's statistics, kept up to date part by part.

The heatmap of a run of 20 000 ops x 1000 recorded steps reads 20 M statistics rows.
Building its matrix from the wide statistics frame (`scalescope.analysis.matrix`) each
time a step arrives costs seconds; `StatGrid` instead keeps, per metric asked for, one
float32 array of ops x recorded steps (process 0; the rows of a loop's iterations
reduced with ``max``, as `scalescope.analysis.matrix` does by default) and a bool array
of where each op has a row, and scatters only the rows of new parts into them. Steps
after the last one are appended as columns; anything else (a part of an earlier step,
an op never seen) rebuilds the grids from the parts in memory.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from scalescope import analysis
from scalescope.store import RunReader


class StatGrid:
    """Per-metric op x step grids of one run (see the module docstring)."""

    def __init__(self, reader: RunReader) -> None:
        self.reader = reader
        self._reset()

    def _reset(self) -> None:
        self.n_parts = 0  # parts of the reader consumed
        self.ops = np.zeros(0, np.int64)  # row -> op id, ascending
        self.steps = np.zeros(0, np.int64)  # column -> step, ascending
        self._present = np.zeros((0, 0), bool)  # capacity columns; the first n used
        self._grids: dict[str, np.ndarray] = {}
        self._parts: list[_Part] = []  # process 0's rows of each part consumed

    # -- reading -----------------------------------------------------------------------

    def sync(self) -> bool:
        """Take in the parts the reader read since the last call; True when any."""
        frames = self.reader.part_frames(self.n_parts)
        if not frames:
            return False
        parts = [_Part(f) for f in frames]
        op_ids = _distinct([p.op_ids for p in parts])
        steps = _distinct([p.steps for p in parts])
        fits = not len(np.setdiff1d(op_ids, self.ops, assume_unique=True)) and (
            not len(steps) or not len(self.steps) or steps[0] >= self.steps[-1]
        )
        if not fits and self.n_parts:  # rows of an earlier step, or a new op: rebuild
            metrics = list(self._grids)
            self._reset()
            self.sync()
            for metric in metrics:
                self.grid(metric)
            return True
        if not len(self.ops):
            self.ops = np.union1d(self._table_ops(), op_ids)
        self._add_steps(np.setdiff1d(steps, self.steps, assume_unique=True))
        for part in parts:
            part.locate(self.ops, self.steps)
            for metric, grid in self._grids.items():
                part.scatter(grid, self._present, metric)
            part.mark(self._present)
        self._parts += parts
        self.n_parts += len(frames)
        return True

    def _table_ops(self) -> np.ndarray:
        """Ops that have statistics of their own in the op table (aliases have none)."""
        table = self.reader.ops
        if not len(table) or "stats_op" not in table.columns:
            return np.zeros(0, np.int64)
        ids = table.index.to_numpy(np.int64)
        return ids[table["stats_op"].to_numpy(np.int64) == ids]

    def _add_steps(self, new: np.ndarray) -> None:
        n_old, n = len(self.steps), len(self.steps) + len(new)
        self.steps = np.concatenate([self.steps, new]).astype(np.int64)
        if n > self._present.shape[1] or self._present.shape[0] != len(self.ops):
            cap = max(n, int(n_old * 1.5) + 64)
            self._present = _grow(self._present, len(self.ops), cap, False)
            for metric, grid in self._grids.items():
                self._grids[metric] = _grow(grid, len(self.ops), cap, np.nan)

    # -- queries -----------------------------------------------------------------------

    @property
    def distinct(self) -> bool:
        """Every row read so far is the only one of its op and step (no loop iterations):
        the grids hold the rows' values as they are, no reduction."""
        return all(p.distinct for p in self._parts)

    @property
    def present(self) -> np.ndarray:
        """ops x steps: True where the op has a row at that step."""
        return self._present[:, : len(self.steps)]

    def grid(self, metric: str) -> np.ndarray:
        """ops x steps float32 values of ``metric`` (NaN where no row), built once."""
        self.sync()
        if metric not in self._grids:
            grid = np.full(self._present.shape, np.nan, np.float32)
            seen = np.zeros(grid.shape, bool)
            for part in self._parts:
                part.scatter(grid, seen, metric)
                part.mark(seen)
            self._grids[metric] = grid
        return self._grids[metric][:, : len(self.steps)]

    def recorded_ops(self) -> np.ndarray:
        """Op ids with at least one row."""
        self.sync()
        return self.ops[self.present.any(axis=1)]

    def rows_of(self, ops: np.ndarray) -> np.ndarray:
        """Row indices of op ids (each must be a row)."""
        return np.searchsorted(self.ops, np.asarray(ops, np.int64))

    def matrix(self, metric: str, ops: np.ndarray, max_steps: int = 500) -> pd.DataFrame:
        """`scalescope.analysis.matrix` of ``metric`` over ``ops`` (iterations ``max``),
        float32, from the grid: steps merged into windows in the metric's direction."""
        grid = self.grid(metric)
        rows = self.rows_of(ops)
        sub, here = _take(grid, rows), _take(self.present, rows)
        direction = analysis.metric_direction(metric)
        out = analysis.window_grid(sub, here, direction, max_steps)
        return pd.DataFrame(
            out.astype(np.float32, copy=False),
            index=pd.Index(self.ops[rows], name="op"),
            columns=pd.Index(self._windows(max_steps), name="step"),
        )

    def measured(self, ops: np.ndarray, max_steps: int = 500) -> pd.DataFrame:
        """`scalescope.analysis.measured_matrix` over ``ops``: True where the op has a
        row in the window."""
        self.sync()
        rows = self.rows_of(ops)
        here = _take(self.present, rows)
        n_steps = here.shape[1]
        width = max(1, -(-n_steps // max_steps))
        if width > 1:
            n_win = -(-n_steps // width)
            padded = np.zeros((len(rows), n_win * width), bool)
            padded[:, :n_steps] = here
            here = padded.reshape(len(rows), n_win, width).any(axis=2)
        return pd.DataFrame(
            here,
            index=pd.Index(self.ops[rows], name="op"),
            columns=pd.Index(self._windows(max_steps), name="step"),
        )

    def _windows(self, max_steps: int) -> np.ndarray:
        if not len(self.steps):
            return np.zeros(0, np.int64)
        return np.unique(analysis.step_windows(self.steps, max_steps).to_numpy()).astype(np.int64)


class _Part:
    """Process 0's rows of one part and where they go in the grids. A part as the
    writer writes it -- every op once per step, steps ascending -- is a dense block of
    columns (copied as one block); any other part is scattered cell by cell."""

    def __init__(self, frame: pd.DataFrame) -> None:
        process = frame["process"].to_numpy()
        self.frame = frame if (process == 0).all() else frame[process == 0]
        self.op = self.frame["op"].to_numpy(np.int64)
        self.step = self.frame["step"].to_numpy(np.int64)
        self.steps = _sorted_unique(self.step)
        self.op_ids = _sorted_unique(np.sort(self.op)) if len(self.op) else self.op
        self.distinct = bool((self.frame["iteration"].to_numpy() == 0).all())
        self.block: tuple[int, int] | None = None  # (first column, steps) of a dense part
        self.cells: tuple[np.ndarray, np.ndarray] | None = None

    def locate(self, ops: np.ndarray, steps: np.ndarray) -> None:
        """Find the part's columns (and rows) in the grid axes ``ops`` x ``steps``."""
        k, n = len(self.steps), len(ops)
        if not len(self.op):
            self.cells = (np.zeros(0, np.int64), np.zeros(0, np.int64))
            return
        first = int(np.searchsorted(steps, self.steps[0]))
        contiguous = first + k <= len(steps) and (steps[first : first + k] == self.steps).all()
        if self.distinct and contiguous and len(self.op) == k * n:
            if (self.op.reshape(k, n) == ops).all() and (
                self.step.reshape(k, n) == self.steps[:, None]
            ).all():
                self.block = (first, k)
                self.op = self.step = None  # not needed for a block: free the copies
                return
        self.cells = (np.searchsorted(ops, self.op), np.searchsorted(steps, self.step))

    def values(self, metric: str) -> np.ndarray:
        if metric in self.frame.columns:
            return self.frame[metric].to_numpy(np.float32)
        return analysis.metric_values(self.frame, metric).to_numpy(np.float32)

    def scatter(self, grid: np.ndarray, seen: np.ndarray, metric: str) -> None:
        """Write the part's values of ``metric`` into ``grid`` (``seen``: cells that
        already hold a row)."""
        values = self.values(metric)
        if self.block is not None:
            first, k = self.block
            cols = slice(first, first + k)
            if not seen[:, cols].any():
                grid[:, cols] = values.reshape(k, -1).T
                return
            r = np.tile(np.arange(grid.shape[0]), k)
            c = np.repeat(np.arange(first, first + k), grid.shape[0])
        else:
            r, c = self.cells
        _scatter_max(grid, seen, r, c, values, self.distinct)

    def mark(self, seen: np.ndarray) -> None:
        if self.block is not None:
            first, k = self.block
            seen[:, first : first + k] = True
        else:
            seen[self.cells] = True


def _sorted_unique(values: np.ndarray) -> np.ndarray:
    """Distinct values of a non-decreasing array (any array: `np.unique`)."""
    if len(values) and (values[1:] < values[:-1]).any():
        return np.unique(values)
    keep = np.ones(len(values), bool)
    keep[1:] = values[1:] != values[:-1]
    return values[keep]


def _distinct(arrays: list[np.ndarray]) -> np.ndarray:
    return np.unique(np.concatenate(arrays)) if arrays else np.zeros(0, np.int64)


def _take(grid: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``grid[rows]``, without a copy when ``rows`` is every row in order."""
    if len(rows) == grid.shape[0] and (not len(rows) or (rows == np.arange(len(rows))).all()):
        return grid
    return grid[rows]


def _grow(array: np.ndarray, n_rows: int, n_cols: int, fill) -> np.ndarray:
    out = np.full((n_rows, n_cols), fill, array.dtype)
    rows, cols = min(array.shape[0], n_rows), min(array.shape[1], n_cols)
    out[:rows, :cols] = array[:rows, :cols]
    return out


def _scatter_max(
    grid: np.ndarray,
    seen: np.ndarray,
    r: np.ndarray,
    c: np.ndarray,
    values: np.ndarray,
    distinct: bool,
) -> None:
    """Write ``values`` at cells ``(r, c)`` of ``grid``: where a cell already holds a row
    (``seen``) or gets several (not ``distinct``: loop iterations), their max, a NaN
    winning as in `scalescope.analysis.reduce_groups`."""
    values = np.asarray(values, np.float32)
    if distinct and not seen[r, c].any():
        grid[r, c] = values
        return
    cell = r.astype(np.int64) * grid.shape[1] + c
    flat = grid.reshape(-1)
    fresh = cell[~seen[r, c]]
    flat[fresh] = -np.inf
    nan = np.isnan(values)
    np.maximum.at(flat, cell[~nan], values[~nan])
    flat[cell[nan]] = np.nan
