"""What a held format keeps of each update: the weights a policy holds in a narrow format.

A policy that holds a step's weights in a format (``input/params/**: e4m3``, FP8 master
weights) rounds each as the step reads it. The step then adds its update in full
precision, and the next step reads the new value rounded again: an update smaller than
half the format's spacing at the weight rounds away, and the weight never moves.
Nothing in the value's own statistics shows it (the weights sit well inside the format,
at a good SNR); what fails is the update against the spacing. At each recorded step a
tracked step measures, per held weight:

- ``moved``: elements the step changed (``new != held(old)``, finite);
- ``lost``: of those, the elements whose held value did not change
  (``held(new) == held(old)``): the update rounded away;
- ``d2``: the update's energy, ``sum (new - held(old))**2``;
- ``e2``: what holding it costs, ``sum (held(new) - new)**2`` (``e2 / d2``: the share
  of the update's energy lost, 1 when every update rounds away).

A held weight is a leaf of an argument the step returns anew (`Measure`) that the step's
loss depends on (`held_leaves`, `loss_inputs`): an optimizer's moments are held state
too, but not measured. State held natively in a narrow dtype is not measured either (the
step rounds its update inside, where no caller sees the update it computed): hold an
FP32 state by a policy to see what that dtype would keep. One small program of its own,
compiled at the first recorded step, reads each held leaf's old and new values once; a
run without such a policy never builds it. The figures go to the run's scalars under
reserved names (`NAME_PREFIX`, hidden from `RunReader.scalars`);
`RunReader.held_updates` reads them back and the advisor's ``stall`` rule judges them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from ..core.policy import UNREACHABLE, Policy
from ..core.scaled_array import ScaledArray
from ..probe.instrument import as_jit_passes
from ..probe.optable import OpTable
from ..probe.quantise import Plan, quantise
from ..scalify.interpreter import is_array_like, normalize_input
from . import layout as L
from .flight import same_layout
from .processes import replicated

#: Scalar names of the figures: ``<prefix><op id>/<field>``. `Run.log` refuses the prefix.
NAME_PREFIX = L.FIGURE_PREFIX
FIELDS = L.FIGURE_FIELDS


@dataclass(frozen=True)
class Held:
    """One leaf of the state held in ``target`` (a format or recipe): the argument it is
    part of (``arg``), its position among that argument's leaves, its input op and the
    axes a recipe blocks along."""

    arg: int
    leaf: int
    op: int
    target: str
    axes: tuple[int, ...] | None


def _leaves(tree: Any) -> list[Any]:
    return jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, ScaledArray))


def _is_dynamic(leaf: Any) -> bool:
    """A leaf the step traces (an array or a number), as opposed to a static one."""
    return isinstance(leaf, ScaledArray) or is_array_like(leaf)


def held_leaves(
    table: OpTable, policy: Policy, args: Sequence[Any], model: set[int] | None = None
) -> tuple[Held, ...]:
    """The leaves of the positional ``args`` that ``policy`` holds in a format or recipe
    read by every op (not ``@matmul``, which leaves the held value as it is; not
    ``fp32``), matched to their input ops in ``table`` (one per array leaf of the call,
    in order: a static leaf, a string or a callable, has none); () when there are none or
    the table does not match the arguments. ``model``: the positions among the array
    leaves of those the step's loss depends on (`loss_inputs`), when known: only those
    are held weights whose updates train the model. An optimizer's moments are state
    too, but an EMA's step is a small part of its value by design (Adam's ``nu`` moves
    by ``1 - b2`` = 0.1 % of itself), so a 16-bit format rounds most of those steps away
    while the model trains as in fp32 (bf16 moments in benchmarks/bench_zoo_verdicts.py:
    +0.0 %). Which of them are state (an argument the step returns anew) is decided per
    call (`Measure`)."""
    per_arg = [_leaves(as_jit_passes(a)) for a in args]
    n = sum(1 for leaves in per_arg for x in leaves if _is_dynamic(x))
    if not n:
        return ()
    plan = Plan.build(table, policy)
    ops = table.ops
    inputs = list(table.sequence[:n])
    if len(inputs) < n or any(i < 0 or ops[i].pass_ != "input" for i in inputs):
        return ()  # the op table does not start with these arguments' inputs
    found, k = [], 0
    for a, leaves in enumerate(per_arg):
        for j, leaf in enumerate(leaves):
            if not _is_dynamic(leaf):
                continue
            entry, op, position = plan.targets[k], ops[inputs[k]], k
            k += 1
            if entry is None or op.note in UNREACHABLE or entry[1] != "all":
                continue
            if entry[0] == "fp32" or (model is not None and position not in model):
                continue
            if tuple(np.shape(leaf)) != tuple(op.shape):
                return ()  # the op table and the arguments disagree: nothing is claimed
            target, _, axis = entry
            if axis is not None:
                axes: tuple[int, ...] | None = (axis % max(len(op.shape), 1),)
            else:
                axes = tuple(op.block_axes) or None
            found.append(Held(a, j, op.id, target, axes))
    return tuple(found)


def loss_inputs(jaxpr: Any) -> set[int] | None:
    """The positions of ``jaxpr``'s inputs (a step's flat arguments) that its scalar
    float outputs (the loss and other metrics; an optimizer's constant placeholders
    depend on nothing) depend on; None when there is no such output or they depend on no
    input. Calls and checkpoints are followed into their bodies; a loop or branch counts
    as depending on all its operands."""
    outs = {
        i
        for i, v in enumerate(jaxpr.outvars)
        if _is_float(v.aval) and int(np.prod(v.aval.shape)) == 1
    }
    found = _depends(jaxpr, outs) if outs else set()
    return found or None


def _is_float(aval: Any) -> bool:
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and bool(jnp.issubdtype(dtype, jnp.floating))


def _depends(jaxpr: Any, wanted: set[int]) -> set[int]:
    """Positions of ``jaxpr.invars`` that its outputs at ``wanted`` depend on."""
    need = {v for i, v in enumerate(jaxpr.outvars) if i in wanted and not isinstance(v, Literal)}
    for eqn in reversed(jaxpr.eqns):
        outs = {i for i, v in enumerate(eqn.outvars) if v in need}
        if not outs:
            continue
        ins: Any = range(len(eqn.invars))
        body = _call_body(eqn)
        if body is not None:
            ins = _depends(body, outs)
        need |= {eqn.invars[i] for i in ins if not isinstance(eqn.invars[i], Literal)}
    return {i for i, v in enumerate(jaxpr.invars) if v in need}


def _call_body(eqn: Any) -> Any:
    """The body of a call-like equation (jit, closed_call, custom_jvp/vjp, checkpoint,
    shard_map: one jaxpr taking the operands and giving the outputs, each once), or
    None (a loop or a branch runs its body many times or not at all)."""
    if eqn.primitive.name in ("scan", "while", "cond"):
        return None
    bodies = [v for v in eqn.params.values() if isinstance(v, Jaxpr | ClosedJaxpr)]
    if len(bodies) != 1:
        return None
    body = bodies[0].jaxpr if isinstance(bodies[0], ClosedJaxpr) else bodies[0]
    if len(body.invars) != len(eqn.invars) or len(body.outvars) != len(eqn.outvars):
        return None
    return body


def _value(x: Any, target: str, axes: tuple[int, ...] | None) -> tuple[jax.Array, jax.Array]:
    """``(x, held(x))`` as float32 values (a `ScaledArray` is held on its data, as the
    policy rounds it)."""
    if isinstance(x, ScaledArray):
        x = normalize_input(x)  # as the scalified step reads it
    held = quantise(x, target, axes)
    if isinstance(x, ScaledArray):
        return x.to_array(jnp.float32), held.to_array(jnp.float32)
    return jnp.asarray(x, jnp.float32), jnp.asarray(held, jnp.float32)


def figures(held: Sequence[Held], old: Sequence[Any], new: Sequence[Any]) -> jax.Array:
    """``[len(held), 4]`` float32: `FIELDS` of each held leaf, from its values before
    (``old``) and after (``new``) the step, in ``held``'s order (traced: one program)."""
    rows = []
    for h, before, after in zip(held, old, new, strict=True):
        _, base = _value(before, h.target, h.axes)
        now, kept = _value(after, h.target, h.axes)
        d, e = now - base, kept - now
        finite = jnp.isfinite(d) & jnp.isfinite(e)
        moved = finite & (d != 0)
        lost = moved & (kept == base)
        rows.append(
            jnp.stack(
                [
                    jnp.sum(moved, dtype=jnp.float32),
                    jnp.sum(lost, dtype=jnp.float32),
                    jnp.sum(jnp.where(finite, d * d, 0.0)),
                    jnp.sum(jnp.where(finite, e * e, 0.0)),
                ]
            )
        )
    return jnp.stack(rows)


class Measure:
    """The held-update figures of a tracked step: call it with a recorded step's
    arguments and outputs. A held leaf counts when its argument is state: an output has
    the argument's structure, shapes and dtypes (`_state_outputs`: ``step(params,
    opt_state, batch) -> (params, opt_state, loss)``, ``step(config, params, batch) ->
    (params, loss)``). None when no held leaf is."""

    def __init__(self, held: Sequence[Held], mesh: Any = None) -> None:
        self.held, self.mesh = tuple(held), mesh
        self._fns: dict[tuple[int, ...], tuple[list[str], Any]] = {}

    def __call__(self, args: Sequence[Any], out: Any) -> tuple[list[str], jax.Array] | None:
        """``(names, figures)``: the scalar names and a ``[len(names)]`` array."""
        outs = tuple(out) if isinstance(out, tuple | list) else (out,)
        where = _state_outputs(args, outs)
        held = [h for h in self.held if h.arg in where]
        if not held:
            return None
        key = tuple(sorted(where.items()))
        if key not in self._fns:
            names = [f"{NAME_PREFIX}{h.op}/{f}" for h in held for f in FIELDS]
            mesh = self.mesh
            fn = jax.jit(lambda old, new: replicated(figures(held, old, new).reshape(-1), mesh))
            self._fns[key] = (names, fn)
        names, fn = self._fns[key]
        old = [_leaves(args[h.arg])[h.leaf] for h in held]
        new = [_leaves(outs[where[h.arg]])[h.leaf] for h in held]
        return names, fn(old, new)


def _state_outputs(args: Sequence[Any], outs: Sequence[Any]) -> dict[int, int]:
    """``{argument: output}`` of the arguments the step returns anew: in order, each
    argument takes the first output of its layout that no earlier argument took (a
    static argument before them, ``step(config, params, opt_state)``, takes none)."""
    found: dict[int, int] = {}
    for a, arg in enumerate(args):
        for i, out in enumerate(outs):
            if i not in found.values() and same_layout(arg, out):
                found[a] = i
                break
    return found
