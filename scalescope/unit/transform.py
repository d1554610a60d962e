"""`unit_scale(fn)`: unit scaling applied automatically to a JAX function's jaxpr.

``fn`` is traced with `jax.make_jaxpr` and its jaxpr interpreted equation by equation.
Before a (sub-)jaxpr is run, a pattern pass finds the ops to rewrite; running it then
multiplies chosen operands by `scale_bwd` (gradient only) and chosen outputs by
`scale_fwd` (value only), so the backward scales come from those custom_vjp functions
and the result composes with `jax.jit` and `jax.grad`. docs/unit.md ("unit_scale")
lists what is rewritten, how patterns are recognised and the limits.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Literal

from ..scalify.interpreter import bind_plain
from .constraints import apply_constraint, validate_constraint
from .functional import (
    attention_scale,
    cross_entropy_grad_scale,
    dot_scales,
    gelu_scales,
    residual_scales,
    silu_scales,
    softmax_scales,
)
from .scale import scale_bwd, scale_fwd

_SQRT_2_OVER_PI = math.sqrt(2 / math.pi)
_GELU_CUBIC = 0.044715
_INV_SQRT_2 = 2**-0.5


def _gaussian_rms_scales(f: Callable, df: Callable) -> tuple[float, float]:
    """``(1/rms(f(z)), 1/rms(f'(z)))`` for ``z ~ N(0, 1)`` (Gauss-Hermite quadrature):
    the unit scales of an elementwise op the PyTorch library has no rule for."""
    z, w = np.polynomial.hermite_e.hermegauss(80)
    w = w / w.sum()
    return float(np.sum(w * f(z) ** 2) ** -0.5), float(np.sum(w * df(z) ** 2) ** -0.5)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-z))


#: ``(output, gradient)`` scales of the single-primitive non-linearities.
ELEMENTWISE_SCALES: dict[str, tuple[float, float]] = {
    "tanh": _gaussian_rms_scales(np.tanh, lambda z: 1 - np.tanh(z) ** 2),
    "logistic": _gaussian_rms_scales(_sigmoid, lambda z: _sigmoid(z) * (1 - _sigmoid(z))),
    "relu": (2**0.5, 2**0.5),  # E[relu(z)^2] = E[1{z>0}] = 1/2, exactly
}

_SHAPE_OPS = {
    "reshape",
    "broadcast_in_dim",
    "transpose",
    "convert_element_type",
    "squeeze",
    "expand_dims",
    "slice",
    "dynamic_slice",
    "copy",
    "copy_p",
    "rev",
    "reduce_precision",
}
_BROADCASTING_OPS = {"broadcast_in_dim", "add", "sub", "mul", "div", "max", "min"}
_CALL_PRIMS = {"jit", "pjit", "closed_call", "core_call"}


@dataclass(frozen=True)
class Rewrite:
    """One op that `unit_scale` rewrote.

    ``kind``: ``linear``, ``readout``, ``matmul``, ``attention``, ``gelu``, ``silu``,
    ``relu``, ``tanh``, ``logistic``, ``softmax``, ``cross_entropy``, ``residual``,
    ``add``, ``embedding`` or ``param_broadcast``. ``primitives``: the primitives the op
    spans (several for an inlined activation). ``output_scale``/``grad_scales``: the
    constants applied. ``where``: the JAX name stack of the op's first equation.
    """

    kind: str
    primitives: tuple[str, ...]
    output_scale: float
    grad_scales: tuple[float, ...]
    where: str = ""


@dataclass
class _Plan:
    """What to scale while running one jaxpr (see `_analyse`)."""

    operand: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)
    default_read: dict[Any, tuple[float, float]] = field(default_factory=dict)
    output: dict[Any, float] = field(default_factory=dict)
    loss_mean: dict[int, float] = field(default_factory=dict)
    call_groups: set[int] = field(default_factory=set)
    grouped: set[int] = field(default_factory=set)
    param_like: dict[Any, bool] = field(default_factory=dict)
    live: dict[Any, bool] = field(default_factory=dict)
    # residual adds: eqn index -> (skip operand position, residual operand position)
    residuals: dict[int, tuple[int, int]] = field(default_factory=dict)
    # eqns with a residual add downstream (in this jaxpr, or everything when the enclosing
    # call has one): they keep the constraint; the others are unconstrained
    constrained: set[int] = field(default_factory=set)
    # outputs `calibrate` leaves at their scale: the u-μP readout's logits
    keep_output: set[Any] = field(default_factory=set)
    # outputs `calibrate` brings to unit RMS without a constant of their own (residual adds)
    calibrated_output: set[Any] = field(default_factory=set)


@dataclass(frozen=True)
class _Options:
    tau: float
    constraint: str | None
    readout: bool


# -- graph helpers -----------------------------------------------------------------------


class _Graph:
    """Producers and consumers of the variables of one jaxpr."""

    def __init__(self, jaxpr: Any):
        self.jaxpr = jaxpr
        self.eqns = jaxpr.eqns
        self.producer: dict[Any, int] = {}
        self.consumers: dict[Any, list[tuple[int, int]]] = {}
        for i, eqn in enumerate(self.eqns):
            for pos, v in enumerate(eqn.invars):
                if not isinstance(v, Literal):
                    self.consumers.setdefault(v, []).append((i, pos))
            for v in eqn.outvars:
                self.producer[v] = i

    def prod(self, v: Any, *prims: str) -> int | None:
        """The index of ``v``'s producer when its primitive is one of ``prims``."""
        if isinstance(v, Literal) or v not in self.producer:
            return None
        i = self.producer[v]
        return i if self.eqns[i].primitive.name in prims else None

    def sole_consumer(self, v: Any, *prims: str) -> tuple[int, int] | None:
        uses = self.consumers.get(v, [])
        if len(uses) != 1 or self.eqns[uses[0][0]].primitive.name not in prims:
            return None
        return uses[0]


def _const(v: Any) -> float | None:
    """The value of a scalar literal operand, else None."""
    if not isinstance(v, Literal):
        return None
    val = np.asarray(v.val)
    return float(val) if val.size == 1 and np.issubdtype(val.dtype, np.number) else None


def _close(c: float | None, target: float) -> bool:
    return c is not None and abs(c - target) <= 1e-4 * abs(target)


def _with_const(g: _Graph, i: int, target: float) -> Any:
    """For a binary equation with a literal ``≈ target`` operand, the other operand."""
    a, b = g.eqns[i].invars
    if _close(_const(a), target):
        return b
    if _close(_const(b), target):
        return a
    return None


def _is_float(v: Any) -> bool:
    dtype = getattr(v.aval, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def _size(v: Any) -> int:
    return math.prod(getattr(v.aval, "shape", ()))


def _extent(v: Any) -> int:
    """How many axes of ``v`` are longer than 1: a bias has one, a positional table two."""
    return sum(n > 1 for n in getattr(v.aval, "shape", ()))


def _where(eqn: Any) -> str:
    return str(getattr(eqn.source_info, "name_stack", ""))


# -- activation patterns -----------------------------------------------------------------


def _half_x_tail(g: _Graph, s: Any, x: Any) -> tuple[list[int], Any] | None:
    """Follow ``s`` through the multiplications by 0.5 and by ``x`` that end a GELU."""
    eqns: list[int] = []
    half = have_x = False
    while not (half and have_x):
        use = g.sole_consumer(s, "mul")
        if use is None:
            return None
        j, pos = use
        other = g.eqns[j].invars[1 - pos]
        hx = g.prod(other, "mul")
        if not half and _close(_const(other), 0.5):
            half = True
        elif not have_x and other is x:
            have_x = True
        elif not (half or have_x) and hx is not None and _with_const(g, hx, 0.5) is x:
            half = have_x = True
            eqns.append(hx)
        else:
            return None
        eqns.append(j)
        s = g.eqns[j].outvars[0]
    return eqns, s


def _cubed(g: _Graph, p: Any, x: Any) -> list[int] | None:
    i = g.prod(p, "integer_pow", "pow")
    if i is None or g.eqns[i].invars[0] is not x:
        return None
    eqn = g.eqns[i]
    power = eqn.params.get("y", _const(eqn.invars[1]) if len(eqn.invars) > 1 else None)
    return [i] if power == 3 else None


def _match_gelu_tanh(g: _Graph, i: int) -> tuple[set[int], Any, Any] | None:
    """``x * 0.5 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))`` around tanh ``i``."""
    m = g.prod(g.eqns[i].invars[0], "mul")
    v = None if m is None else _with_const(g, m, _SQRT_2_OVER_PI)
    a = None if v is None else g.prod(v, "add")
    if a is None:
        return None
    for x, u in (g.eqns[a].invars, g.eqns[a].invars[::-1]):
        c = g.prod(u, "mul")
        p = None if c is None else _with_const(g, c, _GELU_CUBIC)
        cube = None if p is None else _cubed(g, p, x)
        if cube is None:
            continue
        one = g.sole_consumer(g.eqns[i].outvars[0], "add")
        if one is None or _with_const(g, one[0], 1.0) is None:
            return None
        tail = _half_x_tail(g, g.eqns[one[0]].outvars[0], x)
        if tail is None:
            return None
        return {m, a, c, *cube, i, one[0], *tail[0]}, x, tail[1]
    return None


def _match_gelu_erf(g: _Graph, i: int) -> tuple[set[int], Any, Any] | None:
    """``0.5 x erfc(-x/sqrt 2)`` (erfc ``i``) or ``0.5 x (1 + erf(x/sqrt 2))`` (erf ``i``)."""
    eqn = g.eqns[i]
    m = g.prod(eqn.invars[0], "mul")
    inner = None if m is None else _with_const(g, m, _INV_SQRT_2)
    if inner is None:
        return None
    group = {m, i}
    if eqn.primitive.name == "erfc":
        n = g.prod(inner, "neg")
        if n is None:
            return None
        x, s = g.eqns[n].invars[0], eqn.outvars[0]
        group.add(n)
    else:
        x = inner
        one = g.sole_consumer(eqn.outvars[0], "add")
        if one is None or _with_const(g, one[0], 1.0) is None:
            return None
        s = g.eqns[one[0]].outvars[0]
        group.add(one[0])
    tail = _half_x_tail(g, s, x)
    return None if tail is None else (group | set(tail[0]), x, tail[1])


def _match_silu(g: _Graph, i: int) -> tuple[set[int], Any, Any] | None:
    """``x * logistic(x)`` around logistic ``i``."""
    x = g.eqns[i].invars[0]
    use = g.sole_consumer(g.eqns[i].outvars[0], "mul")
    if use is None or g.eqns[use[0]].invars[1 - use[1]] is not x:
        return None
    return {i, use[0]}, x, g.eqns[use[0]].outvars[0]


def _match_relu(g: _Graph, i: int) -> tuple[set[int], Any, Any] | None:
    """``max(x, 0)``."""
    x = _with_const(g, i, 0.0)
    if x is None or isinstance(x, Literal):
        return None
    return {i}, x, g.eqns[i].outvars[0]


def _max_shift(g: _Graph, shifted: Any) -> tuple[set[int], Any, int] | None:
    """``x - stop_gradient(max(x))``: the eqns, ``x`` and the reduced axis."""
    s = g.prod(shifted, "sub")
    if s is None:
        return None
    x, m = g.eqns[s].invars
    group, v = {s}, m
    while (j := g.prod(v, "stop_gradient", "broadcast_in_dim", "max", "reduce_max")) is not None:
        group.add(j)
        eqn = g.eqns[j]
        if eqn.primitive.name == "reduce_max":
            axes = eqn.params["axes"]
            if eqn.invars[0] is not x or len(axes) != 1:
                return None
            return group, x, int(axes[0])
        v = eqn.invars[1] if eqn.primitive.name == "max" and _const(eqn.invars[0]) else None
        v = v if v is not None else eqn.invars[0]
    return None


def _match_softmax(g: _Graph, i: int) -> tuple[str, set[int], Any, Any, int] | None:
    """Softmax (``exp / sum exp``) or log-softmax (``shifted - log sum exp``) at exp ``i``."""
    shift = _max_shift(g, g.eqns[i].invars[0])
    if shift is None:
        return None
    group, x, axis = shift
    e = g.eqns[i].outvars[0]
    r = next(
        (j for j, _ in g.consumers.get(e, []) if g.eqns[j].primitive.name == "reduce_sum"),
        None,
    )
    if r is None:
        return None
    total, group = g.eqns[r].outvars[0], group | {i, r}
    b = g.sole_consumer(total, "broadcast_in_dim")
    if b is not None:
        group.add(b[0])
        total = g.eqns[b[0]].outvars[0]
    for j, pos in g.consumers.get(total, []):
        eqn = g.eqns[j]
        if eqn.primitive.name == "div" and pos == 1 and eqn.invars[0] is e:
            return "softmax", group | {j}, x, eqn.outvars[0], axis
        if eqn.primitive.name == "log":
            use = g.sole_consumer(eqn.outvars[0], "sub")
            shifted = g.eqns[i].invars[0]
            if use is not None and use[1] == 1 and g.eqns[use[0]].invars[0] is shifted:
                return "log_softmax", group | {j, use[0]}, x, g.eqns[use[0]].outvars[0], axis
    return None


def _call_kind(eqn: Any) -> str | None:
    """The op a named call (``jax.nn`` wraps some activations in jit/custom_jvp) is."""
    if eqn.primitive.name not in _CALL_PRIMS | {"custom_jvp_call"}:
        return None
    name = eqn.params.get("name", "")
    inner = eqn.params.get("call_jaxpr")
    if not name and inner is not None and len(inner.jaxpr.eqns) == 1:
        name = inner.jaxpr.eqns[0].params.get("name", "")  # custom_jvp(jit(f)) as in relu
    kinds = {"silu": "silu", "swish": "silu", "relu": "relu", "gelu": "gelu"}
    kinds |= {"log_softmax": "log_softmax", "softmax": "softmax", "_softmax": "softmax"}
    kind = kinds.get(name)
    ok = len(eqn.outvars) == 1 and eqn.invars and _is_float(eqn.invars[0])
    return kind if ok else None


def _inner_axis(eqn: Any) -> int | None:
    """The reduced axis of the first reduce_max in a call's body (a named softmax)."""
    closed = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    for inner in getattr(closed, "jaxpr", closed).eqns:
        if inner.primitive.name == "reduce_max" and len(inner.params["axes"]) == 1:
            return int(inner.params["axes"][0])
    return None


def _match_softcap(g: _Graph, i: int) -> tuple[set[int], Any, Any] | None:
    """Soft-capping at tanh ``i``: ``tanh(x / cap) * cap`` (Gemma's attention logits and
    final logits). It is close to the identity on values well below ``cap``, so it is left
    unchanged, and attention and readout matching see through it."""
    j = g.prod(g.eqns[i].invars[0], "mul", "div")
    use = g.sole_consumer(g.eqns[i].outvars[0], "mul")
    if j is None or use is None or (inner := _scalar_factor(g, j)) is None:
        return None
    outer = _scalar_factor(g, use[0])
    if outer is None or outer[0] is not g.eqns[i].outvars[0]:
        return None
    if inner[1] <= 0 or not math.isclose(inner[1] * outer[1], 1.0, rel_tol=1e-4):
        return None
    return {j, i, use[0]}, inner[0], g.eqns[use[0]].outvars[0]


def _softcap_input(g: _Graph, v: Any) -> Any:
    """``x`` when ``v`` is ``tanh(x / cap) * cap``, else None."""
    j = g.prod(v, "mul")
    if j is None:
        return None
    for u in g.eqns[j].invars:
        t = g.prod(u, "tanh")
        if t is not None and (m := _match_softcap(g, t)) is not None and m[2] is v:
            return m[1]
    return None


def _find_groups(g: _Graph) -> list[tuple[str, set[int], Any, Any, Any]]:
    """Recognised activations, softmaxes and named calls: (kind, eqns, x, out, axis)."""
    found: list[tuple[str, set[int], Any, Any, Any]] = []
    taken: set[int] = set()

    def add(kind: str, group: set[int], x: Any, out: Any, axis: Any = None) -> None:
        if not group & taken:
            found.append((kind, group, x, out, axis))
            taken.update(group)

    for i, eqn in enumerate(g.eqns):
        name = eqn.primitive.name
        if name == "tanh" and (m := _match_gelu_tanh(g, i)):
            add("gelu", *m)
        elif name == "tanh" and (m := _match_softcap(g, i)):
            add("softcap", *m)
        elif name in ("erf", "erfc") and (m := _match_gelu_erf(g, i)):
            add("gelu", *m)
        elif name == "exp" and (m := _match_softmax(g, i)):
            add(*m)
        elif (kind := _call_kind(eqn)) is not None:
            axis = _inner_axis(eqn) if "softmax" in kind else None
            if "softmax" not in kind or axis is not None:
                add(kind, {i}, eqn.invars[0], eqn.outvars[0], axis)
    for i, eqn in enumerate(g.eqns):  # after the composite patterns that contain them
        if i in taken or not (eqn.outvars and _is_float(eqn.outvars[0])):
            continue
        name = eqn.primitive.name
        if name == "logistic" and (m := _match_silu(g, i)):
            add("silu", *m)
        elif name in ("tanh", "logistic"):
            add(name, {i}, eqn.invars[0], eqn.outvars[0])
        elif name == "max" and (m := _match_relu(g, i)):
            add("relu", *m)
    return found


_PASS_THROUGH = {"convert_element_type", "reduce_precision", "copy", "copy_p"}
_MASK_CALLS = {"_where", "where"}


_SCALAR_FNS: dict[str, Callable[..., float]] = {
    "convert_element_type": lambda x: x,
    "sqrt": math.sqrt,
    "rsqrt": lambda x: 1.0 / math.sqrt(x),
    "neg": lambda x: -x,
    "mul": lambda x, y: x * y,
    "div": lambda x, y: x / y,
    "add": lambda x, y: x + y,
    "sub": lambda x, y: x - y,
}


def _scalar_value(g: _Graph, v: Any, depth: int = 4) -> float | None:
    """A scalar known at trace time: a literal, or a short chain of arithmetic on literals
    (``x / jnp.sqrt(d)`` traces as ``sqrt`` of a literal, then ``div``)."""
    if (c := _const(v)) is not None or isinstance(v, Literal) or depth == 0:
        return c
    j = g.producer.get(v)
    if j is None or getattr(v.aval, "shape", None) != ():
        return None
    eqn = g.eqns[j]
    fn = _SCALAR_FNS.get(eqn.primitive.name)
    args = [_scalar_value(g, u, depth - 1) for u in eqn.invars]
    if fn is None or any(a is None for a in args):
        return None
    try:
        value = float(fn(*args))
    except (ArithmeticError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _scalar_factor(g: _Graph, j: int) -> tuple[Any, float] | None:
    """For ``mul``/``div`` by a scalar known at trace time at ``j``: the other operand and
    the factor."""
    eqn = g.eqns[j]
    a, b = eqn.invars
    if eqn.primitive.name == "mul":
        if (c := _scalar_value(g, a)) is not None:
            return b, c
        if (c := _scalar_value(g, b)) is not None:
            return a, c
    elif eqn.primitive.name == "div" and (c := _scalar_value(g, b)) not in (None, 0.0):
        return a, 1.0 / c
    return None


def _through_scaling(g: _Graph, v: Any) -> float:
    """The product of the multiplies and divides by trace-time scalars ``v`` went through
    (shape ops between them allowed): the query scaling a model applies before ``q k^T``."""
    factor = 1.0
    for _ in range(8):
        j = g.prod(v, *_SHAPE_OPS, "mul", "div")
        if j is None:
            break
        if g.eqns[j].primitive.name in _SHAPE_OPS:
            v = g.eqns[j].invars[0]
        elif (fc := _scalar_factor(g, j)) is not None:
            v, c = fc
            factor *= c
        else:
            break
    return factor


def _logits_source(g: _Graph, v: Any, depth: int = 10) -> tuple[int, float, bool] | None:
    """From a softmax input back to the ``q k^T`` dot_general: its index, the scalar factor
    applied to its output, and whether a mask (select or additive) was applied."""
    if depth == 0 or isinstance(v, Literal) or v not in g.producer:
        return None
    j = g.producer[v]
    eqn = g.eqns[j]
    name = eqn.primitive.name
    if name == "dot_general":
        return j, 1.0, False
    if name in _PASS_THROUGH or name in ("reshape", "transpose"):
        return _logits_source(g, eqn.invars[0], depth - 1)
    if (capped := _softcap_input(g, v)) is not None:
        return _logits_source(g, capped, depth - 1)
    if name in ("mul", "div") and (fc := _scalar_factor(g, j)) is not None:
        found = _logits_source(g, fc[0], depth - 1)
        return None if found is None else (found[0], found[1] * fc[1], found[2])
    call = name in _CALL_PRIMS and eqn.params.get("name") in _MASK_CALLS
    if name in ("select_n", "add") or call:
        operands = eqn.invars[1:] if name == "select_n" else eqn.invars
        hits = [
            hit
            for u in operands
            if not isinstance(u, Literal) and _is_float(u)
            for hit in [_logits_source(g, u, depth - 1)]
            if hit is not None
        ]
        if len(hits) == 1:
            return hits[0][0], hits[0][1], True
    return None


def _match_attention(
    g: _Graph, x: Any, out: Any, axis: int
) -> tuple[int, int, int, float, bool] | None:
    """``softmax(c · q k^T [masked]) v`` around a softmax over ``axis`` of ``x``:
    ``(qk index, pv index, v position, c, masked)``."""
    found = _logits_source(g, x)
    if found is None:
        return None
    qk, c, masked = found
    qk_eqn = g.eqns[qk]
    c *= _through_scaling(g, qk_eqn.invars[0]) * _through_scaling(g, qk_eqn.invars[1])
    probs, axis = out, axis % len(x.aval.shape)
    # (grouped-query attention reshapes the probabilities to 5-D before the product)
    while (use := g.sole_consumer(probs, *_PASS_THROUGH, "reshape")) is not None:
        nxt = g.eqns[use[0]].outvars[0]
        if g.eqns[use[0]].primitive.name == "reshape":
            before, after = probs.aval.shape, nxt.aval.shape
            if axis != len(before) - 1 or after[-1:] != before[-1:]:
                return None  # only a reshape that keeps the keys' axis last is followed
            axis = len(after) - 1
        probs = nxt
    use = g.sole_consumer(probs, "dot_general")
    if use is None:
        return None
    pv, pos = use
    contracting = g.eqns[pv].params["dimension_numbers"][0][pos]
    if tuple(contracting) != (axis,):
        return None
    return qk, pv, 1 - pos, c, masked


# -- the analysis ------------------------------------------------------------------------


# What an input of a jaxpr is to the analysis: a parameter (an input of the function, or a
# value computed from parameters by shape-only ops), an activation, or a constant (a key,
# a literal, or a value computed from those alone: random numbers, masks, positions).
PARAM, ACT, CONST = "param", "act", "const"


_PARAM_ARITHMETIC = {"add", "sub", "mul", "div", "neg"}


def _param_like(g: _Graph, flags: Sequence[str]) -> dict[Any, bool]:
    """Variables that are inputs (or consts) seen through shape-only ops, or through
    arithmetic whose other operands are literals or parameters too: parameters."""
    out: dict[Any, bool] = {v: True for v in g.jaxpr.constvars}
    out.update((v, f == PARAM) for v, f in zip(g.jaxpr.invars, flags, strict=True))
    for eqn in g.eqns:
        name = eqn.primitive.name
        floats = [v for v in eqn.invars if not isinstance(v, Literal) and _is_float(v)]
        # shape ops, and arithmetic of parameters with literals or other parameters
        # (Gemma's ``1 + scale`` gain), keep a parameter a parameter
        kept = name in _SHAPE_OPS or name in _PARAM_ARITHMETIC
        like = kept and bool(floats) and all(out.get(v, False) for v in floats)
        for v in eqn.outvars:
            out[v] = like
    return out


def _live(g: _Graph, flags: Sequence[str]) -> dict[Any, bool]:
    """Variables that depend on a parameter or an activation. The others (random numbers
    from a key, masks and positions from constants) are never rewritten: the add inside
    ``jax.random.uniform`` is not a residual add."""
    out: dict[Any, bool] = {v: True for v in g.jaxpr.constvars}
    out.update((v, f != CONST) for v, f in zip(g.jaxpr.invars, flags, strict=True))
    for eqn in g.eqns:
        live = any(out.get(v, False) for v in eqn.invars if not isinstance(v, Literal))
        for v in eqn.outvars:
            out[v] = live
    return out


def _flag(v: Any, param_like: dict[Any, bool], live: dict[Any, bool]) -> str:
    if isinstance(v, Literal) or not live.get(v, False):
        return CONST
    return PARAM if param_like.get(v) else ACT


def _ancestors(g: _Graph) -> tuple[dict[Any, int], dict[Any, int]]:
    """Each variable's ancestors (itself included) as a bitset over variables, and each
    variable's bit index."""
    index: dict[Any, int] = {}
    anc: dict[Any, int] = {}
    for v in [*g.jaxpr.constvars, *g.jaxpr.invars]:
        index[v] = len(index)
        anc[v] = 1 << index[v]
    for eqn in g.eqns:
        parents = 0
        for v in eqn.invars:
            if not isinstance(v, Literal):
                parents |= anc.get(v, 0)
        for v in eqn.outvars:
            index[v] = len(index)
            anc[v] = parents | (1 << index[v])
    return anc, index


def _loss_mean(g: _Graph, out: Any, depth: int = 12) -> int | None:
    """Downstream of a log-softmax: ``div(reduce_sum(...) -> scalar, N)``, the mean."""
    frontier, seen = [out], set()
    for _ in range(depth):
        nxt = []
        for v in frontier:
            for j, _pos in g.consumers.get(v, []):
                if j in seen:
                    continue
                seen.add(j)
                eqn = g.eqns[j]
                num = eqn.invars[0]
                c = _const(eqn.invars[1]) if len(eqn.invars) == 2 else None
                if (
                    eqn.primitive.name == "div"
                    and c is not None
                    and c > 0
                    and g.prod(num, "reduce_sum") is not None
                    and getattr(num.aval, "shape", None) == ()
                ):
                    return j
                nxt.extend(eqn.outvars)
        frontier = nxt
    return None


def _readout(g: _Graph, logits: Any) -> int | None:
    """The dot_general whose output reaches ``logits`` through shape-only ops (and a
    soft-cap)."""
    v = logits
    while True:
        if (capped := _softcap_input(g, v)) is not None:
            v = capped
            continue
        j = g.prod(v, *_SHAPE_OPS, "dot_general")
        if j is None:
            return None
        if g.eqns[j].primitive.name == "dot_general":
            return j
        v = g.eqns[j].invars[0]


def _dot_dims(eqn: Any) -> tuple[int, int, int, bool, bool]:
    """``(k, lhs_free, rhs_free, lhs_batched, rhs_batched)`` of a dot_general."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    ls, rs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    k = math.prod(ls[d] for d in lc)
    lhs_free = math.prod(ls) // max(k * math.prod(ls[d] for d in lb), 1)
    rhs_free = math.prod(rs) // max(k * math.prod(rs[d] for d in rb), 1)
    return k, lhs_free, rhs_free, bool(lb), bool(rb)


def _match_dropout(g: _Graph, i: int, live: dict) -> tuple[int, float] | None:
    """Inverted dropout as Flax and hand-written code spell it: ``x / keep`` selected by
    a mask computed from a key (not from activations) against zeros: ``select_n(mask,
    0, x / keep)`` or ``jnp.where(mask, x / keep, 0)``. Returns the select (or where
    call) and ``keep``."""
    eqn = g.eqns[i]
    if eqn.primitive.name != "div" or not live.get(eqn.invars[0]):
        return None
    keep = _scalar_value(g, eqn.invars[1])
    if keep is None or not 0 < keep < 1:
        return None
    use = g.consumers.get(eqn.outvars[0], [])
    if len(use) != 1:
        return None
    j, pos = use[0]
    sel = g.eqns[j]
    is_where = sel.primitive.name in _CALL_PRIMS and sel.params.get("name") in _MASK_CALLS
    if sel.primitive.name != "select_n" and not is_where:
        return None
    others = [v for k, v in enumerate(sel.invars) if k != pos]
    if len(others) != 2 or any(not isinstance(v, Literal) and live.get(v) for v in others):
        return None  # the mask and the zeros come from constants (a key) alone
    return j, keep


def _residual_operands(
    g: _Graph, eqn: Any, anc: dict, index: dict, live: dict
) -> tuple[int, int] | None:
    """``(skip_pos, residual_pos)`` when ``eqn`` is a residual add: an add of two
    activations one of which is an ancestor of the other."""
    if eqn.primitive.name not in ("add", "add_any") or len(eqn.invars) != 2:
        return None
    a, b = eqn.invars
    if any(isinstance(v, Literal) for v in (a, b)) or not (live.get(a) and live.get(b)):
        return None
    if not (eqn.outvars and _is_float(eqn.outvars[0])):
        return None
    for skip, res, skip_pos, res_pos in ((a, b, 0, 1), (b, a, 1, 0)):
        if anc.get(res, 0) >> index[skip] & 1:
            return skip_pos, res_pos
    return None


def _residual_adds(
    g: _Graph, grouped: set[int], anc: dict, index: dict, live: dict
) -> dict[int, tuple[int, int]]:
    """The residual adds outside recognised ops: eqn index -> operand positions."""
    found = {}
    for i, eqn in enumerate(g.eqns):
        if i not in grouped and (pos := _residual_operands(g, eqn, anc, index, live)):
            found[i] = pos
    return found


def _constrained(
    g: _Graph, residuals: dict[int, Any], anc: dict, index: dict, everywhere: bool
) -> set[int]:
    """Eqns that have a residual add downstream (the residual adds included), or all of
    them when ``everywhere``. The library's `unit_scale` unconstrains every op after the
    last residual add: no skip connection needs their two scales tied, and untied
    scales keep both the output and the gradients unit."""
    if everywhere:
        return set(range(len(g.eqns)))
    upstream = 0
    for i in residuals:
        upstream |= anc[g.eqns[i].outvars[0]]
    return {
        i
        for i, eqn in enumerate(g.eqns)
        if any(upstream >> index[v] & 1 for v in eqn.outvars if v in index)
    }


def _analyse(
    jaxpr: Any,
    flags: Sequence[str],
    opts: _Options,
    log: list[Rewrite],
    before_residual: bool = False,
) -> _Plan:
    """Find the ops of one jaxpr to rewrite and the constants to apply.
    ``before_residual``: the enclosing call has a residual add downstream."""
    g = _Graph(jaxpr)
    plan = _Plan(param_like=_param_like(g, flags), live=_live(g, flags))
    pl, live = plan.param_like, plan.live
    readouts: set[int] = set()
    groups = _find_groups(g)
    anc, index = _ancestors(g)
    grouped = set().union(*(group for _, group, *_ in groups)) if groups else set()
    plan.residuals = _residual_adds(g, grouped, anc, index, live)
    plan.constrained = _constrained(g, plan.residuals, anc, index, before_residual)

    def constraint(i: int) -> str | None:
        return opts.constraint if i in plan.constrained else None

    def scale_group(group: set[int], x: Any, out: Any, o: float, s: float) -> None:
        for j in group:
            for pos, v in enumerate(g.eqns[j].invars):
                if v is x:
                    plan.operand[(j, pos)] = (1.0, s)
        if o != 1.0:
            plan.output[out] = o

    for kind, group, x, out, axis in groups:
        first = g.eqns[min(group)]
        prims = tuple(g.eqns[j].primitive.name for j in sorted(group))
        if len(group) == 1 and first.primitive.name in _CALL_PRIMS | {"custom_jvp_call"}:
            plan.call_groups.add(min(group))
        plan.grouped.update(group)
        if kind == "softcap" or not live.get(x, False):
            continue  # soft-capping, or computed from constants alone: left as it is
        if kind == "log_softmax":
            mean = _loss_mean(g, out)
            if mean is None:
                continue  # a log-softmax that is not a loss: run unchanged
            vocab = x.aval.shape[axis]
            s = cross_entropy_grad_scale(vocab)
            scale_group(group, x, out, 1.0, s)
            plan.loss_mean[mean] = 1.0 / _const(g.eqns[mean].invars[1])
            log.append(Rewrite("cross_entropy", prims, 1.0, (s,), _where(first)))
            if opts.readout and (r := _readout(g, x)) is not None:
                readouts.add(r)
            continue
        if kind == "softmax" and (att := _match_attention(g, x, out, axis)) is not None:
            _plan_attention(plan, g, group, att, x.aval.shape[axis], log)
            continue
        if kind == "softmax":
            o, s = softmax_scales(x.aval.shape[axis])
        elif kind == "gelu":
            o, s = gelu_scales()
        elif kind == "silu":
            o, s = silu_scales()
        else:
            o, s = ELEMENTWISE_SCALES[kind]
        o, s = apply_constraint(constraint(max(group)), o, s, op=f"unit_scale({kind})")
        scale_group(group, x, out, o, s)
        log.append(Rewrite(kind, prims, o, (s,), _where(first)))

    for i, eqn in enumerate(g.eqns):
        name = eqn.primitive.name
        if i in plan.grouped or not eqn.outvars or not _is_float(eqn.outvars[0]):
            continue
        if not live.get(eqn.outvars[0], False):
            continue
        if name == "dot_general":
            _plan_dot(plan, eqn, i, i in readouts, constraint(i), log)
        elif name == "div" and (drop := _match_dropout(g, i, live)) is not None:
            j, keep = drop
            s = keep**0.5  # U.dropout: kept values / sqrt(keep), forward and backward
            plan.operand[(i, 0)] = (1.0, s)
            plan.output[g.eqns[j].outvars[0]] = s
            log.append(Rewrite("dropout", ("div", g.eqns[j].primitive.name), s, (s,), _where(eqn)))
        elif name in ("add", "add_any") and not any(isinstance(v, Literal) for v in eqn.invars):
            _plan_add(plan, g, eqn, i, opts, log)
        elif name == "gather" and pl.get(eqn.invars[0]) and _size(eqn.outvars[0]):
            s = (_size(eqn.invars[0]) / _size(eqn.outvars[0])) ** 0.5
            plan.operand[(i, 0)] = (1.0, s)
            log.append(Rewrite("embedding", (name,), 1.0, (s,), _where(eqn)))
        if name in _BROADCASTING_OPS:
            for pos, v in enumerate(eqn.invars):
                like = not isinstance(v, Literal) and pl.get(v)
                copies = _size(eqn.outvars[0]) // max(_size(v), 1) if like else 1
                if copies > 1 and (i, pos) not in plan.operand:
                    plan.operand[(i, pos)] = (1.0, copies**-0.5)
                    log.append(
                        Rewrite("param_broadcast", (name,), 1.0, (copies**-0.5,), _where(eqn))
                    )
    return plan


def _plan_attention(
    plan: _Plan,
    g: _Graph,
    group: set[int],
    att: tuple[int, int, int, float, bool],
    seq_k: int,
    log: list[Rewrite],
) -> None:
    """`U.scaled_dot_product_attention`'s one scale on q, k, v gradients and the output;
    the two products and the softmax between them get no scales of their own."""
    qk, pv, v_pos, c, masked = att
    d = _dot_dims(g.eqns[qk])[0]
    s = attention_scale(seq_k, d, mult=c * d, is_causal=masked)
    plan.operand[(qk, 0)] = plan.operand[(qk, 1)] = (1.0, s)
    plan.operand[(pv, v_pos)] = (1.0, s)
    plan.output[g.eqns[pv].outvars[0]] = s
    plan.grouped.update({qk, pv})
    prims = tuple(g.eqns[j].primitive.name for j in sorted(group | {qk, pv}))
    log.append(Rewrite("attention", prims, s, (s, s, s), _where(g.eqns[qk])))


def _plan_dot(
    plan: _Plan, eqn: Any, i: int, readout: bool, constraint: str | None, log: list
) -> None:
    """Unit-scaled matmul, linear (one operand a parameter) or readout."""
    k, lhs_free, rhs_free, lb, rb = _dot_dims(eqn)
    out_s, lhs_s, rhs_s = dot_scales(k, lhs_free, rhs_free)
    lhs, rhs = eqn.invars
    weight = 1 if plan.param_like.get(rhs) and not rb else None
    if weight is None and plan.param_like.get(lhs) and not lb:
        weight = 0
    if weight is None:
        kind = "matmul"
        out_s, lhs_s, rhs_s = apply_constraint(constraint, out_s, lhs_s, rhs_s, op=kind)
    elif readout:
        kind, out_s = "readout", 1.0 / k
        plan.keep_output.add(eqn.outvars[0])
    else:
        kind = "linear"
        grads = [lhs_s, rhs_s]
        out_s, grads[1 - weight] = apply_constraint(constraint, out_s, grads[1 - weight])
        lhs_s, rhs_s = grads
    plan.operand[(i, 0)] = (1.0, lhs_s)
    plan.operand[(i, 1)] = (1.0, rhs_s)
    plan.output[eqn.outvars[0]] = out_s
    log.append(Rewrite(kind, ("dot_general",), out_s, (lhs_s, rhs_s), _where(eqn)))


def _affine_output(g: _Graph, v: Any, param_like: dict[Any, bool]) -> bool:
    """Whether ``v`` comes (through shape ops) from a dot_general or a multiply by a
    parameter: what a bias or a norm's shift is added to."""
    while (j := g.prod(v, *_SHAPE_OPS, "dot_general", "mul")) is not None:
        eqn = g.eqns[j]
        if eqn.primitive.name == "dot_general":
            return True
        if eqn.primitive.name == "mul":
            return any(param_like.get(u) for u in eqn.invars if not isinstance(u, Literal))
        v = eqn.invars[0]
    return False


def _weighted(g: _Graph, v: Any, live: dict[Any, bool]) -> bool:
    """``v`` is an activation times an array computed from constants alone (sin and cos
    of positions, a mask): a term of a combination with fixed coefficients."""
    j = g.prod(v, "mul")
    if j is None:
        return False
    return any(not isinstance(u, Literal) and not live.get(u, False) for u in g.eqns[j].invars)


def _plan_add(plan: _Plan, g: _Graph, eqn: Any, i: int, opts: _Options, log: list) -> None:
    """A residual add (one operand is an ancestor of the other) becomes
    residual_split/residual_add; a bias add (a parameter with one axis longer than 1, or
    any parameter added to a linear's or a norm's output: Flax's `DenseGeneral` bias is
    ``(heads, head_dim)``) keeps its value; any other add (of two activations, or of an
    activation and a table such as a positional embedding) is U.add, unless both terms
    are weighted by constants (a rotation such as RoPE keeps unit scale by itself)."""
    a, b = eqn.invars
    if not (plan.live.get(a) and plan.live.get(b)):
        return  # an activation plus a constant (a mask, a position table): its value
    if i in plan.residuals:
        skip_pos, res_pos = plan.residuals[i]
        res_s, skip_s = residual_scales(opts.tau)
        plan.operand[(i, skip_pos)] = (skip_s, skip_s)
        plan.operand[(i, res_pos)] = (res_s, 1.0)
        plan.default_read[eqn.invars[skip_pos]] = (1.0, res_s)
        plan.calibrated_output.add(eqn.outvars[0])
        log.append(Rewrite("residual", (eqn.primitive.name,), 1.0, (res_s, skip_s), _where(eqn)))
        return
    pl = plan.param_like
    if pl.get(a) and pl.get(b):
        return  # parameters combined: not an activation
    for param, act in ((a, b), (b, a)):
        if pl.get(param) and (_extent(param) <= 1 or _affine_output(g, act, pl)):
            return  # a bias (or a norm's shift) keeps its value
    if _weighted(g, a, plan.live) and _weighted(g, b, plan.live):
        return  # a combination with fixed coefficients (RoPE's x1·cos + x2·sin): its value
    s = 2**-0.5
    plan.output[eqn.outvars[0]] = s
    log.append(Rewrite("add", (eqn.primitive.name,), s, (1.0, 1.0), _where(eqn)))


# -- the interpreter ---------------------------------------------------------------------


def _scaled(x: Any, fwd: float, bwd: float) -> Any:
    if bwd != 1.0:
        x = scale_bwd(x, bwd)
    if fwd != 1.0:
        x = scale_fwd(x, fwd)
    return x


def _contains(jaxpr: Any, prim: str) -> bool:
    """Whether ``prim`` occurs in ``jaxpr`` or any of its sub-jaxprs."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == prim:
            return True
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            if _contains(sub, prim):
                return True
    return False


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


class _Interpreter:
    """Runs jaxprs with the rewrites of `_analyse`; records them in ``log``."""

    def __init__(self, opts: _Options, cal: Calibration | None = None):
        self.opts = opts
        self.log: list[Rewrite] = []
        self.before_residual = False  # the call being interpreted has a residual add after it
        self.cal = cal
        self.path: tuple = ()  # indices of the higher-order equations being interpreted
        self.keys: set[tuple] = set()  # calibration keys this trace looked up
        self.unrolling = False  # measuring inside a scan unrolled in Python
        self.iteration: dict[tuple, Any] = {}  # the current iteration's multipliers

    def _calibrated(self, key: tuple, val: Any, forward: bool, backward: bool) -> Any:
        """``val`` with the calibration's multipliers for ``key`` (measuring them first
        while calibrating)."""
        cal = self.cal
        self.keys.add(key)
        if forward:
            if cal.mode == "forward" and not isinstance(val, jax.core.Tracer):
                cal.forward[key] = _inverse(_rms(val))
            if (f := self._multiplier(key, "forward")) is not None:
                val = scale_fwd(val, f)
        if backward:
            if cal.mode == "backward":
                val = _gradient_tap(val, key, cal.backward)
            elif (f := self._multiplier(key, "backward")) is not None:
                val = scale_bwd(val, f)
        return val

    def _multiplier(self, key: tuple, kind: str) -> Any:
        """The ``kind`` ("forward" or "backward") multiplier of ``key``: the current
        scan iteration's (traced), else the calibration's; None where it is 1."""
        if (key, kind) in self.iteration:
            return self.iteration[(key, kind)]
        f = getattr(self.cal, kind).get(key, 1.0)
        return None if f == 1.0 else f

    def _iteration_multipliers(self, length: int) -> dict[tuple, np.ndarray]:
        """Per-iteration multipliers of the scan being interpreted (at ``self.path``), as
        arrays of ``length`` keyed by ``(generic key, "forward" | "backward")``."""
        prefix = self.path
        out: dict[tuple, np.ndarray] = {}
        for kind, table in (("forward", self.cal.forward), ("backward", self.cal.backward)):
            for (path, var), f in table.items():
                if len(path) <= len(prefix) or path[: len(prefix)] != prefix:
                    continue
                step = path[len(prefix)]
                if not (isinstance(step, tuple) and step[0] == _ITER):
                    continue
                key = ((*prefix, _ITER, *path[len(prefix) + 1 :]), var)
                out.setdefault((key, kind), np.ones(length, np.float32))[step[1]] = f
        return out

    def run_closed(self, closed: Any, args: Sequence[Any], flags: Sequence[str]) -> list[Any]:
        return self.run(closed.jaxpr, closed.consts, args, flags)

    def run(
        self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], flags: Sequence[str]
    ) -> list[Any]:
        plan = _analyse(jaxpr, flags, self.opts, self.log, self.before_residual)
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))
        cache: dict[tuple[Any, tuple[float, float]], Any] = {}
        define = self._definer(jaxpr, plan)
        for v in jaxpr.invars:
            env[v] = define(v, env[v])

        def read(v: Any, i: int, pos: int) -> Any:
            if isinstance(v, Literal):
                return v.val
            fb = plan.operand.get((i, pos), plan.default_read.get(v))
            if fb is None or fb == (1.0, 1.0):
                return env[v]
            if (v, fb) not in cache:
                cache[(v, fb)] = _scaled(env[v], *fb)
            return cache[(v, fb)]

        for i, eqn in enumerate(jaxpr.eqns):
            invals = [read(v, i, pos) for pos, v in enumerate(eqn.invars)]
            if i in plan.loss_mean:
                outvals = [scale_fwd(invals[0], plan.loss_mean[i])]
            elif i in plan.call_groups:
                outvals = bind_plain(eqn, invals)
            else:
                sub_flags = [_flag(v, plan.param_like, plan.live) for v in eqn.invars]
                outer, self.before_residual = self.before_residual, i in plan.constrained
                outer_path, self.path = self.path, (*self.path, i)
                try:
                    outvals = self.apply(eqn, invals, sub_flags)
                finally:
                    self.before_residual, self.path = outer, outer_path
            for v, out in zip(eqn.outvars, outvals, strict=True):
                env[v] = define(v, scale_fwd(out, plan.output[v]) if v in plan.output else out)
        return [read(v, -1, -1) for v in jaxpr.outvars]

    def _definer(self, jaxpr: Any, plan: _Plan) -> Callable[[Any, Any], Any]:
        """``define(var, value)``: the value a variable of ``jaxpr`` is bound to, with
        the calibration's multipliers (the value itself when not calibrating)."""
        if self.cal is None:
            return lambda v, val: val
        index = {
            v: n
            for n, v in enumerate(
                [*jaxpr.constvars, *jaxpr.invars, *(o for e in jaxpr.eqns for o in e.outvars)]
            )
        }
        forward = (set(plan.output) - plan.keep_output) | plan.calibrated_output
        read = {jaxpr.eqns[i].invars[pos] for i, pos in plan.operand} | set(plan.default_read)
        backward = {v for v in read if not isinstance(v, Literal)}
        path = self.path

        def define(v: Any, val: Any) -> Any:
            fwd, bwd = v in forward, v in backward
            if not (fwd or bwd) or not _is_float(v):
                return val
            return self._calibrated((path, index[v]), val, fwd, bwd)

        return define

    def apply(self, eqn: Any, invals: list[Any], flags: list[str]) -> list[Any]:
        """Bind ``eqn``, recursing into the bodies of higher-order primitives."""
        name, p = eqn.primitive.name, eqn.params
        if name in _CALL_PRIMS:
            closed = p.get("jaxpr", p.get("call_jaxpr"))
            with jax.named_scope(p.get("name") or name):
                if hasattr(closed, "consts"):
                    return self.run_closed(closed, invals, flags)
                return self.run(closed, [], invals, flags)
        if name == "custom_jvp_call" and _contains(p["call_jaxpr"].jaxpr, "dot_general"):
            return self.run_closed(p["call_jaxpr"], invals, flags)
        if name in ("checkpoint", "remat2"):
            body = functools.partial(self.run, p["jaxpr"], [], flags=flags)
            remat = jax.checkpoint(
                lambda *a: body(a), prevent_cse=p["prevent_cse"], policy=p["policy"]
            )
            return list(remat(*invals))
        if name == "scan":
            return self._scan(p, invals, flags)
        if name == "while":
            return self._while(p, invals, flags)
        if name == "cond":
            return self._cond(p, invals, flags)
        return bind_plain(eqn, invals)

    def _scan(self, p: dict, invals: list[Any], flags: list[str]) -> list[Any]:
        # a loop body feeds its next iteration: everything in it stays constrained
        self.before_residual = True
        nc, nk = p["num_consts"], p["num_carry"]
        consts, init, xs = invals[:nc], invals[nc : nc + nk], invals[nc + nk :]
        body_flags = [*flags[:nc], *([ACT] * nk), *flags[nc + nk :]]
        cal, length = self.cal, p["length"]
        if cal is not None and cal.mode != "apply" and not self.unrolling and length > 0:
            return self._scan_unrolled(p, consts, init, xs, body_flags)
        mult = {}
        if cal is not None and cal.mode == "apply" and not self.iteration:
            mult = self._iteration_multipliers(length)
        names = sorted(mult)
        path = (*self.path, _ITER)

        def step(carry: list, x: list) -> tuple[list, list]:
            x, m = x[: len(x) - len(names)], x[len(x) - len(names) :]
            outer = self.path, self.iteration
            self.path, self.iteration = path, dict(zip(names, m, strict=True)) or self.iteration
            try:
                outs = self.run_closed(p["jaxpr"], [*consts, *carry, *x], body_flags)
            finally:
                self.path, self.iteration = outer
            return outs[:nk], outs[nk:]

        carry, ys = lax.scan(
            step,
            init,
            [*xs, *(jnp.asarray(mult[n]) for n in names)],
            length=length,
            reverse=p["reverse"],
            unroll=p["unroll"],
        )
        return [*carry, *ys]

    def _scan_unrolled(
        self, p: dict, consts: list, init: list, xs: list, flags: list[str]
    ) -> list[Any]:
        """A scan run iteration by iteration in Python while calibrating, so that its
        body's values are concrete and each iteration gets multipliers of its own."""
        nk, length = p["num_carry"], p["length"]
        carry, ys = list(init), [None] * length
        outer = self.path
        self.unrolling = True
        try:
            for t in reversed(range(length)) if p["reverse"] else range(length):
                self.path = (*outer, (_ITER, t))
                outs = self.run_closed(p["jaxpr"], [*consts, *carry, *(x[t] for x in xs)], flags)
                carry, ys[t] = outs[:nk], outs[nk:]
        finally:
            self.path, self.unrolling = outer, False
        return [*carry, *(jnp.stack(column) for column in zip(*ys, strict=True))]

    def _while(self, p: dict, invals: list[Any], flags: list[str]) -> list[Any]:
        self.before_residual = True  # as for scan
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cc, bc, init = invals[:nc], invals[nc : nc + nb], invals[nc + nb :]
        bflags = [*flags[nc : nc + nb], *([ACT] * len(init))]

        def cond_fn(carry: list) -> Any:
            return jax.extend.core.jaxpr_as_fun(p["cond_jaxpr"])(*cc, *carry)[0]

        def body_fn(carry: list) -> list:
            return self.run_closed(p["body_jaxpr"], [*bc, *carry], bflags)

        return list(lax.while_loop(cond_fn, body_fn, list(init)))

    def _cond(self, p: dict, invals: list[Any], flags: list[str]) -> list[Any]:
        index, ops = invals[0], invals[1:]
        branches = [
            functools.partial(self._branch, n, b, flags[1:]) for n, b in enumerate(p["branches"])
        ]
        return list(lax.switch(index, branches, *ops))

    def _branch(self, n: int, closed: Any, flags: list[str], *args: Any) -> list[Any]:
        outer, self.path = self.path, (*self.path, n)
        try:
            return self.run_closed(closed, args, flags)
        finally:
            self.path = outer


# -- the public transform ----------------------------------------------------------------


def _replaced(leaves: Sequence[Any], positions: Sequence[int], vals: Sequence[Any]) -> list:
    """``leaves`` with the leaf at each of ``positions`` replaced by the matching value."""
    full = list(leaves)
    for i, val in zip(positions, vals, strict=True):
        full[i] = val
    return full


def _is_dynamic(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array | np.ndarray | np.generic) or hasattr(leaf, "aval")


def unit_scale(
    fn: Callable[..., Any],
    *,
    tau: float = 1.0,
    constraint: str | None = "to_output_scale",
    readout: bool = True,
    calibrate: Sequence[Any] | None = None,
) -> Callable[..., Any]:
    """Unit-scale ``fn`` automatically: the same function with unit-scaled ops.

    ``fn`` is traced to a jaxpr on its array arguments (other leaves are static) and
    interpreted: dot_generals become unit-scaled matmuls (linear when one operand is a
    parameter, the u-μP readout when it produces the logits of a recognised loss),
    ``softmax(c·q k^T [mask]) v`` becomes one unit-scaled attention, GELU, SiLU, ReLU,
    tanh, sigmoid and softmax get their unit scales, a log-softmax followed
    by a mean keeps its value and gets `U.cross_entropy`'s gradient scale, and an add
    whose operands share an ancestor becomes residual_split/residual_add with ``tau``.
    Weights are used as they are: initialise them with unit std. ``constraint`` ties
    each op's output and input-gradient scales as in `scalescope.unit`; ``readout=False``
    treats the logits projection as an ordinary linear.

    ``calibrate=(arg, ...)``: example positional arguments. The library's constants
    assume unit-normal data and large sizes; calibration measures, once, on these
    arguments (eagerly, op by op, in the order of the forward and then the backward
    pass), the RMS each rewritten op's output and each gradient of a value such an op
    reads actually has, and folds its inverse into the constants, so that on these
    arguments they are exactly 1. The constants stay static afterwards. The readout's
    logits keep their u-μP scale; a `lax.scan` is unrolled while measuring, so each
    iteration gets its own multipliers (scanned along with the loop's inputs); `cond`
    branches keep the library's constants. The measured multipliers are in the
    ``calibration`` attribute (a `Calibration`). It sets forward and backward scales
    independently, so it needs ``constraint=None``.

    The returned function has ``fn``'s signature and outputs, composes with `jax.jit`
    and `jax.grad`, and has a ``rewrites`` attribute: the list of `Rewrite` made by its
    latest trace.
    """
    if not callable(fn):
        raise TypeError(f"unit_scale: fn must be callable, got {type(fn).__name__}")
    if isinstance(tau, bool) or not (isinstance(tau, int | float) and math.isfinite(tau)):
        raise ValueError(f"unit_scale: tau must be a finite number >= 0, got {tau!r}")
    if tau < 0:
        raise ValueError(f"unit_scale: tau must be a finite number >= 0, got {tau!r}")
    validate_constraint(constraint, "unit_scale")
    opts = _Options(float(tau), constraint, bool(readout))
    cal = None
    if calibrate is not None:
        if not isinstance(calibrate, tuple | list):
            raise TypeError(
                "unit_scale: calibrate must be a tuple of example positional arguments "
                f"for fn, got {type(calibrate).__name__}"
            )
        if constraint is not None:
            raise ValueError(
                "unit_scale: calibrate= sets each forward and backward scale on its own, "
                f"which needs constraint=None; got constraint={constraint!r}"
            )
        cal = Calibration()

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        dyn = [i for i, leaf in enumerate(leaves) if _is_dynamic(leaf)]

        def flat_fn(*vals: Any) -> Any:
            a, k = jax.tree_util.tree_unflatten(treedef, _replaced(leaves, dyn, vals))
            return fn(*a, **k)

        dyn_vals = [leaves[i] for i in dyn]
        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*dyn_vals)
        interp = _Interpreter(opts, cal)
        flags = [PARAM if _is_float(v) else CONST for v in closed.jaxpr.invars]
        outs = interp.run_closed(closed, dyn_vals, flags)
        wrapped.rewrites = interp.log
        if cal is not None and cal.mode == "apply":
            missing = {_generic(k) for k in (*cal.forward, *cal.backward)} - interp.keys
            if missing:
                raise ValueError(
                    f"unit_scale: calibrated on a program with {len(missing)} values this "
                    "call does not have; call the function with arguments structured as "
                    "calibrate= (the same pytree, dtypes and ranks)"
                )
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)

    wrapped.rewrites = []
    if cal is not None:
        _calibrate(wrapped, cal, tuple(calibrate))
        wrapped.calibration = cal
    return wrapped


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


__all__ = ["ELEMENTWISE_SCALES", "Calibration", "Rewrite", "unit_scale"]
