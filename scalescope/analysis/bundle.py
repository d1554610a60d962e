"""`RunAnalysis`: everything the views say about one recorded run, computed once.

The dashboard, the report, the notebook and the CLI all show the same judgement of a run
(findings, verdict, causes, format what-if, when each op was measured, the notes on
sampled or budgeted statistics). `analyse(reader)` returns one bundle per state of the
reader (`RunReader.version` counts what `refresh` read) and set of thresholds: asking
twice costs nothing, and a refresh that read new steps gives a new bundle. Each part is
computed on first use, from one read of the statistics; the frames are shared, so treat
them as read-only (the ``*_run`` functions hand out copies).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd

from .advisor import advise
from .causes import causes
from .frames import op_labels, op_table, recorded_formats, recorded_recipes
from .masks import fill_ops, mask_ops
from .measured import measurement_notes, unrecorded_text
from .policies import predict_policy, recommend_policy
from .thresholds import Thresholds
from .verdict import Verdict, first_nonfinite, logged_loss, loss_trend_text, verdict
from .whatif import format_whatif


def held_updates(reader: Any) -> pd.DataFrame | None:
    """The reader's held-update figures (`RunReader.held_updates`; None for a reader that
    keeps none, e.g. a frame-backed one)."""
    read = getattr(reader, "held_updates", None)
    return read() if callable(read) else None


def per_step_worst(
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


def worst_step(values: pd.Series, how: str) -> pd.DataFrame:
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


def _part(build: Callable[[Any], Any]) -> property:
    """A part of the bundle: computed on first use (once, also across threads), kept."""
    name = build.__name__

    @functools.wraps(build)
    def get(self: RunAnalysis) -> Any:
        with self._lock:
            if name not in self._parts:
                self._parts[name] = build(self)
            return self._parts[name]

    return property(get)


class RunAnalysis:
    """One run's analysis at one state of its reader (see the module docstring).

    ``thresholds``: the advisor's and what-if's (default `Thresholds()`); ``audit``:
    formats every op is also checked against (`advise`); ``loss``: the logged scalar the
    verdict reads. Every attribute below is computed on first use and kept."""

    def __init__(
        self,
        reader: Any,
        *,
        thresholds: Thresholds | None = None,
        audit: Sequence[str] = (),
        loss: str = "loss",
    ) -> None:
        self.reader = reader
        self.thresholds = thresholds if thresholds is not None else Thresholds()
        self.audit = tuple([audit] if isinstance(audit, str) else audit)
        self.loss = loss
        self.version = getattr(reader, "version", None)
        self._lock = threading.RLock()  # one computation of each part, also across threads
        self._parts: dict[str, Any] = {}

    @_part
    def stats(self) -> pd.DataFrame:
        """The wide statistics frame (`RunReader.stats`)."""
        return self.reader.stats(wide=True)

    @property
    def ops(self) -> pd.DataFrame:
        """The reader's op table."""
        return self.reader.ops

    @property
    def meta(self) -> dict[str, Any]:
        """The reader's metadata."""
        return self.reader.meta

    @_part
    def table(self) -> pd.DataFrame:
        """The op table with its optional columns filled (`op_table`)."""
        return op_table(self.ops)

    @_part
    def labels(self) -> pd.Series:
        """Each op's label (`op_labels`)."""
        return op_labels(self.table)

    @_part
    def ids(self) -> np.ndarray:
        """Op ids with statistics, ascending."""
        return np.unique(self.stats["op"].to_numpy(np.int64))

    @_part
    def formats(self) -> list[str]:
        """The plain formats the run audits."""
        return recorded_formats(self.stats)

    @_part
    def recipes(self) -> list[str]:
        """The block-scaled recipes the run records."""
        return recorded_recipes(self.stats)

    @_part
    def per_step(self) -> pd.DataFrame:
        """`per_step_worst` of the run."""
        return per_step_worst(self.stats, self.formats, self.recipes)

    @_part
    def findings(self) -> pd.DataFrame:
        """The advisor's findings (`advise`)."""
        return advise(
            self.stats,
            self.ops,
            meta=self.meta,
            thresholds=self.thresholds,
            audit=self.audit,
            updates=held_updates(self.reader),
        )

    @_part
    def logged(self) -> pd.Series:
        """The logged scalar the verdict reads (``loss``), by step (`logged_loss`)."""
        return logged_loss(self.reader.scalar_rows(), self.loss)

    @_part
    def verdict(self) -> Verdict:
        """The run's verdict: its findings and its logged loss (`verdict`); a run with
        no recorded step is not judged by statistics (`Verdict.unjudged`)."""
        loss = self.logged
        return unjudged_if_unrecorded(verdict(self.findings, loss), self.reader, loss)

    @_part
    def divergence(self) -> str:
        """How the logged loss diverged, whatever the verdict's status (the gate's
        ``diverged``): its turning NaN/inf (`nonfinite_loss_text`), else its going up
        (`loss_trend_text`); "" when it did neither or none was logged."""
        return nonfinite_loss_text(self.logged) or loss_trend_text(self.logged)

    @_part
    def causes(self) -> pd.DataFrame:
        """The findings, one row per cause (`causes`)."""
        return causes(self.findings)

    @_part
    def whatif(self) -> pd.DataFrame:
        """The format and recipe what-if over every recorded step (`format_whatif`)."""
        return format_whatif(self.stats, self.ops, thresholds=self.thresholds, meta=self.meta)

    @_part
    def masks(self) -> np.ndarray:
        """Ops whose NaN/Inf are only another op's, masked (`mask_ops`)."""
        nonfinite = self.per_step["frac_nonfinite"]
        return mask_ops(nonfinite, self.thresholds.mask_min_steps, fill_ops(self.table))

    @_part
    def measured(self) -> pd.DataFrame:
        """When each op was measured (`RunReader.measured`, process 0)."""
        return self.reader.measured()

    @_part
    def incidents(self) -> pd.DataFrame:
        """The flight recorder's incidents (`RunReader.incidents`; empty for a reader
        that has none), with each op's ``label`` as the findings name it (`op_labels`:
        ``fwd/dense_1/convert_element_type#1 [128x32]``, where ``name`` may be shared)."""
        read = getattr(self.reader, "incidents", None)
        if read is None:
            columns = ["step", "trigger", "op", "name", "label", "source", "detail"]
            return pd.DataFrame(columns=columns)
        frame = read()
        labels = self.labels if len(self.ops) else pd.Series(dtype=object)
        label = [
            labels.get(int(op), name) if pd.notna(op) and int(op) >= 0 else name
            for op, name in zip(frame["op"], frame["name"], strict=True)
        ]
        return frame.assign(label=pd.Series(label, index=frame.index, dtype=object))

    @_part
    def notes(self) -> list[str]:
        """Sampled statistics, ops measured in turns (`measurement_notes`)."""
        return measurement_notes(self.reader)


#: reader -> {(thresholds, audit, loss): RunAnalysis of its current version}
_BUNDLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_BUNDLES_LOCK = threading.Lock()


def analyse(
    reader: Any,
    *,
    thresholds: Thresholds | None = None,
    audit: str | Sequence[str] = (),
    loss: str = "loss",
) -> RunAnalysis:
    """The `RunAnalysis` of ``reader`` as it is now: the same object until the reader
    reads something new (`RunReader.version`) or other arguments are given. A reader
    without a ``version`` gets a fresh bundle at every call."""
    bundle = RunAnalysis(reader, thresholds=thresholds, audit=audit, loss=loss)
    if bundle.version is None:
        return bundle
    key = (repr(bundle.thresholds), bundle.audit, loss)  # Thresholds holds a dict
    with _BUNDLES_LOCK:
        try:
            kept = _BUNDLES.setdefault(reader, {})
        except TypeError:  # not weak-referenceable: nothing to keep it on
            return bundle
        hit = kept.get(key)
        if hit is not None and hit.version == reader.version:
            return hit
        if len(kept) > 8:  # other thresholds come and go: keep the newest few
            kept.clear()
        kept[key] = bundle
        return bundle


# -- the analyses of a recorded run, through its bundle ----------------------------------

_BUNDLED = {"thresholds", "audit"}


def advise_run(reader: Any, **kwargs: Any) -> pd.DataFrame:
    """`advise` over a recorded run (its statistics, op table and metadata); with only
    ``thresholds``/``audit`` given, the findings of its `analyse` bundle (a copy)."""
    if set(kwargs) <= _BUNDLED:
        return analyse(reader, **kwargs).findings.copy()
    kwargs.setdefault("meta", reader.meta)
    kwargs.setdefault("updates", held_updates(reader))
    return advise(reader.stats(wide=True), reader.ops, **kwargs)


def verdict_run(
    reader: Any,
    *,
    findings: pd.DataFrame | None = None,
    loss: str = "loss",
    thresholds: Any = None,
    **advise_kwargs: Any,
) -> Verdict:
    """`verdict` of a recorded run: its findings (`advise_run`, with ``advise_kwargs``
    such as ``audit``; or ``findings`` already computed) and its logged scalar ``loss``;
    ``thresholds``: the verdict's (`VerdictThresholds`)."""
    if findings is None and thresholds is None and set(advise_kwargs) <= _BUNDLED:
        return analyse(reader, loss=loss, **advise_kwargs).verdict
    if findings is None:
        findings = advise_run(reader, **advise_kwargs)
    logged = logged_loss(reader.scalar_rows(), loss)
    v = verdict(findings, logged, thresholds=thresholds)
    return unjudged_if_unrecorded(v, reader, logged)


def unjudged_if_unrecorded(v: Verdict, reader: Any, loss: pd.Series | None = None) -> Verdict:
    """``v``, marked unjudged when ``reader`` (anything with ``steps``: the recorded
    steps) holds no recorded step: no finding can be made without statistics, so
    "healthy" would claim what nothing measured. ``loss``: the logged loss the verdict
    read, so the mark says whether one was logged. A healthy ``v`` also gets the notes
    its headline must carry: the flight recorder's incidents (`incident_text`) and how
    many ops a budget has measured so far (`coverage_text`) and whether the logged loss
    went up (`loss_trend_text`)."""
    steps = getattr(reader, "steps", None)
    if v.status == "healthy" and not v.incidents and (said := incident_text(reader)):
        v = dataclasses.replace(v, incidents=said)
    if v.status == "healthy" and not v.trend and (said := loss_trend_text(loss)):
        v = dataclasses.replace(v, trend=said)
    if steps is not None and len(steps) and not v.coverage:
        said = [coverage_text(reader), unrecorded_text(getattr(reader, "unrecorded_calls", None))]
        coverage = "; ".join(s for s in said if s)
        return dataclasses.replace(v, coverage=coverage) if coverage else v
    if steps is None or len(steps) or v.unjudged:
        return v
    if loss is None or not len(loss):
        why = "no loss logged"
    elif np.isfinite(loss.to_numpy(np.float64)).all():
        why = "the logged loss is finite"
    else:
        why = "the logged loss is not finite"
    return dataclasses.replace(v, unjudged=f"no step recorded; {why}")


def incident_text(reader: Any) -> str:
    """``"5 incidents (loss_spike), no precision cause found"`` when ``reader`` (anything
    with ``incidents()``: `RunReader.incidents`) holds flight-recorder incidents, else
    "": a run whose loss spiked or diverged with no precision finding is healthy in
    precision, and its headline must not read as if training were."""
    read = getattr(reader, "incidents", None)
    frame = read() if callable(read) else None
    if frame is None or not len(frame):
        return ""
    triggers = ", ".join(sorted({str(t) for t in frame["trigger"].dropna()}))
    n = len(frame)
    what = f" ({triggers})" if triggers else ""
    return f"{n} incident{'s' if n != 1 else ''}{what}, no precision cause found"


def nonfinite_loss_text(loss: pd.Series | None) -> str:
    """``"the logged loss turned NaN/inf at step 12"`` when a value of ``loss`` (logged
    values indexed by step) is not finite, else ""."""
    step = first_nonfinite(loss)
    return "" if step is None else f"the logged loss turned NaN/inf at step {step}"


def coverage_text(reader: Any) -> str:
    """``"17 of 336 ops measured so far"`` when some op with statistics of ``reader``
    (anything with ``measured()``: `RunReader.measured`) has never been measured (a
    budget measures ops in turns), else ""."""
    measured = getattr(reader, "measured", None)
    if not callable(measured):
        return ""
    table = measured()
    ops = getattr(reader, "ops", None)
    if ops is not None and "stats_op" in ops.columns:  # each value once, not its aliases
        table = table[ops["stats_op"].reindex(table.index).to_numpy() == table.index]
    total = len(table)
    done = int(table["last_measured"].notna().sum()) if total else 0
    return f"{done} of {total} ops measured so far" if 0 < total and done < total else ""


def format_whatif_run(
    reader: Any, formats: str | Sequence[str] | None = None, **kwargs: Any
) -> pd.DataFrame:
    """`format_whatif` of a recorded run (its metadata supplies unknown SNR thresholds);
    every format with at most ``thresholds`` given: its `analyse` bundle's (a copy)."""
    if formats is None and set(kwargs) <= {"thresholds"}:
        return analyse(reader, **kwargs).whatif.copy()
    kwargs.setdefault("meta", reader.meta)
    return format_whatif(reader.stats(wide=True), reader.ops, formats, **kwargs)


def recommend_policy_run(reader: Any, **kwargs: Any) -> Any:
    """`recommend_policy` of a recorded run (its what-if over every recorded step)."""
    return recommend_policy(analyse(reader).whatif, reader.ops, **kwargs)


def predict_policy_run(reader: Any, policy: Any) -> pd.DataFrame:
    """`predict_policy` over a recorded run."""
    return predict_policy(policy, analyse(reader).whatif, reader.ops)
