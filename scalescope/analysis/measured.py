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


def measurement_notes(reader: Any) -> list[str]:
    """The notes a view shows next to figures computed from ``reader``'s statistics:
    `sampled_note` and `budget_note`, those that apply (none for an exact run measured
    in full)."""
    budget = reader.budget
    notes = [
        sampled_note(reader.statistics, reader.sample),
        budget_note(budget, reader.measurement_period() if budget is not None else None),
    ]
    return [n for n in notes if n]
