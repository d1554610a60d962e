"""Format what-if: would each op survive a cast to FP8 / FP16 / BF16?

Every recorded op is audited against every format on the device (overflow, underflow,
SNR of the cast), whether or not the run casts it; this module turns those statistics
into a verdict per op and format, with the reason, and counts verdicts per pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from .advisor import Thresholds, pct
from .frames import check_stats, format_list, op_table, pass_rank, require_columns

WHATIF_FIELDS = ("safe", "reason", "snr", "overflow", "underflow")


def _last_steps(stats: pd.DataFrame, last_steps: int | None) -> pd.DataFrame:
    if last_steps is None:
        return stats
    if isinstance(last_steps, bool) or not isinstance(last_steps, int | np.integer):
        raise TypeError(f"last_steps: expected an int or None, got {last_steps!r}")
    if last_steps < 1:
        raise ValueError(f"last_steps: must be >= 1, got {last_steps}")
    keep = np.unique(stats["step"].to_numpy())[-last_steps:]
    return stats[stats["step"].isin(keep)]


def format_whatif(
    stats: pd.DataFrame,
    ops: pd.DataFrame,
    formats: str | Sequence[str] | None = None,
    *,
    thresholds: Thresholds | None = None,
    last_steps: int | None = None,
    meta: dict[str, Any] | None = None,
) -> pd.DataFrame:
    """Verdict per op (index: op id, ascending) and format (default: every audited
    format in ``stats``).

    Columns: a MultiIndex ``(format, field)`` with fields ``safe`` (bool), ``reason``
    (``"ok"`` or the failures joined by ``"; "``: ``"nonfinite 100.0%"``,
    ``"overflow 0.3%"``, ``"underflow 4.1%"``, ``"snr 12.3 dB < 25.5 dB"``), ``snr``
    (worst dB), ``overflow`` and ``underflow`` (worst fractions).

    The worst value over all recorded steps and loop iterations decides (only the last
    ``last_steps`` recorded steps when given). An op whose data already holds NaN/inf is
    not safe in any format (the cast cannot repair it). ``thresholds``: the advisor's
    (`Thresholds`); ``meta``: run metadata, only to derive the SNR threshold of a format
    missing from ``thresholds.snr_db``.
    """
    thresholds = Thresholds() if thresholds is None else thresholds
    if not isinstance(thresholds, Thresholds):
        raise TypeError(f"thresholds: expected a Thresholds, got {type(thresholds).__name__}")
    stats = _last_steps(check_stats(stats), last_steps)
    table = op_table(ops)
    names = format_list(formats, stats, "formats")
    unknown = np.setdiff1d(stats["op"].unique(), table.index.to_numpy())
    if len(unknown):
        raise KeyError(f"ops: op id {int(unknown[0])} appears in stats but not in ops")
    op = stats["op"].to_numpy(np.int64)
    ids = np.unique(op)
    if "frac_nonfinite" in stats.columns:
        nonfinite = stats["frac_nonfinite"].astype(np.float64).groupby(op).max().reindex(ids)
    else:
        nonfinite = pd.Series(0.0, index=ids)
    parts = {}
    for fmt in names:
        over = stats[f"overflow_{fmt}"].astype(np.float64).groupby(op).max().reindex(ids)
        under = stats[f"underflow_{fmt}"].astype(np.float64).groupby(op).max().reindex(ids)
        snr = stats[f"snr_{fmt}"].astype(np.float64).groupby(op).min().reindex(ids)
        snr_thr = thresholds.snr_for(fmt, meta)
        reasons = []
        for nf, ov, un, sn in zip(nonfinite, over, under, snr):
            why = []
            if nf > thresholds.nonfinite:
                why.append(f"nonfinite {pct(nf)}")
            if ov > thresholds.overflow:
                why.append(f"overflow {pct(ov)}")
            if un > thresholds.underflow:
                why.append(f"underflow {pct(un)}")
            if sn < snr_thr:
                why.append(f"snr {sn:.1f} dB < {snr_thr:g} dB")
            reasons.append("; ".join(why) or "ok")
        reason = pd.Series(reasons, index=ids, dtype=object)
        parts[fmt] = pd.DataFrame(
            {
                "safe": (reason == "ok").to_numpy(),
                "reason": reason.to_numpy(),
                "snr": snr.to_numpy(),
                "overflow": over.to_numpy(),
                "underflow": under.to_numpy(),
            },
            index=pd.Index(ids, name="op"),
        )
    if not parts:
        columns = pd.MultiIndex.from_arrays([[], []], names=["format", "field"])
        return pd.DataFrame(index=pd.Index(ids, name="op"), columns=columns)
    out = pd.concat(parts, axis=1, names=["format", "field"])
    out.index.name = "op"
    return out


def verdict_counts(
    whatif: pd.DataFrame, ops: pd.DataFrame, *, as_text: bool = False
) -> pd.DataFrame:
    """Safe ops per pass and format, from a `format_whatif` frame: index pass (input,
    fwd, bwd, opt, ... then ``all``), columns ``(format, "safe")`` and ``(format,
    "total")`` (ints). ``as_text=True``: one column per format holding ``"safe/total"``,
    for the report's summary table."""
    if not isinstance(whatif.columns, pd.MultiIndex) or whatif.columns.nlevels != 2:
        raise ValueError("whatif: expected a format_whatif frame ((format, field) columns)")
    require_columns(ops, ("pass",), "ops")
    missing = whatif.index.difference(ops.index)
    if len(missing):
        raise KeyError(f"ops: op id {int(missing[0])} of whatif is not in ops")
    passes = ops["pass"].reindex(whatif.index).astype(str)
    order = pass_rank(passes)
    formats = list(dict.fromkeys(whatif.columns.get_level_values(0)))
    data = {}
    for fmt in formats:
        safe = whatif[(fmt, "safe")].astype(bool)
        by_pass = safe.groupby(passes.to_numpy())
        data[(fmt, "safe")] = by_pass.sum().reindex(order).tolist() + [int(safe.sum())]
        data[(fmt, "total")] = by_pass.size().reindex(order).tolist() + [len(safe)]
    index = pd.Index(order + ["all"], name="pass")
    columns = pd.MultiIndex.from_tuples(data.keys(), names=["format", "count"])
    out = pd.DataFrame(data, index=index, columns=columns).astype(np.int64)
    if as_text:
        text = {
            f: out[(f, "safe")].astype(str) + "/" + out[(f, "total")].astype(str) for f in formats
        }
        return pd.DataFrame(text, index=index)
    return out


def format_whatif_run(reader: Any, formats: str | Sequence[str] | None = None, **kwargs: Any):
    """`format_whatif` of a recorded run (its metadata supplies unknown SNR thresholds)."""
    kwargs.setdefault("meta", reader.meta)
    return format_whatif(reader.stats(wide=True), reader.ops, formats, **kwargs)
