"""User-facing operations: per-pass casts and scale control.

All work outside scalify too: on plain arrays as identities or plain casts, on a
`ScaledArray` through their scaled rule (`dispatch.accepts_scaled`).
"""

from .cast import cast_on_backward, cast_on_forward
from .scaling import (
    dynamic_rescale_l1,
    dynamic_rescale_l1_grad,
    dynamic_rescale_l2,
    dynamic_rescale_l2_grad,
    dynamic_rescale_max,
    dynamic_rescale_max_grad,
    dynamic_rescale_p,
    set_scaling,
    set_scaling_p,
    stop_scaling,
    stop_scaling_p,
)

__all__ = [
    "cast_on_backward",
    "cast_on_forward",
    "dynamic_rescale_l1",
    "dynamic_rescale_l1_grad",
    "dynamic_rescale_l2",
    "dynamic_rescale_l2_grad",
    "dynamic_rescale_max",
    "dynamic_rescale_max_grad",
    "dynamic_rescale_p",
    "set_scaling",
    "set_scaling_p",
    "stop_scaling",
    "stop_scaling_p",
]
