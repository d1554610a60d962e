"""Where an equation came from: the user's file and line, read from JAX's source info."""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from typing import Any

_INTERNAL_PARTS = (
    f"{os.sep}jax{os.sep}",
    f"{os.sep}jaxlib{os.sep}",
    f"{os.sep}scalescope{os.sep}scalify{os.sep}",
    f"{os.sep}scalescope{os.sep}core{os.sep}",
    f"{os.sep}scalescope{os.sep}ops{os.sep}",
    f"{os.sep}scalescope{os.sep}probe{os.sep}",
    f"{os.sep}scalescope{os.sep}store{os.sep}",
    f"{os.sep}contextlib.py",
    f"{os.sep}functools.py",
)
UNKNOWN = "<unknown>"

#: Libraries whose frames stand for the user's line that called them: the building blocks
#: a model is written with (layers, optimizers, tensor utilities, mixed-precision
#: policies) and the quantisation libraries that wrap a model's ops (qwix, AQT). Told by
#: the folder each is imported from (`package_dir`), not by a folder name in the path: a
#: clone of google/flax running its own examples is the user's code. Any other package,
#: installed or not, is model code whose lines are the answer (a model zoo's
#: ``modeling_flax_gpt2.py``, the user's own package installed into a container): were
#: every installed package's frames a library's, each op of such a model would be placed
#: at the one script line that calls the model.
LIBRARIES = (
    "flax",
    "optax",
    "chex",
    "qwix",
    "aqt",
    "equinox",
    "haiku",
    "jraph",
    "einops",
    "jmp",
)
#: scalescope's own building blocks (``U.linear``): the user's line that called them.
_OWN_LIBRARIES = (("scalescope", "unit"),)


@functools.lru_cache(maxsize=64)
def _package_dirs(name: str, search_path: tuple[str, ...]) -> tuple[str, ...]:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return ()
    if spec is None or not spec.submodule_search_locations:
        return ()
    return tuple(os.path.join(os.path.realpath(p), "") for p in spec.submodule_search_locations)


@functools.lru_cache(maxsize=256)
def _dirs(locations: tuple[str, ...], sub: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(os.path.join(os.path.realpath(p), *sub, "") for p in locations)


def package_dir(name: str, *sub: str) -> tuple[str, ...]:
    """The folders (each ending in a separator) package ``name`` is imported from, with
    ``sub`` appended (``package_dir("flax", "nnx")``); empty when it cannot be found.
    Looked up again when ``sys.path`` changes."""
    mod = sys.modules.get(name)
    locations = getattr(mod, "__path__", None) if mod is not None else None
    if locations is None:
        locations = _package_dirs(name, tuple(sys.path))
    return _dirs(tuple(locations), sub)


@functools.lru_cache(maxsize=4096)
def _real(path: str) -> str:
    return os.path.realpath(path)


def in_package(path: str, name: str, *sub: str) -> bool:
    """Whether the file ``path`` lies in package ``name`` (under ``sub``)."""
    if f"{os.sep}{name}{os.sep}" not in path:
        return False  # (cheap: most frames are not)
    real = _real(path)
    return any(real.startswith(d) for d in package_dir(name, *sub))


def _library(path: str) -> bool:
    return any(in_package(path, name) for name in LIBRARIES) or any(
        in_package(path, *parts) for parts in _OWN_LIBRARIES
    )


#: Optimizer code: optax, and Flax's wrappers of it (their step counters), as files of
#: the installed packages: (package, path inside it).
_OPTIMIZER_FILES = (
    ("flax", os.path.join("nnx", "training", "optimizer.py")),
    ("flax", os.path.join("training", "train_state.py")),
)
#: optax's parts that compute the loss or other forward work, not the optimizer's.
_OPTAX_FORWARD = ("losses", "perturbations", "assignment", os.path.join("_src", "loss.py"))


def _optimizer(path: str) -> bool:
    if in_package(path, "optax"):
        return True
    return any(
        in_package(path, name) and _real(path).endswith(os.sep + rel)
        for name, rel in _OPTIMIZER_FILES
    )


def _optax_forward(path: str) -> bool:
    if not in_package(path, "optax"):
        return False
    real = _real(path)
    return any(
        real.startswith(os.path.join(d, part))
        for d in package_dir("optax")
        for part in _OPTAX_FORWARD
    )


def _frames(source_info: Any) -> list[Any]:
    tb = getattr(source_info, "traceback", None)
    if tb is None:
        return []
    try:
        return list(tb.frames)
    except Exception:  # pragma: no cover - traceback objects vary across jaxlib versions
        return []


def user_frame(source_info: Any) -> tuple[str, int, str] | None:
    """Innermost frame outside JAX and scalescope internals, as (file, line, function).

    Frames of model libraries (flax, optax) are used only when no frame of the user's
    own code is found, so a flax `Dense` resolves to the user's model line.
    """
    library = None
    for frame in _frames(source_info):
        path = frame.file_name
        if any(part in path for part in _INTERNAL_PARTS):
            continue
        if _library(path):
            library = library or frame
            continue
        return path, frame.line_num, frame.function_name
    if library is not None:
        return library.file_name, library.line_num, library.function_name
    return None


#: Where JAX runs a custom derivative's function: frames past it are the caller's, and in a
#: body JAX traced once and reused (Flax's FP8 ops in a second layer) another call's.
_CUSTOM_DERIVATIVES = os.sep.join(("", "jax", "_src", "custom_derivatives.py"))


def caller_functions(source_info: Any) -> frozenset[tuple[str, str]]:
    """``(file, function)`` of the frames of ``source_info`` outside JAX and scalescope:
    the functions an equation that calls a body was traced from (`body_source`)."""
    return frozenset(
        (frame.file_name, frame.function_name)
        for frame in _frames(source_info)
        if not any(part in frame.file_name for part in _INTERNAL_PARTS)
    )


def body_source(
    source_info: Any,
    enclosing: str,
    callers: frozenset[tuple[str, str]] = frozenset(),
    *,
    custom: bool = True,
) -> str:
    """``file:line`` of an equation of a body (of a jit, a loop, a custom derivative)
    called from the user's line ``enclosing``, by functions ``callers``
    (`caller_functions` of the calls around it): its innermost user frame, unless that
    frame is in one of the callers at another line than ``enclosing``: JAX reuses a body
    it traced for later calls with the same types, frames and all, so such a frame is
    another call's (the second layer's gradient got the first layer's line); then, or
    when the equation has library frames only (flax, optax) before JAX's custom
    derivative machinery, ``enclosing``. ``custom``: the body is (inside) a custom
    derivative's, whose frames past that machinery are another call's; elsewhere they are
    the live trace's (`jax.nn.relu`'s derivative, traced under a `jax.grad` inside the
    body, reaches the model's line only past it)."""
    for frame in _frames(source_info):
        path = frame.file_name
        if custom and path.endswith(_CUSTOM_DERIVATIVES):
            break
        if any(part in path for part in _INTERNAL_PARTS) or _library(path):
            continue
        here = f"{path}:{frame.line_num}"
        if (path, frame.function_name) in callers and here != enclosing:
            return enclosing
        return here
    return enclosing


def in_optimizer(source_info: Any) -> bool:
    """Whether an optimizer computed the equation: a frame in optax (or Flax's
    ``nnx.Optimizer`` / ``TrainState``), and none in optax's losses
    (``optax.softmax_cross_entropy`` is forward work). Moment decays and weight decay
    read optimizer state and parameters, not gradients, so only where they were written
    tells them apart from the forward pass."""
    paths = [frame.file_name for frame in _frames(source_info)]
    if any(_optax_forward(path) for path in paths):
        return False
    return any(_optimizer(path) for path in paths)


def format_source(source_info: Any, default: str = UNKNOWN) -> str:
    """``file:line`` of the user frame, or ``default`` when the equation has none."""
    frame = user_frame(source_info)
    if frame is None:
        return default
    return f"{frame[0]}:{frame[1]}"
