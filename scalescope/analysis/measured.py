"""What the views say next to figures whose numbers are not every element at every step:
statistics estimated from element subsampling (``sample=``), and ops measured in turns
under an overhead budget (``budget=``)."""

from __future__ import annotations

from typing import Any


def sampled_note(statistics: str, sample: int | None = None) -> str:
    """The note for statistics estimated from a subset of elements ("" when exact)."""
    if statistics != "sampled":
        return ""
    if sample:
        return f"sampled statistics: estimates from at most {int(sample):,} elements per value"
    return "sampled statistics: estimates from a subset of the elements of each value"


def budget_note(budget: float | None, period: float | None = None) -> str:
    """The note for a run recorded under an overhead budget ("" without one).
    ``period``: median number of recorded steps between two measurements of an op
    (`scalescope.store.RunReader.measurement_period`)."""
    if budget is None:
        return ""
    head = f"rotating subset (budget {float(budget) * 100:g}%): "
    if period is None:
        how = "ops are measured in turns (too few steps yet to say how often)"
    elif period < 1.5:
        how = "ops measured at every recorded step so far"
    else:
        how = f"ops measured every ~{round(period)} recorded steps"
    return head + how


def _unrecorded(unrecorded: dict[str, Any] | None) -> tuple[int, int] | None:
    """(calls, first step) of a run's `RunReader.unrecorded_calls`, None when none."""
    if not unrecorded or not unrecorded.get("count"):
        return None
    return int(unrecorded["count"]), int(unrecorded.get("first_step", 0))


def _calls(unrecorded: dict[str, Any], n: int) -> str:
    """``"3 calls of eval_step"``, or ``"5 calls (train_step: 3, eval_step: 2)"`` when
    several tracked functions made them, or ``"3 calls"`` for runs written before the
    run kept which."""
    calls = f"{n:,} call{'s' if n != 1 else ''}"
    functions = unrecorded.get("functions") or {}
    if len(functions) == 1:
        return f"{calls} of {next(iter(functions))}"
    if functions:
        return f"{calls} (" + ", ".join(f"{k}: {int(v):,}" for k, v in functions.items()) + ")"
    return calls


def unrecorded_note(unrecorded: dict[str, int] | None) -> str:
    """The note for a run some of whose calls traced another graph and ran unrecorded
    ("" when none did): its figures and verdict cover the recorded graph's steps only."""
    if (said := _unrecorded(unrecorded)) is None:
        return ""
    n, first = said
    return (
        f"{_calls(unrecorded, n)} (the first at step {first:,}) traced another graph "
        "than the run's and ran unrecorded: "
        "figures and verdict cover the other steps only (the flight recorder checked them)"
    )


def unrecorded_text(unrecorded: dict[str, int] | None) -> str:
    """`unrecorded_note` as a clause of a healthy headline, ``"29 calls from step 1
    traced another graph and ran unrecorded"`` ("" when none did): a verdict on one
    recorded call of thirty must say what it did not see."""
    if (said := _unrecorded(unrecorded)) is None:
        return ""
    n, first = said
    return f"{_calls(unrecorded, n)} from step {first:,} traced another graph and ran unrecorded"


def ended_note(ended_by: str) -> str:
    """The note for a run whose last session ended in an exception ("" otherwise): its
    data is whole, but the training stopped there."""
    if not ended_by:
        return ""
    return (
        f"the last recording session ended with an exception ({ended_by}): training stopped there"
    )


def measurement_notes(reader: Any) -> list[str]:
    """The notes a view shows next to figures computed from ``reader``'s statistics:
    `sampled_note`, `budget_note`, `unrecorded_note` and `ended_note`, those that apply
    (none for an exact run measured in full that ended normally)."""
    budget = reader.budget
    notes = [
        sampled_note(reader.statistics, reader.sample),
        budget_note(budget, reader.measurement_period() if budget is not None else None),
        unrecorded_note(getattr(reader, "unrecorded_calls", None)),
        ended_note(getattr(reader, "ended_by", "")),
    ]
    return [n for n in notes if n]
