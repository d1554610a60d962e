"""The limits ops are judged by, shared by the advisor (`scalescope.analysis.advisor`)
and the format what-if (`scalescope.analysis.whatif`): `Thresholds`, the default SNR
threshold of each format (`DEFAULT_SNR_DB`, `snr_from_mantissa`), and the limits of a
format or the element format of a block-scaled recipe (`recipe_element`). A leaf of the
analysis: it imports no other analysis module."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# SNR (dB) of each format on N(0, 1) data, measured once with numpy + ml_dtypes
# (4M samples, round-to-nearest-even cast, SNR = 10 log10(sum x^2 / sum (x - q(x))^2)):
#   e4m3 31.5, e5m2 25.5, fp16 73.7, bf16 55.6
# which is 6.02 * mantissa_bits + 13.5 dB to 0.1 dB (fp32: 151.9 by that rule).
# The default threshold is 6 dB (one bit of mantissa) under that: a value which loses
# more than a bit to its format, compared with well-scaled Gaussian data, is flagged.
# A block-scaled recipe is held to its element format's threshold; E2M1 (FP4) follows
# the same rule, 6.02 + 13.5 - 6 = 13.5 dB: the probe measures mxfp4 18.8 dB and nvfp4
# 20.4 dB on N(0, 1) data (1024 x 1024, blocks along the last axis), 19.5 by the rule.
SNR_GAUSSIAN_DB: dict[str, float] = {"e4m3": 31.5, "e5m2": 25.5, "fp16": 73.7, "bf16": 55.6}
SNR_MARGIN_DB = 6.0
DEFAULT_SNR_DB: dict[str, float] = {
    "e4m3": 25.5,
    "e5m2": 19.5,
    "fp16": 67.5,
    "bf16": 49.5,
    "fp32": 145.5,
}


def snr_from_mantissa(mantissa_bits: int) -> float:
    """Default SNR threshold (dB) for a format with ``mantissa_bits`` explicit mantissa
    bits: its SNR on N(0, 1) data (6.02 m + 13.5 dB) minus `SNR_MARGIN_DB`."""
    return round(6.02 * mantissa_bits + 13.5 - SNR_MARGIN_DB, 1)


@dataclass(frozen=True)
class Thresholds:
    """Limits of the advisor's rules (and of the format what-if).

    ``drift_log2``: bound on ``|log2 rms|`` of the data of scaled or cast E4M3 ops;
    other formats get the same margins from their own edges (`drift_bounds`).
    ``underflow``: largest tolerated fraction of non-zero values flushed to zero.
    ``overflow``: largest tolerated fraction of values above the format's max (0: any
    overflow is flagged). ``snr_db``: lowest tolerated SNR per format (see
    `DEFAULT_SNR_DB`; formats not listed use `snr_from_mantissa`).
    ``nonfinite``: largest tolerated fraction of NaN/inf (0: any).
    Block-scaled recipes are judged by the noise they add (``snr_R``, which counts
    what they clip and flush), because that is what training answers to: MXFP8 with
    OCP FLOOR scales (which clips ~0.9 % of Gaussian elements by design), MXFP8 RCEIL and
    NVFP4 (~3.5 % clipped, ~20 dB) applied to every linear operand of a char transformer
    train within 1-2 % of fp32 (docs/advisor.md). ``recipe_snr_db``: lowest tolerated
    ``snr_R`` of any recipe (default 13.5 dB, the E2M1 threshold: NVFP4's noise on
    Gaussian data passes with margin); ``recipe_overflow``: largest tolerated fraction
    of clipped elements (default 1: clipping is judged through the SNR; lower it to
    hold a recipe to less clipping); ``recipe_underflow``: largest tolerated fraction of
    non-zero elements flushed to zero (default 0.75, the fraction of a gradient whose
    flush broke training in the verdict corpus).
    A gradient (a backward value) in a recipe is held to more (`recipe_limits`): with
    8-bit elements an SNR of at least ``recipe_grad_snr_db`` (default 22.5 dB, E4M3's
    threshold less half a bit; E2M1 elements keep ``recipe_snr_db``), and at most
    ``recipe_grad_underflow`` (default 0.5) of its elements flushed. A weight gradient
    sums each gradient element over every token, so an error that is systematic rather
    than random adds up: FLOOR scales clip the largest element of a block, which in a
    logits gradient is the target's, and E2M1 flushes the small ones, whose sum equals
    it. Measured (docs/advisor.md): the logits gradient alone in MXFP8 FLOOR at
    18.9-20.1 dB trained +2.6 % (sample GPT; with E5M2 elements at 18.9 dB the same: the
    cost is the clipping, not the rounding) and +13 % (an NNX LM) worse, while a ViT's
    and an MLP's at 23.5 and 24.5 dB cost nothing measurable; in NVFP4, with 53-55 %
    flushed, +3.5 % and +47 %, the ViT's with 39 % flushed nothing; every other gradient
    operand of those models sat at 27.6 dB or more in MXFP8 and flushed 49 % or less in
    NVFP4, and cost under 2.3 %.
    ``trend_min_points``: fewest recorded steps a trend fit uses;
    ``trend_min_r2``: the fit must explain at least this share of the variance, so a
    flat but noisy op near the bound is not projected out of it.
    ``mask_min_steps``: an op holding the same fraction (< 1) of non-finite values at every
    one of at least this many recorded steps is a mask by construction (``-inf`` logits
    of a causal mask before a softmax), not a failure: the nonfinite rule skips it. A
    value that went bad changes from step to step or is entirely NaN.
    ``delayed_history``: length (in recorded steps) of the amax history of the
    delayed-scaling replay behind the ``delayed`` rule (TE's default is 1024 steps).
    ``delayed_log2``: the rule also needs the amax to exceed the replayed threshold by more
    than this many binades (default 0.5: x1.41). A stationary op whose amax sets a new
    record by a few percent across a power of two clips a handful of elements by a few
    percent; 0 flags that too.
    ``stall``: largest tolerated share of the elements a step updates whose value, held
    in a format by a precision policy, does not change (the median over the recorded
    steps; the ``stall`` rule).
    """

    drift_log2: float = 4.0
    underflow: float = 0.01
    overflow: float = 0.0
    snr_db: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_SNR_DB))
    nonfinite: float = 0.0
    trend_min_points: int = 4
    trend_min_r2: float = 0.5
    mask_min_steps: int = 3
    delayed_history: int = 1024
    delayed_log2: float = 0.5
    recipe_overflow: float = 1.0
    recipe_underflow: float = 0.75
    recipe_snr_db: float = 13.5
    recipe_grad_snr_db: float = 22.5
    recipe_grad_underflow: float = 0.5
    stall: float = 0.05

    def __post_init__(self) -> None:
        names = (
            "drift_log2",
            "underflow",
            "overflow",
            "nonfinite",
            "trend_min_r2",
            "delayed_log2",
            "recipe_overflow",
            "recipe_underflow",
            "recipe_snr_db",
            "recipe_grad_snr_db",
            "recipe_grad_underflow",
            "stall",
        )
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value >= 0:
                raise ValueError(f"Thresholds.{name}: expected a number >= 0, got {value!r}")
        for name in (
            "underflow",
            "overflow",
            "nonfinite",
            "recipe_overflow",
            "recipe_underflow",
            "recipe_grad_underflow",
            "stall",
        ):
            if getattr(self, name) > 1:
                raise ValueError(
                    f"Thresholds.{name}: a fraction in [0, 1], got {getattr(self, name)}"
                )
        if not isinstance(self.mask_min_steps, int) or self.mask_min_steps < 2:
            raise ValueError(
                f"Thresholds.mask_min_steps: expected an int >= 2, got {self.mask_min_steps!r}"
            )
        if not isinstance(self.trend_min_points, int) or self.trend_min_points < 2:
            raise ValueError(
                f"Thresholds.trend_min_points: expected an int >= 2, got {self.trend_min_points!r}"
            )
        history = self.delayed_history
        if isinstance(history, bool) or not isinstance(history, int) or history < 1:
            raise ValueError(f"Thresholds.delayed_history: expected an int >= 1, got {history!r}")
        if not isinstance(self.snr_db, Mapping):
            raise TypeError(f"Thresholds.snr_db: expected a mapping, got {self.snr_db!r}")
        # A partial mapping overrides the defaults for the formats it names.
        object.__setattr__(self, "snr_db", {**DEFAULT_SNR_DB, **dict(self.snr_db)})

    def snr_for(self, fmt: str, meta: Mapping[str, Any] | None = None) -> float:
        """SNR threshold of format ``fmt``: `snr_db`, else derived from its mantissa bits
        (from ``meta["format_info"]`` or scalescope's format table). A block-scaled recipe
        (``"nvfp4"``) takes its own `snr_db` entry, else `recipe_snr_db`."""
        if fmt in self.snr_db:
            return float(self.snr_db[fmt])
        if recipe_element(fmt) is not None:
            return float(self.recipe_snr_db)
        bits = _format_info(fmt, meta).get("mantissa_bits")
        if bits is None:
            raise KeyError(
                f"Thresholds.snr_db: no threshold for format {fmt!r} and its mantissa "
                "bits are unknown; add it to snr_db"
            )
        return snr_from_mantissa(int(bits))

    def recipe_limits(
        self, name: str, meta: Mapping[str, Any] | None = None, *, gradient: bool = False
    ) -> tuple[float, float]:
        """``(lowest SNR in dB, largest flushed fraction)`` tolerated for format or recipe
        ``name``; a ``gradient`` (backward value) in a recipe with 8-bit elements is held
        to `recipe_grad_snr_db` (when that is higher), in any recipe to
        `recipe_grad_underflow`."""
        snr, under = self.snr_for(name, meta), self.underflow_for(name)
        element = recipe_element(name)
        if gradient and element is not None:
            if 1 + element.exponent_bits + element.mantissa_bits == 8:
                snr = max(snr, float(self.recipe_grad_snr_db))
            under = min(under, self.recipe_grad_underflow)
        return snr, under

    def overflow_for(self, name: str) -> float:
        """Tolerated overflow fraction: `recipe_overflow` for a block-scaled recipe,
        `overflow` for a format."""
        return self.recipe_overflow if recipe_element(name) is not None else self.overflow

    def underflow_for(self, name: str) -> float:
        """Tolerated underflow fraction: `recipe_underflow` for a block-scaled recipe,
        `underflow` for a format."""
        return self.recipe_underflow if recipe_element(name) is not None else self.underflow


def recipe_element(name: str) -> Any:
    """The element `Format` of block-scaled recipe ``name``, None when it is not one."""
    from ..core import recipes  # local: the advisor works on frames alone

    return recipes.get(name).element if recipes.is_recipe(name) else None


def _format_info(fmt: str, meta: Mapping[str, Any] | None) -> dict[str, Any]:
    """Limits of a format: the run's ``format_info`` or scalescope's own table."""
    info = ((meta or {}).get("format_info") or {}).get(fmt)
    if info:
        return dict(info)
    from ..core import formats  # local: the advisor works on frames alone

    try:
        f = formats.get(fmt)
    except (KeyError, ValueError, TypeError):
        return {}
    return {"max": f.max, "min_subnormal": f.min_subnormal, "mantissa_bits": f.mantissa_bits}
