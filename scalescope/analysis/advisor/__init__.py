"""The advisor: where is dynamic rescaling needed, and why.

`advise` turns a run's statistics into findings, one row per (op, rule, format):

- ``nonfinite``: any op with ``frac_nonfinite > thresholds.nonfinite``, except masks (the
  same fraction at every recorded step, see `Thresholds.mask_min_steps`);
- ``overflow``, ``underflow`` and ``snr``: an op against each format it is checked
  against, i.e. its ``cast_to`` format (the format a later op rounds it to) plus every
  format in ``audit``;
- ``drift``: an op stored in a low-precision dtype (FP16/BF16/FP8) and scaled (a
  ScaledArray under scalify), or cast to a low-precision format, whose data RMS leaves
  the band of that format (`drift_bounds`: ``|log2 rms| > drift_log2`` for E4M3, the
  same margins from a wider format's own edges): the static scale propagation lost
  track of it;
- ``trend``: such an op, in its band at its last recorded step, whose least-squares fit
  of log2 rms over the recorded steps leaves the band before the horizon;
- ``delayed``: a value cast without a scale of its own (or, when a plain format is
  audited, any float op) whose value amax grows faster than FP8 *delayed scaling* can
  follow: replayed with an amax history of ``delayed_history`` recorded steps
  (`scalescope.analysis.delayed`, algo ``max``, margin 0, the op's cast format or the
  audited one), its amax lands a whole binade above the history's max
  (``clipped_min > 0``: elements clip for sure) and more than ``2**delayed_log2``
  times above it, at some recorded step once the history holds an amax (clipping at
  the initial scale 1 is the overflow rule's business);
- ``stall``: a leaf of the state a precision policy holds in a format (``updates``:
  `RunReader.held_updates`) whose share of updates that round away, the median over the
  recorded steps, exceeds ``thresholds.stall``.

Values constant by construction (`scalescope.analysis.relevance`: optimizer scalars from
the step count, mask fills) raise no drift, trend or delayed finding.

**Severity is graded by magnitude** (`severity_level`; the steps are `SEVERITY_STEPS`):

- ``nonfinite``: critical (NaN/inf outside a mask ends a training), unless it is dropped
  downstream: at every step it appears, the step's outputs (`output_ops`: parameters,
  optimizer state, loss) are recorded and finite (a where/select discards it, e.g. a
  schedule's unused branch at step 0 or an empty segment's -inf): low, impact 0;
- ``overflow`` of a format (a plain cast turns those elements into inf, or NaN in
  e4m3fn): high, critical from 1 % of the values (as broken as a NaN); medium at most
  when every overflowing element stays under the format's `rounding_edge` (they round
  to the max: no step is lost, but no headroom is left); low when handled: at every
  step it overflows the outputs are finite, at no more than half of the recorded steps
  (a dynamic loss scaler skipping a step; its `snr` at those steps is low too); of a block-scaled
  recipe (clipped elements saturate): low below 0.1 %, medium below 1 %, high from 1 %;
- ``underflow``: low below 2 % of the non-zero values flushed to zero, medium below
  25 %, high from 25 % (99 % of a backward value flushed in E5M2 is high);
- ``snr``: low less than 3 dB under the threshold, medium less than 12 dB under it,
  high from 12 dB under it (two more bits lost);
- ``stall``: by the lower of the leaf's share and the model's (every held leaf
  together, the impact): low below 6.25 %, medium below 12.5 %, high from there;
- ``drift``: low within 1 binade beyond ``±drift_log2``, medium within 4, high from 4
  binades beyond (``|log2 rms| >= 8`` by default: an FP8 value's headroom is gone);
- ``trend`` (a projection, never high): low, medium when the fit's rate takes the value
  4 binades or more beyond the bound by the horizon;
- ``delayed``: low when the value amax is less than 2 binades (x4) above the
  delayed-scaling threshold, medium below 4 binades (x16), high from there when it
  clips at two recorded steps or more (a single step, a warm-up transient: medium).

**Each finding carries one readable sentence of evidence and a one-line fix** naming the
op's source line (`fix_line`). Under scalify (or on a scaled op): drift and trend ->
``ss.ops.dynamic_rescale_l2`` after a forward (or optimizer) value,
``ss.ops.dynamic_rescale_l2_grad`` before the forward value whose gradient is a backward
value; overflow -> ``dynamic_rescale_max`` (``_max_grad``), which puts the abs-max, not
the RMS, at 1; underflow and SNR -> ``dynamic_rescale_l2`` when the value is off unit
scale where it fails, else a format with more range (underflow) or more mantissa (SNR),
or a block-scaled recipe (an underflow of a value whose ``dynamic_range`` is wider than
the format's span from max to smallest subnormal, `format_span`: a block-scaled recipe or
a format with more range, whatever the scaling); delayed -> a shorter amax history,
``most_recent``, current
scaling or ``dynamic_rescale_max``. Not under scalify (naive low-precision casts): run
the step under scalify, or cast with a block-scaled recipe: the cheapest recipe the
recorded recipe statistics show safe for that op (`scalescope.analysis.format_whatif`),
else a recipe suited to the failure (``e4m3_tensor`` for overflow, ``mxfp8_e4m3``
otherwise). ``nonfinite``: the earliest op with NaN/inf gets ``jax_debug_nans`` at its
line; later ones point to it.

The package, one idea per module (they import one another without a circle, never this
`__init__`):

- `cells`: the values the rules read, one row per (op, step), and where a rule holds;
- `detectors_nonfinite`, `detectors_formats`, `detectors_scales` (drift, trend),
  `detectors_updates` (stall: updates a held format rounds away),
  `detectors_delayed`: one function per rule (``_<rule>_findings``);
- `severity`: impact and severity of a finding, the metric that shows it;
- `text`: evidence numbers and the one-line fixes;
- `findings`: `advise` and the other entry points.

`Thresholds` (`scalescope.analysis.thresholds`), `pct` (`scalescope.analysis.percent`)
and `mask_ops` / `fill_ops` (`scalescope.analysis.masks`) are leaves of the analysis,
shared with the format what-if, which imports nothing of the advisor.
"""

from ..masks import fill_ops, mask_ops
from ..percent import pct
from ..thresholds import (
    DEFAULT_SNR_DB,
    SNR_GAUSSIAN_DB,
    SNR_MARGIN_DB,
    Thresholds,
    recipe_element,
    snr_from_mantissa,
)
from .detectors_formats import format_span, rounding_edge
from .detectors_nonfinite import output_ops
from .detectors_scales import drift_bounds
from .findings import FINDING_COLUMNS, advise, advisor_columns, summary_by_rule
from .severity import (
    FORMAT_RULES,
    RULES,
    SCALE_RULES,
    SEVERITY,
    SEVERITY_ORDER,
    SEVERITY_STEPS,
    finding_metric,
    severity_level,
    severity_of,
    worst_finding,
    worst_finding_metric,
)
from .text import DEFAULT_RECIPE, RESCALE_LOG2, SUGGESTED_RECIPE, delayed_fix_line, fix_line

__all__ = [
    "FORMAT_RULES",
    "SCALE_RULES",
    "DEFAULT_RECIPE",
    "DEFAULT_SNR_DB",
    "FINDING_COLUMNS",
    "RESCALE_LOG2",
    "RULES",
    "SEVERITY",
    "SEVERITY_ORDER",
    "SEVERITY_STEPS",
    "SNR_GAUSSIAN_DB",
    "SNR_MARGIN_DB",
    "SUGGESTED_RECIPE",
    "Thresholds",
    "advise",
    "advisor_columns",
    "delayed_fix_line",
    "drift_bounds",
    "fill_ops",
    "finding_metric",
    "fix_line",
    "format_span",
    "mask_ops",
    "output_ops",
    "pct",
    "recipe_element",
    "rounding_edge",
    "severity_level",
    "severity_of",
    "snr_from_mantissa",
    "summary_by_rule",
    "worst_finding",
    "worst_finding_metric",
]
