"""The report's "worst ops": which ops (`_worst_ops`), each with its details, verdict
per format, exponent histogram at its worst step and, with recipes, block scales."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from .. import analysis as A
from .collect import _RunData, _worst
from .heatmaps import _heatmap_metrics
from .markup import _WIDTH, _e, _num, _source_html, _stat_note, _table, _td
from .sections import _last_measured

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
    format metric and in log2 rms, never an op constant by construction (a mask fill, an
    optimizer scalar: `scalescope.analysis.constant_ops`). ``step``: where the histogram
    is drawn: the first step with NaN/inf for a nonfinite finding (the step it went
    wrong, not the step where all is NaN), the first step that clips for a delayed
    finding, else the op's worst step in the finding's metric."""
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
        if r["rule"] in ("nonfinite", "delayed", "stall"):
            step = int(r["first_step"])
        else:
            metric, how = _WORST_METRIC.get(
                r["rule"], (f"{r['rule']}_{r['format']}", "min" if r["rule"] == "snr" else "max")
            )
            step = _op_worst_step(data, op, metric, how)
        what = " ".join(x for x in (r["severity"], r["rule"], r["format"]) if x)
        picks[op] = (f"{what}: {r['evidence']}", step)
    fill = [m for m in _heatmap_metrics(data) if m != "frac_nonfinite"][::-1]
    constants = set(A.constant_ops(data.table, data.stats).tolist())  # never "worst"
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
            if int(op) not in picks and int(op) not in constants:
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
    from ..core import formats as _formats

    return {f: info.get(f) or _formats.get(f) for f in formats}


def _worst_op_models(data: _RunData, n_worst: int) -> list[Any]:
    from bokeh.models import Div

    from .. import viz

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
