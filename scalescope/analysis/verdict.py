"""One verdict per run: healthy, at risk or failing, with the causes behind it.

`verdict` reads the advisor's causes (`scalescope.analysis.causes`) and the logged loss:

- **failing**: the loss turned NaN/inf, or a cause is critical (NaN/inf in a value, a
  plain cast overflowing into inf/NaN), or a high cause loses nearly all of its value
  (impact from `VerdictThresholds.failing_impact`, 90 %), or a high cause beside a
  logged loss that diverged (`loss_trend_text`: qwix's static activation scale overrun,
  83 % clipped and the loss from 2.0 to 660, read "at risk" before);
- **at risk**: any other high cause;
- **healthy**: nothing above: medium and low findings are warnings.

The step where it turned is the first recorded step of the causes that decide the
status (for a NaN loss, the first logged step with one; for a diverged one, the first
step above twice its first value). The severities and the impact
threshold are set from the labelled corpus of `benchmarks/bench_verdicts.py`
(docs/advisor.md holds its table).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from .causes import causes as group_causes
from .causes import impact_text

#: Rules whose causes make NaN/inf values: what a non-finite loss starts with.
_MAKES_NONFINITE = ("nonfinite", "overflow")

#: The verdicts, from best to worst.
STATUSES = ("healthy", "at risk", "failing")


@dataclass(frozen=True)
class VerdictThresholds:
    """``failing_impact``: the estimated impact (the share of a value lost, see
    `scalescope.analysis.advise`) from which a high cause fails the run; below it a high
    cause puts the run at risk."""

    failing_impact: float = 0.9

    def __post_init__(self) -> None:
        value = self.failing_impact
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"VerdictThresholds.failing_impact: expected a number, got {value!r}")
        if not 0 <= value <= 1:
            raise ValueError(f"VerdictThresholds.failing_impact: a fraction in [0, 1], got {value}")


@dataclass(frozen=True)
class Reason:
    """One cause behind a verdict: what (``cause``), how bad (``severity``, ``impact``),
    where (the worst ``op``, its ``source`` line), since when (``step``) and the fix."""

    cause: str
    severity: str
    impact: float
    op: str
    source: str
    step: int | None
    fix: str
    evidence: str = ""
    #: what the impact is a share of: the value, or for a stall its update
    lost: str = "value"

    def as_dict(self) -> dict[str, Any]:
        impact = None if not math.isfinite(self.impact) else float(self.impact)
        return {
            "cause": self.cause,
            "severity": self.severity,
            "impact": impact,
            "op": self.op,
            "source": self.source,
            "step": self.step,
            "fix": self.fix,
            "evidence": self.evidence,
        }

    def line(self) -> str:
        where = f" ({self.source})" if self.source and not self.source.startswith("<") else ""
        since = f", from step {self.step}" if self.step is not None else ""
        impact = impact_text(self.impact)
        impact = f", {impact} of the {self.lost} lost" if impact != "-" else ""
        example = f": e.g. {self.op}{where}" if self.op else ""
        return f"[{self.severity}] {self.cause}{impact}{since}{example}"


@dataclass(frozen=True)
class Verdict:
    """A run's verdict (``status``: one of `STATUSES`), up to three ``reasons`` (the
    causes that decide it, worst first), the ``step`` where it turned (None when
    healthy), and the number of causes per severity (``counts``). ``unjudged``: why no
    recorded statistics judged the run (``"no step recorded; ..."``, with what the
    logged loss says), "" when they did."""

    status: str
    reasons: tuple[Reason, ...] = ()
    step: int | None = None
    counts: Mapping[str, int] = field(default_factory=dict)
    unjudged: str = ""
    #: findings (not causes) per severity: what the headline of a healthy run counts,
    #: as the report's findings line does
    findings: Mapping[str, int] = field(default_factory=dict)
    #: how much was measured, when not every op was (a budget measures ops in turns):
    #: ``"17 of 336 ops measured so far"``; a healthy headline says it
    coverage: str = ""
    #: the flight recorder's incidents of a run judged healthy (a loss that spiked
    #: without a precision cause): ``"5 incidents (loss_spike), no precision cause
    #: found"``; a healthy headline says it
    incidents: str = ""
    #: what the logged loss did in a run judged healthy, when it went up rather than
    #: down (a learning rate too high diverges with no precision cause): ``"the logged
    #: loss diverged: 4.56 at step 0, peak 288 at step 2, 7.49 at the end"``; a healthy
    #: headline says it
    trend: str = ""

    @property
    def rank(self) -> int:
        """0 healthy, 1 at risk, 2 failing: compare verdicts by it."""
        return STATUSES.index(self.status)

    @property
    def headline(self) -> str:
        """One line: ``verdict: failing (from step 10): e5m2 underflow in 4 bwd ops...``."""
        if self.status == "healthy" and self.unjudged:
            return f"verdict: not judged ({self.unjudged})"
        if self.status == "healthy":
            found = self.findings or self.counts  # a Verdict made without findings counts
            warn = sum(found.get(s, 0) for s in ("medium", "low"))
            notes = [f"{warn} minor finding{'s' if warn != 1 else ''}"] if warn else []
            notes += [self.coverage] if self.coverage else []
            notes += [self.incidents] if self.incidents else []
            if self.trend:
                cause = "" if self.incidents else ", no precision cause found"
                notes.append(self.trend + cause)
            tail = f" ({'; '.join(notes)})" if notes else ""
            return f"verdict: healthy{tail}"
        since = f" from step {self.step}" if self.step is not None else ""
        first = f": {self.reasons[0].cause}" if self.reasons else ""
        return f"verdict: {self.status}{since}{first}"

    def __str__(self) -> str:
        lines = [self.headline]
        lines += [f"  {r.line()}\n      fix: {r.fix}" for r in self.reasons if r.fix]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "step": self.step,
            "headline": self.headline,
            "counts": dict(self.counts),
            "reasons": [r.as_dict() for r in self.reasons],
            "unjudged": self.unjudged,
            "coverage": self.coverage,
            "incidents": self.incidents,
            "trend": self.trend,
        }


def parse_status(text: str) -> str:
    """A verdict name from user text: ``at-risk``, ``at_risk`` and ``At Risk`` are
    ``at risk``; a clear error for anything else."""
    key = str(text).strip().lower().replace("-", " ").replace("_", " ")
    if key not in STATUSES:
        raise ValueError(f"unknown verdict {text!r}; expected one of: healthy, at-risk, failing")
    return key


def first_nonfinite(loss: pd.Series | None) -> int | None:
    """The first step (index) whose logged ``loss`` value is NaN/inf, None when none is."""
    if loss is None or not len(loss):
        return None
    values = pd.to_numeric(loss, errors="coerce").to_numpy(np.float64)
    bad = np.flatnonzero(~np.isfinite(values))
    return int(loss.index[bad[0]]) if len(bad) else None


def logged_loss(scalar_rows: pd.DataFrame, name: str = "loss") -> pd.Series:
    """The values of scalar ``name`` as logged (``reader.scalar_rows()``: one row per
    logged value), indexed by step, NaN values kept: a NaN loss is a logged NaN, not a
    missing value. A name other than ``"loss"`` that was never logged, where other
    scalars were, is a KeyError naming them (a typo would read as "no loss logged")."""
    rows = scalar_rows[scalar_rows["name"] == name] if len(scalar_rows) else scalar_rows
    if not len(rows) and name != "loss" and len(scalar_rows):
        known = ", ".join(sorted(map(str, scalar_rows["name"].unique())))
        raise KeyError(f"loss: no scalar {name!r} was logged; this run logs: {known}")
    if not len(rows):
        return pd.Series(dtype=np.float64, name=name)
    return pd.Series(rows["value"].to_numpy(np.float64), index=rows["step"].to_numpy(), name=name)


#: fewest finite logged loss values a trend is read from
TREND_MIN_VALUES = 10


def _trend_values(loss: pd.Series | None) -> tuple[np.ndarray, np.ndarray, float] | None:
    """The finite values of ``loss``, their steps and its end (the median of its last
    5 %, at least 3 values), when a trend can be read from them: at least
    `TREND_MIN_VALUES`, all positive (a loss that can be negative, an RL objective, has
    no such scale); else None."""
    if loss is None or not len(loss):
        return None
    values = pd.to_numeric(loss, errors="coerce").to_numpy(np.float64)
    keep = np.isfinite(values)
    values, steps = values[keep], np.asarray(loss.index)[keep]
    if len(values) < TREND_MIN_VALUES or not (values > 0).all():
        return None
    return values, steps, float(np.median(values[-max(3, len(values) // 20) :]))


def loss_trend_text(loss: pd.Series | None) -> str:
    """``"the logged loss diverged: 4.56 at step 0, peak 288 at step 2, 7.49 at the
    end"`` when ``loss`` (logged values indexed by step) went up rather than down: its
    end above twice its first value, or a peak above ten times it (`_trend_values`);
    else "". A verdict reads precision, and a run that diverges for another reason (a
    learning rate too high) has no precision finding: its "healthy" must not read as if
    training were."""
    read = _trend_values(loss)
    if read is None:
        return ""
    values, steps, end = read
    first = values[0]
    peak = int(np.argmax(values[1:])) + 1
    if end <= 2 * first and values[peak] <= 10 * first:
        return ""
    top = f", peak {values[peak]:.3g} at step {steps[peak]}" if values[peak] > 2 * end else ""
    return f"the logged loss diverged: {first:.3g} at step {steps[0]}{top}, {end:.3g} at the end"


def divergence_step(loss: pd.Series | None) -> int | None:
    """The first logged step whose loss is above twice the first value, when the
    divergence lasted (its end above twice the first value, `_trend_values`: a spike the
    run recovered from is no failure); else None."""
    read = _trend_values(loss)
    if read is None or not read[2] > 2 * read[0][0]:
        return None
    values, steps, _ = read
    return int(steps[np.flatnonzero(values > 2 * values[0])[0]])


def _status_of(row: Mapping[str, Any], thresholds: VerdictThresholds) -> int:
    severity, impact = row["severity"], row["impact"]
    impact = -1.0 if impact is None or not math.isfinite(float(impact)) else float(impact)
    if severity == "critical":
        return 2
    if severity == "high":
        return 2 if impact >= thresholds.failing_impact else 1
    return 0


def verdict(
    findings: pd.DataFrame,
    loss: pd.Series | None = None,
    *,
    thresholds: VerdictThresholds | None = None,
    reasons: int = 3,
) -> Verdict:
    """The verdict of a run from its advisor ``findings`` (`scalescope.analysis.advise`)
    and its logged ``loss`` values (indexed by step, `logged_loss`); ``reasons``: how
    many causes to give. See the module docstring for the rules."""
    thresholds = VerdictThresholds() if thresholds is None else thresholds
    if not isinstance(thresholds, VerdictThresholds):
        raise TypeError(f"thresholds: expected a VerdictThresholds, got {thresholds!r}")
    table = group_causes(findings)
    counts = {s: int(n) for s, n in table["severity"].value_counts().items()} if len(table) else {}
    levels = [_status_of(r, thresholds) for r in table.to_dict("records")]
    status = max(levels, default=0)
    picked: list[Reason] = []
    step: int | None = None
    nan_step = first_nonfinite(loss)
    if nan_step is not None:
        status = 2
    # a run at risk whose loss diverged has failed: the outcome, not a threshold, says so
    diverged = divergence_step(loss) if status == 1 else None
    if diverged is not None:
        status = 2
    deciding = [i for i, lv in enumerate(levels) if lv == status and lv > 0]
    # the earliest cause first, in time then program order: a cast overflowing into NaN
    # comes before the NaN it spreads
    deciding.sort(key=lambda i: (int(table["first_step"].iloc[i]), int(table["first_op"].iloc[i])))
    shown = deciding + [i for i, lv in enumerate(levels) if lv and i not in deciding]
    if nan_step is not None:
        # the cause a NaN loss starts with is one that makes NaN/inf (a value holding
        # them, a cast overflowing into inf), not the earliest cause of any kind: a
        # softmax's low SNR since step 0 was named for a NaN that a division made at
        # step 128
        makes = [i for i in shown if str(table["rule"].iloc[i]) in _MAKES_NONFINITE]
        if makes:
            shown = [makes[0]] + [i for i in shown if i != makes[0]]
        name = loss.name or "loss"
        first = table.iloc[shown[0]] if shown else None
        picked.append(
            Reason(
                cause=f"the {name} turned NaN/inf",
                severity="critical",
                impact=1.0,
                # where it starts: the earliest recorded cause
                op="" if first is None else str(first["label"]),
                source="" if first is None else str(first["source"]),
                step=nan_step,
                fix=(
                    "record every step (every=1) to find the earliest op with NaN/inf"
                    if first is None
                    else f"it starts with the next reason, {first['cause']}: fix that first"
                ),
                evidence=f"{name} is not finite at step {nan_step}",
            )
        )
        step = nan_step
    if diverged is not None:
        name = loss.name or "loss"
        first = table.iloc[shown[0]]
        picked.append(
            Reason(
                cause=f"the {name} diverged",
                severity="critical",
                impact=math.nan,
                op=str(first["label"]),
                source=str(first["source"]),
                step=diverged,
                fix=f"it follows the next reason, {first['cause']}: fix that first",
                evidence=loss_trend_text(loss),
            )
        )
        step = diverged
    for i in shown[: max(reasons - len(picked), 0)]:
        r = table.iloc[i]
        picked.append(
            Reason(
                cause=str(r["cause"]),
                severity=str(r["severity"]),
                impact=float(r["impact"]) if pd.notna(r["impact"]) else math.nan,
                op=str(r["label"]),
                source=str(r["source"]),
                step=int(r["first_step"]),
                fix=str(r["fix"]),
                evidence=str(r["evidence"]),
                lost="update" if r["rule"] == "stall" else "value",
            )
        )
    if status and deciding:
        first = int(min(table.iloc[deciding]["first_step"]))
        step = first if step is None else min(step, first)
    per_finding = (
        {str(s): int(n) for s, n in findings["severity"].value_counts().items()}
        if len(findings) and "severity" in findings.columns
        else {}
    )
    return Verdict(
        STATUSES[status], tuple(picked), step if status else None, counts, findings=per_finding
    )


def worst_first(verdicts: Sequence[Verdict]) -> list[int]:
    """Positions of ``verdicts``, the run that needs attention most first: failing, then
    at risk, then healthy; among equals the earliest turn, then the input order."""

    def key(i: int) -> tuple[int, float, int]:
        v = verdicts[i]
        return (-v.rank, float(v.step) if v.step is not None else math.inf, i)

    return sorted(range(len(verdicts)), key=key)
