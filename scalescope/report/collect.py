"""What every report section reads, computed once from one read of the run's statistics
(`_collect`), and `ReportError`: the report cannot be made as asked (bad input)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from .. import analysis as A


class ReportError(Exception):
    """The report cannot be made as asked (bad input): the command exits 2."""


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
    verdict: A.Verdict  # the run's verdict (findings and the logged loss)
    causes: pd.DataFrame  # the findings, one row per cause
    incidents: pd.DataFrame  # the flight recorder's incidents (`RunReader.incidents`)
    css: Any = None  # the page's one InlineStyleSheet (every Div renders in a shadow root)


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
        findings = bundle.findings
    except (KeyError, ValueError) as err:  # an audited format the run does not record
        raise ReportError(f"--audit: {err.args[0] if err.args else err}") from None
    return _RunData(
        reader=reader,
        stats=bundle.stats,
        table=bundle.table,
        labels=bundle.labels,
        ids=bundle.ids,
        formats=bundle.formats,
        recipes=bundle.recipes,
        per_step=bundle.per_step,
        whatif=bundle.whatif,
        findings=findings,
        masks=bundle.masks,
        thresholds=thresholds,
        measured=bundle.measured,
        notes=bundle.notes,
        verdict=bundle.verdict,
        causes=bundle.causes,
        incidents=bundle.incidents,
    )
