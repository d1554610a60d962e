"""The rule table: one scaled rule per JAX primitive, keyed by primitive name.

A *plain* rule is called as ``rule(*invals, **params)`` with `ScaledArray` or plain array
inputs and returns the outputs (a list for multiple-result primitives). A *higher-order*
rule (jit, scan, cond, ...) is called as ``rule(ctx, eqn, invals)`` and interprets the
sub-jaxprs it carries through ``ctx``. A plain rule registered ``with_primitive=True`` is
called as ``rule(primitive, *invals, **params)``: a rule that binds the primitive it
stands for (a collective on the data) gets it from the equation, so primitives that JAX
does not export need no lookup.

Keys are primitive names (``eqn.primitive.name``) rather than primitive objects, so rules
can be registered for primitives that JAX does not export publicly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax


@dataclass(frozen=True)
class Rule:
    fn: Callable[..., Any]
    higher_order: bool = False
    on_plain: bool = False  # also run when no input is scaled (e.g. set_scaling)
    with_primitive: bool = False  # called with the equation's primitive first


RULES: dict[str, Rule] = {}


def _name(prim: Any) -> str:
    return prim if isinstance(prim, str) else prim.name


def register_rule(
    prim: Any,
    fn: Callable[..., Any],
    *,
    higher_order: bool = False,
    on_plain: bool = False,
    replace: bool = False,
    with_primitive: bool = False,
) -> None:
    """Register ``fn`` as the scaled rule of ``prim`` (a primitive or its name).

    ``on_plain=True`` makes the interpreter use the rule even when no input is scaled,
    for primitives whose purpose is to create scaled values. ``with_primitive=True`` calls
    it as ``fn(primitive, *invals, **params)``. A primitive that has a rule
    keeps it (KeyError) unless ``replace=True``: the table is global, so a rule replaced
    by mistake would change every later `scalify`.
    """
    name = _name(prim)
    if name in RULES and not replace:
        raise KeyError(
            f"register_rule: {name!r} already has a scaled rule "
            f"({getattr(RULES[name].fn, '__name__', RULES[name].fn)}); "
            "pass replace=True to replace it for every later scalify"
        )
    RULES[name] = Rule(fn, higher_order, on_plain, with_primitive)


def get_rule(prim: Any) -> Rule | None:
    return RULES.get(_name(prim))


def has_rule(prim: Any) -> bool:
    return _name(prim) in RULES


def registered_primitives() -> tuple[str, ...]:
    return tuple(sorted(RULES))


def primitives_in(jaxpr: Any) -> set[str]:
    """Names of every primitive in ``jaxpr`` (a Jaxpr or ClosedJaxpr), sub-jaxprs of
    jit/scan/cond/custom_* included: what `scalify` must have rules for."""
    from jax.extend.core import jaxprs_in_params

    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    names: set[str] = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for sub in jaxprs_in_params(eqn.params):
            names |= primitives_in(sub)
    return names


def primitive_in(fn: Callable[..., Any], *args: Any, name: str) -> Any:
    """The primitive called ``name`` that ``fn(*args)`` binds (sub-jaxprs included), or
    None: for primitives JAX does not export (``checkpoint_name``'s ``name``,
    ``random_gamma``), found through their public functions."""
    from jax.extend.core import jaxprs_in_params

    def find(jaxpr: Any) -> Any:
        for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
            if eqn.primitive.name == name:
                return eqn.primitive
            for sub in jaxprs_in_params(eqn.params):
                if (hit := find(sub)) is not None:
                    return hit
        return None

    try:
        return find(jax.make_jaxpr(fn)(*args))
    except Exception:  # noqa: BLE001 - a JAX without it: no rule, as for a missing name
        return None
