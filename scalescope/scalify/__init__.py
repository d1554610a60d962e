"""The scalify engine: a jaxpr interpreter with one scaled rule per primitive."""

from . import (  # noqa: F401
    rules_collective,
    rules_control,
    rules_elementwise,
    rules_linalg,
    rules_reduce,
    rules_shape,
)
from .interpreter import (
    NORMALIZED_DTYPES,
    Context,
    Fallback,
    ScalifyError,
    eval_jaxpr,
    normalize_input,
    scalify,
    trace_to_jaxpr,
)
from .registry import (
    RULES,
    Rule,
    get_rule,
    has_rule,
    primitives_in,
    register_rule,
    registered_primitives,
)
from .source import format_source, user_frame

__all__ = [
    "RULES",
    "Context",
    "Fallback",
    "Rule",
    "ScalifyError",
    "eval_jaxpr",
    "format_source",
    "get_rule",
    "has_rule",
    "normalize_input",
    "NORMALIZED_DTYPES",
    "primitives_in",
    "register_rule",
    "registered_primitives",
    "scalify",
    "trace_to_jaxpr",
    "user_frame",
]
