"""The text of the advisor's findings: numbers in evidence sentences (`_num`,
`_signed`, `_steps_text`), the evidence of the ``delayed`` rule (`_delayed_text`), and
the one-line fixes (`fix_line`, `delayed_fix_line`) with the formats and recipes they
name."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .. import delayed
from ..thresholds import recipe_element

# -- numbers in evidence ----------------------------------------------------------------


def _num(value: float) -> str:
    return f"{value:.3g}"


def _signed(value: float) -> str:
    return f"{value:+.1f}"


def _steps_text(k: int, n: int, first: int) -> str:
    if n == 1:
        return f"at step {first}, the only recorded step"
    return f"at {k} of {n} recorded steps (first at step {first})"


# -- fixes -------------------------------------------------------------------------------

# dtype of an op -> the low-precision format it is stored in (named in a fix without one)
_LOW_PRECISION = {
    "float8_e4m3fn": "e4m3",
    "float8_e5m2": "e5m2",
    "float16": "fp16",
    "bfloat16": "bf16",
}
# a format -> the one to keep a value in when it needs more range (underflow at unit
# scale) or more mantissa (SNR at unit scale) than the format has
_MORE_RANGE = {
    "e4m3": "e5m2",
    "e5m2": "bf16",
    "e4m3fnuz": "e5m2fnuz",
    "e5m2fnuz": "bf16",
    "fp16": "bf16",
    "bf16": "fp32",
}
_MORE_MANTISSA = {
    "e5m2": "e4m3",
    "e4m3": "bf16",
    "e5m2fnuz": "e4m3fnuz",
    "e4m3fnuz": "bf16",
    "bf16": "fp16",
    "fp16": "fp32",
}
#: Recipe a naive-cast finding suggests when no recorded recipe statistics say better:
#: current (per-tensor) scaling against overflow, MX block scaling otherwise.
SUGGESTED_RECIPE = {"overflow": "e4m3_tensor"}
DEFAULT_RECIPE = "mxfp8_e4m3"
#: An op at least this many binades off unit scale (|log2 rms|) where an underflow or SNR
#: finding is worst is fixed by rescaling; closer to unit scale, rescaling cannot help.
RESCALE_LOG2 = 1.0


def _where(op: Mapping[str, Any]) -> str:
    source = str(op["source"])
    return source if source and not source.startswith("<") else str(op["label"])


def _rescale(op: Mapping[str, Any], kind: str) -> str:
    """``ss.ops.dynamic_rescale_<kind>`` after a forward/optimizer value, ``_<kind>_grad``
    before the forward value whose gradient a backward value is."""
    where = _where(op)
    if op["pass"] == "bwd":
        return f"x = ss.ops.dynamic_rescale_{kind}_grad(x)  # before {where}"
    return f"x = ss.ops.dynamic_rescale_{kind}(x)  # after {where}"


def _recipe_text(rule: str, recipe: str | None, recorded: Sequence[str] = ()) -> str:
    """``or <recipe>`` for a naive-cast fix: ``recipe`` when the recorded statistics show
    it safe for the op; "" when recipes (``recorded``) were recorded and none is safe;
    None when none was recorded: a suggestion."""
    if recipe:
        return f"; or the {recipe} recipe (safe for this op in the recorded statistics)"
    if recipe == "":
        names = ", ".join(recorded)
        return f" (no recorded recipe{' (' + names + ')' if names else ''} is safe for it)"
    name = SUGGESTED_RECIPE.get(rule, DEFAULT_RECIPE)
    return f'; or a block-scaled recipe such as {name} (record formats=("{name}",) to check it)'


def _loss_scaling_text(
    op: Mapping[str, Any], rule: str, log2_rms: float, fmt: str, headroom: float = math.inf
) -> str:
    """``; or loss scaling ...`` for a backward value that underflows off unit scale
    (``log2_rms`` below -`RESCALE_LOG2`, or unknown), or whose scale drifts down there
    (``drift``/``trend`` of a naive FP16 gradient, flushed before a cast): multiplying
    the loss by 2**k lifts every gradient by 2**k, which is how naive FP16 training
    keeps gradients in range. k
    lifts this value's RMS to 1, at most ``headroom`` (log2 of how far the largest
    gradient held in ``fmt`` is below its max: one loss scale moves them all). "" for
    any other finding, for a gradient near unit scale, and when no 2**k fits."""
    if rule not in ("underflow", "drift", "trend") or op["pass"] != "bwd":
        return ""
    if rule != "underflow" and not log2_rms < -RESCALE_LOG2:
        return ""  # a scale drift upward (or unknown) is no case for loss scaling
    room = math.floor(headroom) if math.isfinite(headroom) else None
    if room is not None and room < 1:
        return ""  # the largest gradient already fills the format: no loss scale fits
    if math.isnan(log2_rms):
        most = f", at most 2**{room}" if room is not None else ""
        return f"; or loss scaling (the loss times 2**k{most}, the gradients divided by 2**k)"
    if not log2_rms < -RESCALE_LOG2:
        return ""
    want = round(-log2_rms)
    k = want if room is None else min(want, room)
    why = f"this gradient's RMS is 2**{-want}"
    if k < want:
        why += f"; a larger scale would overflow the largest gradient in {fmt or 'its format'}"
    how = f"the loss times 2**{k}, the gradients divided by it"
    return f"; or loss scaling by 2**{k} ({how}: {why})"


#: an epsilon optimizers add to a denominator (Adam's ``sqrt(nu) + eps``)
_TYPICAL_EPS = 1e-8


def _optimizer_in_fp32(where: str, dtype: str) -> str:
    """The fix for an optimizer op that makes NaN/inf in ``dtype`` (a low-precision
    parameter dtype): the optimizer's arithmetic in fp32. In a dtype whose smallest value
    is above Adam's 1e-8 (float16, FP8), the epsilon is 0 and a zero second moment
    divides by it; ``jax_debug_nans`` would only stop there."""
    fix = (
        f"keep the optimizer in fp32 at {where}: its state and update in float32 (fp32 "
        f"master weights, cast to {dtype} for the step)"
    )
    try:
        tiny = float(np.finfo(np.dtype(dtype)).smallest_subnormal)
    except TypeError:  # a dtype NumPy does not know (ml_dtypes not imported)
        tiny = 0.0
    if tiny > _TYPICAL_EPS:
        fix += (
            f", or an epsilon {dtype} holds (its smallest value is {tiny:.2g}: Adam's "
            f"eps=1e-8 is 0 there, and a zero second moment divides by it)"
        )
    return fix


def fix_line(
    op: Mapping[str, Any],
    fmt: str,
    scalified: bool,
    rule: str = "drift",
    *,
    recipe: str | None = None,
    log2_rms: float = math.nan,
    origin: Mapping[str, Any] | None = None,
    recorded: Sequence[str] = (),
    too_wide: bool = False,
    headroom: float = math.inf,
    peak: float = math.nan,
) -> str:
    """The one-line fix for a ``rule`` finding on ``op`` (a row of the op table with a
    ``label``), naming the op's source line.

    An underflow of a value whose dynamic range is wider than the format's span
    (``too_wide``: `format_span`) is not fixed by any one scale, rescaled or not: a
    block-scaled recipe (per-block scales) or a format with more range.

    Under scalify (``scalified``: the run or the op): drift and trend,
    ``dynamic_rescale_l2`` after a forward/optimizer value, ``dynamic_rescale_l2_grad``
    for a backward value on the forward value whose gradient it is (so *before* the
    source line that produced it); overflow, ``dynamic_rescale_max`` (``_max_grad``);
    underflow and snr, the l2 rescale when the value is more than `RESCALE_LOG2` binades
    off unit scale where the rule is worst (``log2_rms``), else a format with more range
    (underflow) or more mantissa (snr) than ``fmt``, or a block-scaled recipe. Without
    scalify (naive casts): run the step under scalify, or use ``recipe`` (the cheapest
    recipe the recorded statistics show safe for the op; "": the recipes ``recorded``
    were, none is safe; None: none were recorded, a suitable one is suggested); a backward
    underflow also offers loss scaling (`_loss_scaling_text`; ``headroom``: how far the
    largest gradient in ``fmt`` may be lifted). ``nonfinite``: the
    earliest op with NaN/inf (``origin`` None) gets ``jax_debug_nans``, or, in the
    optimizer in a low-precision dtype, fp32 optimizer arithmetic; a later one
    (``origin``: the earliest op's row) points to it. A finding on a block-scaled recipe
    ``fmt`` names the recipe that would do better. ``peak``: a self-scaled cast's abs-max
    over its format's max where the finding is worst (`_self_scaled_fix`)."""
    where = _where(op)
    if rule == "nonfinite":
        if origin is not None and origin["label"] != op["label"]:
            at = _where(origin)
            at = "" if at == origin["label"] else f" at {at}"  # an input has no line
            return f"fix the earliest op with NaN/inf first: {origin['label']}{at}"
        dtype = str(op.get("dtype", ""))
        if op.get("pass") == "opt" and dtype in _LOW_PRECISION:
            return _optimizer_in_fp32(where, dtype)
        if op.get("pass") == "input":
            return (
                f"find the step that made it: the NaN/inf is already in the step's inputs "
                f"({op['label']}), made by an earlier step that was not recorded (or it is in "
                "the data); record every step before it (Run(every=1) from a checkpoint), or "
                "let the flight recorder replay the first bad step (it cannot with "
                "donate_argnums)"
            )
        return f'jax.config.update("jax_debug_nans", True)  # stops at the first NaN: {where}'
    if rule == "stall":
        held = fmt or "its format"
        return (
            f"keep {op['name']} in fp32 and round it only for the matmuls that read it "
            f"(policy target '{held}@matmul'), or hold it in a format with more mantissa "
            f"than {held}"
        )
    element = recipe_element(fmt) if fmt else None
    if element is not None:  # a block-scaled recipe's own failure
        if rule == "overflow":
            return f"a recipe whose block scales never clip, e.g. mxfp8_e4m3_rceil, at {where}"
        what = "smaller blocks or a wider element" if rule == "underflow" else "more mantissa"
        if recipe and recipe != fmt:
            return f"{what} than {fmt} at {where}: the {recipe} recipe is safe for it"
        better = "fp8_block128" if rule == "underflow" else "mxfp8_e4m3"
        if better == fmt or (better == "mxfp8_e4m3" and element.mantissa_bits >= 3):
            better = "bf16"
        return f"{what} than {fmt} at {where}, e.g. {better}"
    if op.get("origin") == "scaled_cast":
        return _self_scaled_fix(where, fmt, rule, recipe, peak)
    if rule == "underflow" and too_wide:
        other = _MORE_RANGE.get(fmt, "fp32")
        block = recipe or DEFAULT_RECIPE
        return (
            f"cast {where} with the {block} recipe (a scale per block) or to {other}  # "
            f"its dynamic range is wider than {fmt or 'its format'} holds at any one scale"
        )
    if not scalified:
        what = f"naive {fmt} casts" if fmt else "naive low-precision casts"
        cast_at = str(op.get("cast_at") or "")
        if fmt and op.get("cast_to") == fmt and cast_at and not cast_at.startswith("<"):
            # the cast's own line, where the value is made elsewhere (`h = cast(x)`)
            where = cast_at if cast_at == where else f"{cast_at} (of {op['label']} at {where})"
        lift = _loss_scaling_text(op, rule, log2_rms, fmt, headroom)
        blocks = _recipe_text(rule, recipe, recorded)
        # "(no recorded recipe ... is safe)" qualifies the scalify line; a recipe is an "or"
        tail = f"{blocks}{lift}" if recipe == "" else f"{lift}{blocks}"
        return (
            f"run.track(step, scalify=True)  # scale-propagated casts instead of {what} at "
            f"{where}{tail}"
        )
    if rule == "overflow":
        return _rescale(op, "max")
    if rule in ("underflow", "snr") and not abs(log2_rms) > RESCALE_LOG2:
        table = _MORE_RANGE if rule == "underflow" else _MORE_MANTISSA
        need = "range" if rule == "underflow" else "mantissa"
        other = table.get(fmt, "fp32")
        also = "" if recipe == "" else f", or use the {recipe or DEFAULT_RECIPE} recipe"
        return (
            f"cast {where} to {other}{also}  # at unit scale it needs more {need} than "
            f"{fmt or 'its format'}"
        )
    return _rescale(op, "l2")


#: A self-scaled value whose abs-max sits this far under its format's max (4 binades) was
#: put there by a scale too large for it (a stale or fixed calibration range), not by a
#: scale that fits.
_SCALE_TOO_LARGE = 2.0**-4


def _self_scaled_fix(
    where: str, fmt: str, rule: str, recipe: str | None, peak: float = math.nan
) -> str:
    """The fix for a format finding on code that scales into ``fmt`` itself (a clip at
    its max, then the cast: Flax's ``fp8_ops``, qwix, AQT): its own scale is the lever,
    not scalify (which holds such a value as the code wrote it) nor a rescale. ``peak``:
    the value's abs-max over the format's max where the finding is worst (NaN: not
    recorded). Above 1 the code clips, so an SNR loss is the clip's; under
    `_SCALE_TOO_LARGE` the code's scale is too large for the value; only in between is a
    format or recipe the lever."""
    fmt = fmt or "its format"
    scale = (
        f"the scale the code divides by before its clip and {fmt} cast does not fit the "
        "value: take it from this step's amax (current scaling); with delayed scaling, a "
        "shorter amax history (algo='most_recent'); with a static or fixed-range scale, a "
        f"calibration that covers the data, at {where}"
    )
    if rule == "overflow":
        return scale
    if rule == "snr" and peak > 1.0:
        return f"{scale}  # it clips: the value's abs-max is {peak:.3g}x {fmt}'s max"
    if peak < _SCALE_TOO_LARGE:
        return (
            f"{scale}  # the code's scale puts the value's abs-max at {peak:.2g}x {fmt}'s "
            "max: too large a scale for it"
        )
    why = (
        f"  # the code's own scale puts the value's abs-max at {peak:.2g}x {fmt}'s max"
        if math.isfinite(peak)
        else ""
    )
    if rule == "underflow":
        block = recipe or DEFAULT_RECIPE
        return (
            f"a block-scaled recipe ({block}: a scale per block) or a format with more "
            f"range ({_MORE_RANGE.get(fmt, 'fp32')}) at {where}{why}"
        )
    return f"a format with more mantissa ({_MORE_MANTISSA.get(fmt, 'fp32')}) at {where}{why}"


def delayed_fix_line(op: Mapping[str, Any], history: int, scalified: bool) -> str:
    """The one-line fix for a ``delayed`` finding on ``op``: an amax history shorter than
    ``history`` or ``most_recent``, per-tensor current scaling (the ``e4m3_tensor``
    recipe: the scale from this step's amax), or dynamic rescaling of the value by its
    abs-max (under scalify: ``dynamic_rescale_max``; otherwise, scalify first)."""
    recipe = (
        f"amax history < {history} or algo='most_recent', or current scaling (e4m3_tensor recipe)"
    )
    if scalified:
        return f"{recipe}, or {_rescale(op, 'max')}"
    return f"{recipe}, or dynamic rescaling under run.track(step, scalify=True)  # at {_where(op)}"


# -- evidence of the delayed rule -------------------------------------------------------


def _steps_list(steps: np.ndarray, most: int = 5) -> str:
    shown = ", ".join(str(int(s)) for s in steps[:most])
    return f"steps {shown}" + (", …" if len(steps) > most else "")


def _delayed_text(
    amax: np.ndarray, step: np.ndarray, r: delayed.Replay, hit: np.ndarray, fmt: str, history: int
) -> tuple[str, int, float]:
    """Evidence of the ``delayed`` rule for one op's replayed rows: the worst step (amax
    furthest above the threshold), the steps that clip, the growth per recorded step and
    the recording gap. Returns ``(text, worst step, log2(amax / threshold) there)``."""
    with np.errstate(divide="ignore", invalid="ignore"):
        over = np.log2(amax / r.threshold)
        ratios = amax[1:] / amax[:-1]
    w = int(np.flatnonzero(hit)[np.argmax(over[hit])])
    hits = step[hit]
    growth = ratios[np.isfinite(ratios) & (ratios > 0)]
    grows = (
        f"; amax grows ×{np.median(growth):.3g} per recorded step (median)" if len(growth) else ""
    )
    gap = float(np.median(np.diff(step)))
    gap_text = (
        f", recorded every {gap:g} steps: the history spans ~{history * gap:g} training steps"
        if gap > 1
        else ""
    )
    text = (
        f"value amax {_num(amax[w])} at step {int(step[w])} is ×{_num(2.0 ** over[w])} the "
        f"delayed-scaling threshold {_num(r.threshold[w])} (max amax of the previous "
        f"{min(history, w)} recorded steps, history={history}); a whole binade above it "
        f"clips in {fmt} at {len(hits)} of {len(step)} recorded steps ({_steps_list(hits)})"
        f"{grows}{gap_text}."
    )
    return text, int(step[w]), float(over[w])
