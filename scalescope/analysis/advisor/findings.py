"""The advisor's entry points: `advise` runs every rule over a run's statistics and
returns the findings frame (`FINDING_COLUMNS`), with impact, severity and fix, sorted
(`scalescope.analysis.advise_run` over a recorded run); `advisor_columns`, the
statistics columns it reads; `summary_by_rule`, findings counted per rule and format.
A naive cast's fix names the cheapest recipe the format what-if
(`scalescope.analysis.whatif`) shows safe."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from ...probe import reach
from .. import delayed
from ..frames import (
    check_stats,
    format_list,
    op_labels,
    op_table,
    recorded_formats,
    recorded_recipes,
    require_columns,
)
from ..masks import fill_ops
from ..relevance import constant_ops, self_scaled_ops
from ..thresholds import Thresholds, _format_info
from ..whatif import cheapest_recipe, format_whatif
from .cells import _Cells, _cells_of, _Dense, _dense_blocks, _value_amax
from .detectors_delayed import _delayed_findings, _delayed_formats
from .detectors_formats import _format_findings, _too_wide
from .detectors_nonfinite import _nonfinite_findings, flow_of_table, output_ops
from .detectors_scales import _drift_band, _drift_findings, _trend_findings
from .detectors_updates import _stall_findings
from .severity import (
    FORMAT_RULES,
    RULES,
    SCALE_RULES,
    SEVERITY,
    SEVERITY_ORDER,
    _impact,
    severity_level,
    severity_of,
)
from .text import _LOW_PRECISION, delayed_fix_line, fix_line

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
    updates: pd.DataFrame | None = None,
) -> pd.DataFrame:
    """Findings of the advisor (see `scalescope.analysis.advisor` for the rules, their
    severity grades and fixes), one row per (op, rule, format), sorted by severity,
    then first step, then op.

    ``stats``: wide statistics frame (`advisor_columns` lists the columns read);
    ``ops``: the op table; ``meta``: the run's metadata
    (``graph.scalify`` picks the fix, ``config.steps`` the default horizon, ``format_info``
    the limits quoted in the evidence); ``audit``: formats every op is also checked
    against (recorded block-scaled recipes too, with ``thresholds.recipe_overflow``,
    ``recipe_underflow`` and ``recipe_snr_db``; flushed blocks are the format what-if's
    business); ``horizon``: the step trends are projected
    to (default ``config.steps``, else twice the last recorded step); ``updates``: what
    the formats a precision policy holds the weights in kept of each update
    (`RunReader.held_updates`), judged by the ``stall`` rule (its value is the median
    share of updates lost over the recorded steps, its impact the same share over every
    held weight together).

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
    # not constant by construction, nor scaled into its format by the code itself
    self_scaled = self_scaled_ops(table)
    judged = ~np.isin(ids, constant_ops(table, stats)) & ~np.isin(ids, self_scaled)
    drift_ops = ids[((table["scaled"].to_numpy(bool) & low) | (cast_to != "")) & judged]
    band = np.tile([-math.inf, math.inf], (len(cells.ids), 1))
    judged_drift = np.isin(cells.ids, drift_ops)
    band[judged_drift] = _drift_band(table, cells.ids[judged_drift], thresholds.drift_log2)
    last_step = int(stats["step"].max())
    horizon = _default_horizon(meta, last_step) if horizon is None else float(horizon)

    outputs = output_ops(table)
    # NaN/inf the step drops by design: read only through a where ("guarded"), or made
    # from constants and the step count ("constant": a schedule's unused rsqrt branch at
    # step 0, which optax's join_schedules evaluates and a select drops)
    guarded = (
        table.index.to_numpy(np.int64)[table["origin"].astype(str).isin(reach.BY_DESIGN).to_numpy()]
        if "origin" in table.columns
        else None
    )
    rows = _nonfinite_findings(
        cells, thresholds, labels, fill_ops(table), outputs, guarded, flow_of_table(table)
    )
    gradients = ids[table["pass"].astype(str).to_numpy() == "bwd"]
    rows += _format_findings(
        cells, checked, thresholds, meta, outputs, gradients, clipped=self_scaled
    )
    rows += _drift_findings(cells, band, thresholds)
    rows += _trend_findings(cells, band, thresholds, horizon)
    if replay_delayed:
        replayed = _delayed_formats(table[judged], audit_formats)
        rows += _delayed_findings(cells, replayed, thresholds, exp_range)
    rows += _stall_findings(updates, table, thresholds)
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
    want = found["rule"].isin(["overflow", "underflow", "snr", "drift", "trend"]).to_numpy()
    ids = np.unique(found.loc[want, "op"].to_numpy(np.int64))
    if not len(ids):
        return {}
    op = stats["op"].to_numpy(np.int64)
    rows = np.isin(op, ids, kind="table") if op.min() >= 0 else np.isin(op, ids)
    whatif = format_whatif(stats[rows], table, recorded, thresholds=thresholds, meta=meta)
    grads = ~table["pass"].reindex(whatif.index).astype(str).isin(["fwd", "input"]).to_numpy()
    from ...core import recipes as _recipes

    for name in recorded:
        if _recipes.get(name).bits < 8 and grads.any():
            whatif[(name, "safe")] = whatif[(name, "safe")].to_numpy(bool) & ~grads
    return {int(k): str(v) for k, v in cheapest_recipe(whatif).items()}


def _grad_headroom(
    cells: _Cells | _Dense,
    table: pd.DataFrame,
    fmt: str,
    step: int,
    meta: Mapping[str, Any] | None,
    peaks: dict[str, tuple[dict[int, float], bool]],
) -> float:
    """log2 of how far every backward value held in ``fmt`` (cast to it, or stored in it)
    can be multiplied at ``step`` before the largest reaches ``fmt``'s max: the most a
    loss scale may lift the gradients. Where the backward pass computes in ``fmt`` (a
    value of its dtype, not only cast to it) the largest is at least 1: the pass starts
    from the loss's own cotangent, 1 times the loss scale, which the probe does not
    measure (a float16 loss weighted by 2**-14 was offered 2**24, an inf there). inf
    when the format's max is unknown or no value abs-max was recorded.
    ``peaks`` caches, per format, the largest value abs-max per step and whether the
    backward pass computes in it."""
    top = _format_info(fmt, meta).get("max")
    if not top or "_amax" not in cells.cols:
        return math.inf
    if fmt not in peaks:
        dtype = table["dtype"].astype(str).map(_LOW_PRECISION).fillna("")
        held = table["cast_to"].astype(str).where(table["cast_to"].astype(str) != "", dtype)
        bwd = table["pass"].astype(str) == "bwd"
        ops = table.index[bwd & (held == fmt)].to_numpy()
        flat = cells.flat(["_amax"], np.asarray(ops, np.int64))
        frame = pd.DataFrame({"step": flat.step, "amax": flat.cols["_amax"]})
        computes_in = bool((bwd & (dtype == fmt)).any())
        peaks[fmt] = (frame.groupby("step")["amax"].max().to_dict(), computes_in)
    by_step, computes_in = peaks[fmt]
    peak = by_step.get(step, math.nan)
    if computes_in:
        peak = max(peak, 1.0) if peak > 0 and math.isfinite(peak) else 1.0
    if not peak > 0 or not math.isfinite(peak):
        return math.inf
    return math.log2(float(top) / peak)


def _sinking_gradient(rule: str, fmt: str, op: Mapping[str, Any], scaled: bool) -> bool:
    """A drift or trend of a gradient held in a narrow-range format (FP16, FP8) by
    naive casts: its data heads for the format's subnormals (the values are flushed
    before any cast can be measured, so no underflow is seen), which loss scaling
    lifts (`text._loss_scaling_text` reads its RMS)."""
    narrow = fmt in ("fp16", "e5m2", "e4m3")
    return rule in SCALE_RULES and narrow and not scaled and op["pass"] == "bwd"


def _judged_by_format(found: pd.DataFrame, level: np.ndarray) -> np.ndarray:
    """``level`` (`severity_level` of ``found``) with the drift or trend of an op that a
    format also has a finding on capped at that finding's severity: the format measures
    what the cast loses, the scale's distance from unit only how it got there (the
    verdict's causes keep the format's finding for it, `scalescope.analysis.causes`),
    so a high drift beside a medium underflow is no high finding for a gate to count."""
    rule = found["rule"].astype(str).to_numpy()
    fmt = found["format"].fillna("").astype(str).to_numpy()
    cast = np.isin(rule, FORMAT_RULES) & (fmt != "")
    scale = np.isin(rule, SCALE_RULES)
    if not (cast.any() and scale.any()):
        return level
    ops = found["op"].to_numpy()
    ceiling = pd.Series(np.floor(level[cast]) + 0.999).groupby(ops[cast]).max()
    cap = ceiling.reindex(ops[scale]).to_numpy(np.float64)
    out = level.copy()
    out[scale] = np.where(np.isnan(cap), level[scale], np.minimum(level[scale], cap))
    return out


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
    found["severity"] = severity_of(_judged_by_format(found, severity_level(found)))
    at = found["_at"].tolist() if "_at" in found else [None] * len(found)
    origin_of = found["_origin"].tolist() if "_origin" in found else [None] * len(found)
    records = rec.to_dict("records")
    by_op = dict(zip(op_ids, records))
    fixes = []
    peaks: dict[str, tuple[dict[int, float], bool]] = {}
    for i, (rule, fmt, op) in enumerate(zip(found["rule"].tolist(), found["format"], records)):
        scaled = run_scalified or bool(op["scaled"])
        if rule == "delayed":
            fixes.append(delayed_fix_line(op, history, scaled))
            continue
        fmt = fmt or str(op["cast_to"]) or _LOW_PRECISION.get(str(op["dtype"]), "")
        recipe = None if recipes is None else recipes.get(op_ids[i], "")
        log2_rms = math.nan
        sinking = _sinking_gradient(rule, fmt, op, scaled) and not pd.isna(at[i])
        if cells is not None and (rule == "underflow" or (rule == "snr" and scaled) or sinking):
            log2_rms = cells.at("log2_rms", op_ids[i], int(at[i]))
        headroom = math.inf
        lifted = rule == "underflow" or sinking
        if lifted and not scaled and op["pass"] == "bwd" and cells is not None:
            headroom = _grad_headroom(cells, table, fmt, int(at[i]), meta, peaks)
        too_wide = (
            rule == "underflow"
            and cells is not None
            and _too_wide(cells, op_ids[i], int(at[i]), _format_info(fmt, meta)) is not None
        )
        peak = math.nan
        if op.get("origin") == "scaled_cast" and cells is not None and "absmax" in cells.cols:
            limit = _format_info(fmt, meta).get("max") if fmt and not pd.isna(at[i]) else None
            if limit:
                peak = cells.at("absmax", op_ids[i], int(at[i])) / float(limit)
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
                headroom=headroom,
                peak=peak,
            )
        )
    found["fix"] = fixes
    found["_sev"] = found["severity"].map({s: i for i, s in enumerate(SEVERITY_ORDER)})
    found["_rule"] = found["rule"].map({r: i for i, r in enumerate(RULES)})
    found = found.sort_values(["_sev", "first_step", "op", "_rule", "format"], kind="stable")
    found = found[FINDING_COLUMNS].reset_index(drop=True)
    return found.astype({"op": np.int64, "first_step": np.int64, "steps": np.int64})


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
