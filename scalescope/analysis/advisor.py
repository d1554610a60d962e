"""The advisor: where is dynamic rescaling needed, and why.

`advise` turns a run's statistics into findings, one row per (op, rule, format):

- ``nonfinite`` (critical): any op with ``frac_nonfinite > thresholds.nonfinite``, except
  masks (the same fraction at every recorded step, see `Thresholds.mask_min_steps`);
- ``overflow`` (high), ``underflow`` and ``snr`` (medium): an op against each format it
  is checked against, i.e. its ``cast_to`` format (the format a later op rounds it to)
  plus every format in ``audit``;
- ``drift`` (medium): an op stored in a low-precision dtype (FP16/BF16/FP8) and scaled (a
  ScaledArray under scalify), or cast to a low-precision format, whose data RMS leaves
  unit scale: ``|log2 rms| > drift_log2`` (the
  static scale propagation lost track of it);
- ``trend`` (low): such an op, in bound at its last recorded step, whose least-squares
  fit of log2 rms over the recorded steps crosses ``±drift_log2`` before the horizon;
- ``delayed`` (low): a float op whose value amax grows faster than FP8 *delayed scaling*
  can follow: replayed with an amax history of ``delayed_history`` recorded steps
  (`scalescope.analysis.delayed`, algo ``max``, margin 0, the op's cast format or
  e4m3), its amax lands a whole binade above the history's max (``clipped_min > 0``:
  elements clip for sure) and more than ``2**delayed_log2`` times above it, at some
  recorded step once the history holds an amax (clipping at the initial scale 1 is the
  overflow rule's business).

Each finding carries one readable sentence of evidence and a one-line fix (for
``delayed``: a shorter history, ``most_recent``, current scaling or dynamic rescaling):
``ss.ops.dynamic_rescale_l2`` after a forward (or optimizer) value,
``ss.ops.dynamic_rescale_l2_grad`` before the forward value whose gradient is a backward
value, or, for a run not under scalify (naive low-precision casts), running the step
under scalify.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from . import delayed
from .frames import (
    check_stats,
    format_list,
    op_labels,
    op_table,
    recorded_formats,
    recorded_recipes,
    require_columns,
)

# SNR (dB) of each format on N(0, 1) data, measured once with numpy + ml_dtypes
# (4M samples, round-to-nearest-even cast, SNR = 10 log10(sum x^2 / sum (x - q(x))^2)):
#   e4m3 31.5, e5m2 25.5, fp16 73.7, bf16 55.6
# which is 6.02 * mantissa_bits + 13.5 dB to 0.1 dB (fp32: 151.9 by that rule).
# The default threshold is 6 dB (one bit of mantissa) under that: a value which loses
# more than a bit to its format, compared with well-scaled Gaussian data, is flagged.
# A block-scaled recipe is held to its element format's threshold; E2M1 (FP4) follows
# the same rule, 6.02 + 13.5 - 6 = 13.5 dB: the probe measures mxfp4 18.8 dB and nvfp4
# 20.4 dB on N(0, 1) data (1024 x 1024, blocks along the last axis), 19.5 by the rule.
SNR_GAUSSIAN_DB: dict[str, float] = {"e4m3": 31.5, "e5m2": 25.5, "fp16": 73.7, "bf16": 55.6}
SNR_MARGIN_DB = 6.0
DEFAULT_SNR_DB: dict[str, float] = {
    "e4m3": 25.5,
    "e5m2": 19.5,
    "fp16": 67.5,
    "bf16": 49.5,
    "fp32": 145.5,
}

RULES = ("nonfinite", "overflow", "underflow", "snr", "drift", "trend", "delayed")
SEVERITY = {
    "nonfinite": "critical",
    "overflow": "high",
    "underflow": "medium",
    "snr": "medium",
    "drift": "medium",
    "trend": "low",
    "delayed": "low",
}
SEVERITY_ORDER = ("critical", "high", "medium", "low")
FINDING_COLUMNS = [
    "op",
    "label",
    "name",
    "pass",
    "primitive",
    "source",
    "rule",
    "format",
    "first_step",
    "steps",
    "value",
    "threshold",
    "evidence",
    "severity",
    "fix",
]


def snr_from_mantissa(mantissa_bits: int) -> float:
    """Default SNR threshold (dB) for a format with ``mantissa_bits`` explicit mantissa
    bits: its SNR on N(0, 1) data (6.02 m + 13.5 dB) minus `SNR_MARGIN_DB`."""
    return round(6.02 * mantissa_bits + 13.5 - SNR_MARGIN_DB, 1)


@dataclass(frozen=True)
class Thresholds:
    """Limits of the advisor's rules (and of the format what-if).

    ``drift_log2``: bound on ``|log2 rms|`` of the data of scaled or cast ops.
    ``underflow``: largest tolerated fraction of non-zero values flushed to zero.
    ``overflow``: largest tolerated fraction of values above the format's max (0: any
    overflow is flagged). ``snr_db``: lowest tolerated SNR per format (see
    `DEFAULT_SNR_DB`; formats not listed use `snr_from_mantissa`).
    ``nonfinite``: largest tolerated fraction of NaN/inf (0: any).
    ``recipe_overflow``: largest tolerated fraction of elements a block-scaled recipe
    clips (``overflow_R``; default 1e-4). Not 0: a recipe with an FP32 scale
    (``e4m3_tensor``, NVFP4's tensor factor) can put an abs-max a float32 rounding above
    the element max, which saturates harmlessly but counts as overflow. Recipes clip by
    design (the OCP MX rule ~0.9 % of Gaussian elements, NVFP4's rounded block scales
    ~3.5 %): raise it (to 1 to let ``snr_R`` alone judge clipping) to accept that.
    ``trend_min_points``: fewest recorded steps a trend fit uses;
    ``trend_min_r2``: the fit must explain at least this share of the variance, so a
    flat but noisy op near the bound is not projected out of it.
    ``mask_min_steps``: an op holding the same fraction (< 1) of non-finite values at every
    one of at least this many recorded steps is a mask by construction (``-inf`` logits
    of a causal mask before a softmax), not a failure: the nonfinite rule skips it. A
    value that went bad changes from step to step or is entirely NaN.
    ``delayed_history``: length (in recorded steps) of the amax history of the
    delayed-scaling replay behind the ``delayed`` rule (TE's default is 1024 steps).
    ``delayed_log2``: the rule also needs the amax to exceed the replayed threshold by more
    than this many binades (default 0.5: x1.41). A stationary op whose amax sets a new
    record by a few percent across a power of two clips a handful of elements by a few
    percent; 0 flags that too.
    """

    drift_log2: float = 4.0
    underflow: float = 0.01
    overflow: float = 0.0
    snr_db: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_SNR_DB))
    nonfinite: float = 0.0
    trend_min_points: int = 4
    trend_min_r2: float = 0.5
    mask_min_steps: int = 3
    delayed_history: int = 1024
    delayed_log2: float = 0.5
    recipe_overflow: float = 1e-4

    def __post_init__(self) -> None:
        names = (
            "drift_log2",
            "underflow",
            "overflow",
            "nonfinite",
            "trend_min_r2",
            "delayed_log2",
            "recipe_overflow",
        )
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value >= 0:
                raise ValueError(f"Thresholds.{name}: expected a number >= 0, got {value!r}")
        for name in ("underflow", "overflow", "nonfinite", "recipe_overflow"):
            if getattr(self, name) > 1:
                raise ValueError(
                    f"Thresholds.{name}: a fraction in [0, 1], got {getattr(self, name)}"
                )
        if not isinstance(self.mask_min_steps, int) or self.mask_min_steps < 2:
            raise ValueError(
                f"Thresholds.mask_min_steps: expected an int >= 2, got {self.mask_min_steps!r}"
            )
        if not isinstance(self.trend_min_points, int) or self.trend_min_points < 2:
            raise ValueError(
                f"Thresholds.trend_min_points: expected an int >= 2, got {self.trend_min_points!r}"
            )
        history = self.delayed_history
        if isinstance(history, bool) or not isinstance(history, int) or history < 1:
            raise ValueError(f"Thresholds.delayed_history: expected an int >= 1, got {history!r}")
        if not isinstance(self.snr_db, Mapping):
            raise TypeError(f"Thresholds.snr_db: expected a mapping, got {self.snr_db!r}")
        # A partial mapping overrides the defaults for the formats it names.
        object.__setattr__(self, "snr_db", {**DEFAULT_SNR_DB, **dict(self.snr_db)})

    def snr_for(self, fmt: str, meta: Mapping[str, Any] | None = None) -> float:
        """SNR threshold of format ``fmt``: `snr_db`, else derived from its mantissa bits
        (from ``meta["format_info"]`` or scalescope's format table). A block-scaled recipe
        (``"nvfp4"``) takes its own `snr_db` entry, else its element format's threshold
        (``e2m1``: derived, 13.5 dB)."""
        if fmt in self.snr_db:
            return float(self.snr_db[fmt])
        element = recipe_element(fmt)
        if element is not None:
            if element.name in self.snr_db:
                return float(self.snr_db[element.name])
            return snr_from_mantissa(element.mantissa_bits)
        bits = _format_info(fmt, meta).get("mantissa_bits")
        if bits is None:
            raise KeyError(
                f"Thresholds.snr_db: no threshold for format {fmt!r} and its mantissa "
                "bits are unknown; add it to snr_db"
            )
        return snr_from_mantissa(int(bits))

    def overflow_for(self, name: str) -> float:
        """Tolerated overflow fraction: `recipe_overflow` for a block-scaled recipe,
        `overflow` for a format."""
        return self.recipe_overflow if recipe_element(name) is not None else self.overflow


def recipe_element(name: str) -> Any:
    """The element `Format` of block-scaled recipe ``name``, None when it is not one."""
    from ..core import recipes  # local: the advisor works on frames alone

    return recipes.get(name).element if recipes.is_recipe(name) else None


def _format_info(fmt: str, meta: Mapping[str, Any] | None) -> dict[str, Any]:
    """Limits of a format: the run's ``format_info`` or scalescope's own table."""
    info = ((meta or {}).get("format_info") or {}).get(fmt)
    if info:
        return dict(info)
    from ..core import formats  # local: the advisor works on frames alone

    try:
        f = formats.get(fmt)
    except (KeyError, ValueError, TypeError):
        return {}
    return {"max": f.max, "min_subnormal": f.min_subnormal, "mantissa_bits": f.mantissa_bits}


# -- formatting --------------------------------------------------------------------------


def pct(fraction: float) -> str:
    """A fraction as a short percentage: ``0.003 -> '0.3%'``, ``2e-6 -> '0.0002%'``."""
    value = 100.0 * float(fraction)
    if value == 0 or value >= 0.1:
        return f"{value:.1f}%"
    return f"{value:.2g}%"


def _num(value: float) -> str:
    return f"{value:.3g}"


def _signed(value: float) -> str:
    return f"{value:+.1f}"


def _steps_text(k: int, n: int, first: int) -> str:
    if n == 1:
        return f"at step {first}, the only recorded step"
    return f"at {k} of {n} recorded steps (first at step {first})"


# -- per-step view -----------------------------------------------------------------------


def _per_step(
    stats: pd.DataFrame, columns: dict[str, str], extra: Mapping[str, np.ndarray] | None = None
) -> pd.DataFrame:
    """Rows aggregated over loop iterations per (op, step): ``columns`` maps a column to
    ``max``/``min`` (NaN skipped) or ``abs`` (the value of larger magnitude). Index:
    ``(op, step)``, sorted. The groups are found once for every column (sorted keys and
    `numpy.ufunc.reduceat`): a run of thousands of ops x steps is a few array passes.
    ``extra``: more columns, aligned with ``stats``'s rows (no copy of ``stats``)."""
    extra = extra or {}
    op = stats["op"].to_numpy(np.int64)
    step = stats["step"].to_numpy(np.int64)
    if len(step) and (step[1:] >= step[:-1]).all():  # as read: by step, then op
        order = np.argsort(op, kind="stable")  # the same order, one key to sort
    else:
        order = np.lexsort((step, op))
    op, step = op[order], step[order]
    starts = np.flatnonzero(np.r_[True, (op[1:] != op[:-1]) | (step[1:] != step[:-1])])
    one_row_each = len(starts) == len(op)
    out = {}
    for col, how in columns.items():
        values = np.asarray(extra[col] if col in extra else stats[col], np.float64)[order]
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
    index = pd.MultiIndex.from_arrays([op[starts], step[starts]], names=["op", "step"])
    return pd.DataFrame(out, index=index)


def _hits(values: pd.Series, mask: pd.Series, worst: str) -> pd.DataFrame:
    """Per op, over the (op, step) rows where ``mask`` holds: first step, number of
    steps, worst value (``max``/``min``/``abs``) and the step it was reached."""
    held = values[mask.fillna(False).astype(bool)]
    if held.empty:
        return pd.DataFrame(columns=["first_step", "steps", "value", "worst_step"])
    steps = held.index.get_level_values("step").to_numpy()
    ops = held.index.get_level_values("op").to_numpy()
    key = held.to_numpy(np.float64)
    key = {"max": key, "min": -key, "abs": np.abs(key)}[worst]
    frame = pd.DataFrame({"op": ops, "step": steps, "value": held.to_numpy(), "key": key})
    frame = frame.sort_values(["op", "key", "step"], ascending=[True, False, True])
    best = frame.drop_duplicates("op").set_index("op")
    grouped = frame.groupby("op")["step"]
    return pd.DataFrame(
        {
            "first_step": grouped.min(),
            "steps": grouped.size(),
            "value": best["value"],
            "worst_step": best["step"],
        }
    )


def _hit_rows(hits: pd.DataFrame):
    """``(op, first_step, steps, value, worst_step)`` per row of `_hits`, as Python
    scalars (a loop over thousands of findings without a Series per row)."""
    return zip(
        hits.index.tolist(),
        hits["first_step"].astype(np.int64).tolist(),
        hits["steps"].astype(np.int64).tolist(),
        hits["value"].astype(np.float64).tolist(),
        hits["worst_step"].astype(np.int64).tolist(),
    )


# -- fixes -------------------------------------------------------------------------------

# dtype of an op -> the low-precision format it is stored in (named in a fix without one)
_LOW_PRECISION = {
    "float8_e4m3fn": "e4m3",
    "float8_e5m2": "e5m2",
    "float16": "fp16",
    "bfloat16": "bf16",
}


def _where(op: Mapping[str, Any]) -> str:
    source = str(op["source"])
    return source if source and not source.startswith("<") else str(op["label"])


def fix_line(op: Mapping[str, Any], fmt: str, scalified: bool) -> str:
    """The one-line fix for a finding on ``op`` (a row of the op table with a ``label``).

    Under scalify: ``dynamic_rescale_l2`` after a forward/optimizer value; for a backward
    value, ``dynamic_rescale_l2_grad`` on the forward value whose gradient it is (so
    *before* the source line that produced it). Without scalify (naive casts): run the
    step under scalify."""
    where = _where(op)
    if not scalified:
        what = f"naive {fmt} casts" if fmt else "naive low-precision casts"
        return (
            f"run.track(step, scalify=True)  # scale-propagated casts instead of {what} at {where}"
        )
    if op["pass"] == "bwd":
        return f"x = ss.ops.dynamic_rescale_l2_grad(x)  # before {where}"
    return f"x = ss.ops.dynamic_rescale_l2(x)  # after {where}"


def delayed_fix_line(op: Mapping[str, Any], history: int, scalified: bool) -> str:
    """The one-line fix for a ``delayed`` finding on ``op``: an amax history shorter than
    ``history`` or ``most_recent``, per-tensor current scaling (the ``e4m3_tensor``
    recipe: the scale from this step's amax), or dynamic rescaling of the value (under
    scalify: ``dynamic_rescale_l2``; otherwise, scalify first)."""
    recipe = (
        f"amax history < {history} or algo='most_recent', or current scaling (e4m3_tensor recipe)"
    )
    if scalified:
        return f"{recipe}, or {fix_line(op, '', True)}"
    return f"{recipe}, or dynamic rescaling under run.track(step, scalify=True)  # at {_where(op)}"


# -- the rules ---------------------------------------------------------------------------


def _format_findings(
    per_step: pd.DataFrame,
    checked: dict[str, np.ndarray],
    thresholds: Thresholds,
    meta: Mapping[str, Any] | None,
    n_steps: pd.Series,
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    ops_level = per_step.index.get_level_values("op")
    for fmt, ids in checked.items():
        sel = per_step[np.isin(ops_level, ids)]
        info = _format_info(fmt, meta)
        limit = info.get("max")
        tiny = info.get("min_subnormal")
        snr_thr = thresholds.snr_for(fmt, meta)
        over = thresholds.overflow_for(fmt)
        rules = (
            ("overflow", f"overflow_{fmt}", "max", over, lambda v, t: v > t),
            ("underflow", f"underflow_{fmt}", "max", thresholds.underflow, lambda v, t: v > t),
            ("snr", f"snr_{fmt}", "min", snr_thr, lambda v, t: v < t),
        )
        for rule, col, worst, thr, test in rules:
            values = sel[col]
            hits = _hits(values, test(values, thr), worst)
            for op, first, k, v, at in _hit_rows(hits):
                n = int(n_steps[op])
                if rule == "overflow":
                    bound = f" (|x| > {_num(limit)})" if limit else ""
                    text = f"{pct(v)} of values overflow {fmt}{bound} at step {at}"
                elif rule == "underflow":
                    bound = f" (|x| < {_num(tiny)})" if tiny else ""
                    text = f"{pct(v)} of non-zero values flush to zero in {fmt}{bound} at step {at}"
                else:
                    text = f"SNR in {fmt} falls to {v:.1f} dB (threshold {thr:g} dB) at step {at}"
                rows.append(
                    dict(
                        op=op,
                        rule=rule,
                        format=fmt,
                        first_step=first,
                        steps=k,
                        value=v,
                        threshold=float(thr),
                        evidence=f"{text}; {_steps_text(k, n, first)}.",
                    )
                )
    return rows


def _masks(values: pd.Series, min_steps: int) -> np.ndarray:
    """Ops whose non-finite fraction is the same, non-zero and below 1, at every recorded
    step (at least ``min_steps`` of them): masks, see `Thresholds.mask_min_steps`."""
    by_op = values.groupby(level="op")
    lo, hi, n = by_op.min(), by_op.max(), by_op.size()
    steady = (n >= min_steps) & (lo > 0) & (hi < 1) & ((hi - lo) <= 1e-12)
    return steady.index.to_numpy()[steady.to_numpy()]


def _nonfinite_findings(
    per_step: pd.DataFrame, thresholds: Thresholds, n_steps: pd.Series, labels: pd.Series
) -> list[dict[str, Any]]:
    values = per_step["frac_nonfinite"]
    masks = _masks(values, thresholds.mask_min_steps)
    if len(masks):
        values = values[~values.index.get_level_values("op").isin(masks)]
    hits = _hits(values, values > thresholds.nonfinite, "max")
    if hits.empty:
        return []
    origin = hits.sort_values(["first_step"], kind="stable").index[0]
    origin_step = int(hits.loc[origin, "first_step"])
    rows = []
    for op, first, k, v, at in _hit_rows(hits):
        n = int(n_steps[op])
        text = f"{pct(v)} of values are NaN/inf at step {at}"
        if op == origin:
            tail = "the earliest op with non-finite values"
        else:
            tail = (
                f"the earliest op with non-finite values is {labels[origin]} (step {origin_step})"
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
            )
        )
    return rows


def _drift_findings(
    log2_rms: pd.Series, thresholds: Thresholds, n_steps: pd.Series
) -> list[dict[str, Any]]:
    bound = thresholds.drift_log2
    hits = _hits(log2_rms, log2_rms.abs() > bound, "abs")
    rows = []
    for op, first, k, v, at in _hit_rows(hits):
        n = int(n_steps[op])
        text = (
            f"log2 rms of the data reaches {_signed(v)} (rms {_num(2.0**v)}) at step "
            f"{at}, beyond ±{bound:g}"
        )
        rows.append(
            dict(
                op=op,
                rule="drift",
                format="",
                first_step=first,
                steps=k,
                value=v,
                threshold=float(bound),
                evidence=f"{text}; {_steps_text(k, n, first)}.",
            )
        )
    return rows


def _trend_findings(
    log2_rms: pd.Series, thresholds: Thresholds, horizon: float
) -> list[dict[str, Any]]:
    """Least-squares line of log2 rms against step, per op (finite points only)."""
    bound = thresholds.drift_log2
    finite = log2_rms[np.isfinite(log2_rms.to_numpy())]
    if finite.empty:
        return []
    ops = finite.index.get_level_values("op").to_numpy()
    x = finite.index.get_level_values("step").to_numpy(np.float64)
    y = finite.to_numpy(np.float64)
    # last value of each op over *all* its steps (an op drifting now is not "in bound")
    all_ops = log2_rms.index.get_level_values("op").to_numpy()
    is_last = np.r_[all_ops[1:] != all_ops[:-1], True] if len(all_ops) else np.ones(0, bool)
    last = pd.Series(log2_rms.to_numpy()[is_last], index=all_ops[is_last])
    # One least-squares fit per op, vectorised: rows are sorted by (op, step) (`_per_step`).
    uniq, starts, counts = np.unique(ops, return_index=True, return_counts=True)
    codes = np.repeat(np.arange(len(uniq)), counts)
    xm = np.bincount(codes, weights=x) / counts
    ym = np.bincount(codes, weights=y) / counts
    dx, dy = x - xm[codes], y - ym[codes]
    sxx = np.bincount(codes, weights=dx * dx)
    syy = np.bincount(codes, weights=dy * dy)
    sxy = np.bincount(codes, weights=dx * dy)
    ends = starts + counts - 1
    rows = []
    for k, op in enumerate(uniq):
        if counts[k] < thresholds.trend_min_points or not horizon > x[ends[k]]:
            continue
        if not abs(last[op]) <= bound:
            continue
        if sxx[k] == 0 or syy[k] == 0:
            continue
        slope = sxy[k] / sxx[k]
        r2 = slope**2 * sxx[k] / syy[k]
        projected = ym[k] + slope * (horizon - xm[k])
        if abs(projected) <= bound or r2 < thresholds.trend_min_r2:
            continue
        target = math.copysign(bound, projected)
        cross = xm[k] + (target - ym[k]) / slope
        xs = x[starts[k] : ends[k] + 1]
        ys = y[starts[k] : ends[k] + 1]
        text = (
            f"log2 rms of the data moves {slope:+.3g}/step (from {_signed(ys[0])} at step "
            f"{int(xs[0])} to {_signed(ys[-1])} at step {int(xs[-1])}, R² {r2:.2f}); the fit "
            f"crosses {target:+g} at step ~{int(round(cross))} and reaches "
            f"{_signed(projected)} at the horizon (step {int(horizon)})"
        )
        rows.append(
            dict(
                op=int(op),
                rule="trend",
                format="",
                first_step=int(xs[0]),
                steps=int(len(xs)),
                value=float(projected),
                threshold=float(target),
                evidence=text + ".",
            )
        )
    return rows


def _steps_list(steps: np.ndarray, most: int = 5) -> str:
    shown = ", ".join(str(int(s)) for s in steps[:most])
    return f"steps {shown}" + (", …" if len(steps) > most else "")


def _delayed_text(
    amax: np.ndarray, step: np.ndarray, r: delayed.Replay, hit: np.ndarray, fmt: str, history: int
) -> tuple[str, int, float]:
    """Evidence of the ``delayed`` rule for one op's replayed rows: the worst step (amax
    furthest above the threshold), the steps that clip, the growth per recorded step and
    the recording gap. Returns ``(text, worst step, log2(amax / threshold) there)``."""
    with np.errstate(divide="ignore", invalid="ignore"):
        over = np.log2(amax / r.threshold)
        ratios = amax[1:] / amax[:-1]
    w = int(np.flatnonzero(hit)[np.argmax(over[hit])])
    hits = step[hit]
    growth = ratios[np.isfinite(ratios) & (ratios > 0)]
    grows = (
        f"; amax grows ×{np.median(growth):.3g} per recorded step (median)" if len(growth) else ""
    )
    gap = float(np.median(np.diff(step)))
    gap_text = (
        f", recorded every {gap:g} steps: the history spans ~{history * gap:g} training steps"
        if gap > 1
        else ""
    )
    text = (
        f"value amax {_num(amax[w])} at step {int(step[w])} is ×{_num(2.0 ** over[w])} the "
        f"delayed-scaling threshold {_num(r.threshold[w])} (max amax of the previous "
        f"{min(history, w)} recorded steps, history={history}); a whole binade above it "
        f"clips in {fmt} at {len(hits)} of {len(step)} recorded steps ({_steps_list(hits)})"
        f"{grows}{gap_text}."
    )
    return text, int(step[w]), float(over[w])


def _delayed_findings(
    per_step: pd.DataFrame, fmt_of: pd.Series, thresholds: Thresholds
) -> list[dict[str, Any]]:
    """The ``delayed`` rule: one vectorised replay (`delayed.replay`) over every op of
    ``fmt_of`` (op id -> format name) with at least two recorded steps where it ran;
    Python only for the ops that clip."""
    op = per_step.index.get_level_values("op").to_numpy(np.int64)
    keep = np.isin(op, fmt_of.index.to_numpy()) & (per_step["_ran"].to_numpy() > 0)
    starts = delayed.group_starts(op[keep])
    sizes = np.diff(np.r_[starts, np.count_nonzero(keep)])
    keep[keep] = np.repeat(sizes >= 2, sizes)  # at least two recorded steps
    if not keep.any():
        return []
    op = op[keep]
    step = per_step.index.get_level_values("step").to_numpy(np.int64)[keep]
    amax = per_step["_amax"].to_numpy(np.float64)[keep]
    floor = per_step["_floor"].to_numpy(np.float64)[keep]
    starts = delayed.group_starts(op)
    ids = op[starts]
    names = fmt_of.reindex(ids).to_numpy()
    maxima = {f: float(_format_info(f, None)["max"]) for f in fmt_of.unique()}
    sizes = np.diff(np.r_[starts, len(op)])
    fmt_max = np.repeat(pd.Series(names).map(maxima).to_numpy(np.float64), sizes)
    history = thresholds.delayed_history
    r = delayed.replay(amax, starts, history=history, algo="max", margin=0, fmt_max=fmt_max)
    with np.errstate(divide="ignore", invalid="ignore"):
        sure = floor > r.threshold  # clipped_min > 0
        far = np.log2(amax / r.threshold) > thresholds.delayed_log2
    hit = r.from_history & sure & far
    rows = []
    for g in np.unique(np.searchsorted(starts, np.flatnonzero(hit), side="right") - 1):
        a, b = starts[g], starts[g] + sizes[g]
        part = delayed.Replay(*(v[a:b] for v in r))
        text, _, over = _delayed_text(amax[a:b], step[a:b], part, hit[a:b], names[g], history)
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
            )
        )
    return rows


def _delayed_formats(info: pd.DataFrame) -> pd.Series:
    """Float ops (by op-table dtype; unknown dtype counts as float) -> the format their
    delayed scaling is replayed in: the op's cast format when scalescope knows it, else
    e4m3."""
    dtype = info["dtype"].astype(str)
    floats = info[(dtype == "") | dtype.str.contains("float")]
    cast = floats["cast_to"].astype(str)
    known = cast.map(lambda f: bool(f) and "max" in _format_info(f, None))
    return cast.where(known, "e4m3")


# -- entry points ------------------------------------------------------------------------


def _empty_findings() -> pd.DataFrame:
    frame = pd.DataFrame({c: pd.Series(dtype=object) for c in FINDING_COLUMNS})
    return frame.astype({"op": np.int64, "first_step": np.int64, "steps": np.int64}).astype(
        {"value": np.float64, "threshold": np.float64}
    )


def _default_horizon(meta: Mapping[str, Any] | None, last_step: int) -> float:
    steps = ((meta or {}).get("config") or {}).get("steps")
    if isinstance(steps, int | float) and not isinstance(steps, bool) and steps > 0:
        return float(steps)
    return float(last_step * 2)


def advise(
    stats: pd.DataFrame,
    ops: pd.DataFrame,
    *,
    meta: Mapping[str, Any] | None = None,
    audit: str | Sequence[str] = (),
    thresholds: Thresholds | None = None,
    horizon: int | float | None = None,
) -> pd.DataFrame:
    """Findings of the advisor (see the module docstring for the rules), one row per
    (op, rule, format), sorted by severity, then first step, then op.

    ``stats``: wide statistics frame; ``ops``: the op table; ``meta``: the run's metadata
    (``graph.scalify`` picks the fix, ``config.steps`` the default horizon, ``format_info``
    the limits quoted in the evidence); ``audit``: formats every op is also checked
    against (recorded block-scaled recipes too: their overflow rule tolerates
    ``thresholds.recipe_overflow``, their SNR threshold is their element format's; flushed
    blocks are the format what-if's business); ``horizon``: the step trends are projected
    to (default ``config.steps``, else twice the last recorded step).

    Columns: op, label, name, pass, primitive, source, rule, format ("" for nonfinite,
    drift, trend and delayed), first_step (first recorded step where the rule holds; for
    trend the first fitted step), steps (recorded steps where it holds; for trend the
    fitted points), value (worst: max fraction, min SNR dB, log2 rms of larger magnitude; for
    trend the projected log2 rms at the horizon; for delayed the largest log2(value amax
    / delayed-scaling threshold)), threshold (for trend the signed bound crossed; 0 for
    delayed), evidence, severity, fix. The delayed rule needs ``absmax`` and ``scale``
    columns (skipped without them) and reads the histogram range from
    ``meta["hist_columns"]``.

    Values NaN in a statistic (no finite element) never trigger overflow, underflow,
    snr or drift: the nonfinite rule reports them. An all-zero value (rms 0) has no scale
    to drift from and is skipped by drift and trend.
    """
    thresholds = Thresholds() if thresholds is None else thresholds
    if not isinstance(thresholds, Thresholds):
        raise TypeError(f"thresholds: expected a Thresholds, got {type(thresholds).__name__}")
    stats = check_stats(stats)
    require = ["frac_nonfinite", "rms"]
    missing = [c for c in require if c not in stats.columns]
    if missing:
        raise KeyError(f"stats: missing column(s) {missing} the advisor needs")
    table = op_table(ops)
    unknown = np.setdiff1d(stats["op"].unique(), table.index.to_numpy())
    if len(unknown):
        raise KeyError(f"ops: op id {int(unknown[0])} appears in stats but not in ops")
    audit_list = list([audit] if isinstance(audit, str) else audit)
    audit_formats = format_list(audit_list, stats, "audit", recipes=True)
    if horizon is not None and (isinstance(horizon, bool) or not isinstance(horizon, int | float)):
        raise TypeError(f"horizon: expected a step number, got {horizon!r}")
    if stats.empty:
        return _empty_findings()

    known = recorded_formats(stats) + recorded_recipes(stats)
    in_stats = np.unique(stats["op"].to_numpy(np.int64))
    info = table.loc[in_stats]
    checked: dict[str, np.ndarray] = {}
    for fmt in known:
        mask = (info["cast_to"] == fmt).to_numpy() | (fmt in audit_formats)
        if mask.any():
            checked[fmt] = info.index.to_numpy()[mask]

    columns = {"frac_nonfinite": "max"}
    for fmt in checked:
        columns |= {f"overflow_{fmt}": "max", f"underflow_{fmt}": "max", f"snr_{fmt}": "min"}
    rms = stats["rms"].astype(np.float64).to_numpy()
    with np.errstate(divide="ignore", invalid="ignore"):
        l2 = np.log2(np.where(rms > 0, rms, np.nan))
    extra = {"log2_rms": l2}
    columns |= {"log2_rms": "abs"}
    replay_delayed = {"absmax", "scale"} <= set(stats.columns)
    if replay_delayed:  # value amax, its binade's floor, ran: maxima over iterations
        exp_range = delayed.hist_range((meta or {}).get("hist_columns"))
        amax, floor, ran = delayed.value_columns(stats, exp_range)
        extra |= {"_amax": amax, "_floor": floor, "_ran": ran.astype(np.float64)}
        columns |= {"_amax": "max", "_floor": "max", "_ran": "max"}
    per_step = _per_step(stats, columns, extra)
    n_steps = per_step.groupby(level="op").size()
    labels = op_labels(table)

    # Drift matters where the data is stored or cast in a narrow format: an FP32 value of
    # RMS 2^8 loses nothing, an FP16 or FP8 one heads for overflow or underflow.
    low = info["dtype"].astype(str).isin(list(_LOW_PRECISION)).to_numpy()
    drift_ops = info.index[
        (info["scaled"].to_numpy(bool) & low) | (info["cast_to"] != "").to_numpy()
    ]
    log2_rms = per_step["log2_rms"]
    log2_rms = log2_rms[log2_rms.index.get_level_values("op").isin(drift_ops)]
    last_step = int(stats["step"].max())
    horizon = _default_horizon(meta, last_step) if horizon is None else float(horizon)

    rows = _nonfinite_findings(per_step, thresholds, n_steps, labels)
    rows += _format_findings(per_step, checked, thresholds, meta, n_steps)
    rows += _drift_findings(log2_rms, thresholds, n_steps)
    rows += _trend_findings(log2_rms, thresholds, horizon)
    if replay_delayed:
        rows += _delayed_findings(per_step, _delayed_formats(info), thresholds)
    if not rows:
        return _empty_findings()
    return _finish(pd.DataFrame(rows), table, labels, meta, thresholds.delayed_history)


def _finish(
    found: pd.DataFrame,
    table: pd.DataFrame,
    labels: pd.Series,
    meta: Mapping[str, Any] | None,
    history: int = 1024,
) -> pd.DataFrame:
    """Add op details, severity and fix; sort."""
    run_scalified = bool(((meta or {}).get("graph") or {}).get("scalify", False))
    found["op"] = found["op"].astype(np.int64)
    rec = table.loc[found["op"]].assign(label=labels.reindex(found["op"]).to_numpy())
    rec.index = found.index
    for col in ("label", "name", "pass", "primitive", "source"):
        found[col] = rec[col].to_numpy()
    found["severity"] = found["rule"].map(SEVERITY)
    fixes = []
    for rule, fmt, op in zip(
        found["rule"].tolist(), found["format"].tolist(), rec.to_dict("records")
    ):
        fmt = fmt or str(op["cast_to"]) or _LOW_PRECISION.get(str(op["dtype"]), "")
        if rule == "delayed":
            fixes.append(delayed_fix_line(op, history, run_scalified or bool(op["scaled"])))
        else:
            fixes.append(fix_line(op, fmt, run_scalified or bool(op["scaled"])))
    found["fix"] = fixes
    found["_sev"] = found["severity"].map({s: i for i, s in enumerate(SEVERITY_ORDER)})
    found["_rule"] = found["rule"].map({r: i for i, r in enumerate(RULES)})
    found = found.sort_values(["_sev", "first_step", "op", "_rule", "format"], kind="stable")
    found = found[FINDING_COLUMNS].reset_index(drop=True)
    return found.astype({"op": np.int64, "first_step": np.int64, "steps": np.int64})


def advise_run(reader: Any, **kwargs: Any) -> pd.DataFrame:
    """`advise` over a recorded run (its statistics, op table and metadata)."""
    kwargs.setdefault("meta", reader.meta)
    return advise(reader.stats(wide=True), reader.ops, **kwargs)


def summary_by_rule(findings: pd.DataFrame) -> pd.DataFrame:
    """Findings counted per (rule, format): severity, findings, distinct ops, passes
    involved, first step, and the worst value (max fraction, min SNR, log2 rms of larger
    magnitude). Ordered by severity, then rule."""
    require_columns(findings, ("op", "rule", "format", "first_step", "value", "pass"), "findings")
    cols = ["rule", "format", "severity", "findings", "ops", "passes", "first_step", "worst"]
    if findings.empty:
        return pd.DataFrame(columns=cols)
    rows = []
    for (rule, fmt), g in findings.groupby(["rule", "format"], sort=False):
        values = g["value"].astype(np.float64)
        if rule == "snr":
            worst = values.min()
        elif rule in ("drift", "trend"):
            worst = values.iloc[int(np.argmax(values.abs().to_numpy()))]
        else:
            worst = values.max()
        rows.append(
            dict(
                rule=rule,
                format=fmt,
                severity=SEVERITY.get(rule, ""),
                findings=len(g),
                ops=g["op"].nunique(),
                passes=", ".join(dict.fromkeys(g["pass"])),
                first_step=int(g["first_step"].min()),
                worst=float(worst),
            )
        )
    out = pd.DataFrame(rows, columns=cols)
    sev = out["severity"].map({s: i for i, s in enumerate(SEVERITY_ORDER)}).fillna(len(SEVERITY))
    rule = out["rule"].map({r: i for i, r in enumerate(RULES)}).fillna(len(RULES))
    order = np.lexsort((out["format"].to_numpy(), rule.to_numpy(), sev.to_numpy()))
    return out.iloc[order].reset_index(drop=True)
