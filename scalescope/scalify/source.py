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
_LIBRARY_PARTS = (f"{os.sep}flax{os.sep}", f"{os.sep}optax{os.sep}", f"{os.sep}chex{os.sep}")


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


def format_source(source_info: Any) -> str:
    """``file:line`` of the user frame, or ``"<unknown>"``."""
    frame = user_frame(source_info)
    if frame is None:
        return "<unknown>"
    return f"{frame[0]}:{frame[1]}"
