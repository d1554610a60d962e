"""Masks: ops whose non-finite values are there by construction, not a failure (the
``-inf`` logits of a causal mask before a softmax). `mask_ops`: the same non-finite
fraction (< 1) at every recorded step; `fill_ops`: the ops the probe saw hold a constant
fill. The advisor's nonfinite rule, the format what-if and the report skip them. A leaf
of the analysis: it imports no other analysis module."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd


def mask_ops(values: pd.Series, min_steps: int, fills: Any = ()) -> np.ndarray:
    """Op ids whose non-finite fraction (``values``: indexed by (op, step), one value per
    recorded step) is the same, non-zero and below 1, at every recorded step (at least
    ``min_steps`` of them; one for the ops of ``fills``, which the probe saw mix a
    constant fill such as -inf into a value): masks, which the nonfinite rule skips (see
    `Thresholds.mask_min_steps`)."""
    by_op = values.groupby(level="op")
    lo, hi, n = by_op.min(), by_op.max(), by_op.size()
    need = np.where(lo.index.isin(np.asarray(list(fills))), 1, min_steps)
    steady = (n >= need) & (lo > 0) & (hi < 1) & ((hi - lo) <= 1e-12)
    return steady.index.to_numpy()[steady.to_numpy()]


def fill_ops(ops: pd.DataFrame) -> np.ndarray:
    """Op ids the probe saw hold a constant fill (``origin == "fill"``)."""
    if "origin" not in ops.columns:
        return np.zeros(0, np.int64)
    return ops.index.to_numpy(np.int64)[ops["origin"].fillna("").astype(str).eq("fill")]
