"""Delayed-scaling replay: what a Transformer Engine / Flax ``fp8_ops`` style *delayed
scaling* recipe would have clipped, replayed on the host from recorded statistics.

Delayed scaling casts a tensor to FP8 with a scale computed from the abs-maxima
("amaxes") of *earlier* steps, kept in an amax history. At recorded step t, for one op:

- the value cast is the op's value: amax_t = ``absmax * scale`` (``absmax`` is the
  largest finite ``|x|`` of the data component, ``scale`` the ScaledArray scale, 1 for a
  plain value), the value a plain FP8 cast would see. Non-finite elements are not part of
  it (a real history would take their inf/NaN; the advisor's nonfinite rule reports them);
- the history holds the amaxes of the ``history`` previous *recorded* steps. The scale
  used at step t comes from the history before amax_t is pushed:
  ``amax_ref = max(history)`` (``algo="max"``) or its most recent entry
  (``"most_recent"``), then ``scale_t = fmt.max / amax_ref / 2**margin``. When
  ``amax_ref`` is 0, not finite (a NaN in the history propagates through the max, as in
  TE) or the history is empty (the first step), the previous scale is kept; the initial
  scale is 1.0;
- an element clips when ``|x| * scale_t > fmt.max``, i.e. ``|x| > threshold_t =
  fmt.max / scale_t`` (computed as ``amax_ref * 2**margin``, its exact value, so that a
  constant amax never looks clipped through rounding of the round trip).

Only recorded steps are known: with ``every=10`` the replayed history holds every 10th
step's amax, so a history of N entries spans about 10 N training steps and growth
between two recorded steps is seen as one jump (the ``gap`` column says how many
training steps separate consecutive recorded steps).

The clipped fraction comes from the exponent histogram of the data (bins of
``floor(log2|d|)``: one binade of resolution), so it is a pair of bounds: ``clipped_min``
counts the bins entirely above the threshold, ``clipped_max`` adds the bin holding it.
Both are exactly 0 when amax_t <= threshold_t.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from numbers import Real
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import pandas as pd

if TYPE_CHECKING:
    from ..core.formats import Format

ALGOS = ("max", "most_recent")
OUTPUT_COLUMNS = (
    "step",
    "amax",
    "amax_ref",
    "scale",
    "threshold",
    "clipped_min",
    "clipped_max",
    "headroom_log2",
    "gap",
)
#: Histogram labels besides the ``2^e`` bins (see `scalescope.probe.kernel.HIST_COLUMNS`).
SPECIAL_BINS = ("zero", "below", "above", "nonfinite")
_EXPONENT_BIN = re.compile(r"^2\^(-?\d+)$")


class Replay(NamedTuple):
    """Per replayed row (a recorded step of an op): the history's reference amax (NaN:
    empty, or a NaN in it), the scale used, the clipping threshold (value units), and
    whether the scale comes from a history entry (False: still the initial scale 1.0)."""

    amax_ref: np.ndarray
    scale: np.ndarray
    threshold: np.ndarray
    from_history: np.ndarray


# -- arguments ---------------------------------------------------------------------------


def check_options(history: Any, algo: Any, margin: Any, fmt: Any) -> Format:
    """Validate the replay options; returns the `scalescope.core.formats.Format` of
    ``fmt``. ValueError naming the argument and the bad value otherwise."""
    from ..core import formats  # local: analysis works on frames alone

    if isinstance(history, bool) or not isinstance(history, int | np.integer) or history < 1:
        raise ValueError(f"history: expected an int >= 1, got {history!r}")
    if algo not in ALGOS:
        raise ValueError(f"algo: expected one of {', '.join(map(repr, ALGOS))}, got {algo!r}")
    if isinstance(margin, bool) or not isinstance(margin, Real) or not math.isfinite(margin):
        raise ValueError(f"margin: expected a finite real number, got {margin!r}")
    try:
        return formats.get(fmt)
    except KeyError as err:
        raise ValueError(f"fmt: {err.args[0]}") from None


def exponent_bins(labels: Iterable[Any]) -> tuple[list[str], np.ndarray, np.ndarray] | None:
    """The exponent-histogram columns among ``labels``, with each bin's bounds on
    ``|d|``: ``(columns, lower, upper)``, elements of a bin satisfy ``lower <= |d| <
    upper`` (``zero``: 0, 0; ``below``: 0, 2^lo; ``2^e``: 2^e, 2^(e+1); ``above``:
    2^(hi+1), inf; ``nonfinite``: NaN, NaN, never clipped). None when ``labels`` holds
    no histogram column; ValueError when it holds an incomplete one."""
    labels = [c for c in labels if isinstance(c, str)]
    exps = sorted(int(m.group(1)) for c in labels if (m := _EXPONENT_BIN.match(c)))
    special = [c for c in SPECIAL_BINS if c in labels]
    if not exps and not special:
        return None
    missing = [c for c in SPECIAL_BINS if c not in special]
    if not exps:
        missing.append("2^e bins")
    elif exps != list(range(exps[0], exps[-1] + 1)):
        gaps = sorted(set(range(exps[0], exps[-1] + 1)) - set(exps))
        missing += [f"2^{e}" for e in gaps]
    if missing:
        raise ValueError(f"frame: incomplete exponent histogram, missing column(s) {missing}")
    lo, hi = exps[0], exps[-1]
    columns = ["zero", "below", *(f"2^{e}" for e in exps), "above", "nonfinite"]
    e = np.asarray(exps, np.float64)
    lower = np.r_[0.0, 0.0, np.exp2(e), np.exp2(hi + 1.0), np.nan]
    upper = np.r_[0.0, np.exp2(float(lo)), np.exp2(e + 1.0), np.inf, np.nan]
    return columns, lower, upper


def hist_range(labels: Iterable[Any] | None) -> tuple[int, int] | None:
    """``(lo, hi)``: the exponents of the first and last ``2^e`` bins among ``labels``
    (a run's ``hist_columns``), or None without a histogram."""
    bins = exponent_bins(labels or ())
    if bins is None:
        return None
    exps = [int(c[2:]) for c in bins[0] if c.startswith("2^")]
    return exps[0], exps[-1]


# -- the replay --------------------------------------------------------------------------


def _group_rows(starts: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the index of its group's first row, and its group number."""
    counts = np.diff(np.r_[starts, n]).astype(np.int64)
    group = np.repeat(np.arange(len(starts)), counts)
    return np.asarray(starts, np.int64)[group], group


def history_reference(amax: np.ndarray, starts: np.ndarray, history: int, algo: str) -> np.ndarray:
    """The history's reference amax before each row is pushed: rows are consecutive
    recorded steps of groups (ops) starting at ``starts``; the history of a row is the
    up to ``history`` previous rows of its group. ``algo="max"``: their max (NaN when one
    is NaN, as ``torch.max``/``jnp.max`` propagate it); ``"most_recent"``: the previous
    row. NaN for a group's first row (empty history).

    Vectorised over every group: a grouped running max for windows that start at the
    group's first row, a doubling sliding-window max for full windows."""
    amax = np.asarray(amax, np.float64)
    n = len(amax)
    sizes = np.diff(np.r_[starts, n]).astype(np.int64)
    if len(sizes) and sizes[0] > 0 and (sizes == sizes[0]).all():
        return _history_reference_dense(amax.reshape(len(sizes), -1), history, algo).ravel()
    first, group = _group_rows(starts, n)
    index = np.arange(n)
    pos = index - first
    ref = np.full(n, np.nan)
    has = pos >= 1
    if algo == "most_recent":
        ref[has] = amax[index[has] - 1]
        return ref
    nan = np.isnan(amax)
    filled = np.where(nan, -np.inf, amax)
    running = pd.Series(filled).groupby(group, sort=False).cummax().to_numpy()
    short = has & (pos <= history)
    ref[short] = running[index[short] - 1]
    full = pos > history
    if full.any():
        k = int(np.floor(np.log2(history)))
        window = filled.copy()  # after the loop: max over [i, i + 2^k)
        for j in range(k):
            w = 1 << j
            window[:-w] = np.maximum(window[:-w], window[w:])
        rows = index[full]
        ref[rows] = np.maximum(window[rows - history], window[rows - (1 << k)])
    seen = np.r_[0, np.cumsum(nan)]
    lo = np.maximum(first, index - history)
    ref[has & (seen[index] - seen[lo] > 0)] = np.nan
    return ref


def _history_reference_dense(amax: np.ndarray, history: int, algo: str) -> np.ndarray:
    """`history_reference` of groups of equal length, one per row of ``amax`` (ops x
    recorded steps): the same numbers, computed along the rows."""
    g, length = amax.shape
    ref = np.full((g, length), np.nan)
    if length < 2:
        return ref
    if algo == "most_recent":
        ref[:, 1:] = amax[:, :-1]
        return ref
    nan = np.isnan(amax)
    filled = np.where(nan, -np.inf, amax)
    h = min(history, length - 1)
    ref[:, 1 : h + 1] = np.maximum.accumulate(filled[:, :h], axis=1)
    if length - 1 > history:  # full windows: the max of the previous `history` entries
        k = int(np.floor(np.log2(history)))
        window = filled.copy()  # after the loop: max over [i, i + 2^k) along each row
        for j in range(k):
            w = 1 << j
            window[:, :-w] = np.maximum(window[:, :-w], window[:, w:])
        cols = np.arange(history + 1, length)
        ref[:, history + 1 :] = np.maximum(window[:, cols - history], window[:, cols - (1 << k)])
    if nan.any():  # a NaN in the window makes the reference NaN
        seen = np.zeros((g, length + 1), np.int64)
        np.cumsum(nan, axis=1, out=seen[:, 1:])
        idx = np.arange(1, length)
        lo = np.maximum(idx - history, 0)
        bad = (seen[:, idx] - seen[:, lo]) > 0
        ref[:, 1:][bad] = np.nan
    return ref


def replay(
    amax: np.ndarray,
    starts: np.ndarray,
    *,
    history: int,
    algo: str,
    margin: float,
    fmt_max: float | np.ndarray,
) -> Replay:
    """Delayed scaling over grouped rows (see `history_reference`): the scale and
    threshold used at each row. A reference that is 0 or not finite keeps the group's
    previous scale (initial 1.0, threshold ``fmt_max``). ``fmt_max``: a number, or one
    per row."""
    ref = history_reference(amax, starts, history, algo)
    n = len(ref)
    first, _ = _group_rows(starts, n)
    with np.errstate(invalid="ignore"):
        valid = np.isfinite(ref) & (ref > 0)
    last = np.maximum.accumulate(np.where(valid, np.arange(n), -1)) if n else np.zeros(0, int)
    from_history = last >= first
    kept = ref[np.maximum(last, 0)] if n else ref
    factor = 2.0 ** float(margin)
    fmt_max = np.broadcast_to(np.asarray(fmt_max, np.float64), (n,))
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        scale = np.where(from_history, fmt_max / kept / factor, 1.0)
        threshold = np.where(from_history, kept * factor, fmt_max)
    return Replay(ref, scale, threshold, from_history)


def binade_floor(absmax: np.ndarray, exp_range: tuple[int, int] | None = None) -> np.ndarray:
    """Lower bound of the exponent-histogram bin holding ``absmax``: ``2^floor(log2
    absmax)``; with ``exp_range = (lo, hi)`` (`hist_range`), 0 below ``2^lo`` (the
    ``below`` bin) and ``2^(hi+1)`` from there up (the ``above`` bin). 0 for 0, NaN for
    NaN. The bin is entirely above a threshold exactly when this is: the test behind
    ``clipped_min > 0`` without reading the histogram."""
    a = np.asarray(absmax, np.float64)
    with np.errstate(invalid="ignore"):
        positive = np.isfinite(a) & (a > 0)
    # 2^floor(log2 a) of a normal float64: its sign and exponent bits, mantissa cleared
    # (float32 data is never subnormal in float64; a float64 subnormal takes frexp)
    floor = (np.abs(a).view(np.int64) & np.int64(0x7FF0000000000000)).view(np.float64)
    tiny = positive & (a < np.finfo(np.float64).tiny)
    if tiny.any():
        _, exp = np.frexp(a[tiny])
        floor[tiny] = np.exp2(exp.astype(np.float64) - 1.0)
    if exp_range is not None:
        lo, hi = exp_range
        floor = np.where(floor < 2.0**lo, 0.0, np.minimum(floor, 2.0 ** (hi + 1)))
    out = np.where(positive, floor, a)
    if exp_range is not None:
        out = np.where(np.isposinf(a), 2.0 ** (exp_range[1] + 1), out)
    return out


def clipped_counts(
    counts: np.ndarray,
    lower: np.ndarray,
    upper: np.ndarray,
    data_scale: np.ndarray,
    threshold: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Per row: elements surely clipped (bins whose lower bound times ``data_scale`` is
    above ``threshold``) and possibly clipped (also the bin holding the threshold).
    ``counts``: ``[rows, bins]``; ``lower``/``upper``: per bin, in data units."""
    s = np.asarray(data_scale, np.float64)[:, None]
    t = np.asarray(threshold, np.float64)[:, None]
    with np.errstate(invalid="ignore"):
        sure = (lower[None, :] * s) > t
        possible = (upper[None, :] * s) > t
    c = np.asarray(counts, np.float64)
    return (c * sure).sum(axis=1), (c * possible).sum(axis=1)


# -- one op ------------------------------------------------------------------------------


def _check_frame(frame: Any) -> pd.DataFrame:
    """The rows of one op and one process, sorted by step (loop iterations stay
    together); rows with ``count == 0`` (the op did not run) dropped."""
    if not isinstance(frame, pd.DataFrame):
        raise TypeError(f"frame: expected a pandas DataFrame, got {type(frame).__name__}")
    missing = [c for c in ("step", "absmax", "scale") if c not in frame.columns]
    if missing:
        raise ValueError(
            f"frame: missing column(s) {missing}; it has {list(map(str, frame.columns))}"
        )
    for col, what in (("op", "ops"), ("process", "processes")):
        if col in frame.columns and frame[col].nunique() > 1:
            found = sorted(frame[col].unique().tolist())
            raise ValueError(f"frame: rows of {len(found)} {what} {found[:5]}; pass one")
    steps = pd.to_numeric(frame["step"], errors="coerce")
    if steps.isna().any() or not np.all(np.mod(steps, 1) == 0):
        bad = frame["step"][steps.isna() | (np.mod(steps.fillna(0.5), 1) != 0)].iloc[0]
        bad = bad.item() if isinstance(bad, np.generic) else bad
        raise ValueError(f"frame: step must hold integers, got {bad!r}")
    if "count" in frame.columns:
        frame = frame[frame["count"].fillna(0).to_numpy() != 0]
    return frame.sort_values("step", kind="stable").reset_index(drop=True)


def _empty_output() -> pd.DataFrame:
    out = pd.DataFrame({c: pd.Series(dtype=np.float64) for c in OUTPUT_COLUMNS})
    return out.astype({"step": np.int64})


def delayed_scaling(
    frame: pd.DataFrame,
    *,
    history: int = 1024,
    algo: str = "max",
    margin: float = 0,
    fmt: Any = "e4m3",
) -> pd.DataFrame:
    """Replay delayed scaling (see the module docstring) over the recorded rows of ONE
    op: what a TE / Flax-style FP8 recipe with an amax history of ``history`` recorded
    steps, ``algo`` (``"max"`` or ``"most_recent"``), ``margin`` and format ``fmt`` (a
    name of `scalescope.core.formats`) would have clipped at each recorded step.

    ``frame``: columns ``step``, ``absmax``, ``scale`` and the exponent-histogram bins
    (``zero``, ``below``, ``2^e``..., ``above``, ``nonfinite``: `RunReader.hist`'s
    labels); without histogram columns the clipped bounds are NaN where clipping
    happens. Several rows of one step are iterations of a loop sharing one history: the
    step's amax is their max, the clipped counts add up (each row against the threshold
    in its own data units). Rows with ``count == 0`` (the op did not run) are skipped.

    Returns one row per recorded step: ``step``; ``amax`` (value abs-max); ``amax_ref``
    (the history's reference, NaN when empty or holding a NaN); ``scale`` (the delayed
    scale used; 1.0 until the history holds a finite amax > 0); ``threshold``
    (``fmt.max / scale``: larger values clip); ``clipped_min`` / ``clipped_max`` (bounds
    on the fraction of all elements clipped, one binade of histogram resolution, exactly
    0 when ``amax <= threshold``, NaN with no element); ``headroom_log2``
    (``log2(threshold / amax)``: negative means clipping); ``gap`` (training steps
    since the previous recorded step: the history spans about ``history * gap`` training
    steps). The options are in ``attrs``.
    """
    f = check_options(history, algo, margin, fmt)
    rows = _check_frame(frame)
    bins = exponent_bins(rows.columns)
    if rows.empty:
        out = _empty_output()
        out.attrs.update(history=int(history), algo=algo, margin=margin, fmt=f.name)
        return out
    step = rows["step"].to_numpy().astype(np.int64)
    starts = np.flatnonzero(np.r_[True, step[1:] != step[:-1]])
    absmax = rows["absmax"].to_numpy(np.float64)
    data_scale = rows["scale"].to_numpy(np.float64)
    value = absmax * data_scale
    with np.errstate(invalid="ignore"):
        amax = np.fmax.reduceat(value, starts)
    first = np.zeros(1, np.int64)
    r = replay(amax, first, history=int(history), algo=algo, margin=margin, fmt_max=f.max)
    exact_zero = amax <= r.threshold
    if bins is None:
        cmin = cmax = np.where(exact_zero, 0.0, np.nan)
    else:
        columns, lower, upper = bins
        counts = rows[columns].to_numpy(np.float64)
        per_row = np.repeat(r.threshold, np.diff(np.r_[starts, len(rows)]))
        sure, possible = clipped_counts(counts, lower, upper, data_scale, per_row)
        total = np.add.reduceat(counts.sum(axis=1), starts)
        with np.errstate(divide="ignore", invalid="ignore"):
            total = np.where(total > 0, total, np.nan)
            cmin = np.where(exact_zero, 0.0, np.add.reduceat(sure, starts) / total)
            cmax = np.where(exact_zero, 0.0, np.add.reduceat(possible, starts) / total)
    with np.errstate(divide="ignore", invalid="ignore"):
        headroom = np.log2(r.threshold / amax)
    steps = step[starts]
    out = pd.DataFrame(
        {
            "step": steps,
            "amax": amax,
            "amax_ref": r.amax_ref,
            "scale": r.scale,
            "threshold": r.threshold,
            "clipped_min": cmin,
            "clipped_max": cmax,
            "headroom_log2": headroom,
            "gap": np.r_[np.nan, np.diff(steps).astype(np.float64)],
        }
    )
    out.attrs.update(history=int(history), algo=algo, margin=margin, fmt=f.name)
    return out


def delayed_scaling_run(
    reader: Any,
    op: int | str,
    history: int = 1024,
    algo: str = "max",
    margin: float = 0,
    fmt: str = "e4m3",
    process: int | None = 0,
    iteration: int | None = None,
) -> pd.DataFrame:
    """`delayed_scaling` of one op of a recorded run (``reader``: a `scalescope.open_run`
    reader; ``op``: an id or ``pass/name``), from its recorded abs-max, scale and exponent
    histogram (`scalescope.store.RunReader.op_rows`). The history holds recorded steps
    only (``every=10``: every 10th step; the ``gap`` column).

    ``iteration``: rows of that loop iteration only (e.g. one layer of a scan over
    layers, which would own its FP8 history); None: the iterations of a step share one
    history (their amax is the max, their clipped counts add up). ``process``: rows of
    that JAX process (None: all, treated like iterations). ``attrs`` add the op id and
    its ``pass/name`` label."""
    check_options(history, algo, margin, fmt)
    op_id = reader.op_id(op)
    rows = reader.op_rows(op, process=process, iteration=iteration)
    out = delayed_scaling(rows, history=history, algo=algo, margin=margin, fmt=fmt)
    rec = reader.ops.loc[op_id]
    out.attrs.update(op=op_id, label=f"{rec['pass']}/{rec['name']}")
    return out


# -- many ops (the advisor) --------------------------------------------------------------


def value_columns(
    stats: pd.DataFrame, exp_range: tuple[int, int] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of a wide statistics frame: the value amax (``absmax * scale``), the
    lower bound of the histogram bin holding it in value units (`binade_floor`), and
    whether the op ran (``count != 0``; all True without a ``count`` column). Rows that
    did not run give NaN amax and bound (a max over loop iterations skips them)."""
    data_scale = stats["scale"].to_numpy(np.float64)
    absmax = stats["absmax"].to_numpy(np.float64)
    value = absmax * data_scale
    floor = binade_floor(absmax, exp_range) * data_scale
    if "count" in stats.columns:
        ran = stats["count"].fillna(0).to_numpy() != 0
    else:
        ran = np.ones(len(stats), bool)
    return np.where(ran, value, np.nan), np.where(ran, floor, np.nan), ran


def group_starts(keys: Sequence[Any] | np.ndarray) -> np.ndarray:
    """First index of each run of equal consecutive ``keys``."""
    k = np.asarray(keys)
    return np.flatnonzero(np.r_[True, k[1:] != k[:-1]]) if len(k) else np.zeros(0, np.int64)
