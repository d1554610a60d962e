"""The ``delayed`` rule: a value whose amax grows faster than FP8 delayed scaling can
follow, found by one vectorised replay (`scalescope.analysis.delayed`) over the values a
run casts without a scale of their own, or every float op when a format is audited."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from .. import delayed
from ..thresholds import Thresholds, _format_info, recipe_element
from .cells import _Cells, _Dense
from .text import _delayed_text


def _delayed_candidates(dense: _Dense, thresholds: Thresholds) -> np.ndarray:
    """Ops of ``dense`` the delayed rule may flag; the others cannot clip. With a
    history covering every recorded step, an op whose amax is finite everywhere is
    replayed against the running max of its previous amaxes, so it needs an amax more
    than ``2**delayed_log2`` times that max at some step. Ops with a non-finite amax (or
    a shorter history) are always candidates. One pass down the steps, no copy."""
    amax = dense.cols["_amax"]
    k = amax.shape[0]
    if thresholds.delayed_history < k - 1 or k < 2:
        return dense.ids
    factor = 2.0**thresholds.delayed_log2 * (1 - 1e-9)  # slack: log2 vs product rounding
    finite = np.ones(amax.shape[1], bool)
    grows = np.zeros(amax.shape[1], bool)
    running = np.asarray(amax[0], np.float64)
    finite &= np.isfinite(running)
    with np.errstate(invalid="ignore", over="ignore"):
        for row in amax[1:]:
            finite &= np.isfinite(row)
            grows |= row > factor * running
            running = np.maximum(running, row)
    return dense.ids[grows | ~finite]


def _delayed_findings(
    cells: _Cells | _Dense,
    fmt_of: pd.Series,
    thresholds: Thresholds,
    exp_range: tuple[int, int] | None = None,
) -> list[dict[str, Any]]:
    """The ``delayed`` rule: one vectorised replay (`delayed.replay`) over every op of
    ``fmt_of`` (op id -> format name) with at least two recorded steps where it ran;
    Python only for the ops that clip. The binade floor of the value amax (``_floor``)
    is read where the amax exceeds the threshold only; on `_Dense` cells it is computed
    there from ``absmax`` and ``scale`` (``exp_range``: the histogram's range)."""
    if isinstance(cells, _Dense):
        dense = cells
        fmt_of = fmt_of[fmt_of.index.isin(_delayed_candidates(dense, thresholds))]
        sub = np.flatnonzero(np.isin(dense.ids, fmt_of.index.to_numpy()))
        cells = dense.flat(["_amax", "_ran"], fmt_of.index.to_numpy())
        k = len(dense.steps)

        def floor_at(rows: np.ndarray) -> np.ndarray:
            j, i = np.divmod(rows, k)
            absmax = np.asarray(dense.cols["absmax"][i, sub[j]], np.float64)
            scale = np.asarray(dense.cols["scale"][i, sub[j]], np.float64)
            return delayed.binade_floor(absmax, exp_range) * scale

    else:
        floor_all = cells.cols["_floor"]

        def floor_at(rows: np.ndarray) -> np.ndarray:
            return floor_all[rows]

    keep = cells.rows_of(fmt_of.index.to_numpy()) & (cells.cols["_ran"] > 0)
    op = cells.op
    starts = delayed.group_starts(op[keep])
    sizes = np.diff(np.r_[starts, np.count_nonzero(keep)])
    keep[keep] = np.repeat(sizes >= 2, sizes)  # at least two recorded steps
    if not keep.any():
        return []
    kept = np.flatnonzero(keep)
    del keep
    op = op[kept]
    step = cells.step[kept]
    amax = cells.cols["_amax"][kept]
    starts = delayed.group_starts(op)
    ids = op[starts]
    names = fmt_of.reindex(ids).to_numpy()
    maxima = {f: float(_format_info(f, None)["max"]) for f in fmt_of.unique()}
    sizes = np.diff(np.r_[starts, len(op)])
    fmt_max = np.repeat(pd.Series(names).map(maxima).to_numpy(np.float64), sizes)
    history = thresholds.delayed_history
    r = delayed.replay(amax, starts, history=history, algo="max", margin=0, fmt_max=fmt_max)
    with np.errstate(divide="ignore", invalid="ignore"):
        # the binade floor is at most the amax: only rows whose amax clips can hold
        above = np.flatnonzero(r.from_history & (amax > r.threshold))
        floor = floor_at(kept[above])
        sure = floor > r.threshold[above]  # clipped_min > 0
        far = np.log2(amax[above] / r.threshold[above]) > thresholds.delayed_log2
    hit = np.zeros(len(amax), bool)
    hit[above[sure & far]] = True
    rows = []
    for g in np.unique(np.searchsorted(starts, np.flatnonzero(hit), side="right") - 1):
        a, b = starts[g], starts[g] + sizes[g]
        part = delayed.Replay(*(v[a:b] for v in r))
        text, at, over = _delayed_text(amax[a:b], step[a:b], part, hit[a:b], names[g], history)
        hits = step[a:b][hit[a:b]]
        rows.append(
            dict(
                op=int(ids[g]),
                rule="delayed",
                format="",  # as drift/trend: the replayed format is in the evidence
                first_step=int(hits[0]),
                steps=int(len(hits)),
                value=over,
                threshold=0.0,
                evidence=text,
                _at=at,
            )
        )
    return rows


def _fp8(fmt: str) -> bool:
    """A plain format of 8 bits or fewer with a max: what FP8 training scales per tensor,
    and so what delayed scaling concerns (BF16 and FP16 are cast without a scale: a
    healthy BF16 run got "delayed scaling" findings on values that grow from zero)."""
    if not fmt or "max" not in _format_info(fmt, None):
        return False
    from ...core import formats  # local: the advisor works on frames alone

    try:
        return np.dtype(formats.get(fmt).dtype).itemsize <= 1
    except (KeyError, ValueError, TypeError):
        return False


def _delayed_formats(info: pd.DataFrame, audit: Sequence[str] = ()) -> pd.Series:
    """Float ops (by op-table dtype; unknown dtype counts as float) -> the format their
    delayed scaling is replayed in. Delayed scaling is a way to scale a cast to FP8
    (`_fp8`): the rule concerns the values a run casts to such a format without a scale
    of their own (a naive cast, replayed in its format; a scalified value is cast with
    this step's scale), and, when such a format is audited, every float op (replayed in
    its FP8 cast format, else the first such audited format)."""
    dtype = info["dtype"].astype(str)
    floats = info[(dtype == "") | dtype.str.contains("float")]
    cast = floats["cast_to"].astype(str)
    limits = {f: _fp8(f) for f in cast.unique()}
    known = cast.map(limits).to_numpy(bool)
    audited = [f for f in audit if recipe_element(f) is None and _fp8(f)]
    if audited:
        return cast.where(known, audited[0])
    return cast[known & ~floats["scaled"].to_numpy(bool)]
