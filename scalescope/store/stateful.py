"""Flax NNX objects among a tracked step's arguments: their state in, their new state out.

Flax's NNX examples write a training step on objects, ``optimizer.update(model, grads)``
on the model passed in, and compile it with ``nnx.jit``, which writes what the step
assigned back into the caller's objects. Under `jax.jit` those assignments change copies
made while tracing, and the model never trains. `Run.track` promises the step's own
signature and effect, so it does what ``nnx.jit`` does: a call splits the NNX objects
among the arguments into one pure state (`nnx.split` of them all at once, so a variable
two objects share stays one), the traced step merges them back, runs the user's function
and returns the objects' new state beside its outputs, and the call writes that state
into the caller's objects (`nnx.update`). The kept inputs of the flight recorder are the
pure state of that call, not objects that later steps change. Steps on plain pytrees
pass through unchanged, and nothing here imports Flax: it only acts on objects of an
already imported ``flax.nnx``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ..core.scaled_array import ScaledArray, asarray
from .jitting import program_name


class NodeState:
    """An NNX object's place among a step's arguments: its part of the call's state (the
    children, keyed as the state is, so that ops are named ``model/l1/kernel``), its
    index among the call's objects and their joint graph definition (static)."""

    def __init__(self, graphdef: Any, index: int, state: Any) -> None:
        self.graphdef, self.index, self.state = graphdef, index, state

    def tree_flatten_with_keys(self) -> tuple[tuple[tuple[Any, Any], ...], Any]:
        keys = tuple(self.state.keys())
        children = tuple((jax.tree_util.DictKey(k), self.state[k]) for k in keys)
        return children, (self.graphdef, self.index, keys)

    @classmethod
    def tree_unflatten(cls, aux: Any, children: tuple[Any, ...]) -> NodeState:
        graphdef, index, keys = aux
        return cls(graphdef, index, _nnx().State(dict(zip(keys, children, strict=True))))


jax.tree_util.register_pytree_with_keys_class(NodeState)


#: What `split` passes over without asking Flax (`is_graph_node` costs ~10 us a call).
_PLAIN = (ScaledArray, jax.Array, np.ndarray, np.generic, dict, list, tuple, int, float, type(None))


#: Argument structures `split` found no NNX object in (bounded: cleared when full).
_NO_OBJECTS: set[Any] = set()


def _nnx() -> Any:
    return sys.modules.get("flax.nnx")


def _is_node(nnx: Any) -> Callable[[Any], bool]:
    """Where flattening stops: a `ScaledArray`, or an NNX object (a module, an
    optimizer, ``nnx.Rngs``). Not a variable: the pure state of the functional API
    (``nnx.split``'s ``State`` of ``Param``s) is a pytree like any other, and its
    variables are the caller's to replace, not to be written into."""
    is_graph_node, variable = nnx.graph.is_graph_node, nnx.Variable

    def stop(x: Any) -> bool:
        if isinstance(x, _PLAIN):  # the common leaves and containers, told apart at once
            return isinstance(x, ScaledArray)
        return is_graph_node(x) and not isinstance(x, variable)

    return stop


class Split:
    """A call's arguments with their NNX objects replaced by `NodeState`
    (``args``, ``kwargs``), and the objects themselves, to write the new state into."""

    def __init__(self, args: tuple, kwargs: dict, nodes: tuple[Any, ...]) -> None:
        self.args, self.kwargs, self.nodes = args, kwargs, nodes

    def update(self, state: Any) -> None:
        """Write a step's new state into the caller's objects (plain arrays: a scaled
        value is stored as the value it represents)."""
        _nnx().update(self.nodes, asarray(state))


def split(args: tuple, kwargs: dict) -> Split | None:
    """``args, kwargs`` with their NNX objects as pure state; None when there are none
    (or Flax NNX was never imported)."""
    nnx = _nnx()
    if nnx is None:
        return None
    # A structure seen to hold no NNX object is not searched again: asking each node
    # costs ~2 us, a few ms a call for a model of a thousand leaves, where the structure
    # alone is read in C++.
    structure = jax.tree_util.tree_structure((args, kwargs))
    if structure in _NO_OBJECTS:
        return None
    stop = _is_node(nnx)
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=stop)
    where = [i for i, leaf in enumerate(leaves) if not isinstance(leaf, ScaledArray) and stop(leaf)]
    if not where:
        if len(_NO_OBJECTS) >= 64:
            _NO_OBJECTS.clear()
        _NO_OBJECTS.add(structure)
        return None
    nodes = tuple(leaves[i] for i in where)
    graphdef, state = nnx.split(nodes)
    leaves = list(leaves)
    for k, i in enumerate(where):
        leaves[i] = NodeState(graphdef, k, state[k])
    args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
    return Split(args, kwargs, nodes)


def _merged(args: tuple, kwargs: dict) -> tuple[tuple, dict, tuple[Any, ...] | None]:
    """Inside the traced step: the arguments with their objects merged back, and the
    objects (None when the call had none)."""
    marks = lambda x: isinstance(x, NodeState | ScaledArray)  # noqa: E731
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=marks)
    parts = [leaf for leaf in leaves if isinstance(leaf, NodeState)]
    if not parts:
        return args, kwargs, None
    nnx = _nnx()
    nodes = nnx.merge(parts[0].graphdef, nnx.State({p.index: p.state for p in parts}))
    leaves = [nodes[leaf.index] if isinstance(leaf, NodeState) else leaf for leaf in leaves]
    args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
    return args, kwargs, nodes


def returning_state(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` on arguments `split` made: its NNX objects merged back before it runs and
    ``(outputs, their new state)`` returned; on other arguments, ``fn`` itself."""

    @functools.wraps(fn)
    def step(*args: Any, **kwargs: Any) -> Any:
        args, kwargs, nodes = _merged(args, kwargs)
        out = fn(*args, **kwargs)
        if nodes is None:
            return out
        return out, _nnx().state(nodes)

    # ``wraps`` keeps the wrapper's name for a partial: name the program as jax.jit would
    step.__name__ = program_name(fn, step.__name__)
    return step
