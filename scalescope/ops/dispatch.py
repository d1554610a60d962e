"""Ops called on a `ScaledArray` outside `scalify` run their scaled rule directly.

Inside `scalify` an op sees plain traced data and the interpreter applies its rule. Called
eagerly (or under a plain ``jax.jit``) on a `ScaledArray`, the op would hand the pytree to
a JAX primitive, which rejects it; instead it runs through `scalify` itself, with the
input taken exactly as passed (no normalisation), so
``ss.ops.dynamic_rescale_l2(x)`` works wherever ``x`` is a `ScaledArray`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import jax

from ..core.scaled_array import ScaledArray
from ..scalify.interpreter import scalify

F = TypeVar("F", bound=Callable[..., Any])


def _has_scaled(tree: Any) -> bool:
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, ScaledArray))
    return any(isinstance(leaf, ScaledArray) for leaf in leaves)


def accepts_scaled(fn: F) -> F:
    """``fn``, which also takes `ScaledArray` arguments outside `scalify`."""
    scaled = scalify(fn, normalize=False)

    @functools.wraps(fn)
    def op(*args: Any, **kwargs: Any) -> Any:
        if _has_scaled((args, kwargs)):
            return scaled(*args, **kwargs)
        return fn(*args, **kwargs)

    return op  # type: ignore[return-value]
