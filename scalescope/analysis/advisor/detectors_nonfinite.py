"""The ``nonfinite`` rule: NaN/inf outside masks (`_nonfinite_findings`), with the
earliest op holding one, and whether the step's outputs (`output_ops`) stay finite where
it appears (dropped downstream)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from ...probe import reach
from ..percent import pct
from ..thresholds import Thresholds
from .cells import _Cells, _compare, _Dense, _hit_rows, _hits
from .text import _steps_text


def _mask_groups(
    cells: _Cells | _Dense,
    values: np.ndarray,
    min_steps: int | np.ndarray,
    fills: np.ndarray | None = None,
) -> np.ndarray:
    """Per op (bool, aligned with ``cells.ids``): a non-finite fraction that is the same,
    non-zero and below 1, at every recorded step (at least ``min_steps`` of them, per op
    when an array): masks, see `Thresholds.mask_min_steps`. ``fills`` (per op): a value
    the probe saw hold a constant fill (``where(mask, s, -inf)``) is a mask whatever its
    fraction, as long as some of it and never all of it is masked: a padding mask's
    share follows each batch's lengths."""
    if not np.size(values):
        return np.zeros(len(cells.ids), bool)
    with np.errstate(invalid="ignore"):
        if isinstance(cells, _Dense):
            lo, hi = np.fmin.reduce(values, axis=0), np.fmax.reduce(values, axis=0)
        else:
            lo = np.fmin.reduceat(values, cells.starts)
            hi = np.fmax.reduceat(values, cells.starts)
        lo, hi = lo.astype(np.float64), hi.astype(np.float64)  # min/max: exact either way
        same = (hi - lo) <= 1e-12
        if fills is not None:
            same = same | fills
        return (cells.sizes >= min_steps) & (lo > 0) & (hi < 1) & same


def output_ops(ops: pd.DataFrame) -> np.ndarray:
    """Op ids whose statistics are those of the step's outputs (``output/...`` ops share
    the statistics of the op that produced them, ``stats_op``): parameters, optimizer
    state, loss."""
    if not {"name", "stats_op"} <= set(ops.columns) or not len(ops):
        return np.zeros(0, np.int64)
    out = ops["name"].astype(str).str.startswith("output").to_numpy()
    src = pd.to_numeric(ops["stats_op"], errors="coerce").to_numpy(np.float64)[out]
    return np.unique(src[np.isfinite(src) & (src >= 0)].astype(np.int64))  # -1: no stats


def flow_of_table(ops: pd.DataFrame) -> reach.Flow | None:
    """The data flow of the op table (`reach.flow_of`), None for a run stored without
    its ops' inputs (before they were stored)."""
    if not {"inputs", "stats_op", "dtype", "primitive"} <= set(ops.columns):
        return None
    stats_op = pd.to_numeric(ops["stats_op"], errors="coerce").fillna(-1).astype(np.int64)
    return reach.flow_of(
        zip(
            stats_op.tolist(),
            ops["inputs"].tolist(),
            ops["dtype"].astype(str).tolist(),
            (ops["primitive"].astype(str) == "output").tolist(),
            strict=True,
        )
    )


def _finite_output_steps(cells: _Cells | _Dense, outputs: np.ndarray) -> np.ndarray:
    """Recorded steps at which every output op (`output_ops`) is recorded and holds no
    NaN/inf (empty when the outputs are not all recorded)."""
    outputs = np.unique(outputs)
    if not len(outputs) or not np.isin(outputs, cells.ids).all():
        return np.zeros(0, np.int64)
    values = cells.cols["frac_nonfinite"]
    if isinstance(cells, _Dense):
        cols = np.searchsorted(cells.ids, outputs)
        bad = np.asarray(values)[:, cols]
        return cells.steps[~(np.isnan(bad) | (bad > 0)).any(axis=1)]
    rows = np.flatnonzero(cells.rows_of(outputs))
    steps, v = cells.step[rows], np.asarray(values, np.float64)[rows]
    uniq, inv, count = np.unique(steps, return_inverse=True, return_counts=True)
    bad = np.zeros(len(uniq), bool)
    np.logical_or.at(bad, inv, np.isnan(v) | (v > 0))
    return uniq[(count == len(outputs)) & ~bad]


def _op_steps(cells: _Cells | _Dense, op: int, mask: np.ndarray) -> np.ndarray:
    """Recorded steps of ``op`` where ``mask`` (a flag per row) holds."""
    g = int(np.searchsorted(cells.ids, op))
    if isinstance(cells, _Dense):
        return cells.steps[np.broadcast_to(mask, (len(cells.steps), len(cells.ids)))[:, g]]
    a = int(cells.starts[g])
    b = a + int(cells.sizes[g])
    return cells.step[a:b][np.asarray(mask)[a:b]]


def _dropped(
    cells: _Cells | _Dense, op: int, mask: np.ndarray, outputs: np.ndarray, finite_out: np.ndarray
) -> bool:
    """Whether ``op`` (not an output) holds NaN/inf (``mask``) only at recorded steps
    whose outputs are all finite: something downstream discards it."""
    return op not in outputs and bool(np.isin(_op_steps(cells, op, mask), finite_out).all())


def _carried_nowhere(
    cells: _Cells | _Dense, bad: np.ndarray, guarded: np.ndarray, flow: reach.Flow
) -> np.ndarray:
    """A flag per row of ``bad``'s shape: a ``guarded`` op's NaN/inf (``bad``) at a step
    where no path carries it to the outputs (`reach.dropped` over the ops ``bad`` at that
    step, the ops not recorded then counted as carrying it). Steps with the same ops
    non-finite (every step after a divergence) are followed once."""
    keep = set(guarded.tolist())
    seen: dict[bytes, set[int]] = {}

    def dropped_at(nf: np.ndarray, known: np.ndarray | None) -> list[int]:
        key = nf.tobytes() + b"|" + (b"" if known is None else known.tobytes())
        if key not in seen:
            seen[key] = (
                reach.dropped(nf.tolist(), flow, None if known is None else set(known.tolist()))
                & keep
            )
        return list(seen[key])

    hit = np.isin(cells.ids, guarded)
    if isinstance(cells, _Dense):  # every op at every step: all known
        flags = np.broadcast_to(bad, (len(cells.steps), len(cells.ids)))
        out = np.zeros(flags.shape, bool)
        for t in np.flatnonzero((flags & hit[None, :]).any(axis=1)).tolist():
            out[t] = np.isin(cells.ids, dropped_at(cells.ids[flags[t]], None))
        return out
    row_op = np.repeat(cells.ids, cells.sizes)
    flags = np.asarray(bad, bool)
    out = np.zeros(flags.shape, bool)
    order = np.argsort(cells.step, kind="stable")  # rows grouped by step, once
    steps = cells.step[order]
    for s in np.unique(cells.step[flags & cells.per_op(hit)]).tolist():
        rows = order[np.searchsorted(steps, s) : np.searchsorted(steps, s, side="right")]
        gone = dropped_at(row_op[rows[flags[rows]]], row_op[rows])
        out[rows] = np.isin(row_op[rows], gone)
    return out


def _nonfinite_findings(
    cells: _Cells | _Dense,
    thresholds: Thresholds,
    labels: pd.Series,
    fills: np.ndarray,
    outputs: np.ndarray | None = None,
    guarded: np.ndarray | None = None,
    flow: reach.Flow | None = None,
) -> list[dict[str, Any]]:
    """``guarded``: ops read only through a ``jnp.where`` (the safe-division idiom), or
    computed from constants and the step count (a schedule's unused branch): NaN/inf
    they hold at steps whose outputs stay finite were discarded by design, no finding;
    so is one they hold where ``flow`` (the op table's data flow, when stored) shows no
    path carrying it to the outputs (`reach.dropped`)."""
    values = cells.cols["frac_nonfinite"]
    outputs = np.zeros(0, np.int64) if outputs is None else np.asarray(outputs, np.int64)
    finite_out = _finite_output_steps(cells, outputs)
    # a fill the probe saw (a -inf mask) is a mask from its first recorded step on; one
    # whose share changes (a padding mask follows each batch's lengths) while the step's
    # outputs stay finite, too: where they do not, it may have gone bad, and is judged
    filled = np.isin(cells.ids, fills)
    need = np.where(filled, 1, thresholds.mask_min_steps)
    over = _compare(values, "gt", thresholds.nonfinite)
    held = filled.copy()
    for g in np.flatnonzero(filled):
        held[g] = _dropped(cells, int(cells.ids[g]), over, outputs, finite_out)
    kept = ~cells.per_op(_mask_groups(cells, values, need, held))
    bad = over & kept
    guarded = np.zeros(0, np.int64) if guarded is None else np.asarray(guarded, np.int64)
    for op in np.intersect1d(guarded, cells.ids).tolist():
        if _op_steps(cells, op, bad).size and _dropped(cells, op, bad, outputs, finite_out):
            bad = bad & ~cells.rows_of(np.asarray([op]))
    if flow is not None and len(guarded):
        # where the outputs went non-finite for another reason (an FP8 overflow), a
        # guarded value's NaN/inf that no path carries on is still no finding
        bad = bad & ~_carried_nowhere(cells, bad, guarded, flow)
    hits = _hits(cells, values, bad, "max")
    if not hits.op:
        return []
    first_steps = np.asarray(hits.first_step)
    k0 = int(np.argmin(first_steps))  # earliest; ties: the smallest op id
    origin, origin_step = hits.op[k0], int(first_steps[k0])
    rows = []
    for op, first, k, v, at in _hit_rows(hits):
        n = int(cells.sizes[np.searchsorted(cells.ids, op)])
        text = f"{pct(v)} of values are NaN/inf at step {at}"
        if op == origin:
            tail = "the earliest op with non-finite values"
        else:
            tail = (
                f"the earliest op with non-finite values is {labels[origin]} (step {origin_step})"
            )
        # dropped downstream: at every step it holds NaN/inf, the step's outputs are
        # finite (a where/select discards it: a warm-up branch at step 0, an empty segment)
        contained = _dropped(cells, op, bad, outputs, finite_out)
        if contained:
            tail += (
                "; dropped downstream: the step's outputs (parameters, optimizer state, "
                "loss) stay finite at those steps"
            )
        rows.append(
            dict(
                op=op,
                rule="nonfinite",
                format="",
                first_step=first,
                steps=k,
                value=v,
                threshold=float(thresholds.nonfinite),
                evidence=f"{text}; {_steps_text(k, n, first)}; {tail}.",
                _at=at,
                _origin=origin,
                _contained=contained,
            )
        )
    return rows
