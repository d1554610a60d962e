"""Core types: `ScaledArray`, number formats and power-of-two helpers."""

from . import formats
from .formats import Format
from .pow2 import (
    Pow2Round,
    pow2_round,
    pow2_round_down,
    pow2_round_nearest,
    pow2_round_up,
    static_pow2_round_down,
)
from .scaled_array import SCALE_DTYPE, ScaledArray, as_scaled_array, asarray, is_scaled_array

__all__ = [
    "SCALE_DTYPE",
    "Format",
    "Pow2Round",
    "ScaledArray",
    "as_scaled_array",
    "asarray",
    "formats",
    "is_scaled_array",
    "pow2_round",
    "pow2_round_down",
    "pow2_round_nearest",
    "pow2_round_up",
    "static_pow2_round_down",
]
