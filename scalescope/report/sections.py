"""The text sections of the report page (HTML strings, each shown in a named Bokeh
``Div``): title, ``--fail-on`` results, verdicts per pass and format, advisor findings,
run metadata."""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .. import analysis as A
from ..analysis.advisor import pct
from .collect import _RunData
from .gate import _SEVERITIES, _fmt_value, _metric_kind, damage_notes
from .markup import _e, _source_html, _stat_note, _table, _td
from .verdicts import _plain, _thresholds_dict

#: Findings listed in the HTML table (all of them are in the JSON).
MAX_FINDING_ROWS = 200


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
        _verdict_html(data.verdict),
        f"<div>{len(data.ids)} ops with statistics ({len(reader.ops)} in the op table), "
        f"{len(steps)} recorded steps ({int(steps[0])} to {int(steps[-1])}), "
        f"{'under scalify' if scalified else 'not under scalify'}; status "
        f"{_e(reader.status)}.</div>",
        f"<div><b>{len(f)} findings</b> ({_e(sev)}). <b>{_e(safe)}</b>.</div>",
        _stat_note(data),
        _damage_html(reader),
    ]
    if len(data.incidents):
        first = data.incidents.iloc[0]
        lines.append(
            f'<div class="damaged"><b>{len(data.incidents)} incident(s)</b>: the first at '
            f"step {int(first['step'])} ({_e(first['trigger'])}) at "
            f"{_e(first.get('label') or first['name'] or '?')}.</div>"
        )
    if compare is not None:
        lines.append(f"<div>Compared with run <b>{_e(compare.name)}</b>.</div>")
    stamp = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    lines.append(f'<div class="note">generated {_e(stamp)} from {_e(reader.path)}</div>')
    return "".join(lines)


def _damage_html(reader: Any) -> str:
    """A banner saying what the run lost or could not be read (empty for an intact
    run): the figures below are of what was read."""
    notes = damage_notes(reader)
    if not notes:
        return ""
    items = "".join(f"<li>{_e(n)}</li>" for n in notes)
    return (
        '<div class="damaged" id="damage"><b>This run is damaged</b>: what follows is '
        f"computed from what could be read.<ul>{items}</ul></div>"
    )


def _verdict_html(verdict: A.Verdict) -> str:
    """The run's verdict, first on the page: its headline, then each reason with its op,
    source line and fix."""
    cls = "verdict-" + verdict.status.replace(" ", "-")
    head = f'<div class="verdict {cls}" id="verdict">{_e(verdict.headline)}</div>'
    if not verdict.reasons:
        return head
    items = "".join(
        f'<li><span class="sev-{_e(r.severity)}">{_e(r.severity)}</span> {_e(r.cause)}'
        f"{'' if r.step is None else f', from step {r.step}'}; e.g. <b>{_e(r.op)}</b> "
        f"{_source_html(r.source)}<br><code>{_e(r.fix)}</code></li>"
        for r in verdict.reasons
    )
    return head + f'<ol class="verdict-reasons">{items}</ol>'


def _causes_html(data: _RunData) -> str:
    """The findings grouped by cause (rule, format, pass, module), most severe and
    largest impact first."""
    rows = [
        [
            f'<td><span class="sev-{_e(r["severity"])}">{_e(r["severity"])}</span></td>',
            _td(r["cause"]),
            _td(A.impact_text(r["impact"]), "num"),
            _td(r["worst"], "num"),
            _td(r["first_step"], "num"),
            _td(f"{r['label']} (op {r['op']})"),
            f"<td>{_source_html(r['source'])}</td>",
            f"<td><code>{_e(r['fix'])}</code></td>",
        ]
        for r in data.causes.to_dict("records")
    ]
    header = ["severity", "cause", "impact (share of the value lost)", "worst value", "first step"]
    header += ["worst op", "source", "fix"]
    return "<h3>Causes</h3>" + f'<div class="scroll">{_table(header, rows)}</div>'


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
        recipe_rule = f"<div>{_e(A.recipe_rule_text(t))}</div>"
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


def _noise(record: dict[str, Any]) -> str:
    noise = record.get("noise")
    if noise is None or noise != noise:
        return "-"
    return f"{100 * float(noise):+.2f} %"


def _verified_html(reader: Any) -> str:
    """Policies checked against training on this run (``scalescope verify``): measured
    loss gap and verdict beside the what-if's prediction; "" when there are none."""
    records = reader.verifications()
    policy = reader.meta.get("policy")
    if not records and not policy:
        return ""
    parts = ["<h2>Precision policies</h2>"]
    if policy:
        parts.append(
            f"<div>This run was trained under a policy: {_e(A.policy_text(policy))}.</div>"
        )
    if records:
        rows = []
        for r in records:
            cls = {"safe": "safe-all", "unsafe": "safe-none"}.get(r["verdict"], "")
            rows.append(
                [
                    _td(A.policy_text(r["policy"])),
                    _td(r["steps"], "num"),
                    _td(f"{100 * float(r['gap']):+.2f} %", "num"),
                    _td(_noise(r), "num"),
                    _td(r["verdict"], cls),
                    _td(r.get("predicted") or "-"),
                    _td(A.agreement(r)),
                ]
            )
        parts.append(
            "<div>Each policy was applied to this run's model, seed and batches "
            "(<code>scalescope verify</code>) and trained beside the plain step: the gap "
            "is the relative loss difference over the last tenth of the steps, unsafe beyond "
            "the threshold it was run with (at least twice the noise floor: the gap of the "
            "same values rounded to BF16).</div>"
            + _table(["policy", "steps", "loss gap", "measured", "predicted", "agree"], rows)
        )
    return "".join(parts)


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


def _incidents_html(data: _RunData) -> str:
    """The flight recorder's incidents (empty when there are none): the steps that went
    non-finite or spiked, each with the op it started at and what was found there."""
    inc = data.incidents
    if inc.empty:
        return ""
    rows = [
        [
            _td(int(r["step"]), "num"),
            _td(r["trigger"]),
            _td(f"{r.get('label') or r['name']} (op {int(r['op'])})" if int(r["op"]) >= 0 else "-"),
            f"<td>{_source_html(r['source'] or '')}</td>",
            _td(r["detail"]),
        ]
        for r in inc.to_dict("records")
    ]
    head = (
        f"<h2>Incidents: {len(inc)} step(s) went wrong</h2><div>Each step that produced "
        "NaN/Inf or whose loss or norm spiked was replayed with every op measured; the op "
        "named is where it started.</div>"
    )
    return head + _table(["step", "trigger", "op", "source", "what was found"], rows)


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
            _td(A.worst_text(r.rule, r.worst), "num"),
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
        + _causes_html(data)
        + "<h3>Findings per rule and format</h3>"
        + _table(
            ["severity", "rule", "format", "findings", "ops", "passes", "first step", "worst"],
            srows,
        )
        + "<h3>Findings per op</h3>"
        + more
        + f'<div class="scroll">{_table(header, rows)}</div>'
    )


def _last_measured(data: _RunData, op: int) -> str:
    last = data.measured["last_measured"].get(int(op), np.nan)
    return "-" if pd.isna(last) else str(int(last))


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
