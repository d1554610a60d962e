"""Which parameter an unnamed op works on, from the outputs it reaches.

Optimizers add no name scopes: an AdamW step is a few hundred ``mul``/``add``/``sqrt``
ops, each on one parameter's leaf, that the op table would otherwise list as ``opt/mul#37
[64x10]``. Every such op reaches only the outputs of its own parameter (its new value
and optimizer state, e.g. ``0/params/dense/kernel`` and ``1/0/mu/params/dense/kernel``),
while the forward pass and a global norm reach them all. So an op without a scope whose
reached outputs share a path suffix that is the path of an input leaf (``params/dense/
kernel``, the argument's own name dropped) is named after it:
``params/dense/kernel/mul``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol


class _Node(Protocol):
    """A value of the interpretation: its inputs' nodes and the op record made for it."""

    parents: tuple[Any, ...]
    own: Any  # OpRecord | None


def reached_outputs(order: Sequence[_Node], outputs: Sequence[_Node | None]) -> dict[int, int]:
    """``{id(node): bitmask of the outputs it reaches}``. ``order``: every node, each
    after the nodes it is computed from (the interpretation's order)."""
    reach: dict[int, int] = {}
    for j, node in enumerate(outputs):
        if node is not None:
            reach[id(node)] = reach.get(id(node), 0) | (1 << j)
    for node in reversed(order):
        bits = reach.get(id(node), 0)
        if bits:
            for parent in node.parents:
                reach[id(parent)] = reach.get(id(parent), 0) | bits
    return reach


def _parts(path: str) -> tuple[str, ...]:
    return tuple(p for p in path.split("/") if p)


def _leaf_of_output(path: str) -> tuple[str, ...]:
    """A leaf path without the tuple/list positions it starts with (``0/params/w`` ->
    ``params/w``; ``1/0/mu/params/w`` -> ``mu/params/w``)."""
    parts = _parts(path)
    while parts and parts[0].isdigit():
        parts = parts[1:]
    return parts


def _common_suffix(paths: Iterable[tuple[str, ...]]) -> tuple[str, ...]:
    paths = list(paths)
    if not paths:
        return ()
    out = paths[0]
    for p in paths[1:]:
        k = 0
        while k < min(len(out), len(p)) and out[len(out) - 1 - k] == p[len(p) - 1 - k]:
            k += 1
        out = out[len(out) - k :] if k else ()
        if not out:
            break
    return out


def parameter_of(reached: int, output_paths: Sequence[str], leaves: set[tuple[str, ...]]) -> str:
    """The parameter path the outputs in bitmask ``reached`` all belong to ("" when
    they do not share one): the longest input leaf path (``leaves``) that ends their
    common path suffix; where none does, the shortest of the outputs' own paths when it
    is such a leaf and the only one that short. Flax's ``TrainState`` holds the inner
    parameter dict: a moment's update reaches ``params/dense/kernel`` and
    ``opt_state/mu/dense/kernel``, whose common suffix ``dense/kernel`` is no leaf, and
    the parameter is the path the optimizer's copies extend."""
    paths = [_leaf_of_output(output_paths[j]) for j in range(len(output_paths)) if reached >> j & 1]
    suffix = _common_suffix(paths)
    for k in range(len(suffix)):
        if suffix[k:] in leaves:
            return "/".join(suffix[k:])
    if suffix and paths:
        short = min(len(p) for p in paths)
        shortest = {p for p in paths if len(p) == short}
        if len(shortest) == 1 and (only := next(iter(shortest))) in leaves:
            return "/".join(only)
    return ""


def parameter_leaves(leaves: set[tuple[str, ...]]) -> set[tuple[str, ...]]:
    """The input leaves an op may be named after: ``leaves`` without the copies of the
    parameters held in optimizer state (``opt_state/0/mu/l1/kernel`` where ``l1/kernel``
    is a leaf too), told by their prefix: one that stands before two or more other
    leaves (``mu/`` mirrors the tree). A submodule's ``norm/bias`` beside a top-level
    ``bias`` is kept."""
    leaves = set(leaves)
    leaves.discard(())
    mirrors: dict[tuple[str, ...], int] = {}
    for leaf in leaves:
        for k in range(1, len(leaf)):
            if leaf[k:] in leaves:
                mirrors[leaf[:k]] = mirrors.get(leaf[:k], 0) + 1
    return {
        leaf
        for leaf in leaves
        if not any(
            mirrors.get(leaf[:k], 0) >= 2 and leaf[k:] in leaves for k in range(1, len(leaf))
        )
    }


def name_by_parameter(
    order: Sequence[_Node],
    outputs: Sequence[tuple[str, _Node | None]],
    input_paths: Sequence[str],
    pass_scopes: Sequence[str] = (),
) -> None:
    """Name each op record without a name scope of its own (its name is its primitive,
    or a pass scope and its primitive: ``opt/mul``) after the parameter it works on,
    where its reached outputs identify one: ``params/w/mul``, ``opt/params/w/mul``."""
    # (positions dropped as in outputs: a step on ``state = (model, optimizer)``, as the
    # functional NNX API writes it, has leaves ``state/0/l1/kernel/value``)
    leaves = parameter_leaves({_leaf_of_output("/".join(_parts(p)[1:])) for p in input_paths})
    if not leaves or not outputs:
        return
    paths = [p for p, _ in outputs]
    reach = reached_outputs(order, [node for _, node in outputs])
    every = (1 << len(outputs)) - 1
    for node in order:
        rec = node.own
        bits = reach.get(id(node), 0)
        if rec is None or not bits or bits == every:
            continue
        head, _, prim = rec.name.rpartition("/")
        if prim != rec.primitive or (head and head not in pass_scopes):
            continue
        param = parameter_of(bits, paths, leaves)
        if param:
            rec.name = "/".join(p for p in (head, param, prim) if p)
