"""Which ops a judgement concerns: values constant by construction are not judged.

Two kinds of recorded values say nothing about how well a model's numbers are scaled,
however extreme their statistics:

- **constants**: values computed from constants and integer inputs only, such as
  optax's bias corrections ``1 - b1**count`` and learning-rate schedules (the probe's
  ``origin == "constant"``);
- **fills**: values holding a large constant fill, such as an attention mask's -1e9 or
  ``finfo.min`` and what keeps it elementwise (softmax's ``s - max(s)``): their RMS is
  the fill's (``origin == "fill"``). Runs recorded before the probe marked origins fall
  back to magnitude: an op whose value abs-max (``absmax * scale``) reaches
  `FILL_MAGNITUDE` at some recorded step holds a fill standing for -inf.

Neither is ranked among the "worst ops", and neither raises drift, trend or delayed
findings. A format they are cast to (or audited against) still judges them: a -2.4e38
mask cast to fp16 turns into -inf, which is a finding.

A third kind is judged by its formats only: **self-scaled casts**, the values of code
that scales into a narrow format itself, ``clip(x / s, -448, 448).astype(e4m3)`` (Flax's
``fp8_ops``, qwix, AQT; the probe's ``origin == "scaled_cast"``). Their RMS sits near the
format's max by design, where the code's own scale puts it, so drift, trend and delayed
scaling say nothing of them; what the clip saturates (their overflow) and what the cast
rounds away do.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

#: Finite magnitudes from which a value is taken for a mask fill standing for -inf
#: (``jnp.finfo(float16).min`` is -65504, far below; ``-1e30`` and ``finfo(float32).min``
#: are above).
FILL_MAGNITUDE = 1e30

#: The probe's ``origin`` values of ops constant by construction.
CONSTANT_ORIGINS = ("constant", "fill")
#: The probe's ``origin`` of the values of code that scales into a format itself.
SELF_SCALED_ORIGINS = ("scaled_cast",)


def value_absmax(stats: pd.DataFrame) -> np.ndarray:
    """Per row: the value's abs-max, ``absmax * scale`` (``absmax`` alone without a
    ``scale`` column), float64; NaN where ``absmax`` is not recorded."""
    if "absmax" not in stats.columns:
        return np.full(len(stats), np.nan)
    amax = np.abs(stats["absmax"].to_numpy(np.float64))
    if "scale" in stats.columns:
        with np.errstate(invalid="ignore", over="ignore"):
            amax = amax * np.abs(stats["scale"].to_numpy(np.float64))
    return amax


def fill_rows(stats: pd.DataFrame, values: np.ndarray | None = None) -> np.ndarray:
    """Per row of a wide statistics frame: whether it is, or comes from, a mask fill
    value: the metric ``values`` (optional) or the op's value abs-max is finite and at
    least `FILL_MAGNITUDE` in magnitude."""
    out = np.zeros(len(stats), bool)
    with np.errstate(invalid="ignore", over="ignore"):
        if values is not None:
            v = np.abs(np.asarray(values, np.float64))
            out |= np.isfinite(v) & (v >= FILL_MAGNITUDE)
        amax = value_absmax(stats)
        out |= np.isfinite(amax) & (amax >= FILL_MAGNITUDE)
    return out


def constant_ops(ops: pd.DataFrame, stats: pd.DataFrame | None = None) -> np.ndarray:
    """Sorted op ids constant by construction (module docstring): the op table's
    ``origin`` is "constant" or "fill", or, for a run recorded without origins, the op's
    rows in ``stats`` hold a fill of magnitude `FILL_MAGNITUDE` or more."""
    ids: list[np.ndarray] = []
    if "origin" in ops.columns:
        origin = ops["origin"].fillna("").astype(str)
        ids.append(ops.index.to_numpy(np.int64)[origin.isin(CONSTANT_ORIGINS).to_numpy()])
    elif stats is not None and len(stats) and "op" in stats.columns:
        rows = fill_rows(stats)
        ids.append(np.unique(stats["op"].to_numpy(np.int64)[rows]))
    if not ids:
        return np.zeros(0, np.int64)
    return np.unique(np.concatenate(ids)).astype(np.int64)


def self_scaled_ops(ops: pd.DataFrame) -> np.ndarray:
    """Sorted op ids of self-scaled casts (module docstring): a clip at a narrow format's
    max that a cast to that format reads (measured before the clip: its overflow is the
    share clipped), and that cast."""
    if "origin" not in ops.columns:
        return np.zeros(0, np.int64)
    origin = ops["origin"].fillna("").astype(str)
    return np.sort(ops.index.to_numpy(np.int64)[origin.isin(SELF_SCALED_ORIGINS).to_numpy()])


def judged(ops: pd.DataFrame, stats: pd.DataFrame | None = None) -> pd.Series:
    """Per op id of ``ops``: True when its scale is judged (not `constant_ops`)."""
    out = pd.Series(True, index=ops.index, name="judged")
    out[out.index.isin(constant_ops(ops, stats))] = False
    return out
