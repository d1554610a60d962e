"""The planning of `unit_scale`: from the patterns found in one jaxpr, which ops to
rewrite and which constants to apply (`_analyse`, a `_Plan`), and the `Rewrite` record
of each.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from jax.extend.core import Literal

from .constraints import apply_constraint
from .functional import (
    attention_scale,
    cross_entropy_grad_scale,
    dot_scales,
    gelu_scales,
    residual_scales,
    silu_scales,
    softmax_scales,
)
from .patterns import (
    _CALL_PRIMS,
    _MASK_CALLS,
    _SHAPE_OPS,
    _const,
    _extent,
    _find_groups,
    _Graph,
    _is_float,
    _match_attention,
    _scalar_value,
    _size,
    _softcap_input,
    _where,
    branches_of_one_input,
    one_hot,
    stopped,
)


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

_BROADCASTING_OPS = {"broadcast_in_dim", "add", "sub", "mul", "div", "max", "min"}


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


#: The calls `jnp.take_along_axis` and `jnp.take` trace as (a gather inside each).
_TAKE_CALLS = {"take_along_axis", "_take", "take"}


def _logsumexp_loss(g: _Graph, x: Any, lse: Any) -> tuple[tuple[int, int], int] | None:
    """``mean(logsumexp(x) - x[label])`` (optax's integer-label cross-entropy): the
    ``(eqn, operand)`` where the label's logit is read from ``x`` (a gather, or a call
    such as ``take_along_axis`` around one, through shape ops) and the mean's index."""
    use = g.sole_consumer(lse, "sub")
    if use is None or use[1] != 0:
        return None
    v = g.eqns[use[0]].invars[1]
    for _ in range(8):
        j = g.producer.get(v)
        if j is None or isinstance(v, Literal):
            return None
        eqn = g.eqns[j]
        name = eqn.primitive.name
        take = name in _CALL_PRIMS and eqn.params.get("name") in _TAKE_CALLS
        if name not in _SHAPE_OPS and name != "gather" and not take:
            return None
        if eqn.invars[0] is x:
            mean = _loss_mean(g, g.eqns[use[0]].outvars[0])
            return None if mean is None else ((j, 0), mean)
        v = eqn.invars[0]
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
    if not (eqn.outvars and _is_float(eqn.outvars[0])) or stopped(g, a) or stopped(g, b):
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
        if kind in ("log_softmax", "logsumexp"):
            # the two spellings of a cross-entropy: log_softmax(x)[label], or
            # logsumexp(x) - x[label] (whose label pick reads x outside the group)
            if kind == "log_softmax":
                pick, mean = None, _loss_mean(g, out)
            else:
                pick, mean = _logsumexp_loss(g, x, out) or (None, None)
            if mean is None:
                continue  # not a loss: run unchanged
            s = cross_entropy_grad_scale(x.aval.shape[axis])
            scale_group(group, x, out, 1.0, s)
            if pick is not None:
                plan.operand[pick] = (1.0, s)
                plan.grouped.add(pick[0])  # the label's logit: not an embedding lookup
                if g.eqns[pick[0]].primitive.name in _CALL_PRIMS:
                    plan.call_groups.add(pick[0])
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
        if name == "dot_general" and (pos := _one_hot_lookup(g, eqn, pl)) is not None:
            s = (_size(eqn.invars[pos]) / max(_size(eqn.outvars[0]), 1)) ** 0.5
            plan.operand[(i, pos)] = (1.0, s)  # U.embedding's table gradient
            log.append(Rewrite("embedding", (name,), 1.0, (s,), _where(eqn)))
        elif name == "dot_general":
            _plan_dot(plan, eqn, i, i in readouts, constraint(i), log)
        elif name == "conv_general_dilated":
            _plan_conv(plan, eqn, i, constraint(i), log)
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


def _one_hot_lookup(g: _Graph, eqn: Any, param_like: dict[Any, bool]) -> int | None:
    """For ``one_hot(ids) @ table`` (a lookup written as a product, as TPU code does): the
    table's operand position."""
    for pos in (1, 0):
        if param_like.get(eqn.invars[pos]) and one_hot(g, eqn.invars[1 - pos]):
            return pos
    return None


def _plan_conv(plan: _Plan, eqn: Any, i: int, constraint: str | None, log: list) -> None:
    """A convolution by a kernel parameter, as `U.conv1d` scales it in any number of
    spatial dimensions: output ``(in / groups * kernel)^-1/2``, input gradient
    ``(stride * groups / (out * kernel))^1/2``, kernel gradient ``positions^-1/2`` (the
    output's positions over every batch row). Others (two activations, a transposed or
    batch-grouped convolution, the forms JAX's own gradients take) are not unit-scaled,
    and the log says so."""
    p = eqn.params
    lhs, rhs = eqn.invars
    dims = p["dimension_numbers"]
    plain = all(d == 1 for d in p.get("lhs_dilation") or ()) and p.get("batch_group_count", 1) == 1
    if not (plan.param_like.get(rhs) and plain):  # (a data input is param-like too)
        kind = "conv (not unit-scaled)"
        log.append(Rewrite(kind, ("conv_general_dilated",), 1.0, (), _where(eqn)))
        return
    shape = rhs.aval.shape
    out_features, in_per_group = shape[dims.rhs_spec[0]], shape[dims.rhs_spec[1]]
    kernel = math.prod(shape[d] for d in dims.rhs_spec[2:])
    groups = p.get("feature_group_count", 1)
    stride = math.prod(p.get("window_strides") or (1,))
    if not (out_features and in_per_group and kernel):
        return  # an empty convolution: nothing to scale
    out_shape = eqn.outvars[0].aval.shape
    positions = max(math.prod(out_shape) // max(out_shape[dims.out_spec[1]], 1), 1)
    out_s, x_s = apply_constraint(
        constraint,
        (in_per_group * kernel) ** -0.5,
        (stride * groups / (out_features * kernel)) ** 0.5,
        op="conv",
    )
    w_s = positions**-0.5
    plan.operand[(i, 0)] = (1.0, x_s)
    plan.operand[(i, 1)] = (1.0, w_s)
    plan.output[eqn.outvars[0]] = out_s
    log.append(Rewrite("conv", ("conv_general_dilated",), out_s, (x_s, w_s), _where(eqn)))


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
    if stopped(g, a) or stopped(g, b) or branches_of_one_input(g, a, b):
        return  # logsumexp's shift, or the branches of one piecewise activation: its value
    for param, act in ((a, b), (b, a)):
        if pl.get(param) and (_extent(param) <= 1 or _affine_output(g, act, pl)):
            return  # a bias (or a norm's shift) keeps its value
    if _weighted(g, a, plan.live) and _weighted(g, b, plan.live):
        return  # a combination with fixed coefficients (RoPE's x1·cos + x2·sin): its value
    s = 2**-0.5
    plan.output[eqn.outvars[0]] = s
    log.append(Rewrite("add", (eqn.primitive.name,), s, (1.0, 1.0), _where(eqn)))
