"""The values the advisor's rules read: a run's statistics reduced to one row per (op,
step) over loop iterations, op-major (`_Cells`) or, for a run measured in full in the
writer's order, steps x ops as stored (`_Dense`); how they are built from the wide
frame (`_cells_of`, `_per_step`, `_dense_blocks`), and where a rule holds, per op
(`_hits`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np
import pandas as pd


class _Cells:
    """The values the rules read, one row per (op, step) -- loop iterations reduced --
    sorted by op, then step. ``starts``: first row of each op; ``ids``: its op id;
    ``sizes``: its number of rows (recorded steps)."""

    __slots__ = ("op", "step", "cols", "starts", "ids", "sizes")

    def __init__(self, op: np.ndarray, step: np.ndarray, cols: dict[str, np.ndarray]) -> None:
        self.op, self.step, self.cols = op, step, cols
        n = len(op)
        self.starts = np.flatnonzero(np.r_[True, op[1:] != op[:-1]]) if n else np.zeros(0, np.int64)
        self.ids = op[self.starts]
        self.sizes = np.diff(np.r_[self.starts, n])

    def group_of(self, rows: np.ndarray) -> np.ndarray:
        """Op group (index into ``ids``) of each row index."""
        return np.searchsorted(self.starts, rows, side="right") - 1

    def rows_of(self, ops: np.ndarray) -> np.ndarray:
        """Bool per row: its op is one of ``ops``."""
        return self.per_op(np.isin(self.ids, ops))

    def per_op(self, flags: np.ndarray) -> np.ndarray:
        """A flag per op (aligned with ``ids``) as a flag per row."""
        return np.repeat(flags, self.sizes)

    def flat(self, names: Sequence[str], ops: np.ndarray | None = None) -> _Cells:
        """These cells (only ``names``; only the ops in ``ops`` when given)."""
        if ops is None:
            return self
        keep = self.rows_of(ops)
        return _Cells(self.op[keep], self.step[keep], {c: self.cols[c][keep] for c in names})

    def at(self, col: str, op: int, step: int) -> float:
        """Value of ``col`` for ``op`` at ``step`` (NaN when not recorded)."""
        g = int(np.searchsorted(self.ids, op))
        if g >= len(self.ids) or self.ids[g] != op:
            return math.nan
        a = int(self.starts[g])
        steps = self.step[a : a + int(self.sizes[g])]
        k = int(np.searchsorted(steps, step))
        return float(self.cols[col][a + k]) if k < len(steps) and steps[k] == step else math.nan


def _compare(values: np.ndarray, how: str, threshold: float) -> np.ndarray:
    """``values > threshold`` (``how`` "gt") or ``values < threshold`` ("lt"), decided
    as in float64 even for float32 ``values`` (no float64 copy of them: the threshold is
    moved to the float32 that gives the same answer). NaN compares False."""
    t = float(threshold)
    v = np.asarray(values)
    with np.errstate(invalid="ignore", over="ignore"):
        if v.dtype != np.float32 or not math.isfinite(t) or abs(t) > 3e38:
            v = v.astype(np.float64, copy=False)
            return v > t if how == "gt" else v < t
        t32 = np.float32(t)
        if how == "gt":  # x > t  <=>  x >= t32 when t32 > t, else x > t32
            return v >= t32 if float(t32) > t else v > t32
        return v <= t32 if float(t32) < t else v < t32


class _Dense:
    """The values the rules read for a run measured in full in the writer's order (every
    op once at every step, no loop): steps x ops arrays, the frame's columns reshaped,
    nothing sorted or transposed. ``ids``: the ops (ascending); ``steps``: the steps;
    ``sizes``: recorded steps per op (all of them). The same interface as `_Cells` for
    the rules; `flat` gives op-major `_Cells` of a few columns for the rules that walk
    each op's steps in order (trend, delayed)."""

    def __init__(self, ids: np.ndarray, steps: np.ndarray, cols: Mapping[str, np.ndarray]):
        self.ids, self.steps = ids, steps
        self.cols = dict(cols)  # as stored (float32 statistics stay float32: `_compare`)
        self.sizes = np.full(len(ids), len(steps), np.int64)

    def rows_of(self, ops: np.ndarray) -> np.ndarray:
        return self.per_op(np.isin(self.ids, ops))

    def per_op(self, flags: np.ndarray) -> np.ndarray:
        return np.asarray(flags, bool)[None, :]

    def flat(self, names: Sequence[str], ops: np.ndarray | None = None) -> _Cells:
        """Op-major `_Cells` of columns ``names`` (only the ops in ``ops`` when given)."""
        cols = np.arange(len(self.ids)) if ops is None else np.flatnonzero(np.isin(self.ids, ops))
        k, n = len(self.steps), len(cols)
        every = n == len(self.ids)
        out = {}
        for name in names:
            src = self.cols[name]
            src = np.asarray(src) if every else np.asarray(src)[:, cols]
            out[name] = _transpose(src, k, n)
        return _Cells(np.repeat(self.ids[cols], k), np.tile(self.steps, n), out)

    def at(self, col: str, op: int, step: int) -> float:
        j = int(np.searchsorted(self.ids, op))
        i = int(np.searchsorted(self.steps, step))
        if j >= len(self.ids) or self.ids[j] != op or i >= len(self.steps):
            return math.nan
        if self.steps[i] != step:
            return math.nan
        return float(self.cols[col][i, j])


def _dense_blocks(op: np.ndarray, step: np.ndarray) -> tuple[int, int] | None:
    """``(k, n)`` when the rows are k steps (ascending) of the same n ops (ascending, once
    each), step by step -- the order the writer stores a run measured in full -- so that
    sorting by op is a transpose; None otherwise."""
    total = len(op)
    if not total:
        return None
    n = int(np.argmax(step != step[0])) or total
    if total % n:
        return None
    k = total // n
    first = op[:n]
    if n > 1 and not (first[1:] > first[:-1]).all():
        return None
    if not (op.reshape(k, n) == first).all():
        return None
    steps = step.reshape(k, n)
    col = steps[:, 0]
    if not (steps == col[:, None]).all() or (k > 1 and not (col[1:] > col[:-1]).all()):
        return None
    return k, n


def _transpose(values: np.ndarray, k: int, n: int, block: int = 1024) -> np.ndarray:
    """``values`` (k steps x n ops, step-major) as float64 in op-major order, copied
    ``block`` ops at a time (a cache-friendly transpose: several times faster than one
    strided copy of 20 M values)."""
    src = np.asarray(values).reshape(k, n)
    out = np.empty((n, k), np.float64)
    for j in range(0, n, block):
        out[j : j + block] = src[:, j : j + block].T
    return out.ravel()


def _per_step(
    stats: pd.DataFrame, columns: dict[str, str], extra: Mapping[str, np.ndarray] | None = None
) -> _Cells:
    """Rows aggregated over loop iterations per (op, step): ``columns`` maps a column to
    ``max``/``min`` (NaN skipped) or ``abs`` (the value of larger magnitude). Sorted by
    (op, step). A frame in the writer's order with one row per op and step (a run
    measured in full, no loop) is transposed, nothing sorted; otherwise the groups are
    found once for every column (sorted keys and `numpy.ufunc.reduceat`).
    ``extra``: more columns, aligned with ``stats``'s rows (no copy of ``stats``)."""
    extra = extra or {}
    op = stats["op"].to_numpy(np.int64)
    step = stats["step"].to_numpy(np.int64)

    def source(col: str) -> np.ndarray:
        return np.asarray(extra[col] if col in extra else stats[col].to_numpy())

    if len(step) and (step[1:] >= step[:-1]).all():  # as read: by step, then op
        order = np.argsort(op, kind="stable")  # the same order, one key to sort
    else:
        order = np.lexsort((step, op))
    op, step = op[order], step[order]
    starts = np.flatnonzero(np.r_[True, (op[1:] != op[:-1]) | (step[1:] != step[:-1])])
    one_row_each = len(starts) == len(op)
    out = {}
    for col, how in columns.items():
        values = np.asarray(source(col), np.float64)[order]
        if one_row_each:
            out[col] = values
            continue
        with np.errstate(invalid="ignore"):
            hi = np.fmax.reduceat(values, starts) if how != "min" else None
            lo = np.fmin.reduceat(values, starts) if how != "max" else None
        if how == "max":
            out[col] = hi
        elif how == "min":
            out[col] = lo
        else:
            out[col] = np.where(np.abs(hi) < np.abs(lo), lo, hi)
    return _Cells(op[starts], step[starts], out)


def _value_amax(stats: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """`delayed.value_columns` without the binade floor: the value amax (NaN where the op
    did not run) and whether it ran."""
    if "count" in stats.columns:
        ran = stats["count"].fillna(0).to_numpy() != 0
    else:
        ran = np.ones(len(stats), bool)
    value = stats["absmax"].to_numpy(np.float64) * stats["scale"].to_numpy(np.float64)
    value[~ran] = np.nan
    return value, ran


def _cells_of(
    stats: pd.DataFrame,
    columns: dict[str, str],
    extra: Mapping[str, np.ndarray],
    block: tuple[int, int] | None,
) -> _Cells | _Dense:
    """`_Dense` views of a run in the writer's order with one row per op and step
    (``block``: `_dense_blocks`), else `_per_step`'s sorted, reduced rows."""
    if block is None:
        return _per_step(stats, columns, extra)
    op = stats["op"].to_numpy(np.int64)
    k, n = block
    step = stats["step"].to_numpy(np.int64)[::n]
    cols = {
        c: np.asarray(extra[c] if c in extra else stats[c].to_numpy()).reshape(k, n)
        for c in columns
    }
    return _Dense(op[:n].copy(), step.copy(), cols)


class _Hits(NamedTuple):
    """Per op where a rule holds (at least one row): op id, first step, number of steps,
    worst value and the (first) step it was reached, as Python lists."""

    op: list[int]
    first_step: list[int]
    steps: list[int]
    value: list[float]
    worst_step: list[int]


def _hits(cells: _Cells | _Dense, values: np.ndarray, mask: np.ndarray, worst: str) -> _Hits:
    """Per op, over the rows where ``mask`` holds: first step, number of steps, worst
    value (``max``/``min``/``abs``) and the earliest step it was reached. Only the rows
    (ops of a `_Dense`) where it holds are touched beyond the mask."""
    if isinstance(cells, _Dense):
        return _hits_dense(cells, values, mask, worst)
    rows = np.flatnonzero(mask)
    if not len(rows):
        return _Hits([], [], [], [], [])
    group = cells.group_of(rows)
    gs = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
    counts = np.diff(np.r_[gs, len(rows)])
    v = np.asarray(values, np.float64)[rows]
    key = {"max": v, "min": -v, "abs": np.abs(v)}[worst]
    best = np.maximum.reduceat(key, gs)
    is_best = key == np.repeat(best, counts)
    pos = np.minimum.reduceat(np.where(is_best, np.arange(len(rows)), len(rows)), gs)
    return _Hits(
        cells.ids[group[gs]].tolist(),
        cells.step[rows[gs]].tolist(),
        counts.tolist(),
        v[pos].tolist(),
        cells.step[rows[pos]].tolist(),
    )


def _hits_dense(cells: _Dense, values: np.ndarray, mask: np.ndarray, worst: str) -> _Hits:
    """`_hits` on steps x ops arrays: reductions down each op's column."""
    mask = np.broadcast_to(mask, (len(cells.steps), len(cells.ids)))
    cols = np.flatnonzero(mask.any(axis=0))
    if not len(cols):
        return _Hits([], [], [], [], [])
    m = mask[:, cols]
    v = np.asarray(np.asarray(values)[:, cols], np.float64)
    key = {"max": v, "min": -v, "abs": np.abs(v)}[worst]
    keym = np.where(m, key, -np.inf)
    best = keym.max(axis=0)
    at = (m & (keym == best)).argmax(axis=0)
    return _Hits(
        cells.ids[cols].tolist(),
        cells.steps[m.argmax(axis=0)].tolist(),
        m.sum(axis=0).tolist(),
        v[at, np.arange(len(cols))].tolist(),
        cells.steps[at].tolist(),
    )


def _hit_rows(hits: _Hits):
    """``(op, first_step, steps, value, worst_step)`` per op of `_hits`."""
    return zip(*hits)
