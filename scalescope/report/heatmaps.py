"""The report's op x step heatmaps: which metrics are drawn, and how thousands of ops
and steps fit (module groups, then neighbouring rows and steps merged in their worse
direction)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from .. import analysis as A
from ..analysis.frames import reduce_groups
from .collect import _RunData
from .markup import _WIDTH, _stat_note


def _merge_rows(
    mat: pd.DataFrame,
    labels: pd.Series,
    metric: str,
    max_ops: int,
    measured: pd.DataFrame | None = None,
) -> tuple[pd.DataFrame, pd.Series, int]:
    """At most ``max_ops`` rows: groups of consecutive ops merged in the metric's worse
    direction (a NaN in a group stays NaN); each group is labelled by its first and last
    op and indexed by its first op id.

    ``measured`` (`scalescope.analysis.measured_matrix`, aligned with ``mat``): cells of
    ops not measured at a step are left out of their group's cell, which is NaN only when
    no op of the group was measured there (a measured NaN still makes it NaN)."""
    n = len(mat)
    if n <= max_ops:
        return mat, labels.reindex(mat.index), 1
    width = math.ceil(n / max_ops)
    group = np.arange(n) // width
    n_cols = mat.shape[1]
    values = pd.Series(mat.to_numpy(np.float64).ravel())
    rows = pd.Series(np.repeat(group, n_cols))
    cols = pd.Series(np.tile(np.arange(n_cols), n))
    if measured is not None:
        keep = measured.reindex(index=mat.index, columns=mat.columns, fill_value=False)
        keep = keep.to_numpy(bool).ravel()
        values, rows, cols = values[keep], rows[keep], cols[keep]
    cells = reduce_groups(values, [rows, cols], A.metric_direction(metric))
    grid = np.full((math.ceil(n / width), n_cols), np.nan)
    grid[
        cells.index.get_level_values(0).to_numpy(np.int64),
        cells.index.get_level_values(1).to_numpy(np.int64),
    ] = cells.to_numpy(np.float64)
    ids = mat.index.to_numpy()
    first = ids[::width]
    last = ids[np.minimum(np.arange(len(first)) * width + width - 1, n - 1)]
    out = pd.DataFrame(grid, index=pd.Index(first, name="op"), columns=mat.columns)
    names = [
        f"{labels.get(a, a)} ... {labels.get(b, b)} ({int(min(width, n - i * width))} ops)"
        if a != b
        else str(labels.get(a, a))
        for i, (a, b) in enumerate(zip(first, last))
    ]
    return out, pd.Series(names, index=out.index), width


def _merge_measured(measured: pd.DataFrame, width: int) -> pd.DataFrame:
    """`_merge_rows`'s groups of ``width`` ops of a measured matrix: measured when any op
    of the group was."""
    if width <= 1:
        return measured
    grid = measured.to_numpy(bool)
    group = np.arange(len(grid)) // width
    merged = np.zeros((int(group.max()) + 1 if len(grid) else 0, grid.shape[1]), bool)
    np.logical_or.at(merged, group, grid)
    return pd.DataFrame(
        merged, index=pd.Index(measured.index[::width], name="op"), columns=measured.columns
    )


def _heatmap_metrics(data: _RunData) -> list[str]:
    """log2_rms, frac_nonfinite when any op holds NaN/inf, and the format metric that
    fails most: the most severe format finding's, else the (format, rule) with the most
    unsafe ops in the what-if."""
    metrics = ["log2_rms"]
    if (data.per_step["frac_nonfinite"] > 0).any():
        metrics.append("frac_nonfinite")
    f = data.findings
    fmt_rows = f[(f["format"] != "") & f["rule"].isin(["overflow", "underflow", "snr"])]
    chosen = None
    if len(fmt_rows):
        r = fmt_rows.iloc[0]
        chosen = f"{r['rule']}_{r['format']}"
    else:
        best = 0
        for fmt in data.formats:
            reasons = data.whatif[(fmt, "reason")].astype(str)
            for kind in ("overflow", "underflow", "snr"):
                n = int(reasons.str.contains(rf"(?:^|; ){kind} ").sum())
                if n > best:
                    best, chosen = n, f"{kind}_{fmt}"
        if chosen is None and data.formats:
            chosen = f"snr_{data.formats[0]}"
    if chosen:
        metrics.append(chosen)
    return list(dict.fromkeys(metrics))


def _heatmaps(data: _RunData, max_ops: int, max_steps: int) -> list[Any]:
    from bokeh.models import Div

    from .. import viz

    models: list[Any] = [
        Div(
            text="<h2>Heatmaps: op x step</h2><div>One row per op (id order), one column per "
            "recorded step. Where there are more ops than fit, the ops are grouped by pass and "
            "module path (<code>fwd/layers/3</code>) and each group is one row (&#9656;) "
            "holding, at each step, its worst op's value, which the hover names; where there "
            "are still too many rows, or more steps than fit, neighbouring rows and steps are "
            "merged. Worse: max of a fraction, min of an SNR, larger magnitude of a log2, over "
            "the cells measured; grey: no value (NaN data); blank (hatched): the op was not "
            "measured at that step. Hover for names.</div>" + _stat_note(data),
            name="report-heatmaps",
            width=_WIDTH,
            stylesheets=[data.css],
        )
    ]
    measured_all = A.measured_matrix(data.stats, max_steps=max_steps)
    keys = A.group_keys(data.table, 1)
    for metric in _heatmap_metrics(data):
        mat = A.matrix(data.stats, metric, iterations="worst", max_steps=max_steps)
        measured = measured_all.reindex(index=mat.index, columns=mat.columns, fill_value=False)
        n_ops, n_steps = len(mat), len(data.reader.steps)
        groups = keys.reindex(mat.index)
        n_groups = groups.nunique()
        # Small runs: one row per op; big ones: module groups collapsed to their worst op;
        # too many groups: neighbouring ops merged.
        grouped = n_ops <= max_ops or n_groups <= max_ops
        labels, width = data.labels, 1
        if not grouped:
            mat, labels, width = _merge_rows(mat, data.labels, metric, max_ops, measured)
            measured = _merge_measured(measured, width)
        mat = mat.astype(np.float32)
        title = f"{metric}: {n_ops} ops"
        if width > 1:
            title += f" (groups of {width})"
        elif n_ops > max_ops:
            title += f" in {n_groups} module groups (each row: the group's worst op)"
        title += f" x {n_steps} steps"
        if mat.shape[1] < n_steps:
            title += f" (windows of {math.ceil(n_steps / max(mat.shape[1], 1))})"
        models.append(
            viz.heatmap(
                mat,
                metric=metric,
                labels=labels,
                title=title,
                name=f"report-heatmap-{metric}",
                measured=measured,
                groups=groups if grouped else None,
                expanded=set(groups) if n_ops <= max_ops else frozenset(),
            )
        )
    return models
