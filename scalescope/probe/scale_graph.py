"""The scale graph: every op's forward RMS and gradient RMS, on one log2 axis.

Unit scaling's analysis plot. The gradient of a forward value is not in a differentiated
step's jaxpr as such (after AD nothing links a value to its cotangent), so it is computed
directly: the loss is evaluated equation by equation with a zero added to every floating
output, and the gradient of the loss with respect to those zeros is each value's
gradient, exactly (the perturbations do not change any value).

``scale_graph(loss_fn, *args)`` returns one row per floating value the loss computes.
Calls (``jit``) are entered; loops, branches and custom-derivative calls count as one op
(their outputs are perturbed, not their insides, so their own derivative rules stay).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from ..scalify import traverse
from ..scalify.interpreter import bind_plain
from ..scalify.source import UNKNOWN, format_source
from .modules import module_scopes
from .names import Scope, op_name, parse

#: Call primitives whose body is entered (the others are one op each).
_CALLS = traverse.PLAIN_CALLS

COLUMNS = ("name", "primitive", "shape", "dtype", "source", "fwd_log2_rms", "grad_log2_rms")


def _is_float(aval: Any) -> bool:
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating) and aval.shape != ()


def _body(eqn: Any) -> Jaxpr | None:
    if eqn.primitive.name not in _CALLS:
        return None
    inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    return inner.jaxpr if isinstance(inner, ClosedJaxpr) else inner


def _consts(eqn: Any) -> Sequence[Any]:
    inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    return inner.consts if isinstance(inner, ClosedJaxpr) else ()


def _walk(
    jaxpr: Jaxpr,
    consts: Sequence[Any],
    args: Sequence[Any],
    scope: Scope,
    hook,
    where: str = UNKNOWN,
) -> list:
    """Evaluate ``jaxpr``; every floating non-scalar output of an op goes through
    ``hook(value, eqn, var, scope, source)``, which returns the value to carry on with.
    ``where``: the user's line of the enclosing call, for equations without one."""
    env: dict[Any, Any] = {}
    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        inner = scope.join(parse(eqn.source_info.name_stack))
        source = format_source(eqn.source_info, where)
        body = _body(eqn)
        if body is not None:
            outs = _walk(body, _consts(eqn), invals, inner, hook, source)
        else:
            outs = bind_plain(eqn, invals)
            outs = [
                hook(out, eqn, var, inner, source) if _is_float(var.aval) else out
                for var, out in zip(eqn.outvars, outs)
            ]
        for v, out in zip(eqn.outvars, outs):
            env[v] = out
    return [read(v) for v in jaxpr.outvars]


def _describe(eqn: Any, var: Any, scope: Scope, source: str) -> dict[str, Any]:
    return {
        "name": op_name(scope, eqn.primitive.name),
        "primitive": eqn.primitive.name,
        "shape": tuple(var.aval.shape),
        "dtype": str(var.aval.dtype),
        "source": source,
    }


def _log2_rms(x: jax.Array) -> jax.Array:
    """log2 of the RMS of ``x``, on device in float32: NaN where the RMS is 0 or not
    finite. Squares are taken after dividing by the abs-max (exact for a power of two),
    so values near float32's max or min do not over- or underflow; only this scalar
    leaves the device, which also works on arrays sharded over several processes."""
    x = jnp.asarray(x, jnp.float32)
    if x.size == 0:
        return jnp.float32(jnp.nan)
    amax = jnp.max(jnp.abs(x))
    ok = jnp.isfinite(amax) & (amax > 0)
    # the power of two of amax: dividing by it is exact
    p2 = jnp.where(ok, jnp.exp2(jnp.floor(jnp.log2(jnp.where(ok, amax, 1.0)))), 1.0)
    y = x / p2
    rms = jnp.sqrt(jnp.mean(y * y))
    return jnp.where(ok & (rms > 0), jnp.log2(rms) + jnp.log2(p2), jnp.nan)


def _host(x: jax.Array) -> float:
    """A replicated scalar's value (its first addressable shard: valid in every
    process of a multi-process run)."""
    return float(np.asarray(x.addressable_data(0)))


def scale_graph(loss_fn: Callable[..., Any], *args: Any) -> pd.DataFrame:
    """One row per floating non-scalar value ``loss_fn(*args)`` computes: its op name
    (scopes as the probe names them), primitive, shape, dtype, source line, and the log2
    RMS of the value (``fwd_log2_rms``) and of the loss's gradient with respect to it
    (``grad_log2_rms``). ``loss_fn`` must return one floating scalar. NaN where an RMS is
    0 or not finite."""
    if not callable(loss_fn):
        raise TypeError(f"scale_graph: loss_fn must be callable, got {type(loss_fn).__name__}")
    flat, tree = jax.tree_util.tree_flatten(args)
    with module_scopes():
        closed = jax.make_jaxpr(lambda *a: loss_fn(*jax.tree_util.tree_unflatten(tree, a)))(*flat)
    out = closed.out_avals
    if len(out) != 1 or out[0].shape != () or not jnp.issubdtype(out[0].dtype, jnp.floating):
        got = [f"{a.dtype}{list(a.shape)}" for a in out]
        raise ValueError(f"scale_graph: loss_fn must return one floating scalar, got {got}")

    rows: list[dict[str, Any]] = []
    shapes: list[Any] = []

    def describe(value, eqn, var, scope, source):
        rows.append(_describe(eqn, var, scope, source))
        shapes.append(jax.ShapeDtypeStruct(var.aval.shape, var.aval.dtype))
        return value

    jax.eval_shape(lambda *a: _walk(closed.jaxpr, closed.consts, a, Scope(), describe), *flat)

    def perturbed(perts, consts, *a):
        values: list[Any] = []

        def add(value, eqn, var, scope, source):
            values.append(value)
            return value + perts[len(values) - 1]

        (loss,) = _walk(closed.jaxpr, consts, a, Scope(), add)
        return jnp.asarray(loss, jnp.float32), values

    def measured(perts, consts, *a):
        (_, values), grads = jax.value_and_grad(perturbed, has_aux=True)(perts, consts, *a)
        return [_log2_rms(v) for v in values], [_log2_rms(g) for g in grads]

    zeros = [jnp.zeros(s.shape, s.dtype) for s in shapes]
    # the arrays ``loss_fn`` closes over are passed as arguments, not constants: that is
    # what JAX requires of arrays sharded over several processes
    fwd, grad = jax.jit(measured)(zeros, list(closed.consts), *flat)
    frame = pd.DataFrame(rows, columns=list(COLUMNS[:5]))
    # replicated scalars: every process holds them
    frame["fwd_log2_rms"] = np.array([_host(v) for v in fwd], np.float64)
    frame["grad_log2_rms"] = np.array([_host(g) for g in grad], np.float64)
    frame.index.name = "op"
    return frame


__all__ = ["COLUMNS", "scale_graph"]
