"""Higher-order primitives: interpreted recursively, never rejected.

``jit`` and the custom-derivative calls are inlined (their primal jaxpr is interpreted in
place, under the call's name). ``scan``, ``while`` and ``cond`` are rebuilt with
`jax.lax` control flow whose bodies interpret the original sub-jaxprs, so scaled values
flow through loops and branches. Taking the equations apart and rebinding them is
`traverse`'s (shared with unit_scale); the rules here add what is scalify's own.

Loop carries keep a stable structure: a carry that is scaled on the way in is scaled on
the way out. Which carries must be scaled is found by a fixpoint: trace the body, and if
an unscaled carry comes back scaled, promote it and trace again. A scaled carry's data is
re-centred at the end of each iteration when it drifted far from unit (`_recentred`), so
a long loop cannot walk it out of its format.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import traverse
from .common import (
    FIT_BAND,
    data_absmax,
    data_of,
    is_scaled,
    make_scaled,
    positive_or_one,
    renormalized,
    rescale_data,
    unit_scale,
    unscale,
)
from .interpreter import bind_unscaled
from .registry import register_rule


class _CarryMaskChanged(Exception):
    def __init__(self, mask: list[bool]):
        super().__init__("carry mask changed")
        self.mask = mask


def _to_scaled(x):
    if is_scaled(x):
        return x
    x = jnp.asarray(x)
    return make_scaled(x, unit_scale())


def _conform(values, mask):
    """Make ``values`` match ``mask`` (True: scaled). Raises when a value is scaled where
    the mask says plain, so the caller can widen the mask and retrace."""
    grown = [m or is_scaled(v) for m, v in zip(mask, values)]
    if grown != list(mask):
        raise _CarryMaskChanged(grown)
    return [_to_scaled(v) if m else v for v, m in zip(values, mask)]


# -- calls -----------------------------------------------------------------------------


def _constrain(ctx, values, shardings):
    """Apply a jit's explicit ``in_shardings``/``out_shardings`` to inlined values as
    sharding constraints: the data of a `ScaledArray` gets it, its scalar scale stays
    replicated. Unspecified (and AUTO) entries are not `Sharding` objects: left alone."""
    if not shardings:
        return list(values)
    out = []
    for v, s in zip(values, shardings, strict=True):
        src = v
        if isinstance(s, jax.sharding.Sharding):
            if is_scaled(v):
                v = make_scaled(jax.lax.with_sharding_constraint(v.data, s), v.scale)
            elif isinstance(v, jax.Array) or hasattr(v, "ndim"):
                v = jax.lax.with_sharding_constraint(v, s)
            if ctx.observer is not None and v is not src:
                ctx.observer.same_value(src, v)
        out.append(v)
    return out


def _inlined(ctx, eqn):
    """The body callback of an inlined call: the body interpreted in place."""

    def body(closed, args, where):
        return ctx.nested(eqn, "call").eval_closed(closed, args), ()

    return body


def scaled_jit(ctx, eqn, invals):
    """Inline the jit body. Explicit in/out shardings are kept as sharding constraints
    (inlining would otherwise drop them)."""
    p = eqn.params

    def body(closed, args, where):
        args = _constrain(ctx, args, p.get("in_shardings"))
        outs = ctx.nested(eqn, "call").eval_closed(closed, args)
        return _constrain(ctx, outs, p.get("out_shardings")), ()

    return traverse.call(eqn, invals, body)


def scaled_call(ctx, eqn, invals):
    """Inline a call: closed_call, or a custom-derivative call's primal."""
    return traverse.call(eqn, invals, _inlined(ctx, eqn))


def scaled_remat(ctx, eqn, invals):
    """Inline a checkpoint's body (the remat is dropped)."""
    return traverse.checkpoint(eqn, invals, _inlined(ctx, eqn), inline=True)


# -- loops and branches ------------------------------------------------------------------


def _merge_stacked(y):
    """A scan output stacked from per-iteration `ScaledArray` values has one scale per
    iteration; express it in the largest of them (exact power-of-two ratios)."""
    if not is_scaled(y):
        return y
    scales = y.scale
    if scales.shape[0] == 0:
        return make_scaled(y.data, unit_scale())
    top = positive_or_one(jnp.max(scales))
    factor = (scales / top).reshape((-1,) + (1,) * (y.data.ndim - 1))
    return make_scaled(rescale_data(y.data, factor), top)


def _recentred(carry):
    """Scaled float carries at the end of a loop iteration, their data shifted back
    near unit (a power of two moved into the scale) where its abs-max left 2^±`FIT_BAND`;
    bit for bit unchanged otherwise. The rules assume unit-scaled inputs: a carry whose
    data drifts by a binade per iteration (the gradient of an RNN through a gate slice)
    would otherwise leave float32's range after ~120 iterations (FP16's after ~20) and
    turn to zero, though its scale could hold it."""
    floats = (is_scaled(c) and jnp.issubdtype(c.dtype, jnp.floating) for c in carry)
    return [_recentre(c) if f and c.data.size else c for c, f in zip(carry, floats)]


def _recentre(c):
    """One carry re-centred. Inside a `shard_map` body, a scale typed invariant along
    axes its data varies over stays so (the carry's type may not change): the abs-max is
    taken over those devices too, one scalar ``pmax``."""
    from .rules_collective import varying_axes  # (it imports this module)

    amax = data_absmax(c.data)
    missing = tuple(sorted(varying_axes(c.data) - varying_axes(c.scale)))
    if missing:
        amax = jax.lax.pmax(amax, missing)
    return renormalized(c, amax, FIT_BAND)


def _conformed(init, mask):
    """The initial carries, scaled where ``mask`` says so."""
    return [_to_scaled(c) if m else c for c, m in zip(init, mask)]


def _fixed_point(mask, trace):
    """``trace(mask)``, traced again with the wider mask while a carry (or a branch's
    output) that the mask says is plain comes back scaled."""
    while True:
        try:
            return trace(mask)
        except _CarryMaskChanged as change:
            mask = change.mask


def scaled_scan(ctx, eqn, invals):
    """Scan the data of scaled ``xs`` (a scalar scale cannot be sliced; each iteration
    re-attaches it); stacked scaled outputs share their largest iteration's scale."""
    _, where = traverse.locate(eqn, traverse.SCAN)
    consts, init, xs = traverse.split(where, invals)
    xs_data = [data_of(x) for x in xs]
    xs_scale = [x.scale if is_scaled(x) else None for x in xs]
    bodies = []  # the context of the latest body trace, whose observer outputs are kept

    def trace(mask):
        def body(closed, args, where):
            n = where.consts + where.carry
            x_vals = [make_scaled(d, s) if s is not None else d for d, s in zip(args[n:], xs_scale)]
            sub = ctx.nested(eqn, "scan")
            bodies.append(sub)
            outs = sub.eval_closed(closed, [*args[:n], *x_vals])
            carry = _recentred(_conform(outs[: where.carry], mask))
            return [*carry, *outs[where.carry :]], sub.body_outputs()

        return traverse.scan(eqn, [*consts, *_conformed(init, mask), *xs_data], body)

    outs, extra = _fixed_point([is_scaled(c) for c in init], trace)
    ctx.adopt(bodies[-1], extra, "scan", reverse=bool(eqn.params.get("reverse", False)))
    return [*outs[: len(init)], *[_merge_stacked(y) for y in outs[len(init) :]]]


def _zeros_like(shapes):
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _extra_shapes(ctx, eqn, kind, body, args):
    """Trace a body once, unconformed, to learn the structure of its observer outputs
    (a while carry and the branches of a cond need it before the real trace)."""

    def probe(*args):
        sub = ctx.nested(eqn, kind)
        body(sub, list(args))
        return sub.body_outputs()

    return jax.eval_shape(probe, *args)


def scaled_while(ctx, eqn, invals):
    """The predicate is interpreted silently (its values are not observed); observer
    outputs of the body are folded across iterations (`Context.accumulate`)."""
    body_jaxpr, body_where = traverse.locate(eqn, traverse.WHILE_BODY)
    body_consts, init, _ = traverse.split(body_where, invals)
    consts = invals[: len(invals) - len(init)]  # the predicate's and the body's
    silent = ctx.nested(eqn, "silent")
    run_body = lambda sub, carry: sub.eval_closed(body_jaxpr, [*body_consts, *carry])
    acc0 = ()
    if ctx.observer is not None:
        acc0 = _zeros_like(_extra_shapes(ctx, eqn, "while", run_body, init))
    bodies = []

    def trace(mask):
        def body(closed, args, where):
            if where.kind == traverse.WHILE_COND:
                (pred,) = silent.eval_closed(closed, args)
                return [unscale(pred)], ()
            sub = ctx.nested(eqn, "while")
            bodies.append(sub)
            new = _recentred(_conform(sub.eval_closed(closed, args), mask))
            return new, sub.accumulate(where.aux, sub.body_outputs())

        return traverse.while_loop(eqn, [*consts, *_conformed(init, mask)], body, aux0=acc0)

    carry, acc = _fixed_point([is_scaled(c) for c in init], trace)
    if bodies:
        ctx.adopt(bodies[-1], acc, "while")
    return carry


def scaled_cond(ctx, eqn, invals):
    """Every branch's outputs are scaled alike; each branch hands out its observer
    outputs in its own slot (zeros in the others' slots)."""
    branches = traverse.bodies(eqn)
    index, operands = unscale(invals[0]), invals[1:]
    shapes = []
    if ctx.observer is not None:
        shapes = [
            _extra_shapes(ctx, eqn, "cond", lambda sub, ops, b=b: sub.eval_closed(b, ops), operands)
            for b, _ in branches
        ]
    subs = [None] * len(branches)

    def trace(mask):
        def body(closed, args, where):
            i = where.index
            sub = ctx.nested(eqn, "cond")
            subs[i] = sub
            outs = _conform(sub.eval_closed(closed, args), mask)
            extras = [
                sub.body_outputs() if j == i else _zeros_like(s) for j, s in enumerate(shapes)
            ]
            return outs, extras

        return traverse.cond(eqn, [index, *operands], body)

    outs, extras = _fixed_point([False] * len(branches[0][0].out_avals), trace)
    for sub, extra in zip(subs, extras):
        ctx.adopt(sub, extra, "cond")
    return outs


# -- bound whole on the values -----------------------------------------------------------


def scaled_on_values(ctx, eqn, invals):
    """Bound as it is on the unscaled values: `jax.debug.print` / `jax.debug.callback`
    and `jax.pure_callback` / `io_callback` (the host function sees, and returns, what it
    would without scalify) and `lax.custom_linear_solve` (``jnp.linalg.solve``: its
    matvec and solve bodies)."""
    return bind_unscaled(eqn, invals)


RULES = {
    "debug_callback": scaled_on_values,
    "debug_print": scaled_on_values,
    "pure_callback": scaled_on_values,
    "io_callback": scaled_on_values,
    "custom_linear_solve": scaled_on_values,
    "jit": scaled_jit,
    "pjit": scaled_jit,
    "custom_jvp_call": scaled_call,
    "custom_vjp_call": scaled_call,
    "custom_vjp_call_jaxpr": scaled_call,
    "remat2": scaled_remat,
    "checkpoint": scaled_remat,
    "closed_call": scaled_call,
    "core_call": scaled_call,
    "eval_jaxpr": scaled_call,  # JAX 0.11's closed_call
    "scan": scaled_scan,
    "while": scaled_while,
    "cond": scaled_cond,
}

for _name, _rule in RULES.items():
    register_rule(_name, _rule, higher_order=True)
