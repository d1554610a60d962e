"""Analysis of a recorded run as pandas frames: op x step matrices, per-op summaries,
the advisor (where dynamic rescaling is needed), the format what-if, the FP8
delayed-scaling replay and run comparison.

Every function takes plain DataFrames (``reader.stats(wide=True)`` and ``reader.ops``);
the ``*_run`` / ``*_readers`` variants take `scalescope.open_run` readers.
"""

from .advisor import (
    DEFAULT_SNR_DB,
    FINDING_COLUMNS,
    RULES,
    SEVERITY,
    SEVERITY_ORDER,
    Thresholds,
    advise,
    advise_run,
    fix_line,
    snr_from_mantissa,
    summary_by_rule,
)
from .compare import Comparison, compare_readers, compare_runs, match_ops
from .delayed import delayed_scaling
from .frames import (
    DERIVED_METRICS,
    log2_absmax,
    log2_rms,
    log2_scale,
    matrix,
    matrix_run,
    measured_matrix,
    metric_direction,
    metric_values,
    op_labels,
    recorded_formats,
    step_windows,
    with_derived,
)
from .measured import budget_note, measurement_notes, sampled_note
from .summary import op_summary, op_summary_run, worst_ops
from .whatif import format_whatif, format_whatif_run, verdict_counts

__all__ = [
    "DEFAULT_SNR_DB",
    "DERIVED_METRICS",
    "FINDING_COLUMNS",
    "RULES",
    "SEVERITY",
    "SEVERITY_ORDER",
    "Comparison",
    "Thresholds",
    "advise",
    "advise_run",
    "budget_note",
    "compare_readers",
    "compare_runs",
    "delayed_scaling",
    "fix_line",
    "format_whatif",
    "format_whatif_run",
    "log2_absmax",
    "log2_rms",
    "log2_scale",
    "match_ops",
    "measurement_notes",
    "matrix",
    "matrix_run",
    "measured_matrix",
    "metric_direction",
    "metric_values",
    "op_labels",
    "op_summary",
    "op_summary_run",
    "recorded_formats",
    "sampled_note",
    "snr_from_mantissa",
    "step_windows",
    "summary_by_rule",
    "verdict_counts",
    "with_derived",
    "worst_ops",
]
