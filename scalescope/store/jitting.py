"""`jax.jit` for a training step whose arguments include values that are not arrays.

A step written for a plain Python loop often takes an optax transformation, a model
definition, a loss function or a string among its arguments (``update(params, state,
optimizer, batch)``). `jax.jit` needs such arguments named in ``static_argnums``;
`Run.track` promises "the same signature as fn", so it finds them itself: every pytree
leaf that is not an array (a `ScaledArray` flattens to arrays) or a Python number is
passed as a static value (hashed, compared by equality, a new value compiles again), as
if it had been listed in ``static_argnums``. Python numbers stay traced, as under
`jax.jit`. Arguments named by position in ``donate`` are donated, as with ``jax.jit``'s
``donate_argnums``: their array leaves, and those alone. An argument can also be made
static whole, arrays and numbers included (`Static`, ``Run.track``'s ``static_argnums``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from typing import Any

import jax
import numpy as np

from ..scalify.interpreter import OutTree, is_array_like, split_static_outputs

_NUMBERS = (bool, int, float, complex)
#: Leaf types known to be traced, so the common case skips `is_array_like`'s checks; JAX's
#: array type joins at its first sight (naming it here would start a backend at import).
_TRACED_TYPES: set[type] = {*_NUMBERS, np.ndarray}


class Static:
    """An argument passed whole as one static value (``Run.track``'s ``static_argnums``):
    a pytree leaf that is not an array, hashed and compared by its value, so a Python
    number or a config of them the step branches on is not traced."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __hash__(self) -> int:
        return hash(self.value)

    def __eq__(self, other: object) -> bool:
        return type(other) is Static and bool(self.value == other.value)

    def __repr__(self) -> str:
        return f"Static({self.value!r})"


def as_statics(
    args: tuple, kwargs: dict, positions: tuple[int, ...], names: tuple[str, ...], where: str
) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with the arguments at ``positions`` and the keyword arguments
    ``names`` wrapped in `Static` (each must hash)."""
    out, given = list(args), dict(kwargs)
    for i in positions:
        if i < len(out) and type(out[i]) is not Static:
            out[i] = _static(out[i], f"{where} args[{i}]")
    for name in names:
        if name in given and type(given[name]) is not Static:
            given[name] = _static(given[name], f"{where} kwargs[{name!r}]")
    return tuple(out), given


def _static(value: Any, what: str) -> Static:
    try:
        hash(value)
    except TypeError as err:
        raise TypeError(
            f"{what} is a {type(value).__name__}, which is not hashable ({err}): an argument "
            "named in static_argnums or static_argnames is compared by value from call to "
            "call and must be hashable, all its fields included (a tuple, a frozen "
            "dataclass of hashable fields, a number...)"
        ) from None
    return Static(value)


def with_statics(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` taking `Static` arguments: it sees their values (one wrapper per
    function, so that tracking it again reuses its compiled programs)."""
    try:
        return _with_statics(fn)
    except TypeError:  # an unhashable callable: a wrapper of its own
        return _with_statics.__wrapped__(fn)


@functools.lru_cache(maxsize=64)
def _with_statics(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def step(*args: Any, **kwargs: Any) -> Any:
        args = tuple(a.value if type(a) is Static else a for a in args)
        return fn(*args, **{k: v.value if type(v) is Static else v for k, v in kwargs.items()})

    step.__name__ = program_name(fn, step.__name__)
    return step


def _is_traced(leaf: Any) -> bool:
    kind = type(leaf)
    if kind in _TRACED_TYPES:
        return True
    if isinstance(leaf, jax.Array):
        _TRACED_TYPES.add(kind)
        return True
    return isinstance(leaf, _NUMBERS) or is_array_like(leaf)


def signature(static: Hashable, dynamic: list) -> Hashable:
    """What decides a call's trace: the static part and each traced leaf's shape and
    dtype (its type for a Python number)."""
    return static, tuple(_leaf_signature(leaf) for leaf in dynamic)


def _leaf_signature(leaf: Any) -> Any:
    aval = getattr(leaf, "aval", None)
    if aval is not None:
        return aval
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return (tuple(leaf.shape), np.dtype(leaf.dtype))
    return type(leaf)


def partition(args: tuple, kwargs: dict, *, where: str = "argument") -> tuple[Hashable, list]:
    """``(static, dynamic)``: the hashable description of every non-array leaf of
    ``(args, kwargs)`` with the tree's structure, and the traced leaves in order."""
    flat, treedef = jax.tree_util.tree_flatten((args, kwargs))
    fixed, dynamic = [], []
    for i, leaf in enumerate(flat):
        if _is_traced(leaf):
            dynamic.append(leaf)
            continue
        try:
            hash(leaf)
        except TypeError:
            raise TypeError(
                f"{where} {_describe(args, kwargs, i)} is a {type(leaf).__name__}, which is "
                "not an array and not hashable: non-array arguments are passed as static "
                "values (as with jax.jit's static_argnums) and must be hashable"
            ) from None
        fixed.append((i, leaf))
    return (treedef, tuple(fixed)), dynamic


def _describe(args: tuple, kwargs: dict, index: int) -> str:
    """``args[2].init`` / ``kwargs['act']`` for the ``index``-th leaf of ``(args, kwargs)``."""
    paths = jax.tree_util.tree_flatten_with_path((args, kwargs))[0]
    head, *rest = paths[index][0]
    root = "args" if getattr(head, "idx", 0) == 0 else "kwargs"
    return root + jax.tree_util.keystr(tuple(rest))


def _rebuild(static: Hashable, dynamic: list) -> tuple[tuple, dict]:
    treedef, fixed = static
    given = dict(fixed)
    it = iter(dynamic)
    leaves = [given[i] if i in given else next(it) for i in range(treedef.num_leaves)]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def program_name(fn: Callable[..., Any], default: str) -> str:
    """The name ``jax.jit(fn)`` gives its program: ``fn``'s (a partial's function's), or
    ``default`` for a callable without one."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    name = getattr(fn, "__name__", None)
    return name if isinstance(name, str) and name else default


class StaticLeafJit:
    """``jax.jit(fn)`` with non-array argument leaves made static; call it like ``fn``.
    ``trace(*args, **kwargs)`` traces without compiling (as `jax.jit(...).trace`).
    ``donate``: the positions of the arguments whose arrays the program may reuse for
    its outputs (``jax.jit``'s ``donate_argnums``); the caller's arrays are then deleted.

    The program is named ``name`` (default: ``fn``'s name), as ``jax.jit(fn)`` would
    name it: profiles and XLA dumps show the user's step, and the persistent
    compilation cache, whose keys begin with that name, serves the same computation
    jitted elsewhere under it."""

    def __init__(
        self,
        fn: Callable[..., Any],
        where: str,
        name: str | None = None,
        donate: tuple[int, ...] = (),
    ) -> None:
        self.where = where
        self.donate = tuple(sorted(set(donate)))
        # static part of the arguments -> how to put back the non-array leaves of them
        # that ``fn`` returns (`split_static_outputs`), for the calls that do
        self._outs: dict[Hashable, OutTree] = {}
        # static part -> which traced leaves are donated (with ``donate`` only)
        self._donated: dict[Hashable, tuple[bool, ...]] = {}

        def core(static: Hashable, dynamic: list, given: list = ()) -> Any:
            if self.donate:  # ``dynamic`` holds the donated leaves, ``given`` the others
                dynamic = _merge(self._donated[static], dynamic, given)
            args, kwargs = _rebuild(static, dynamic)
            out = fn(*args, **kwargs)
            returned, tree = split_static_outputs(fn, out, [leaf for _, leaf in static[1]])
            if tree is not None:
                self._outs[static] = tree
            return returned

        core.__name__ = core.__qualname__ = name or program_name(fn, "core")
        self._jitted = jax.jit(core, static_argnums=0, donate_argnums=1 if self.donate else ())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call_parts(partition(args, kwargs, where=self.where))

    def call_parts(self, parts: tuple[Hashable, list]) -> Any:
        """Call on arguments already split by `partition` (a caller that needs the split
        itself does not pay for it twice)."""
        out = self._jitted(*self._split(parts))
        tree = self._outs.get(parts[0]) if self._outs else None
        return out if tree is None else tree.unflatten(out)

    def trace(self, *args: Any, **kwargs: Any) -> Any:
        return self._jitted.trace(*self._split(partition(args, kwargs, where=self.where)))

    def _split(self, parts: tuple[Hashable, list]) -> tuple:
        """``parts``, with the traced leaves of donated arguments apart from the others."""
        if not self.donate:
            return parts
        static, dynamic = parts
        mask = self._donated.get(static)
        if mask is None:
            mask = self._donated[static] = _donated_leaves(static, self.donate)
        donated = [x for x, d in zip(dynamic, mask, strict=True) if d]
        return static, donated, [x for x, d in zip(dynamic, mask, strict=True) if not d]


def _donated_leaves(static: Hashable, donate: tuple[int, ...]) -> tuple[bool, ...]:
    """For each traced leaf of the arguments ``static`` describes (`partition`), whether
    it belongs to a positional argument in ``donate``."""
    treedef, fixed = static
    args_tree = treedef.children()[0]
    owner: list[int] = []
    for i, child in enumerate(args_tree.children()):
        owner += [i] * child.num_leaves
    owner += [-1] * (treedef.num_leaves - len(owner))  # keyword arguments
    fixed_at = {i for i, _ in fixed}
    return tuple(owner[i] in donate for i in range(treedef.num_leaves) if i not in fixed_at)


def _merge(mask: tuple[bool, ...], donated: list, given: list) -> list:
    """The traced leaves in order again from `StaticLeafJit._split`'s two lists."""
    d, g = iter(donated), iter(given)
    return [next(d) if m else next(g) for m in mask]
