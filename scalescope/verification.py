"""`verify`: train a step with a precision policy and without, and measure the gap.

A verdict from statistics is a prediction; `verify` checks one against training. It runs
``steps`` steps of the plain step and of the step under ``policy`` (`emulate`), from the
same initial state on the same batches, and compares their losses: the measured cost of
the policy. ``scalescope verify RUN`` does it for a recorded sample-model run and keeps
the outcome in the run directory, where the report and the dashboard show it next to
what the what-if predicted.
"""

from __future__ import annotations

import itertools
import math
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

import jax
import numpy as np

from .core.policy import Policy, as_policy
from .core.scaled_array import asarray
from .probe import emulate
from .scalify import scalify as _scalify

#: A policy whose loss is more than this much (relative) above the plain step's, over
#: the last tenth of the steps, is measured unsafe; at least (docs/policies.md): the
#: threshold rises to `NOISE_FACTOR` times the gap of the BF16 control.
GAP_THRESHOLD = 0.005
#: How many times the control's |gap| (the noise floor) a gap must exceed to count.
NOISE_FACTOR = 2.0


@dataclass
class Verification:
    """What `verify` measured. ``gap``: (policy - plain) / plain of the mean loss over
    the last tenth of the steps (``tail`` steps); ``verdict``: ``"unsafe"`` when the gap
    exceeds ``threshold`` either way (a loss far below plain is the policy rounding the
    loss's own computation, not better training) or the policy's loss went non-finite;
    ``"unknown"`` when the plain step's loss is not finite (or zero) over the tail
    (nothing to compare against); else ``"safe"``. The policy's loss is the step's as
    computed (every op reads the rounded values), never the returned number rounded.
    ``step_ratio``: the emulated step's time over the plain step's (median, compiled).
    ``noise``: the gap of the control (the same values rounded to BF16 instead, a
    harmless perturbation: how far any two trajectories drift apart; NaN when no control
    ran); ``threshold`` is then at least `NOISE_FACTOR` times its magnitude.
    ``spread``: the standard error of the gap, from the per-step differences of the two
    runs over the tail (the same batches: what one window of steps can tell apart);
    ``threshold`` is at least `NOISE_FACTOR` times it too."""

    policy: list[list[str]]
    steps: int
    tail: int
    loss_plain: list[float]
    loss_policy: list[float]
    gap: float
    threshold: float
    verdict: str
    step_ratio: float
    noise: float = math.nan
    loss_control: list[float] = field(default_factory=list)
    spread: float = math.nan  # standard error of the gap from its tail's paired steps
    predicted: str = ""  # the what-if's verdict of the policy, when known
    prediction: list[dict[str, Any]] = field(default_factory=list)  # per reached value
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def agrees(self) -> bool | None:
        """Whether the prediction matches the measurement (None without a prediction,
        or without a measured verdict)."""
        if self.predicted not in ("safe", "unsafe") or self.verdict not in ("safe", "unsafe"):
            return None
        return self.predicted == self.verdict

    def summary(self) -> str:
        a, b = _tail_mean(self.loss_plain, self.tail), _tail_mean(self.loss_policy, self.tail)
        if self.verdict == "unknown":
            return (
                f"measured over {self.steps} steps: loss {a:.4f} plain, {b:.4f} with the "
                "policy: unknown (the plain step's loss is not a finite non-zero number over "
                "the last tenth of the steps, so no gap can be measured)"
            )
        line = (
            f"measured over {self.steps} steps: loss {a:.4f} plain, {b:.4f} with the policy "
            f"({self.gap:+.2%}; unsafe beyond ±{self.threshold:.2%}): {self.verdict}"
        )
        if self.gap < -self.threshold:
            line += (
                "\nthe policy's loss is below the plain one by more than the noise: a "
                "rounding does not train better, so the run departs from the plain one "
                "(a rule rounding the loss's own sums, E4M3 saturating at 448, reads so)"
            )
        if math.isfinite(self.noise):
            line += f"\nnoise floor: the same values in BF16 move the loss {self.noise:+.2%}"
        if math.isfinite(self.spread):
            line += (
                f"\nspread: the gap's standard error over the last {self.tail} steps is "
                f"{self.spread:.2%} (paired steps, the same batches)"
            )
        if self.predicted:
            agree = {True: "agrees", False: "disagrees", None: "cannot be compared"}[self.agrees]
            line += f"\npredicted by the what-if: {self.predicted} ({agree})"
            if self.predicted == "safe" and len(self.prediction) > 1:
                line += (
                    f", value by value: each of the {len(self.prediction)} values passes "
                    "alone; what their errors cost together only training shows (every "
                    "matmul operand of a small LM in NVFP4, each value safe: +50 %)"
                )
        return line

    def __str__(self) -> str:
        return self.summary()


def _tail_mean(values: list[float], tail: int) -> float:
    arr = np.asarray(values[-tail:], np.float64)
    return float(np.mean(arr)) if arr.size else math.nan


def _gap(plain: float, other: float) -> float:
    """(other - plain) / |plain|; NaN when the plain loss is not a finite non-zero."""
    return (other - plain) / abs(plain) if plain != 0 and math.isfinite(plain) else math.nan


def _spread(plain: list[float], other: list[float], tail: int, mean: float) -> float:
    """Standard error of the relative gap over the last ``tail`` steps, from the steps'
    paired differences (both runs see the same batches, so each step's difference is
    one sample of the gap); NaN under two steps or with a non-finite loss. Steps are
    treated as independent: the gap of one window of a few tens of steps moves by about
    this much from the next (a ViT at +-2 % in MXFP8, docs/policies.md)."""
    a = np.asarray(plain[-tail:], np.float64)
    b = np.asarray(other[-tail:], np.float64)
    if tail < 2 or len(a) < 2 or not (math.isfinite(mean) and mean != 0):
        return math.nan
    diff = (b - a) / abs(mean)
    if not np.isfinite(diff).all():
        return math.nan
    return float(np.std(diff, ddof=1) / math.sqrt(len(diff)))


def _loss_of(out: Any, where: str) -> tuple[tuple, float | Any]:
    if not isinstance(out, tuple | list) or len(out) < 2:
        raise TypeError(
            f"verify: the step must return (*state, loss), the new state then the loss; "
            f"{where} returned {type(out).__name__}"
        )
    loss = out[-1]
    if np.ndim(asarray(loss)) != 0:
        raise TypeError(
            f"verify: the step's last output must be the scalar loss; {where} returned "
            f"shape {np.shape(asarray(loss))}"
        )
    return tuple(out[:-1]), loss


def _train(
    fn: Callable[..., Any], state: tuple, batches: list, label: str, stream: TextIO | None
) -> tuple[list[float], list[float]]:
    losses, times = [], []
    n = len(batches)
    for i, batch in enumerate(batches):
        t0 = time.perf_counter()
        state, loss = _loss_of(fn(*state, batch), f"step {i} ({label})")
        value = float(np.asarray(asarray(loss), np.float64))
        times.append(time.perf_counter() - t0)
        losses.append(value)
        if stream is not None and (i + 1) % max(1, n // 10) == 0:
            stream.write(f"  {label}: step {i + 1}/{n}  loss {value:.4f}\n")
            stream.flush()
    return losses, times


def verify(
    step: Callable[..., Any],
    init_args: tuple | list,
    batches: Iterable[Any] | Callable[[], Iterable[Any]],
    policy: Policy | dict[str, str] | str,
    *,
    steps: int = 300,
    scalify: bool = False,
    threshold: float = GAP_THRESHOLD,
    control: bool = True,
    progress: bool | TextIO = False,
) -> Verification:
    """Train ``step`` for ``steps`` steps as it is and under ``policy`` (`emulate`),
    from ``init_args`` on the same ``steps`` batches, and measure the loss gap.

    ``step(*state, batch)`` returns ``(*new_state, loss)`` (the sample models' step:
    ``(params, opt_state, batch) -> (params, opt_state, loss)``); ``init_args`` is the
    initial state. ``batches``: an iterable of at least ``steps`` batches (or a callable
    returning one), each passed as the last argument; the first ``steps`` are used by
    both runs. ``scalify``: run both scalified (``ss.scalify``). A rule of ``policy``
    that reaches no op is a `PolicyError` before anything trains.

    ``control``: also train the control, the policy with every target replaced by BF16
    (a harmless rounding of the same values): its gap is the noise floor, and a gap
    counts as unsafe only beyond `NOISE_FACTOR` times it (or ``threshold``, whichever
    is larger). A small model whose trajectories drift apart by a percent from any
    perturbation would otherwise be called unsafe by noise. The threshold is also at
    least `NOISE_FACTOR` times the gap's standard error over the tail (``spread``): one
    control is one sample of the noise, and an FP8 trajectory wanders further from the
    plain one than a BF16 one does."""
    policy = as_policy(policy)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"verify: steps must be a positive int, got {steps!r}")
    if (
        isinstance(threshold, bool)
        or not isinstance(threshold, int | float)
        or not (math.isfinite(threshold) and threshold > 0)
    ):
        raise ValueError(
            f"verify: threshold must be a positive relative loss gap (0.005 is 0.5 %), "
            f"got {threshold!r}"
        )
    if not isinstance(init_args, tuple | list):
        raise TypeError(
            f"verify: init_args must be the tuple of the step's state arguments, got "
            f"{type(init_args).__name__}"
        )
    source = batches() if callable(batches) else batches
    taken = list(itertools.islice(iter(source), steps))
    if len(taken) < steps:
        raise ValueError(f"verify: {steps} steps need {steps} batches, got {len(taken)}")
    stream = None
    if progress:
        stream = progress if hasattr(progress, "write") else sys.stderr
    plain = jax.jit(_scalify(step) if scalify else step)
    # the loss (the last output) as computed: a rule reaching the returned number itself
    # would round what is printed, not what trains; a rule that changes nothing (held
    # for a matmul none reads) has nothing to verify
    exact = {"exact_outputs": (-1,), "strict": True}
    emulated = emulate(step, policy, scalify=scalify, **exact)
    emulated.describe(*init_args, taken[0])  # a rule reaching nothing fails here
    jax.eval_shape(emulated, *init_args, taken[0])  # one changing nothing, here
    emulated = jax.jit(emulated)
    state = tuple(init_args)
    loss_a, time_a = _train(plain, state, taken, "plain", stream)
    loss_b, time_b = _train(emulated, state, taken, "policy", stream)
    tail = max(1, steps // 10)
    a, b = _tail_mean(loss_a, tail), _tail_mean(loss_b, tail)
    gap = _gap(a, b)
    noise, loss_c = math.nan, []
    if control:
        bf16 = Policy([(r.pattern, r.spec if r.target == "fp32" else f"bf16@{r.reads}")
                       for r in policy.rules])  # fmt: skip
        loss_c, _ = _train(jax.jit(emulate(step, bf16, scalify=scalify, **exact)), state,
                           taken, "control", stream)  # fmt: skip
        noise = _gap(a, _tail_mean(loss_c, tail))
        if math.isfinite(noise):
            threshold = max(threshold, NOISE_FACTOR * abs(noise))
    spread = _spread(loss_a, loss_b, tail, a)
    if math.isfinite(spread):
        threshold = max(threshold, NOISE_FACTOR * spread)
    bad = not all(math.isfinite(v) for v in loss_b)
    if not (math.isfinite(a) and a != 0):  # no baseline to measure a gap against
        verdict = "unknown"
    else:  # beyond the threshold either way: a loss far below plain is no better
        # training but the policy rounding the loss's own sums (E4M3 saturating at 448)
        verdict = "unsafe" if bad or not (abs(gap) <= threshold) else "safe"
    ratio = math.nan
    if steps > 2:  # the first call of each compiles
        ratio = float(np.median(time_b[1:]) / np.median(time_a[1:]))
    return Verification(
        policy=[[r.pattern, r.spec] for r in policy.rules],
        steps=steps,
        tail=tail,
        loss_plain=loss_a,
        loss_policy=loss_b,
        gap=float(gap),
        threshold=float(threshold),
        verdict=verdict,
        step_ratio=ratio,
        noise=float(noise),
        loss_control=loss_c,
        spread=float(spread),
    )
