"""The JSON verdicts of a report (``--json``; `build_report`'s second value).

Plain JSON (no NaN or Infinity, ``null`` instead), schema ``"scalescope-report"``
version 1::

  {
    "schema": "scalescope-report", "version": 1, "generated": ISO time,
    "statistics": "exact" | "sampled",   # sampled: estimates from <= sample elements/value
    "budget": null | float,              # overhead budget: ops measured in turns
    "sample": null | int,                # the per-value element cap
    "measurement_period": null | float,  # median recorded steps between two measurements
    "notes": [str],                      # what the HTML says next to each figure
    "run": {name, path, status, created, closed, config, formats, recipes, format_info,
            device, versions, graph, every, histograms, sample, budget, statistics,
            "steps": {count, first, last}, "ops": {total, with_stats}},
    "thresholds": {drift_log2, underflow, overflow, nonfinite, snr_db: {fmt: dB},
                   trend_min_points, trend_min_r2, mask_min_steps,
                   delayed_history, delayed_log2, recipe_overflow},
    "summary": {
      "verdicts": {pass: {fmt: {safe, total}}},     # passes input/fwd/bwd/opt/.../all;
                                                    # fmt: every format, then recipe
      "cheapest_recipe": {pass: {recipe: n, ..., "none": n}},  # {} without recipes
      "findings": {total, by_severity: {critical, high, medium, low},
                   by_rule: [{rule, format, severity, findings, ops, passes,
                              first_step, worst}]}},
    "ops": [   # one per op with statistics (aliases and constants have none), by id
      {op, label, name, pass, primitive, shape: [int], dtype, scaled, source, cast_to,
       last_measured,         # last step with a row of the op
       n_measured,            # number of recorded steps with a row of the op
       nonfinite,             # worst fraction of NaN/inf values over the recorded steps
       first_nonfinite_step,  # null if never
       mask,                  # constant non-finite fraction: a mask, not a failure
       log2_rms,              # worst |log2 rms| over the steps, signed (null: none finite)
       formats: {fmt: {safe, reason, snr, overflow, underflow}},  # recipes add block_flush
       cheapest_recipe}],     # the cheapest safe recorded recipe; null: none (or no recipe)
    "incidents": [  # the flight recorder's (reader.incidents()), by step
      {step, trigger, op, name, source, detail, value, formats, process, inputs, ...}],
    "findings": [  # exactly the rows of reader.advise(thresholds=...), same order
      {op, label, name, pass, primitive, source, rule, format, first_step, steps,
       value, threshold, evidence, severity, fix}],
    "fail_on": [   # one per --fail-on rule, in the order given
      {rule, metric, scope, operator, threshold, value, tripped, op, label, step,
       op_value, note}],
    "compare": null | {run, path, names: [a, b], matched, unmatched,
                       statistics, budget, notes,             # of the other run
                       verdicts: {fmt: {safe, total}},        # of the other run
                       largest_differences: [{op_a, op_b, label, pass, primitive,
                                              step, rms_a, rms_b, log2_ratio}]}
  }

Per op and format (`scalescope.analysis.format_whatif`, worst over every recorded step):
``safe`` (bool), ``reason`` (``"ok"`` or the failures: ``"overflow 0.3%"``, ...),
``snr`` (worst dB; null when the cast is exact at every step, i.e. infinite SNR, or
no element is finite), ``overflow`` / ``underflow`` (worst fractions); per recorded
block-scaled recipe the same plus ``block_flush`` (worst fraction of flushed blocks).
"""

from __future__ import annotations

import datetime as _dt
import math
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .. import analysis as A
from .collect import _RunData, _worst
from .gate import _SEVERITIES

REPORT_SCHEMA = "scalescope-report"
REPORT_VERSION = 1


def _plain(x: Any) -> Any:
    """Plain JSON types: numpy scalars -> Python, NaN/inf -> None, tuples -> lists."""
    if isinstance(x, Mapping):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    if isinstance(x, np.ndarray):
        return [_plain(v) for v in x.tolist()]
    if x is None or isinstance(x, str):
        return x
    if isinstance(x, bool | np.bool_):
        return bool(x)
    if isinstance(x, int | np.integer):
        return int(x)
    if isinstance(x, float | np.floating):
        f = float(x)
        return f if math.isfinite(f) else None
    if x is pd.NA or x is pd.NaT:
        return None
    return str(x)


def _thresholds_dict(t: A.Thresholds) -> dict[str, Any]:
    return _plain(asdict(t))


def _cheapest_dict(whatif: pd.DataFrame, table: pd.DataFrame) -> dict[str, dict[str, int]]:
    """``{pass: {recipe: ops whose cheapest safe recipe it is, ..., "none": n}}``; ``{}``
    for a run without recipes."""
    counts = A.cheapest_counts(whatif, table)
    if not len(counts.columns):
        return {}
    return {str(p): {str(c): int(counts.loc[p, c]) for c in counts.columns} for p in counts.index}


def _verdict_dict(counts: pd.DataFrame) -> dict[str, dict[str, dict[str, int]]]:
    formats = list(dict.fromkeys(counts.columns.get_level_values(0)))
    return {
        str(p): {
            f: {"safe": int(counts.loc[p, (f, "safe")]), "total": int(counts.loc[p, (f, "total")])}
            for f in formats
        }
        for p in counts.index
    }


def _ops_json(data: _RunData) -> list[dict[str, Any]]:
    ids = data.ids
    info = data.table.loc[ids]
    nonfinite = _worst(data.per_step["frac_nonfinite"], "max").reindex(ids)
    bad = data.per_step["frac_nonfinite"]
    bad = bad[bad > 0]
    first_bad = (
        pd.Series(bad.index.get_level_values("step"), index=bad.index.get_level_values("op"))
        .groupby(level=0)
        .min()
        .reindex(ids)
    )
    drift = _worst(data.per_step["log2_rms"], "abs").reindex(ids)
    when = data.measured.reindex(ids)
    last_measured = when["last_measured"].tolist()
    n_measured = when["n_measured"].fillna(0).astype(np.int64).tolist()
    fields = {f: A.WHATIF_FIELDS for f in data.formats}
    fields |= {r: A.RECIPE_FIELDS for r in data.recipes}
    cols = {
        fmt: {field: data.whatif[(fmt, field)].reindex(ids).to_numpy() for field in names}
        for fmt, names in fields.items()
    }
    cheapest = A.cheapest_recipe(data.whatif).reindex(ids).replace("", None).tolist()
    masks = set(int(m) for m in data.masks)
    labels = data.labels.reindex(ids).tolist()
    text = {c: info[c].astype(str).tolist() for c in ("name", "pass", "primitive", "dtype")}
    text |= {c: info[c].astype(str).tolist() for c in ("source", "cast_to")}
    shapes = [[int(d) for d in (s or ())] for s in info["shape"]]
    scaled = info["scaled"].astype(bool).tolist()
    worst_nf = nonfinite["value"].tolist()
    first_nf = first_bad.tolist()
    l2 = drift["value"].tolist()
    per_fmt = {fmt: {field: c[field].tolist() for field in c} for fmt, c in cols.items()}
    out = []
    for i, op in enumerate(ids.tolist()):
        out.append(
            {
                "op": op,
                "label": labels[i],
                "name": text["name"][i],
                "pass": text["pass"][i],
                "primitive": text["primitive"][i],
                "shape": shapes[i],
                "dtype": text["dtype"][i],
                "scaled": scaled[i],
                "source": text["source"][i],
                "cast_to": text["cast_to"][i],
                "last_measured": None if np.isnan(last_measured[i]) else int(last_measured[i]),
                "n_measured": n_measured[i],
                "nonfinite": worst_nf[i],
                "first_nonfinite_step": first_nf[i],
                "mask": op in masks,
                "log2_rms": l2[i],
                "formats": {
                    fmt: {field: values[i] for field, values in c.items()}
                    for fmt, c in per_fmt.items()
                },
                "cheapest_recipe": cheapest[i],
            }
        )
    return _plain(out)


def _run_json(reader: Any, data: _RunData) -> dict[str, Any]:
    meta = reader.meta
    steps = reader.steps
    keys = (
        "name",
        "status",
        "created",
        "closed",
        "config",
        "formats",
        "recipes",
        "format_info",
        "device",
        "versions",
        "graph",
        "every",
        "histograms",
    )
    out = {k: meta.get(k) for k in keys}
    out |= {"sample": reader.sample, "budget": reader.budget, "statistics": reader.statistics}
    out["recipes"] = list(reader.recipes)
    out["name"] = reader.name
    out["path"] = str(Path(reader.path).resolve())
    out["steps"] = {
        "count": len(steps),
        "first": int(steps[0]) if len(steps) else None,
        "last": int(steps[-1]) if len(steps) else None,
    }
    out["ops"] = {"total": len(reader.ops), "with_stats": len(data.ids)}
    out["damage"] = list(getattr(reader, "damage", []) or [])
    out["skipped_parts"] = [
        {"path": str(part), "reason": why} for part, why in getattr(reader, "skipped", []) or []
    ]
    return _plain(out)


def _verified(record: dict[str, Any]) -> dict[str, Any]:
    """A kept verification without its loss curves (the report shows the gap)."""
    curves = ("loss_plain", "loss_policy", "loss_control")
    return {k: v for k, v in record.items() if k not in curves}


def _verdicts(
    reader: Any,
    data: _RunData,
    thresholds: A.Thresholds,
    results: list[dict[str, Any]],
    cmp: dict[str, Any] | None,
) -> dict[str, Any]:
    """The JSON document: run, thresholds, summary, ops, findings, the ``--fail-on``
    results (``results``, `evaluate_rules`) and the comparison (``cmp``)."""
    counts = A.verdict_counts(data.whatif, data.table)
    f = data.findings
    verdicts = {
        "schema": REPORT_SCHEMA,
        "version": REPORT_VERSION,
        "generated": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "statistics": reader.statistics,
        "budget": reader.budget,
        "sample": reader.sample,
        "measurement_period": reader.measurement_period(),
        "notes": list(data.notes),
        "run": _run_json(reader, data),
        "verdict": _plain(data.verdict.as_dict()),
        "thresholds": _thresholds_dict(thresholds),
        "summary": {
            "verdicts": _verdict_dict(counts),
            "cheapest_recipe": _cheapest_dict(data.whatif, data.table),
            "findings": {
                "total": len(f),
                "by_severity": {s: int((f["severity"] == s).sum()) for s in _SEVERITIES},
                "by_rule": _plain(A.summary_by_rule(f).to_dict("records")),
            },
        },
        "ops": _ops_json(data),
        "causes": _plain(data.causes.to_dict("records")),
        "findings": _plain(f.to_dict("records")),
        "incidents": _plain(data.incidents.to_dict("records")),
        "fail_on": _plain([{k: v for k, v in r.items() if k != "text"} for r in results]),
        "compare": _plain(cmp),
        "policy": _plain(reader.meta.get("policy")),
        "verified": _plain([_verified(r) for r in reader.verifications()]),
    }
    return verdicts
