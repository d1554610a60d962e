"""One row per recorded op: where it is, how big its values are now, and the worst it
ever got against each audited format and recorded recipe (the op table of the dashboard
and the report)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from .frames import (
    check_stats,
    metric_direction,
    op_labels,
    op_table,
    recorded_formats,
    recorded_recipes,
    reduce_groups,
    worst_by_op,
)

_INFO_COLUMNS = [
    "label",
    "name",
    "pass",
    "primitive",
    "shape",
    "dtype",
    "scaled",
    "source",
    "cast_to",
    "cast_at",
]


def op_summary(stats: pd.DataFrame, ops: pd.DataFrame) -> pd.DataFrame:
    """Summary of every op that has rows in ``stats`` (index: op id, ascending).

    Columns: the op's ``label``, name, pass, primitive, shape, dtype, scaled, source,
    ``cast_to``; ``first_step``/``last_step`` recorded; at the last step ``rms`` (RMS over
    loop iterations), ``absmax``, ``dynamic_range`` (when recorded) and ``scale`` (max
    over iterations) and ``log2_rms``;
    per audited format F the worst over steps and iterations: ``overflow_F`` and
    ``underflow_F`` (max) and ``snr_F`` (min; NaN steps, i.e. no finite element, are
    skipped); per recorded recipe R the same three plus ``block_flush_R`` (max) and the
    range of its block scales, ``scale_log2_min_R`` (min) and ``scale_log2_max_R``
    (max); ``frac_nonfinite`` (max) and ``first_nonfinite_step`` (first step with a
    non-finite element, NaN if never).
    """
    stats = check_stats(stats)
    table = op_table(ops)
    unknown = np.setdiff1d(stats["op"].unique(), table.index.to_numpy())
    if len(unknown):
        raise KeyError(f"ops: op id {int(unknown[0])} appears in stats but not in ops")
    op = stats["op"].to_numpy(np.int64)
    step = stats["step"].to_numpy(np.int64)
    ids = np.unique(op)
    out = pd.DataFrame(index=pd.Index(ids, name="op"))
    labels = op_labels(table)
    out["label"] = labels.reindex(ids).to_numpy()
    for col in _INFO_COLUMNS[1:]:
        out[col] = table[col].reindex(ids).to_numpy()
    by_op = pd.Series(step, index=op).groupby(level=0)
    out["first_step"] = by_op.min().reindex(ids).to_numpy()
    out["last_step"] = by_op.max().reindex(ids).to_numpy()

    last = stats.loc[step == out["last_step"].reindex(op).to_numpy()]
    last_op = last["op"].to_numpy(np.int64)
    if "rms" in stats.columns:
        sq = last["rms"].astype(np.float64) ** 2
        out["rms"] = np.sqrt(reduce_groups(sq, [last_op], "mean")).reindex(ids).to_numpy()
        with np.errstate(divide="ignore", invalid="ignore"):
            out["log2_rms"] = np.log2(out["rms"].to_numpy(np.float64))
    for col in ("absmax", "dynamic_range", "scale"):
        if col in stats.columns:
            vals = last[col].astype(np.float64)
            out[col] = reduce_groups(vals, [last_op], "max").reindex(ids).to_numpy()

    worst_cols = [
        f"{stat}_{fmt}"
        for fmt in recorded_formats(stats)
        for stat in ("overflow", "underflow", "snr")
    ]
    recipe_stats = ("overflow", "underflow", "snr", "block_flush")
    recipe_stats += ("scale_log2_min", "scale_log2_max")
    for recipe in recorded_recipes(stats):
        worst_cols += [f"{stat}_{recipe}" for stat in recipe_stats if f"{stat}_{recipe}" in stats]
    if "frac_nonfinite" in stats.columns:
        worst_cols.append("frac_nonfinite")
    worst = worst_by_op(stats, {c: _worse(c) for c in worst_cols}).reindex(ids)
    for col in worst_cols:
        out[col] = worst[col].to_numpy()
    if "frac_nonfinite" in stats.columns:
        nonfinite = stats["frac_nonfinite"].astype(np.float64).to_numpy()
        bad = nonfinite > 0
        first = pd.Series(step[bad], index=op[bad]).groupby(level=0).min()
        out["first_nonfinite_step"] = first.reindex(ids).astype(np.float64).to_numpy()
    return out


def _worse(col: str) -> str:
    """``min`` for a column that gets worse as it falls (SNR, smallest block scale),
    else ``max``."""
    return "min" if metric_direction(col) == "min" else "max"


def worst_ops(summary: pd.DataFrame, by: str, n: int = 20, exclude: Any = None) -> pd.DataFrame:
    """The ``n`` rows of an `op_summary` that are worst by column ``by``: largest first
    for fractions and sizes, smallest first for ``snr_*`` and ``first_nonfinite_step``,
    largest magnitude first for ``log2_*`` (infinite ones, from all-zero values, last).
    NaN rows come last. ``exclude``: op ids never ranked, such as the values constant by
    construction (`scalescope.analysis.constant_ops`: mask fills, optimizer scalars)."""
    if by not in summary.columns:
        known = [c for c in summary.columns if pd.api.types.is_numeric_dtype(summary[c])]
        raise KeyError(f"by: {by!r} is not a column of the summary; numeric columns: {known}")
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
        raise ValueError(f"n: expected a non-negative int, got {n!r}")
    if exclude is not None and len(exclude):
        summary = summary[~summary.index.isin(np.asarray(exclude))]
    values = summary[by].astype(np.float64)
    if by == "first_nonfinite_step" or metric_direction(by) == "min":
        key = values
    elif metric_direction(by) == "abs":
        # log2 of an all-zero value is -inf: it has no scale to drift, rank it last
        key = -values.abs().where(np.isfinite(values))
    else:
        key = -values
    order = np.argsort(key.to_numpy(), kind="stable")  # NaN sorts last
    return summary.iloc[order[:n]]


def op_summary_run(reader: Any) -> pd.DataFrame:
    """`op_summary` of a recorded run."""
    return op_summary(reader.stats(wide=True), reader.ops)
