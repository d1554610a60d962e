"""The overhead budget: which steps record, and which value groups they measure.

`Run(path, budget=0.05)` keeps the time spent recording, and checking each step for the
flight recorder where that check is a program of its own (CPU), at or under 5 % of the
time spent training. The recorded values are split into groups of about equal cost
(`instrument`'s ``groups``); each recorded step measures a few groups, switched by a
runtime mask in one compiled program. This module only decides; `writer.Tracked` times
the steps and runs them.

The cost of a recorded step is modelled as ``fixed + per_element * elements``: the fixed
part is what any recorded step pays (with ``isolate``, a second evaluation of the step),
the rest grows with the elements measured. A step records when the overhead spent so far
plus the expected cost of this one stays within ``TARGET * budget`` times the training
time so far (measured plain steps times their count; `TARGET` keeps a tenth of the budget
for what the model misses), so a slow recorded step is paid back by a longer gap before
the next. Each recorded step measures every *hot* group (one where the last
measurement showed non-finite values, drift from unit scale, a growing trend, or
under/overflow in the format the value is cast to) and the next few cold groups in
round-robin order, so every value is measured within a bounded period
(`coverage_period`) and values with findings at every recorded step. No recorded step
is planned to cost more than `MAX_STEP_OVERHEAD` plain steps beyond a plain one: past
that, it measures fewer groups and records more often (`groups_per_step`), so training
never stalls for one long step; hot groups then take turns too.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import numpy as np

#: Findings that make a group hot (measured more often): |log2 rms| beyond this...
DRIFT_LOG2 = 4.0
#: ...or grown by this much since the op's previous measurement...
TREND_LOG2 = 1.0
#: ...or underflow in the cast format above this fraction, or any overflow or non-finite.
UNDERFLOW = 0.01
#: The controller spends at most this share of the budget: the budget is a ceiling, and
#: what its cost model does not see (the device pipeline drained around each timed step,
#: the last flush, timing noise) is paid from the rest.
TARGET = 0.9
#: The most a recorded step is planned to cost beyond a plain step, in plain steps (the
#: statistics program next to the plain one): with the step itself, 2.6x a plain step,
#: under the 3x that issue 36 allows the slowest step, with room for timing noise. On the
#: sample GPT (2 x 128, FP8, 2-core CPU) measuring all 16 groups at once cost 3.3x more,
#: so a recorded step took 4.3x; the statistics program alone (no group) costs ~1.15x.
MAX_STEP_OVERHEAD = 1.5


class BudgetController:
    """Plans recorded steps under an overhead budget (fraction of training time)."""

    def __init__(
        self,
        budget: float,
        group_elements: Sequence[int],
        *,
        every: int = 1,
        fixed_share: float = 1.0,
    ) -> None:
        if not (isinstance(budget, int | float) and 0 < budget < 1):
            raise ValueError(f"Run: budget must be a fraction in (0, 1), got {budget!r}")
        self.budget = float(budget)
        self.elements = np.asarray(group_elements, np.float64)
        self.groups = len(self.elements)
        if self.groups == 0:
            raise ValueError("Run: the budget needs at least one recorded value")
        self.every = every
        self.t_plain: float | None = None  # seconds per plain step (smoothed)
        self.t_check = 0.0  # seconds of the flight recorder's check per step (smoothed)
        self.fixed: float | None = None  # fixed seconds per recorded step (prior: shares)
        self.fixed_share = fixed_share  # prior for fixed cost, in plain steps
        self.per_element: float | None = None
        self.spent = 0.0  # overhead seconds spent recording
        self.steps = 0  # steps seen (recorded or not)
        self.last_record = -(10**9)
        self.next_group = 0
        self._advance = 0
        self._hot_turn = 0  # hot groups take turns when they do not all fit in one step
        self._hot_taken = 0
        self.slot = 0  # recorded steps so far
        self.measured_at = np.full(self.groups, -1, np.int64)  # last step each group ran
        self.first_full_cover: int | None = None
        self._hot: frozenset[int] = frozenset()
        self._lock = threading.Lock()

    # -- timings ----------------------------------------------------------------------

    def observe_plain(self, seconds: float) -> None:
        """A plain step took ``seconds`` (compilation excluded)."""
        self.t_plain = seconds if self.t_plain is None else 0.7 * self.t_plain + 0.3 * seconds
        if self.fixed is None:
            self.fixed = self.fixed_share * self.t_plain

    def observe_check(self, seconds: float) -> None:
        """The flight recorder's check of a step took ``seconds``, as a program of its
        own after the step (`flight.check_in_step`): every step pays it, so the budget
        pays it first, and recording gets the rest."""
        seen = self.t_check > 0
        self.t_check = 0.7 * self.t_check + 0.3 * seconds if seen else seconds

    @property
    def t_step(self) -> float:
        """Seconds per unrecorded step: the plain step and its check."""
        return float(self.t_plain or 0.0) + self.t_check

    def _room(self) -> float:
        """Seconds of recording the budget allows per step, the check paid."""
        return TARGET * self.budget * float(self.t_plain) - self.t_check

    @property
    def starved(self) -> bool:
        """Whether the check alone takes the whole budget (nothing can record)."""
        return self.ready and self._room() <= 0

    def observe_record(self, overhead: float, mask: np.ndarray) -> None:
        """A recorded step measuring ``mask`` cost ``overhead`` seconds more than a plain
        step."""
        overhead = max(0.0, overhead)
        with self._lock:
            self.spent += overhead
        fixed = self.fixed or 0.0
        elements = float(self.elements[mask].sum())
        if elements > 0:
            rate = max(0.0, overhead - fixed) / elements
            if overhead < fixed:  # the fixed part was overestimated
                self.fixed = 0.5 * fixed + 0.5 * overhead
            self.per_element = (
                rate if self.per_element is None else 0.5 * self.per_element + 0.5 * rate
            )

    def observe_writer(self, seconds: float) -> None:
        """The writer thread spent ``seconds`` on a recorded step's statistics (copy,
        findings, Parquet): counted as overhead too, since it shares the machine."""
        with self._lock:
            self.spent += max(0.0, seconds)

    def observe_findings(self, hot_groups: set[int]) -> None:
        """Groups whose latest measurement had findings (called from the writer)."""
        with self._lock:
            self._hot = frozenset(int(g) for g in hot_groups)

    # -- plans ------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.t_plain is not None

    def groups_per_record(self) -> int:
        """Cold groups measured together: enough that measuring costs about twice the
        fixed cost of a recorded step (with few groups per record, most of the budget
        would go to the fixed cost; with all of them, no recorded step could be cheap),
        and no more than `groups_per_step` allows."""
        if not self.per_element or not self.fixed:
            return 1
        mean = float(self.elements.mean()) or 1.0
        k = round(2 * self.fixed / (self.per_element * mean))
        return int(min(self.groups, self.groups_per_step(), max(1, k)))

    def groups_per_step(self) -> int:
        """The most groups (of the mean size) one recorded step measures: its expected
        cost stays under `MAX_STEP_OVERHEAD` plain steps (at least one group)."""
        if not self.per_element or not self.fixed or self.t_plain is None:
            return self.groups
        mean = float(self.elements.mean()) or 1.0
        room = MAX_STEP_OVERHEAD * float(self.t_plain) - self.fixed
        return int(min(self.groups, max(1, room // (self.per_element * mean))))

    def expected_cost(self, mask: np.ndarray) -> float:
        fixed = self.fixed or 0.0
        per = self.per_element if self.per_element is not None else 0.0
        return fixed + per * float(self.elements[mask].sum())

    def plan(self, step: int) -> np.ndarray | None:
        """The mask of groups to measure at ``step``, or None for a plain step. Call once
        per step, in order."""
        self.steps += 1
        if not self.ready or step - self.last_record < self.every:
            return None
        mask = self._next_mask()
        allowed = self.steps * self._room()
        if self.spent + self.expected_cost(mask) > allowed:
            return None
        self._commit(step, mask)
        return mask

    def _next_mask(self) -> np.ndarray:
        """Every hot group, and the next cold groups in round-robin order; when they do
        not fit in `groups_per_step`, the hot groups take turns (at least one cold
        group is measured at every recorded step, so every value comes round)."""
        with self._lock:
            hot = sorted(self._hot)
        n, k, alternate = self._shares(len(hot))
        if n < len(hot):  # hot groups take turns
            start = self._hot_turn % len(hot)
            hot = (hot[start:] + hot[:start])[:n]
        if alternate:
            hot, k = (hot, 0) if self.slot % 2 == 0 else ([], k)
        self._hot_taken = len(hot)
        mask = np.zeros(self.groups, bool)
        mask[hot] = True
        is_hot = mask.copy()
        taken, i = 0, 0
        while taken < k and i < self.groups:
            g = (self.next_group + i) % self.groups
            if not is_hot[g]:
                mask[g] = True
                taken += 1
            i += 1
        self._advance = i
        return mask

    def _shares(self, hot: int) -> tuple[int, int, bool]:
        """``(hot, cold, alternate)``: how many of ``hot`` hot groups and how many cold
        groups a recorded step measures within `groups_per_step`; ``alternate`` when one
        group fills a step, and a hot record (one hot group) and a cold one (one cold
        group) take turns."""
        k, room = self.groups_per_record(), self.groups_per_step()
        if not hot or hot + k <= room:
            return hot, k, False
        if room <= 1:
            return 1, 1, True
        n = min(hot, room - 1)
        return n, room - n, False

    def _commit(self, step: int, mask: np.ndarray) -> None:
        self.next_group = (self.next_group + self._advance) % self.groups
        self._hot_turn += self._hot_taken
        self.slot += 1
        self.last_record = step
        self.measured_at[mask] = step
        if self.first_full_cover is None and (self.measured_at >= 0).all():
            self.first_full_cover = step

    def coverage_period(self) -> float:
        """Steps between two measurements of the same value, at the current cost
        estimates (round-robin only; hot groups come round more often)."""
        if not self.ready:
            return math.inf
        with self._lock:
            hot = len(self._hot)
        hot, k, alternate = self._shares(hot)
        turns = 1
        if alternate:  # one group a record, a cold one every other record
            hot, turns = 0, 2
        mask = np.zeros(self.groups, bool)
        mask[: min(self.groups, k + hot)] = True
        room = self._room()
        if room <= 0:
            return math.inf
        per_record = self.expected_cost(mask) / room
        interval = max(self.every, per_record)
        cold = max(1, self.groups - hot)
        return math.ceil(cold / k) * interval * turns


def hot_groups(
    stats: dict[str, np.ndarray],
    row_group: np.ndarray,
    measured: np.ndarray,
    cast_to: Sequence[str],
    scaled: np.ndarray,
    previous_log2: np.ndarray,
) -> set[int]:
    """Groups with a row showing a finding in this measurement (see the module doc).

    ``measured``: rows measured at this step; ``cast_to``/``scaled``: per row, the format
    the value is cast to ("" for none) and whether it is a scaled value;
    ``previous_log2``: per row, log2 rms at its previous measurement (NaN if none),
    updated in place."""
    rms = np.asarray(stats["rms"], np.float64).reshape(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        log2 = np.where(rms > 0, np.log2(rms), np.nan)
    bad = np.asarray(stats["frac_nonfinite"]).reshape(-1) > 0
    bad |= scaled & (np.abs(log2) > DRIFT_LOG2)
    grown = np.abs(log2) - np.abs(previous_log2) >= TREND_LOG2
    bad |= np.nan_to_num(grown, nan=0).astype(bool)
    for fmt in {c for c in cast_to if c}:
        rows = np.array([c == fmt for c in cast_to])
        over = stats.get(f"overflow_{fmt}")
        under = stats.get(f"underflow_{fmt}")
        if over is not None:
            bad |= rows & (np.nan_to_num(np.asarray(over).reshape(-1)) > 0)
        if under is not None:
            bad |= rows & (np.nan_to_num(np.asarray(under).reshape(-1)) > UNDERFLOW)
    bad &= measured
    previous_log2[measured] = log2[measured]
    return {int(g) for g in np.unique(row_group[bad]) if g >= 0}
