"""The format rules: ``overflow``, ``underflow`` and ``snr`` of an op against each
format or block-scaled recipe it is checked against (`_format_findings`), and the limits
of a format their evidence quotes (`rounding_edge`, `format_span`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..percent import pct
from ..thresholds import Thresholds, _format_info, recipe_element
from .cells import _Cells, _compare, _Dense, _hit_rows, _hits
from .detectors_nonfinite import _finite_output_steps, _op_steps
from .text import _num, _steps_text


def _format_findings(
    cells: _Cells | _Dense,
    checked: dict[str, np.ndarray],
    thresholds: Thresholds,
    meta: Mapping[str, Any] | None,
    outputs: np.ndarray | None = None,
    gradients: np.ndarray | None = None,
    clipped: np.ndarray | None = None,
) -> list[dict[str, Any]]:
    """Findings of the format rules per format or recipe of ``checked`` (op ids each);
    ``gradients``: the backward ops, which a recipe holds to `Thresholds.recipe_limits`
    with ``gradient=True``; ``outputs``: the step's output ops (a handled overflow);
    ``clipped``: self-scaled casts (`scalescope.analysis.relevance.self_scaled_ops`),
    whose overflow the code's clip saturates."""
    rows: list[dict[str, Any]] = []
    finite_out = (
        _finite_output_steps(cells, np.asarray(outputs, np.int64))
        if outputs is not None
        else np.zeros(0, np.int64)
    )
    for fmt, all_ids in checked.items():
        split = gradients is not None and recipe_element(fmt) is not None
        grad = np.isin(all_ids, gradients) if split else np.zeros(len(all_ids), bool)
        for gradient in (False, True):
            ids = all_ids[grad == gradient]
            if len(ids):
                rows += _findings_of(
                    cells,
                    fmt,
                    ids,
                    thresholds,
                    meta,
                    finite_out,
                    gradient=gradient,
                    clipped=clipped,
                )
    return rows


def _findings_of(
    cells: _Cells | _Dense,
    fmt: str,
    ids: np.ndarray,
    thresholds: Thresholds,
    meta: Mapping[str, Any] | None,
    finite_out: np.ndarray,
    *,
    gradient: bool,
    clipped: np.ndarray | None = None,
) -> list[dict[str, Any]]:
    """The format rules' findings of ops ``ids`` against ``fmt``. The overflow of a
    ``clipped`` op (a self-scaled cast, measured before its clip) is what the code's clip
    saturates; it is not judged at steps where it stays within a binade of the max (each
    clipped element keeps over half of itself: delayed scaling a step behind a growing
    amax does this at every step the amax grows), and its SNR not where it clips."""
    clipped = np.zeros(0, np.int64) if clipped is None else np.asarray(clipped, np.int64)
    rows: list[dict[str, Any]] = []
    sel = cells.rows_of(ids)
    info = _format_info(fmt, meta)
    limit = info.get("max")
    tiny = info.get("min_subnormal")
    snr_thr, under_thr = thresholds.recipe_limits(fmt, meta, gradient=gradient)
    over = thresholds.overflow_for(fmt)
    rules = (
        ("overflow", f"overflow_{fmt}", "max", over, "gt"),
        ("underflow", f"underflow_{fmt}", "max", under_thr, "gt"),
        ("snr", f"snr_{fmt}", "min", snr_thr, "lt"),
    )
    edge = rounding_edge(info) if recipe_element(fmt) is None else math.nan
    handled: dict[int, np.ndarray] = {}  # op -> the steps of its handled overflow
    clipping: dict[int, np.ndarray] = {}  # self-scaled op -> the steps the code clips at
    for rule, col, worst, thr, how in rules:
        values = cells.cols[col]
        mask = _compare(values, how, thr) & sel
        if rule == "overflow" and len(clipped) and "absmax" in cells.cols and limit:
            with np.errstate(invalid="ignore"):
                mild = cells.cols["absmax"] < 2.0 * float(limit)
            mask = mask & ~(cells.rows_of(clipped) & mild)
        peaks = {}
        if rule == "overflow" and math.isfinite(edge) and "absmax" in cells.cols:
            hits = _hit_rows(_hits(cells, cells.cols["absmax"], mask, "max"))
            peaks = {op: peak for op, _, _, peak, _ in hits}
        for op, first, k, v, at in _hit_rows(_hits(cells, values, mask, worst)):
            n = int(cells.sizes[np.searchsorted(cells.ids, op)])
            # every overflowing element under the edge rounds to the max (an abs-max
            # not above the max disagrees with the overflow: no claim then)
            saturated = bool(limit < peaks.get(op, math.inf) < edge) if peaks else False
            contained = False
            clips = rule == "overflow" and op in clipped
            if clips:
                saturated = False
                clipping[op] = _op_steps(cells, op, mask)
                text = (
                    f"{pct(v)} of values exceed {fmt}'s max ({_num(limit)}) at step {at}, "
                    f"largest {_num(peaks.get(op, math.nan))}: the code clips them to "
                    f"±{_num(limit)} before its cast (the scale it divides by is too small "
                    "for them)"
                )
            elif rule == "overflow":
                bound = f" (|x| > {_num(limit)})" if limit else ""
                text = f"{pct(v)} of values overflow {fmt}{bound} at step {at}"
                if saturated:
                    text += (
                        f", none beyond {_num(edge)} (largest {_num(peaks[op])}): they "
                        f"round to ±{_num(limit)}, not to inf/NaN, but no headroom is left"
                    )
                elif math.isfinite(edge):
                    contained = _handled(cells, op, mask, finite_out, k, n)
                    if contained:
                        handled[op] = _op_steps(cells, op, mask)
                if contained:
                    text += (
                        "; dropped downstream: the step's outputs (parameters, optimizer "
                        "state, loss) stay finite at those steps, at a minority of the "
                        "recorded ones (a dynamic loss scaler probing upward skips such "
                        "a step and halves its scale)"
                    )
            elif rule == "underflow":
                bound = f" (|x| < {_num(tiny)})" if tiny else ""
                text = f"{pct(v)} of non-zero values flush to zero in {fmt}{bound} at step {at}"
                wide = _too_wide(cells, op, at, info)
                if wide is not None:
                    text += (
                        f"; its dynamic range, {wide[0]:.1f} octaves, is wider than "
                        f"{fmt}'s {wide[1]:.1f} (max to smallest subnormal): no single "
                        "scale keeps every element"
                    )
            else:
                text = f"SNR in {fmt} falls to {v:.1f} dB (threshold {thr:g} dB) at step {at}"
                # lost only at the steps of a handled overflow: that overflow's inf
                contained = op in handled and bool(
                    np.isin(_op_steps(cells, op, mask), handled[op]).all()
                )
                if contained:
                    text += ", only where it overflows and the step drops the inf"
                elif op in clipping and np.isin(_op_steps(cells, op, mask), clipping[op]).all():
                    # lost to the code's clip, which the overflow finding names
                    contained = True
                    text += ", only where the code clips it (its overflow finding)"
            rows.append(
                dict(
                    op=op,
                    rule=rule,
                    format=fmt,
                    first_step=first,
                    steps=k,
                    value=v,
                    threshold=float(thr),
                    evidence=f"{text}; {_steps_text(k, n, first)}.",
                    _at=at,
                    _saturated=saturated,
                    _contained=contained,
                    _clipped=clips,
                )
            )
    return rows


def _handled(
    cells: _Cells | _Dense, op: int, mask: np.ndarray, finite_out: np.ndarray, k: int, n: int
) -> bool:
    """An overflow the step handles: at every recorded step where ``op`` overflows
    (``mask``), the step's outputs are finite (`_finite_output_steps`: the inf was
    discarded, as a dynamic loss scaler discards the update of a step whose gradients
    overflowed), and it overflows at no more than half of the ``n`` recorded steps
    (``k``): a scaler that overflows at most steps never trains."""
    if not len(finite_out) or 2 * k > n:
        return False
    return bool(np.isin(_op_steps(cells, op, mask), finite_out).all())


def rounding_edge(info: Mapping[str, Any]) -> float:
    """The magnitude from which a plain cast to a format gives inf (NaN in e4m3fn): its
    max plus half a unit in the last place (464 for e4m3, 61440 for e5m2, 65520 for
    fp16); values between the max and this edge round to the max. NaN when the limits
    are unknown."""
    top, bits = info.get("max"), info.get("mantissa_bits")
    if not top or bits is None:
        return math.nan
    return float(top) + 2.0 ** (math.floor(math.log2(float(top))) - int(bits) - 1)


def format_span(info: Mapping[str, Any]) -> float:
    """Octaves from a format's max down to its smallest subnormal (17.8 for e4m3): the
    widest dynamic range one scale can keep without flushing or clipping; NaN when the
    limits are unknown (a block-scaled recipe has per-block scales, no single span)."""
    top, tiny = info.get("max"), info.get("min_subnormal")
    if not top or not tiny:
        return math.nan
    return math.log2(float(top)) - math.log2(float(tiny))


def _too_wide(
    cells: _Cells | _Dense, op: int, step: int, info: Mapping[str, Any]
) -> tuple[float, float] | None:
    """``(dynamic range, format span)`` when the op's recorded dynamic range at ``step``
    is wider than the format's span, else None (also when it was not recorded)."""
    if "dynamic_range" not in cells.cols:
        return None
    span = format_span(info)
    octaves = cells.at("dynamic_range", op, int(step))
    return (octaves, span) if octaves > span else None
