"""HTML pieces of the report page: its style sheet, tables and cells, numbers, source
lines, the note on estimated statistics. Every text goes through ``html.escape``."""

from __future__ import annotations

import html
import linecache
import math
from collections.abc import Sequence
from typing import Any

from .collect import _RunData

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
.verdict { font-size: 1.25em; font-weight: bold; padding: 6px 10px; margin: 6px 0;
  border-radius: 4px; }
.verdict-healthy { background: #d9f0d3; color: #1b5e20; }
.verdict-at-risk { background: #feb24c; color: #3d2600; }
.verdict-failing { background: #b10026; color: #fff; }
.damaged { border: 2px solid #b10026; padding: 6px 10px; margin: 6px 0; }
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
