"""``--compare``: the report of a run against another run (the JSON ``compare`` entry
and the comparison section)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .. import analysis as A
from .collect import _RunData
from .markup import _e, _num, _stat_note, _table, _td
from .verdicts import _plain, _verdict_dict

#: Rows of the comparison table.
COMPARE_ROWS = 20


def _run_names(a: Any, b: Any) -> tuple[str, str]:
    names = (a.name, b.name)
    return names if names[0] != names[1] and all(names) else ("a", "b")


def _compare_data(data: _RunData, other: Any) -> dict[str, Any]:
    a, b = _run_names(data.reader, other)
    # the values' RMS (data RMS times scale): a scalified run keeps its data near unit
    # scale, so data RMS against a plain run ranks the scales' bookkeeping, not values
    values, unmatched = A.compare_readers(data.reader, other, "value_rms", names=(a, b))
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
    whatif = A.analyse(other, thresholds=data.thresholds).whatif
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
        + f"<h3>Largest differences of the values' RMS (data RMS x scale; log2 {_e(b)}/{_e(a)}), "
        "worst step per op</h3>"
    )
    if drows:
        header = ["op", "pass", "primitive", "step", f"rms {a}", f"rms {b}", "log2 ratio"]
        text += _table(header, drows)
    else:
        text += '<div class="note">No matched op with finite RMS in both runs.</div>'
    return text
