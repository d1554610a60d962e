"""The calibration of `unit_scale(..., calibrate=args)`: the measured multipliers
(`Calibration`), the RMS taps that measure them, and the forward and backward pass on
the example arguments (`_calibrate`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _rms(x: Any) -> float:
    """RMS of a concrete array, in float64 (0 for an empty one)."""
    x = np.asarray(x, np.float64)
    return float(np.sqrt(np.mean(np.square(x)))) if x.size else 0.0


def _inverse(r: float) -> float:
    return 1.0 / r if r > 0 and math.isfinite(r) else 1.0


@dataclass
class Calibration:
    """Multipliers `unit_scale(..., calibrate=args)` measured on ``args``.

    ``forward[key]`` multiplies the output of one rewritten op (or residual add) so that
    its RMS is 1; ``backward[key]`` multiplies the whole gradient of one value that a
    rewritten op reads so that its RMS is 1. A key names a value by where it is in the
    traced program: the indices of the enclosing higher-order equations, then the
    value's index in its jaxpr.
    """

    forward: dict[tuple, float] = field(default_factory=dict)
    backward: dict[tuple, float] = field(default_factory=dict)
    mode: str = "apply"  # "forward" or "backward" while measuring
    #: The arguments measured on: their pytree and each array's path, rank and dtype
    #: (`signature`); a call must match it, as the multipliers are per value.
    measured_on: tuple | None = None


def signature(args: Any) -> tuple:
    """``args``' pytree and, for each array leaf, its path, rank and dtype: what a
    calibration's multipliers depend on (a batch size may change, a rank may not)."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(args)
    arrays = tuple(
        (jax.tree_util.keystr(path), np.ndim(leaf), str(jnp.result_type(leaf)))
        for path, leaf in with_path
        if _is_dynamic(leaf)
    )
    return treedef, arrays


def check_signature(cal: Calibration, args: Any) -> None:
    """Record the arguments of the first measuring call; refuse a later call whose
    arrays differ in structure, rank or dtype (its values would take the multipliers of
    others), naming the first that differs."""
    sig = signature(args)
    if cal.measured_on is None:
        cal.measured_on = sig
        return
    if sig == cal.measured_on:
        return
    (tree, arrays), (tree0, arrays0) = sig, cal.measured_on
    if tree != tree0 or len(arrays) != len(arrays0):
        what = f"a pytree {tree} where calibrate= had {tree0}"
    else:
        now, then = next((a, b) for a, b in zip(arrays, arrays0, strict=True) if a != b)
        what = (
            f"argument{now[0]} of rank {now[1]} and dtype {now[2]} where calibrate= had "
            f"rank {then[1]} and dtype {then[2]}"
        )
    raise ValueError(
        f"unit_scale: called with {what}; a calibrated function takes arguments "
        "structured as calibrate= (the same pytree, dtypes and ranks; sizes may differ)"
    )


# A scan body's place in a calibration key: ``(_ITER, t)`` for iteration ``t`` while
# measuring (the loop is unrolled), ``_ITER`` alone in the traced body, which reads the
# multipliers of the current iteration from arrays scanned along with the loop's inputs.
_ITER = "iteration"


def _generic(key: tuple) -> tuple:
    """``key`` with every iteration index dropped: the key a traced loop body uses."""
    path, var = key
    return tuple(_ITER if isinstance(p, tuple) and p[0] == _ITER else p for p in path), var


def _gradient_tap(x: Any, key: tuple, into: dict[tuple, float]) -> Any:
    """``x`` unchanged; in the backward pass, its gradient divided by its RMS, and the
    multiplier stored under ``key`` (where the gradient is concrete, i.e. not inside a
    loop body)."""

    @jax.custom_vjp
    def tap(x):
        return x

    def bwd(_, ct):
        if isinstance(ct, jax.core.Tracer):
            return (ct,)
        f = _inverse(_rms(ct))
        into[key] = f
        return (ct * jnp.asarray(f, ct.dtype),)

    tap.defvjp(lambda x: (x, None), bwd)
    return tap(x)


def _replaced(leaves: Sequence[Any], positions: Sequence[int], vals: Sequence[Any]) -> list:
    """``leaves`` with the leaf at each of ``positions`` replaced by the matching value."""
    full = list(leaves)
    for i, val in zip(positions, vals, strict=True):
        full[i] = val
    return full


def _is_dynamic(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array | np.ndarray | np.generic) or hasattr(leaf, "aval")


def _cotangent(out: Any) -> Any:
    """Cotangent of one output for calibration: 1 for a scalar, unit-normal values for
    an array, and zeros for an integer output."""
    out = jnp.asarray(out)
    if not jnp.issubdtype(out.dtype, jnp.inexact):
        return np.zeros(out.shape, jax.dtypes.float0)
    if out.ndim == 0:
        return jnp.ones((), out.dtype)
    return jax.random.normal(jax.random.PRNGKey(0), out.shape, out.dtype)


def _calibrate(wrapped: Callable[..., Any], cal: Calibration, args: tuple) -> None:
    """Measure ``cal``'s multipliers on ``args``: a forward pass, then a backward pass
    with respect to every floating-point array among ``args``."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    floats = [
        i
        for i, x in enumerate(leaves)
        if _is_dynamic(x) and jnp.issubdtype(jnp.result_type(x), jnp.floating)
    ]
    if not floats:
        raise ValueError("unit_scale: calibrate= holds no floating-point array to measure with")

    def fn_of_floats(*vals: Any) -> Any:
        return wrapped(*jax.tree_util.tree_unflatten(treedef, _replaced(leaves, floats, vals)))

    try:
        cal.mode = "forward"
        fn_of_floats(*(leaves[i] for i in floats))
        cal.mode = "backward"
        try:
            out, vjp = jax.vjp(fn_of_floats, *(leaves[i] for i in floats))
            vjp(jax.tree.map(_cotangent, out))
        except (TypeError, ValueError) as err:
            err.add_note(
                "unit_scale: calibrate= differentiates fn with respect to every "
                "floating-point array argument"
            )
            raise
    finally:
        cal.mode = "apply"
