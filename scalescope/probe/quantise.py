"""Quantise-dequantise: a value rounded to a format or a block-scaled recipe, and the
plan saying which values of a traced step a `Policy` rounds to what (`emulate`)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core import formats as _formats
from ..core import recipes as _recipes
from ..core.policy import UNREACHABLE, Policy, PolicyError, targets, unique_labels
from ..core.scaled_array import ScaledArray
from .optable import OpTable
from .recipe_kernel import dequantise


def _round_format(x: jax.Array, fmt: _formats.Format) -> jax.Array:
    """``x`` rounded to ``fmt`` (nearest even, saturating at its max), in float32."""
    big = np.float32(fmt.max)
    return lax.clamp(-big, x, big).astype(fmt.dtype).astype(jnp.float32)


def _qdq(x: jax.Array, target: str, axes: tuple[int, ...] | None) -> jax.Array:
    dtype = x.dtype
    x32 = x.astype(jnp.float32)
    if _recipes.is_recipe(target):
        out = dequantise(x32, _recipes.get(target), axes)
    else:
        out = jnp.where(jnp.isfinite(x32), _round_format(x32, _formats.get(target)), x32)
    return out.astype(dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _qdq_ste(x: jax.Array, target: str, axes: tuple[int, ...] | None) -> jax.Array:
    return _qdq(x, target, axes)


@_qdq_ste.defjvp
def _qdq_ste_jvp(target, axes, primals, tangents):
    # Straight through: differentiating an emulated function (quantisation-aware
    # training) passes the tangent unchanged, as FP8 training treats its casts.
    (x,), (t,) = primals, tangents
    return _qdq(x, target, axes), t


def quantise(x: Any, target: str, axes: Sequence[int] | None = None) -> Any:
    """``x`` quantised to ``target`` (a format of `scalescope.formats` or a block-scaled
    recipe of `scalescope.core.recipes`) and dequantised, in ``x``'s dtype.

    Formats round each element to nearest even, saturating at the format's max (``fp32``
    leaves a value as it is). Recipes scale each block (along ``axes``, default the last
    axis) as the probe measures them (`recipe_kernel.dequantise`). Non-finite elements
    stay as they are. A `ScaledArray` is quantised on its data (its scale is a power of
    two the recipes' scales absorb), as scalify's casts do. Differentiating through it
    passes the tangent unchanged (a straight-through estimator)."""
    if not isinstance(target, str) or target not in targets():
        raise PolicyError(f"quantise: unknown format or recipe {target!r}")
    if isinstance(x, ScaledArray):
        return ScaledArray.trusted(quantise(x.data, target, axes), x.scale)
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating) or _is_identity(target, x):
        return x
    axes = None if axes is None else tuple(int(a) for a in axes)
    return _qdq_ste(jnp.asarray(x), target, axes)


def _is_identity(target: str, x: Any) -> bool:
    """A format at least as wide as ``x``'s dtype changes no value of it."""
    if _recipes.is_recipe(target):
        return False
    fmt = _formats.get(target)
    src = jax.dtypes.finfo(jnp.result_type(x))
    return fmt.mantissa_bits >= src.nmant and fmt.max >= float(src.max)


@dataclass(frozen=True)
class Plan:
    """What to do with each value of one call signature, in the order of interpretation:
    ``targets[seq]`` (None: keep it; else ``(target, reads, axis)`` of its `Rule`) and the
    primitive the probe saw there."""

    targets: tuple[tuple[str, str, int | None] | None, ...]
    primitives: tuple[str, ...]
    labels: tuple[str, ...]
    reached: int  # values that get a target
    ops: tuple[int, ...] = ()  # the op id of each value (`OpTable.sequence`)
    rules: tuple[str, ...] = ()  # the pattern of the rule each value follows ("": none)

    @classmethod
    def build(cls, table: OpTable, policy: Policy) -> Plan:
        """The plan of ``policy`` over the ops of ``table`` (every rule must reach an op:
        `Policy.describe` raises naming the rule otherwise)."""
        policy.describe(table, strict=True)
        ops = table.ops
        labels = unique_labels([op.pass_ for op in ops], [op.name for op in ops])
        by_op: list[tuple[str, str] | None] = []
        patterns: list[str] = []
        for op, label in zip(ops, labels):
            rule = None if op.note in UNREACHABLE else policy.rule_for(label)
            by_op.append(None if rule is None else (rule.target, rule.reads, rule.axis))
            patterns.append("" if rule is None else rule.pattern)
        prims = [op.primitive for op in ops]
        targets = [by_op[i] if i >= 0 else None for i in table.sequence]
        created = [prims[i] if i >= 0 else "" for i in table.sequence]
        rules = [patterns[i] if i >= 0 else "" for i in table.sequence]
        reached = sum(t is not None for t in by_op)
        return cls(
            tuple(targets), tuple(created), tuple(labels), reached, table.sequence, tuple(rules)
        )


class Replacer:
    """Quantises the ``seq``-th value an interpretation makes as a `Plan` says: in place
    (every reader gets the rounded value) or for the matmuls that read it (`reads`)."""

    def __init__(self, plan: Plan, block_axes: dict[Any, tuple[int, ...]]) -> None:
        self.plan, self.block_axes, self.seq = plan, block_axes, 0
        self.for_matmul: dict[int, Any] = {}  # id(value) -> what a matmul reads instead
        self._keep: list[Any] = []  # keeps the ids above from being reused
        self._waiting: dict[int, int] = {}  # id(value) -> seq, until a matmul reads it
        self._read: set[int] = set()  # seqs of values held '@matmul' that a matmul read
        self.original: dict[int, Any] = {}  # id(rounded) -> the value as computed

    def __call__(self, seq: int, value: Any, var: Any, primitive: str = "") -> Any:
        plan = self.plan
        if seq >= len(plan.targets):
            raise RuntimeError(
                f"emulate: the function made more values ({seq + 1}) than when its op "
                f"table was traced ({len(plan.targets)}); does it trace differently "
                "from one call to the next?"
            )
        expected = plan.primitives[seq]
        if primitive and expected and primitive != expected:
            raise RuntimeError(
                f"emulate: value {seq} is a '{primitive}' here and a '{expected}' in the op "
                "table; does the function trace differently from one call to the next?"
            )
        entry = plan.targets[seq]
        if entry is None:
            return value
        target, reads, axis = entry
        if axis is not None:
            ndim = np.ndim(value.data if isinstance(value, ScaledArray) else value)
            if ndim and not -ndim <= axis < ndim:
                label = plan.labels[plan.ops[seq]] if plan.ops else f"value {seq}"
                raise PolicyError(
                    f"emulate: {label} has {ndim} axes; its rule blocks along axis {axis}"
                )
            axes: Any = (axis % max(ndim, 1),)
        else:
            axes = self.block_axes.get(var) if var is not None else None
        rounded = quantise(value, target, axes)
        if reads == "all":
            self.original[id(rounded)] = value
            self._keep.append(rounded)
            return rounded
        self.for_matmul[id(value)] = rounded
        self._waiting[id(value)] = seq
        self._keep.append(value)
        return value

    def target_of(self, seq: int) -> str | None:
        """The format or recipe the ``seq``-th value is rounded to (None: kept as it is;
        ``fp32`` keeps it too)."""
        entry = self.plan.targets[seq] if seq < len(self.plan.targets) else None
        return None if entry is None or entry[0] == "fp32" else entry[0]

    def next(self, value: Any, var: Any, primitive: str) -> Any:
        out = self(self.seq, value, var, primitive)
        self.seq += 1
        return out

    def reads(self, eqn: Any, invals: Sequence[Any]) -> Sequence[Any]:
        """A matmul's operands as it reads them: rounded where a rule says so."""
        if eqn.primitive.name != "dot_general" or not self.for_matmul:
            return invals
        for v in invals[:2]:
            seq = self._waiting.pop(id(v), None)
            if seq is not None:
                self._read.add(seq)
        return [self.for_matmul.get(id(v), v) for v in invals]

    def unread_seqs(self) -> set[int]:
        """The values (by ``seq``) held ``@matmul`` that no matmul has read."""
        return set(self._waiting.values())

    def unread(self) -> list[str]:
        """Labels of the values held ``@matmul`` that no matmul read where the
        interpretation could see it (inside a ``scan`` body a loop's values are new ones
        at each step), of the rules no matmul read any value of: those rules changed
        nothing. A rule some matmul reads through (``fwd/**: e4m3@matmul``) leaves the
        values it reaches and no matmul reads as they are, which is what it says."""
        plan = self.plan
        waiting = set(self._waiting.values())
        if plan.rules:
            working = {plan.rules[seq] for seq in self._read}
            waiting = {seq for seq in waiting if plan.rules[seq] not in working}
        ids = sorted({plan.ops[seq] for seq in waiting if plan.ops})
        return [plan.labels[i] for i in ids if i >= 0]
