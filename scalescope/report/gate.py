"""The ``--fail-on`` CI gate: parse rules (`parse_fail_on`), check them against what the
run records, and evaluate them on the run's data (`evaluate_rules`).

``--fail-on`` rules (see `parse_fail_on`): comma-separated ``METRIC OP NUMBER``, e.g.
``overflow_e4m3>0,underflow_e5m2>0.01,nonfinite>0``, ``snr_e4m3<20`` or, on a run that
records recipes, ``block_flush_nvfp4>0,underflow_mxfp8_e4m3>1%``; the command exits 1
when any rule trips, naming it with its value, op and step.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from .. import analysis as A
from ..analysis.advisor import pct
from .collect import ReportError, _RunData

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
    "findings, findings_<severity>, findings_<rule> (number of advisor findings); "
    "verdict (the run's verdict: verdict>=at-risk fails an at-risk or failing run, "
    "verdict>=failing a failing one); incidents (number of the flight recorder's "
    "incidents: NaN/Inf or spiking steps, replayed and kept; incidents>0 fails on any); "
    "diverged (1 when the logged loss turned NaN/inf or went up: its end above twice "
    "its first value, or a peak above ten times it; diverged>0). "
    "Fractions take 0.01 or 1%%. Example: verdict>=at-risk,overflow_e4m3>0,nonfinite>0"
)


@dataclass(frozen=True)
class Rule:
    """One ``--fail-on`` rule: trips when ``value <operator> threshold``.

    ``kind``: ``nonfinite``, ``overflow``, ``underflow``, ``snr``, ``block_flush``,
    ``findings``, ``incidents`` (a count), ``diverged`` (1 when the logged loss turned
    NaN/inf or went up, `scalescope.analysis.RunAnalysis.divergence`, else 0) or ``verdict``
    (``threshold``: the rank of a verdict in `scalescope.analysis.STATUSES`: 0 healthy,
    1 at risk, 2 failing); ``format``: the
    format or recipe of overflow/underflow/snr/block_flush
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
    from ..core import formats as _formats
    from ..core import recipes as _recipes

    known = (
        "nonfinite, overflow_F, underflow_F, snr_F (F: "
        + ", ".join(_formats.names())
        + "; optional :all), overflow_R, underflow_R, snr_R, block_flush_R (R: "
        + ", ".join(_recipes.names())
        + "), findings, findings_<severity>, findings_<rule>, verdict, incidents, diverged"
    )
    if not metric:
        raise _bad(piece, f"no metric before the operator; metrics: {known}")
    if metric == "verdict":
        return "verdict", "", "", "", False
    if metric in ("incidents", "diverged"):
        return metric, "", "", "", False
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
      ``findings_<rule>`` (nonfinite, overflow, underflow, snr, stall, drift, trend, delayed):
      number of advisor findings;
    * ``verdict``: the run's verdict (`scalescope.analysis.verdict`), compared with a
      verdict name: ``verdict>=at-risk`` trips on an at-risk or failing run,
      ``verdict>=failing`` (or ``verdict>at-risk``) on a failing one.

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
        if kind == "verdict":
            if op not in (">", ">="):
                raise _bad(piece, "a verdict gets worse as it grows: use >= (verdict>=at-risk)")
            try:
                threshold = float(A.STATUSES.index(A.parse_status(number)))
            except ValueError as err:
                raise _bad(piece, str(err)) from None
            rules.append(Rule(piece, metric, kind, "", "", "", op, threshold))
            continue
        if kind == "snr" and op not in ("<", "<="):
            raise _bad(piece, "SNR gets worse as it falls: use < or <= (e.g. snr_e4m3<20)")
        if kind != "snr" and op not in (">", ">="):
            raise _bad(piece, f"{kind} gets worse as it grows: use > or >=")
        threshold = _parse_number(piece, number, kind in _FRACTION_KINDS)
        if kind in _FRACTION_KINDS and not 0.0 <= threshold <= 1.0:
            raise _bad(piece, f"{threshold:g} is not a fraction in [0, 1] (use 0.01 or 1%)")
        if kind in ("findings", "incidents", "diverged") and threshold < 0:
            raise _bad(piece, f"a number of {kind} cannot be negative ({threshold:g})")
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
    if kind == "verdict":
        return A.STATUSES[int(value)]
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
        label = None
        if rule.kind == "verdict":
            v = data.verdict
            value, step = float(v.rank), v.step
            if v.reasons:
                label, note = v.reasons[0].op, v.reasons[0].cause
        elif rule.kind == "diverged":
            said = data.divergence
            value, note = float(bool(said)), said
        elif rule.kind == "incidents":
            inc = data.incidents
            value = float(len(inc))
            if len(inc):
                first = inc.iloc[0]
                step = int(first["step"])
                if int(first["op"]) >= 0:
                    op = int(first["op"])
                note = f"{first['trigger']}: {first['detail']}"
        elif rule.kind == "findings":
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
                "label": label if op is None else str(data.labels.get(op, f"op {op}")),
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
    if rule.kind == "verdict":
        since = f" from step {step}" if step is not None else ""
        return (
            text
            + f"the run is {_fmt_value(rule.kind, value)}{since}"
            + (f" ({note})" if note else "")
        )
    if rule.kind == "diverged":
        said = "the logged loss diverged" if value else "the logged loss did not diverge"
        return text + said + (f" ({note})" if note else "")
    if rule.kind == "incidents":
        text += f"{_fmt_value(rule.kind, value)} incident(s)"
        if step is not None:
            where = f" at {data.labels.get(op, f'op {op}')} (op {op})" if op is not None else ""
            text += f", the first at step {step}{where}"
        return text
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


def damage_notes(reader: Any) -> list[str]:
    """What the run could not give the report: the writer's damage notes (a failed
    write lost steps) and each part the reader skipped as unreadable."""
    notes = list(getattr(reader, "damage", []) or [])
    for part, why in getattr(reader, "skipped", []) or []:
        notes.append(f"unreadable part {part} skipped ({why})")
    return notes


def damage_result(reader: Any, allow_damaged: bool) -> dict[str, Any] | None:
    """The gate's own rule, added to the ``--fail-on`` results: a damaged run (data
    lost in writing, or parts it cannot read) trips it, since no rule can vouch for
    values it never saw; ``allow_damaged`` judges what was read instead. None for an
    intact run."""
    notes = damage_notes(reader)
    if not notes:
        return None
    tripped = not allow_damaged
    head = "TRIPPED" if tripped else "ok (--allow-damaged)"
    more = f" (+{len(notes) - 1} more)" if len(notes) > 1 else ""
    hint = "; pass --allow-damaged to judge what was read" if tripped else ""
    return {
        "rule": "intact run",
        "metric": "damage",
        "scope": "all",
        "operator": "==",
        "threshold": 0.0,
        "value": float(len(notes)),
        "tripped": tripped,
        "op": None,
        "label": None,
        "step": None,
        "op_value": None,
        "note": "; ".join(notes),
        "text": f"{head}: intact run: the run is damaged: {notes[0]}{more}{hint}",
    }
