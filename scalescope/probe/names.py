"""Readable op names and passes from JAX's name stacks.

An equation's name stack reads like ``transpose(jvp(block_0))/attn``: scopes from
`jax.named_scope` and flax module paths, wrapped by the transformations that produced
the equation. Inside a loop body the stack is relative to the loop equation, and JAX
repeats the loop's own scope there without its transformations, so the two are joined
without repeating the common part.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..scalify.rules_collective import COLLECTIVES

_WRAPPED = re.compile(r"^([A-Za-z_][\w.]*)\((.*)\)$")

#: Top-level scopes that name a pass of their own (``with jax.named_scope("opt"):``).
PASS_SCOPES = ("opt",)


@dataclass(frozen=True)
class Scope:
    """A parsed name stack: the scope path and the transformations seen on it."""

    path: tuple[str, ...] = ()
    transforms: frozenset[str] = frozenset()

    def join(self, inner: Scope) -> Scope:
        """``inner`` (a stack relative to this one) seen from the outside."""
        path = inner.path
        if path[: len(self.path)] != self.path:
            path = self.path + path
        return Scope(path, self.transforms | inner.transforms)


def parse(name_stack: str) -> Scope:
    """``"transpose(jvp(blocks))/attn"`` -> path ``("blocks", "attn")``, transforms
    ``{"transpose", "jvp"}``."""
    path, transforms = [], set()
    for part in _split(str(name_stack)):
        while True:
            m = _WRAPPED.match(part)
            if not m:
                break
            transforms.add(m.group(1))
            part = m.group(2)
        if part and not part.startswith(_EQUINOX_SCOPE):
            path.append(part)
    return Scope(tuple(path), frozenset(transforms))


#: The scope Equinox's layers give their calls (``eqx.nn.Linear``): their class, which the
#: module's path names better (`modules.module_scopes`), so it is left out of names.
_EQUINOX_SCOPE = "eqx."


def _split(stack: str) -> list[str]:
    """Split on ``/`` outside parentheses."""
    parts, depth, cur = [], 0, []
    for ch in stack:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "/" and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p for p in parts if p]


def pass_of(
    scope: Scope,
    after_backward: bool,
    pass_scopes=PASS_SCOPES,
    optimizer: bool = False,
    gradient_comm: bool = False,
) -> str:
    """``bwd`` under ``transpose``; a pass scope's name (``opt``) for a value under a
    top-level scope of that name; ``opt`` for a value computed from gradients outside
    the backward pass, or by an optimizer library (``optimizer``: optax's moment and
    weight decays read no gradient), but ``bwd`` for the gradients' communication
    across devices (``gradient_comm``, `gradient_comm`); ``fwd`` otherwise."""
    if "transpose" in scope.transforms:
        return "bwd"
    if scope.path and scope.path[0] in pass_scopes:
        return scope.path[0]
    if gradient_comm and not optimizer:
        return "bwd"
    return "opt" if after_backward or optimizer else "fwd"


def gradient_comm(primitive: str, operands: Sequence[Any]) -> bool:
    """Whether an op communicates gradients as the backward pass left them: a collective
    (`rules_collective.COLLECTIVES`: data parallelism's all-reduce, `lax.pmean` of the
    grads) whose every operand is a ``bwd`` value, or the division of one collective's
    ``bwd`` output by constants that `lax.pmean` adds. Such an op finishes the backward
    pass rather than starts the update.

    ``operands``: the record (``pass_``, ``primitive``) of each operand that is not a
    constant, None where there is none."""
    if not operands or any(r is None or r.pass_ != "bwd" for r in operands):
        return False
    if primitive in COLLECTIVES:
        return True
    return primitive == "div" and len(operands) == 1 and operands[0].primitive in COLLECTIVES


def op_name(scope: Scope, primitive: str) -> str:
    return "/".join((*scope.path, primitive))
