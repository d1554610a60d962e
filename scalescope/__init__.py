"""scalescope: see what low precision does to every primitive of a JAX training step."""

from . import ops
from .core import formats
from .core.formats import Format
from .core.scaled_array import ScaledArray, as_scaled_array, asarray, is_scaled_array
from .scalify import ScalifyError, register_rule, scalify

__version__ = "0.1.0"

__all__ = [
    "Format",
    "ScaledArray",
    "ScalifyError",
    "as_scaled_array",
    "asarray",
    "formats",
    "is_scaled_array",
    "ops",
    "register_rule",
    "scalify",
]
