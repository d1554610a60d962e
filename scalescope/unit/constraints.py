"""Scale constraints: how an op's output scale and input-gradient scales are tied.

A unit-scaled op has one ideal scale for its output (forward) and one per input gradient
(backward). When a value feeds several consumers, differing forward and backward scales
make the gradients of the graph inconsistent with its forward function, so by default
the scales are *constrained* to one shared value. The names and meanings are those of
`unit_scaling.constraints` (Graphcore's PyTorch library).
"""

from __future__ import annotations

import math
from collections.abc import Callable

#: The accepted ``constraint=`` values (``None`` means unconstrained).
CONSTRAINTS: tuple[str | None, ...] = (
    "to_output_scale",
    "to_grad_input_scale",
    "gmean",
    "hmean",
    "amean",
    None,
)

#: Also accepted by ops with two differentiable inputs (``matmul``, ``add``).
TERNARY_ONLY: tuple[str, ...] = ("to_left_grad_scale", "to_right_grad_scale")


def gmean(*scales: float) -> float:
    """Geometric mean of the scales: the library's recommended compromise."""
    return math.prod(scales) ** (1.0 / len(scales))


def hmean(*scales: float) -> float:
    """Harmonic mean of the scales (the choice behind Xavier/Glorot initialisation)."""
    return len(scales) / sum(1.0 / s for s in scales)


def amean(*scales: float) -> float:
    """Arithmetic mean of the scales."""
    return sum(scales) / len(scales)


def to_output_scale(output_scale: float, *grad_input_scales: float) -> float:
    """Use the output scale everywhere: the forward pass is exactly unit-scaled."""
    return output_scale


def to_grad_input_scale(output_scale: float, *grad_input_scales: float) -> float:
    """Use the input-gradient scale everywhere: the backward pass is unit-scaled.

    With two gradient scales (``matmul``, ``add``) their geometric mean is used; the
    PyTorch library accepts only one here (see docs/unit.md).
    """
    return gmean(*grad_input_scales)


def to_left_grad_scale(output_scale: float, left: float, right: float) -> float:
    """Use the left operand's gradient scale everywhere (two-input ops only)."""
    return left


def to_right_grad_scale(output_scale: float, left: float, right: float) -> float:
    """Use the right operand's gradient scale everywhere (two-input ops only)."""
    return right


_FUNCTIONS: dict[str, Callable[..., float]] = {
    "to_output_scale": to_output_scale,
    "to_grad_input_scale": to_grad_input_scale,
    "gmean": gmean,
    "hmean": hmean,
    "amean": amean,
    "to_left_grad_scale": to_left_grad_scale,
    "to_right_grad_scale": to_right_grad_scale,
}


def allowed(n_scales: int) -> tuple[str | None, ...]:
    """The constraint names valid for an op with ``n_scales`` scales (1 output + grads)."""
    return CONSTRAINTS[:-1] + (TERNARY_ONLY if n_scales == 3 else ()) + (None,)


def validate_constraint(constraint: str | None, op: str, n_scales: int = 2) -> None:
    """Raise ValueError naming the allowed values when ``constraint`` is not one of them."""
    ok = allowed(n_scales)
    if constraint is not None and (not isinstance(constraint, str) or constraint not in ok):
        raise ValueError(f"{op}: constraint must be one of {ok}, got {constraint!r}")


def apply_constraint(constraint: str | None, *scales: float, op: str = "unit op") -> tuple:
    """Return ``scales`` (output scale first, then the gradient scales) after the constraint.

    ``None`` leaves them independent; any named constraint replaces all of them with the
    single value the constraint picks, so forward and backward agree.
    """
    validate_constraint(constraint, op, len(scales))
    if constraint is None:
        return tuple(float(s) for s in scales)
    value = float(_FUNCTIONS[constraint](*scales))
    return tuple(value for _ in scales)


__all__ = [
    "CONSTRAINTS",
    "amean",
    "apply_constraint",
    "gmean",
    "hmean",
    "to_grad_input_scale",
    "to_left_grad_scale",
    "to_output_scale",
    "to_right_grad_scale",
    "validate_constraint",
]
