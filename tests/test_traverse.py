"""The shared traversal of higher-order primitives (`scalescope.scalify.traverse`), on its
own: a jaxpr evaluated with an identity body callback gives what plain JAX gives."""

from __future__ import annotations

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import Literal

from scalescope.scalify import traverse
from scalescope.scalify.interpreter import bind_plain


def _eval(jaxpr, consts, args):
    """A plain jaxpr evaluator whose higher-order equations go through `traverse.apply`."""
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    read = lambda v: v.val if isinstance(v, Literal) else env[v]
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        if eqn.primitive.name in traverse.PRIMITIVES:
            outs = traverse.apply(eqn, invals, _identity)
        else:
            outs = bind_plain(eqn, invals)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def _identity(closed, args, where):
    return _eval(closed.jaxpr, closed.consts, args), ()


def _traversed(fn, *args):
    closed = jax.make_jaxpr(fn)(*args)
    return _eval(closed.jaxpr, closed.consts, jax.tree.leaves(args))


def _check(fn, *args):
    """``fn`` traversed equals ``fn`` bit for bit, eagerly and under jit."""
    want = jax.tree.leaves(fn(*args))
    for got in (_traversed(fn, *args), jax.jit(lambda *a: _traversed(fn, *a))(*args)):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _x(n=5, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(n, 3)).astype(np.float32))


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _eqns(sub)


def _eqn(fn, *args, name):
    """The first equation of primitive ``name`` in ``fn``'s jaxpr (at any depth)."""
    return next(e for e in _eqns(jax.make_jaxpr(fn)(*args).jaxpr) if e.primitive.name == name)


@pytest.mark.parametrize("reverse", [False, True])
def test_scan_with_consts_forward_and_reverse(reverse):
    w = _x(3, 1)

    def f(xs):
        def step(c, x):
            c = jnp.tanh(c @ w + x)  # w: a const of the body
            return c, c * 2.0

        return lax.scan(step, jnp.zeros(3), xs, reverse=reverse)

    _check(f, _x())


def test_scan_without_xs_and_unrolled():
    f = lambda c: lax.scan(lambda c, _: (c * 1.5 + 1.0, c), c, None, length=4, unroll=2)
    _check(f, jnp.ones(3))


def test_while_loop_with_consts():
    limit, step = jnp.float32(10.0), jnp.float32(1.5)
    f = lambda x: lax.while_loop(lambda c: c[0] < limit, lambda c: (c[0] + step, c[1] * 2), x)
    _check(f, (jnp.float32(0.0), jnp.ones(3)))


@pytest.mark.parametrize("index", [0, 1, 2])
def test_switch_three_branches(index):
    f = lambda i, x: lax.switch(i, [jnp.sin, jnp.cos, lambda y: y * 3.0], x)
    _check(f, jnp.int32(index), _x())


def test_checkpoint_and_its_gradient():
    def g(x):
        return jnp.sum(jnp.sin(x) ** 2)

    f = jax.checkpoint(g, policy=jax.checkpoint_policies.nothing_saveable)
    _check(f, _x())
    # the rebound checkpoint is differentiable like the original
    grad = jax.grad(lambda x: _traversed(f, x)[0])(_x())
    np.testing.assert_allclose(grad, jax.grad(f)(_x()), rtol=1e-6)


def test_nested_jit_and_custom_jvp():
    inner = jax.jit(lambda x: jax.nn.relu(x) + 1.0)
    f = jax.jit(lambda x: inner(x) * inner(x + 1.0))
    _check(f, _x())


def test_nested_loops_and_branches():
    def f(xs):
        def step(c, x):
            c = lax.cond(jnp.sum(x) > 0, lambda v: v + x, lambda v: v - x, c)
            return jax.jit(jnp.tanh)(c), lax.fori_loop(0, 3, lambda i, v: v * 0.5, x)

        return lax.scan(step, jnp.zeros(3), xs)

    _check(f, _x())


def test_bodies_say_where_they_sit():
    x = jnp.float32(0.0)
    loop = _eqn(lambda x: lax.while_loop(lambda c: c < x, lambda c: c + 1.0, x), x, name="while")
    kinds = [(w.kind, w.consts, w.carry) for _, w in traverse.bodies(loop)]
    assert kinds == [(traverse.WHILE_COND, 1, 1), (traverse.WHILE_BODY, 0, 1)]
    sw = _eqn(lambda i, x: lax.switch(i, [jnp.sin, jnp.cos, jnp.tan], x), 1, x, name="cond")
    assert [(w.kind, w.index) for _, w in traverse.bodies(sw)] == [("branch", n) for n in range(3)]
    sc = _eqn(lambda c, xs: lax.scan(lambda c, x: (c + x, c), c, xs), x, jnp.ones(4), name="scan")
    _, where = traverse.locate(sc, traverse.SCAN)
    assert traverse.body_operands(where, ["c", "x"], carried="carry") == ["carry", "x"]
    assert traverse.split(where, ["c", "x"]) == ([], ["c"], ["x"])


class _FlatTree:
    """JAX 0.11's ``ft_in`` of a scan, as far as `traverse` reads it: (consts, carry, xs)."""

    def __init__(self, *groups):
        self.groups = groups

    def unpack(self):
        return tuple([None] * n for n in self.groups)


def test_a_scan_in_jax_0_11s_layout_is_taken_apart_alike():
    """JAX 0.11 dropped a scan's ``num_consts``/``num_carry`` for a flat tree ``ft_in``
    of its operands (CI runs 0.10, a GPU image 0.11): the same counts and result."""
    w = _x(3, 1)

    def f(c, xs):
        return lax.scan(lambda c, x: (jnp.tanh(c @ w + x), c * 2.0), c, xs)

    args = (jnp.ones(3), _x(5, 2))
    closed = jax.make_jaxpr(f)(*args)
    old = next(e for e in closed.jaxpr.eqns if e.primitive.name == "scan")
    p = old.params
    if "num_consts" in p:  # JAX 0.10: the scan rewritten into 0.11's layout
        keep = {k: v for k, v in p.items() if k not in ("num_consts", "num_carry", "linear")}
        n_xs = len(old.invars) - p["num_consts"] - p["num_carry"]
        ft_in = _FlatTree(p["num_consts"], p["num_carry"], n_xs)
        new = old.replace(params={**keep, "ft_in": ft_in})
        assert traverse.scan_counts(p) == (1, 1)
    else:  # JAX 0.11 itself (the GPU image's; tried on CPU with Python 3.12)
        new = old
    assert traverse.scan_counts(new.params) == (1, 1)
    assert [w.carry for _, w in traverse.bodies(new)] == [1]
    env = {**dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))}
    env.update(zip(closed.jaxpr.invars, args, strict=True))
    got = traverse.apply(new, [env[v] for v in new.invars], _identity)
    for g, want in zip(got, jax.tree.leaves(f(*args)), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(want))
    with pytest.raises(KeyError, match="scan without operand counts"):
        traverse.scan_counts({"length": 3})


def test_aux_is_stacked_carried_and_taken():
    """What bodies hand out beside their outputs: a scan stacks it, a while loop carries
    it, a cond returns the taken branch's."""
    xs = _x()
    sc = _eqn(lambda c, xs: lax.scan(lambda c, x: (c + x, c), c, xs), jnp.zeros(3), xs, name="scan")
    body = lambda closed, args, where: (_eval(closed.jaxpr, closed.consts, args), where.aux * 2)
    outs, aux = traverse.scan(sc, [jnp.zeros(3), xs], body, aux_xs=jnp.arange(5.0))
    np.testing.assert_allclose(aux, np.arange(5.0) * 2)
    np.testing.assert_allclose(outs[0], np.sum(xs, 0), rtol=1e-6)

    to_five = lambda c: lax.while_loop(lambda c: c < 5.0, lambda c: c + 1.0, c)
    loop = _eqn(to_five, 0.0, name="while")

    def count(closed, args, where):
        outs = _eval(closed.jaxpr, closed.consts, args)
        return outs, where.aux + (where.kind == traverse.WHILE_BODY)

    carry, n = traverse.while_loop(loop, [jnp.float32(0.0)], count, aux0=jnp.int32(0))
    assert float(carry[0]) == 5.0 and int(n) == 5

    sw = _eqn(lambda i, x: lax.switch(i, [jnp.sin, jnp.cos, jnp.tan], x), 1, 0.5, name="cond")
    which = lambda closed, args, where: (_eval(closed.jaxpr, closed.consts, args), where.index)
    outs, taken = traverse.cond(sw, [jnp.int32(2), jnp.float32(0.5)], which)
    assert int(taken) == 2
    np.testing.assert_allclose(outs[0], np.tan(np.float32(0.5)), rtol=1e-6)


@pytest.mark.parametrize("reverse", [False, True])
def test_scan_unrolled_matches_scan(reverse):
    w = _x(3, 1)
    f = lambda xs: lax.scan(lambda c, x: (c @ w + x, c * x), jnp.ones(3), xs, reverse=reverse)
    xs = _x()
    sc = _eqn(f, xs, name="scan")
    seen = []

    def body(closed, args, where):
        seen.append(where.index)
        return _identity(closed, args, where)

    got = traverse.scan_unrolled(sc, [w, jnp.ones(3), xs], body)
    for g, want in zip(got, jax.tree.leaves(f(xs)), strict=True):
        np.testing.assert_allclose(g, want, rtol=1e-6)
    assert seen == ([4, 3, 2, 1, 0] if reverse else [0, 1, 2, 3, 4])


def test_unknown_higher_order_primitive_is_named():
    a, b = jnp.eye(3) * 2.0, jnp.ones(3)
    solve = _eqn(jnp.linalg.solve, a, b, name="custom_linear_solve")
    with pytest.raises(NotImplementedError, match="'custom_linear_solve'"):
        traverse.apply(solve, [], _identity)
    with pytest.raises(NotImplementedError, match="'custom_linear_solve'"):
        traverse.bodies(solve)
