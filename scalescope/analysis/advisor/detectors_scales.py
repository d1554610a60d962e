"""The scale rules: ``drift``, an op's data RMS leaves the band of the format it is
held in (`drift_bounds`, `_drift_findings`), and ``trend``, a least-squares fit of its
log2 rms leaves that band before the horizon (`_trend_findings`)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from .. import delayed
from ..thresholds import Thresholds, _format_info
from .cells import _Cells, _Dense, _hit_rows, _hits
from .text import _LOW_PRECISION, _num, _signed, _steps_text

#: E4M3's edges (log2 of its max and of its smallest subnormal): `Thresholds.drift_log2`
#: is a bound on |log2 rms| for E4M3 data, and every other format gets the same margins
#: from its own edges (`drift_bounds`).
_E4M3_TOP = math.log2(448.0)
_E4M3_BOTTOM = -9.0


def drift_bounds(fmt: str, drift_log2: float = 4.0) -> tuple[float, float]:
    """The band of log2 rms a value held in format ``fmt`` may drift in without a
    finding: ``±drift_log2`` for E4M3, and for a wider format the same margins from its
    own max and smallest subnormal (e5m2 -11 .. +11, fp16 -19 .. +11.2, bf16 -128 ..
    +123.2): FP16 data at RMS 2^-7 keeps 12 binades above its smallest subnormal, where
    E4M3 data would flush. ``(-inf, inf)`` for an unknown format."""
    info = _format_info(fmt, None)
    top, tiny = info.get("max"), info.get("min_subnormal")
    if not top or not tiny:
        return -math.inf, math.inf
    lower = math.log2(float(tiny)) + (-drift_log2 - _E4M3_BOTTOM)
    upper = math.log2(float(top)) - (_E4M3_TOP - drift_log2)
    return lower, upper


def _drift_band(table: pd.DataFrame, ids: np.ndarray, drift_log2: float) -> np.ndarray:
    """Per op of ``ids``: ``(lower, upper)`` drift bounds (`drift_bounds`) of the format
    its data is judged in: the format it is cast to, else its own dtype's."""
    cast = table["cast_to"].reindex(ids).fillna("").astype(str).to_numpy()
    dtype = table["dtype"].reindex(ids).fillna("").astype(str).map(_LOW_PRECISION)
    fmt = np.where(cast != "", cast, dtype.fillna("").to_numpy())
    band = {f: drift_bounds(f, drift_log2) for f in set(fmt.tolist())}
    return np.array([band[f] for f in fmt], np.float64).reshape(len(ids), 2)


def _drift_findings(
    cells: _Cells | _Dense, band: np.ndarray, thresholds: Thresholds
) -> list[dict[str, Any]]:
    """``band``: per op of ``cells.ids``, its drift bounds (``(-inf, inf)``: not judged)."""
    l2 = cells.cols["log2_rms"]
    lo, hi = band[:, 0], band[:, 1]
    if not isinstance(cells, _Dense):  # op-major rows
        lo, hi = np.repeat(lo, cells.sizes), np.repeat(hi, cells.sizes)
    with np.errstate(invalid="ignore"):
        excess = np.maximum(l2 - hi, lo - l2)
        mask = excess > 0
    rows = []
    for op, first, k, _, at in _hit_rows(_hits(cells, excess, mask, "max")):
        n = int(cells.sizes[np.searchsorted(cells.ids, op)])
        v = cells.at("log2_rms", op, int(at))
        lower, upper = band[int(np.searchsorted(cells.ids, op))]
        bound = upper if v > upper else lower
        text = (
            f"log2 rms of the data reaches {_signed(v)} (rms {_num(2.0**v)}) at step "
            f"{at}, beyond {bound:+.3g}"
        )
        rows.append(
            dict(
                op=op,
                rule="drift",
                format="",
                first_step=first,
                steps=k,
                value=v,
                threshold=float(bound),
                evidence=f"{text}; {_steps_text(k, n, first)}.",
                _at=at,
            )
        )
    return rows


class _TrendFit(NamedTuple):
    """Per op with finite points: the least-squares sums of log2 rms against step, the
    last log2 rms over all its steps (NaN included), the last fitted step, and a
    function giving the fitted points ``(steps, log2 rms)`` of the k-th op."""

    ops: np.ndarray
    counts: np.ndarray
    xm: np.ndarray
    ym: np.ndarray
    sxx: np.ndarray
    syy: np.ndarray
    sxy: np.ndarray
    last: np.ndarray
    x_last: np.ndarray
    points: Any


def _trend_fit(cells: _Cells, drift_ops: np.ndarray) -> _TrendFit | None:
    """`_TrendFit` over op-major cells: one bincount per sum."""
    l2 = cells.cols["log2_rms"]
    used = cells.rows_of(drift_ops) & np.isfinite(l2)
    if used.all():  # every row: no gathers
        ops, x, y = cells.op, cells.step.astype(np.float64), l2
    else:
        rows_idx = np.flatnonzero(used)
        if not len(rows_idx):
            return None
        ops = cells.op[rows_idx]
        x = cells.step[rows_idx].astype(np.float64)
        y = l2[rows_idx]
    del used
    # last value of each op over *all* its steps (an op drifting now is not "in bound")
    last_all = l2[cells.starts + cells.sizes - 1]
    starts = delayed.group_starts(ops)
    uniq, counts = ops[starts], np.diff(np.r_[starts, len(ops)])
    codes = np.repeat(np.arange(len(uniq)), counts)
    xm = np.bincount(codes, weights=x) / counts
    ym = np.bincount(codes, weights=y) / counts
    dx, dy = x - xm[codes], y - ym[codes]
    prod = np.multiply(dx, dx)  # one buffer for the three products
    sxx = np.bincount(codes, weights=prod)
    sxy = np.bincount(codes, weights=np.multiply(dx, dy, out=prod))
    syy = np.bincount(codes, weights=np.multiply(dy, dy, out=prod))
    del prod, dx, dy, codes
    ends = starts + counts - 1

    def points(k: int) -> tuple[np.ndarray, np.ndarray]:
        return x[starts[k] : ends[k] + 1], y[starts[k] : ends[k] + 1]

    last = last_all[np.searchsorted(cells.ids, uniq)]
    return _TrendFit(uniq, counts, xm, ym, sxx, syy, sxy, last, x[ends], points)


def _trend_fit_dense(cells: _Dense, drift_ops: np.ndarray) -> _TrendFit | None:
    """`_TrendFit` over steps x ops: the same sums, accumulated step by step (the order
    of the op-major bincounts, so the same numbers) with one vector per step, no copy of
    the steps x ops values."""
    l2 = cells.cols["log2_rms"]
    drift = np.isin(cells.ids, drift_ops)
    x = cells.steps.astype(np.float64)
    n = len(cells.ids)
    counts = np.zeros(n, np.int64)
    sx, sy = np.zeros(n), np.zeros(n)
    x_last = np.full(n, np.nan)
    finite = [np.isfinite(row) & drift for row in l2]
    for xi, row, ok in zip(x, l2, finite):
        counts += ok
        sx += np.where(ok, xi, 0.0)
        sy += np.where(ok, row, 0.0)
        x_last = np.where(ok, xi, x_last)
    has = counts > 0
    if not has.any():
        return None
    with np.errstate(divide="ignore", invalid="ignore"):
        xm, ym = sx / counts, sy / counts
    sxx, syy, sxy = np.zeros(n), np.zeros(n), np.zeros(n)
    for xi, row, ok in zip(x, l2, finite):
        dx = np.where(ok, xi - xm, 0.0)
        dy = np.where(ok, row - ym, 0.0)
        sxx += dx * dx
        syy += dy * dy
        sxy += dx * dy
    cols = np.flatnonzero(has)

    def points(k: int) -> tuple[np.ndarray, np.ndarray]:
        j = cols[k]
        ok = np.isfinite(l2[:, j])
        return x[ok], l2[ok, j]

    pick = (cols,)
    return _TrendFit(
        cells.ids[cols],
        counts[pick],
        xm[pick],
        ym[pick],
        sxx[pick],
        syy[pick],
        sxy[pick],
        np.asarray(l2[-1, cols], np.float64),
        x_last[pick],
        points,
    )


def _trend_findings(
    cells: _Cells | _Dense, band: np.ndarray, thresholds: Thresholds, horizon: float
) -> list[dict[str, Any]]:
    """Least-squares line of log2 rms against step, per op with finite drift bounds in
    ``band`` (per op of ``cells.ids``; finite points only), projected out of its band."""
    drift_ops = cells.ids[np.isfinite(band).any(axis=1)]
    if isinstance(cells, _Dense):
        fit = _trend_fit_dense(cells, drift_ops)
    else:
        fit = _trend_fit(cells, drift_ops)
    if fit is None:
        return []
    xm, ym, sxx, syy, sxy = fit.xm, fit.ym, fit.sxx, fit.syy, fit.sxy
    lo, hi = band[np.searchsorted(cells.ids, fit.ops)].T
    with np.errstate(divide="ignore", invalid="ignore"):
        slope = sxy / sxx
        r2 = slope**2 * sxx / syy
        projected = ym + slope * (horizon - xm)
        candidate = (
            (fit.counts >= thresholds.trend_min_points)
            & (horizon > fit.x_last)
            & (fit.last >= lo)
            & (fit.last <= hi)
            & (sxx != 0)
            & (syy != 0)
            & ((projected > hi) | (projected < lo))
            & (r2 >= thresholds.trend_min_r2)
        )
    out = []
    for k in np.flatnonzero(candidate):
        target = float(hi[k] if projected[k] > hi[k] else lo[k])
        cross = xm[k] + (target - ym[k]) / slope[k]
        xs, ys = fit.points(k)
        text = (
            f"log2 rms of the data moves {slope[k]:+.3g}/step (from {_signed(ys[0])} at step "
            f"{int(xs[0])} to {_signed(ys[-1])} at step {int(xs[-1])}, R² {r2[k]:.2f}); the "
            f"fit crosses {target:+.3g} at step ~{int(round(cross))} and reaches "
            f"{_signed(projected[k])} at the horizon (step {int(horizon)})"
        )
        out.append(
            dict(
                op=int(fit.ops[k]),
                rule="trend",
                format="",
                first_step=int(xs[0]),
                steps=int(len(xs)),
                value=float(projected[k]),
                threshold=float(target),
                evidence=text + ".",
            )
        )
    return out
