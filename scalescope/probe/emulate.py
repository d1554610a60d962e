"""`emulate`: a step whose chosen values are held in a low-precision format or recipe.

A `Policy` names values by the probe's op labels (``fwd/…``, ``bwd/…``, ``opt/…``,
``input/…``). `emulate` interprets the whole step (forward, backward and optimizer, as
one jaxpr) like `instrument` does, and replaces each value a rule reaches by its
quantise-dequantise in the rule's target: downstream ops read the rounded value, as they
would in a training that casts it. Nothing else changes.

Labels are known only once the whole function has been interpreted (ops without a scope
are named after the parameter they update at the end), so each call signature is
interpreted twice: once abstractly by the probe, which gives the op table and the op of
each value in the order the interpretation makes them (`OpTable.sequence`), then for
real, counting values in the same order. Both interpret the same traced jaxpr, and each
value's primitive is checked against the table's.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from ..core.policy import Policy, PolicyError, as_policy
from ..core.scaled_array import ScaledArray
from ..scalify.interpreter import (
    FALLBACK_POLICIES,
    Context,
    Observer,
    array_scales,
    eval_jaxpr,
    flatten_args,
    normalize_inputs,
    unwrap_scalified,
)
from ..scalify.registry import get_rule
from . import blocking
from .instrument import as_jit_passes, instrument
from .optable import OpTable
from .quantise import Plan, Replacer


class _Emulator(Observer):
    """Counts values in the order the probe's recorder makes them (every output of a
    first-order equation) and replaces those the plan targets."""

    def __init__(self, replacer: Replacer) -> None:
        self.replacer = replacer

    def reads(self, eqn, invals):
        return self.replacer.reads(eqn, invals)

    def on_eqn(self, ctx, eqn, invals, outvals):
        rule = get_rule(eqn.primitive)
        if rule is not None and rule.higher_order:
            return None
        name = eqn.primitive.name
        return [
            self.replacer.next(out, var, name)
            for var, out in zip(eqn.outvars, outvals, strict=True)
        ]


def emulate(
    fn: Callable[..., Any],
    policy: Policy | dict[str, str] | str,
    *,
    scalify: bool = False,
    fallback: str = "raise",
    exact_outputs: Sequence[int] = (),
    strict: bool = False,
) -> Callable[..., Any]:
    """``fn`` with each value a rule of ``policy`` reaches replaced by its
    quantise-dequantise in the rule's format or recipe (`quantise`).

    Rules match the probe's op labels (``ss.instrument(fn).op_table(*args)``, or the
    dashboard's op names): a forward activation (``fwd/…``), a gradient (``bwd/…``), an
    optimizer moment (``opt/…``) or an argument (``input/…``). Recipes block a value along
    the axes a GEMM contracts it (the probe's layout), else its last axis. A rule that
    reaches no op is a `PolicyError` naming the nearest op labels.

    The result has ``fn``'s signature and outputs; wrap it in `jax.jit`. Python numbers
    among the arguments are traced as `jax.jit` traces them. ``scalify=True`` runs the
    step scalified (as ``ss.scalify(fn)``), quantising scaled values on their data.
    ``emulated.describe(*args)`` lists the ops each rule reaches (`Policy.describe`);
    ``emulated.op_table(*args)`` is the probe's op table.

    ``exact_outputs``: indices of ``fn``'s flattened outputs returned as computed, not
    rounded, while every op inside still reads the rounded value (the loss a step
    reports: rounding the returned number changes what is printed, not what trains).
    ``strict``: a value held ``@matmul`` that no matmul reads (its rule changes nothing)
    is a `PolicyError` instead of a warning.
    """
    if not callable(fn):
        raise TypeError(f"emulate: fn must be callable, got {type(fn).__name__}")
    if fallback not in FALLBACK_POLICIES:
        raise ValueError(f"emulate: fallback must be one of {FALLBACK_POLICIES}, got {fallback!r}")
    if scalify:  # emulate(scalify(step), scalify=True) emulates step
        fn, fallback = unwrap_scalified(fn, fallback)
    policy = as_policy(policy)
    probe = instrument(fn, scalify=scalify, formats=(), histograms=False, fallback=fallback)
    plans: dict[Any, tuple[Plan, dict[Any, tuple[int, ...]]]] = {}

    def plan_of(flat: tuple) -> tuple[Plan, Any, Any]:
        leaves, treedef, _, avals, key = flat
        closed, out_tree = probe.trace_flat(leaves, treedef, avals, key)
        if key not in plans:
            table = probe.table_of(flat)
            plans[key] = (Plan.build(table, policy), blocking.block_axes(closed.jaxpr))
        plan, axes = plans[key]
        return plan, axes, (closed, out_tree)

    @functools.wraps(fn)
    def emulated(*args: Any, **kwargs: Any) -> Any:
        flat = flatten_args(*as_jit_passes((args, kwargs)))
        plan, axes, (closed, out_tree) = plan_of(flat)
        dyn = normalize_inputs(flat[2]) if scalify else list(flat[2])
        if not scalify and any(isinstance(x, ScaledArray) for x in dyn):
            raise TypeError(
                "emulate(scalify=False) runs a plain function, but an argument is a "
                "ScaledArray; pass plain arrays or use scalify=True"
            )
        replacer = Replacer(plan, axes)
        dyn = [replacer.next(v, var, "input") for v, var in zip(dyn, closed.jaxpr.invars)]
        ctx = Context(fallback=fallback, recurse_plain=True, observer=_Emulator(replacer),
                      scaling=scalify)  # fmt: skip
        outs = list(eval_jaxpr(ctx, closed.jaxpr, closed.consts, dyn))
        _warn_unread(replacer, strict)
        for i in exact_outputs:
            outs[i] = replacer.original.get(id(outs[i]), outs[i])
        outs = array_scales(outs) if scalify else outs
        return out_tree.unflatten(outs)

    def describe(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        """Which ops each rule reaches on these arguments (`Policy.describe`)."""
        return policy.describe(op_table(*args, **kwargs))

    def op_table(*args: Any, **kwargs: Any) -> OpTable:
        return probe.table_of(flatten_args(*as_jit_passes((args, kwargs))))

    emulated.policy = policy
    emulated.probe = probe  # its plan's op tables; a Run's recording program plans on it too
    emulated.describe = describe
    emulated.op_table = op_table
    return emulated


def _warn_unread(replacer: Replacer, strict: bool = False) -> None:
    unread = replacer.unread()
    if unread:
        shown = ", ".join(unread[:5]) + (f" and {len(unread) - 5} more" if len(unread) > 5 else "")
        text = (
            f"emulate: {len(unread)} value(s) held '@matmul' are read by no matmul that "
            f"emulate can follow ({shown}), so their rule changes nothing: either no matmul "
            "multiplies them (hold them in place: drop '@matmul'), or a scan body or loop "
            "carry reads a new value each step (name the matmul's own operand inside the loop)."
        )
        if strict:
            raise PolicyError(text)
        warnings.warn(text, stacklevel=3)
