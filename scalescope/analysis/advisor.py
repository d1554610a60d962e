"""The advisor: where is dynamic rescaling needed, and why.

`advise` turns a run's statistics into findings, one row per (op, rule, format):

- ``nonfinite``: any op with ``frac_nonfinite > thresholds.nonfinite``, except masks (the
  same fraction at every recorded step, see `Thresholds.mask_min_steps`);
- ``overflow``, ``underflow`` and ``snr``: an op against each format it is checked
  against, i.e. its ``cast_to`` format (the format a later op rounds it to) plus every
  format in ``audit``;
- ``drift``: an op stored in a low-precision dtype (FP16/BF16/FP8) and scaled (a
  ScaledArray under scalify), or cast to a low-precision format, whose data RMS leaves
  the band of that format (`drift_bounds`: ``|log2 rms| > drift_log2`` for E4M3, the
  same margins from a wider format's own edges): the static scale propagation lost
  track of it;
- ``trend``: such an op, in its band at its last recorded step, whose least-squares fit
  of log2 rms over the recorded steps leaves the band before the horizon;
- ``delayed``: a value cast without a scale of its own (or, when a plain format is
  audited, any float op) whose value amax grows faster than FP8 *delayed scaling* can
  follow: replayed with an amax history of ``delayed_history`` recorded steps
  (`scalescope.analysis.delayed`, algo ``max``, margin 0, the op's cast format or the
  audited one), its amax lands a whole binade above the history's max
  (``clipped_min > 0``: elements clip for sure) and more than ``2**delayed_log2``
  times above it, at some recorded step once the history holds an amax (clipping at
  the initial scale 1 is the overflow rule's business).

Values constant by construction (`scalescope.analysis.relevance`: optimizer scalars from
the step count, mask fills) raise no drift, trend or delayed finding.

**Severity is graded by magnitude** (`severity_level`; the steps are `SEVERITY_STEPS`):

- ``nonfinite``: critical (NaN/inf outside a mask ends a training), unless it is dropped
  downstream: at every step it appears, the step's outputs (`output_ops`: parameters,
  optimizer state, loss) are recorded and finite (a where/select discards it, e.g. a
  schedule's unused branch at step 0 or an empty segment's -inf): low, impact 0;
- ``overflow`` of a format (a plain cast turns those elements into inf, or NaN in
  e4m3fn): high, critical from 1 % of the values (as broken as a NaN); medium at most
  when every overflowing element stays under the format's `rounding_edge` (they round
  to the max: no step is lost, but no headroom is left); of a block-scaled
  recipe (clipped elements saturate): low below 0.1 %, medium below 1 %, high from 1 %;
- ``underflow``: low below 2 % of the non-zero values flushed to zero, medium below
  25 %, high from 25 % (99 % of a backward value flushed in E5M2 is high);
- ``snr``: low less than 3 dB under the threshold, medium less than 12 dB under it,
  high from 12 dB under it (two more bits lost);
- ``drift``: low within 1 binade beyond ``±drift_log2``, medium within 4, high from 4
  binades beyond (``|log2 rms| >= 8`` by default: an FP8 value's headroom is gone);
- ``trend`` (a projection, never high): low, medium when the fit's rate takes the value
  4 binades or more beyond the bound by the horizon;
- ``delayed``: low when the value amax is less than 2 binades (x4) above the
  delayed-scaling threshold, medium below 4 binades (x16), high from there when it
  clips at two recorded steps or more (a single step, a warm-up transient: medium).

**Each finding carries one readable sentence of evidence and a one-line fix** naming the
op's source line (`fix_line`). Under scalify (or on a scaled op): drift and trend ->
``ss.ops.dynamic_rescale_l2`` after a forward (or optimizer) value,
``ss.ops.dynamic_rescale_l2_grad`` before the forward value whose gradient is a backward
value; overflow -> ``dynamic_rescale_max`` (``_max_grad``), which puts the abs-max, not
the RMS, at 1; underflow and SNR -> ``dynamic_rescale_l2`` when the value is off unit
scale where it fails, else a format with more range (underflow) or more mantissa (SNR),
or a block-scaled recipe (an underflow of a value whose ``dynamic_range`` is wider than
the format's span from max to smallest subnormal, `format_span`: a block-scaled recipe or
a format with more range, whatever the scaling); delayed -> a shorter amax history,
``most_recent``, current
scaling or ``dynamic_rescale_max``. Not under scalify (naive low-precision casts): run
the step under scalify, or cast with a block-scaled recipe: the cheapest recipe the
recorded recipe statistics show safe for that op (`scalescope.analysis.format_whatif`),
else a recipe suited to the failure (``e4m3_tensor`` for overflow, ``mxfp8_e4m3``
otherwise). ``nonfinite``: the earliest op with NaN/inf gets ``jax_debug_nans`` at its
line; later ones point to it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

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
from .relevance import constant_ops

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
#: The most severe grade each rule can reach (`severity_level` grades every finding by
#: its magnitude: `SEVERITY_STEPS`).
SEVERITY = {
    "nonfinite": "critical",
    "overflow": "critical",
    "underflow": "high",
    "snr": "high",
    "drift": "high",
    "trend": "medium",
    "delayed": "high",
}
#: Where a finding's severity steps up, per rule: the magnitude from which it is medium,
#: high and critical (below the first: low). Units: ``overflow`` (of a format;
#: ``overflow_recipe`` of a block-scaled recipe) and ``underflow``, the fraction of values
#: (the finding's ``value``); ``snr``, dB under the threshold; ``drift``, binades of
#: ``|log2 rms|`` beyond ``drift_log2``; ``trend``, binades beyond it projected at the
#: horizon; ``delayed``, binades of value amax above the delayed-scaling threshold.
#: ``nonfinite`` is always critical.
SEVERITY_STEPS: dict[str, tuple[float, float, float]] = {
    "overflow": (0.0, 0.0, 1e-2),
    "overflow_recipe": (1e-3, 1e-2, math.inf),
    # medium from 5 %, high from 75 % of the non-zero values flushed: in the labelled
    # corpus (benchmarks/bench_verdicts.py, docs/advisor.md) runs that trained as well as
    # fp32 flushed up to 59 % of a backward value, broken ones 77 % and more
    "underflow": (0.05, 0.75, math.inf),
    "snr": (3.0, 12.0, math.inf),
    "drift": (1.0, 4.0, math.inf),
    "trend": (4.0, math.inf, math.inf),
    "delayed": (2.0, 4.0, math.inf),
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
    "impact",
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

    ``drift_log2``: bound on ``|log2 rms|`` of the data of scaled or cast E4M3 ops;
    other formats get the same margins from their own edges (`drift_bounds`).
    ``underflow``: largest tolerated fraction of non-zero values flushed to zero.
    ``overflow``: largest tolerated fraction of values above the format's max (0: any
    overflow is flagged). ``snr_db``: lowest tolerated SNR per format (see
    `DEFAULT_SNR_DB`; formats not listed use `snr_from_mantissa`).
    ``nonfinite``: largest tolerated fraction of NaN/inf (0: any).
    Block-scaled recipes are judged by the noise they add (``snr_R``, which counts
    what they clip and flush), because that is what training answers to: MXFP8 with
    OCP FLOOR scales (which clips ~0.9 % of Gaussian elements by design), MXFP8 RCEIL and
    NVFP4 (~3.5 % clipped, ~20 dB) applied to every linear operand of a char transformer
    train within 1-2 % of fp32 (docs/advisor.md). ``recipe_snr_db``: lowest tolerated
    ``snr_R`` of any recipe (default 13.5 dB, the E2M1 threshold: NVFP4's noise on
    Gaussian data passes with margin); ``recipe_overflow``: largest tolerated fraction
    of clipped elements (default 1: clipping is judged through the SNR; lower it to
    hold a recipe to less clipping); ``recipe_underflow``: largest tolerated fraction of
    non-zero elements flushed to zero (default 0.75, the fraction of a gradient whose
    flush broke training in the verdict corpus).
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
    recipe_overflow: float = 1.0
    recipe_underflow: float = 0.75
    recipe_snr_db: float = 13.5

    def __post_init__(self) -> None:
        names = (
            "drift_log2",
            "underflow",
            "overflow",
            "nonfinite",
            "trend_min_r2",
            "delayed_log2",
            "recipe_overflow",
            "recipe_underflow",
            "recipe_snr_db",
        )
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value >= 0:
                raise ValueError(f"Thresholds.{name}: expected a number >= 0, got {value!r}")
        for name in ("underflow", "overflow", "nonfinite", "recipe_overflow", "recipe_underflow"):
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
        (``"nvfp4"``) takes its own `snr_db` entry, else `recipe_snr_db`."""
        if fmt in self.snr_db:
            return float(self.snr_db[fmt])
        if recipe_element(fmt) is not None:
            return float(self.recipe_snr_db)
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

    def underflow_for(self, name: str) -> float:
        """Tolerated underflow fraction: `recipe_underflow` for a block-scaled recipe,
        `underflow` for a format."""
        return self.recipe_underflow if recipe_element(name) is not None else self.underflow


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


# -- fixes -------------------------------------------------------------------------------

# dtype of an op -> the low-precision format it is stored in (named in a fix without one)
_LOW_PRECISION = {
    "float8_e4m3fn": "e4m3",
    "float8_e5m2": "e5m2",
    "float16": "fp16",
    "bfloat16": "bf16",
}
# a format -> the one to keep a value in when it needs more range (underflow at unit
# scale) or more mantissa (SNR at unit scale) than the format has
_MORE_RANGE = {"e4m3": "e5m2", "e5m2": "bf16", "fp16": "bf16", "bf16": "fp32"}
_MORE_MANTISSA = {"e5m2": "e4m3", "e4m3": "bf16", "bf16": "fp16", "fp16": "fp32"}
#: Recipe a naive-cast finding suggests when no recorded recipe statistics say better:
#: current (per-tensor) scaling against overflow, MX block scaling otherwise.
SUGGESTED_RECIPE = {"overflow": "e4m3_tensor"}
DEFAULT_RECIPE = "mxfp8_e4m3"
#: An op at least this many binades off unit scale (|log2 rms|) where an underflow or SNR
#: finding is worst is fixed by rescaling; closer to unit scale, rescaling cannot help.
RESCALE_LOG2 = 1.0


def _where(op: Mapping[str, Any]) -> str:
    source = str(op["source"])
    return source if source and not source.startswith("<") else str(op["label"])


def _rescale(op: Mapping[str, Any], kind: str) -> str:
    """``ss.ops.dynamic_rescale_<kind>`` after a forward/optimizer value, ``_<kind>_grad``
    before the forward value whose gradient a backward value is."""
    where = _where(op)
    if op["pass"] == "bwd":
        return f"x = ss.ops.dynamic_rescale_{kind}_grad(x)  # before {where}"
    return f"x = ss.ops.dynamic_rescale_{kind}(x)  # after {where}"


def _recipe_text(rule: str, recipe: str | None, recorded: Sequence[str] = ()) -> str:
    """``or <recipe>`` for a naive-cast fix: ``recipe`` when the recorded statistics show
    it safe for the op; "" when recipes (``recorded``) were recorded and none is safe;
    None when none was recorded: a suggestion."""
    if recipe:
        return f"; or the {recipe} recipe (safe for this op in the recorded statistics)"
    if recipe == "":
        names = ", ".join(recorded)
        return f" (no recorded recipe{' (' + names + ')' if names else ''} is safe for it)"
    name = SUGGESTED_RECIPE.get(rule, DEFAULT_RECIPE)
    return f'; or a block-scaled recipe such as {name} (record formats=("{name}",) to check it)'


def fix_line(
    op: Mapping[str, Any],
    fmt: str,
    scalified: bool,
    rule: str = "drift",
    *,
    recipe: str | None = None,
    log2_rms: float = math.nan,
    origin: Mapping[str, Any] | None = None,
    recorded: Sequence[str] = (),
    too_wide: bool = False,
) -> str:
    """The one-line fix for a ``rule`` finding on ``op`` (a row of the op table with a
    ``label``), naming the op's source line.

    An underflow of a value whose dynamic range is wider than the format's span
    (``too_wide``: `format_span`) is not fixed by any one scale, rescaled or not: a
    block-scaled recipe (per-block scales) or a format with more range.

    Under scalify (``scalified``: the run or the op): drift and trend,
    ``dynamic_rescale_l2`` after a forward/optimizer value, ``dynamic_rescale_l2_grad``
    for a backward value on the forward value whose gradient it is (so *before* the
    source line that produced it); overflow, ``dynamic_rescale_max`` (``_max_grad``);
    underflow and snr, the l2 rescale when the value is more than `RESCALE_LOG2` binades
    off unit scale where the rule is worst (``log2_rms``), else a format with more range
    (underflow) or more mantissa (snr) than ``fmt``, or a block-scaled recipe. Without
    scalify (naive casts): run the step under scalify, or use ``recipe`` (the cheapest
    recipe the recorded statistics show safe for the op; "": the recipes ``recorded``
    were, none is safe; None: none were recorded, a suitable one is suggested). ``nonfinite``: the
    earliest op with NaN/inf (``origin`` None) gets ``jax_debug_nans``; a later one
    (``origin``: the earliest op's row) points to it. A finding on a block-scaled recipe
    ``fmt`` names the recipe that would do better."""
    where = _where(op)
    if rule == "nonfinite":
        if origin is not None and origin["label"] != op["label"]:
            return f"fix the earliest op with NaN/inf first: {origin['label']} at {_where(origin)}"
        return f'jax.config.update("jax_debug_nans", True)  # stops at the first NaN: {where}'
    element = recipe_element(fmt) if fmt else None
    if element is not None:  # a block-scaled recipe's own failure
        if rule == "overflow":
            return f"a recipe whose block scales never clip, e.g. mxfp8_e4m3_rceil, at {where}"
        what = "smaller blocks or a wider element" if rule == "underflow" else "more mantissa"
        if recipe and recipe != fmt:
            return f"{what} than {fmt} at {where}: the {recipe} recipe is safe for it"
        better = "fp8_block128" if rule == "underflow" else "mxfp8_e4m3"
        if better == fmt or (better == "mxfp8_e4m3" and element.mantissa_bits >= 3):
            better = "bf16"
        return f"{what} than {fmt} at {where}, e.g. {better}"
    if rule == "underflow" and too_wide:
        other = _MORE_RANGE.get(fmt, "fp32")
        block = recipe or DEFAULT_RECIPE
        return (
            f"cast {where} with the {block} recipe (a scale per block) or to {other}  # "
            f"its dynamic range is wider than {fmt or 'its format'} holds at any one scale"
        )
    if not scalified:
        what = f"naive {fmt} casts" if fmt else "naive low-precision casts"
        return (
            f"run.track(step, scalify=True)  # scale-propagated casts instead of {what} at "
            f"{where}{_recipe_text(rule, recipe, recorded)}"
        )
    if rule == "overflow":
        return _rescale(op, "max")
    if rule in ("underflow", "snr") and not abs(log2_rms) > RESCALE_LOG2:
        table = _MORE_RANGE if rule == "underflow" else _MORE_MANTISSA
        need = "range" if rule == "underflow" else "mantissa"
        other = table.get(fmt, "fp32")
        also = "" if recipe == "" else f", or use the {recipe or DEFAULT_RECIPE} recipe"
        return (
            f"cast {where} to {other}{also}  # at unit scale it needs more {need} than "
            f"{fmt or 'its format'}"
        )
    return _rescale(op, "l2")


def delayed_fix_line(op: Mapping[str, Any], history: int, scalified: bool) -> str:
    """The one-line fix for a ``delayed`` finding on ``op``: an amax history shorter than
    ``history`` or ``most_recent``, per-tensor current scaling (the ``e4m3_tensor``
    recipe: the scale from this step's amax), or dynamic rescaling of the value by its
    abs-max (under scalify: ``dynamic_rescale_max``; otherwise, scalify first)."""
    recipe = (
        f"amax history < {history} or algo='most_recent', or current scaling (e4m3_tensor recipe)"
    )
    if scalified:
        return f"{recipe}, or {_rescale(op, 'max')}"
    return f"{recipe}, or dynamic rescaling under run.track(step, scalify=True)  # at {_where(op)}"


# -- the rules ---------------------------------------------------------------------------


def _format_findings(
    cells: _Cells | _Dense,
    checked: dict[str, np.ndarray],
    thresholds: Thresholds,
    meta: Mapping[str, Any] | None,
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for fmt, ids in checked.items():
        sel = cells.rows_of(ids)
        info = _format_info(fmt, meta)
        limit = info.get("max")
        tiny = info.get("min_subnormal")
        snr_thr = thresholds.snr_for(fmt, meta)
        over = thresholds.overflow_for(fmt)
        rules = (
            ("overflow", f"overflow_{fmt}", "max", over, "gt"),
            ("underflow", f"underflow_{fmt}", "max", thresholds.underflow_for(fmt), "gt"),
            ("snr", f"snr_{fmt}", "min", snr_thr, "lt"),
        )
        edge = rounding_edge(info) if recipe_element(fmt) is None else math.nan
        for rule, col, worst, thr, how in rules:
            values = cells.cols[col]
            mask = _compare(values, how, thr) & sel
            peaks = {}
            if rule == "overflow" and math.isfinite(edge) and "absmax" in cells.cols:
                hits = _hit_rows(_hits(cells, cells.cols["absmax"], mask, "max"))
                peaks = {op: peak for op, _, _, peak, _ in hits}
            for op, first, k, v, at in _hit_rows(_hits(cells, values, mask, worst)):
                n = int(cells.sizes[np.searchsorted(cells.ids, op)])
                # every overflowing element under the edge rounds to the max (an abs-max
                # not above the max disagrees with the overflow: no claim then)
                saturated = bool(limit < peaks.get(op, math.inf) < edge) if peaks else False
                if rule == "overflow":
                    bound = f" (|x| > {_num(limit)})" if limit else ""
                    text = f"{pct(v)} of values overflow {fmt}{bound} at step {at}"
                    if saturated:
                        text += (
                            f", none beyond {_num(edge)} (largest {_num(peaks[op])}): they "
                            f"round to ±{_num(limit)}, not to inf/NaN, but no headroom is left"
                        )
                elif rule == "underflow":
                    bound = f" (|x| < {_num(tiny)})" if tiny else ""
                    text = f"{pct(v)} of non-zero values flush to zero in {fmt}{bound} at step {at}"
                    wide = _too_wide(cells, op, at, info)
                    if wide is not None:
                        text += (
                            f"; its dynamic range, {wide[0]:.1f} octaves, is wider than "
                            f"{fmt}'s {wide[1]:.1f} (max to smallest subnormal): no single "
                            "scale keeps every element"
                        )
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
                        _at=at,
                        _saturated=saturated,
                    )
                )
    return rows


def rounding_edge(info: Mapping[str, Any]) -> float:
    """The magnitude from which a plain cast to a format gives inf (NaN in e4m3fn): its
    max plus half a unit in the last place (464 for e4m3, 61440 for e5m2, 65520 for
    fp16); values between the max and this edge round to the max. NaN when the limits
    are unknown."""
    top, bits = info.get("max"), info.get("mantissa_bits")
    if not top or bits is None:
        return math.nan
    return float(top) + 2.0 ** (math.floor(math.log2(float(top))) - int(bits) - 1)


def format_span(info: Mapping[str, Any]) -> float:
    """Octaves from a format's max down to its smallest subnormal (17.8 for e4m3): the
    widest dynamic range one scale can keep without flushing or clipping; NaN when the
    limits are unknown (a block-scaled recipe has per-block scales, no single span)."""
    top, tiny = info.get("max"), info.get("min_subnormal")
    if not top or not tiny:
        return math.nan
    return math.log2(float(top)) - math.log2(float(tiny))


def _too_wide(
    cells: _Cells | _Dense, op: int, step: int, info: Mapping[str, Any]
) -> tuple[float, float] | None:
    """``(dynamic range, format span)`` when the op's recorded dynamic range at ``step``
    is wider than the format's span, else None (also when it was not recorded)."""
    if "dynamic_range" not in cells.cols:
        return None
    span = format_span(info)
    octaves = cells.at("dynamic_range", op, int(step))
    return (octaves, span) if octaves > span else None


def _mask_groups(
    cells: _Cells | _Dense, values: np.ndarray, min_steps: int | np.ndarray
) -> np.ndarray:
    """Per op (bool, aligned with ``cells.ids``): a non-finite fraction that is the same,
    non-zero and below 1, at every recorded step (at least ``min_steps`` of them, per op
    when an array): masks, see `Thresholds.mask_min_steps`."""
    if not np.size(values):
        return np.zeros(len(cells.ids), bool)
    with np.errstate(invalid="ignore"):
        if isinstance(cells, _Dense):
            lo, hi = np.fmin.reduce(values, axis=0), np.fmax.reduce(values, axis=0)
        else:
            lo = np.fmin.reduceat(values, cells.starts)
            hi = np.fmax.reduceat(values, cells.starts)
        lo, hi = lo.astype(np.float64), hi.astype(np.float64)  # min/max: exact either way
        return (cells.sizes >= min_steps) & (lo > 0) & (hi < 1) & ((hi - lo) <= 1e-12)


def mask_ops(values: pd.Series, min_steps: int, fills: Any = ()) -> np.ndarray:
    """Op ids whose non-finite fraction (``values``: indexed by (op, step), one value per
    recorded step) is the same, non-zero and below 1, at every recorded step (at least
    ``min_steps`` of them; one for the ops of ``fills``, which the probe saw mix a
    constant fill such as -inf into a value): masks, which the nonfinite rule skips (see
    `Thresholds.mask_min_steps`)."""
    by_op = values.groupby(level="op")
    lo, hi, n = by_op.min(), by_op.max(), by_op.size()
    need = np.where(lo.index.isin(np.asarray(list(fills))), 1, min_steps)
    steady = (n >= need) & (lo > 0) & (hi < 1) & ((hi - lo) <= 1e-12)
    return steady.index.to_numpy()[steady.to_numpy()]


def fill_ops(ops: pd.DataFrame) -> np.ndarray:
    """Op ids the probe saw hold a constant fill (``origin == "fill"``)."""
    if "origin" not in ops.columns:
        return np.zeros(0, np.int64)
    return ops.index.to_numpy(np.int64)[ops["origin"].fillna("").astype(str).eq("fill")]


def output_ops(ops: pd.DataFrame) -> np.ndarray:
    """Op ids whose statistics are those of the step's outputs (``output/...`` ops share
    the statistics of the op that produced them, ``stats_op``): parameters, optimizer
    state, loss."""
    if not {"name", "stats_op"} <= set(ops.columns) or not len(ops):
        return np.zeros(0, np.int64)
    out = ops["name"].astype(str).str.startswith("output").to_numpy()
    src = pd.to_numeric(ops["stats_op"], errors="coerce").to_numpy(np.float64)[out]
    return np.unique(src[np.isfinite(src) & (src >= 0)].astype(np.int64))  # -1: no stats


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


def _nonfinite_findings(
    cells: _Cells | _Dense,
    thresholds: Thresholds,
    labels: pd.Series,
    fills: np.ndarray,
    outputs: np.ndarray | None = None,
) -> list[dict[str, Any]]:
    values = cells.cols["frac_nonfinite"]
    # a fill the probe saw (a -inf mask) is a mask from its first recorded step on
    need = np.where(np.isin(cells.ids, fills), 1, thresholds.mask_min_steps)
    kept = ~cells.per_op(_mask_groups(cells, values, need))
    bad = _compare(values, "gt", thresholds.nonfinite) & kept
    hits = _hits(cells, values, bad, "max")
    if not hits.op:
        return []
    outputs = np.zeros(0, np.int64) if outputs is None else np.asarray(outputs, np.int64)
    finite_out = _finite_output_steps(cells, outputs)
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
        contained = op not in outputs and bool(np.isin(_op_steps(cells, op, bad), finite_out).all())
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


#: E4M3's edges (log2 of its max and of its smallest subnormal): `Thresholds.drift_log2`
#: is a bound on |log2 rms| for E4M3 data, and every other format gets the same margins
#: from its own edges (`drift_bounds`).
_E4M3_TOP = math.log2(448.0)
_E4M3_BOTTOM = -9.0


def drift_bounds(fmt: str, drift_log2: float = 4.0) -> tuple[float, float]:
    """The band of log2 rms a value held in format ``fmt`` may drift in without a
    finding: ``±drift_log2`` for E4M3, and for a wider format the same margins from its
    own max and smallest subnormal (e5m2 -11 .. +11, fp16 -19 .. +11.2, bf16 -128 ..
    +123.2): FP16 data at RMS 2^-7 keeps 12 binades above its smallest subnormal, where
    E4M3 data would flush. ``(-inf, inf)`` for an unknown format."""
    info = _format_info(fmt, None)
    top, tiny = info.get("max"), info.get("min_subnormal")
    if not top or not tiny:
        return -math.inf, math.inf
    lower = math.log2(float(tiny)) + (-drift_log2 - _E4M3_BOTTOM)
    upper = math.log2(float(top)) - (_E4M3_TOP - drift_log2)
    return lower, upper


def _drift_band(table: pd.DataFrame, ids: np.ndarray, drift_log2: float) -> np.ndarray:
    """Per op of ``ids``: ``(lower, upper)`` drift bounds (`drift_bounds`) of the format
    its data is judged in: the format it is cast to, else its own dtype's."""
    cast = table["cast_to"].reindex(ids).fillna("").astype(str).to_numpy()
    dtype = table["dtype"].reindex(ids).fillna("").astype(str).map(_LOW_PRECISION)
    fmt = np.where(cast != "", cast, dtype.fillna("").to_numpy())
    band = {f: drift_bounds(f, drift_log2) for f in set(fmt.tolist())}
    return np.array([band[f] for f in fmt], np.float64).reshape(len(ids), 2)


def _drift_findings(
    cells: _Cells | _Dense, band: np.ndarray, thresholds: Thresholds
) -> list[dict[str, Any]]:
    """``band``: per op of ``cells.ids``, its drift bounds (``(-inf, inf)``: not judged)."""
    l2 = cells.cols["log2_rms"]
    lo, hi = band[:, 0], band[:, 1]
    if not isinstance(cells, _Dense):  # op-major rows
        lo, hi = np.repeat(lo, cells.sizes), np.repeat(hi, cells.sizes)
    with np.errstate(invalid="ignore"):
        excess = np.maximum(l2 - hi, lo - l2)
        mask = excess > 0
    rows = []
    for op, first, k, _, at in _hit_rows(_hits(cells, excess, mask, "max")):
        n = int(cells.sizes[np.searchsorted(cells.ids, op)])
        v = cells.at("log2_rms", op, int(at))
        lower, upper = band[int(np.searchsorted(cells.ids, op))]
        bound = upper if v > upper else lower
        text = (
            f"log2 rms of the data reaches {_signed(v)} (rms {_num(2.0**v)}) at step "
            f"{at}, beyond {bound:+.3g}"
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
                _at=at,
            )
        )
    return rows


class _TrendFit(NamedTuple):
    """Per op with finite points: the least-squares sums of log2 rms against step, the
    last log2 rms over all its steps (NaN included), the last fitted step, and a
    function giving the fitted points ``(steps, log2 rms)`` of the k-th op."""

    ops: np.ndarray
    counts: np.ndarray
    xm: np.ndarray
    ym: np.ndarray
    sxx: np.ndarray
    syy: np.ndarray
    sxy: np.ndarray
    last: np.ndarray
    x_last: np.ndarray
    points: Any


def _trend_fit(cells: _Cells, drift_ops: np.ndarray) -> _TrendFit | None:
    """`_TrendFit` over op-major cells: one bincount per sum."""
    l2 = cells.cols["log2_rms"]
    used = cells.rows_of(drift_ops) & np.isfinite(l2)
    if used.all():  # every row: no gathers
        ops, x, y = cells.op, cells.step.astype(np.float64), l2
    else:
        rows_idx = np.flatnonzero(used)
        if not len(rows_idx):
            return None
        ops = cells.op[rows_idx]
        x = cells.step[rows_idx].astype(np.float64)
        y = l2[rows_idx]
    del used
    # last value of each op over *all* its steps (an op drifting now is not "in bound")
    last_all = l2[cells.starts + cells.sizes - 1]
    starts = delayed.group_starts(ops)
    uniq, counts = ops[starts], np.diff(np.r_[starts, len(ops)])
    codes = np.repeat(np.arange(len(uniq)), counts)
    xm = np.bincount(codes, weights=x) / counts
    ym = np.bincount(codes, weights=y) / counts
    dx, dy = x - xm[codes], y - ym[codes]
    prod = np.multiply(dx, dx)  # one buffer for the three products
    sxx = np.bincount(codes, weights=prod)
    sxy = np.bincount(codes, weights=np.multiply(dx, dy, out=prod))
    syy = np.bincount(codes, weights=np.multiply(dy, dy, out=prod))
    del prod, dx, dy, codes
    ends = starts + counts - 1

    def points(k: int) -> tuple[np.ndarray, np.ndarray]:
        return x[starts[k] : ends[k] + 1], y[starts[k] : ends[k] + 1]

    last = last_all[np.searchsorted(cells.ids, uniq)]
    return _TrendFit(uniq, counts, xm, ym, sxx, syy, sxy, last, x[ends], points)


def _trend_fit_dense(cells: _Dense, drift_ops: np.ndarray) -> _TrendFit | None:
    """`_TrendFit` over steps x ops: the same sums, accumulated step by step (the order
    of the op-major bincounts, so the same numbers) with one vector per step, no copy of
    the steps x ops values."""
    l2 = cells.cols["log2_rms"]
    drift = np.isin(cells.ids, drift_ops)
    x = cells.steps.astype(np.float64)
    n = len(cells.ids)
    counts = np.zeros(n, np.int64)
    sx, sy = np.zeros(n), np.zeros(n)
    x_last = np.full(n, np.nan)
    finite = [np.isfinite(row) & drift for row in l2]
    for xi, row, ok in zip(x, l2, finite):
        counts += ok
        sx += np.where(ok, xi, 0.0)
        sy += np.where(ok, row, 0.0)
        x_last = np.where(ok, xi, x_last)
    has = counts > 0
    if not has.any():
        return None
    with np.errstate(divide="ignore", invalid="ignore"):
        xm, ym = sx / counts, sy / counts
    sxx, syy, sxy = np.zeros(n), np.zeros(n), np.zeros(n)
    for xi, row, ok in zip(x, l2, finite):
        dx = np.where(ok, xi - xm, 0.0)
        dy = np.where(ok, row - ym, 0.0)
        sxx += dx * dx
        syy += dy * dy
        sxy += dx * dy
    cols = np.flatnonzero(has)

    def points(k: int) -> tuple[np.ndarray, np.ndarray]:
        j = cols[k]
        ok = np.isfinite(l2[:, j])
        return x[ok], l2[ok, j]

    pick = (cols,)
    return _TrendFit(
        cells.ids[cols],
        counts[pick],
        xm[pick],
        ym[pick],
        sxx[pick],
        syy[pick],
        sxy[pick],
        np.asarray(l2[-1, cols], np.float64),
        x_last[pick],
        points,
    )


def _trend_findings(
    cells: _Cells | _Dense, band: np.ndarray, thresholds: Thresholds, horizon: float
) -> list[dict[str, Any]]:
    """Least-squares line of log2 rms against step, per op with finite drift bounds in
    ``band`` (per op of ``cells.ids``; finite points only), projected out of its band."""
    drift_ops = cells.ids[np.isfinite(band).any(axis=1)]
    if isinstance(cells, _Dense):
        fit = _trend_fit_dense(cells, drift_ops)
    else:
        fit = _trend_fit(cells, drift_ops)
    if fit is None:
        return []
    xm, ym, sxx, syy, sxy = fit.xm, fit.ym, fit.sxx, fit.syy, fit.sxy
    lo, hi = band[np.searchsorted(cells.ids, fit.ops)].T
    with np.errstate(divide="ignore", invalid="ignore"):
        slope = sxy / sxx
        r2 = slope**2 * sxx / syy
        projected = ym + slope * (horizon - xm)
        candidate = (
            (fit.counts >= thresholds.trend_min_points)
            & (horizon > fit.x_last)
            & (fit.last >= lo)
            & (fit.last <= hi)
            & (sxx != 0)
            & (syy != 0)
            & ((projected > hi) | (projected < lo))
            & (r2 >= thresholds.trend_min_r2)
        )
    out = []
    for k in np.flatnonzero(candidate):
        target = float(hi[k] if projected[k] > hi[k] else lo[k])
        cross = xm[k] + (target - ym[k]) / slope[k]
        xs, ys = fit.points(k)
        text = (
            f"log2 rms of the data moves {slope[k]:+.3g}/step (from {_signed(ys[0])} at step "
            f"{int(xs[0])} to {_signed(ys[-1])} at step {int(xs[-1])}, R² {r2[k]:.2f}); the "
            f"fit crosses {target:+.3g} at step ~{int(round(cross))} and reaches "
            f"{_signed(projected[k])} at the horizon (step {int(horizon)})"
        )
        out.append(
            dict(
                op=int(fit.ops[k]),
                rule="trend",
                format="",
                first_step=int(xs[0]),
                steps=int(len(xs)),
                value=float(projected[k]),
                threshold=float(target),
                evidence=text + ".",
            )
        )
    return out


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


def _delayed_formats(info: pd.DataFrame, audit: Sequence[str] = ()) -> pd.Series:
    """Float ops (by op-table dtype; unknown dtype counts as float) -> the format their
    delayed scaling is replayed in. Delayed scaling is a way to scale a cast: the rule
    concerns the values a run casts to a plain format without a scale of their own (a
    naive cast, replayed in its format; a scalified value is cast with this step's
    scale), and, when a plain format with a max is audited, every float op (replayed in
    its cast format, else the first such audited format)."""
    dtype = info["dtype"].astype(str)
    floats = info[(dtype == "") | dtype.str.contains("float")]
    cast = floats["cast_to"].astype(str)
    limits = {f: bool(f) and "max" in _format_info(f, None) for f in cast.unique()}
    known = cast.map(limits).to_numpy(bool)
    audited = [f for f in audit if recipe_element(f) is None and "max" in _format_info(f, None)]
    if audited:
        return cast.where(known, audited[0])
    return cast[known & ~floats["scaled"].to_numpy(bool)]


# -- impact ------------------------------------------------------------------------------


#: Upper bound of the relative error of a value that rounds down to a format's max (at
#: most half a unit in the last place: 16/464 in e4m3): the impact of a saturated overflow
#: per element.
_SATURATED_LOSS = 16.0 / 464.0


def _impact(found: pd.DataFrame, cells: _Cells | _Dense, passes: np.ndarray) -> np.ndarray:
    """Per finding: the estimated share of the value lost at its worst step, in [0, 1]
    (see `advise`; ``passes``: each finding's op's pass). NaN for drift, trend and
    delayed, which warn before a loss."""
    out = np.full(len(found), np.nan)
    rule = found["rule"].astype(str).to_numpy()
    fmt = found["format"].astype(str).to_numpy()
    value = found["value"].to_numpy(np.float64)
    at = found["_at"].to_numpy() if "_at" in found else np.zeros(len(found))
    ops = found["op"].to_numpy(np.int64)
    saturated, contained = (
        found[c].eq(True).to_numpy(bool) if c in found else np.zeros(len(found), bool)
        for c in ("_saturated", "_contained")
    )
    with np.errstate(invalid="ignore", over="ignore"):
        for i in range(len(found)):
            if rule[i] == "nonfinite":
                out[i] = 0.0 if contained[i] else 1.0
            elif rule[i] == "overflow" and recipe_element(fmt[i]) is not None:
                out[i] = value[i]  # clipped elements saturate
            elif rule[i] == "overflow" and saturated[i]:
                out[i] = value[i] * _SATURATED_LOSS  # they round to the max
            elif rule[i] == "overflow":
                out[i] = 1.0  # a plain cast turns them into inf (NaN in e4m3fn): step lost
            elif rule[i] == "snr":
                out[i] = 10.0 ** (-value[i] / 10.0)
            elif rule[i] == "underflow" and passes[i] not in ("fwd", "input"):
                out[i] = value[i]  # a gradient or update element flushed is a step lost
            elif rule[i] == "underflow":
                col = f"snr_{fmt[i]}"
                snr = cells.at(col, int(ops[i]), int(at[i])) if col in cells.cols else np.nan
                out[i] = 10.0 ** (-snr / 10.0) if np.isfinite(snr) else value[i]
    return np.clip(out, 0.0, 1.0)


# -- severity ----------------------------------------------------------------------------


def _band_level(
    m: np.ndarray, lo: float, steps: tuple[float, float, float], top: float
) -> np.ndarray:
    """0, 1, 2 or 3 (low, medium, high, critical) by the magnitude ``m`` against
    ``steps`` (medium, high and critical from), plus where ``m`` lies in its band, in
    [0, 1): bands run from ``lo`` (the rule's threshold) through the steps to ``top``
    (the end of the last band)."""
    edges = [lo, *steps]
    level = np.searchsorted(np.asarray(steps), m, side="right").astype(np.float64)
    frac = np.zeros(len(m))
    for band in range(4):
        a = edges[band]
        b = edges[band + 1] if band < 3 else top
        if band < 3 and not math.isfinite(b):
            b = top
        if not (math.isfinite(a) and math.isfinite(b)) or b <= a:
            continue
        here = level == band
        frac[here] = (m[here] - a) / (b - a)
    return level + np.clip(np.nan_to_num(frac, nan=0.0), 0.0, 0.999)


def _log_fraction(values: np.ndarray | float) -> np.ndarray:
    return np.log10(np.maximum(np.asarray(values, np.float64), 1e-12))


def severity_level(findings: pd.DataFrame) -> np.ndarray:
    """A number per finding (row of `advise`), larger is worse: its severity's rank
    from the bottom (0 low, 1 medium, 2 high, 3 critical) plus where its magnitude lies
    within that severity's band, in [0, 1). The severity steps are `SEVERITY_STEPS`
    (module docstring); the magnitude is the fraction (on a log scale) for overflow and
    underflow, the dB under the threshold for snr, the binades beyond the bound for drift
    and trend, above the threshold for delayed; nonfinite is critical. Needs the rule,
    format, value and threshold columns."""
    require_columns(findings, ("rule", "format", "value", "threshold"), "findings")
    n = len(findings)
    out = np.zeros(n)
    if not n:
        return out
    rule = findings["rule"].astype(str).to_numpy()
    fmt = findings["format"].astype(str)
    value = findings["value"].to_numpy(np.float64)
    thr = findings["threshold"].to_numpy(np.float64)
    recipe = fmt.map({f: recipe_element(f) is not None for f in fmt.unique()}).to_numpy(bool)
    with np.errstate(invalid="ignore", divide="ignore"):
        for name in np.unique(rule):
            m = rule == name
            v, t = value[m], thr[m]
            if name == "nonfinite":
                out[m] = 3.0 + 0.999 * np.clip(np.nan_to_num(v, nan=1.0), 0.0, 1.0)
                if "impact" in findings.columns:  # dropped downstream: no step lost, low
                    lost = findings["impact"].to_numpy(np.float64)[m]
                    out[m] = np.where(lost == 0.0, 0.999 * np.clip(v, 0.0, 1.0), out[m])
            elif name in ("overflow", "underflow"):
                keys = np.where(recipe[m] & (name == "overflow"), "overflow_recipe", name)
                for key in np.unique(keys):
                    k = keys == key
                    steps = tuple(float(_log_fraction(x)) for x in SEVERITY_STEPS[key])
                    lo = float(_log_fraction(np.nanmin(t[k])))
                    idx = np.flatnonzero(m)[k]
                    out[idx] = _band_level(_log_fraction(v[k]), lo, steps, 0.0)
                if name == "overflow" and "impact" in findings.columns:
                    # a plain cast whose overflowing elements all round to the max
                    # (`rounding_edge`) loses no step: no headroom, medium at most
                    impact = findings["impact"].to_numpy(np.float64)[m]
                    capped = np.flatnonzero(m)[~recipe[m] & (impact < 1.0)]
                    out[capped] = np.minimum(out[capped], 1.999)
            elif name == "snr":
                # graded from the lower of the format's threshold and E4M3's: a cast that
                # keeps more SNR than a healthy E4M3 cast (an FP16 cast at 40 dB) loses
                # less than training tolerates (the corpus): at most low
                floor = np.minimum(t, DEFAULT_SNR_DB["e4m3"])
                graded = np.where(np.isnan(v), 0.0, floor - v)
                level = _band_level(graded, 0.0, SEVERITY_STEPS["snr"], 36.0)
                low = np.clip(np.where(np.isnan(v), 0.0, t - v) / 36.0, 0.0, 0.999)
                out[m] = np.where(graded > 0, level, low)
            elif name in ("drift", "trend"):
                beyond = np.abs(v) - np.abs(t)
                out[m] = _band_level(beyond, 0.0, SEVERITY_STEPS[name], 16.0)
            elif name == "delayed":
                level = _band_level(v, 0.0, SEVERITY_STEPS["delayed"], 12.0)
                if "steps" in findings.columns:  # clipping at one recorded step only (a
                    once = findings["steps"].to_numpy()[m] <= 1  # warm-up transient):
                    level = np.where(once, np.minimum(level, 1.999), level)  # medium at most
                out[m] = level
    return out


def severity_of(level: np.ndarray) -> np.ndarray:
    """Severity names (`SEVERITY_ORDER`) of `severity_level` numbers."""
    rank = np.clip(np.floor(np.asarray(level, np.float64)), 0, 3).astype(np.int64)
    return np.asarray(SEVERITY_ORDER[::-1], dtype=object)[rank]


def finding_metric(rule: str, fmt: str = "") -> str:
    """The statistic (a column of `scalescope.analysis.op_summary`, a heatmap metric)
    that shows a finding: ``frac_nonfinite``; ``overflow_F``, ``underflow_F``,
    ``snr_F``; ``log2_rms`` for drift and trend; ``absmax`` for delayed."""
    if rule == "nonfinite":
        return "frac_nonfinite"
    if rule in ("overflow", "underflow", "snr") and fmt:
        return f"{rule}_{fmt}"
    if rule == "delayed":
        return "absmax"
    return "log2_rms"


def worst_finding(findings: pd.DataFrame) -> int | None:
    """Position (``iloc``) of the worst finding: the highest severity, then the largest
    magnitude (`severity_level`); on a tie the first in the frame's order. None when
    there is none."""
    if findings is None or not len(findings):
        return None
    return int(np.argmax(severity_level(findings)))


def worst_finding_metric(
    findings: pd.DataFrame | None,
    options: Sequence[str] | None = None,
    default: str = "log2_rms",
) -> str | None:
    """The metric to rank ops by so that the worst finding shows first (`finding_metric`
    of the worst finding, by `severity_level`): the worst finding's whose metric is in
    ``options`` (None: any). Without findings, or when none's metric is offered,
    ``default`` (when offered; else the first option, None without options)."""
    fallback = default if options is None or default in options else None
    if fallback is None and options:
        fallback = list(options)[0]
    if findings is None or not len(findings):
        return fallback
    level = severity_level(findings)
    rules = findings["rule"].astype(str).to_numpy()
    fmts = findings["format"].astype(str).to_numpy()
    for i in np.argsort(-level, kind="stable"):
        metric = finding_metric(rules[i], fmts[i])
        if options is None or metric in options:
            return metric
    return fallback


# -- entry points ------------------------------------------------------------------------


def _empty_findings() -> pd.DataFrame:
    frame = pd.DataFrame({c: pd.Series(dtype=object) for c in FINDING_COLUMNS})
    return frame.astype({"op": np.int64, "first_step": np.int64, "steps": np.int64}).astype(
        {"value": np.float64, "threshold": np.float64, "impact": np.float64}
    )


def _default_horizon(meta: Mapping[str, Any] | None, last_step: int) -> float:
    steps = ((meta or {}).get("config") or {}).get("steps")
    if isinstance(steps, int | float) and not isinstance(steps, bool) and steps > 0:
        return float(steps)
    return float(last_step * 2)


def advisor_columns(
    columns: Sequence[str], ops: pd.DataFrame, audit: str | Sequence[str] = ()
) -> list[str]:
    """The statistics columns `advise` reads, of the wide frame's ``columns``: key columns
    (step, op, iteration), frac_nonfinite, rms, absmax, scale, count, and the overflow,
    underflow and snr columns of every format some op of ``ops`` is cast to or that is
    audited, plus every recorded recipe's (their verdicts pick a naive-cast fix). A view
    that holds the statistics as parts builds a frame of these only."""
    cols = [c for c in columns if isinstance(c, str)]
    have = pd.DataFrame(columns=cols)
    audit_list = set([audit] if isinstance(audit, str) else audit)
    cast = set(op_table(ops)["cast_to"].astype(str)) if len(ops) else set()
    keep = ["step", "op", "iteration", "frac_nonfinite", "rms", "absmax", "scale", "count"]
    keep.append("dynamic_range")
    for fmt in recorded_formats(have):
        if fmt in cast or fmt in audit_list:
            keep += [f"overflow_{fmt}", f"underflow_{fmt}", f"snr_{fmt}"]
    for recipe in recorded_recipes(have):
        keep += [f"overflow_{recipe}", f"underflow_{recipe}", f"snr_{recipe}"]
        keep.append(f"block_flush_{recipe}")
    return [c for c in dict.fromkeys(keep) if c in cols]


def advise(
    stats: pd.DataFrame,
    ops: pd.DataFrame,
    *,
    meta: Mapping[str, Any] | None = None,
    audit: str | Sequence[str] = (),
    thresholds: Thresholds | None = None,
    horizon: int | float | None = None,
) -> pd.DataFrame:
    """Findings of the advisor (see the module docstring for the rules, their severity
    grades and fixes), one row per (op, rule, format), sorted by severity, then first
    step, then op.

    ``stats``: wide statistics frame (`advisor_columns` lists the columns read);
    ``ops``: the op table; ``meta``: the run's metadata
    (``graph.scalify`` picks the fix, ``config.steps`` the default horizon, ``format_info``
    the limits quoted in the evidence); ``audit``: formats every op is also checked
    against (recorded block-scaled recipes too, with ``thresholds.recipe_overflow``,
    ``recipe_underflow`` and ``recipe_snr_db``; flushed blocks are the format what-if's
    business); ``horizon``: the step trends are projected
    to (default ``config.steps``, else twice the last recorded step).

    Columns: op, label, name, pass, primitive, source, rule, format ("" for nonfinite,
    drift, trend and delayed), first_step (first recorded step where the rule holds; for
    trend the first fitted step), steps (recorded steps where it holds; for trend the
    fitted points), value (worst: max fraction, min SNR dB, log2 rms of larger magnitude; for
    trend the projected log2 rms at the horizon; for delayed the largest log2(value amax
    / delayed-scaling threshold)), threshold (for trend the signed bound crossed; 0 for
    delayed), impact (the estimated share of the value lost at the worst step, in
    [0, 1]: 1 for nonfinite and for an overflow of a plain format, whose inf or NaN ends
    the step; for the underflow of a backward or optimizer value, the fraction of its
    non-zero elements flushed, each a lost piece of an update; the quantisation noise
    over the signal power, ``10**(-snr/10)``, of the format at that step for snr and for
    the underflow of a forward value, which counts the flushed values' share of the
    signal; the clipped fraction for a recipe's overflow; NaN for drift, trend and
    delayed, which warn before anything is lost), evidence, severity (graded by the
    value: `severity_level`), fix
    (`fix_line`). The delayed rule needs ``absmax`` and ``scale`` columns (skipped
    without them) and reads the histogram range from ``meta["hist_columns"]``.

    Values NaN in a statistic (no finite element) never trigger overflow, underflow,
    snr or drift: the nonfinite rule reports them. An all-zero value (rms 0) has no scale
    to drift from and is skipped by drift and trend.

    Vectorised: a run of 20 000 ops x 1000 recorded steps in the writer's order is
    transposed to op-major order (no sort), and each rule touches only the rows where it
    holds beyond one comparison per row.
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
    unknown = np.setdiff1d(pd.unique(stats["op"].to_numpy()), table.index.to_numpy())
    if len(unknown):
        raise KeyError(f"ops: op id {int(unknown[0])} appears in stats but not in ops")
    audit_list = list([audit] if isinstance(audit, str) else audit)
    audit_formats = format_list(audit_list, stats, "audit", recipes=True)
    if horizon is not None and (isinstance(horizon, bool) or not isinstance(horizon, int | float)):
        raise TypeError(f"horizon: expected a step number, got {horizon!r}")
    if stats.empty:
        return _empty_findings()

    known = recorded_formats(stats) + recorded_recipes(stats)
    ids = table.index.to_numpy()
    cast_to = table["cast_to"].to_numpy()
    checked: dict[str, np.ndarray] = {}
    for fmt in known:
        mask = (cast_to == fmt) | (fmt in audit_formats)
        if mask.any():
            checked[fmt] = ids[mask]

    columns = {"frac_nonfinite": "max"}
    if "dynamic_range" in stats.columns:
        columns["dynamic_range"] = "max"
    for fmt in checked:
        columns |= {f"overflow_{fmt}": "max", f"underflow_{fmt}": "max", f"snr_{fmt}": "min"}
    if checked and "absmax" in stats.columns:  # does an overflow saturate or turn inf?
        columns["absmax"] = "max"
    rms = stats["rms"].to_numpy(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        l2 = np.log2(np.where(rms > 0, rms, np.nan))
    extra = {"log2_rms": l2}
    columns |= {"log2_rms": "abs"}
    replay_delayed = {"absmax", "scale"} <= set(stats.columns)
    exp_range = delayed.hist_range((meta or {}).get("hist_columns"))
    dense = _dense_blocks(stats["op"].to_numpy(np.int64), stats["step"].to_numpy(np.int64))
    if replay_delayed and dense is None:  # value amax, its binade's floor, ran: maxima
        amax, floor, ran = delayed.value_columns(stats, exp_range)  # over iterations
        extra |= {"_amax": amax, "_floor": floor, "_ran": ran}
        columns |= {"_amax": "max", "_floor": "max", "_ran": "max"}
    elif replay_delayed:  # one row per op and step: the floor where it matters only
        amax, ran = _value_amax(stats)
        extra |= {"_amax": amax, "_ran": ran}
        columns |= {"_amax": "max", "_ran": "max", "absmax": "max", "scale": "max"}
    cells = _cells_of(stats, columns, extra, dense)
    del extra, l2
    labels = op_labels(table)

    # Drift matters where the data is stored or cast in a narrow format: an FP32 value of
    # RMS 2^8 loses nothing, an FP16 or FP8 one heads for overflow or underflow.
    low = table["dtype"].astype(str).isin(list(_LOW_PRECISION)).to_numpy()
    judged = ~np.isin(ids, constant_ops(table, stats))  # not constant by construction
    drift_ops = ids[((table["scaled"].to_numpy(bool) & low) | (cast_to != "")) & judged]
    band = np.tile([-math.inf, math.inf], (len(cells.ids), 1))
    judged_drift = np.isin(cells.ids, drift_ops)
    band[judged_drift] = _drift_band(table, cells.ids[judged_drift], thresholds.drift_log2)
    last_step = int(stats["step"].max())
    horizon = _default_horizon(meta, last_step) if horizon is None else float(horizon)

    rows = _nonfinite_findings(cells, thresholds, labels, fill_ops(table), output_ops(table))
    rows += _format_findings(cells, checked, thresholds, meta)
    rows += _drift_findings(cells, band, thresholds)
    rows += _trend_findings(cells, band, thresholds, horizon)
    if replay_delayed:
        replayed = _delayed_formats(table[judged], audit_formats)
        rows += _delayed_findings(cells, replayed, thresholds, exp_range)
    if not rows:
        return _empty_findings()
    found = pd.DataFrame(rows)
    passes = table["pass"].reindex(found["op"].to_numpy()).astype(str).to_numpy()
    found["impact"] = _impact(found, cells, passes)
    recipes = _safe_recipes(found, stats, table, thresholds, meta)
    recorded = recorded_recipes(stats)
    return _finish(found, table, labels, meta, thresholds.delayed_history, cells, recipes, recorded)


def _safe_recipes(
    found: pd.DataFrame,
    stats: pd.DataFrame,
    table: pd.DataFrame,
    thresholds: Thresholds,
    meta: Mapping[str, Any] | None,
) -> dict[int, str] | None:
    """Op id -> the cheapest recorded recipe safe for it over the recorded steps
    (`scalescope.analysis.format_whatif`; "" when none is), for the ops of format
    findings; None when the run records no recipe. A backward or optimizer value is
    offered 8-bit recipes only: FP4 training casts gradients with stochastic rounding and
    random Hadamard transforms, which these statistics do not model."""
    recorded = recorded_recipes(stats)
    if not recorded:
        return None
    from .whatif import cheapest_recipe, format_whatif  # whatif imports this module

    want = found["rule"].isin(["overflow", "underflow", "snr", "drift", "trend"]).to_numpy()
    ids = np.unique(found.loc[want, "op"].to_numpy(np.int64))
    if not len(ids):
        return {}
    op = stats["op"].to_numpy(np.int64)
    rows = np.isin(op, ids, kind="table") if op.min() >= 0 else np.isin(op, ids)
    whatif = format_whatif(stats[rows], table, recorded, thresholds=thresholds, meta=meta)
    grads = ~table["pass"].reindex(whatif.index).astype(str).isin(["fwd", "input"]).to_numpy()
    from ..core import recipes as _recipes

    for name in recorded:
        if _recipes.get(name).bits < 8 and grads.any():
            whatif[(name, "safe")] = whatif[(name, "safe")].to_numpy(bool) & ~grads
    return {int(k): str(v) for k, v in cheapest_recipe(whatif).items()}


def _finish(
    found: pd.DataFrame,
    table: pd.DataFrame,
    labels: pd.Series,
    meta: Mapping[str, Any] | None,
    history: int = 1024,
    cells: _Cells | _Dense | None = None,
    recipes: Mapping[int, str] | None = None,
    recorded: Sequence[str] = (),
) -> pd.DataFrame:
    """Add op details, severity and fix; sort."""
    run_scalified = bool(((meta or {}).get("graph") or {}).get("scalify", False))
    found["op"] = found["op"].astype(np.int64)
    op_ids = found["op"].tolist()
    rec = table.loc[found["op"]].assign(label=labels.reindex(found["op"]).to_numpy())
    rec.index = found.index
    for col in ("label", "name", "pass", "primitive", "source"):
        found[col] = rec[col].to_numpy()
    found["severity"] = severity_of(severity_level(found))
    at = found["_at"].tolist() if "_at" in found else [None] * len(found)
    origin_of = found["_origin"].tolist() if "_origin" in found else [None] * len(found)
    records = rec.to_dict("records")
    by_op = dict(zip(op_ids, records))
    fixes = []
    for i, (rule, fmt, op) in enumerate(zip(found["rule"].tolist(), found["format"], records)):
        scaled = run_scalified or bool(op["scaled"])
        if rule == "delayed":
            fixes.append(delayed_fix_line(op, history, scaled))
            continue
        fmt = fmt or str(op["cast_to"]) or _LOW_PRECISION.get(str(op["dtype"]), "")
        recipe = None if recipes is None else recipes.get(op_ids[i], "")
        log2_rms = math.nan
        if rule in ("underflow", "snr") and scaled and cells is not None:
            log2_rms = cells.at("log2_rms", op_ids[i], int(at[i]))
        too_wide = (
            rule == "underflow"
            and cells is not None
            and _too_wide(cells, op_ids[i], int(at[i]), _format_info(fmt, meta)) is not None
        )
        origin = None
        if rule == "nonfinite" and origin_of[i] is not None and not pd.isna(origin_of[i]):
            origin = by_op.get(int(origin_of[i]))
            if origin is None:  # the origin op has a finding of its own: always in by_op
                origin = table.loc[int(origin_of[i])].to_dict() | {
                    "label": labels[int(origin_of[i])]
                }
        fixes.append(
            fix_line(
                op,
                fmt,
                scaled,
                rule,
                recipe=recipe,
                log2_rms=log2_rms,
                origin=origin,
                recorded=recorded,
                too_wide=too_wide,
            )
        )
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
    """Findings counted per (rule, format): severity (the most severe of its findings),
    findings, distinct ops, passes involved, first step, and the worst value (max
    fraction, min SNR, log2 rms of larger magnitude). Ordered by severity, then rule."""
    require_columns(findings, ("op", "rule", "format", "first_step", "value", "pass"), "findings")
    cols = ["rule", "format", "severity", "findings", "ops", "passes", "first_step", "worst"]
    if findings.empty:
        return pd.DataFrame(columns=cols)
    rank = {s: i for i, s in enumerate(SEVERITY_ORDER)}
    rows = []
    for (rule, fmt), g in findings.groupby(["rule", "format"], sort=False):
        values = g["value"].astype(np.float64)
        if rule == "snr":
            worst = values.min()
        elif rule in ("drift", "trend"):
            worst = values.iloc[int(np.argmax(values.abs().to_numpy()))]
        else:
            worst = values.max()
        if "severity" in g.columns:
            severity = min(g["severity"], key=lambda s: rank.get(s, len(rank)))
        else:
            severity = SEVERITY.get(rule, "")
        rows.append(
            dict(
                rule=rule,
                format=fmt,
                severity=severity,
                findings=len(g),
                ops=g["op"].nunique(),
                passes=", ".join(dict.fromkeys(g["pass"])),
                first_step=int(g["first_step"].min()),
                worst=float(worst),
            )
        )
    out = pd.DataFrame(rows, columns=cols)
    sev = out["severity"].map(rank).fillna(len(SEVERITY))
    rule = out["rule"].map({r: i for i, r in enumerate(RULES)}).fillna(len(RULES))
    order = np.lexsort((out["format"].to_numpy(), rule.to_numpy(), sev.to_numpy()))
    return out.iloc[order].reset_index(drop=True)
