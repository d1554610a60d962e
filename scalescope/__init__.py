"""scalescope: see what low precision does to every primitive of a JAX training step."""

from . import ops, unit
from ._version import __version__ as __version__
from .core import formats
from .core.formats import Format
from .core.policy import Policy, PolicyError
from .core.scaled_array import ScaledArray, as_scaled_array, asarray, is_scaled_array
from .notebook import load_notebook, show
from .probe import (
    OpRecord,
    OpTable,
    emulate,
    instrument,
    module_scopes,
    scale_graph,
    stats_frame,
)
from .run_view import RunView, open_run
from .scalify import ScalifyError, register_rule, scalify
from .store import (
    NonFiniteStep,
    NotARunError,
    Run,
    RunError,
    RunMismatchError,
    RunReader,
    RunWarning,
    RunWriteError,
    Triggers,
    list_runs,
)
from .unit import unit_scale
from .verification import Verification, verify

__all__ = [
    "Format",
    "NonFiniteStep",
    "NotARunError",
    "OpRecord",
    "OpTable",
    "Policy",
    "PolicyError",
    "Run",
    "RunError",
    "RunMismatchError",
    "RunReader",
    "RunView",
    "RunWarning",
    "RunWriteError",
    "Triggers",
    "ScaledArray",
    "ScalifyError",
    "as_scaled_array",
    "asarray",
    "emulate",
    "formats",
    "instrument",
    "is_scaled_array",
    "list_runs",
    "load_notebook",
    "module_scopes",
    "open_run",
    "ops",
    "register_rule",
    "scale_graph",
    "scalify",
    "show",
    "stats_frame",
    "unit",
    "unit_scale",
    "Verification",
    "verify",
]
