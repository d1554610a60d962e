"""The flight recorder: every tracked step is checked, recorded or not, and a step that
goes wrong is replayed and kept as an incident.

Inside the step's own program, or in a small one right after it (`check_in_step`),
`health` computes three scalars from the outputs: how many
float elements are NaN/Inf, the loss (the first scalar float output) and a norm (of the
update ``out[0] - args[0]`` when the first output is the first argument's new value, as
in ``step(params, ...) -> (params, ...)``; else of the non-scalar outputs), returned as
one array (`packed_health`). The host reads it once the step has run (a `Watcher`
thread, or the call itself for ``on_nonfinite`` "stop"/"skip") and `Detector` judges
it: non-finite, or a loss or norm spike (above the running median of recent healthy
steps by ``k`` median absolute deviations and by a ratio). A step that trips one is run
again fully instrumented from the same inputs, held by reference only until the step is
judged, so no copy of the state is kept; `describe_incident` names the first op, in
program order, whose output holds a NaN/Inf (for a spike: whose magnitude grew most
since the last recorded step), its source line, its inputs' statistics and the formats
its values exceed, and on a step spread over devices `nonfinite_devices` names the
devices holding them.
"""

from __future__ import annotations

import datetime as _dt
import functools
import math
import queue
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core import formats as _formats
from ..core.scaled_array import ScaledArray
from ..probe import reach
from . import layout as L
from .processes import to_host

#: What a trigger is called in an incident.
TRIGGERS = ("nonfinite", "loss_spike", "norm_spike")
#: What a tracked step does after a non-finite step (`Run`'s ``on_nonfinite``).
ON_NONFINITE = ("record", "stop", "skip")
#: Largest finite value of each plain format an incident's op is judged against.
_FORMAT_MAX = {name: float(f.max) for name, f in _formats.FORMATS.items()}


class NonFiniteStep(L.RunError):
    """A tracked step produced NaN/Inf and the run was opened with
    ``on_nonfinite="stop"``; ``incident`` holds what the replay found (the first op)."""

    def __init__(self, message: str, incident: dict[str, Any]) -> None:
        super().__init__(message)
        self.incident = incident


@dataclass(frozen=True)
class Triggers:
    """When a step is an incident. ``nonfinite``: any NaN/Inf in an output. A loss (or
    norm) spike: the value exceeds the median of the last ``window`` healthy steps by
    more than ``loss_spike`` (``norm_spike``) median absolute deviations *and* by the
    ratio ``loss_ratio`` (``norm_ratio``) of that median; None turns it off. Spikes are
    judged once ``warmup`` healthy steps have been seen. The deviation is at least 5 %
    of the median (a loss that low precision holds on a few values has none).

    The defaults are set against the labelled corpus (`benchmarks/bench_verdicts.py`):
    its healthy runs trip no trigger (their update norm moves by up to ~3.5x, a loss
    near zero doubles), and an injected 100x jump is caught at its step."""

    nonfinite: bool = True
    loss_spike: float | None = 12.0
    norm_spike: float | None = 12.0
    loss_ratio: float = 3.0
    norm_ratio: float = 10.0
    window: int = 128
    warmup: int = 32

    def __post_init__(self) -> None:
        for name in ("loss_spike", "norm_spike"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int | float) or not k > 0):
                raise ValueError(f"Triggers.{name}: expected a number > 0 or None, got {k!r}")
        for name in ("loss_ratio", "norm_ratio"):
            r = getattr(self, name)
            if not isinstance(r, int | float) or not r >= 1:
                raise ValueError(f"Triggers.{name}: expected a number >= 1, got {r!r}")
        for name in ("window", "warmup"):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"Triggers.{name}: expected an int >= 1, got {n!r}")


# -- on the device: the step's health ----------------------------------------------------


def _float_leaves(tree: Any) -> list[Any]:
    return [
        x
        for x in jax.tree_util.tree_leaves(tree)
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)
    ]


def same_layout(a: Any, b: Any) -> bool:
    """Whether two pytrees have the same structure, shapes and dtypes."""
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    if ta != tb or not la:
        return False
    return all(
        getattr(x, "shape", None) == getattr(y, "shape", None)
        and getattr(x, "dtype", None) == getattr(y, "dtype", None)
        for x, y in zip(la, lb, strict=True)
    )


def loss_of(args: Sequence[Any], out: Any) -> jax.Array | None:
    """The step's loss among its outputs: a scalar float leaf, taken from the outputs
    that are not an argument's new value (the parameters, an optimizer state holding a
    scalar learning rate), one named ``loss`` (a dict key or attribute) or ending in
    ``loss`` (``train_loss``) first, else the first; failing that, the first scalar
    float output anywhere. None when there is none. A metrics dict flattens by key
    (``accuracy`` before ``loss``): the name decides there, not the order."""
    tops = list(out) if isinstance(out, tuple | list) else [out]
    own = [o for o in tops if not _mirrors_an_argument(o, args)]
    for group in (own, tops):
        scalars = [
            (path, x)
            for path, x in jax.tree_util.tree_flatten_with_path(group)[0]
            if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and x.size == 1
        ]
        for rank in (0, 1):
            for path, x in scalars:
                if _loss_name(path) == rank:
                    return x
        if scalars:
            return scalars[0][1]
    return None


def _mirrors_an_argument(output: Any, args: Sequence[Any]) -> bool:
    """Whether ``output`` has the layout of an argument holding some non-scalar array
    (a state the step returns anew; a lone scalar is as likely a loss as a state)."""
    if not any(getattr(x, "size", 1) > 1 for x in jax.tree_util.tree_leaves(output)):
        return False
    return any(same_layout(a, output) for a in args)


def _loss_name(path: tuple) -> int | None:
    """0 when the innermost name on ``path`` is ``loss``, 1 when it ends in ``loss``
    (``train_loss``, ``total_loss``; case aside), else None."""
    for key in reversed(path):
        name = getattr(key, "key", None) if hasattr(key, "key") else getattr(key, "name", None)
        if isinstance(name, str):
            name = name.lower()
            return 0 if name == "loss" else 1 if name.endswith("loss") else None
    return None


def norm_kind(args: Sequence[Any], out: Any) -> str:
    """``"update"`` when the first output is the first argument's new value (its norm is
    that of the update), else ``"output"``. Scaled arrays: pass them through `_values`."""
    first = out[0] if isinstance(out, tuple | list) and out else None
    if args and first is not None and same_layout(args[0], first) and _float_leaves(first):
        return "update"
    return "output"


def _values(tree: Any) -> Any:
    """``tree`` with each `ScaledArray` replaced by the float32 value it represents: a
    rescale changes a value's data and scale, not the value."""

    def value(leaf: Any) -> Any:
        return leaf.to_array(jnp.float32) if isinstance(leaf, ScaledArray) else leaf

    return jax.tree_util.tree_map(value, tree, is_leaf=lambda x: isinstance(x, ScaledArray))


def _sums(operands: tuple[jax.Array, ...], dims: tuple[int, ...]) -> tuple[jax.Array, ...]:
    """Sums of ``operands`` over ``dims`` in one variadic reduction."""
    inits = tuple(np.zeros((), x.dtype) for x in operands)
    return lax.reduce(
        operands, inits, lambda a, b: tuple(p + q for p, q in zip(a, b, strict=True)), dims
    )


def _shape_health(
    counted: Sequence[jax.Array], squared: Sequence[jax.Array]
) -> tuple[jax.Array, jax.Array]:
    """``(non-finite elements of counted, sum of the finite squares of squared)`` for
    leaves of one shape (float32), in one reduction that reads each of them once.

    Leaves of one shape are added element by element before the reduction, which XLA
    fuses into its loop: one kernel per shape rather than per leaf (a model's biases and
    norms, their optimizer moments and the updates of each). The per-element sums are
    always two in one variadic reduction (NaNs and infinities counted apart where no
    squares are wanted): XLA on CPU fuses that into one loop, while a lone sum of a mask
    went through a tree reduction that wrote the mask out first."""
    dims = tuple(range(counted[0].ndim))
    if not squared:
        nans = functools.reduce(jnp.add, [jnp.isnan(v).astype(jnp.int32) for v in counted])
        infs = functools.reduce(jnp.add, [jnp.isinf(v).astype(jnp.int32) for v in counted])
        a, b = _sums((nans, infs), dims)
        return a + b, jnp.float32(0)
    bad = functools.reduce(jnp.add, [(~jnp.isfinite(v)).astype(jnp.int32) for v in counted])
    sq = functools.reduce(jnp.add, [jnp.where(jnp.isfinite(d), d * d, 0.0) for d in squared])
    return _sums((bad, sq), dims)


def _real(v: jax.Array) -> jax.Array:
    """``v`` in float32; a complex leaf by its modulus."""
    return jnp.abs(v).astype(jnp.float32) if jnp.iscomplexobj(v) else v.astype(jnp.float32)


def health(args: Sequence[Any], out: Any) -> dict[str, jax.Array]:
    """The step's health, computed on the device (traced): ``nonfinite`` (float
    elements of the outputs that are NaN/Inf), ``loss`` (`loss_of`, NaN when there is
    none) and ``norm`` (see `norm_kind`; non-finite elements left out,
    they are counted above). Scaled arrays count by the values they represent. Each
    output leaf (and, for an update, each old parameter) is read once, the leaves of one
    shape by one reduction (`_shape_health`)."""
    args, out = _values(tuple(args)), _values(out)
    leaves = _float_leaves(out)
    loss = loss_of(args, out)
    loss = jnp.float32(jnp.nan) if loss is None else loss.reshape(()).astype(jnp.float32)
    # shape -> (leaves counted for NaN/Inf, leaves whose finite squares are summed)
    groups: dict[tuple[int, ...], tuple[list, list]] = {}

    def add(x: jax.Array, square: jax.Array | None = None) -> None:
        counted, squared = groups.setdefault(tuple(x.shape), ([], []))
        counted.append(_real(x))
        if square is not None:
            squared.append(square)

    if norm_kind(args, out) == "update":
        new, old = jax.tree_util.tree_leaves(out[0]), jax.tree_util.tree_leaves(args[0])
        for n, o in zip(new, old, strict=True):
            if hasattr(n, "dtype") and jnp.issubdtype(n.dtype, jnp.inexact):
                add(n, _real(n - o) if jnp.iscomplexobj(n) else _real(n) - _real(o))
        for x in _float_leaves(tuple(out[1:])):
            add(x)
    else:
        for x in leaves:
            add(x, _real(x) if x.size > 1 else None)
    parts = [_shape_health(counted, squared) for counted, squared in groups.values()]
    # each shape's count in float32 before they are added: a sum of counts cannot wrap
    nonfinite = sum(p[0].astype(jnp.float32) for p in parts) if parts else jnp.float32(0)
    total = sum(p[1] for p in parts) if parts else jnp.float32(0)
    return {"nonfinite": jnp.asarray(nonfinite, jnp.float32), "loss": loss, "norm": jnp.sqrt(total)}


# -- on the host: the triggers ------------------------------------------------------------


#: The order of a step's health numbers in the one array a tracked program returns.
HEALTH_KEYS = ("nonfinite", "loss", "norm")

#: Where a tracked step's check runs (`check_in_step`); None: the backend decides.
IN_STEP: bool | None = None


def check_in_step() -> bool:
    """Whether the check runs inside the step's own program (GPU, TPU) or in a program
    of its own dispatched right after it (CPU).

    Inside the step, XLA's GPU compiler can fuse each reduction into the kernel that
    produces the output it reads (a multi-output fusion), so the check reads nothing
    again. XLA's CPU compiler instead fuses the producer (the optimizer's update, with
    its scale arithmetic) into the reduction as well, computing it twice: the sample
    GPT's FP8 step (2 x 128) ran 4-6 % slower with the check inside and 2 % with it after,
    which reads the outputs and the old parameters once more (docs/flight.md). `IN_STEP`
    overrides the choice (the GPU suite measures both)."""
    return IN_STEP if IN_STEP is not None else jax.default_backend() != "cpu"


def packed_health(args: Sequence[Any], out: Any) -> jax.Array:
    """`health` as one float32[3] array (`HEALTH_KEYS` order): what a tracked program
    returns, so that the host reads it in one transfer."""
    h = health(args, out)
    return jnp.stack([jnp.asarray(h[k], jnp.float32) for k in HEALTH_KEYS])


def read_health(packed: Any) -> dict[str, float]:
    """A step's health on the host from `packed_health` (waits for the step)."""
    values = np.asarray(to_host(packed), np.float64).reshape(-1)
    return dict(zip(HEALTH_KEYS, values.tolist(), strict=True))


class Call(NamedTuple):
    """One tracked call as the flight recorder judges it: its number, inputs, outputs,
    health, statistics (None when not recorded) and the last two fully measured steps'
    statistics as they were after it (what a spike is compared with)."""

    step: int
    args: tuple
    kwargs: dict
    out: Any
    health: Any
    stats: Any
    kept: tuple[Any, Any]


class Watcher:
    """Judges calls in a thread of its own as their steps finish (`Detector.check` on
    each health, in call order). A healthy call is dropped at once (its inputs are let
    go); one that trips a trigger is kept with its judgement until `judged` hands it to
    the caller's thread, which replays it."""

    def __init__(self, detector: Detector) -> None:
        self.detector = detector
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Condition()
        self._last = -1  # the last step judged
        self._tripped: list[tuple[Call, tuple]] = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="scalescope-health", daemon=True)
        self._thread.start()

    def put(self, call: Call) -> None:
        self._queue.put(call)

    def judged(self, upto: int) -> list[tuple[Call, tuple]]:
        """Wait until every call up to step ``upto`` is judged; the ones that tripped a
        trigger, with what `Detector.check` found, in order. Raises what reading a
        step's health raised (e.g. the step failed on the device)."""
        with self._done:
            self._done.wait_for(lambda: self._last >= upto or self._error is not None)
            if self._error is not None:
                err, self._error = self._error, None
                raise err
            out = [t for t in self._tripped if t[0].step <= upto]
            self._tripped = [t for t in self._tripped if t[0].step > upto]
        return out

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while True:
            call = self._queue.get()
            if call is None:
                return
            try:
                found = self.detector.check(read_health(call.health))
            except BaseException as err:  # noqa: BLE001 - raised in the caller's thread
                with self._done:
                    self._error, self._last = err, call.step
                    self._done.notify_all()
                continue
            step, tripped = call.step, None if found is None else (call, found)
            call = None  # a healthy call's inputs go now, before anyone is told
            with self._done:
                if tripped is not None:
                    self._tripped.append(tripped)
                self._last = step
                self._done.notify_all()
            tripped = None


class Detector:
    """Judges each step's health (`health`, read to the host) against `Triggers`; keeps
    the recent healthy losses and norms that the spike triggers compare with."""

    def __init__(self, triggers: Triggers) -> None:
        self.triggers = triggers
        self.losses: deque[float] = deque(maxlen=triggers.window)
        self.norms: deque[float] = deque(maxlen=triggers.window)
        self.ongoing: str | None = None  # the trigger of the bad stretch under way

    def check(self, h: Mapping[str, float]) -> tuple[str, float, str, bool] | None:
        """``(trigger, value, why, first)`` when the step trips a trigger, else None
        (and the step joins the history). ``first``: the first step of a stretch of
        steps tripping that trigger (a NaN spreads to every later step: one incident).
        A norm of exactly 0 (a step that changed nothing: gradient accumulation such as
        ``optax.MultiSteps`` between updates, an update ``apply_if_finite`` skipped) is
        neither judged nor kept: with 3 steps in 4 at 0 the median was 0, and every real
        update read as a spike."""
        t = self.triggers
        nonfinite, loss, norm = float(h["nonfinite"]), float(h["loss"]), float(h["norm"])
        found = None
        if t.nonfinite and nonfinite > 0:
            found = (
                "nonfinite",
                nonfinite,
                f"{nonfinite:.0f} non-finite element(s) in the step's outputs",
            )
        else:
            found = self._spike("loss", loss, self.losses, t.loss_spike, t.loss_ratio)
            if norm != 0:  # no update (accumulating, skipped): no sample of its norm
                found = found or self._spike("norm", norm, self.norms, t.norm_spike, t.norm_ratio)
        if found is not None:
            first = self.ongoing != found[0]
            self.ongoing = found[0]
            return (*found, first)
        self.ongoing = None
        if math.isfinite(loss):
            self.losses.append(loss)
        if math.isfinite(norm) and norm != 0:
            self.norms.append(norm)
        return None

    def _spike(
        self, what: str, value: float, history: deque, k: float | None, ratio: float
    ) -> tuple[str, float, str] | None:
        if k is None or not math.isfinite(value) or len(history) < self.triggers.warmup:
            return None
        past = np.asarray(history, np.float64)
        median = float(np.median(past))
        mad = float(np.median(np.abs(past - median)))
        floor = max(mad, 0.05 * abs(median), 1e-12)
        excess = value - median
        if excess > k * floor and excess > (ratio - 1.0) * abs(median):
            return (
                f"{what}_spike",
                value,
                f"{what} {value:.4g} against a median of {median:.4g} over the last "
                f"{len(past)} healthy steps ({excess / floor:.0f} median deviations above)",
            )
        return None


# -- what the replay found -----------------------------------------------------------------


def _per_op(table: Any, values: Any) -> dict[int, float]:
    """One value per recorded op from per-row ``values``: the largest over its rows (loop
    iterations), NaN rows left out."""
    out: dict[int, float] = {}
    values = np.asarray(values, np.float64)
    for op, v in zip(np.asarray(table.row_op).tolist(), values.tolist(), strict=True):
        if math.isnan(v):
            continue
        out[op] = v if op not in out else max(out[op], v)
    return out


def _at_iteration(table: Any, values: Any, it: int, scans: tuple) -> dict[int, float]:
    """One value per op of the loop nest ``scans`` at flat iteration ``it`` (what an op
    of that loop read in that iteration), NaN rows left out."""
    values = np.asarray(values, np.float64)
    out: dict[int, float] = {}
    for rec in table.ops:
        if rec.scans == scans and rec.n_rows > it and rec.stats_op == rec.id:
            v = float(values[rec.row_start + it])
            if not math.isnan(v):
                out[rec.id] = v
    return out


def run_order(table: Any) -> list[int]:
    """The rows of ``table`` in the order the step computed them: ops in program order,
    and a scan's rows by iteration (last first for a reversed scan, as a scan's
    transpose runs), every op of one iteration before the next iteration's. A while
    loop's row, which sums its iterations, stands at its op."""
    ops = {rec.id: rec for rec in table.ops}
    first: dict[int, int] = {}  # scan -> the lowest op id in its body: where it starts
    for rec in table.ops:
        for serial, _ in rec.scans:
            first[serial] = min(first.get(serial, rec.id), rec.id)
    keys = []
    for op, it in zip(np.asarray(table.row_op).tolist(), np.asarray(table.row_iter).tolist()):
        rec, key = ops[op], []
        if rec.scans and len(rec.scans) == len(rec.loop):
            index = np.unravel_index(it, rec.loop)
            for (serial, reverse), i, n in zip(rec.scans, index, rec.loop, strict=True):
                key += [first[serial], n - 1 - int(i) if reverse else int(i)]
        keys.append((*key, op))
    return sorted(range(len(keys)), key=keys.__getitem__)


def _iteration_text(rec: Any, it: int) -> str:
    """`` in iteration 3 of 12`` for an op inside a scan (``(1, 3)`` when nested)."""
    if not rec.loop or int(np.prod(rec.loop)) <= 1:
        return ""
    index = tuple(int(i) for i in np.unravel_index(it, rec.loop))
    shown = index[0] if len(index) == 1 else index
    total = rec.loop[0] if len(rec.loop) == 1 else tuple(rec.loop)
    return f" in iteration {shown} of {total}"


def _log2(x: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log2(np.where(x > 0, x, np.nan))


def dropped_by_design(table: Any, nonfinite: set[int]) -> set[int]:
    """Of ``nonfinite`` (op ids holding a NaN/Inf), the values computed from constants
    and the step count, or read only through a ``where`` (`OpRecord.origin` "constant",
    "guarded"), whose NaN/Inf no path carries to the step's outputs (`reach.dropped`)."""
    by_design = {rec.stats_op for rec in table.ops if rec.origin in reach.BY_DESIGN}
    candidates = nonfinite & by_design
    if not candidates:
        return set()
    flow = reach.flow_of(
        (rec.stats_op, rec.inputs, rec.dtype, rec.primitive == "output") for rec in table.ops
    )
    return reach.dropped(nonfinite, flow) & candidates


def describe_incident(
    table: Any,
    stats: Mapping[str, np.ndarray],
    trigger: str,
    previous: Mapping[str, np.ndarray] | None,
    formats: Sequence[str],
    exact: bool = True,
) -> dict[str, Any]:
    """The op an incident names and what is known of it, from the replayed step's
    statistics (host arrays, one value per row of ``table``). Non-finite: the first op,
    in program order, with a NaN/Inf in its output, leaving out ops non-finite by
    construction (mask fills, and ops already non-finite at ``previous``, the last fully
    measured step's statistics). A spike: the op whose abs-max grew most (log2) since
    ``previous``, else the one of largest abs-max. Keys: op, name, primitive, source,
    detail, formats, inputs.

    A spike's op is the first, in program order, whose abs-max grew by at least a
    quarter of the largest growth (in log2) and by at least 2x: ops downstream of the
    jump grow more (a gradient squares it), the origin comes first.

    ``exact``: the statistics measured every element (no ``sample``); only then does a
    non-finite incident say its op made the NaN/Inf from finite inputs."""
    ops = {rec.id: rec for rec in table.ops}
    frac = _per_op(table, stats["frac_nonfinite"])
    absmax = _per_op(table, stats["absmax"])
    rms = _per_op(table, stats["rms"])
    zero = _per_op(table, stats["frac_zero"]) if "frac_zero" in stats else {}
    op, row = None, None
    if trigger == "nonfinite":
        # NaN/Inf by construction (a causal mask's -inf, its softmax inputs) is no
        # incident's start: neither a fill nor an op already non-finite at the last
        # fully measured step (the step was healthy then)
        expected = {rec.id for rec in table.ops if rec.origin == "fill"}
        if previous is not None:
            before = _per_op(table, previous["frac_nonfinite"])
            expected |= {o for o, f in before.items() if f > 0}
        # nor one that nothing downstream keeps (a schedule's unused branch, a log under
        # a where), even where the outputs went non-finite for another reason
        expected |= dropped_by_design(table, {o for o, f in frac.items() if f > 0})
        row_op = np.asarray(table.row_op)
        shares = np.asarray(stats["frac_nonfinite"], np.float64)
        # the first row the step computed, not the lowest op id: inside a scan, an op
        # early in the body reads in iteration 1 what a later op made in iteration 0
        row = next(
            (r for r in run_order(table) if shares[r] > 0 and int(row_op[r]) not in expected),
            None,
        )
        op = None if row is None else int(row_op[row])
        if op is not None:
            share = "all" if shares[row] >= 1 else pct_text(float(shares[row]))
            it = int(np.asarray(table.row_iter)[row])
            where = _iteration_text(ops[op], it)
            why = f"first op with a NaN/Inf output{where}: {share} of its elements"
        else:
            why = (
                "no recorded op holds a NaN/Inf (the non-finite value is in an output "
                "the probe does not record)"
            )
    else:
        growth: dict[int, float] = {}
        if previous is not None:
            before = _per_op(table, previous["absmax"])
            for o, a in absmax.items():
                if o in before:
                    growth[o] = float(_log2(np.array(a)) - _log2(np.array(before[o])))
            growth = {o: g for o, g in growth.items() if math.isfinite(g)}
        top = max(growth, key=lambda o: (growth[o], -o)) if growth else None
        if top is not None and growth[top] > 0:
            # downstream ops grow more (a gradient squares a jump): the first op, in
            # program order, whose growth is a good part of the largest is the origin
            sharp = min(growth[top], max(1.0, growth[top] / 4))
            op = min(o for o, g in growth.items() if g >= sharp)
            why = (
                "first op whose abs-max jumped since the last recorded step: "
                f"x{2 ** growth[op]:.3g}"
            )
            if op != top:
                why += f" (the largest jump, x{2 ** growth[top]:.3g}, at {_shown(ops[top])})"
        elif absmax:
            op = max(absmax, key=lambda o: (absmax[o], -o))
            why = "largest abs-max of the step (no earlier recorded step to compare with)"
        else:
            why = "no recorded op to compare"
    if op is None:
        return {"op": -1, "name": "", "primitive": "", "source": "", "detail": why}
    rec = ops[op]
    if row is not None and len(rec.loop):  # the op and its loop's inputs at that iteration
        it = int(np.asarray(table.row_iter)[row])
        absmax, rms, frac, zero = (
            {**m, **_at_iteration(table, stats[k], it, rec.scans)} if k in stats else m
            for m, k in (
                (absmax, "absmax"),
                (rms, "rms"),
                (frac, "frac_nonfinite"),
                (zero, "frac_zero"),
            )
        )
    top = absmax.get(op, math.nan)  # of the finite elements
    exceeded = [f for f in formats if f in _FORMAT_MAX and top > _FORMAT_MAX[f]]
    inputs = []
    for i in rec.inputs:
        if i in ops:
            inputs.append(
                {
                    "op": int(i),
                    "name": _shown(ops[i]),
                    "rms": rms.get(i, math.nan),
                    "absmax": absmax.get(i, math.nan),
                    "frac_nonfinite": frac.get(i, math.nan),
                    "frac_zero": zero.get(i, math.nan),
                }
            )
    parts = [why]
    if math.isfinite(top):
        finite = "of its finite elements " if frac.get(op, 0) > 0 else ""
        parts.append(f"abs-max {finite}{top:.4g}, rms {rms.get(op, math.nan):.4g}")
    if exceeded:
        parts.append("beyond the range of " + ", ".join(exceeded))
    if trigger == "nonfinite" and exact and _made_here(rec, inputs):
        parts.append("its inputs are finite: the NaN/Inf is made here" + _narrow_max(rec.dtype))
        parts += _zeros_it_cannot_take(rec, inputs, ops)
    if inputs:
        shown = "; ".join(
            f"{x['name']} (rms {x['rms']:.3g}, abs-max {x['absmax']:.3g}, "
            f"{pct_text(x['frac_nonfinite'])} non-finite)"
            for x in inputs[:4]
        )
        parts.append(f"inputs: {shown}")
    return {
        "op": int(op),
        "name": _shown(rec),
        "primitive": rec.primitive,
        "source": rec.source,
        "detail": "; ".join(parts),
        "formats": exceeded,
        "inputs": inputs,
    }


def _shown(rec: Any) -> str:
    """How an incident names an op: ``pass/name`` (``fwd/block_0/attn/dot_general``),
    and an input by its name alone, which already starts with its pass (``input/x``)."""
    return rec.name if rec.name.startswith(f"{rec.pass_}/") else rec.label


def _made_here(rec: Any, inputs: list[dict[str, Any]]) -> bool:
    """Every float input of the op is measured and free of NaN/Inf: the op itself made
    its non-finite values (an overflow, 0/0, log(0), ...), nothing upstream did. An
    input left unmeasured (``select``) has a NaN fraction, and one with no record at all
    (a loop's output) clears ``inputs_complete``: no claim is made then."""
    return bool(inputs) and rec.inputs_complete and all(x["frac_nonfinite"] == 0 for x in inputs)


def _zeros_it_cannot_take(
    rec: Any, inputs: list[dict[str, Any]], ops: Mapping[int, Any]
) -> list[str]:
    """Where an op that is infinite at zero (`OpRecord.zero_pole`: ``log``, ``rsqrt``, a
    divisor, a negative power) made the NaN/Inf from an input holding exact zeros: say so,
    and name the cast that made them, where a cast to a narrower float produced that input
    (values flushed to zero by FP8 or FP16, then ``log`` of them)."""
    x = next((x for x in inputs if x["op"] == rec.zero_pole), None)
    if x is None or not x.get("frac_zero", 0) > 0:
        return []
    said = f"{x['name']} holds exact zeros ({pct_text(x['frac_zero'])} of it)"
    src = ops.get(x["op"])
    if src is not None and src.stats_op != src.id:  # a widening cast back: its source
        src = ops.get(src.stats_op, src)
    if (
        src is not None
        and src.primitive == "convert_element_type"
        and _formats.narrower_than_float32(src.dtype)
    ):
        said += f", made by its cast to {src.dtype}, which flushes small values to zero"
    return [said + f": {_POLE_NAME.get(rec.primitive, rec.primitive)} is infinite there"]


#: How an incident names the operation whose pole an exact zero hit.
_POLE_NAME = {"div": "the division", "integer_pow": "the negative power", "pow": "the power"}


def _narrow_max(dtype: str) -> str:
    """`` (float16 output: largest finite 65504)`` for a float dtype with less range
    than float32, where an overflow is the usual cause; "" otherwise."""
    if not _formats.narrower_than_float32(dtype):
        return ""
    return f" ({dtype} output: largest finite {float(jnp.finfo(dtype).max):.6g})"


def nonfinite_devices(where: Any, plucked_in: Any = None) -> list[dict[str, int]]:
    """The devices holding NaN/Inf of an incident's op, from `instrument`'s
    ``nonfinite_where``: ``[{"device", "process", "nonfinite"}]`` in device order (the
    count of NaN/Inf elements each holds; a replicated value counts on every copy).
    ``where`` is laid out as the op's value was (GSPMD), or holds per-device counts over
    the manual axes of a shard_map body (``plucked_in``: its mesh and axes). Across
    processes every process contributes its own devices (one collective)."""
    if where is None:
        return []
    devices = jax.devices()
    index = {d.id: i for i, d in enumerate(devices)}
    counts = np.zeros(len(devices), np.int64)
    mesh = getattr(plucked_in, "mesh", None)
    if plucked_in is not None:
        per = _local(where)[0]
        per = per.reshape(-1, per.shape[-1]).sum(axis=0)
        names = tuple(mesh.axis_names)
        grid = np.asarray(mesh.devices)
        sizes = [grid.shape[names.index(a)] for a in plucked_in.axes]
        for flat, n in enumerate(per):
            at = dict(zip(plucked_in.axes, np.unravel_index(flat, sizes), strict=True))
            block = grid[tuple(at.get(a, slice(None)) for a in names)]
            for d in np.ravel(block):
                counts[index[d.id]] = max(counts[index[d.id]], int(n))
    else:
        for shard in where.addressable_shards:
            counts[index[shard.device.id]] += int(np.count_nonzero(np.asarray(shard.data)))
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            counts = (
                np.asarray(multihost_utils.process_allgather(counts))
                .reshape(-1, len(devices))
                .sum(axis=0)
            )
    return [
        {"device": int(d.id), "process": int(d.process_index), "nonfinite": int(n)}
        for d, n in zip(devices, counts, strict=True)
        if n > 0
    ]


def devices_text(found: Sequence[Mapping[str, int]], total: int) -> str:
    """``found`` (`nonfinite_devices`) in words: which of ``total`` devices."""
    if not found:
        return "no device holds it"
    if len(found) == total and total > 1:
        return f"on all {total} devices"
    named = ", ".join(f"{d['device']} (process {d['process']})" for d in found)
    word = "device" if len(found) == 1 else "devices"
    return f"on {word} {named} of {total}"


def pct_text(fraction: float) -> str:
    if not math.isfinite(fraction):
        return "n/a"
    return f"{fraction * 100:.3g} %"


def now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def trees_equal(a: Any, b: Any) -> bool:
    """Whether two pytrees of arrays hold the same values (NaN equal to NaN); an array
    spread over several processes is compared on this process's shards."""
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    if ta != tb:
        return False
    for x, y in zip(la, lb, strict=True):
        for u, v in zip(_local(x), _local(y), strict=False):
            if u.shape != v.shape or not np.array_equal(u, v, equal_nan=u.dtype.kind in "fc"):
                return False
    return True


def _local(x: Any) -> list[np.ndarray]:
    """The values of ``x`` this process holds: the whole array, or its own shards; a
    typed PRNG key by its key data."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return [np.asarray(s.data) for s in x.addressable_shards]
    return [np.asarray(x)]
