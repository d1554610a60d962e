"""The pattern matchers of `unit_scale`: which equations of a jaxpr form one op to
rewrite (GELU, SiLU, ReLU, softmax, soft-capping, named `jax.nn` calls, attention), on
a `_Graph` of the jaxpr's producers and consumers. docs/unit.md ("unit_scale") lists
how each pattern is recognised.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from ..scalify import traverse

_SQRT_2_OVER_PI = math.sqrt(2 / math.pi)
_GELU_CUBIC = 0.044715
_INV_SQRT_2 = 2**-0.5

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
_CALL_PRIMS = traverse.PLAIN_CALLS


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


_ELEMENTWISE = _SHAPE_OPS | {"add", "sub", "mul", "div", "neg", "integer_pow", "square"}
_REDUCTIONS = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin"}


def _a_statistic(g: _Graph, v: Any, hops: int = 4) -> bool:
    """Whether ``v`` is computed, through a few elementwise ops, from reductions and
    constants only: a statistic (a variance ``mean(x²) - mean(x)²``), not an activation
    (``h - mean(h)`` still holds ``h`` itself)."""
    if isinstance(v, Literal):
        return True
    if v not in g.producer:
        return False  # an input of the function: a tensor
    eqn = g.eqns[g.producer[v]]
    if eqn.primitive.name in _REDUCTIONS:
        return True
    if hops == 0 or eqn.primitive.name not in _ELEMENTWISE:
        return False
    return all(_a_statistic(g, u, hops - 1) for u in eqn.invars)


def _total(eqn: Any) -> bool:
    """A reduction over every axis of its operand (a loss's sum or mean), whatever the
    batch size."""
    axes = eqn.params.get("axes", ())
    return eqn.primitive.name in _REDUCTIONS and len(axes) == len(eqn.invars[0].aval.shape)


def _only_into_a_total(g: _Graph, v: Any, hops: int = 4) -> bool:
    """Whether every use of ``v`` flows, through a few elementwise ops, into a reduction
    over all its axes: a loss term (a hinge loss's ``mean(max(0, 1 - y·f))``), not an
    activation (one also used by a matmul, or returned, is one)."""
    outputs = set(map(id, g.jaxpr.outvars))
    frontier, reached = [v], False
    for _ in range(hops):
        nxt = []
        for u in frontier:
            uses = g.consumers.get(u, [])
            if id(u) in outputs or not uses:
                return False
            for j, _ in uses:
                eqn = g.eqns[j]
                if _total(eqn):
                    reached = True
                elif eqn.primitive.name in _ELEMENTWISE:
                    nxt += eqn.outvars
                else:
                    return False
        frontier = nxt
    return reached and not frontier


#: Ops that compute each element from the same element of their operands.
#: (Not slices, transposes or reshapes: two slices of one tensor added are two values.)
_POINTWISE = {
    "add", "sub", "mul", "div", "neg", "integer_pow", "square", "min", "max", "abs", "sign",
    "exp", "exp2", "expm1", "log", "log1p", "log2", "tanh", "logistic", "erf", "sqrt", "rsqrt",
    "one_minus_square",
    "select_n", "gt", "ge", "lt", "le", "eq", "ne", "convert_element_type", "copy", "copy_p",
    "reduce_precision",
}  # fmt: skip


def pointwise_root(g: _Graph, v: Any, hops: int = 8) -> Any:
    """The one variable ``v`` is computed from by pointwise ops (and constants) alone, or
    None: ``max(x, 0)`` and ``expm1(min(x, 0))`` both have root ``x``."""
    if isinstance(v, Literal):
        return None
    if v not in g.producer or hops == 0:
        return v
    eqn = g.eqns[g.producer[v]]
    if eqn.primitive.name not in _POINTWISE:
        return v
    roots = [pointwise_root(g, u, hops - 1) for u in eqn.invars if not isinstance(u, Literal)]
    if not roots or any(r is None or r is not roots[0] for r in roots):
        return None
    return roots[0]


def branches_of_one_input(g: _Graph, a: Any, b: Any) -> bool:
    """Two terms computed pointwise from one variable: the branches of a piecewise (or
    compound) activation, such as CELU's ``max(x, 0) + expm1(min(x, 0))``. Their sum is
    the activation; scaling a branch or the sum as two activations would change it."""
    ra, rb = pointwise_root(g, a), pointwise_root(g, b)
    return ra is not None and ra is rb and a is not ra and b is not rb


def _made_by(g: _Graph, v: Any, prim: str) -> bool:
    """``v`` is (through shape ops) the output of a ``prim`` equation."""
    while (j := g.prod(v, *_SHAPE_OPS, prim)) is not None:
        if g.eqns[j].primitive.name == prim:
            return True
        v = g.eqns[j].invars[0]
    return False


def one_hot(g: _Graph, v: Any) -> bool:
    """``v`` is a one-hot array: `jax.nn.one_hot`'s call, or indices compared (``eq``) with
    an ``iota`` and converted to float, through shape ops: a lookup when multiplied into a
    table."""
    while (j := g.prod(v, *_SHAPE_OPS, "eq", *_CALL_PRIMS)) is not None:
        eqn = g.eqns[j]
        if eqn.primitive.name == "eq":
            return any(_made_by(g, u, "iota") for u in eqn.invars)  # the class indices
        if eqn.primitive.name in _CALL_PRIMS:
            return eqn.params.get("name") in ("_one_hot", "one_hot")
        v = eqn.invars[0]
    return False


def stopped(g: _Graph, v: Any) -> bool:
    """``v`` is (through shape ops) a ``stop_gradient``: a shift for numerical stability
    (logsumexp's ``max + log(sum(exp(x - max)))``), not a branch of the model."""
    return _made_by(g, v, "stop_gradient")


def _a_branch(g: _Graph, out: Any) -> bool:
    """``out`` is added to (or subtracted from) another term of the same input."""
    uses = g.consumers.get(out, [])
    if len(uses) != 1 or g.eqns[uses[0][0]].primitive.name not in ("add", "sub"):
        return False
    j, pos = uses[0]
    return branches_of_one_input(g, out, g.eqns[j].invars[1 - pos])


def _not_an_activation(g: _Graph, x: Any, out: Any) -> bool:
    """``max(x, 0)`` (or ``jax.nn.relu``) that clamps a statistic, is a loss term, or is one
    branch of a piecewise activation (CELU, ELU written with max): the ReLU's unit scale
    (√2, for unit-normal inputs) would change its value."""
    return _a_statistic(g, x) or _only_into_a_total(g, out) or _a_branch(g, out)


def _match_relu(g: _Graph, i: int) -> tuple[set[int], Any, Any] | None:
    """``max(x, 0)`` as an activation: not a clamp of a statistic (a norm's variance,
    ``max(var, 0)``) nor a loss term reduced to one number (a hinge loss)."""
    x = _with_const(g, i, 0.0)
    if x is None or isinstance(x, Literal):
        return None
    out = g.eqns[i].outvars[0]
    if _not_an_activation(g, x, out):
        return None
    return {i}, x, out


def _axis_of(g: _Graph, x: Any, y: Any, axis: int) -> int | None:
    """``y``'s ``axis`` as an axis of ``x``, when ``x`` is ``y`` or a transpose of it (JAX's
    non-causal ``dot_product_attention`` transposes the logits and their max apart
    before it subtracts one from the other)."""
    if x is y:
        return axis
    t = g.prod(x, "transpose")
    if t is None or g.eqns[t].invars[0] is not y:
        return None
    return tuple(g.eqns[t].params["permutation"]).index(axis)


def _max_shift(g: _Graph, shifted: Any) -> tuple[set[int], Any, int] | None:
    """``x - stop_gradient(max(x))``: the eqns, ``x`` and the reduced axis."""
    s = g.prod(shifted, "sub")
    if s is None:
        return None
    x, m = g.eqns[s].invars
    group, v = {s}, m
    walk = ("stop_gradient", "broadcast_in_dim", "transpose", "max", "select_n", "reduce_max")
    while (j := g.prod(v, *walk)) is not None:
        group.add(j)
        eqn = g.eqns[j]
        if eqn.primitive.name == "reduce_max":
            axes = eqn.params["axes"]
            axis = None if len(axes) != 1 else _axis_of(g, x, eqn.invars[0], int(axes[0]))
            return None if axis is None else (group, x, axis)
        if eqn.primitive.name == "select_n":  # logsumexp's max, or 0 where it is not finite
            v = eqn.invars[-1]
            continue
        v = eqn.invars[1] if eqn.primitive.name == "max" and _const(eqn.invars[0]) else None
        v = v if v is not None else eqn.invars[0]
    return None


def _stopped_in(g: _Graph, group: set[int]) -> set[Any]:
    """The outputs of the ``stop_gradient`` equations of ``group``."""
    return {g.eqns[j].outvars[0] for j in group if g.eqns[j].primitive.name == "stop_gradient"}


def _match_softmax(g: _Graph, i: int) -> tuple[str, set[int], Any, Any, int] | None:
    """Softmax (``exp / sum exp``), log-softmax (``shifted - log sum exp``) or logsumexp
    (``max + log sum exp(x - max)``, as `jax.nn.logsumexp` is inlined) at exp ``i``."""
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
        if eqn.primitive.name == "abs" and (log := g.sole_consumer(eqn.outvars[0], "log")):
            j, eqn, group = log[0], g.eqns[log[0]], group | {j}  # logsumexp's |sum|
        if eqn.primitive.name == "log":
            use = g.sole_consumer(eqn.outvars[0], "sub")
            shifted = g.eqns[i].invars[0]
            if use is not None and use[1] == 1 and g.eqns[use[0]].invars[0] is shifted:
                return "log_softmax", group | {j, use[0]}, x, g.eqns[use[0]].outvars[0], axis
            add = g.sole_consumer(eqn.outvars[0], "add")
            if add is not None and g.eqns[add[0]].invars[1 - add[1]] in _stopped_in(g, group):
                return "logsumexp", group | {j, add[0]}, x, g.eqns[add[0]].outvars[0], axis
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
            if kind == "relu" and _not_an_activation(g, eqn.invars[0], eqn.outvars[0]):
                continue
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


def _random(g: _Graph, v: Any, hops: int = 8) -> bool:
    """``v`` is drawn at random: computed, within a few equations, from ``random_bits`` or
    a call named like ``jax.random.bernoulli``'s (not a causal mask, which is fixed)."""
    frontier = [v]
    for _ in range(hops):
        nxt = []
        for u in frontier:
            if isinstance(u, Literal) or u not in g.producer:
                continue
            eqn = g.eqns[g.producer[u]]
            if eqn.primitive.name == "random_bits" or "bernoulli" in str(
                eqn.params.get("name", "")
            ):
                return True
            nxt.extend(eqn.invars)
        frontier = nxt
    return False


def _dropout_multiplier(g: _Graph, v: Any, hops: int = 6) -> bool:
    """``v`` is a dropout multiplier: a random boolean mask converted to float, through
    shape ops and multiplies or divides by literals (Flax's ``keep / keep_prob``)."""
    for _ in range(hops):
        if isinstance(v, Literal) or v not in g.producer:
            return False
        eqn = g.eqns[g.producer[v]]
        name = eqn.primitive.name
        if name == "convert_element_type" and eqn.invars[0].aval.dtype == np.bool_:
            return _random(g, eqn.invars[0])
        if name in ("mul", "div") and (
            _const(eqn.invars[1]) is not None or _const(eqn.invars[0]) is not None
        ):
            v = eqn.invars[0] if _const(eqn.invars[1]) is not None else eqn.invars[1]
        elif name in _SHAPE_OPS:
            v = eqn.invars[0]
        else:
            return False
    return False


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
    # (grouped-query attention reshapes the probabilities to 5-D before the product;
    # dropout multiplies them by a mask)
    while (use := g.sole_consumer(probs, *_PASS_THROUGH, "reshape", "mul")) is not None:
        nxt = g.eqns[use[0]].outvars[0]
        if g.eqns[use[0]].primitive.name == "mul":
            mask = g.eqns[use[0]].invars[1 - use[1]]
            if not _dropout_multiplier(g, mask) or nxt.aval.shape != probs.aval.shape:
                return None
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
