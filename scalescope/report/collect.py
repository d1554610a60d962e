"""What every report section reads, computed once from one read of the run's statistics
(`_collect`), and `ReportError`: the report cannot be made as asked (bad input)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import analysis as A


class ReportError(Exception):
    """The report cannot be made as asked (bad input): the command exits 2."""


class _RunData:
    """What every section reads: the run's analysis bundle (`scalescope.analysis
    .RunAnalysis`: stats, table, labels, ids, formats, recipes, per_step, whatif,
    findings, masks, thresholds, measured, notes, verdict, causes, incidents; each part
    computed once per reader state) plus the page's one stylesheet (``css``: every Div
    renders in a shadow root)."""

    def __init__(self, bundle: A.RunAnalysis, css: Any = None) -> None:
        self.bundle, self.css = bundle, css

    def __getattr__(self, name: str) -> Any:
        if name == "bundle":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.bundle, name)


#: Per (op, step) worst over loop iterations, and per op the worst of such a series:
#: the analysis bundle's (kept under these names for the sections).
_per_step = A.per_step_worst
_worst = A.worst_step


def _collect(reader: Any, thresholds: A.Thresholds, audit: Sequence[str] = ()) -> _RunData:
    """What the sections read: the run's `scalescope.analysis.RunAnalysis` (computed once
    per reader state, shared with every other view of the reader)."""
    if len(reader.ops) == 0 or len(reader.steps) == 0:
        raise ReportError(f"{reader.path}: the run has no recorded step yet; nothing to report")
    bundle = A.analyse(reader, thresholds=thresholds, audit=tuple(audit))
    try:
        bundle.findings  # noqa: B018 - computed here, where a bad --audit is reported
    except (KeyError, ValueError) as err:
        message = str(err.args[0] if err.args else err)
        if audit and message.startswith("audit: "):  # a format the run does not record
            raise ReportError(f"--audit: {message.removeprefix('audit: ')}") from None
        raise ReportError(f"{reader.path}: its statistics cannot be analysed: {message}") from None
    return _RunData(bundle)
