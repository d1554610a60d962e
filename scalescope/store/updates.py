"""What a held format keeps of each update: the state a policy holds in a narrow format.

A policy that holds a step's state in a format (``input/params/**: e4m3``, FP8 master
weights; ``input/**/nu/**: bf16``, 16-bit Adam moments) rounds each leaf as the step
reads it. The step then adds its update in full precision, and the next step reads the
new value rounded again: an update smaller than half the format's spacing at the weight
rounds away, and the weight never moves. Nothing in the value's own statistics shows
it (the weights sit well inside the format, at a good SNR); what fails is the update
against the spacing. At each recorded step a tracked step measures, per held leaf of its
state:

- ``moved``: elements the step changed (``new != held(old)``, finite);
- ``lost``: of those, the elements whose held value did not change
  (``held(new) == held(old)``): the update rounded away;
- ``d2``: the update's energy, ``sum (new - held(old))**2``;
- ``e2``: what holding it costs, ``sum (held(new) - new)**2``; ``e2 / d2`` is the share
  of the update lost (1 when every update rounds away).

The state is every argument the step returns anew at the same position (`Measure`);
state held natively in a narrow dtype is not measured (the step rounds its update
inside, where no caller sees the update it computed): hold an FP32 state by a policy to
see what that dtype would keep. One small program of its own, compiled at the first
recorded step, reads each held leaf's old and new values once; a run without such a
policy never builds it. The
figures go to the run's scalars under reserved names (`NAME_PREFIX`, hidden from
`RunReader.scalars`); `RunReader.held_updates` reads them back and the advisor's
``stall`` rule judges them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from ..core.policy import Policy
from ..core.scaled_array import ScaledArray
from ..probe.optable import OpTable
from ..probe.quantise import Plan, quantise
from ..scalify import traverse
from . import layout as L

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


def held_leaves(
    table: OpTable, policy: Policy, args: Sequence[Any], model: set[int] | None = None
) -> tuple[Held, ...]:
    """The leaves of the positional ``args`` that ``policy`` holds in a format or recipe
    read by every op (not ``@matmul``, which leaves the held value as it is; not
    ``fp32``), matched to their input ops in ``table`` (the first input ops, one per
    leaf, in order); () when there are none or the table does not match the arguments.
    ``model``: the flat positions of the leaves the step's loss depends on (`loss_inputs`),
    when known: only those are held weights whose updates train the model. An optimizer's
    moments are state too, but an EMA's step is a small part of its value by design
    (Adam's ``nu`` moves by ``1 - b2`` = 0.1 % of itself), so a 16-bit format rounds most
    of those steps away while the model trains as in fp32 (bf16 moments in
    benchmarks/bench_zoo_verdicts.py: +0.0 %). Which of them are state (an argument the
    step returns anew) is decided per call (`Measure`)."""
    per_arg = [_leaves(a) for a in args]
    n = sum(len(leaves) for leaves in per_arg)
    if not n:
        return ()
    plan = Plan.build(table, policy)
    ops = table.ops
    inputs = list(table.sequence[:n])
    if len(inputs) < n or any(i < 0 or ops[i].pass_ != "input" for i in inputs):
        return ()  # a leaf without an input op of its own (not an array): not matched
    found, k = [], 0
    for a, leaves in enumerate(per_arg):
        for j, leaf in enumerate(leaves):
            entry, op = plan.targets[k], ops[inputs[k]]
            k += 1
            if entry is None or op.note or entry[1] != "all" or entry[0] == "fp32":
                continue
            if model is not None and k - 1 not in model:
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
        ins = range(len(eqn.invars))
        if eqn.primitive.name in traverse.CALLS | traverse.CHECKPOINTS:
            body = traverse.bodies(eqn)[0][0].jaxpr
            if len(body.invars) == len(eqn.invars) and len(body.outvars) == len(eqn.outvars):
                ins = _depends(body, outs)
        need |= {eqn.invars[i] for i in ins if not isinstance(eqn.invars[i], Literal)}
    return {i for i, v in enumerate(jaxpr.invars) if v in need}


def _value(x: Any, target: str, axes: tuple[int, ...] | None) -> tuple[jax.Array, jax.Array]:
    """``(x, held(x))`` as float32 values (a `ScaledArray` is held on its data, as the
    policy rounds it)."""
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
    arguments and outputs. A held leaf counts when its argument is state: the output at
    the same position has the argument's structure, shapes and dtypes (``step(params,
    opt_state, batch) -> (params, opt_state, loss)``: the first two). None when no held
    leaf is."""

    def __init__(self, held: Sequence[Held]) -> None:
        self.held = tuple(held)
        self._fns: dict[tuple[int, ...], tuple[list[str], Any]] = {}

    def __call__(self, args: Sequence[Any], out: Any) -> tuple[list[str], jax.Array] | None:
        """``(names, figures)``: the scalar names and a ``[len(names)]`` array."""
        outs = tuple(out) if isinstance(out, tuple | list) else (out,)
        state = [a for a in sorted({h.arg for h in self.held})
                 if a < len(outs) and _same_layout(args[a], outs[a])]  # fmt: skip
        held = [h for h in self.held if h.arg in state]
        if not held:
            return None
        key = tuple(state)
        if key not in self._fns:
            names = [f"{NAME_PREFIX}{h.op}/{f}" for h in held for f in FIELDS]
            fn = jax.jit(lambda old, new: figures(held, old, new).reshape(-1))
            self._fns[key] = (names, fn)
        names, fn = self._fns[key]
        old = [_leaves(args[h.arg])[h.leaf] for h in held]
        new = [_leaves(outs[h.arg])[h.leaf] for h in held]
        return names, fn(old, new)


def _same_layout(a: Any, b: Any) -> bool:
    """Whether two pytrees have the same structure, shapes and dtypes (scaled leaves
    compared by their data)."""
    la, ta = jax.tree_util.tree_flatten(a, is_leaf=lambda x: isinstance(x, ScaledArray))
    lb, tb = jax.tree_util.tree_flatten(b, is_leaf=lambda x: isinstance(x, ScaledArray))
    if ta != tb:
        return False
    return all(
        np.shape(x) == np.shape(y) and _dtype(x) == _dtype(y) for x, y in zip(la, lb, strict=True)
    )


def _dtype(x: Any) -> Any:
    x = x.data if isinstance(x, ScaledArray) else x
    return getattr(x, "dtype", type(x))


def reserved(name: str) -> bool:
    """Whether a scalar name is one of the held-update figures'."""
    return name.startswith(NAME_PREFIX)
