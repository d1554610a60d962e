"""Whether a NaN/Inf an op holds reaches the step's outputs.

A value can hold a NaN/Inf that nothing downstream keeps: optax's ``join_schedules``
evaluates every schedule and selects one (an ``rsqrt`` warm-up branch is ``0 ** -0.5``
at step 0), and ``where(x > 0, log(x), 0)`` computes the log everywhere. Such a value is
no incident's origin and no finding, even in a step whose outputs went non-finite for
another reason (an FP8 overflow). Told from the op table's data flow: each op's float
inputs (`OpRecord.inputs`, stats ids).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

#: A consumer whose value is not known: it may carry a NaN/Inf on.
UNKNOWN = -1
#: A consumer that cannot hold a NaN/Inf (a comparison, an integer op): it drops it.
FINITE = -2
#: `OpRecord.origin` of values whose NaN/Inf a step may drop by design: computed from
#: constants and the step count (a schedule's unused branch), or read only through a
#: ``where`` (the safe-division idiom).
BY_DESIGN = ("constant", "guarded")


@dataclass(frozen=True)
class Flow:
    """The data flow between recorded values (by stats id): ``consumers[i]`` the values
    computed from value ``i`` (`UNKNOWN` for a float consumer without statistics),
    ``sinks`` the step's outputs (a NaN/Inf there is kept whatever follows)."""

    consumers: Mapping[int, frozenset[int]] = field(default_factory=dict)
    sinks: frozenset[int] = frozenset()


def flow_of(records: Iterable[tuple[int, Collection[int], str, bool]]) -> Flow:
    """The `Flow` of an op table given as ``(stats_op, inputs, dtype, output)`` per op:
    ``stats_op`` the stats id of the op's value (-1 when it has none), ``inputs`` the
    stats ids of its float inputs, ``output`` whether the op is one of the step's
    outputs. A consumer without statistics is `UNKNOWN` when its value is a float (it may
    hold the NaN/Inf on) and `FINITE` when it is not (a comparison, an integer op:
    ``isnan(x)`` drops the NaN)."""
    consumers: dict[int, set[int]] = {}
    sinks = set()
    for stats_op, inputs, dtype, output in records:
        if output and stats_op >= 0:
            sinks.add(int(stats_op))
        if stats_op >= 0:
            target = int(stats_op)
        else:
            target = UNKNOWN if _float(dtype) else FINITE
        for i in inputs:
            if int(i) != target:  # an alias (a reshape) shares its source's statistics
                consumers.setdefault(int(i), set()).add(target)
    return Flow({i: frozenset(c) for i, c in consumers.items()}, frozenset(sinks))


def _float(dtype: str) -> bool:
    try:
        return bool(np.issubdtype(np.dtype(dtype), np.floating))
    except TypeError:  # ml_dtypes' names (float8_e4m3fn, bfloat16) NumPy may not know
        return "float" in str(dtype)


def dropped(
    nonfinite: Collection[int], flow: Flow, known: Collection[int] | None = None
) -> set[int]:
    """Of the values in ``nonfinite`` (stats ids holding a NaN/Inf), those whose
    NaN/Inf no path carries to an output: every value computed from them is finite, or
    drops it further on. A value is kept (not dropped) when it is a sink, when nothing
    recorded reads it, or when a value read from it is not known: `UNKNOWN`, or missing
    from ``known`` (the values recorded at this step, when not all are)."""
    bad = set(int(o) for o in nonfinite)
    kept: set[int] = set()
    changed = True
    order = sorted(bad, reverse=True)  # consumers first, mostly: few rounds
    while changed:
        changed = False
        for op in order:
            if op in kept:
                continue
            users = flow.consumers.get(op, frozenset())
            if (
                op in flow.sinks
                or not users
                or any(
                    c == UNKNOWN or c in kept or (known is not None and c >= 0 and c not in known)
                    for c in users
                )
            ):
                kept.add(op)
                changed = True
    return bad - kept
