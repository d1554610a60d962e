"""One traversal of JAX's higher-order primitives, shared by scalify and unit_scale.

Each function here takes an equation of a higher-order primitive apart (its parameters
and the operands feeding each body), runs every body through a caller's callback, and
rebinds the result with public JAX: `jax.lax.scan`, `lax.while_loop`, `lax.switch`,
`jax.checkpoint`, `jax.named_scope`. The caller supplies only what is its own: what
running a body means (``body(closed_jaxpr, args, where) -> (outs, aux)``), and the values
a loop or branch body hands out beside its outputs (``aux``: a scan stacks them, a while
loop carries them, a cond returns the taken branch's). The call family, checkpoint,
scan, while and cond are known; any other primitive is refused by name.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import ClosedJaxpr

# Kinds of body (`Where.kind`).
CALL = "call"
CHECKPOINT = "checkpoint"
SCAN = "scan"
WHILE_COND = "while_cond"
WHILE_BODY = "while_body"
BRANCH = "branch"

#: Calls whose body takes the equation's operands in order (``eval_jaxpr`` is JAX 0.11's
#: name for ``closed_call``).
PLAIN_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "eval_jaxpr"})
#: Primitives whose body is inlined: the plain calls and the custom-derivative calls
#: (their primal).
CALLS = PLAIN_CALLS | {"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"}
CHECKPOINTS = frozenset({"checkpoint", "remat2"})
#: Every higher-order primitive this module takes apart.
PRIMITIVES = CALLS | CHECKPOINTS | {"scan", "while", "cond"}


@dataclass(frozen=True)
class Where:
    """Which body of a higher-order equation a callback runs.

    ``kind``: CALL, CHECKPOINT, SCAN, WHILE_COND, WHILE_BODY or BRANCH. ``index``: the
    branch number (BRANCH) or the iteration (a scan run by `scan_unrolled`). The body's
    inputs are ``consts`` loop-invariant values, then ``carry`` carried ones (also its
    first outputs, for a loop body), then the rest (a scan's slices of ``xs``). ``aux``:
    what rides in beside the inputs (a scan: this iteration's slice of ``aux_xs``; a while
    loop: the carried aux).
    """

    eqn: Any
    kind: str
    index: int | None = None
    consts: int = 0
    carry: int = 0
    aux: Any = ()


#: ``body(closed_jaxpr, args, where) -> (outs, aux)``: runs one body on ``args``.
Body = Callable[[ClosedJaxpr, list[Any], Where], tuple[Sequence[Any], Any]]

_KEEP = object()


def _unknown(eqn: Any) -> NotImplementedError:
    return NotImplementedError(
        f"traverse: no traversal of the higher-order primitive '{eqn.primitive.name}' "
        f"(known: {', '.join(sorted(PRIMITIVES))})"
    )


def _closed(jaxpr: Any) -> ClosedJaxpr:
    """A body as a closed jaxpr (checkpoint and old call primitives hold open ones)."""
    return jaxpr if isinstance(jaxpr, ClosedJaxpr) else ClosedJaxpr(jaxpr, [])


def _call_jaxpr(params: dict) -> Any:
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        if key in params:
            return params[key]
    raise KeyError(f"traverse: a call without a body (params: {sorted(params)})")


def scan_counts(params: dict) -> tuple[int, int]:
    """How many of a scan's operands are loop-invariant and how many carried (the rest
    are scanned over). JAX <= 0.10 names the counts; JAX 0.11 groups the operands in a
    flat tree ``ft_in`` of (consts, carry, xs)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    if "ft_in" in params:
        consts, carry, _ = (len(group) for group in params["ft_in"].unpack())
        return consts, carry
    raise KeyError(f"traverse: a scan without operand counts (params: {sorted(params)})")


def bodies(eqn: Any) -> list[tuple[ClosedJaxpr, Where]]:
    """The bodies of the higher-order ``eqn``, each with where it sits (a while loop:
    its predicate, then its body; a cond: its branches in order)."""
    name, p = eqn.primitive.name, eqn.params
    if name in CALLS:
        return [(_closed(_call_jaxpr(p)), Where(eqn, CALL))]
    if name in CHECKPOINTS:
        return [(_closed(p["jaxpr"]), Where(eqn, CHECKPOINT))]
    if name == "scan":
        consts, carry = scan_counts(p)
        return [(p["jaxpr"], Where(eqn, SCAN, consts=consts, carry=carry))]
    if name == "while":
        carry = len(eqn.invars) - p["cond_nconsts"] - p["body_nconsts"]
        return [
            (p["cond_jaxpr"], Where(eqn, WHILE_COND, consts=p["cond_nconsts"], carry=carry)),
            (p["body_jaxpr"], Where(eqn, WHILE_BODY, consts=p["body_nconsts"], carry=carry)),
        ]
    if name == "cond":
        return [(b, Where(eqn, BRANCH, index=n)) for n, b in enumerate(p["branches"])]
    raise _unknown(eqn)


def locate(eqn: Any, kind: str) -> tuple[ClosedJaxpr, Where]:
    """The first body of ``eqn`` of ``kind`` (a call, a scan, a while predicate or body)."""
    for closed, where in bodies(eqn):
        if where.kind == kind:
            return closed, where
    raise ValueError(f"traverse: '{eqn.primitive.name}' has no body of kind {kind!r}")


def body_operands(where: Where, operands: Sequence[Any], carried: Any = _KEEP) -> list[Any]:
    """What of a list parallel to the equation's operands (values, or the caller's tags
    of them) feeds ``where``'s body, in the order of its inputs; with ``carried`` given,
    it replaces the carried entries (a loop's carries are the body's own values)."""
    p = where.eqn.params
    if where.kind == WHILE_COND:
        ops = [*operands[: p["cond_nconsts"]], *operands[p["cond_nconsts"] + p["body_nconsts"] :]]
    elif where.kind == WHILE_BODY:
        ops = list(operands[p["cond_nconsts"] :])
    elif where.kind == BRANCH:
        ops = list(operands[1:])  # the first operand is the branch index
    else:
        ops = list(operands)
    if carried is _KEEP:
        return ops
    c, k = where.consts, where.carry
    return [*ops[:c], *([carried] * k), *ops[c + k :]]


def split(where: Where, operands: Sequence[Any]) -> tuple[list[Any], list[Any], list[Any]]:
    """The operands feeding ``where``'s body as (loop-invariant, carried, the rest)."""
    ops = body_operands(where, operands)
    c, k = where.consts, where.carry
    return ops[:c], ops[c : c + k], ops[c + k :]


def call_name(eqn: Any) -> str | None:
    """The name scope an inlined call runs under by default: its ``name`` parameter."""
    return eqn.params.get("name")


def _scope(name: str | None) -> Any:
    return jax.named_scope(name) if name else contextlib.nullcontext()


# -- rebinding ---------------------------------------------------------------------------


def call(
    eqn: Any,
    invals: Sequence[Any],
    body: Body,
    *,
    scope: Callable[[Any], str | None] = call_name,
) -> list[Any]:
    """Inline a call (jit, closed_call, a custom-derivative call's primal): its body run
    in place under the name scope ``scope(eqn)`` (none when that is empty)."""
    closed, where = locate(eqn, CALL)
    with _scope(scope(eqn)):
        outs, _ = body(closed, list(invals), where)
    return list(outs)


def checkpoint(eqn: Any, invals: Sequence[Any], body: Body, *, inline: bool = False) -> list[Any]:
    """A checkpoint (remat) rebound with `jax.checkpoint` and its ``prevent_cse`` and
    ``policy`` around the body; ``inline=True`` runs the body in place instead."""
    closed, where = locate(eqn, CHECKPOINT)
    if inline:
        return list(body(closed, list(invals), where)[0])
    p = eqn.params

    def run(*args: Any) -> list[Any]:
        return list(body(closed, list(args), where)[0])

    return list(jax.checkpoint(run, prevent_cse=p["prevent_cse"], policy=p["policy"])(*invals))


def scan(eqn: Any, invals: Sequence[Any], body: Body, *, aux_xs: Any = ()) -> tuple[list[Any], Any]:
    """A scan rebound with `lax.scan` (its length, direction and unrolling kept).
    ``aux_xs`` is scanned along with ``xs``, each iteration's slice handed to the body as
    ``where.aux``; returns (the carries and stacked outputs, the stacked aux)."""
    closed, where = locate(eqn, SCAN)
    consts, init, xs = split(where, invals)
    nk, p = where.carry, eqn.params

    def step(carry: list[Any], x: tuple[list[Any], Any]) -> tuple[list[Any], Any]:
        x, aux = x
        outs, out_aux = body(closed, [*consts, *carry, *x], dataclasses.replace(where, aux=aux))
        return list(outs[:nk]), (list(outs[nk:]), out_aux)

    carry, (ys, aux) = lax.scan(
        step,
        list(init),
        (list(xs), aux_xs),
        length=p["length"],
        reverse=p["reverse"],
        unroll=p["unroll"],
    )
    return [*carry, *ys], aux


def scan_unrolled(eqn: Any, invals: Sequence[Any], body: Body) -> list[Any]:
    """A scan run iteration by iteration in Python (``where.index``: the iteration), its
    outputs stacked with `jnp.stack`: each body sees concrete values when ``invals`` are.
    The bodies' aux is dropped. Needs a scan of length 1 or more (nothing to stack)."""
    closed, where = locate(eqn, SCAN)
    consts, init, xs = split(where, invals)
    nk, p = where.carry, eqn.params
    length = p["length"]
    if length < 1:
        raise ValueError(f"traverse: scan_unrolled needs a scan of length >= 1, got {length}")
    carry, ys = list(init), [None] * length
    for t in reversed(range(length)) if p["reverse"] else range(length):
        args = [*consts, *carry, *(x[t] for x in xs)]
        outs, _ = body(closed, args, dataclasses.replace(where, index=t))
        carry, ys[t] = list(outs[:nk]), list(outs[nk:])
    return [*carry, *(jnp.stack(column) for column in zip(*ys, strict=True))]


def while_loop(
    eqn: Any, invals: Sequence[Any], body: Body, *, aux0: Any = ()
) -> tuple[list[Any], Any]:
    """A while loop rebound with `lax.while_loop`. The predicate body's first output is
    the loop's condition. ``aux0`` starts the aux carried beside the carries (the body
    gets it as ``where.aux`` and returns the next); returns (the carries, the aux)."""
    (cond_jaxpr, cond_where), (body_jaxpr, body_where) = bodies(eqn)
    cond_consts = split(cond_where, invals)[0]
    body_consts, init, _ = split(body_where, invals)

    def cond_fn(state: tuple[list[Any], Any]) -> Any:
        carry, aux = state
        where = dataclasses.replace(cond_where, aux=aux)
        return body(cond_jaxpr, [*cond_consts, *carry], where)[0][0]

    def body_fn(state: tuple[list[Any], Any]) -> tuple[list[Any], Any]:
        carry, aux = state
        where = dataclasses.replace(body_where, aux=aux)
        outs, aux = body(body_jaxpr, [*body_consts, *carry], where)
        return list(outs), aux

    carry, aux = lax.while_loop(cond_fn, body_fn, (list(init), aux0))
    return list(carry), aux


def cond(eqn: Any, invals: Sequence[Any], body: Body) -> tuple[list[Any], Any]:
    """A cond rebound with `lax.switch` on its first operand (the branch index); every
    branch's aux must have one structure. Returns (the outputs, the taken branch's aux)."""

    def branch(closed: ClosedJaxpr, where: Where) -> Callable[..., Any]:
        def run(*args: Any) -> tuple[list[Any], Any]:
            outs, aux = body(closed, list(args), where)
            return list(outs), aux

        return run

    branches = [branch(closed, where) for closed, where in bodies(eqn)]
    outs, aux = lax.switch(invals[0], branches, *invals[1:])
    return list(outs), aux


def apply(
    eqn: Any,
    invals: Sequence[Any],
    body: Body,
    *,
    scope: Callable[[Any], str | None] = call_name,
) -> list[Any]:
    """Bind the higher-order ``eqn`` with each body run by ``body`` (aux, if any, is
    dropped; checkpoints are rebound). Raises NotImplementedError naming any other
    primitive."""
    name = eqn.primitive.name
    if name in CALLS:
        return call(eqn, invals, body, scope=scope)
    if name in CHECKPOINTS:
        return checkpoint(eqn, invals, body)
    if name == "scan":
        return scan(eqn, invals, body)[0]
    if name == "while":
        return while_loop(eqn, invals, body)[0]
    if name == "cond":
        return cond(eqn, invals, body)[0]
    raise _unknown(eqn)
