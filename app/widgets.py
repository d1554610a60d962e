"""What the dashboard's tabs share: tables, HTML snippets (verdict, messages), the
findings and what-if table layouts and the default thresholds."""

from __future__ import annotations

import html
from typing import Any

import pandas as pd
import panel as pn

from scalescope import analysis
from scalescope.analysis.advisor import pct

FINDING_COLUMNS = [
    "severity",
    "rule",
    "format",
    "label",
    "pass",
    "primitive",
    "first_step",
    "steps",
    "evidence",
    "source",
    "fix",
]


def make_table(
    frame: pd.DataFrame, name: str, page_size: int = 20, **kwargs: Any
) -> pn.widgets.Tabulator:
    """A read-only, sortable table."""
    return pn.widgets.Tabulator(
        frame,
        disabled=True,
        pagination="local",
        page_size=page_size,
        show_index=False,
        sizing_mode="stretch_width",
        layout="fit_data_table",
        css_classes=[f"ss-{name}"],
        **kwargs,
    )


def wrap_columns(*columns: str, width: int = 380) -> dict[str, Any]:
    """Tabulator options that wrap the text of ``columns`` in cells ``width`` px wide."""
    return {
        "formatters": {c: {"type": "textarea"} for c in columns},
        "widths": {c: width for c in columns},
    }


def causes_table(causes: pd.DataFrame) -> pd.DataFrame:
    """The findings grouped by cause (`scalescope.analysis.causes`) as the Overview shows
    them: severity, cause, impact and worst value with their units, first step, the worst
    op, its source line and the fix."""
    return pd.DataFrame(
        {
            "severity": causes["severity"],
            "cause": causes["cause"],
            "impact (share of the value lost)": [analysis.impact_text(v) for v in causes["impact"]],
            "worst": causes["worst"],
            "first_step": causes["first_step"],
            "worst op": causes["label"],
            "source": causes["source"],
            "fix": causes["fix"],
        }
    )


#: Views whose figures are computed from statistics: they carry the statistics note.
NOTED_VIEWS = ("Overview", "Heatmap", "Op detail", "Advisor", "Formats")


def statistics_note(notes: list[str]) -> str:
    """The note on sampled statistics / ops measured in turns ("" when there is none)."""
    if not notes:
        return ""
    items = " &nbsp;·&nbsp; ".join(html.escape(n) for n in notes)
    return (
        "<div class='ss-statistics-note' style='color:#8a5a00;background:#fff6e0;"
        f"padding:3px 8px;border-left:3px solid #e0a000'>{items}</div>"
    )


THRESHOLDS = analysis.Thresholds()  # the dashboard's views use the defaults
FORMATS_HEAD = (
    "<h3>Safe ops per pass, format and recipe</h3><p>An op is safe in a format when, over "
    f"the recorded steps, it never overflows, underflows at most "
    f"{pct(THRESHOLDS.underflow)}, keeps its SNR above the format's threshold and "
    "holds no NaN/inf. Block-scaled recipes are recorded with <code>formats=</code>. "
    f"{html.escape(analysis.recipe_rule_text(THRESHOLDS))}</p>"
)
CHEAPEST_HEAD = (
    "<h3>Cheapest safe recipe</h3><p>Ops per pass for which each recipe is the cheapest "
    "that keeps them safe (fewer bits per element, then per-tensor before per-block "
    "scales, then larger blocks); <i>none</i>: no recorded recipe does.</p>"
)


def whatif_table(whatif: pd.DataFrame, labels: pd.Series, last: pd.Series) -> pd.DataFrame:
    """The per-op table of the Formats & recipes view, one row per op of a
    `scalescope.analysis.format_whatif` frame: ``op``, ``label``, ``last measured``,
    ``cheapest recipe`` (with recipes); per format ``F safe``, ``F snr``, ``F why``; per
    recipe, side by side, ``R safe``, ``R underflow``, ``R clipped`` (overflow_R),
    ``R snr``, ``R flushed`` (flushed blocks), ``R why``."""
    flat = pd.DataFrame(index=whatif.index)
    flat["label"] = labels.reindex(whatif.index).to_numpy()
    flat["last measured"] = last.reindex(whatif.index).to_numpy()
    recipes = analysis.whatif_recipes(whatif)
    if recipes:
        flat[analysis.CHEAPEST] = whatif[analysis.CHEAPEST].to_numpy()
    for name in analysis.whatif_groups(whatif):
        flat[f"{name} safe"] = whatif[(name, "safe")]
        if name in recipes:
            flat[f"{name} underflow"] = whatif[(name, "underflow")]
            flat[f"{name} clipped"] = whatif[(name, "overflow")]
        flat[f"{name} snr"] = whatif[(name, "snr")].round(1)
        if name in recipes:
            flat[f"{name} flushed"] = whatif[(name, "block_flush")]
        flat[f"{name} why"] = whatif[(name, "reason")]
    return flat.reset_index()


_VERDICT_STYLE = {
    "healthy": "background:#d9f0d3;color:#1b5e20",
    "at risk": "background:#feb24c;color:#3d2600",
    "failing": "background:#b10026;color:#fff",
}


def verdict_html(v: analysis.Verdict) -> str:
    """A verdict as the dashboard shows it above every view: the headline in the
    verdict's colour, then each reason (cause, op, source line, fix)."""
    style = _VERDICT_STYLE[v.status]
    if v.unjudged and v.status == "healthy":  # nothing measured: not a green light
        style = "background:#e0e0e0;color:#333"
    cls = "ss-verdict ss-verdict-" + v.status.replace(" ", "-")
    out = (
        f"<div class='{cls}' style='{style};font-size:1.2em;font-weight:bold;"
        f"padding:6px 10px;border-radius:4px'>{html.escape(v.headline)}</div>"
    )
    if v.reasons:
        items = "".join(
            f"<li>{html.escape(r.line())}<br><code style='white-space:pre-wrap'>"
            f"fix: {html.escape(r.fix)}</code></li>"
            for r in v.reasons
        )
        out += f"<ol class='ss-verdict-reasons' style='margin:4px 0'>{items}</ol>"
    return out


def verified_html(reader: Any) -> str:
    """The policies this run was trained under or checked against (``scalescope
    verify``), one line each below the verdict; "" when there are none."""
    lines = []
    if reader.meta.get("policy"):
        lines.append("trained under policy " + analysis.policy_text(reader.meta["policy"], 2))
    lines += [analysis.verification_line(r) for r in reader.verifications()]
    if not lines:
        return ""
    items = "".join(f"<li>{html.escape(line)}</li>" for line in lines)
    return f"<ul class='ss-verified' style='margin:4px 0'>{items}</ul>"


def message_html(text: str, kind: str = "info") -> str:
    colors = {"info": "#555", "warn": "#a15c00", "error": "#b00020"}
    return f'<div class="ss-msg ss-{kind}" style="color:{colors[kind]}">{html.escape(text)}</div>'


def when_text(when: pd.Series, n_recorded: int) -> str:
    """``step L (n of N recorded steps, every ~K)`` for an op's row of `RunData.measured`."""
    if pd.isna(when["last_measured"]):
        return "never"
    text = f"step {int(when['last_measured'])} ({int(when['n_measured'])} of {n_recorded} "
    text += "recorded steps"
    gap = when["gap"]
    if pd.notna(gap) and gap > 1:
        text += f", every ~{gap:g}"
    return text + ")"
