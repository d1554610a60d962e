"""Higher-order primitives: interpreted recursively, never rejected.

``jit`` and the custom-derivative calls are inlined (their primal jaxpr is interpreted in
place, under the call's name). ``scan``, ``while`` and ``cond`` are rebuilt with
`jax.lax` control flow whose bodies interpret the original sub-jaxprs, so scaled values
flow through loops and branches.

Loop carries keep a stable structure: a carry that is scaled on the way in is scaled on
the way out. Which carries must be scaled is found by a fixpoint: trace the body, and if
an unscaled carry comes back scaled, promote it and trace again.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax import lax

from .common import (
    is_scaled,
    make_scaled,
    positive_or_one,
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


def _scope(name: str | None):
    return jax.named_scope(name) if name else contextlib.nullcontext()


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


def scaled_jit(ctx, eqn, invals):
    """Inline the jit body. Explicit in/out shardings are kept as sharding constraints
    (inlining would otherwise drop them)."""
    p = eqn.params
    with _scope(p.get("name")):
        invals = _constrain(ctx, invals, p.get("in_shardings"))
        outs = ctx.nested(eqn, "call").eval_closed(p["jaxpr"], invals)
        return _constrain(ctx, outs, p.get("out_shardings"))


def scaled_custom_call(ctx, eqn, invals):
    closed = eqn.params.get("call_jaxpr", eqn.params.get("fun_jaxpr"))
    with _scope(eqn.params.get("name")):
        return ctx.nested(eqn, "call").eval_closed(closed, invals)


def scaled_remat(ctx, eqn, invals):
    return ctx.nested(eqn, "call").eval_jaxpr(eqn.params["jaxpr"], [], invals)


def scaled_closed_call(ctx, eqn, invals):
    return ctx.nested(eqn, "call").eval_closed(eqn.params["call_jaxpr"], invals)


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


def scaled_scan(ctx, eqn, invals):
    p = eqn.params
    n_consts, n_carry = p["num_consts"], p["num_carry"]
    body = p["jaxpr"]
    consts = invals[:n_consts]
    init = invals[n_consts : n_consts + n_carry]
    xs = invals[n_consts + n_carry :]
    xs_data = [x.data if is_scaled(x) else x for x in xs]
    xs_scale = [x.scale if is_scaled(x) else None for x in xs]
    mask = [is_scaled(c) for c in init]
    bodies = []  # the context of the latest body trace, whose observer outputs are kept

    while True:

        def step(carry, x, mask=mask):
            x_vals = [make_scaled(d, s) if s is not None else d for d, s in zip(x, xs_scale)]
            sub = ctx.nested(eqn, "scan")
            bodies.append(sub)
            outs = sub.eval_closed(body, [*consts, *carry, *x_vals])
            return _conform(outs[:n_carry], mask), (outs[n_carry:], sub.body_outputs())

        carry0 = [_to_scaled(c) if m else c for c, m in zip(init, mask)]
        try:
            carry, (ys, extra) = lax.scan(
                step,
                carry0,
                xs_data,
                length=p["length"],
                reverse=p["reverse"],
                unroll=p["unroll"],
            )
        except _CarryMaskChanged as change:
            mask = change.mask
            continue
        ctx.adopt(bodies[-1], extra, "scan")
        return [*carry, *[_merge_stacked(y) for y in ys]]


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
    p = eqn.params
    n_cond, n_body = p["cond_nconsts"], p["body_nconsts"]
    cond_consts = invals[:n_cond]
    body_consts = invals[n_cond : n_cond + n_body]
    init = invals[n_cond + n_body :]
    mask = [is_scaled(c) for c in init]
    silent = ctx.nested(eqn, "silent")
    run_body = lambda sub, carry: sub.eval_closed(p["body_jaxpr"], [*body_consts, *carry])
    acc0 = ()
    if ctx.observer is not None:
        acc0 = _zeros_like(_extra_shapes(ctx, eqn, "while", run_body, init))
    bodies = []

    def cond_fn(state):
        (pred,) = silent.eval_closed(p["cond_jaxpr"], [*cond_consts, *state[0]])
        return unscale(pred)

    while True:

        def body_fn(state, mask=mask):
            carry, acc = state
            sub = ctx.nested(eqn, "while")
            bodies.append(sub)
            new = _conform(run_body(sub, carry), mask)
            return new, sub.accumulate(acc, sub.body_outputs())

        carry0 = [_to_scaled(c) if m else c for c, m in zip(init, mask)]
        try:
            carry, acc = lax.while_loop(cond_fn, body_fn, (carry0, acc0))
        except _CarryMaskChanged as change:
            mask = change.mask
            continue
        if bodies:
            ctx.adopt(bodies[-1], acc, "while")
        return list(carry)


def scaled_cond(ctx, eqn, invals):
    branches = eqn.params["branches"]
    index, operands = unscale(invals[0]), invals[1:]
    mask = [False] * len(branches[0].out_avals)
    shapes = []
    if ctx.observer is not None:
        shapes = [
            _extra_shapes(ctx, eqn, "cond", lambda sub, ops, b=b: sub.eval_closed(b, ops), operands)
            for b in branches
        ]
    bodies = [None] * len(branches)

    while True:

        def make_branch(i, closed, mask=mask):
            def branch(*ops):
                sub = ctx.nested(eqn, "cond")
                bodies[i] = sub
                outs = _conform(sub.eval_closed(closed, list(ops)), mask)
                extras = [
                    sub.body_outputs() if j == i else _zeros_like(s) for j, s in enumerate(shapes)
                ]
                return outs, extras

            return branch

        try:
            outs, extras = lax.switch(
                index, [make_branch(i, b) for i, b in enumerate(branches)], *operands
            )
        except _CarryMaskChanged as change:
            mask = change.mask
            continue
        for sub, extra in zip(bodies, extras):
            ctx.adopt(sub, extra, "cond")
        return list(outs)


# -- bound whole on the values -----------------------------------------------------------


def scaled_on_values(ctx, eqn, invals):
    """Bound as it is on the unscaled values: `jax.debug.print` / `jax.debug.callback`
    (the callback sees what the user would see without scalify) and
    `lax.custom_linear_solve` (``jnp.linalg.solve``: its matvec and solve bodies)."""
    return bind_unscaled(eqn, invals)


RULES = {
    "debug_callback": scaled_on_values,
    "debug_print": scaled_on_values,
    "custom_linear_solve": scaled_on_values,
    "jit": scaled_jit,
    "pjit": scaled_jit,
    "custom_jvp_call": scaled_custom_call,
    "custom_vjp_call": scaled_custom_call,
    "custom_vjp_call_jaxpr": scaled_custom_call,
    "remat2": scaled_remat,
    "checkpoint": scaled_remat,
    "closed_call": scaled_closed_call,
    "core_call": scaled_closed_call,
    "scan": scaled_scan,
    "while": scaled_while,
    "cond": scaled_cond,
}

for _name, _rule in RULES.items():
    register_rule(_name, _rule, higher_order=True)
