"""scalescope: see what low precision does to every primitive of a JAX training step."""

from . import ops
from .core import formats
from .core.formats import Format
from .core.scaled_array import ScaledArray, as_scaled_array, asarray, is_scaled_array
from .probe import OpRecord, OpTable, instrument, stats_frame
from .scalify import ScalifyError, register_rule, scalify

__version__ = "0.1.0"

__all__ = [
    "Format",
    "OpRecord",
    "OpTable",
    "ScaledArray",
    "ScalifyError",
    "as_scaled_array",
    "asarray",
    "formats",
    "instrument",
    "is_scaled_array",
    "ops",
    "register_rule",
    "scalify",
    "stats_frame",
]
