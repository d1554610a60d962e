"""Number formats scalescope audits against: FP8 (E4M3, E5M2, and the fnuz variants AMD's
MI300 casts to: no negative zero or infinity, one exponent more, E4M3FNUZ's max 240),
FP16, BF16 and FP32.

Every constant is read from `ml_dtypes.finfo`, so the figures are those of the dtypes
JAX actually casts to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np


@dataclass(frozen=True)
class Format:
    """A floating-point format: its dtype and the limits that decide under/overflow."""

    name: str
    dtype: np.dtype
    max: float
    min_normal: float
    min_subnormal: float
    mantissa_bits: int
    exponent_bits: int

    @property
    def min_exponent(self) -> int:
        """Exponent of the smallest normal number (``min_normal == 2**min_exponent``)."""
        return int(np.log2(self.min_normal))

    @property
    def max_exponent(self) -> int:
        """Exponent of the largest finite number (``floor(log2(max))``)."""
        return int(np.floor(np.log2(self.max)))


def _from_dtype(name: str, dtype) -> Format:
    dtype = np.dtype(dtype)
    info = ml_dtypes.finfo(dtype)
    return Format(
        name=name,
        dtype=dtype,
        max=float(info.max),
        min_normal=float(info.smallest_normal),
        min_subnormal=float(info.smallest_subnormal),
        mantissa_bits=int(info.nmant),
        exponent_bits=int(info.nexp),
    )


FORMATS: dict[str, Format] = {
    "e4m3": _from_dtype("e4m3", ml_dtypes.float8_e4m3fn),
    "e5m2": _from_dtype("e5m2", ml_dtypes.float8_e5m2),
    "fp16": _from_dtype("fp16", np.float16),
    "bf16": _from_dtype("bf16", ml_dtypes.bfloat16),
    "fp32": _from_dtype("fp32", np.float32),
    "e4m3fnuz": _from_dtype("e4m3fnuz", ml_dtypes.float8_e4m3fnuz),
    "e5m2fnuz": _from_dtype("e5m2fnuz", ml_dtypes.float8_e5m2fnuz),
}

_ALIASES = {
    "float8_e4m3fn": "e4m3",
    "float8_e5m2": "e5m2",
    "float16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
    "float32": "fp32",
    "float8_e4m3fnuz": "e4m3fnuz",
    "float8_e5m2fnuz": "e5m2fnuz",
}


def names() -> tuple[str, ...]:
    return tuple(FORMATS)


def get(name) -> Format:
    """Look a format up by its short name (``"e4m3"``), dtype name or dtype."""
    if isinstance(name, Format):
        return name
    if not isinstance(name, str):
        try:
            name = np.dtype(name).name
        except TypeError as err:
            raise KeyError(f"not a format name or dtype: {name!r}") from err
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in FORMATS:
        raise KeyError(f"unknown format {name!r}; known formats: {', '.join(FORMATS)}")
    return FORMATS[key]


#: Narrow float dtypes whose largest value marks code that scales values into the format
#: itself: ``clip(x / s, -max, max).astype(dtype)`` (qwix, AQT, Flax's ``fp8_ops``, MX
#: emulations). A clip at one of these bounds is such code's, not the model's.
SELF_SCALED_DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(t)
    for t in (
        ml_dtypes.float8_e4m3fn,
        ml_dtypes.float8_e4m3fnuz,
        ml_dtypes.float8_e5m2,
        ml_dtypes.float8_e5m2fnuz,
        ml_dtypes.float4_e2m1fn,
        np.float16,
    )
)
#: The largest finite values of `SELF_SCALED_DTYPES`.
FORMAT_MAXIMA: frozenset[float] = frozenset(
    float(ml_dtypes.finfo(t).max) for t in SELF_SCALED_DTYPES
)


def format_bound(x: Any) -> float | None:
    """``|x|`` when ``x`` is a static scalar (NumPy or Python, known at trace time) whose
    magnitude is one of `FORMAT_MAXIMA`: a clip bound of code that scales into a format
    itself. Else None."""
    if isinstance(x, bool) or not isinstance(x, (np.ndarray, np.generic, float, int)):
        return None
    if np.ndim(x) != 0:
        return None
    bound = abs(float(x))
    return bound if bound in FORMAT_MAXIMA else None


def narrow_max(dtype) -> float | None:
    """The largest finite value of ``dtype`` when it is one of `SELF_SCALED_DTYPES`,
    else None."""
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        return None
    return float(ml_dtypes.finfo(dtype).max) if dtype in SELF_SCALED_DTYPES else None


def narrower_than_float32(dtype) -> bool:
    """A float dtype with less range than float32 (FP16, FP8, FP4): where an overflow
    is the usual cause of an Inf, and data must not grow. False for float32, bfloat16,
    float64 and for dtypes that are not floats."""
    try:
        return bool(ml_dtypes.finfo(dtype).maxexp < np.finfo(np.float32).maxexp)
    except (TypeError, ValueError):
        return False
