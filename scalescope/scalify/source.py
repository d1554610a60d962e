"""Where an equation came from: the user's file and line, read from JAX's source info."""

from __future__ import annotations

import os
from typing import Any

_INTERNAL_PARTS = (
    f"{os.sep}jax{os.sep}",
    f"{os.sep}jaxlib{os.sep}",
    f"{os.sep}scalescope{os.sep}scalify{os.sep}",
    f"{os.sep}scalescope{os.sep}core{os.sep}",
    f"{os.sep}scalescope{os.sep}ops{os.sep}",
    f"{os.sep}scalescope{os.sep}probe{os.sep}",
    f"{os.sep}contextlib.py",
    f"{os.sep}functools.py",
)
UNKNOWN = "<unknown>"

#: Libraries whose frames stand for the user's line that called them: model and optimizer
#: libraries, and the quantisation libraries that wrap a model's ops (qwix, AQT).
_LIBRARY_PARTS = tuple(
    f"{os.sep}{name}{os.sep}" for name in ("flax", "optax", "chex", "qwix", "aqt")
)


#: JAX frames where a body was entered (a custom derivative, a loop, a transformation):
#: frames past them are the caller's. JAX reuses a body it traced for later calls with
#: the same types, frames and all, so those may be another call's. Not ``pjit.py``: a
#: jit body's frames end at its own edge, and the jit frames inside them are jnp's
#: inlined helpers (``jnp.sqrt``, ``x * 3``), called from the body's own lines.
_BOUNDARY_PARTS = tuple(
    os.sep.join(("", "jax", "_src", *part))
    for part in (
        ("custom_derivatives.py",),
        ("api.py",),
        ("linear_util.py",),
        ("interpreters", "ad.py"),
        ("lax", "control_flow", ""),
    )
)

_OPTAX = f"{os.sep}optax{os.sep}"
#: Optimizer code: optax, and Flax's wrappers of it (their step counters).
_OPTIMIZER_PARTS = (
    _OPTAX,
    os.sep.join(("", "flax", "nnx", "training", "optimizer.py")),
    os.sep.join(("", "flax", "training", "train_state.py")),
)
#: optax packages that compute the loss or other forward work, not the optimizer's.
_OPTAX_FORWARD = tuple(
    f"{_OPTAX}{sub}{os.sep}" for sub in ("losses", "perturbations", "assignment")
) + (f"{_OPTAX}_src{os.sep}loss.py",)


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
        if any(part in path for part in _LIBRARY_PARTS):
            library = library or frame
            continue
        return path, frame.line_num, frame.function_name
    if library is not None:
        return library.file_name, library.line_num, library.function_name
    return None


def body_source(source_info: Any, enclosing: str) -> str:
    """``file:line`` of an equation of a body (of a jit, a loop, a custom derivative)
    called from the user's line ``enclosing``: the innermost user frame inside the body
    (before the first frame where JAX entered a body, `_BOUNDARY_PARTS`), else
    ``enclosing``. A frame past that boundary is a caller's, and may be another call's
    (JAX reuses a body it traced: the second layer's gradient got the first layer's
    line); a library frame (flax, optax) stands for less than the user's call."""
    for frame in _frames(source_info):
        path = frame.file_name
        if any(part in path for part in _BOUNDARY_PARTS):
            break
        if any(part in path for part in _INTERNAL_PARTS + _LIBRARY_PARTS):
            continue
        return f"{path}:{frame.line_num}"
    return enclosing


def in_optimizer(source_info: Any) -> bool:
    """Whether an optimizer computed the equation: a frame in optax (or Flax's
    ``nnx.Optimizer`` / ``TrainState``), and none in optax's losses
    (``optax.softmax_cross_entropy`` is forward work). Moment decays and weight decay
    read optimizer state and parameters, not gradients, so only where they were written
    tells them apart from the forward pass."""
    paths = [frame.file_name for frame in _frames(source_info)]
    if any(part in path for path in paths for part in _OPTAX_FORWARD):
        return False
    return any(part in path for path in paths for part in _OPTIMIZER_PARTS)


def format_source(source_info: Any, default: str = UNKNOWN) -> str:
    """``file:line`` of the user frame, or ``default`` when the equation has none."""
    frame = user_frame(source_info)
    if frame is None:
        return default
    return f"{frame[0]}:{frame[1]}"
