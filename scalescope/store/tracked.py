"""`Tracked`: what `Run.track` returns, the step function wrapped to record.

A tracked step compiles the plain step and a recording program (the step evaluated
again with the probe's statistics). Every ``every``-th call, or the calls a
`budget.BudgetController` picks, runs the recording program after the plain one (so the
outputs are bit for bit those of an unrecorded step) and hands the statistics to the
run's background writer. Under a budget the recording program compiles in a background
thread while the steps run plain.

With the flight recorder on (`Run`'s ``detect``), each step's health (`flight.health`)
is computed inside the programs that give the outputs, or on CPU by a small program
of its own right after the step (`flight.check_in_step`, `_HEALTH`); every call reads
it and a step that trips a trigger is replayed with every op measured and kept as an
incident (see `flight`).
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core.scaled_array import ScaledArray, is_scaled_array
from ..probe import emulate, instrument
from ..probe.instrument import as_jit_passes
from ..scalify import scalify as _scalify
from ..scalify.interpreter import flatten_args
from . import budget as _budget
from . import flight, stateful, updates
from . import layout as L
from .jitting import (
    Static,
    StaticLeafJit,
    as_statics,
    partition,
    program_name,
    signature,
    with_statics,
)
from .processes import global_mesh, replicated, to_host

log = logging.getLogger("scalescope")

#: How a tracked step's arguments are named in errors (see `jitting.partition`).
_WHERE = "Run.track: the step's argument"


class _ProgramCache:
    """The programs of the last few tracked steps, by step function and options.

    A second `Run.track` of the same function with the same options (a notebook cell run
    again, the variants of a benchmark) reuses the jitted programs, with their traces and
    compiled executables, instead of tracing and compiling them anew. The programs are
    pure: everything a run owns (its step counter, writer, triggers, budget) stays in its
    `Tracked`. Holding a step function here keeps it alive, so only `SIZE` are kept, the
    least recently tracked dropped first; unhashable options (a policy given as a dict)
    are not cached."""

    SIZE = 4

    def __init__(self) -> None:
        self._entries: dict[Any, tuple[Any, ...]] = {}
        self._lock = threading.Lock()

    def get(self, key: tuple, build: Callable[[], tuple[Any, ...]]) -> tuple[Any, ...]:
        try:
            hash(key)
        except TypeError:
            return build()
        with self._lock:
            entry = self._entries.pop(key, None)
        if entry is None:
            entry = build()
        with self._lock:
            self._entries[key] = entry  # the most recent last
            while len(self._entries) > self.SIZE:
                del self._entries[next(iter(self._entries))]
        return entry

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


_PROGRAMS = _ProgramCache()


def _outside_package() -> int:
    """The ``stacklevel`` of the first caller outside scalescope, for a warning that
    names the user's line whichever entry point (a call, ``warmup``) got there."""
    package = str(Path(__file__).resolve().parents[1])
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


class Tracked:
    """What `Run.track` returns: call it like the step function it wraps.

    ``step`` is the number the next call gets; calls whose number is a multiple of
    ``every`` run the recording variant (under a budget, the `budget.BudgetController`
    decides instead, and ``controller`` holds its state). ``run``: the `Run` that owns
    it (typed loosely: `writer` imports this module, not the reverse).
    """

    def __init__(
        self,
        run: Any,
        fn: Callable[..., Any],
        *,
        scalify: bool,
        every: int,
        policy: Any = None,
        donate: tuple[int, ...] = (),
        static: tuple[int, ...] = (),
        static_names: tuple[str, ...] = (),
    ) -> None:
        self.run, self.every, self.scalify, self.policy = run, every, scalify, policy
        # positions (and keyword-only names) of the arguments passed whole as static
        # values (`jitting.Static`)
        self.static, self.static_names = static, static_names
        fn = with_statics(fn) if static or static_names else fn
        # positions of the arguments the step's programs may overwrite (`Run.track`'s
        # donate_argnums): such a step keeps no inputs to replay (`_incident`)
        self.donate = donate
        # Calls of functions whose graph is the run's take the run's next number (`step`):
        # a step tracked again (a notebook cell run twice, or once with donation and
        # once without) continues the run's steps instead of recording over them. A
        # function of another graph (`_foreign`) numbers its own calls, from here.
        self._own_step = run._next_step
        self.budgeted = run.budget is not None
        # The recorded values come from a program of their own (the step evaluated again,
        # with statistics): a recorded step runs the plain program for its outputs, so
        # they are bit for bit those of an unrecorded step, and the two programs never
        # hold their temporaries at once (but for one first run of the statistics
        # program beside the steps on CPU, `_compile_async`). isolate=False records
        # inside one program that also gives the outputs (cheaper; outputs may differ in
        # the last bits).
        self.separate = run.isolate
        self.detect = run.detect
        # the check inside the plain program, or after it (`flight.check_in_step`), which
        # reads the first argument (and the others' layout): inside when the step is
        # given arguments to overwrite
        self.in_step = self.detect and (bool(donate) or flight.check_in_step())
        formats = tuple(run.formats) + tuple(run.recipes)
        unjudged = [] if policy is None else [t for t in policy.targets() if t not in formats]
        if unjudged:
            warnings.warn(
                f"Run.track: the policy rounds values to {', '.join(unjudged)}, which "
                f"{run.path} does not record: the verdict cannot judge those values. Pass "
                f"Run(..., formats=(..., {', '.join(repr(t) for t in unjudged)})) to judge them.",
                stacklevel=3,
            )
        options = dict(
            scalify=scalify,
            formats=formats,
            histograms=run.histograms,
            select=run.select,
            sample=run.sample,
            fallback=run.fallback,
            groups=run.groups if self.budgeted else 0,
            policy=policy,
        )
        self.instrumented, self._plain, self._recording = _PROGRAMS.get(
            (fn, self.separate, self.detect, self.in_step, self.budgeted, donate)
            + tuple(sorted(options.items())),
            lambda: self._programs(stateful.returning_state(fn), options),
        )
        self.detector = flight.Detector(run.triggers) if self.detect else None
        self._last_good: Any = None  # outputs of the last healthy call (on_nonfinite="skip")
        self._watcher: flight.Watcher | None = None  # judges steps as they run ("record")
        self._watched = -1  # the last step handed to the watcher
        self._last_stats: Any = None  # statistics of the last fully measured step
        self._prev_stats: Any = None  # and of the one before it
        self._registered = False
        self._health_names_cache: list[str | None] | None = None  # `_health_names`
        # another function tracked into the run first holds its graph, and this one's
        # differs (an eval step beside the train step): its calls run unrecorded
        self._foreign = False
        # call signature -> records (same graph)? or _ADAPT (the same once its constants
        # are scaled like the registered call's leaves, `_kinds`)
        self._signatures: dict[Any, Any] = {}
        self._kinds: tuple[Any, list[bool]] | None = None
        self.controller: _budget.BudgetController | None = None
        self._warm: set[str] = set()  # variants already compiled (their first call is not timed)
        self._starved_warned = False  # the check takes the whole budget (warned once)
        # Under a budget the statistics program compiles in a thread (`_compile_async`);
        # set once it has (or has failed: the first recorded step then compiles it again).
        self._compiled = threading.Event()
        self._compile_thread: threading.Thread | None = None
        self._submitted_step = -1  # the last step whose statistics went to the writer
        # What the policy's held formats keep of each update (`updates`), measured at
        # recorded steps; None without a policy holding the state (set at registration).
        self._measure: updates.Measure | None = None
        # to pass each argument the same way whether given by position or keyword: the
        # op table names inputs as they are passed, and a run holds one graph
        try:
            self._signature: inspect.Signature | None = inspect.signature(fn)
        except (TypeError, ValueError):  # a builtin or a callable without one
            self._signature = None
        functools.update_wrapper(self, fn)

    def _programs(self, fn: Callable[..., Any], options: dict[str, Any]) -> tuple[Any, ...]:
        """``(instrumented, plain, recording)``: the step instrumented, and the jitted
        plain and recording programs (see `_PROGRAMS`)."""
        self.instrumented = instrument(fn, isolate=False, **options)
        scalify, fallback, policy = options["scalify"], options["fallback"], options["policy"]
        if policy is not None:
            plain = emulate(fn, policy, scalify=scalify, fallback=fallback)
            # one plan for both programs: the probe's abstract pass over the step, once
            self.instrumented.plain_probe = plain.probe
        else:
            plain = _scalify(fn, fallback=fallback) if scalify else fn
        plain = _with_health(plain) if self.in_step else plain
        plain_jit = StaticLeafJit(plain, _WHERE, self._program_name(), donate=self.donate)
        return self.instrumented, plain_jit, self._recording_fn(None)

    def _scalified(self, table: Any) -> bool:
        """Whether the step runs scaled (what the run's graph records, and the advisor's
        fixes follow): asked for, and some value of it carries a scale. Under scalify a
        step whose arguments are plain arrays runs as written (naive casts): that is
        said once, with how to scalify it or record it as it is."""
        if not self.scalify or any(op.scaled for op in table):
            return self.scalify
        warnings.warn(
            f"Run.track: {self._program_name()} runs under scalify, but none of its "
            "values carries a scale (its arguments are plain arrays): it runs and is "
            "recorded as written, its casts unscaled. Pass them as "
            "ss.as_scaled_array(x, 'rms') to scale them, or track(fn, scalify=False) to "
            "record the step as it is without this warning",
            stacklevel=_outside_package(),
        )
        return False

    def _program_name(self) -> str:
        """Every program of the step is named after it (see `StaticLeafJit`)."""
        return program_name(getattr(self.instrumented, "__wrapped__", self.instrumented), "step")

    def _recording_fn(self, mesh: jax.sharding.Mesh | None) -> Callable[..., Any]:
        """The jitted recording variant; with ``mesh`` (a step jitted over devices of
        several processes) its statistics are replicated on every device of the mesh."""
        inst = self.instrumented.masked if self.budgeted else self.instrumented
        if self.separate:
            stats = lambda *a, **k: replicated(inst(*a, **k)[1], mesh)  # noqa: E731
            return StaticLeafJit(stats, _WHERE, self._program_name())
        detect, lead = self.detect, 1 if self.budgeted else 0

        def both(*a: Any, **k: Any) -> tuple[Any, ...]:
            out, stats = inst(*a, **k)
            if detect:  # the step's own arguments follow the budget's mask
                return out, replicated(stats, mesh), flight.packed_health(a[lead:], out)
            return out, replicated(stats, mesh)

        donate = tuple(i + lead for i in self.donate)  # this program gives the outputs
        return StaticLeafJit(both, _WHERE, self._program_name(), donate=donate)

    def records(self, step: int) -> bool:
        """Whether call number ``step`` records statistics (every-``every`` mode)."""
        return step % self.every == 0

    def _register(self, args: tuple, kwargs: dict) -> bool:
        """Trace (no compile) and check the graph against the run before anything of
        this call reaches the directory, recorded step or not; False when another
        function tracked into the run holds a graph other than this one's."""
        t0 = time.perf_counter()
        mesh = global_mesh((args, kwargs))
        if mesh is not None:
            self._recording = self._recording_fn(mesh)
        # The op table comes from tracing the recording program itself: jit keeps that
        # trace, so the first recorded step compiles without tracing the step again.
        mask = self._every_group()
        traced = self._recording.trace(*(() if mask is None else (mask,)), *args, **kwargs)
        table = self.instrumented.op_table(*args, **kwargs)
        if self._graph_of_another(table):
            return False
        self._warn_if_donation_dropped(args, kwargs)
        self.run._register(table, self._scalified(table))
        self._registered = True
        if self.policy is not None:
            self._measure = self._held_measure(table, args, kwargs, mesh)
            if self._measure is not None and self.donate:
                raise ValueError(
                    f"Run.track: {self._program_name()} is tracked with donate_argnums="
                    f"{self.donate} under a policy that holds its weights in narrow "
                    "formats: what each update keeps is measured from the weights before "
                    "and after the step, and donation frees the ones before. Track it "
                    "without donate_argnums."
                )
        self._kinds = _leaf_kinds(args, kwargs)
        if self.budgeted:
            self.controller = _budget.BudgetController(
                self.run.budget,
                table.group_elements,
                every=self.every,
                fixed_share=1.0 if self.run.isolate else 0.1,
            )
            self.run._writer.on_findings = self.controller.observe_findings
            self.run._writer.on_cost = self.controller.observe_writer
            warm = None
            one = jax.default_backend() == "cpu" and jax.process_count() == 1
            if one and not self.donate:  # `_compile_async` (a donated state is not kept)
                warm = partition((mask, *args), kwargs, where=_WHERE)[1]
            self._compile_async(traced, warm)
        else:
            self._compiled.set()
        log.info(
            "scalescope: recording %d ops (%d rows) %s into %s (traced in %.1f s; the "
            "recording step compiles %s)",
            len(table),
            table.n_rows,
            f"under a {self.run.budget:.0%} budget in {table.n_groups} groups"
            if self.budgeted
            else f"every {self.every} steps",
            self.run.path,
            time.perf_counter() - t0,
            "in the background while steps run plain" if self.budgeted else "at its first use",
        )
        return True

    def _warn_if_donation_dropped(self, args: tuple, kwargs: dict) -> None:
        """Say so when the step is a ``jax.jit`` function that donates arguments and
        ``donate_argnums`` was not given: under the tracked step's own jit the inner
        donation does nothing, so the state would be held twice unnoticed."""
        fn = getattr(self, "__wrapped__", None)
        if self.static or self.static_names:  # the user's function, under `with_statics`
            fn = getattr(fn, "__wrapped__", None)
        if self.donate or not isinstance(fn, jax.stages.Wrapped):
            return
        args = tuple(a.value if type(a) is Static else a for a in args)
        kwargs = {k: v.value if type(v) is Static else v for k, v in kwargs.items()}
        try:
            info = fn.trace(*args, **kwargs).args_info[0]
        except Exception:  # noqa: BLE001 - a hint only; the step itself traced already
            return
        donated = tuple(
            i
            for i, arg in enumerate(info)
            if any(getattr(a, "donated", False) for a in jax.tree_util.tree_leaves(arg))
        )
        if donated:
            warnings.warn(
                f"Run.track: {self._program_name()} donates its arguments {donated} under "
                "its own jax.jit, which does nothing inside the tracked step's program: "
                "the state it is given would be held beside the state it returns. Pass "
                f"run.track(..., donate_argnums={donated}) to donate them (a bad step "
                "then has no inputs left to replay from).",
                stacklevel=_outside_package(),
            )

    def _graph_of_another(self, table: Any) -> bool:
        """Whether a function tracked into the run before this one holds a graph other
        than ``table`` (said once): a run holds one graph, and a second function (an
        eval step beside the train step) is no reason to stop the training, so its
        calls run unrecorded. A run appended to from an earlier process still refuses
        another graph (`Run._register`)."""
        first = next((t for t in self.run._tracked if t is not self and t._registered), None)
        if first is None:
            return False
        difference = self.run._graph_difference(table)
        if difference is None:
            return False
        self._foreign = True
        name = getattr(self, "__name__", "the step")
        warnings.warn(
            f"Run.track: {name} traces a graph other than the one {self.run.path} records "
            f"({getattr(first, '__name__', 'the first tracked step')}'s, tracked and called "
            f"first: {difference}); a run holds one graph, so calls of {name} run "
            "unrecorded (the flight recorder still checks them, without a replay). Track "
            f"it into a Run of its own (ss.Run(other_path).track({name})) to record it.",
            stacklevel=_outside_package(),
        )
        return True

    def _compile_async(self, traced: Any, warm: list | None = None) -> None:
        """Compile the statistics program in a thread: under a budget, steps run plain
        until it is ready instead of the first recorded step waiting for it (the compile
        fills jit's own cache, so the first recorded call runs at once). ``warm``: the
        first call's arrays, to run the program on once there. XLA on CPU finishes
        preparing a program at its first run (any program: +2.3 plain steps of the
        sample GPT, 2-core VM), which would otherwise fall on the first recorded step;
        the arrays are let go after that run (its temporaries are held beside those of
        the plain steps that run meanwhile, in host memory). Not on other backends,
        where holding the first call's state for the length of a compile would cost
        device memory, nor across processes, whose collectives must run in the same
        order in each."""

        def compile_() -> None:
            nonlocal warm
            t0 = time.perf_counter()
            try:
                compiled = traced.lower().compile()
            except Exception as err:  # noqa: BLE001 - the first recorded step compiles again
                log.warning(
                    "scalescope: compiling the statistics program in the background failed "
                    "(%s: %s); it compiles at the first recorded step",
                    type(err).__name__,
                    err,
                )
            else:
                if warm is not None:
                    try:
                        jax.block_until_ready(compiled(warm))
                    except Exception as err:  # noqa: BLE001 - a first run, nothing else
                        log.warning(
                            "scalescope: the statistics program's first run in the "
                            "background failed (%s: %s); the first recorded step runs it "
                            "first instead",
                            type(err).__name__,
                            err,
                        )
                log.info(
                    "scalescope: statistics program compiled in %.1f s; recording starts",
                    time.perf_counter() - t0,
                )
            finally:
                warm = None
                self._compiled.set()

        thread = threading.Thread(target=compile_, name="scalescope-compile", daemon=True)
        self._compile_thread = thread
        self.run._compiling.append(thread)
        thread.start()

    def _bound(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A call's arguments as the programs take them: bound by position where they
        can be (`_canonical`), those named static wrapped (`jitting.as_statics`)."""
        if kwargs and self._signature is not None:
            args, kwargs = _canonical(self._signature, args, kwargs)
        if self.static or self.static_names:
            args, kwargs = as_statics(args, kwargs, self.static, self.static_names, _WHERE)
        return args, kwargs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.run._check_open()
        args, kwargs = self._bound(args, kwargs)
        objects = stateful.split(args, kwargs)
        if objects is None:
            return self._call(args, kwargs)
        # Flax NNX objects: the step runs on their state and its new state is written
        # back into them, as `nnx.jit` does (`stateful`); nothing is written when it
        # raises (on_nonfinite="stop"), the last healthy state under "skip".
        out, state = self._call(objects.args, objects.kwargs)
        objects.update(state)
        return out

    @property
    def step(self) -> int:
        """The number the next call gets (see `__init__`)."""
        return self._own_step if self._foreign else self.run._next_step

    @step.setter
    def step(self, value: int) -> None:
        if self._foreign:
            self._own_step = value
        else:
            self.run._next_step = value

    def _call(self, args: tuple, kwargs: dict) -> Any:
        parts = partition(args, kwargs, where=_WHERE)  # once per call: the hot path
        if any(type(leaf) is int or getattr(leaf, "weak_type", False) for leaf in parts[1]):
            args, kwargs = _strongly_typed(args, kwargs)
            parts = partition(args, kwargs, where=_WHERE)
        if any(isinstance(leaf, jax.core.Tracer) for leaf in parts[1]):
            raise TypeError(
                "a tracked step was called inside a JAX transformation (jax.jit, vmap, "
                "grad, eval_shape, ...): it records and checks each step it runs, so call "
                "it from Python; to transform the step, transform the function given to "
                "run.track (or use ss.instrument, which returns the statistics)"
            )
        recorded, args, kwargs, parts = self._matched(args, kwargs, parts)
        step, self.step = self.step, self.step + 1
        if not recorded:  # another graph: not recorded, but checked (not replayed)
            self.run._note_unrecorded(step, self._program_name())
            out, health = self._plain_parts(parts, args)
            if health is None:
                return out
            return self._judged(flight.Call(step, args, kwargs, out, health, None, None))
        if self.budgeted:
            out, health, stats = self._budgeted_call(step, args, kwargs, parts)
        elif not self.records(step):
            (out, health), stats = self._plain_parts(parts, args), None
        else:
            out, stats, health = self._record(None, args, kwargs)
            self.run._submit(step, stats)
            self._held_updates(step, args, out)
            self._keep_stats(stats)
        if health is None:
            return out
        self.run._submit_figures(step, self._health_names(args, out), health)
        kept = (self._last_stats, self._prev_stats)
        return self._judged(flight.Call(step, args, kwargs, out, health, stats, kept))

    def _judged(self, call: flight.Call) -> Any:
        """Hand a call to the flight recorder; returns the outputs the call gives back.
        ``call.kept`` None: a call of another graph than the run's (not replayed)."""
        step, out = call.step, call.out
        if self.run.on_nonfinite != "record":
            return self._judge(call)  # stop or skip act on this step: read it now
        # Judged once the step has run, by a thread (`flight.Watcher`): reading a step's
        # health waits for it, and waiting on the step just dispatched would leave the
        # device idle while the host prepares the next one. This call then takes in the
        # judgement of the previous call (at the same point in every process: a replay
        # runs in all of them). A healthy step's inputs are let go as soon as it has run.
        before, self._watched = self._watched, step
        if self._watcher is None:
            self._watcher = flight.Watcher(self.detector)
        self._watcher.put(call)
        self._take_judgements(before)
        return out

    def settle(self) -> None:
        """Take in the judgement of every step called so far (`Run.healthy`,
        `Run.incidents`, flush and close call it); it is otherwise taken in at the next
        call."""
        self._take_judgements(self._watched)

    def stop_watching(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None

    def _take_judgements(self, upto: int) -> None:
        """Act on the steps up to ``upto`` that tripped a trigger (waits until they ran)."""
        if self._watcher is not None and upto >= 0:
            for call, found in self._watcher.judged(upto):
                self._act(call, found)

    def _plain_parts(self, parts: tuple, args: tuple) -> tuple[Any, Any]:
        """``(outputs, health)`` of the plain program (health None when not detecting);
        ``parts``: ``args`` (and the call's keywords) split by `partition`."""
        return self._checked(args, self._plain.call_parts(parts))

    def _plain_call(self, args: tuple, kwargs: dict) -> tuple[Any, Any]:
        return self._checked(args, self._plain(*args, **kwargs))

    def _checked(self, args: tuple, res: Any) -> tuple[Any, Any]:
        """``(outputs, health)`` from what the plain program returned for ``args``: its
        own health (the check inside it), or that of `_HEALTH` dispatched after it, or
        None when not detecting."""
        if self.in_step:
            return res
        return res, (_HEALTH(args, res) if self.detect else None)

    # -- the flight recorder ---------------------------------------------------------------

    def _judge(self, call: flight.Call) -> Any:
        """Read the step's health now and act on it (on_nonfinite stop or skip)."""
        return self._act(call, self.detector.check(flight.read_health(call.health)))

    def _act(self, call: flight.Call, found: tuple | None) -> Any:
        """Act on a step's judgement (see `flight` and `Run`); returns the outputs the
        call gives back."""
        step, args, kwargs, out, _, stats, kept = call
        if found is None:
            if self.run.on_nonfinite == "skip":
                self._last_good = out
            return out
        trigger, value, why, first = found
        incident = None
        if first:
            incident = self._incident(step, args, kwargs, out, stats, kept, trigger, value, why)
        if trigger != "nonfinite":
            return out
        if self.run.on_nonfinite == "stop":
            incident = incident or {"step": step, "name": "", "source": "", "detail": why}
            where = f"{incident['name']} ({incident['source']})" if incident["name"] else "?"
            raise flight.NonFiniteStep(
                f"step {step} produced NaN/Inf ({why}); first non-finite op: {where}. "
                f"{incident['detail']}",
                incident,
            )
        if self.run.on_nonfinite == "skip":
            if self._last_good is not None:
                return self._last_good
            warnings.warn(
                f"Run(on_nonfinite='skip'): step {step} is non-finite and no earlier step "
                "was healthy; its own outputs are returned",
                stacklevel=3,
            )
        return out

    def _incident(
        self,
        step: int,
        args: tuple,
        kwargs: dict,
        out: Any,
        stats: Any,
        kept: tuple[Any, Any],
        trigger: str,
        value: float,
        why: str,
    ) -> dict[str, Any]:
        """Replay the step with every op measured (unless it was, just now), keep its
        statistics as a recorded step, and hand the run the incident."""
        if kept is None:  # a call of another graph: the run's program cannot replay it
            what = f"this call of {self._program_name()} traced another graph than the run's"
            return self._unreplayed(step, trigger, value, f"{why}; not replayed: {what}")
        last, prev = kept
        full = stats is not None and stats is last
        replay_equal = True
        gone = bool(self.donate) and _given_away((args, kwargs))  # donated to the step
        if not full and gone:
            return self._unreplayed(step, trigger, value, f"{why}; not replayed: {_DONATED_NOTE}")
        if not full:
            again, stats, _ = self._record(self._every_group(), args, kwargs)
            replay_equal = flight.trees_equal(out, again)
            if not self._submitted(step):
                self.run._submit(step, stats)
        table = self.instrumented.op_table(*args, **kwargs)
        before = prev if full else last
        previous = None if before is None else jax.tree_util.tree_map(to_host, before)
        found = flight.describe_incident(
            table,
            jax.tree_util.tree_map(to_host, stats),
            trigger,
            previous,
            self.run.formats + self.run.recipes,
            exact=self.run.sample is None,  # sampled statistics can miss an input's NaN
        )
        if trigger == "nonfinite" and found["op"] >= 0 and not gone:
            located = self._located(table, found["op"], args, kwargs)
            if located is not None:
                found["devices"], text = located
                found["detail"] = f"{found['detail']}; {text}"
        incident = {
            "step": step,
            "trigger": trigger,
            "value": value,
            **found,
            "detail": f"{why}; {found['detail']}",
            "replayed": not full,
            "replay_equal": replay_equal,
        }
        self.run._incident(incident)
        return incident

    def _unreplayed(self, step: int, trigger: str, value: float, detail: str) -> dict[str, Any]:
        """Hand the run an incident that names no op (the step could not be replayed)."""
        incident = {
            "step": step,
            "trigger": trigger,
            "value": value,
            "op": -1,
            "name": "",
            "primitive": "",
            "source": "",
            "detail": detail,
            "replayed": False,
            "replay_equal": None,
        }
        self.run._incident(incident)
        return incident

    def _located(
        self, table: Any, op: int, args: tuple, kwargs: dict
    ) -> tuple[list[dict[str, int]], str] | None:
        """On a step spread over several devices: which of them hold the NaN/Inf of the
        incident's op (`flight.nonfinite_devices`) and that in words, found by running
        the step once more with that op's non-finite elements as its output (a program
        of its own, compiled for the incident). None on one device; an op inside a
        while or cond body is not located (the words say so)."""
        rec = next(r for r in table.ops if r.id == op)
        used = {d for x in jax.tree_util.tree_leaves((args, kwargs)) if isinstance(x, jax.Array)
                for d in x.sharding.device_set}  # fmt: skip
        if len(used) <= 1 and not rec.varying:
            return None
        if rec.in_while or rec.in_cond:
            return [], "its device is not located (the op is inside a while or cond body)"
        seq = table.sequence.index(op)
        where = StaticLeafJit(
            functools.partial(self.instrumented.nonfinite_where, seq),
            _WHERE,
            self._program_name(),
        )
        try:
            found = flight.nonfinite_devices(where(*args, **kwargs), self.instrumented.plucked_in)
        except Exception as err:  # an incident is kept even if this extra look fails
            log.warning("incident at op %s: its device was not located: %s", rec.label, err)
            return [], f"its device is not located ({type(err).__name__}: {err})"
        mesh = getattr(self.instrumented.plucked_in, "mesh", None)
        total = mesh.size if mesh is not None else len(used)
        return found, flight.devices_text(found, total)

    def _held_measure(
        self, table: Any, args: tuple, kwargs: dict, mesh: Any
    ) -> updates.Measure | None:
        """What `updates` measures of this step: the weights the policy holds (the
        leaves the loss depends on), None when there are none."""
        if not updates.held_leaves(table, self.policy, args):
            return None  # the common case: no trace
        flat = flatten_args(*as_jit_passes((args, kwargs)))
        closed, _ = self.instrumented.trace_flat(flat[0], flat[1], flat[3], flat[4])
        model = updates.loss_inputs(closed.jaxpr)
        if model is None:
            warnings.warn(
                "Run.track: the policy holds part of the step's arguments in a narrow "
                "format, but the step returns no scalar loss that depends on them, so its "
                "weights cannot be told from other state (an optimizer's moments): what "
                "the held formats keep of each update is not measured (the stall rule)",
                stacklevel=4,
            )
            return None
        held = updates.held_leaves(table, self.policy, args, model)
        return updates.Measure(held, mesh) if held else None

    def _held_updates(self, step: int, args: tuple, out: Any) -> Any:
        """Hand the writer what the held formats kept of this step's update (`updates`);
        returns the figures (None when nothing is measured)."""
        measured = self._measure(args, out) if self._measure is not None else None
        if measured is None:
            return None
        self.run._submit_figures(step, *measured)
        return measured[1]

    def _health_names(self, args: tuple, out: Any) -> list[str | None]:
        """The scalar names a step's health is written under (`layout.HEALTH_PREFIX`),
        None for the loss of a step that returns none (its NaN is no loss value);
        decided once, from the layout of the first call's arguments and outputs."""
        if self._health_names_cache is None:
            shape = lambda x: (  # noqa: E731 - a value's layout, nothing computed
                jax.ShapeDtypeStruct(x.shape, jnp.float32)
                if isinstance(x, ScaledArray)
                else jax.ShapeDtypeStruct(np.shape(x), x.dtype)
                if hasattr(x, "dtype")
                else x
            )
            layout = jax.tree_util.tree_map(shape, (args, out), is_leaf=is_scaled_array)
            has_loss = flight.loss_of(layout[0], layout[1]) is not None
            self._health_names_cache = [
                None if key == "loss" and not has_loss else L.HEALTH_PREFIX + key
                for key in flight.HEALTH_KEYS
            ]
        return self._health_names_cache

    def _keep_stats(self, stats: Any) -> None:
        """Remember a fully measured step's statistics (device arrays, a few per op):
        what a spike's op is found against."""
        self._prev_stats, self._last_stats = self._last_stats, stats

    def _submitted(self, step: int) -> bool:
        """Whether this step's statistics went to the writer already (a budgeted step
        that measured some groups: its rows are on their way; the replay adds none)."""
        return self._submitted_step == step

    def _matched(self, args: tuple, kwargs: dict, parts: tuple) -> tuple[bool, tuple, dict, tuple]:
        """``(recorded, args, kwargs, parts)`` of a call: `_records_signature`'s answer,
        with the arguments adapted where a plain float leaf stands where the registered
        call had a `ScaledArray` (scalify returns a value computed from constants plain:
        ``optax.adafactor``'s placeholder zeros; fed back, the second call would trace
        another graph and the run would record its first step only)."""
        recorded = self._records_signature(args, kwargs, parts)
        if recorded is _ADAPT:
            args, kwargs = _scaled_like(args, kwargs, self._kinds)
            return True, args, kwargs, partition(args, kwargs, where=_WHERE)
        return recorded, args, kwargs, parts

    def _records_signature(self, args: tuple, kwargs: dict, parts: tuple) -> Any:
        """Whether calls like this one are recorded: the first call registers the run's
        graph; a later call whose arguments trace differently (other shapes, dtypes or
        static values) is recorded if its graph is the same, and otherwise runs
        unrecorded, with a warning once: a run holds one graph. ``parts``: the call's
        arguments split by `partition`."""
        key = signature(*parts)
        known = self._signatures.get(key)
        if known is not None:
            return known
        if self._foreign:
            known = False
        elif not self._registered:
            known = self._register(args, kwargs)
        elif (adapted := _scaled_like(args, kwargs, self._kinds)) is not None and (
            self._records_signature(*adapted, partition(*adapted, where=_WHERE)) is True
        ):
            known = _ADAPT
        else:
            difference = self.run._graph_difference(self.instrumented.op_table(*args, **kwargs))
            known = difference is None
            if not known:
                warnings.warn(
                    f"Run.track: call {self.step} of {getattr(self, '__name__', 'the step')} "
                    f"traces a graph other than the one {self.run.path} records "
                    f"({difference}); such calls run unrecorded. A run holds one graph: "
                    "track the other variant into a Run of its own.",
                    stacklevel=_outside_package(),
                )
        self._signatures[key] = known
        return known

    def _every_group(self) -> np.ndarray | None:
        """The mask that measures every group (None outside a budget: no mask)."""
        return np.ones(self.instrumented.groups, bool) if self.budgeted else None

    def _record(self, mask: Any, args: tuple, kwargs: dict) -> tuple[Any, Any, Any]:
        """``(outputs, statistics, health)`` of a recorded step (``mask``: the groups to
        measure, under a budget; health None when not detecting)."""
        lead = () if mask is None else (mask,)
        if self.separate:
            if self.donate:  # the statistics read the arguments the step overwrites
                stats = self._recording(*lead, *args, **kwargs)
                out, health = self._plain_call(args, kwargs)
                return out, stats, health
            out, health = self._plain_call(args, kwargs)
            return out, self._recording(*lead, *args, **kwargs), health
        res = self._recording(*lead, *args, **kwargs)
        return res if self.detect else (*res, None)

    def warmup(self, *args: Any, **kwargs: Any) -> None:
        """Compile both variants now (each runs once on these arguments; nothing is
        recorded and the step counter does not move), so no training step pays for it."""
        self.run._check_open()
        args, kwargs = self._bound(args, kwargs)
        if (objects := stateful.split(args, kwargs)) is not None:
            args, kwargs = objects.args, objects.kwargs  # nothing is written back
        args, kwargs = _strongly_typed(args, kwargs)
        parts = partition(args, kwargs, where=_WHERE)
        recorded, args, kwargs, _ = self._matched(args, kwargs, parts)
        jax.block_until_ready(self._plain_call(self._spare(args), kwargs))
        self._warm.add("plain")
        if self._compile_thread is not None:
            self._compile_thread.join()
        if recorded:
            res = self._record(self._every_group(), self._spare(args), kwargs)
            out = jax.block_until_ready(res)[0]
            if self._measure is not None:  # compiled now too (nothing is written)
                jax.block_until_ready(self._measure(args, out))
            self._warm.add("recording")

    def _spare(self, args: tuple) -> tuple:
        """``args`` with copies of those the step may overwrite (`warmup` leaves the
        caller's arrays as they are)."""
        copy = lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x  # noqa: E731
        return tuple(
            jax.tree_util.tree_map(copy, a) if i in self.donate else a for i, a in enumerate(args)
        )

    def _timed(self, variant: str, fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
        """Run ``fn`` alone on the device and time it; None on its first (compiling) call."""
        jax.block_until_ready(args)
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        elapsed = time.perf_counter() - t0
        first = variant not in self._warm
        self._warm.add(variant)
        return out, (None if first else elapsed)

    def _warn_if_starved(self) -> None:
        """Warn once when the flight recorder's check alone takes the whole budget."""
        ctrl = self.controller
        if ctrl is None or not ctrl.starved or self._starved_warned:
            return
        self._starved_warned = True
        warnings.warn(
            f"Run(budget={ctrl.budget:g}): checking each step for NaN/Inf and spikes "
            f"takes {ctrl.t_check / float(ctrl.t_plain):.1%} of a step, the whole budget: "
            "while it does, no step records statistics (steps are timed as they run, so "
            "recording resumes if the check gets cheaper; a larger budget leaves room, "
            "detect=False turns the check off)",
            stacklevel=4,
        )

    def _budgeted_call(
        self, step: int, args: tuple, kwargs: dict, parts: tuple
    ) -> tuple[Any, Any, Any]:
        """``(outputs, health, statistics or None)`` of a call under a budget."""
        ctrl = self.controller
        if not self._compiled.is_set():  # the statistics program is still compiling
            # Untimed: the compile shares the machine, so a plain step timed now reads
            # slow (2-2.5x on a 2-core VM) and would skew every plan made with it.
            res = self._plain_parts(parts, args)
            self._warm.add("plain")  # compiled by this call if it was the first
            return (*res, None)
        mask = ctrl.plan(step)
        if mask is None:
            if ctrl.ready and ctrl.steps % 32:
                return (*self._plain_parts(parts, args), None)
            # Time a plain step now and then: the budget is a fraction of it. A check
            # of its own (CPU) is timed apart: the budget pays for it first.
            res, seconds = self._timed("plain", lambda *a: self._plain.call_parts(parts), *args)
            if seconds is not None:
                ctrl.observe_plain(seconds)
            if not self.detect or self.in_step:
                return (*self._checked(args, res), None)
            health, check = self._timed("check", lambda *a: _HEALTH(a, res), *args)
            if check is not None:
                ctrl.observe_check(check)
                self._warn_if_starved()
            return res, health, None

        def recorded(*a: Any) -> tuple[Any, Any, Any]:
            res = self._record(mask, a, kwargs)
            jax.block_until_ready(self._held_updates(step, a, res[0]))  # timed with it
            return res

        (out, stats, health), seconds = self._timed("recording", recorded, *args)
        if seconds is not None:
            ctrl.observe_record(seconds - ctrl.t_step, mask)
        self.run._submit(step, stats, mask)
        self._submitted_step = step
        if bool(np.all(mask)):
            self._keep_stats(stats)
        return out, health, stats


def _parameters(fn: Callable[..., Any]) -> list[inspect.Parameter] | None:
    """``fn``'s parameters, None when its signature is unknown."""
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None


def argument_positions(
    fn: Callable[..., Any], value: Any, option: str = "donate_argnums"
) -> tuple[int, ...]:
    """``Run.track``'s ``donate_argnums`` (or ``static_argnums``, named by ``option``)
    as sorted positions, checked: ints, each a parameter ``fn`` takes by position (when
    its signature says); a negative one counts from the last of those, as in
    ``jax.jit``."""
    items = (value,) if isinstance(value, (int, np.integer)) else value
    try:
        items = tuple(items)
    except TypeError:
        raise TypeError(
            f"Run.track: {option} must be an int or a sequence of ints, got {type(value).__name__}"
        ) from None
    for i in items:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"Run.track: {option} must hold ints (argument positions), got {i!r}")
    params = _parameters(fn)
    if params is None or any(p.kind is p.VAR_POSITIONAL for p in params):
        if any(i < 0 for i in items):
            raise ValueError(
                f"Run.track: {option}={tuple(items)}: a negative position needs to know how "
                f"many arguments {program_name(fn, 'the step')} takes by position, and its "
                "signature does not say"
            )
        return tuple(sorted({int(i) for i in items}))
    taken = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
    beyond = [i for i in items if not -taken <= i < taken]
    if beyond:
        raise ValueError(
            f"Run.track: {option}={tuple(items)}: {program_name(fn, 'the step')} takes "
            f"{taken} argument(s) by position, so there is no argument {beyond[0]}"
        )
    return tuple(sorted({int(i) % taken for i in items}))


def static_names(fn: Callable[..., Any], names: Any) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``Run.track``'s ``static_argnames``: ``(positions, keyword-only names)``, the
    names of parameters that can be passed by position given as those positions
    (arguments are bound by position where they can be, `_canonical`)."""
    names = (names,) if isinstance(names, str) else tuple(names)
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"Run.track: static_argnames must hold parameter names, got {names!r}")
    params = _parameters(fn)
    if params is None:
        return (), names
    by_name = {p.name: (i, p) for i, p in enumerate(params)}
    positions, keywords = [], []
    for name in names:
        if name not in by_name:
            if any(p.kind is p.VAR_KEYWORD for p in params):
                keywords.append(name)
                continue
            raise ValueError(
                f"Run.track: static_argnames names {name!r}, which "
                f"{program_name(fn, 'the step')} has no parameter of"
            )
        i, p = by_name[name]
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            positions.append(i)
        else:
            keywords.append(name)
    return tuple(sorted(set(positions))), tuple(keywords)


def _canonical(sig: inspect.Signature, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``(args, kwargs)`` as ``sig`` binds them: a parameter that can be passed by
    position is, whichever way the call gave it (``step(w, x=x)`` is ``step(w, x)``);
    keyword-only ones follow in the signature's order. A call ``sig`` does not bind is
    left as it is, for the function to raise its own error."""
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError:
        return args, kwargs
    return bound.args, bound.kwargs


def _strongly_typed(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with each weakly typed JAX array (``jnp.full(n, -1.0)``: a
    parameter made from a Python number) as a strongly typed one of its dtype, and each
    Python ``int`` as an int32 (or int64) array. A training step returns its state
    strongly typed (optax's updates are), so the second call would trace another graph
    than the first (JAX inserts a cast where a weak value meets a strong one) and, a run
    holding one graph, run unrecorded; every later call traces the first call's graph
    instead. Flax's ``TrainState.create`` starts ``step`` at the Python int 0: the step
    returns it as an array, and every call after the first ran unrecorded. (Python
    floats stay weak, as under ``jax.jit``: made float32 they would promote a bfloat16
    value they multiply.)"""

    def strong(leaf: Any) -> Any:
        if type(leaf) is int:  # (jnp.asarray(0) alone is weakly typed)
            return jnp.asarray(leaf, jax.dtypes.canonicalize_dtype(jnp.int_))
        if isinstance(leaf, jax.Array) and getattr(leaf, "weak_type", False):
            return jnp.asarray(leaf, leaf.dtype)
        return leaf

    return jax.tree_util.tree_map(strong, (args, kwargs))


def _with_health(plain: Callable[..., Any]) -> Callable[..., Any]:
    """``plain`` returning ``(outputs, flight.packed_health(args, outputs))``: the flight
    recorder's check, computed inside the step's own program."""

    def checked(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        out = plain(*args, **kwargs)
        return out, flight.packed_health(args, out)

    return checked


#: The flight recorder's check as a program of its own, run right after the step on its
#: arguments (it reads the first; jit drops the others, whose layout tells the loss
#: apart, `flight.loss_of`) and outputs where it is not inside the step (`flight.check_in_step`:
#: on CPU). Shared by every tracked step (jit traces it once per layout of the arguments).
_HEALTH = StaticLeafJit(flight.packed_health, _WHERE, "health")


#: `Tracked._records_signature`: recorded once adapted by `_scaled_like`.
_ADAPT = object()

#: Why a step tracked with ``donate_argnums`` is not replayed (`Tracked._incident`).
_DONATED_NOTE = (
    "the step's inputs were donated (run.track(..., donate_argnums=...)), so there is "
    "nothing to run it again from; its op is named when a recorded step shows it, or "
    "track without donate_argnums to replay the first bad step"
)


def _given_away(tree: Any) -> bool:
    """Whether some array of ``tree`` was deleted (donated to a program)."""
    return any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree_util.tree_leaves(tree))


def _leaf_kinds(args: tuple, kwargs: dict) -> tuple[Any, list[bool]]:
    """The structure of a call's arguments with `ScaledArray` leaves, and which leaves
    are scaled."""
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_scaled_array)
    return treedef, [is_scaled_array(leaf) for leaf in leaves]


def _scaled_like(args: tuple, kwargs: dict, kinds: Any) -> tuple[tuple, dict] | None:
    """``(args, kwargs)`` with each plain floating array that stands where ``kinds`` (the
    registered call's `_leaf_kinds`) has a `ScaledArray` made one at scale 1 (the same
    value); None when there is none or the structures differ otherwise."""
    if kinds is None:
        return None
    ref_tree, ref_scaled = kinds
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_scaled_array)
    if treedef != ref_tree:
        return None
    out, changed = [], False
    for leaf, scaled in zip(leaves, ref_scaled, strict=True):
        if scaled and not is_scaled_array(leaf) and _is_float_array(leaf):
            leaf, changed = ScaledArray.trusted(leaf, jnp.ones((), jnp.float32)), True
        out.append(leaf)
    if not changed:
        return None
    return jax.tree_util.tree_unflatten(treedef, out)


def _is_float_array(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    # jnp's, not NumPy's: bfloat16 and the FP8 dtypes are not NumPy floating types
    return hasattr(x, "shape") and dtype is not None and jnp.issubdtype(dtype, jnp.floating)
