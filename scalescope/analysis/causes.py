"""One finding per cause: the advisor's per-op findings grouped by rule, format, pass and
module.

An op that fails a format in several ways (its E5M2 cast flushes 99 % of its values, so
its SNR falls too) counts once, under its most severe rule.

A failure rarely sits in one op: E5M2 underflow of a backward MLP shows in every layer's
``add_any``, ``dot_general`` and ``mul`` of ``blocks/mlp``. `causes` folds those rows into
one row per (rule, format, pass, module) so that a reader sees the cause once, with the
ops it covers, the worst of them (its evidence, source line and fix), its severity and
its estimated impact, and sorts causes by severity, then impact.

The module of an op is its scope path without the primitive, cut to `MODULE_DEPTH`
components, with layer numbers folded (``block_0`` and ``block_1`` are ``block_*``;
``blocks/3`` is ``blocks/*``): the layers of a stack share one cause.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from .advisor import FORMAT_RULES, SCALE_RULES, SEVERITY_ORDER, severity_level
from .frames import require_columns

#: Components of the scope path that name a cause's module.
MODULE_DEPTH = 2

CAUSE_COLUMNS = [
    "cause",
    "rule",
    "format",
    "pass",
    "module",
    "severity",
    "impact",
    "n_ops",
    "ops",
    "op",
    "label",
    "source",
    "first_step",
    "first_op",
    "value",
    "worst",
    "evidence",
    "fix",
]

_LAYER = re.compile(r"^(.*[^_\d])_\d+$")
_TITLES = {
    "nonfinite": "NaN/inf",
    "drift": "scale drift",
    "trend": "scale trend",
    "delayed": "delayed-scaling clipping",
    "stall": "updates rounded away",
}


def module_of(name: str, pass_: str, depth: int = MODULE_DEPTH) -> str:
    """The module a cause groups op ``name`` under (module docstring): ``blocks/mlp``
    for ``blocks/mlp/add_any``, ``block_*/attn`` for ``block_1/attn/dot_general``, ""
    for an op outside any scope."""
    parts = [p for p in str(name).split("/")[:-1] if p]
    if parts and parts[0] == pass_:
        parts = parts[1:]
    levels: list[str] = []
    for part in parts:
        if part.isdigit():  # a layer index joins its parent: blocks/3 -> blocks/*
            if not levels:
                levels.append("*")
            elif not levels[-1].endswith("*"):
                levels[-1] += "/*"
            continue
        levels.append(_LAYER.sub(r"\1_*", part))
    return "/".join(levels[: max(depth, 0)])


def worst_text(rule: str, value: float) -> str:
    """A finding's worst value with its unit: ``98.7% flushed``, ``12.5 dB``,
    ``log2 rms -9.1``, ``amax 2^1.5 over``."""
    if not np.isfinite(value):
        return "NaN" if np.isnan(value) else str(value)
    if rule == "nonfinite":
        return f"{100 * value:.3g}% NaN/inf"
    if rule == "overflow":
        return f"{100 * value:.3g}% over max"
    if rule == "underflow":
        return f"{100 * value:.3g}% flushed"
    if rule == "snr":
        return f"SNR {value:.1f} dB"
    if rule == "stall":
        return f"{100 * value:.3g}% of updates lost"
    if rule in ("drift", "trend"):
        return f"log2 rms {value:+.1f}"
    if rule == "delayed":
        return f"amax x{2.0**value:.3g} over the delayed scale"
    return f"{value:.3g}"


def impact_text(impact: float) -> str:
    """An impact, the share of a value lost, as a percentage: ``42%``, ``0.27%``; ``-``
    when not measured (a warning: drift, trend, delayed)."""
    if impact is None or not np.isfinite(impact):
        return "-"
    pct = 100.0 * float(impact)
    return f"{pct:.2g}%" if pct < 10 else f"{pct:.0f}%"


def _title(rule: str, fmt: str, pass_: str, module: str, n: int) -> str:
    what = _TITLES.get(rule, rule)
    if fmt:
        what = f"{fmt} {what}" if rule != "delayed" else f"{what} ({fmt})"
    ops = f"{n} {pass_} op{'s' if n != 1 else ''}"
    return f"{what} in {ops}" + (f" of {module}" if module else "")


def _one_per_cast(f: pd.DataFrame) -> pd.DataFrame:
    """One finding per (op, format): an op that both underflows and loses SNR in a format
    has one cause, its overflow, underflow or snr finding, whichever is most severe (on a
    tie in that order); its impact is the largest of them. The drift or trend of an op
    that a format judges is how it got there: the format's finding stands for it."""
    fmt = f["format"].fillna("").astype(str)
    cast = f["rule"].isin(FORMAT_RULES).to_numpy() & (fmt != "").to_numpy()
    if not cast.any():
        return f
    judged = f["rule"].isin(SCALE_RULES).to_numpy() & f["op"].isin(f["op"][cast])
    f, cast = f[~judged], cast[~judged]
    part = f[cast].assign(_level=severity_level(f[cast]))
    part["_order"] = part["rule"].map({r: i for i, r in enumerate(FORMAT_RULES)})
    if "impact" in part:
        part["impact"] = part.groupby(["op", "format"])["impact"].transform("max")
    part = part.sort_values(["_level", "_order"], ascending=[False, True], kind="stable")
    part = part.drop_duplicates(["op", "format"]).drop(columns=["_level", "_order"])
    return pd.concat([f[~cast], part]).sort_index()


def causes(findings: pd.DataFrame) -> pd.DataFrame:
    """One row per (rule, format, pass, module) of the advisor's ``findings``
    (`scalescope.analysis.advise`), most severe first, then the largest impact (NaN
    last), then the earliest step, then the earliest op in program order (where a cast
    overflows into NaN, the overflow comes before the NaN it causes).

    Columns: ``cause`` (a title: "e5m2 underflow in 4 bwd ops of blocks/mlp"), rule,
    format, pass, module; ``severity`` and ``impact`` (the worst of its findings';
    impact is the estimated share of the value's signal lost, NaN for warnings);
    ``n_ops`` and ``ops`` (the labels of the ops, worst first); ``op``, ``label``,
    ``source``, ``evidence`` and ``fix`` of the worst op (by `severity_level`);
    ``first_step`` (the earliest of its findings); ``first_op`` (its earliest op in
    program order at that step: op ids are in order of appearance); ``value`` (the worst op's) and
    ``worst`` (that value with its unit)."""
    if isinstance(findings, pd.DataFrame) and findings.empty:  # none (columns or not)
        return pd.DataFrame({c: pd.Series(dtype=object) for c in CAUSE_COLUMNS})
    need = ("op", "label", "name", "pass", "rule", "format", "value", "threshold")
    require_columns(findings, need, "findings")
    f = _one_per_cast(findings.reset_index(drop=True))
    level = severity_level(f)
    impact = f["impact"].to_numpy(np.float64) if "impact" in f else np.full(len(f), np.nan)
    modules = [module_of(n, p) for n, p in zip(f["name"].astype(str), f["pass"].astype(str))]
    keys = pd.DataFrame(
        {
            "rule": f["rule"].astype(str),
            "format": f["format"].fillna("").astype(str),
            "pass": f["pass"].astype(str),
            "module": modules,
        }
    )
    rows = []
    for key, idx in keys.groupby(list(keys.columns), sort=False).indices.items():
        rule, fmt, pass_, module = key
        order = idx[np.lexsort((-np.nan_to_num(impact[idx], nan=-1.0), -level[idx]))]
        worst = f.iloc[order[0]]
        labels = list(dict.fromkeys(f["label"].iloc[order].astype(str)))
        first = f["first_step"].iloc[idx] if "first_step" in f else pd.Series(-1, index=idx)
        rows.append(
            dict(
                cause=_title(rule, fmt, pass_, module, len(labels)),
                rule=rule,
                format=fmt,
                module=module,
                severity=str(worst.get("severity", "")) or "low",
                impact=float(np.nanmax(impact[idx])) if np.isfinite(impact[idx]).any() else np.nan,
                n_ops=len(labels),
                ops=labels,
                op=int(worst["op"]),
                label=str(worst["label"]),
                source=str(worst.get("source", "")),
                first_step=int(first.min()),
                value=float(worst["value"]),
                worst=worst_text(rule, float(worst["value"])),
                evidence=str(worst.get("evidence", "")),
                fix=str(worst.get("fix", "")),
                _level=float(level[order[0]]),
                first_op=int(f["op"].iloc[idx][first.to_numpy() == first.min()].min()),
                **{"pass": pass_},
            )
        )
    out = pd.DataFrame(rows)
    rank = out["severity"].map({s: i for i, s in enumerate(SEVERITY_ORDER)}).fillna(9)
    order = np.lexsort(
        (
            -out["_level"].to_numpy(),
            out["first_op"].to_numpy(),
            out["first_step"].to_numpy(),
            -out["impact"].fillna(-1.0).to_numpy(),
            rank.to_numpy(),
        )
    )
    return out.iloc[order][CAUSE_COLUMNS].reset_index(drop=True)
