"""Unit scaling for JAX: the counterpart of Graphcore's ``unit_scaling`` library.

``import scalescope.unit as U`` gives the unit-scaled ops (``U.linear``, ``U.softmax``,
...), `scale_fwd`/`scale_bwd` and the constraints. ``scalescope.unit.nn`` holds Flax NNX
modules built on them; it is imported on first access so that plain ``import
scalescope`` does not need Flax. docs/unit.md lists every scaling rule.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import constraints
from .constraints import CONSTRAINTS, apply_constraint
from .functional import (
    add,
    conv1d,
    cross_entropy,
    dropout,
    embedding,
    gelu,
    layer_norm,
    linear,
    linear_readout,
    matmul,
    mse_loss,
    residual_add,
    residual_apply,
    residual_split,
    rms_norm,
    scale_elementwise,
    scaled_dot_product_attention,
    silu,
    silu_glu,
    softmax,
    transformer_residual_scaling_rule,
)
from .scale import logarithmic_interpolation, scale_bwd, scale_fwd
from .transform import Rewrite, unit_scale


def __getattr__(name: str) -> Any:
    """Import ``nn`` lazily (it needs Flax)."""
    if name == "nn":
        return importlib.import_module(f"{__name__}.nn")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CONSTRAINTS",
    "Rewrite",
    "add",
    "apply_constraint",
    "constraints",
    "conv1d",
    "cross_entropy",
    "dropout",
    "embedding",
    "gelu",
    "layer_norm",
    "linear",
    "linear_readout",
    "logarithmic_interpolation",
    "matmul",
    "mse_loss",
    "residual_add",
    "residual_apply",
    "residual_split",
    "rms_norm",
    "scale_bwd",
    "scale_fwd",
    "scale_elementwise",
    "scaled_dot_product_attention",
    "silu",
    "silu_glu",
    "softmax",
    "transformer_residual_scaling_rule",
    "unit_scale",
]
