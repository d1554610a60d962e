"""How bad a finding is: the rules (`RULES`), the most severe grade each can reach
and where its severity steps up (`SEVERITY`, `SEVERITY_STEPS`), the estimated share of
the value lost (`_impact`), the grading (`severity_level`, `severity_of`), and the
statistic that shows a finding (`finding_metric`, `worst_finding_metric`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

from ..frames import require_columns
from ..thresholds import DEFAULT_SNR_DB, recipe_element
from .cells import _Cells, _Dense

RULES = ("nonfinite", "overflow", "underflow", "snr", "stall", "drift", "trend", "delayed")
#: The rules a format judges a cast by (what it loses), in the order a cause keeps one
#: of them for an op; the scale rules (drift, trend) say only how a value got there.
FORMAT_RULES = ("overflow", "underflow", "snr")
SCALE_RULES = ("drift", "trend")
#: The most severe grade each rule can reach (`severity_level` grades every finding by
#: its magnitude: `SEVERITY_STEPS`).
SEVERITY = {
    "nonfinite": "critical",
    "overflow": "critical",
    "underflow": "high",
    "snr": "high",
    "stall": "high",
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
    # the share of the elements a step updates whose held value stays (the median over
    # the recorded steps; the lower of the op's and the model's): in
    # benchmarks/bench_zoo_verdicts.py, models whose held weights trained as well as
    # fp32 lost up to 7 % of their updates, broken ones 16 % and more (docs/advisor.md)
    "stall": (0.0625, 0.125, math.inf),
    "drift": (1.0, 4.0, math.inf),
    "trend": (4.0, math.inf, math.inf),
    "delayed": (2.0, 4.0, math.inf),
}
SEVERITY_ORDER = ("critical", "high", "medium", "low")


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
    share = (
        found["_share"].to_numpy(np.float64) if "_share" in found else np.full(len(found), np.nan)
    )
    saturated, contained, clipped = (
        found[c].eq(True).to_numpy(bool) if c in found else np.zeros(len(found), bool)
        for c in ("_saturated", "_contained", "_clipped")
    )
    with np.errstate(invalid="ignore", over="ignore"):
        for i in range(len(found)):
            if rule[i] == "nonfinite":
                out[i] = 0.0 if contained[i] else 1.0
            elif rule[i] in ("overflow", "snr") and contained[i]:
                out[i] = 0.0  # the inf is discarded with the step (a loss scaler's skip)
            elif rule[i] == "overflow" and (clipped[i] or recipe_element(fmt[i]) is not None):
                out[i] = value[i]  # clipped elements saturate (a recipe's, or the code's)
            elif rule[i] == "overflow" and saturated[i]:
                out[i] = value[i] * _SATURATED_LOSS  # they round to the max
            elif rule[i] == "overflow":
                out[i] = 1.0  # a plain cast turns them into inf (NaN in e4m3fn): step lost
            elif rule[i] == "snr":
                out[i] = 10.0 ** (-value[i] / 10.0)
            elif rule[i] == "stall":
                out[i] = share[i]  # the share of the model's updates lost
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
    (`scalescope.analysis.advisor`'s docstring); the magnitude is the fraction (on a log
    scale) for overflow and underflow, the dB under the threshold for snr, the binades
    beyond the bound for drift and trend, above the threshold for delayed, the share of
    updates lost for stall (the lower of the value and the impact, the model's share:
    without an impact column, the value alone); nonfinite is critical. Needs the rule,
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
    clipped = np.zeros(n, bool)
    if "_clipped" in findings.columns:  # a self-scaled cast's overflow saturates, as a recipe's
        clipped = findings["_clipped"].eq(True).to_numpy(bool)
        recipe = recipe | clipped
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
            elif name == "stall":  # graded with the model's share lost (the impact)
                if "impact" in findings.columns:
                    v = np.fmin(v, findings["impact"].to_numpy(np.float64)[m])
                steps = tuple(float(x) for x in SEVERITY_STEPS["stall"])
                out[m] = _band_level(v, float(np.nanmin(t)), steps, 1.0)
            elif name in ("drift", "trend"):
                beyond = np.abs(v) - np.abs(t)
                out[m] = _band_level(beyond, 0.0, SEVERITY_STEPS[name], 16.0)
            elif name == "delayed":
                level = _band_level(v, 0.0, SEVERITY_STEPS["delayed"], 12.0)
                if "steps" in findings.columns:  # clipping at one recorded step only (a
                    once = findings["steps"].to_numpy()[m] <= 1  # warm-up transient):
                    level = np.where(once, np.minimum(level, 1.999), level)  # medium at most
                out[m] = level
        if "impact" in findings.columns:
            # an overflow whose inf the step discards (impact 0,
            # `detectors_formats._handled`), and its SNR at those steps: low
            lost = findings["impact"].to_numpy(np.float64)
            handled = np.isin(rule, ("overflow", "snr")) & (lost == 0.0)
            out[handled] = np.minimum(out[handled], 0.999)
    if "severity" in findings.columns:
        # graded already (`advise`): the grade stands, as it may rest on what the frame
        # no longer holds (a self-scaled cast's clip); the magnitude orders within it
        rank = {s: 3 - i for i, s in enumerate(SEVERITY_ORDER)}
        stored = findings["severity"].map(rank).to_numpy(np.float64)
        known = ~np.isnan(stored)
        within = np.where(np.floor(out) == stored, out - np.floor(out), 0.5)
        out = np.where(known, stored + within, out)
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
    if rule in FORMAT_RULES and fmt:
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
