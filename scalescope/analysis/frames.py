"""Building blocks over a run's frames: derived metrics, readable op labels and the
op x step matrix behind every heatmap.

Every function takes plain DataFrames (a *wide* statistics frame as returned by
``reader.stats(wide=True)`` and the op table ``reader.ops``), so the views and the tests
can feed them synthetic frames as well as recorded runs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import numpy as np
import pandas as pd

from ..core.policy import unique_labels
from ..core.recipes import format_names

Direction = Literal["max", "min", "abs", "mean"]
IterationsArg = Literal["max", "min", "mean", "worst", "all"]

#: Derived metrics: name -> (source columns, description).
DERIVED_METRICS: dict[str, tuple[tuple[str, ...], str]] = {
    "log2_rms": (("rms",), "log2 of the RMS of the data component"),
    "log2_absmax": (("absmax",), "log2 of the abs-max of the data component"),
    "log2_scale": (("scale",), "log2 of the scale (0 for plain values)"),
    "value_rms": (("rms", "scale"), "RMS of the value data * scale"),
    "value_absmax": (("absmax", "scale"), "abs-max of the value data * scale"),
}

#: Metrics that cannot be negative (a log2 ratio between two runs is meaningful).
POSITIVE_METRICS = frozenset(
    {"count", "scale", "rms", "absmax", "absmin", "std", "value_rms", "value_absmax"}
)

_MAX_PREFIXES = ("overflow_", "underflow_", "subnormal_", "block_flush_", "scale_log2_max_")
_MAX_NAMES = frozenset(
    {"frac_nonfinite", "frac_zero", "absmax", "value_absmax", "max", "dynamic_range"}
)

#: Order in which passes are listed (others follow alphabetically).
PASS_ORDER = ("input", "fwd", "bwd", "opt", "output")

# Optional op-table columns and the value an op takes when a (older) table lacks them.
_OP_DEFAULTS: dict[str, Any] = {
    "shape": (),
    "dtype": "",
    "scaled": False,
    "source": "",
    "note": "",
    "cast_to": "",
    "cast_at": "",
}


# -- argument checks ---------------------------------------------------------------------


def require_columns(frame: pd.DataFrame, columns: Iterable[str], arg: str) -> None:
    """Raise a KeyError naming ``arg`` when ``frame`` lacks any of ``columns``."""
    if not isinstance(frame, pd.DataFrame):
        raise TypeError(f"{arg}: expected a pandas DataFrame, got {type(frame).__name__}")
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise KeyError(
            f"{arg}: missing column(s) {missing}; it has {list(map(str, frame.columns))}"
        )


def check_stats(stats: pd.DataFrame, arg: str = "stats") -> pd.DataFrame:
    """Validate a wide statistics frame and return it with an ``iteration`` column.

    A long frame (``metric``/``value`` columns) is refused with a hint, because every
    function here reads one column per metric."""
    if isinstance(stats, pd.DataFrame) and {"metric", "value"} <= set(stats.columns):
        raise ValueError(
            f"{arg}: this is a long frame (metric/value columns); pass "
            "reader.stats(wide=True) instead"
        )
    require_columns(stats, ("step", "op"), arg)
    if "iteration" not in stats.columns:
        stats = stats.assign(iteration=0)
    return stats


def op_table(ops: pd.DataFrame, arg: str = "ops") -> pd.DataFrame:
    """The op table with the optional columns filled in (``cast_to`` is absent from
    runs recorded before it existed: those ops count as not cast) and sorted by op id."""
    require_columns(ops, ("name", "pass", "primitive"), arg)
    missing = {c: v for c, v in _OP_DEFAULTS.items() if c not in ops.columns}
    table = ops.copy()
    for col, default in missing.items():
        table[col] = [default] * len(table)
    table["cast_to"] = table["cast_to"].fillna("").astype(str)
    table["cast_at"] = table["cast_at"].fillna("").astype(str)
    table["source"] = table["source"].fillna("").astype(str)
    table["note"] = table["note"].fillna("").astype(str)
    table["scaled"] = table["scaled"].fillna(False).astype(bool)
    return table.sort_index()


def _audited(stats: pd.DataFrame) -> list[str]:
    """Names with a complete set of ``overflow_X``, ``underflow_X`` and ``snr_X`` columns
    (formats and recipes alike), in column order."""
    cols = set(stats.columns)
    return [
        c[4:]
        for c in stats.columns
        if isinstance(c, str)
        and c.startswith("snr_")
        and {f"overflow_{c[4:]}", f"underflow_{c[4:]}"} <= cols
    ]


def recorded_recipes(stats: pd.DataFrame) -> list[str]:
    """Block-scaled recipes recorded in ``stats``: the names R with ``overflow_R``,
    ``underflow_R``, ``snr_R`` and ``block_flush_R`` columns (a format has no
    ``block_flush_F``), in column order."""
    cols = set(stats.columns)
    return [n for n in _audited(stats) if f"block_flush_{n}" in cols]


def recorded_formats(stats: pd.DataFrame) -> list[str]:
    """Plain formats audited in ``stats``: those with a complete set of ``overflow_F``,
    ``underflow_F`` and ``snr_F`` columns, in column order; recipes (`recorded_recipes`)
    are not formats and are left out."""
    recipes = set(recorded_recipes(stats))
    return [n for n in _audited(stats) if n not in recipes]


def format_list(
    formats: str | Sequence[str] | None,
    stats: pd.DataFrame,
    arg: str,
    *,
    recipes: bool = False,
) -> list[str]:
    """Normalise a format argument (one name or several; None: all recorded) and check
    that ``stats`` holds its columns. ``recipes``: recorded recipes are valid names too
    (None then gives the formats, then the recipes)."""
    known = recorded_formats(stats)
    recorded = recorded_recipes(stats) if recipes else []
    if formats is None:
        return known + recorded
    names = format_names(formats)
    if isinstance(formats, str) and not names:
        names = [formats]  # named in the error below
    for name in names:
        if name not in known and name not in recorded:
            also = f"; recorded recipes: {', '.join(recorded) or 'none'}" if recipes else ""
            raise KeyError(
                f"{arg}: format {name!r} is not audited in these statistics "
                f"(audited: {', '.join(known) or 'none'}{also})"
            )
    return list(dict.fromkeys(names))


def worst_by_op(stats: pd.DataFrame, columns: dict[str, Literal["max", "min"]]) -> pd.DataFrame:
    """Worst value per op of each column over all rows (steps and loop iterations):
    ``max`` or ``min`` per column, NaN skipped (NaN only when every row is NaN).

    Index: op id, ascending; float64 columns. The ops are coded once and every column is
    reduced with an unbuffered ``np.fmax.at`` / ``np.fmin.at`` (no hashing per column):
    a few seconds for 20k ops x 1000 steps x 30 columns."""
    op = stats["op"].to_numpy(np.int64)
    if not len(op):
        index = pd.Index([], dtype=np.int64, name="op")
        return pd.DataFrame({c: pd.Series(dtype=np.float64) for c in columns}, index=index)
    codes, ids = _int_codes(op)
    out = {}
    for col, how in columns.items():
        if how not in ("max", "min"):
            raise ValueError(f"columns[{col!r}]: expected 'max' or 'min', got {how!r}")
        worst = np.full(len(ids), np.nan)
        reduce = np.fmax if how == "max" else np.fmin  # fmax(NaN, x) == x
        reduce.at(worst, codes, stats[col].to_numpy(np.float64))
        out[col] = worst
    return pd.DataFrame(out, index=pd.Index(ids, name="op"))


# -- derived metrics ---------------------------------------------------------------------


def _log2(values: pd.Series, name: str) -> pd.Series:
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.log2(values.to_numpy(np.float64))
    return pd.Series(out, index=values.index, name=name)


def log2_rms(stats: pd.DataFrame) -> pd.Series:
    """log2 of the data RMS: 0 means unit scale, the quantity the advisor's drift rule
    bounds. An all-zero value gives ``-inf`` (kept, not dropped: it is information);
    NaN RMS (non-finite data) stays NaN."""
    require_columns(stats, ("rms",), "stats")
    return _log2(stats["rms"], "log2_rms")


def log2_absmax(stats: pd.DataFrame) -> pd.Series:
    """log2 of the data abs-max (``-inf`` for an all-zero value), to compare with the
    exponent range of a format (e4m3 overflows above log2(448) ~ 8.8)."""
    require_columns(stats, ("absmax",), "stats")
    return _log2(stats["absmax"], "log2_absmax")


def log2_scale(stats: pd.DataFrame) -> pd.Series:
    """log2 of the ScaledArray scale (0 for plain values; ``-inf`` for a zero scale)."""
    require_columns(stats, ("scale",), "stats")
    return _log2(stats["scale"], "log2_scale")


def metric_values(stats: pd.DataFrame, metric: str) -> pd.Series:
    """One metric of a wide frame as float64: a recorded column or a derived metric
    (`DERIVED_METRICS`)."""
    if not isinstance(metric, str):
        raise TypeError(f"metric: expected a metric name, got {type(metric).__name__}")
    if metric in stats.columns:
        return stats[metric].astype(np.float64)
    if metric in DERIVED_METRICS:
        sources, _ = DERIVED_METRICS[metric]
        missing = [c for c in sources if c not in stats.columns]
        if missing:
            raise KeyError(f"metric {metric!r} needs column(s) {missing}, absent from stats")
        if metric.startswith("log2_"):
            return _log2(stats[sources[0]], metric)
        prod = stats[sources[0]].astype(np.float64) * stats[sources[1]].astype(np.float64)
        return prod.rename(metric)
    keys = ("step", "op", "iteration", "process", "name", "pass", "primitive", "label")
    known = [c for c in stats.columns if c not in keys]
    known += list(DERIVED_METRICS)
    raise KeyError(f"metric {metric!r} is neither a column of stats nor derived; known: {known}")


def with_derived(stats: pd.DataFrame, metrics: Iterable[str] | None = None) -> pd.DataFrame:
    """A copy of ``stats`` with derived metric columns added (default: every derived
    metric whose source columns are present)."""
    names = (
        [m for m, (src, _) in DERIVED_METRICS.items() if set(src) <= set(stats.columns)]
        if metrics is None
        else list(metrics)
    )
    return stats.assign(**{m: metric_values(stats, m) for m in names})


def metric_direction(metric: str) -> Direction:
    """Which way a metric gets worse, used to aggregate steps, iterations and to rank:
    ``max`` for fractions of bad values (overflow_*, underflow_*, subnormal_*,
    block_flush_*, frac_nonfinite, frac_zero), abs-max and a recipe's largest block scale
    (scale_log2_max_*); ``min`` for snr_* and a recipe's smallest block scale
    (scale_log2_min_*: the extremes of the scale range survive merging); ``abs`` (the
    value of larger magnitude) for log2_* (drift from unit scale either way); ``mean``
    otherwise."""
    if metric.startswith(_MAX_PREFIXES) or metric in _MAX_NAMES:
        return "max"
    if metric.startswith(("snr", "scale_log2_min_")) or metric in ("min", "absmin"):
        return "min"
    if metric.startswith("log2_"):
        return "abs"
    return "mean"


# -- labels ------------------------------------------------------------------------------


def _shape_text(shape: Any) -> str:
    if shape is None or (isinstance(shape, float) and math.isnan(shape)):
        return ""
    try:
        dims = [int(d) for d in shape]
    except TypeError:
        return f" [{shape}]"
    return " [" + "x".join(map(str, dims)) + "]"


def op_labels(ops: pd.DataFrame) -> pd.Series:
    """Readable, unique label per op id: ``pass/name`` (the pass prefix is not repeated
    when the name already starts with it, e.g. ``opt/mul``), ``#k`` (k-th occurrence in
    op-id order, from 1) when several ops share that prefix, and the shape:
    ``fwd/block_0/attn/dot_general#2 [16x64x384]``."""
    require_columns(ops, ("name", "pass"), "ops")
    table = ops.sort_index()
    names = table["name"].astype(str).tolist()
    base = unique_labels(table["pass"].astype(str).tolist(), names)  # what policies match
    shapes = table["shape"] if "shape" in table.columns else pd.Series(None, index=table.index)
    labels = [f"{b}{_shape_text(s)}" for b, s in zip(base, shapes)]
    out = pd.Series(labels, index=table.index, name="label", dtype=object)
    out.index.name = table.index.name or "op"
    return out


# -- aggregation -------------------------------------------------------------------------


def reduce_groups(
    values: pd.Series, keys: list[pd.Series] | list[np.ndarray], how: Direction
) -> pd.Series:
    """Aggregate ``values`` per group of ``keys`` with ``how`` (see `metric_direction`).

    A NaN in a group makes the result NaN: a statistic of non-finite data is worse
    than any number, so no aggregation hides it."""
    grouped = values.groupby(keys, sort=True)
    if how == "max":
        out = grouped.max()
    elif how == "min":
        out = grouped.min()
    elif how == "mean":
        out = grouped.mean()
    elif how == "abs":
        hi, lo = grouped.max(), grouped.min()
        out = hi.where(hi.abs() >= lo.abs(), lo)
    else:
        raise ValueError(f"how: expected max, min, abs or mean, got {how!r}")
    has_nan = values.isna().groupby(keys, sort=True).any()
    return out.mask(has_nan.reindex(out.index, fill_value=False))


def step_windows(steps: Sequence[int] | np.ndarray, max_steps: int) -> pd.Series:
    """Map each recorded step to the first step of its window when more than
    ``max_steps`` steps must be shown: windows of ``ceil(n / max_steps)`` consecutive
    recorded steps. With ``n <= max_steps`` every step is its own window."""
    if isinstance(max_steps, bool) or not isinstance(max_steps, int | np.integer):
        raise TypeError(f"max_steps: expected an int, got {type(max_steps).__name__}")
    if max_steps < 1:
        raise ValueError(f"max_steps: must be >= 1, got {max_steps}")
    uniq = np.unique(np.asarray(steps, dtype=np.int64))
    width = max(1, math.ceil(len(uniq) / max_steps))
    firsts = uniq[(np.arange(len(uniq)) // width) * width]
    return pd.Series(firsts, index=uniq, name="window")


def matrix(
    stats: pd.DataFrame,
    metric: str,
    *,
    ops: int | Sequence[int] | None = None,
    iterations: IterationsArg = "max",
    max_steps: int = 500,
) -> pd.DataFrame:
    """Op x step matrix of one metric (recorded or derived), the data of a heatmap.

    Index: op id, ascending (``(op, iteration)`` for ``iterations="all"``); columns: the
    recorded steps (name ``step``); float64 values, NaN where an op has no row.

    ``iterations``: how the rows of a loop body (one per scan iteration) are combined:
    ``max``, ``min``, ``mean``, ``worst`` (the metric's bad direction, see
    `metric_direction`) or ``all`` (keep them). ``ops``: restrict to these op ids.

    When there are more than ``max_steps`` recorded steps, consecutive steps are merged
    into windows of ``ceil(n / max_steps)`` steps, each aggregated in the metric's *worse*
    direction (max for overflow_*/underflow_*/subnormal_*/frac_nonfinite/frac_zero/absmax,
    min for snr_*, the value of larger magnitude for log2_*, mean otherwise), so a single
    spike survives downsampling; the column is labelled with the window's first step.
    NaN (non-finite data) in a window or over iterations is kept as NaN.

    Nothing is filled in: a cell (or a whole window) in which the op has no row -- it was
    not measured there, e.g. under an overhead budget -- is NaN, never a neighbour's value;
    a window in which it was measured at some steps aggregates those steps only.
    `measured_matrix` tells the two kinds of NaN apart.
    """
    stats = check_stats(stats)
    if iterations not in ("max", "min", "mean", "worst", "all"):
        raise ValueError(
            f"iterations: expected 'max', 'min', 'mean', 'worst' or 'all', got {iterations!r}"
        )
    values = metric_values(stats, metric)
    frame = pd.DataFrame(
        {
            "op": stats["op"].to_numpy(np.int64),
            "iteration": stats["iteration"].to_numpy(np.int64),
            "step": stats["step"].to_numpy(np.int64),
            "value": values.to_numpy(np.float64),
        }
    )
    if ops is not None:
        ids = [ops] if isinstance(ops, int | np.integer) else list(ops)
        frame = frame[frame["op"].isin(ids)]
    direction = metric_direction(metric)
    if iterations != "all" and len(frame):
        per_iteration = direction if iterations == "worst" else iterations
        dense = _dense_matrix(frame, per_iteration, direction, max_steps)  # type: ignore[arg-type]
        if dense is not None:
            return dense
    windows = step_windows(frame["step"].to_numpy(), max_steps)
    keys = ["op", "iteration"] if iterations == "all" else ["op"]
    if iterations not in ("all",):
        how: Direction = direction if iterations == "worst" else iterations  # type: ignore[assignment]
        per_step = reduce_groups(frame["value"], [frame["op"], frame["step"]], how)
        frame = per_step.rename("value").reset_index()
        frame.columns = ["op", "step", "value"]
    frame = frame.assign(step=frame["step"].map(windows))
    cells = reduce_groups(frame["value"], [frame[k] for k in keys + ["step"]], direction)
    out = cells.unstack("step") if len(cells) else _empty_matrix(keys)
    out = out.sort_index().sort_index(axis=1).astype(np.float64)
    out.columns = pd.Index(out.columns.astype(np.int64), name="step")
    return out


def measured_matrix(
    stats: pd.DataFrame,
    *,
    ops: int | Sequence[int] | None = None,
    max_steps: int = 500,
) -> pd.DataFrame:
    """Op x step boolean matrix: True where the op has at least one row at that step
    (or, when steps are merged into windows as in `matrix`, at one step of the window).

    Same index (op id) and columns (recorded steps or window starts) as
    ``matrix(stats, metric, ops=ops, max_steps=max_steps)``: a heatmap draws a NaN cell
    of that matrix blank when it is False here (the op was not measured: a run under an
    overhead budget measures a rotating subset of ops per recorded step) and grey when it
    is True (measured, but the statistic is NaN: non-finite data)."""
    stats = check_stats(stats)
    op = stats["op"].to_numpy(np.int64)
    step = stats["step"].to_numpy(np.int64)
    if ops is not None:
        ids = [ops] if isinstance(ops, int | np.integer) else list(ops)
        keep = np.isin(op, np.asarray(ids, np.int64))
        op, step = op[keep], step[keep]
    if not len(op):
        step_windows(step, max_steps)  # checks max_steps
        return pd.DataFrame(
            np.zeros((0, 0), bool),
            index=pd.Index([], dtype=np.int64, name="op"),
            columns=pd.Index([], dtype=np.int64, name="step"),
        )
    op_codes, op_ids = _int_codes(op)
    step_codes, steps = _int_codes(step)
    windows = step_windows(steps, max_steps).to_numpy()
    firsts, win_of_step = np.unique(windows, return_inverse=True)
    grid = np.zeros((len(op_ids), len(firsts)), bool)
    grid[op_codes, win_of_step[step_codes]] = True
    return pd.DataFrame(
        grid,
        index=pd.Index(op_ids, name="op"),
        columns=pd.Index(firsts.astype(np.int64), name="step"),
    )


def _int_codes(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(codes, sorted uniques)`` of integer keys (a lookup table when their range is
    small, else a hash factorisation)."""
    lo, hi = int(values.min()), int(values.max())
    if hi - lo <= 4 * len(values) + 1024:
        shifted = values - lo
        present = np.zeros(hi - lo + 1, bool)
        present[shifted] = True
        return (np.cumsum(present) - 1)[shifted], np.flatnonzero(present) + lo
    codes, uniques = pd.factorize(values, sort=True)
    return codes, np.asarray(uniques, np.int64)


def _reduce_cells(values: np.ndarray, cells: np.ndarray, size: int, how: Direction):
    """`reduce_groups` of ``values`` over integer cell ids in ``[0, size)``, dense: the
    reduced values and the row count per cell (NaN in a cell gives NaN)."""
    counts = np.bincount(cells, minlength=size)
    if len(counts) and counts.max() <= 1:  # one row per cell (no loop): nothing to reduce
        out = np.full(size, np.nan)
        out[cells] = values
        return out, counts
    with np.errstate(invalid="ignore", divide="ignore"):
        if how == "mean":
            return np.bincount(cells, weights=values, minlength=size) / counts, counts
        hi, lo = np.full(size, -np.inf), np.full(size, np.inf)
        if how != "min":
            np.maximum.at(hi, cells, values)  # np.maximum/minimum propagate NaN
        if how != "max":
            np.minimum.at(lo, cells, values)
    return _pick(how, hi, lo), counts


def _pick(how: Direction, hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    if how == "max":
        return hi
    if how == "min":
        return lo
    return np.where(np.abs(hi) >= np.abs(lo), hi, lo)  # "abs"; NaN in both stays NaN


def _dense_matrix(
    frame: pd.DataFrame, how: Direction, direction: Direction, max_steps: int
) -> pd.DataFrame | None:
    """`matrix` (iterations reduced with ``how``) on a dense op x step grid with NumPy:
    the groupby path's values, ~10x faster on 2000 ops x 1000 steps (0.2 s, not 2 s).
    None when the grid would be much larger than the frame (sparse steps)."""
    op_codes, op_ids = _int_codes(frame["op"].to_numpy(np.int64))
    step_codes, steps = _int_codes(frame["step"].to_numpy(np.int64))
    firsts = np.unique(step_windows(steps, max_steps).to_numpy())  # checks max_steps
    n_ops, n_steps = len(op_ids), len(steps)
    if n_ops * n_steps > max(4 * len(frame), 1 << 20):
        return None
    per_step, counts = _reduce_cells(
        frame["value"].to_numpy(np.float64), op_codes * n_steps + step_codes, n_ops * n_steps, how
    )
    present = (counts > 0).reshape(n_ops, n_steps)
    out = window_grid(per_step.reshape(n_ops, n_steps), present, direction, max_steps)
    return pd.DataFrame(
        out,
        index=pd.Index(op_ids, name="op"),
        columns=pd.Index(firsts, dtype=np.int64, name="step"),
    )


def window_grid(
    per_step: np.ndarray, present: np.ndarray, direction: Direction, max_steps: int
) -> np.ndarray:
    """Merge the step columns of a dense op x step grid into the windows of
    `step_windows` (``ceil(n / max_steps)`` consecutive columns), each reduced in
    ``direction`` (`metric_direction`) over the cells where ``present`` is True; a window
    without a present cell is NaN, a present NaN stays NaN. ops x windows, float64 (float32
    for a float32 grid in which every cell is present)."""
    n_ops, n_steps = per_step.shape
    width = max(1, math.ceil(n_steps / max_steps))  # the windows of step_windows
    if width == 1:
        out = per_step.astype(np.float64, copy=True)
        out[~present] = np.nan
        return out
    n_win = math.ceil(n_steps / width)
    if direction != "mean" and present.all():
        return _window_dense(per_step, direction, width, n_win)
    pad = ((0, 0), (0, n_win * width - n_steps))
    grid = np.pad(per_step, pad).reshape(n_ops, n_win, width)
    here_all = np.pad(present, pad).reshape(n_ops, n_win, width)
    # Reduce each window slice by slice (a reduction over a short strided axis is slow).
    n = np.zeros((n_ops, n_win), np.int64)
    hi, lo, total = np.full(n.shape, -np.inf), np.full(n.shape, np.inf), np.zeros(n.shape)
    with np.errstate(invalid="ignore", divide="ignore"):  # inf - inf, 0 / 0: NaN
        for k in range(width):
            cell, here = grid[:, :, k], here_all[:, :, k]
            n += here
            if direction == "mean":
                total += np.where(here, cell, 0.0)
            if direction in ("max", "abs"):
                hi = np.maximum(hi, np.where(here, cell, -np.inf))
            if direction in ("min", "abs"):
                lo = np.minimum(lo, np.where(here, cell, np.inf))
        out = total / n if direction == "mean" else _pick(direction, hi, lo)
    out[n == 0] = np.nan  # no row of this op in this window
    return out


def _window_dense(per_step: np.ndarray, direction: Direction, width: int, n_win: int):
    """`window_grid` of a grid without absent cells, in its own dtype: one pass per
    position in the window over whole columns (NaN propagates through max/min)."""
    n_ops, n_steps = per_step.shape
    n_full = n_steps // width
    body = per_step[:, : n_full * width].reshape(n_ops, n_full, width)
    tail = per_step[:, n_full * width :]
    out = np.empty((n_ops, n_win), per_step.dtype)
    with np.errstate(invalid="ignore"):
        hi = lo = None
        if direction in ("max", "abs"):
            hi = body[:, :, 0].copy()
            for k in range(1, width):
                np.maximum(hi, body[:, :, k], out=hi)
        if direction in ("min", "abs"):
            lo = body[:, :, 0].copy()
            for k in range(1, width):
                np.minimum(lo, body[:, :, k], out=lo)
        out[:, :n_full] = _pick(direction, hi, lo)
        if tail.shape[1]:
            t_hi = tail.max(axis=1) if hi is not None else None
            t_lo = tail.min(axis=1) if lo is not None else None
            out[:, n_full] = _pick(direction, t_hi, t_lo)
    return out


def _empty_matrix(keys: list[str]) -> pd.DataFrame:
    if len(keys) == 1:
        index = pd.Index([], dtype=np.int64, name="op")
    else:
        index = pd.MultiIndex.from_arrays([[], []], names=keys)
    return pd.DataFrame(index=index, columns=pd.Index([], dtype=np.int64, name="step"))


def matrix_run(reader: Any, metric: str, **kwargs: Any) -> pd.DataFrame:
    """`matrix` over a recorded run (reads only the columns the metric needs)."""
    sources = DERIVED_METRICS[metric][0] if metric in DERIVED_METRICS else (metric,)
    return matrix(reader.stats(list(sources), wide=True), metric, **kwargs)


def pass_rank(passes: Iterable[str]) -> list[str]:
    """The distinct passes in display order (`PASS_ORDER`, then others sorted)."""
    seen = list(dict.fromkeys(passes))
    known = [p for p in PASS_ORDER if p in seen]
    return known + sorted(p for p in seen if p not in PASS_ORDER)
