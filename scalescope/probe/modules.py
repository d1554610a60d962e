"""Flax NNX and Equinox module paths as JAX name scopes, while a function is traced.

Flax linen wraps each module call in a named scope, so an op inside
``decoder/block_0/attn`` carries that path in its name stack. Flax NNX adds no scope: its
ops are named by primitive alone. `module_scopes` gives NNX calls the same names without
touching Flax: a profile function (`sys.setprofile`, this thread only) sees each call of a
method whose ``self`` is an ``nnx.Module`` and enters one `jax.named_scope` per element of
the module's attribute path (``layers``, ``0``, ``attn``), leaving them when the method
returns. Paths come from `nnx.iter_modules` of the outermost module called (the root,
whose own ops get no prefix), so they read like the parameters' paths
(``params/layers/0/attn/q/kernel``). A module the root does not reach (one built inside
a transformed function, such as the layer an ``nnx.scan`` body is given) takes the path
of the one module of its class below its caller (the stacked layers), else its class
name. Equinox's modules are pytrees: the paths are their field names and indices
(``layers/0``), and the scope Equinox gives each layer call, its class name
(``eqx.nn.Linear``), is left out of op names (`names.parse`).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

import jax

from ..scalify.source import in_package

_local = threading.local()

#: Part of `jax.jit`'s cache key while `module_scopes` is on: a jitted function (an
#: ``nnx.jit`` train step) traced before without the hook would otherwise be reused from
#: JAX's trace cache, unnamed.
_NAMING = jax.make_user_context(default_value=False)


def _key_name(key: Any) -> str:
    """A pytree key path element as a path component: ``layers``, ``0``, ``fc1``."""
    for attr in ("name", "idx", "key"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _equinox_modules(module_type: type) -> Any:
    """``iter_modules`` for Equinox: every ``eqx.Module`` a root reaches through its
    pytree fields, with its path of field names and indices (``layers/0``), the root
    first with the empty path, as ``nnx.iter_modules`` gives them."""

    def iter_modules(root: Any) -> list[tuple[tuple[str, ...], Any]]:
        found = [((), root)]

        def walk(node: Any, prefix: tuple[str, ...]) -> None:
            def below(x: Any) -> bool:
                return x is not node and isinstance(x, module_type)

            for path, child in jax.tree_util.tree_flatten_with_path(node, is_leaf=below)[0]:
                if below(child):
                    full = (*prefix, *(_key_name(k) for k in path))
                    found.append((full, child))
                    walk(child, full)

        walk(root, ())
        return found

    return iter_modules


def _kinds() -> list[tuple[type, Any]]:
    """``(module class, iter_modules)`` of each module library imported: Flax NNX's
    (whose calls carry no scope of their own) and Equinox's (whose layers' scopes name
    their class, ``eqx.nn.Linear``, not which one)."""
    kinds = []
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None:
        kinds.append((nnx.Module, nnx.iter_modules))
    eqx = sys.modules.get("equinox")
    if eqx is not None and isinstance(getattr(eqx, "Module", None), type):
        kinds.append((eqx.Module, _equinox_modules(eqx.Module)))
    return kinds


@contextlib.contextmanager
def module_scopes() -> Iterator[None]:
    """Within this context, calls of Flax NNX and Equinox modules traced on this thread
    run under named scopes of their attribute paths. Does nothing when neither is
    imported; nests (an inner context is a no-op)."""
    kinds = _kinds()
    if not kinds or getattr(_local, "active", False):
        yield
        return
    previous = sys.getprofile()
    tracker = _Tracker(kinds, previous)
    _local.active = True
    sys.setprofile(tracker.event)
    try:
        with _NAMING(True):
            yield
    finally:
        sys.setprofile(previous)
        _local.active = False
        tracker.close()


def _may_be_layer_method(code: Any) -> bool:
    """A method that may compute a layer: its first argument is ``self``, it is not a
    special method other than ``__call__``, and it is not Flax's own graph and pytree
    machinery (which ``nnx.merge`` and attribute access run outside any layer call)."""
    if code.co_argcount == 0 or code.co_varnames[0] != "self":
        return False
    name = code.co_name
    if name.startswith("__") and name.endswith("__") and name != "__call__":
        return False
    path = code.co_filename
    if in_package(path, "equinox"):  # its layers, not its module machinery
        return in_package(path, "equinox", "nn")
    return not in_package(path, "flax", "nnx") or in_package(path, "flax", "nnx", "nn")


class _Tracker:
    """The profile function and its stack of entered module calls."""

    def __init__(self, kinds: list[tuple[type, Any]], previous: Any = None) -> None:
        self.previous = previous  # a profile function already set, still called
        self.kinds = kinds  # (module class, iter_modules) per library
        self.module_type = tuple(k for k, _ in kinds)
        self.methods: dict[Any, bool] = {}  # code object -> `_may_be_layer_method`
        self.paths: dict[int, tuple[Any, tuple[str, ...]]] = {}  # id -> (module, path)
        self.stack: list[tuple[Any, Any, tuple[str, ...], list[Any]]] = []

    def event(self, frame: Any, event: str, arg: Any) -> None:
        if self.previous is not None:
            self.previous(frame, event, arg)
        if event == "call":
            self._call(frame)
        elif event == "return" and self.stack and self.stack[-1][0] is frame:
            _, _, _, scopes = self.stack.pop()
            for scope in reversed(scopes):
                scope.__exit__(None, None, None)

    def _call(self, frame: Any) -> None:
        code = frame.f_code
        known = self.methods.get(code)
        if known is None:
            known = self.methods[code] = _may_be_layer_method(code)
        if not known:
            return
        module = frame.f_locals.get("self")
        if not isinstance(module, self.module_type):
            return
        if self.stack and self.stack[-1][1] is module:
            return  # a method of the module calling another of its own methods
        outer = self.stack[-1][2] if self.stack else ()
        path = self._path(module)
        rel = path[len(outer) :] if path[: len(outer)] == outer else path
        scopes = [jax.named_scope(name) for name in rel]
        for scope in scopes:
            scope.__enter__()
        self.stack.append((frame, module, path, scopes))

    def _path(self, module: Any) -> tuple[str, ...]:
        path = self._known(module)
        if path:  # reached from a root already
            return path
        if not self.stack:  # a root: index every module it reaches
            self._index(module, ())
            return ()
        caller, caller_path = self.stack[-1][1], self.stack[-1][2]
        self._index(caller, caller_path)
        path = self._known(module)
        return path if path else self._by_type(module, caller_path)

    def _by_type(self, module: Any, caller_path: tuple[str, ...]) -> tuple[str, ...]:
        """The path of the one module of ``module``'s class below the caller (the stacked
        layers an ``nnx.scan`` body was sliced from), else the class name."""
        n = len(caller_path)
        same = {
            path
            for node, path in self.paths.values()
            if type(node) is type(module) and len(path) > n and path[:n] == caller_path
        }
        return same.pop() if len(same) == 1 else (*caller_path, type(module).__name__)

    def _known(self, module: Any) -> tuple[str, ...] | None:
        found = self.paths.get(id(module))
        return found[1] if found is not None and found[0] is module else None

    def _index(self, root: Any, prefix: tuple[str, ...]) -> None:
        iter_modules = next(it for kind, it in self.kinds if isinstance(root, kind))
        for path, node in iter_modules(root):
            key, full = id(node), (*prefix, *(str(p) for p in path))
            old = self.paths.get(key)
            # A module seen as a root so far takes the path of a root that reaches it.
            # The module is kept, so its id cannot be reused while we hold it.
            if old is None or old[0] is not node or (not old[1] and full):
                self.paths[key] = (node, full)

    def close(self) -> None:
        while self.stack:  # unwound by an exception the profile did not see return
            for scope in reversed(self.stack.pop()[3]):
                scope.__exit__(None, None, None)
        self.paths.clear()
