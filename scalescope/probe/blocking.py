"""Which axis a block-scaled recipe blocks a value along.

A GEMM scales its operands along the axis it contracts, so a value whose only uses are
as a ``dot_general`` operand, contracted along the same axes by each, is blocked along
those axes (docs/probe.md, "Block-scaled recipes"); any other value along its last axis.
Uses are followed into the bodies of call-like primitives (``jit``, ``remat``, custom
derivatives), where the value keeps its identity.
"""

from __future__ import annotations

from typing import Any

from jax.extend import core as jcore

from ..core.formats import narrow_max
from ..scalify import traverse

#: Parameters holding the body of a call whose inputs are the equation's inputs, in order.
_CALL_BODIES = ("jaxpr", "call_jaxpr", "fun_jaxpr")
_CALLS = traverse.CALLS | traverse.CHECKPOINTS | {"remat"}


def _body(eqn: Any) -> Any | None:
    if eqn.primitive.name not in _CALLS:
        return None
    for key in _CALL_BODIES:
        body = eqn.params.get(key)
        if body is not None:
            return getattr(body, "jaxpr", body)
    return None


def _body_or_scan(eqn: Any) -> Any | None:
    """The body of a call, or of a scan (its inputs: consts, carry, xs; its outputs:
    carry, ys, in the equation's order), else None."""
    body = _body(eqn)
    if body is None and eqn.primitive.name == "scan":
        body = getattr(eqn.params["jaxpr"], "jaxpr", eqn.params["jaxpr"])
    return body


def _sub_jaxprs(eqn: Any):
    for value in eqn.params.values():
        items = value if isinstance(value, list | tuple) else (value,)
        for item in items:
            inner = getattr(item, "jaxpr", item)
            if isinstance(inner, jcore.Jaxpr):
                yield inner


def block_axes(jaxpr: Any) -> dict[Any, tuple[int, ...]]:
    """Map each variable of ``jaxpr`` (and of every nested jaxpr) used only as a
    ``dot_general`` operand to the axes those dots contract it along."""
    out: dict[Any, tuple[int, ...]] = {}
    _visit(getattr(jaxpr, "jaxpr", jaxpr), out, set())
    return out


def _visit(jaxpr: Any, out: dict[Any, tuple[int, ...]], seen: set[int]) -> None:
    if id(jaxpr) in seen:
        return
    seen.add(id(jaxpr))
    for eqn in jaxpr.eqns:  # inner bodies first: a call's use is its body's use
        for inner in _sub_jaxprs(eqn):
            _visit(inner, out, seen)
    uses: dict[Any, list[tuple[int, ...] | None]] = {}
    for eqn in jaxpr.eqns:
        body = _body(eqn)
        for k, var in enumerate(eqn.invars):
            if isinstance(var, jcore.Literal):
                continue
            uses.setdefault(var, []).append(_use(eqn, k, body, out))
    for var in jaxpr.outvars:
        if not isinstance(var, jcore.Literal):
            uses.setdefault(var, []).append(None)
    for var, axes in uses.items():
        if axes and all(a is not None and a == axes[0] for a in axes):
            out[var] = axes[0]


def _use(eqn: Any, k: int, body: Any, out: dict[Any, tuple[int, ...]]):
    """The contracting axes of operand ``k`` of ``eqn``, or None (not a GEMM use)."""
    if eqn.primitive.name == "dot_general" and k < 2:
        (contract_l, contract_r), _ = eqn.params["dimension_numbers"]
        axes = tuple(int(a) for a in (contract_l if k == 0 else contract_r))
        if len(set(eqn.invars[:2])) == 1:  # x @ x.T style: both sides must agree
            other = tuple(int(a) for a in (contract_r if k == 0 else contract_l))
            return axes if axes == other else None
        return axes or None
    if body is not None and k < len(body.invars):
        return out.get(body.invars[k])
    return None


def gemm_operands(jaxpr: Any) -> set[Any]:
    """Variables of ``jaxpr`` (and of every nested jaxpr) that some ``dot_general`` reads
    as an operand, directly or as the argument of a call or scan body that does: the
    values a training in low precision quantises for its GEMMs."""
    out: set[Any] = set()
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    _visit_gemm(jaxpr, out, set())
    _into_bodies(jaxpr, out, set())
    return out


def _into_bodies(jaxpr: Any, out: set[Any], seen: set[int]) -> None:
    """A call's output that a matmul reads is made inside its body: the body's output
    variable is a GEMM operand too (``jax.nn.relu``'s ``max`` in a custom_jvp, the
    ``select_n`` of ``jnp.where`` in a jit: values the probe records inside)."""
    if id(jaxpr) in seen:
        return
    seen.add(id(jaxpr))
    for eqn in jaxpr.eqns:
        body = _body_or_scan(eqn)
        if body is None:
            continue
        for var, inner in zip(eqn.outvars, body.outvars):
            if var in out and not isinstance(inner, jcore.Literal):
                out.add(inner)
        _into_bodies(body, out, seen)


def _visit_gemm(jaxpr: Any, out: set[Any], seen: set[int]) -> None:
    if id(jaxpr) in seen:
        return
    seen.add(id(jaxpr))
    for eqn in jaxpr.eqns:
        for inner in _sub_jaxprs(eqn):
            _visit_gemm(inner, out, seen)
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            out.update(v for v in eqn.invars[:2] if not isinstance(v, jcore.Literal))
            continue
        body = _body_or_scan(eqn)
        if body is None:
            continue
        for var, inner in zip(eqn.invars, body.invars):
            if inner in out and not isinstance(var, jcore.Literal):
                out.add(var)


def narrow_casts(jaxpr: Any) -> dict[Any, set[float]]:
    """Variables of ``jaxpr`` (and of every nested jaxpr) that a ``convert_element_type``
    casts to one of the narrow dtypes code scales into itself
    (`scalescope.core.formats.SELF_SCALED_DTYPES`), each mapped to those dtypes' largest
    values; a call's output is followed into its body (a body JAX traced once for calls
    cast to different formats holds each). The probe tells by it a clip at a
    format's max that feeds a cast to that format (code that scaled the value into the
    format: what it clips is what the cast loses)."""
    out: dict[Any, set[float]] = {}
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    _visit_casts(jaxpr, out, set())
    return out


def _visit_casts(jaxpr: Any, out: dict[Any, set[float]], seen: set[int]) -> None:
    if id(jaxpr) in seen:
        return
    seen.add(id(jaxpr))
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "convert_element_type":
            top = narrow_max(eqn.params.get("new_dtype"))
            var = eqn.invars[0]
            if top is not None and not isinstance(var, jcore.Literal):
                out.setdefault(var, set()).add(top)
    for eqn in jaxpr.eqns:  # then into bodies: a call's output cast is its body's
        body = _body_or_scan(eqn)
        if body is not None:
            for var, inner in zip(eqn.outvars, body.outvars):
                if var in out and not isinstance(inner, jcore.Literal):
                    out.setdefault(inner, set()).update(out[var])
        for inner in _sub_jaxprs(eqn):
            _visit_casts(inner, out, seen)
