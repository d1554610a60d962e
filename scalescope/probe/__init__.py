"""The probe: statistics of every value of a traced function, computed on the device.

`instrument(fn)` interprets ``fn`` (scalified or plain) and returns ``(out, stats)``;
``stats`` is a flat dict of arrays, one row per recorded (op, iteration), described by
the static `OpTable` from ``instrumented.op_table(*args)``. `emulate(fn, policy)`
interprets it the same way and rounds the values a `Policy` names.
"""

from .emulate import emulate
from .instrument import instrument
from .kernel import (
    BASIC_STATS,
    FORMAT_STATS,
    HIST_COLUMNS,
    HIST_EXPONENTS,
    HIST_HI,
    HIST_LO,
    StatSpec,
)
from .modules import module_scopes
from .names import PASS_SCOPES
from .optable import NOTES, OpRecord, OpTable, stats_frame
from .scale_graph import scale_graph

__all__ = [
    "BASIC_STATS",
    "FORMAT_STATS",
    "HIST_COLUMNS",
    "HIST_EXPONENTS",
    "HIST_HI",
    "HIST_LO",
    "NOTES",
    "PASS_SCOPES",
    "OpRecord",
    "scale_graph",
    "OpTable",
    "StatSpec",
    "emulate",
    "instrument",
    "module_scopes",
    "stats_frame",
]
