"""What every report section reads, computed once from one read of the run's statistics
(`_collect`), and `ReportError`: the report cannot be made as asked (bad input)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from .. import analysis as A
from ..analysis import mask_ops
from ..analysis.advisor import fill_ops
from ..analysis.frames import op_table


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


def _collect(reader: Any, thresholds: A.Thresholds, audit: Sequence[str] = ()) -> _RunData:
    if len(reader.ops) == 0 or len(reader.steps) == 0:
        raise ReportError(f"{reader.path}: the run has no recorded step yet; nothing to report")
    stats = reader.stats(wide=True)
    table = op_table(reader.ops)
    formats = A.recorded_formats(stats)
    recipes = A.recorded_recipes(stats)
    per_step = _per_step(stats, formats, recipes)
    nonfinite = per_step["frac_nonfinite"]
    try:
        findings = A.advise(
            stats, reader.ops, meta=reader.meta, thresholds=thresholds, audit=tuple(audit)
        )
    except (KeyError, ValueError) as err:  # an audited format the run does not record
        raise ReportError(f"--audit: {err.args[0] if err.args else err}") from None
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
        findings=findings,
        masks=mask_ops(nonfinite, thresholds.mask_min_steps, fill_ops(table)),
        thresholds=thresholds,
        measured=reader.measured(),
        notes=A.measurement_notes(reader),
        verdict=A.verdict(findings, A.logged_loss(reader.scalar_rows())),
        causes=A.causes(findings),
    )
