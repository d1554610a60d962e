"""The precision-audit report: one standalone HTML file, JSON verdicts and a CI gate.

``scalescope report RUN -o audit.html [--json audit.json] [--fail-on RULES]
[--compare OTHER_RUN]`` (or `write_report` from Python) reads a recorded run and writes:

* **HTML**: one file that opens offline with no network request (plain Bokeh, BokehJS
  inline; no Panel, no CDN, no web font). Sections, each a Bokeh model with a stable
  ``name`` (``Bokeh.documents[0].get_model_by_name(name)``): ``report-title``,
  ``report-fail-on`` (with ``--fail-on``), ``report-summary`` (safe ops per pass and
  format or recipe; with recipes, the cheapest safe recipe's op count per pass),
  ``report-findings`` (the advisor's findings with their source lines),
  ``report-heatmaps`` then ``report-heatmap-<metric>`` figures (op x step, rows and steps
  merged in their worse direction when there are more than ``max_ops`` / ``max_steps``),
  ``report-worst-ops`` then per op ``report-op-<k>``, ``report-histogram-<k>`` (exponent
  histogram at the op's worst step) and, with recipes, ``report-scales-<k>`` (each
  recipe's block scales over steps against its element format's range), ``report-loss`` (loss
  curve; both runs with ``--compare``), ``report-scale-graph`` (the latest scale graph
  recorded with `Run.scale_graph`, if any), ``report-compare`` (with ``--compare``) and
  ``report-metadata``. The file stays a few MB for thousands of ops (measured in the
  tests). When the run's statistics are estimates (recorded with ``sample=``) or its ops
  were measured in turns under an overhead budget, every section computed from
  statistics carries a note saying so (``class="stat-note"``); heatmap cells of an op not
  measured at a step are blank (hatched), measured NaN cells grey.
* **JSON** (plain JSON: no NaN or Infinity, ``null`` instead), schema
  ``"scalescope-report"`` version 1::

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

``--fail-on`` rules (see `parse_fail_on`): comma-separated ``METRIC OP NUMBER``, e.g.
``overflow_e4m3>0,underflow_e5m2>0.01,nonfinite>0``, ``snr_e4m3<20`` or, on a run that
records recipes, ``block_flush_nvfp4>0,underflow_mxfp8_e4m3>1%``; the command exits 1
when any rule trips, naming it with its value, op and step.

Exit status of the command: 0 written and no rule tripped, 1 a ``--fail-on`` rule
tripped, 2 bad input (missing run, not a run, malformed rule, format the run does not
audit or recipe it does not record, unwritable output), with a one-line message on
stderr.
"""

from __future__ import annotations

import datetime as _dt
import html
import json
import linecache
import math
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from . import analysis as A
from .analysis.advisor import _masks, pct
from .analysis.frames import op_table, reduce_groups

REPORT_SCHEMA = "scalescope-report"
REPORT_VERSION = 1

#: Heatmap rows (ops) and columns (steps) beyond which neighbours are merged.
DEFAULT_MAX_OPS = 600
DEFAULT_MAX_STEPS = 200
#: Ops shown with a histogram in the "worst ops" section.
DEFAULT_WORST = 6
#: Findings listed in the HTML table (all of them are in the JSON).
MAX_FINDING_ROWS = 200
#: Rows of the comparison table.
COMPARE_ROWS = 20
#: Points of a loss curve (more are thinned, keeping every non-finite one).
MAX_SCALAR_POINTS = 4000


class ReportError(Exception):
    """The report cannot be made as asked (bad input): the command exits 2."""


# ---------------------------------------------------------------------------------------
# --fail-on rules

_FRACTION_KINDS = ("nonfinite", "overflow", "underflow", "block_flush")
#: Metric kinds of formats and recipes (``<kind>_<name>``), longest prefix first.
_FORMAT_KINDS = ("overflow", "underflow", "snr")
_RECIPE_KINDS = ("block_flush", *_FORMAT_KINDS)
_SEVERITIES = A.SEVERITY_ORDER
_RULE_NAMES = A.RULES
_OPERATORS = (">=", "<=", ">", "<")
_RULE_RE = re.compile(r"^(?P<metric>[^<>=!\s]*)\s*(?P<op>[<>=!]+)\s*(?P<number>.*)$")

FAIL_ON_HELP = (
    "comma-separated rules METRIC OP NUMBER; exit 1 when one trips. Metrics: nonfinite "
    "(worst fraction of NaN/inf values in any op, masks excluded); overflow_F, "
    "underflow_F (worst fraction, F one of e4m3, e5m2, fp16, bf16, over the ops the run "
    "casts to F; add :all for every op, as if cast); snr_F (worst SNR in dB, use < or <=); "
    "overflow_R, underflow_R, snr_R, block_flush_R for a block-scaled recipe R the run "
    "records (mxfp8_e4m3, nvfp4, ...; over every op); "
    "findings, findings_<severity>, findings_<rule> (number of advisor findings). "
    "Fractions take 0.01 or 1%%. Example: overflow_e4m3>0,underflow_e5m2>0.01,nonfinite>0"
)


@dataclass(frozen=True)
class Rule:
    """One ``--fail-on`` rule: trips when ``value <operator> threshold``.

    ``kind``: ``nonfinite``, ``overflow``, ``underflow``, ``snr``, ``block_flush`` or
    ``findings``; ``format``: the format or recipe of overflow/underflow/snr/block_flush
    rules (else ``""``); ``recipe``: True when ``format`` is a block-scaled recipe;
    ``scope``: ``cast`` (ops the run casts to the format) or ``all`` for format rules,
    always ``all`` for recipe rules (nothing is cast to a recipe), ``""`` otherwise;
    ``select``: for findings counts, the severity or rule counted (``""``: all
    findings)."""

    text: str
    metric: str
    kind: str
    format: str
    scope: str
    select: str
    operator: str
    threshold: float
    recipe: bool = False

    def trips(self, value: float | None) -> bool:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return False
        return {
            ">": value > self.threshold,
            ">=": value >= self.threshold,
            "<": value < self.threshold,
            "<=": value <= self.threshold,
        }[self.operator]


def _bad(piece: str, why: str) -> ValueError:
    return ValueError(f"--fail-on rule {piece!r}: {why}")


def _split_kind(name: str) -> tuple[str, str]:
    """``("block_flush", "nvfp4")`` from ``"block_flush_nvfp4"``; ``("", name)`` when it
    starts with no format or recipe metric."""
    for kind in _RECIPE_KINDS:
        if name.startswith(kind + "_"):
            return kind, name[len(kind) + 1 :]
    return "", name


def _parse_metric(piece: str, metric: str) -> tuple[str, str, str, str, bool]:
    """``(kind, format, scope, select, recipe)`` of a metric name, or a ValueError."""
    from .core import formats as _formats
    from .core import recipes as _recipes

    known = (
        "nonfinite, overflow_F, underflow_F, snr_F (F: "
        + ", ".join(_formats.names())
        + "; optional :all), overflow_R, underflow_R, snr_R, block_flush_R (R: "
        + ", ".join(_recipes.names())
        + "), findings, findings_<severity>, findings_<rule>"
    )
    if not metric:
        raise _bad(piece, f"no metric before the operator; metrics: {known}")
    name, _, scope = metric.partition(":")
    if name == "nonfinite" or name == "findings" or name.startswith("findings_"):
        if scope:
            raise _bad(piece, f"':{scope}' applies only to overflow_F, underflow_F and snr_F")
        if name == "nonfinite":
            return "nonfinite", "", "", "", False
        select = name[len("findings_") :] if name != "findings" else ""
        if select and select not in _SEVERITIES and select not in _RULE_NAMES:
            raise _bad(
                piece,
                f"unknown findings selector {select!r}; severities: {', '.join(_SEVERITIES)}; "
                f"rules: {', '.join(_RULE_NAMES)}",
            )
        return "findings", "", "", select, False
    kind, fmt = _split_kind(name)
    if not kind:
        raise _bad(piece, f"unknown metric {metric!r}; metrics: {known}")
    recipe = _recipes.is_recipe(fmt)
    if recipe:
        fmt = _recipes.get(fmt).name
    elif kind == "block_flush":
        why = (
            f"block_flush applies to block-scaled recipes, not the format {fmt!r}"
            if fmt in _formats.names()
            else f"unknown recipe {fmt!r} in {name!r}"
        )
        raise _bad(piece, f"{why}; recipes: {', '.join(_recipes.names())}")
    elif fmt not in _formats.names():
        raise _bad(
            piece,
            f"unknown format or recipe {fmt!r} in {name!r}; formats: "
            f"{', '.join(_formats.names())}; recipes: {', '.join(_recipes.names())}",
        )
    scope = scope or ("all" if recipe else "cast")
    if scope not in ("cast", "all"):
        raise _bad(piece, f"unknown scope ':{scope}'; use ':all' (every op) or nothing")
    if recipe and scope != "all":
        raise _bad(piece, f"a recipe rule checks every op; drop ':{scope}'")
    return kind, fmt, scope, "", recipe


def _parse_number(piece: str, text: str, fraction: bool) -> float:
    text = text.strip()
    percent = text.endswith("%")
    body = text[:-1].strip() if percent else text
    try:
        value = float(body)
    except ValueError:
        value = math.nan
    if not body or not math.isfinite(value):
        raise _bad(piece, f"{text!r} is not a finite number" if text else "no number after it")
    if percent:
        if not fraction:
            raise _bad(piece, "a percentage only makes sense for a fraction metric")
        value /= 100.0
    return value


def parse_fail_on(text: str | Sequence[str]) -> list[Rule]:
    """Parse ``--fail-on`` rules: ``METRIC OP NUMBER`` separated by commas (a list of such
    strings, e.g. a repeated option, is joined).

    Metrics:

    * ``nonfinite``: worst fraction of NaN/inf values of any op at any recorded step
      (masks, a constant fraction of ``-inf`` at every step, are excluded as the advisor
      does);
    * ``overflow_F`` / ``underflow_F``: worst fraction of values above F's max / flushed to
      zero, over the ops the run casts to F (``cast_to == F``, the ops the advisor checks);
      ``overflow_F:all`` checks every op as if it were cast (the format what-if);
    * ``snr_F`` (``:all`` likewise): worst quantisation SNR in dB; it gets worse as it
      falls, so it takes ``<`` or ``<=``;
    * ``overflow_R``, ``underflow_R``, ``snr_R``, ``block_flush_R`` for a block-scaled
      recipe R (``mxfp8_e4m3``, ``nvfp4``, ...; see `scalescope.core.recipes`): the same
      statistics of the recipe, and the worst fraction of its blocks flushed to zero,
      over every op (no op is cast to a recipe). Any recipe name parses; the report
      refuses a rule on a recipe the run does not record;
    * ``findings``, ``findings_<severity>`` (critical, high, medium, low),
      ``findings_<rule>`` (nonfinite, overflow, underflow, snr, drift, trend, delayed):
      number of advisor findings.

    Operators: ``>``, ``>=`` for fractions and counts, ``<``, ``<=`` for SNR. Numbers:
    finite; fractions in [0, 1], also written as percentages (``1%``); counts >= 0.

    Raises ValueError naming the bad piece (empty rule, unknown metric, format or recipe,
    bad operator, bad number)."""
    if isinstance(text, str):
        text = [text]
    pieces = [p.strip() for chunk in text for p in str(chunk).split(",")]
    if not pieces or all(not p for p in pieces):
        raise ValueError("--fail-on: no rule given (e.g. overflow_e4m3>0,nonfinite>0)")
    rules = []
    for piece in pieces:
        if not piece:
            raise ValueError(f"--fail-on: empty rule in {','.join(text)!r} (stray comma?)")
        m = _RULE_RE.match(piece)
        if m is None:
            raise _bad(piece, "expected METRIC OP NUMBER, e.g. overflow_e4m3>0 (no operator found)")
        metric, op, number = m.group("metric"), m.group("op"), m.group("number")
        kind, fmt, scope, select, recipe = _parse_metric(piece, metric)
        if op not in _OPERATORS:
            raise _bad(piece, f"bad operator {op!r}; use >, >=, < or <=")
        if kind == "snr" and op not in ("<", "<="):
            raise _bad(piece, "SNR gets worse as it falls: use < or <= (e.g. snr_e4m3<20)")
        if kind != "snr" and op not in (">", ">="):
            raise _bad(piece, f"{kind} gets worse as it grows: use > or >=")
        threshold = _parse_number(piece, number, kind in _FRACTION_KINDS)
        if kind in _FRACTION_KINDS and not 0.0 <= threshold <= 1.0:
            raise _bad(piece, f"{threshold:g} is not a fraction in [0, 1] (use 0.01 or 1%)")
        if kind == "findings" and threshold < 0:
            raise _bad(piece, f"a number of findings cannot be negative ({threshold:g})")
        rules.append(Rule(piece, metric, kind, fmt, scope, select, op, threshold, recipe))
    return rules


def _as_rules(fail_on: str | Sequence[str] | Sequence[Rule] | None) -> list[Rule]:
    if fail_on is None:
        return []
    if isinstance(fail_on, Rule):
        return [fail_on]
    if not isinstance(fail_on, str) and all(isinstance(r, Rule) for r in fail_on):
        return list(fail_on)
    return parse_fail_on(fail_on)


# ---------------------------------------------------------------------------------------
# per-op data


@dataclass
class _RunData:
    """What every section needs, computed once from one read of the statistics."""

    reader: Any
    stats: pd.DataFrame
    table: pd.DataFrame  # op table with optional columns filled
    labels: pd.Series
    ids: np.ndarray  # ops with statistics
    formats: list[str]  # plain formats audited
    recipes: list[str]  # block-scaled recipes recorded
    per_step: pd.DataFrame  # (op, step) -> worst over loop iterations
    whatif: pd.DataFrame
    findings: pd.DataFrame
    masks: np.ndarray
    thresholds: A.Thresholds
    measured: pd.DataFrame  # per op: first/last measured step, n_measured, gap
    notes: list[str]  # sampled statistics / ops measured in turns (empty: exact, in full)
    css: Any = None  # the page's one InlineStyleSheet (every Div renders in a shadow root)


def _per_step(
    stats: pd.DataFrame, formats: Sequence[str], recipes: Sequence[str] = ()
) -> pd.DataFrame:
    """Per (op, step): the worst over loop iterations (NaN skipped) of the statistics
    the rules and the worst-op picks read (a recipe's flushed blocks too); ``log2_rms``
    of larger magnitude (rms 0 has no scale: NaN)."""
    rms = stats["rms"].astype(np.float64).to_numpy()
    with np.errstate(divide="ignore", invalid="ignore"):
        l2 = np.log2(np.where(rms > 0, rms, np.nan))
    cols: dict[str, str] = {"frac_nonfinite": "max"}
    for fmt in [*formats, *recipes]:
        cols |= {f"overflow_{fmt}": "max", f"underflow_{fmt}": "max", f"snr_{fmt}": "min"}
    for recipe in recipes:
        cols[f"block_flush_{recipe}"] = "max"
    frame = stats[list(cols)].astype(np.float64).assign(log2_rms=l2)
    keys = [stats["op"].to_numpy(np.int64), stats["step"].to_numpy(np.int64)]
    grouped = frame.groupby(keys, sort=True)
    out = grouped.agg(cols)
    hi, lo = grouped["log2_rms"].max(), grouped["log2_rms"].min()
    out["log2_rms"] = hi.where(~(hi.abs() < lo.abs()), lo)
    out.index.names = ["op", "step"]
    return out


def _worst(values: pd.Series, how: str) -> pd.DataFrame:
    """Per op: the worst value of an (op, step) series (``max``, ``min`` or ``abs``; NaN
    skipped) and the first step reaching it. Columns value, step; index op."""
    values = values.dropna()
    if values.empty:
        return pd.DataFrame({"value": [], "step": []}, index=pd.Index([], name="op"))
    v = values.to_numpy(np.float64)
    key = {"max": -v, "min": v, "abs": -np.abs(v)}[how]
    frame = pd.DataFrame(
        {
            "op": values.index.get_level_values("op").to_numpy(np.int64),
            "step": values.index.get_level_values("step").to_numpy(np.int64),
            "value": v,
            "key": key,
        }
    )
    best = frame.sort_values(["op", "key", "step"], kind="stable").drop_duplicates("op")
    return best.set_index("op")[["value", "step"]]


def _collect(reader: Any, thresholds: A.Thresholds) -> _RunData:
    if len(reader.ops) == 0 or len(reader.steps) == 0:
        raise ReportError(f"{reader.path}: the run has no recorded step yet; nothing to report")
    stats = reader.stats(wide=True)
    table = op_table(reader.ops)
    formats = A.recorded_formats(stats)
    recipes = A.recorded_recipes(stats)
    per_step = _per_step(stats, formats, recipes)
    nonfinite = per_step["frac_nonfinite"]
    return _RunData(
        reader=reader,
        stats=stats,
        table=table,
        labels=A.op_labels(table),
        ids=np.unique(stats["op"].to_numpy(np.int64)),
        formats=formats,
        recipes=recipes,
        per_step=per_step,
        whatif=A.format_whatif(stats, reader.ops, thresholds=thresholds, meta=reader.meta),
        findings=A.advise(stats, reader.ops, meta=reader.meta, thresholds=thresholds),
        masks=_masks(nonfinite, thresholds.mask_min_steps),
        thresholds=thresholds,
        measured=reader.measured(),
        notes=A.measurement_notes(reader),
    )


# ---------------------------------------------------------------------------------------
# rule evaluation


def _check_rules(rules: Sequence[Rule], formats: Sequence[str], recipes: Sequence[str]) -> None:
    """A rule on a format the run does not audit, or on a recipe it does not record, is
    bad input (`ReportError`), named with what the run has."""
    for rule in rules:
        if rule.recipe and rule.format not in recipes:
            raise ReportError(
                f"--fail-on rule {rule.text!r}: this run does not record recipe "
                f"{rule.format} (recorded recipes: {', '.join(recipes) or 'none'}; record "
                f"it with formats=(..., {rule.format!r}) or scalescope train --formats)"
            )
        if not rule.recipe and rule.format and rule.format not in formats:
            raise ReportError(
                f"--fail-on rule {rule.text!r}: this run does not audit {rule.format} "
                f"(audited: {', '.join(formats) or 'none'})"
            )


def _metric_kind(metric: str) -> str:
    """The kind of a rule's metric text (``nonfinite``, ``block_flush``, ``snr``, ...)."""
    name = metric.partition(":")[0]
    kind, _ = _split_kind(name)
    return kind or ("findings" if name.startswith("findings") else name)


def _fmt_value(kind: str, value: float | None) -> str:
    if value is None:
        return "n/a"
    if kind in _FRACTION_KINDS:
        return f"{pct(value)} ({value:.4g})"
    if kind == "snr":
        return f"{value:.1f} dB"
    return f"{int(value)}"


def _earliest(series: pd.Series) -> tuple[int, int, float]:
    """``(op, step, value)`` of the earliest row of an (op, step) series: first step,
    then lowest op id."""
    ops = series.index.get_level_values("op").to_numpy(np.int64)
    steps = series.index.get_level_values("step").to_numpy(np.int64)
    i = int(np.lexsort((ops, steps))[0])
    return int(ops[i]), int(steps[i]), float(series.iloc[i])


def evaluate_rules(data: _RunData, rules: Sequence[Rule]) -> list[dict[str, Any]]:
    """Value of each rule on the run and whether it trips (see `parse_fail_on`).

    ``value``: the worst value over the ops in the rule's scope and every recorded step
    (a count for findings rules; None when no op is in scope). ``op``/``step``: where the
    rule first trips (earliest step, then lowest op id; for findings rules the first
    finding, i.e. the most severe), or where the worst value is when it does not trip;
    ``op_value``: the op's value there."""
    out = []
    for rule in rules:
        value, op, step, op_value, note = None, None, None, None, ""
        if rule.kind == "findings":
            f = data.findings
            if rule.select in _SEVERITIES:
                f = f[f["severity"] == rule.select]
            elif rule.select:
                f = f[f["rule"] == rule.select]
            value = float(len(f))
            if len(f):
                op, step = int(f["op"].iloc[0]), int(f["first_step"].iloc[0])
                op_value = float(f["value"].iloc[0])
        else:
            if rule.kind == "nonfinite":
                series = data.per_step["frac_nonfinite"]
                keep = ~series.index.get_level_values("op").isin(data.masks)
                series = series[keep]
                if len(data.masks):
                    note = f"{len(data.masks)} mask op(s) excluded"
            else:
                series = data.per_step[f"{rule.kind}_{rule.format}"]
                if rule.scope == "cast":
                    cast = data.table.index[data.table["cast_to"] == rule.format]
                    series = series[series.index.get_level_values("op").isin(cast)]
                    if not len(series):
                        note = (
                            f"no op is cast to {rule.format} in this run; "
                            f"{rule.kind}_{rule.format}:all checks every op"
                        )
            series = series.dropna()
            if len(series):
                bad = series.min() if rule.kind == "snr" else series.max()
                value = float(bad)
                hits = series[series == bad]
                if rule.trips(value):
                    trips = series.to_numpy(np.float64)
                    trips = {
                        ">": trips > rule.threshold,
                        ">=": trips >= rule.threshold,
                        "<": trips < rule.threshold,
                        "<=": trips <= rule.threshold,
                    }[rule.operator]
                    hits = series[trips]
                op, step, op_value = _earliest(hits)
            elif not note:
                note = "no finite value"
        tripped = rule.trips(value)
        out.append(
            {
                "rule": rule.text,
                "metric": rule.metric,
                "scope": rule.scope,
                "operator": rule.operator,
                "threshold": rule.threshold,
                "value": value,
                "tripped": bool(tripped),
                "op": op,
                "label": None if op is None else str(data.labels.get(op, f"op {op}")),
                "step": step,
                "op_value": op_value,
                "note": note,
                "text": _rule_line(rule, value, op, step, op_value, data, tripped, note),
            }
        )
    return out


def _rule_line(rule, value, op, step, op_value, data, tripped, note) -> str:
    head = "TRIPPED" if tripped else "ok"
    text = f"{head}: {rule.text}: "
    if rule.kind == "findings":
        text += f"{_fmt_value(rule.kind, value)} finding(s)"
        if op is not None:
            text += f", the first at {data.labels.get(op, f'op {op}')} (op {op}), step {step}"
    else:
        text += f"worst {_fmt_value(rule.kind, value)}"
        where = f"{data.labels.get(op, f'op {op}')} (op {op}), step {step}"
        if op is not None and tripped:
            text += f"; first trips at {where}"
            if op_value != value:
                text += f" ({_fmt_value(rule.kind, op_value)})"
        elif op is not None:
            text += f" at {where}"
    return text + (f" [{note}]" if note else "")


# ---------------------------------------------------------------------------------------
# JSON


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
    return _plain(out)


# ---------------------------------------------------------------------------------------
# HTML pieces (every text goes through html.escape)

_CSS = """
:host { font-family: sans-serif; font-size: 13px; color: #222; }
h1 { font-size: 22px; margin: 4px 0 6px 0; }
h2 { font-size: 17px; margin: 18px 0 6px 0; border-bottom: 1px solid #ccc; }
h3 { font-size: 14px; margin: 10px 0 4px 0; }
table { border-collapse: collapse; margin: 4px 0 8px 0; }
th, td { border: 1px solid #ddd; padding: 3px 6px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.safe-all { background: #d9f0d3; } td.safe-some { background: #fee8c8; }
td.safe-none { background: #fcbba1; }
.sev-critical { color: #fff; background: #b10026; padding: 1px 4px; border-radius: 3px; }
.sev-high { color: #fff; background: #e31a1c; padding: 1px 4px; border-radius: 3px; }
.sev-medium { background: #feb24c; padding: 1px 4px; border-radius: 3px; }
.sev-low { background: #ffeda0; padding: 1px 4px; border-radius: 3px; }
.tripped { color: #fff; background: #b10026; font-weight: bold; padding: 1px 4px; }
.passed { background: #d9f0d3; padding: 1px 4px; }
code, pre { font-family: monospace; font-size: 12px; }
pre { background: #f7f7f7; padding: 2px 4px; margin: 2px 0; white-space: pre-wrap; }
.note { color: #666; font-style: italic; }
.stat-note { color: #8a5a00; background: #fff6e0; border-left: 3px solid #e0a000;
  padding: 2px 8px; margin: 4px 0; }
.scroll { max-height: 640px; overflow: auto; }
"""

_WIDTH = 1150


def _e(x: Any) -> str:
    return html.escape("" if x is None else str(x))


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], cls: str = "") -> str:
    """An HTML table; ``rows`` hold already-escaped HTML cells (``<td ...>`` included)."""
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join(f"<tr>{''.join(r)}</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _td(x: Any, cls: str = "") -> str:
    return f'<td class="{cls}">{_e(x)}</td>' if cls else f"<td>{_e(x)}</td>"


def _source_html(source: str) -> str:
    """The source location, and the line of code itself when the file is readable."""
    text = f"<code>{_e(source)}</code>"
    path, _, line = str(source).rpartition(":")
    if path and line.isdigit() and not path.startswith("<"):
        code = linecache.getline(path, int(line)).strip()
        if code:
            text += f"<pre>{_e(code)}</pre>"
    return text


def _num(value: Any, spec: str = ".3g") -> str:
    try:
        f = float(value)
    except (TypeError, ValueError):
        return str(value)
    if math.isnan(f):
        return "n/a"
    if math.isinf(f):
        return "inf" if f > 0 else "-inf"
    return format(f, spec)


def _stat_note(data: _RunData) -> str:
    """The note on sampled statistics / ops measured in turns, for a section computed from
    statistics ("" for exact statistics measured in full)."""
    if not data.notes:
        return ""
    return f'<div class="stat-note">{_e(" · ".join(data.notes))}</div>'


# ---------------------------------------------------------------------------------------
# sections


def _title_html(reader: Any, data: _RunData, compare: Any) -> str:
    f = data.findings
    by_sev = f["severity"].value_counts()
    sev = ", ".join(f"{int(by_sev.get(s, 0))} {s}" for s in _SEVERITIES)
    steps = reader.steps
    scalified = bool((reader.meta.get("graph") or {}).get("scalify", False))
    fp8 = [fmt for fmt in data.formats if fmt in ("e4m3", "e5m2")] or data.formats
    safe = "; ".join(
        f"{int(data.whatif[(fmt, 'safe')].sum())}/{len(data.whatif)} ops safe in {fmt}"
        for fmt in fp8
    )
    lines = [
        f"<h1>scalescope precision audit: {_e(reader.name)}</h1>",
        f"<div>{len(data.ids)} ops with statistics ({len(reader.ops)} in the op table), "
        f"{len(steps)} recorded steps ({int(steps[0])} to {int(steps[-1])}), "
        f"{'under scalify' if scalified else 'not under scalify'}; status "
        f"{_e(reader.status)}.</div>",
        f"<div><b>{len(f)} findings</b> ({_e(sev)}). <b>{_e(safe)}</b>.</div>",
        _stat_note(data),
    ]
    if compare is not None:
        lines.append(f"<div>Compared with run <b>{_e(compare.name)}</b>.</div>")
    stamp = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    lines.append(f'<div class="note">generated {_e(stamp)} from {_e(reader.path)}</div>')
    return "".join(lines)


def _fail_on_html(results: Sequence[dict[str, Any]]) -> str:
    rows = []
    for r in results:
        state = (
            '<span class="tripped">TRIPPED</span>'
            if r["tripped"]
            else '<span class="passed">ok</span>'
        )
        kind = _metric_kind(r["metric"])
        rows.append(
            [
                f"<td>{state}</td>",
                _td(r["rule"]),
                _td(_fmt_value(kind, r["value"]), "num"),
                _td("" if r["label"] is None else f"{r['label']} (op {r['op']})"),
                _td("" if r["step"] is None else r["step"], "num"),
                _td(r["note"]),
            ]
        )
    n = sum(r["tripped"] for r in results)
    head = f"<h2>CI gate (--fail-on): {n} of {len(results)} rule(s) tripped</h2>"
    return head + _table(["result", "rule", "value", "worst op", "step", "note"], rows)


def _summary_html(data: _RunData) -> str:
    counts = A.verdict_counts(data.whatif, data.table)
    formats = list(dict.fromkeys(counts.columns.get_level_values(0)))
    rows = []
    for p in counts.index:
        cells = [_td(p)]
        for fmt in formats:
            safe, total = int(counts.loc[p, (fmt, "safe")]), int(counts.loc[p, (fmt, "total")])
            cls = "safe-all" if safe == total else "safe-none" if safe == 0 else "safe-some"
            cells.append(_td(f"{safe}/{total}", f"num {cls}"))
        rows.append(cells)
    t = data.thresholds
    snr = ", ".join(f"{fmt} {t.snr_for(fmt):g} dB" for fmt in formats)
    title = "format or recipe" if data.recipes else "format"
    recipe_rule = ""
    if data.recipes:
        recipe_rule = _RECIPE_RULE.format(over=pct(t.recipe_overflow), under=pct(t.underflow))
    return (
        f"<h2>Verdicts: ops safe per pass and {title}</h2>"
        "<div>An op is safe in a format when, at every recorded step, casting it loses "
        f"no value to overflow (more than {pct(t.overflow)}), flushes at most "
        f"{pct(t.underflow)} of its non-zero values to zero, keeps its "
        f"quantisation SNR above the threshold ({_e(snr)}) and holds no NaN/inf. "
        "Every op is audited against every format, whether or not the run casts it.</div>"
        + recipe_rule
        + _stat_note(data)
        + _table(["pass", *formats], rows)
        + _cheapest_html(data)
    )


_RECIPE_RULE = (
    "<div>A block-scaled recipe is safe for an op when, at every recorded step, it clips at "
    "most {over} of the elements (recipes clip by design; clipping that matters lowers the "
    "SNR), flushes at most {under} of the non-zero values and no block to zero, keeps the "
    "SNR above its element format's threshold and holds no NaN/inf.</div>"
)


def _cheapest_html(data: _RunData) -> str:
    """Per pass, how many ops each recipe is the cheapest safe one for ("" without
    recipes)."""
    counts = A.cheapest_counts(data.whatif, data.table)
    if not len(counts.columns):
        return ""
    rows = [
        [_td(p), *(_td(int(counts.loc[p, c]), "num") for c in counts.columns)] for p in counts.index
    ]
    return (
        "<h3>Cheapest safe recipe per pass</h3><div>Each op counts under the cheapest "
        "recorded recipe that keeps it safe (fewer bits per element first, then one scale "
        "per tensor before scales per block, then larger blocks); <i>none</i>: no recorded "
        "recipe does.</div>" + _table(["pass", *counts.columns], rows)
    )


def _findings_html(data: _RunData) -> str:
    f = data.findings
    head = "<h2>Advisor findings: where dynamic rescaling is needed</h2>" + _stat_note(data)
    if f.empty:
        return head + "<div>No findings: every op stays within the advisor's thresholds.</div>"
    summary = A.summary_by_rule(f)
    srows = [
        [
            f'<td><span class="sev-{_e(r.severity)}">{_e(r.severity)}</span></td>',
            _td(r.rule),
            _td(r.format),
            _td(r.findings, "num"),
            _td(r.ops, "num"),
            _td(r.passes),
            _td(r.first_step, "num"),
            _td(_num(r.worst), "num"),
        ]
        for r in summary.itertuples(index=False)
    ]
    rows = []
    for r in f.head(MAX_FINDING_ROWS).to_dict("records"):
        rows.append(
            [
                f'<td><span class="sev-{_e(r["severity"])}">{_e(r["severity"])}</span></td>',
                _td(r["rule"]),
                _td(r["format"]),
                _td(f"{r['label']} (op {r['op']})"),
                _td(r["pass"]),
                _td(r["primitive"]),
                _td(r["first_step"], "num"),
                _td(_last_measured(data, r["op"]), "num"),
                _td(r["evidence"]),
                f"<td>{_source_html(r['source'])}</td>",
                f"<td><code>{_e(r['fix'])}</code></td>",
            ]
        )
    more = ""
    if len(f) > MAX_FINDING_ROWS:
        more = (
            f'<div class="note">{MAX_FINDING_ROWS} of {len(f)} findings shown (most severe '
            "first); the JSON report (--json) holds all of them.</div>"
        )
    header = ["severity", "rule", "format", "op", "pass", "primitive", "first step"]
    header += ["last measured", "evidence", "source", "fix"]
    return (
        head
        + _table(
            ["severity", "rule", "format", "findings", "ops", "passes", "first step", "worst"],
            srows,
        )
        + more
        + f'<div class="scroll">{_table(header, rows)}</div>'
    )


def _last_measured(data: _RunData, op: int) -> str:
    last = data.measured["last_measured"].get(int(op), np.nan)
    return "-" if pd.isna(last) else str(int(last))


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
    fmt_rows = data.findings[data.findings["format"] != ""]
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

    from . import viz

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


_WORST_METRIC = {
    "drift": ("log2_rms", "abs"),
    "trend": ("log2_rms", "abs"),
}


def _op_worst_step(data: _RunData, op: int, metric: str, how: str) -> int | None:
    """First step at which ``op`` reaches its worst value of ``metric``."""
    values = data.per_step[metric]
    values = values[values.index.get_level_values("op") == op]
    worst = _worst(values, how)
    return int(worst["step"].iloc[0]) if len(worst) else None


def _worst_ops(data: _RunData, n: int) -> list[tuple[int, str, int | None]]:
    """Up to ``n`` ``(op, why, step)``: first one op per kind of finding (rule and format,
    most severe first), then the other findings' ops, then the ops worst in the heatmaps'
    format metric and in log2 rms. ``step``: where the histogram is drawn: the first step
    with NaN/inf for a nonfinite finding (the step it went wrong, not the step where all
    is NaN), the first step that clips for a delayed finding, else the op's worst step in
    the finding's metric."""
    picks: dict[int, tuple[str, int | None]] = {}
    f = data.findings
    first_of_kind = ~f.duplicated(["rule", "format"])
    ordered = pd.concat([f[first_of_kind], f[~first_of_kind]]) if len(f) else f
    for r in ordered.to_dict("records"):
        if len(picks) >= n:
            break
        op = int(r["op"])
        if op in picks:
            continue
        if r["rule"] in ("nonfinite", "delayed"):
            step = int(r["first_step"])
        else:
            metric, how = _WORST_METRIC.get(
                r["rule"], (f"{r['rule']}_{r['format']}", "min" if r["rule"] == "snr" else "max")
            )
            step = _op_worst_step(data, op, metric, how)
        what = " ".join(x for x in (r["severity"], r["rule"], r["format"]) if x)
        picks[op] = (f"{what}: {r['evidence']}", step)
    fill = [m for m in _heatmap_metrics(data) if m != "frac_nonfinite"][::-1]
    for metric in fill:
        if len(picks) >= n:
            break
        how = "min" if metric.startswith("snr") else "abs" if metric == "log2_rms" else "max"
        worst = _worst(data.per_step[metric], how)
        if worst.empty:
            continue
        values = worst["value"]
        key = {"min": values, "abs": -values.abs(), "max": -values}[how]
        for op in worst.index[np.argsort(key.to_numpy(), kind="stable")]:
            if len(picks) >= n:
                break
            if int(op) not in picks:
                value, step = worst.loc[op, "value"], int(worst.loc[op, "step"])
                picks[int(op)] = (f"worst {metric}: {_num(value, '.4g')} at step {step}", step)
    return [(op, why, step) for op, (why, step) in picks.items()]


def _op_detail_html(data: _RunData, k: int, op: int, why: str, step: int | None) -> str:
    row = data.table.loc[op]
    shape = "x".join(str(int(d)) for d in (row["shape"] or ())) or "scalar"
    info = [
        ("pass", row["pass"]),
        ("primitive", row["primitive"]),
        ("shape", f"{shape} {row['dtype']}"),
        ("scaled", "yes" if row["scaled"] else "no"),
        ("cast to", row["cast_to"] or "-"),
        ("worst step", "-" if step is None else step),
        ("last measured", _last_measured(data, op)),
    ]
    if data.recipes:
        info.append(("cheapest safe recipe", data.whatif.loc[op, A.CHEAPEST] or "none"))
    cells = "".join(f"<b>{_e(a)}</b> {_e(b)} &nbsp; " for a, b in info)
    verdicts = [_verdict_cells(data, op, fmt) for fmt in [*data.formats, *data.recipes]]
    header = ["format", "verdict", "reason", "SNR dB", "overflow", "underflow"]
    header += ["flushed blocks"] if data.recipes else []
    return (
        f"<h3>{k + 1}. {_e(data.labels[op])} (op {op})</h3>"
        f"<div>{cells}</div><div>{_source_html(row['source'])}</div>"
        f"<div><b>why:</b> {_e(why)}</div>" + _table(header, verdicts)
    )


def _verdict_cells(data: _RunData, op: int, fmt: str) -> list[str]:
    """One row of an op's verdict table: the what-if's verdict of ``fmt`` (a format or a
    recipe), and its flushed blocks when the run records recipes ("-" for a format)."""
    w = data.whatif.loc[op]
    cells = [
        _td(fmt),
        _td("safe" if w[(fmt, "safe")] else "unsafe"),
        _td(w[(fmt, "reason")]),
        _td(_num(w[(fmt, "snr")], ".1f"), "num"),
        _td(_num(w[(fmt, "overflow")], ".3g"), "num"),
        _td(_num(w[(fmt, "underflow")], ".3g"), "num"),
    ]
    if data.recipes:
        flush = _num(w[(fmt, "block_flush")], ".3g") if fmt in data.recipes else "-"
        cells.append(_td(flush, "num"))
    return cells


def _format_info(reader: Any, formats: Sequence[str]) -> dict[str, Any]:
    info = dict(reader.meta.get("format_info") or {})
    if all(f in info for f in formats):
        return {f: info[f] for f in formats}
    from .core import formats as _formats

    return {f: info.get(f) or _formats.get(f) for f in formats}


def _worst_op_models(data: _RunData, n_worst: int) -> list[Any]:
    from bokeh.models import Div

    from . import viz

    reader = data.reader
    picks = _worst_ops(data, n_worst)
    intro = (
        "<h2>Worst ops</h2><div>The ops of the most severe findings (then the worst in the "
        "heatmaps' format metric), each with its exponent histogram at its worst step: "
        "bars are log2|x| bins, shaded boxes each format's normal and subnormal range, "
        "dashed lines their max."
        + (
            " With block-scaled recipes, a line figure per op shows each recipe's block "
            "scales over the steps (dotted) and the |x| range they give its element format "
            "(band), against the op's abs-max (black)."
            if data.recipes
            else ""
        )
        + "</div>"
        + _stat_note(data)
    )
    if not reader.hist_columns:
        intro += '<div class="note">This run was recorded without histograms.</div>'
    models: list[Any] = [
        Div(text=intro, name="report-worst-ops", width=_WIDTH, stylesheets=[data.css])
    ]
    fmt_info = _format_info(reader, data.formats)
    for k, (op, why, step) in enumerate(picks):
        if step is None:  # no finite value: the op's last measured step (it has a row there)
            last = data.measured["last_measured"].get(op, np.nan)
            step = int(last) if pd.notna(last) else int(reader.steps[-1])
        models.append(
            Div(
                text=_op_detail_html(data, k, op, why, step),
                name=f"report-op-{k}",
                width=_WIDTH,
                stylesheets=[data.css],
            )
        )
        if reader.hist_columns:
            counts = reader.hist(op, step)
            models.append(
                viz.exponent_histogram(
                    counts,
                    fmt_info,
                    title=f"{data.labels[op]}: exponent histogram at step {step}",
                    name=f"report-histogram-{k}",
                )
            )
        if data.recipes:
            rows = data.stats[data.stats["op"].to_numpy() == op]
            models.append(
                viz.scale_ranges(
                    A.block_scales(rows, data.recipes),
                    A.recipe_elements(data.recipes),
                    absmax=rows.groupby("step")["absmax"].max(),
                    title=f"{data.labels[op]}: block scales vs element exponent range",
                    name=f"report-scales-{k}",
                )
            )
    return models


def _thin_scalars(frame: pd.DataFrame) -> pd.DataFrame:
    """At most about `MAX_SCALAR_POINTS` rows, keeping every row with a non-finite value."""
    if len(frame) <= MAX_SCALAR_POINTS:
        return frame
    stride = math.ceil(len(frame) / MAX_SCALAR_POINTS)
    keep = np.zeros(len(frame), bool)
    keep[::stride] = True
    keep[-1] = True
    values = frame.to_numpy(np.float64, na_value=np.nan)
    keep |= np.isinf(values).any(axis=1)
    # the first NaN of a column that never recovers (a diverged loss) must survive
    nan = np.isnan(values)
    for j in range(values.shape[1]):
        if nan[:, j].any():
            keep[int(np.argmax(nan[:, j]))] = True
    return frame[keep]


def _run_names(a: Any, b: Any) -> tuple[str, str]:
    names = (a.name, b.name)
    return names if names[0] != names[1] and all(names) else ("a", "b")


def _loss_models(data: _RunData, compare: Any) -> list[Any]:
    from bokeh.models import Div

    from . import viz

    runs = {data.reader.name: data.reader.scalars}
    if compare is not None:
        a, b = _run_names(data.reader, compare)
        runs = {a: data.reader.scalars, b: compare.scalars}
    runs = {k: _thin_scalars(v) for k, v in runs.items()}
    has_loss = any({"loss", "val_loss"} & set(v.columns) for v in runs.values())
    text = "<h2>Loss</h2>"
    if not has_loss:
        text += '<div class="note">No loss was logged (run.log(step, loss=...)).</div>'
    models: list[Any] = [
        Div(text=text, name="report-loss-section", width=_WIDTH, stylesheets=[data.css])
    ]
    figure = viz.loss_curve(runs, name="report-loss")
    models.append(figure)
    return models


def _compare_data(data: _RunData, other: Any) -> dict[str, Any]:
    a, b = _run_names(data.reader, other)
    values, unmatched = A.compare_readers(data.reader, other, "rms", names=(a, b))
    diffs = values[np.isfinite(values["log2_ratio"].to_numpy(np.float64))]
    rows: list[dict[str, Any]] = []
    if len(diffs):
        diffs = diffs.assign(_abs=diffs["log2_ratio"].abs())
        top = diffs.sort_values(["_abs", "step"], ascending=[False, True], kind="stable")
        top = top.drop_duplicates(f"op_{a}").head(COMPARE_ROWS)
        for d in top.to_dict("records"):
            rows.append(
                {
                    "op_a": int(d[f"op_{a}"]),
                    "op_b": int(d[f"op_{b}"]),
                    "label": d["label"],
                    "pass": d["pass"],
                    "primitive": d["primitive"],
                    "step": int(d["step"]),
                    "rms_a": d[f"value_{a}"],
                    "rms_b": d[f"value_{b}"],
                    "log2_ratio": d["log2_ratio"],
                }
            )
    matched = values[f"op_{a}"].nunique() if len(values) else 0
    other_stats = other.stats(wide=True)
    whatif = A.format_whatif(other_stats, other.ops, thresholds=data.thresholds, meta=other.meta)
    counts = A.verdict_counts(whatif, other.ops)
    verdicts = _verdict_dict(counts).get("all", {})
    return _plain(
        {
            "run": other.name,
            "path": str(Path(other.path).resolve()),
            "names": [a, b],
            "matched": int(matched),
            "unmatched": int(len(unmatched)),
            "verdicts": verdicts,
            "largest_differences": rows,
            "statistics": other.statistics,
            "budget": other.budget,
            "notes": A.measurement_notes(other),
        }
    )


def _compare_html(data: _RunData, cmp: dict[str, Any]) -> str:
    a, b = cmp["names"]
    mine = _verdict_dict(A.verdict_counts(data.whatif, data.table)).get("all", {})
    fmts = list(dict.fromkeys([*mine, *cmp["verdicts"]]))
    vrows = []
    for fmt in fmts:
        x, y = mine.get(fmt), cmp["verdicts"].get(fmt)
        vrows.append(
            [
                _td(fmt),
                _td(f"{x['safe']}/{x['total']}" if x else "-", "num"),
                _td(f"{y['safe']}/{y['total']}" if y else "-", "num"),
            ]
        )
    drows = [
        [
            _td(f"{r['label']} (op {r['op_a']} / {r['op_b']})"),
            _td(r["pass"]),
            _td(r["primitive"]),
            _td(r["step"], "num"),
            _td(_num(r["rms_a"]), "num"),
            _td(_num(r["rms_b"]), "num"),
            _td(_num(r["log2_ratio"], "+.2f"), "num"),
        ]
        for r in cmp["largest_differences"]
    ]
    text = (
        f"<h2>Comparison: {_e(a)} (this run) vs {_e(b)}</h2>"
        f"<div>{cmp['matched']} ops matched by (pass, name, primitive, shape); "
        f"{cmp['unmatched']} without a partner (casts and rescales one run adds).</div>"
        + _stat_note(data)
        + "".join(f'<div class="stat-note">{_e(b)}: {_e(n)}</div>' for n in cmp["notes"])
        + "<h3>Safe ops, all passes</h3>"
        + _table(["format", a, b], vrows)
        + f"<h3>Largest differences of data RMS (log2 {_e(b)}/{_e(a)}), worst step per op</h3>"
    )
    if drows:
        header = ["op", "pass", "primitive", "step", f"rms {a}", f"rms {b}", "log2 ratio"]
        text += _table(header, drows)
    else:
        text += '<div class="note">No matched op with finite RMS in both runs.</div>'
    return text


def _metadata_html(reader: Any, data: _RunData) -> str:
    meta = reader.meta
    steps = reader.steps
    rows = [
        ("name", reader.name),
        ("path", str(Path(reader.path).resolve())),
        ("status", reader.status),
        ("created", meta.get("created")),
        ("closed", meta.get("closed")),
        (
            "recorded steps",
            f"{len(steps)} ({int(steps[0])} to {int(steps[-1])}), every {meta.get('every')}",
        ),
        ("ops", f"{len(reader.ops)} in the op table, {len(data.ids)} with statistics"),
        ("formats audited", ", ".join(data.formats)),
        ("recipes recorded", ", ".join(data.recipes) or "none"),
        ("histograms", "yes" if reader.hist_columns else "no"),
        ("config", json.dumps(_plain(meta.get("config") or {}), sort_keys=True)),
        ("graph", json.dumps(_plain(meta.get("graph") or {}), sort_keys=True)),
        ("device", json.dumps(_plain(meta.get("device") or {}), sort_keys=True)),
        ("versions", json.dumps(_plain(meta.get("versions") or {}), sort_keys=True)),
        ("thresholds", json.dumps(_thresholds_dict(data.thresholds), sort_keys=True)),
    ]
    body = [[_td(k), f"<td><code>{_e(v)}</code></td>"] for k, v in rows]
    return "<h2>Run metadata</h2>" + _table(["field", "value"], body)


# ---------------------------------------------------------------------------------------
# entry points


def _check_limit(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    return int(value)


def build_report(
    reader: Any,
    *,
    compare: Any = None,
    thresholds: A.Thresholds | None = None,
    fail_on: str | Sequence[str] | Sequence[Rule] | None = None,
    max_ops: int = DEFAULT_MAX_OPS,
    max_steps: int = DEFAULT_MAX_STEPS,
    worst: int = DEFAULT_WORST,
) -> tuple[str, dict[str, Any]]:
    """The report of run ``reader`` (a `scalescope.open_run` reader): ``(html, verdicts)``.

    ``html``: a complete standalone page (see the module docstring for its sections);
    ``verdicts``: the JSON document (plain types; ``json.dumps(verdicts)`` is the JSON
    report). ``compare``: another reader, drawn in the loss curve and compared op by op.
    ``thresholds``: the advisor's (default `Thresholds()`). ``fail_on``: rules (text or
    `Rule`s) evaluated into ``verdicts["fail_on"]`` and shown at the top of the page.
    ``max_ops`` / ``max_steps``: heatmap rows and columns beyond which neighbours are
    merged (keeps the file small for thousands of ops); ``worst``: ops shown with a
    histogram. Raises `ReportError` for a run without recorded steps or a rule on a
    format the run does not audit, ValueError for a malformed rule.
    """
    page, verdicts, _ = _build(
        reader,
        compare=compare,
        thresholds=thresholds,
        rules=_as_rules(fail_on),
        max_ops=max_ops,
        max_steps=max_steps,
        worst=worst,
        html=True,
    )
    return page, verdicts


def _build(
    reader: Any,
    *,
    compare: Any,
    thresholds: A.Thresholds | None,
    rules: list[Rule],
    max_ops: int,
    max_steps: int,
    worst: int,
    html: bool,
) -> tuple[str | None, dict[str, Any], list[str]]:
    """`build_report`, the HTML only when ``html``; also the rules' one-line results."""
    with np.errstate(invalid="ignore", divide="ignore"):  # NaN statistics are expected
        return _build_quiet(reader, compare, thresholds, rules, max_ops, max_steps, worst, html)


def _build_quiet(reader, compare, thresholds, rules, max_ops, max_steps, worst, html):
    thresholds = A.Thresholds() if thresholds is None else thresholds
    max_ops, max_steps = _check_limit("max_ops", max_ops), _check_limit("max_steps", max_steps)
    worst = _check_limit("worst", worst)
    data = _collect(reader, thresholds)
    _check_rules(rules, data.formats, data.recipes)
    results = evaluate_rules(data, rules)
    cmp = _compare_data(data, compare) if compare is not None else None
    page = _page(data, compare, cmp, results, max_ops, max_steps, worst) if html else None

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
        "findings": _plain(f.to_dict("records")),
        "fail_on": _plain([{k: v for k, v in r.items() if k != "text"} for r in results]),
        "compare": cmp,
    }
    return page, verdicts, [r["text"] for r in results]


def _page(
    data: _RunData,
    compare: Any,
    cmp: dict[str, Any] | None,
    results: list[dict[str, Any]],
    max_ops: int,
    max_steps: int,
    worst: int,
) -> str:
    """The standalone HTML: one Bokeh column of named sections."""
    from bokeh.layouts import column
    from bokeh.models import Div, InlineStyleSheet

    from . import viz

    reader = data.reader
    data.css = InlineStyleSheet(css=_CSS)

    def div(text: str, name: str) -> Div:
        return Div(text=text, name=name, width=_WIDTH, stylesheets=[data.css])

    models: list[Any] = [div(_title_html(reader, data, compare), "report-title")]
    if results:
        models.append(div(_fail_on_html(results), "report-fail-on"))
    models.append(div(_summary_html(data), "report-summary"))
    models.append(div(_findings_html(data), "report-findings"))
    models += _heatmaps(data, max_ops, max_steps)
    models += _worst_op_models(data, worst)
    models += _loss_models(data, compare)
    models += _scale_graph_models(data)
    if cmp is not None:
        models.append(div(_compare_html(data, cmp), "report-compare"))
    models.append(div(_metadata_html(reader, data), "report-metadata"))
    return viz.standalone_html(
        column(*models, name="report"), title=f"scalescope audit: {reader.name}"
    )


def _scale_graph_models(data: _RunData) -> list[Any]:
    """The latest scale graph recorded in the run (`Run.scale_graph`), if any."""
    from bokeh.models import Div

    from . import viz

    steps = data.reader.scale_graph_steps
    if not steps:
        return []
    step = steps[-1]
    frame = data.reader.scale_graph(step)
    text = (
        f"<h2>Scale graph</h2><p>Each op's value (circle) and gradient (triangle) as log2 RMS "
        f"at step {step} (recorded at steps {', '.join(map(str, steps))}), with each format's "
        "normal range shaded and its subnormal floor dashed.</p>"
    )
    fig = viz.scale_graph_figure(frame, data.formats, title=f"scale graph, step {step}")
    fig.name, fig.sizing_mode, fig.width = "report-scale-graph", "fixed", _WIDTH
    head = Div(text=text, name="report-scale-graph-section", width=_WIDTH, stylesheets=[data.css])
    return [head, fig]


def _open(path: str | Path) -> Any:
    from .store import open_run

    return open_run(path)


def write_report(
    run: str | Path | Any,
    html_path: str | Path | None,
    json_path: str | Path | None = None,
    fail_on: str | Sequence[str] | Sequence[Rule] | None = None,
    compare: str | Path | Any = None,
    *,
    thresholds: A.Thresholds | None = None,
    max_ops: int = DEFAULT_MAX_OPS,
    max_steps: int = DEFAULT_MAX_STEPS,
    quiet: bool = False,
) -> int:
    """Write the report of ``run`` (a path or reader) to ``html_path`` and/or
    ``json_path`` (parent folders created), print where, and return the exit status:
    0, or 1 when a ``fail_on`` rule trips (each rule's line is printed, the tripped ones
    naming value, op and step). Bad input raises: ValueError (malformed rule),
    `ReportError`, `scalescope.RunError` / FileNotFoundError (no run there), OSError
    (cannot write); `main_report` turns those into exit status 2."""
    rules = _as_rules(fail_on)  # a malformed rule fails before any reading
    reader = run if hasattr(run, "stats") else _open(run)
    other = None
    if compare is not None:
        other = compare if hasattr(compare, "stats") else _open(compare)
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    say(f"scalescope report: {reader.path}: {len(reader.ops)} ops, {len(reader.steps)} steps")
    page, verdicts, lines = _build(
        reader,
        compare=other,
        thresholds=thresholds,
        rules=rules,
        max_ops=max_ops,
        max_steps=max_steps,
        worst=DEFAULT_WORST,
        html=html_path is not None,
    )
    if html_path is not None:
        path = Path(html_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(page, encoding="utf-8")
        say(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")
    if json_path is not None:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(verdicts, indent=1, allow_nan=False) + "\n", encoding="utf-8")
        say(f"wrote {path}")
    f = verdicts["summary"]["findings"]
    by_sev = ", ".join(f"{v} {k}" for k, v in f["by_severity"].items() if v)
    say(f"{f['total']} finding(s){f' ({by_sev})' if by_sev else ''}")
    for line in lines:
        print(line, flush=True)
    tripped = [r["rule"] for r in verdicts["fail_on"] if r["tripped"]]
    if tripped:
        print(f"scalescope report: --fail-on tripped: {', '.join(tripped)}", file=sys.stderr)
        return 1
    return 0


def add_parser(subparsers: Any) -> Any:
    """Add the ``report`` command to an argparse subparsers object."""
    p = subparsers.add_parser(
        "report",
        help="write a standalone HTML precision audit and JSON verdicts; a CI gate",
        description="Write the precision audit of RUN: one standalone HTML file that opens "
        "offline (verdicts per pass and format, advisor findings with source lines, heatmaps, "
        "worst ops with histograms, loss curve, run metadata) and/or JSON verdicts per op. "
        "Exit status: 0 ok, 1 a --fail-on rule tripped, 2 bad input.",
    )
    p.add_argument("run", help="a run directory")
    p.add_argument("-o", "--output", metavar="HTML", help="the HTML report to write")
    p.add_argument("--json", metavar="JSON", help="the JSON verdicts to write")
    p.add_argument("--fail-on", metavar="RULES", action="append", help=FAIL_ON_HELP)
    p.add_argument("--compare", metavar="OTHER_RUN", help="another run to compare with")
    p.add_argument(
        "--max-ops",
        type=int,
        default=DEFAULT_MAX_OPS,
        help=f"heatmap rows before neighbouring ops are merged (default {DEFAULT_MAX_OPS})",
    )
    p.add_argument(
        "--max-steps",
        type=int,
        default=DEFAULT_MAX_STEPS,
        help=f"heatmap columns before steps are merged (default {DEFAULT_MAX_STEPS})",
    )
    return p


def main_report(args: Any) -> int:
    """Run the ``report`` command from parsed arguments; returns the exit status."""

    def fail(message: str) -> int:
        print(f"scalescope report: error: {message}", file=sys.stderr)
        return 2

    if args.output is None and args.json is None and not args.fail_on:
        return fail("nothing to do: give -o HTML, --json JSON and/or --fail-on RULES")
    if args.max_ops < 1 or args.max_steps < 1:
        return fail("--max-ops and --max-steps must be >= 1")
    try:
        rules = parse_fail_on(args.fail_on) if args.fail_on else []
    except ValueError as err:
        return fail(str(err))
    from .store import RunError

    try:
        return write_report(
            args.run,
            args.output,
            args.json,
            fail_on=rules,
            compare=args.compare,
            max_ops=args.max_ops,
            max_steps=args.max_steps,
        )
    except (ReportError, RunError, FileNotFoundError) as err:
        return fail(str(err))
    except OSError as err:
        return fail(f"cannot write the report: {err}")
