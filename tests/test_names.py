"""Op names, source lines and passes on models nobody here wrote the naming for: Flax NNX
module paths, ops inside JAX's own jitted helpers, and optax's optimizer work."""

from __future__ import annotations

import collections
import importlib
import inspect
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import scalescope as ss

nnx = pytest.importorskip("flax.nnx")
linen = pytest.importorskip("flax.linen")

D, V, T = 8, 11, 6


class Attn(nnx.Module):
    def __init__(self, rngs):
        self.q = nnx.Linear(D, D, rngs=rngs)
        self.k = nnx.Linear(D, D, rngs=rngs)
        self.norm = nnx.LayerNorm(D, rngs=rngs)

    def __call__(self, x):
        h = self.norm(x)
        s = jnp.einsum("btd,bsd->bts", self.q(h), self.k(h))
        s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -1e9)
        return x + jax.nn.softmax(s, -1) @ h


class Model(nnx.Module):
    def __init__(self, rngs):
        self.emb = nnx.Embed(V, D, rngs=rngs)
        self.layers = nnx.List([Attn(rngs) for _ in range(2)])
        self.out = nnx.Linear(D, V, rngs=rngs)

    def __call__(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


IDS = jnp.arange(2 * T).reshape(2, T) % V
LOSS_LINE = UPDATE_LINE = 0


def _functional_step():
    """The functional NNX style: split once, merge inside the step, optax outside."""
    global LOSS_LINE, UPDATE_LINE
    graphdef, params = nnx.split(Model(nnx.Rngs(0)), nnx.Param)
    tx = optax.adamw(1e-3)

    def step(params, opt_state, ids):
        def loss_fn(p):
            logits = nnx.merge(graphdef, p)(ids)
            return optax.softmax_cross_entropy_with_integer_labels(logits, ids).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    lines, start = inspect.getsourcelines(step)
    LOSS_LINE = start + next(i for i, s in enumerate(lines) if "softmax_cross" in s)
    UPDATE_LINE = start + next(i for i, s in enumerate(lines) if "tx.update" in s)
    return step, (params, tx.init(params), IDS)


@pytest.fixture(scope="module")
def nnx_table():
    step, args = _functional_step()
    return ss.instrument(step, scalify=False).op_table(*args)


def _names(table, pass_):
    return {r.name for r in table if r.pass_ == pass_}


def test_nnx_ops_carry_module_paths(nnx_table):
    fwd, bwd = _names(nnx_table, "fwd"), _names(nnx_table, "bwd")
    for layer in ("0", "1"):
        for lin in ("q", "k"):
            assert f"layers/{layer}/{lin}/dot_general" in fwd
            assert f"layers/{layer}/{lin}/dot_general" in bwd
        assert any(n.startswith(f"layers/{layer}/norm/") for n in fwd)
        # ops of the layer's own body (the causal mask, the softmax) are under its path
        assert f"layers/{layer}/select_n" in fwd
        assert f"layers/{layer}/exp" in fwd
    assert "out/dot_general" in fwd and "out/dot_general" in bwd
    assert any(n.startswith("emb/") for n in fwd)
    # the names read like the parameters' paths
    inputs = _names(nnx_table, "input")
    assert "input/params/layers/1/q/kernel/value" in inputs
    # a select regex on a module path now matches forward and backward ops
    selected = ss.instrument(_functional_step()[0], scalify=False, select="layers/1/k/")
    table = selected.op_table(*_functional_step()[1])
    recorded = {(r.pass_, r.name) for r in table if r.recorded and r.pass_ != "input"}
    assert ("fwd", "layers/1/k/dot_general") in recorded
    assert ("bwd", "layers/1/k/dot_general") in recorded
    assert all("layers/1/k/" in name for _, name in recorded)


def test_every_op_has_a_source_line(nnx_table):
    here = __file__
    unknown = [r for r in nnx_table if r.source == "<unknown>"]
    assert unknown == []
    # ops inside jnp's jitted helpers (tril, where, take, one_hot, log_softmax) are
    # placed at the user's line that called them
    sources = {r.source for r in nnx_table if r.pass_ in ("fwd", "bwd")}
    assert all(s.startswith(here) or "<" in s for s in sources), sources
    tril_line = next(
        i + Attn.__call__.__code__.co_firstlineno
        for i, s in enumerate(inspect.getsourcelines(Attn.__call__)[0])
        if "jnp.tril" in s
    )
    at_tril = {r.primitive for r in nnx_table if r.source == f"{here}:{tril_line}"}
    assert {"iota", "select_n"} <= at_tril


def test_optax_work_is_the_opt_pass(nnx_table):
    at_update = [r for r in nnx_table if r.source.endswith(f":{UPDATE_LINE}")]
    assert len(at_update) > 20
    # the moment decays b1*mu and b2*nu read no gradient, yet they are optimizer work
    assert {r.pass_ for r in at_update} == {"opt"}
    assert sum(r.primitive == "mul" for r in at_update) >= 4 * 2
    # optax's loss is forward work (and its gradient backward)
    at_loss = {r.pass_ for r in nnx_table if r.source.endswith(f":{LOSS_LINE}")}
    assert at_loss == {"fwd", "bwd"}


class Block(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(D, D, rngs=rngs)
        self.norm = nnx.RMSNorm(D, rngs=rngs)

    def __call__(self, x):
        return x + self.lin(self.norm(x))


class Stacked(nnx.Module):
    """Layers created with nnx.vmap and run with nnx.scan (as Flax's Gemma example)."""

    def __init__(self, rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return Block(rngs)

        self.blocks = create(rngs)
        self.head = nnx.Linear(D, 2, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x, block):
            return block(x)

        return self.head(forward(x, self.blocks))


def test_nnx_scan_and_optimizer():
    model = Stacked(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    x = jax.random.normal(jax.random.PRNGKey(1), (4, D))

    def step(state, x):
        m, o = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(lambda m: (m(x) ** 2).mean())(m)
        o.update(m, grads)
        return loss, nnx.state((m, o))

    update_line = inspect.getsourcelines(step)[1] + 3
    inst = ss.instrument(step, scalify=False)
    table = inst.op_table(state, x)
    names = {(r.pass_, r.name) for r in table}
    # the scanned layer is named by the stacked attribute it was sliced from
    assert ("fwd", "blocks/lin/dot_general") in names
    assert ("bwd", "blocks/lin/dot_general") in names
    assert any(p == "fwd" and n.startswith("blocks/norm/") for p, n in names)
    assert ("fwd", "head/dot_general") in names
    at_update = [r for r in table if r.source.endswith(f":{update_line}")]
    assert at_update and {r.pass_ for r in at_update} == {"opt"}
    assert all(r.source != "<unknown>" for r in table)
    # the optimizer's per-leaf work is named after the parameter it updates, as for a
    # step on (params, opt_state): the argument is a tuple, (model state, optimizer)
    per_leaf = [r for r in at_update if r.shape != ()]
    params = {
        "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path): (
            leaf.shape
        )
        for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
    }
    assert "blocks/lin/kernel/value" in params
    assert per_leaf and all(
        r.name.rpartition("/")[0] in params and params[r.name.rpartition("/")[0]] == r.shape
        for r in per_leaf
    ), sorted({r.name for r in per_leaf})
    assert {r.name.rpartition("/")[0] for r in per_leaf} == set(params)
    # the names do not change what is computed
    (loss, _), _ = jax.jit(inst)(state, x)
    np.testing.assert_allclose(loss, jax.jit(step)(state, x)[0], rtol=1e-6)


def test_linen_paths_sources_and_optax_pass():
    class Mlp(linen.Module):
        @linen.compact
        def __call__(self, x):
            x = linen.Dense(D, name="up")(x)
            x = jnp.where(x > 0, x, 0.1 * x)
            return linen.Dense(1, name="down")(x)

    model = Mlp()
    x = jax.random.normal(jax.random.PRNGKey(0), (4, D))
    params = model.init(jax.random.PRNGKey(1), x)
    tx = optax.sgd(0.1, momentum=0.9)

    def step(params, opt_state):
        grads = jax.grad(lambda p: (model.apply(p, x) ** 2).mean())(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    update_line = inspect.getsourcelines(step)[1] + 2
    table = ss.instrument(step, scalify=False).op_table(params, tx.init(params))
    names = {(r.pass_, r.name) for r in table}
    assert ("fwd", "Mlp/up/dot_general") in names or ("fwd", "up/dot_general") in names
    assert any(p == "bwd" and "down/dot_general" in n for p, n in names)
    assert all(r.source != "<unknown>" for r in table)
    at_update = [r for r in table if r.source.endswith(f":{update_line}")]
    assert at_update and {r.pass_ for r in at_update} == {"opt"}


def test_module_scopes_in_a_users_own_trace():
    model = Model(nnx.Rngs(0))
    with ss.module_scopes():
        jaxpr = jax.make_jaxpr(lambda ids: model(ids))(IDS)
    stacks = {str(e.source_info.name_stack) for e in jaxpr.eqns}
    assert {"layers/0/q", "layers/1/k", "out"} <= stacks
    # outside the context NNX adds no scope, and the profile hook is gone
    jaxpr = jax.make_jaxpr(lambda ids: model(ids))(IDS)
    assert {str(e.source_info.name_stack) for e in jaxpr.eqns} <= {"", "btd,bsd->bts"}
    import sys

    assert sys.getprofile() is None


def test_scale_graph_names_nnx_modules():
    model = Model(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(p):
        logits = nnx.merge(graphdef, p)(IDS)
        return optax.softmax_cross_entropy_with_integer_labels(logits, IDS).mean()

    frame = ss.scale_graph(loss, params)
    assert "layers/0/q/dot_general" in set(frame["name"])
    assert not (frame["source"] == "<unknown>").any()


def test_a_quantisation_librarys_ops_are_placed_at_the_users_line(tmp_path, monkeypatch):
    """Ops a quantisation library (qwix, AQT) emits inside a model are placed at the
    user's line that called it, as flax's and optax's are: the advisor's fix then names a
    line the user can edit, not one inside the library."""
    pkg = tmp_path / "qwix"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "import jax.numpy as jnp\n\n\n"
        "def fake_quant(x):\n"
        "    s = jnp.max(jnp.abs(x)) / 448.0\n"
        "    return jnp.clip(x / s, -448.0, 448.0).astype(jnp.float8_e4m3fn).astype(x.dtype) * s\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "qwix", raising=False)
    import qwix  # the stand-in above

    def step(x):
        return qwix.fake_quant(x) * 2.0

    line = inspect.getsourcelines(step)[1] + 1
    table = ss.instrument(step, scalify=False).op_table(jnp.ones((4, 8)))
    converts = [r for r in table if "convert_element_type" in r.name]
    assert converts and all(r.source.endswith(f":{line}") for r in converts), [
        r.source for r in converts
    ]
    assert all("qwix" not in r.source for r in table)


def _site_package(tmp_path, monkeypatch, name: str) -> Any:
    """A package ``name`` whose ``dense(w, x)`` is ``tanh(x @ w)`` (line 5), installed in a
    ``site-packages`` folder of ``tmp_path``, imported."""
    site_dir = tmp_path / "lib" / "site-packages"
    pkg = site_dir / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "import jax.numpy as jnp\n\n\ndef dense(w, x):\n    return jnp.tanh(x @ w)\n"
    )
    monkeypatch.syspath_prepend(str(site_dir))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return importlib.import_module(name)


def _dense_sources(pkg) -> tuple[set[str], str]:
    """The sources of ``pkg.dense``'s ops (forward and backward) in a loss, and the loss's
    line that calls it."""

    def loss(w, x):
        return pkg.dense(w, x).sum()

    line = f"{__file__}:{inspect.getsourcelines(loss)[1] + 1}"
    table = ss.instrument(jax.grad(loss), scalify=False).op_table(
        jnp.ones((4, 4)), jnp.ones((2, 4))
    )
    return {r.source for r in table if r.primitive in ("tanh", "dot_general")}, line


def test_an_installed_model_packages_ops_are_placed_at_its_own_lines(tmp_path, monkeypatch):
    """A package that is not a named library is model code wherever it is installed (a
    model zoo's ``modeling_flax_gpt2.py``, the user's own package installed into a
    container): its ops are at its own lines. Were every installed package's frames a
    library's, each op would be placed at the one script line that calls the model."""
    pkg = _site_package(tmp_path, monkeypatch, "zoomodels")
    got, line = _dense_sources(pkg)
    assert got == {f"{pkg.__file__}:5"}, got
    assert line not in got


def test_a_named_librarys_ops_are_placed_at_the_users_line(tmp_path, monkeypatch):
    """A library of `source.LIBRARIES` (Equinox's ``nn.Linear``, Haiku's, einops), installed
    in ``site-packages`` too: its frames stand for the user's line that called it (an
    Equinox model's every op, and the verdict's fix, once named a line inside
    ``site-packages/equinox``)."""
    from scalescope.scalify import source

    monkeypatch.setattr(source, "LIBRARIES", (*source.LIBRARIES, "zoolayers"))
    got, line = _dense_sources(_site_package(tmp_path, monkeypatch, "zoolayers"))
    assert got == {line}, got
    assert {"equinox", "haiku", "einops", "jmp"} <= set(source.LIBRARIES)


def test_unit_scaled_ops_are_placed_at_the_users_line():
    """``U.linear`` and ``U.gelu`` are building blocks, as Flax's layers: their ops are at
    the user's line, not inside ``scalescope/unit``."""
    import scalescope.unit as U

    def loss(w, x):
        return U.gelu(U.linear(x, w)).sum()

    line = f"{__file__}:{inspect.getsourcelines(loss)[1] + 1}"
    table = ss.instrument(jax.grad(loss), scalify=False).op_table(
        jnp.ones((4, 4)), jnp.ones((2, 4))
    )
    got = {r.source for r in table if r.primitive in ("dot_general", "tanh", "erf")}
    assert got == {line}, got


def test_a_unit_scaled_functions_ops_are_placed_at_the_users_lines():
    """``ss.unit_scale(loss)`` re-traces the loss's equations (unit-scaled matmuls, the
    scales between ops): each op and its scales keep the line the user wrote. Every op,
    and so every fix of the verdict, was placed at one line of the transform before."""

    def loss(w, x):
        h = jax.nn.gelu(x @ w)
        return (h @ w).sum()

    first = inspect.getsourcelines(loss)[1]
    lines = {f"{__file__}:{first + 1}", f"{__file__}:{first + 2}"}
    table = ss.instrument(jax.grad(ss.unit_scale(loss)), scalify=False).op_table(
        jnp.ones((4, 4)), jnp.ones((2, 4))
    )
    got = {r.source for r in table if not r.source.startswith("<")}
    assert got == lines, got
    # the rewritten matmuls are there, at those lines
    assert {r.source for r in table if r.primitive == "dot_general"} == lines


def _innermost_outside_jax(eqn) -> str | None:
    tb = eqn.source_info.traceback
    for f in tb.frames if tb is not None else ():
        if f"{os.sep}jax{os.sep}" not in f.file_name:
            return f"{f.file_name}:{f.line_num}"
    return None


def test_a_scalified_programs_ops_carry_the_users_lines():
    """What scalify makes of an equation (its rule's data and scale arithmetic) carries
    the equation's own traceback, as JAX's transformations do: the program names the
    user's lines (HLO metadata for profilers, XLA dumps), not scalescope's helpers, and
    a function interpreting an emulated step finds them too."""

    def loss(w, x):
        h = jax.nn.gelu(x @ w)
        return (h @ w).sum()

    first = inspect.getsourcelines(loss)[1]
    lines = {f"{__file__}:{first + 1}", f"{__file__}:{first + 2}"}
    w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
    closed = jax.make_jaxpr(ss.scalify(jax.grad(loss)))(
        ss.as_scaled_array(w), ss.as_scaled_array(x)
    )
    eqns = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            eqns.append(e)
            for p in e.params.values():
                if hasattr(p, "jaxpr"):
                    walk(getattr(p.jaxpr, "jaxpr", p.jaxpr))

    walk(closed.jaxpr)
    at = [_innermost_outside_jax(e) for e in eqns]
    # the rules' ops are at the user's lines; the rest normalise the inputs (before any
    # equation of the user's)
    assert sum(a in lines for a in at) >= 0.8 * len(at), collections.Counter(at)
    assert {a for a in at if a is not None and a.startswith(__file__)} == lines
    # instrument of an emulated step: the probe finds the user's lines in what emulate made
    emulated = ss.emulate(jax.grad(loss), ss.Policy.from_dict({"**": "e4m3"}))
    table = ss.instrument(emulated, scalify=False).op_table(w, x)
    sources = collections.Counter(r.source for r in table)
    assert set(sources) - {"<input>", "<output>", "<unknown>"} == lines, sources
    assert sources["<unknown>"] <= 0.1 * len(table)  # the arguments' own quantisation


_FAKE_EQUINOX = """
import dataclasses

import jax


class Module:
    \"\"\"Equinox's Module in miniature: a dataclass that is a pytree of its fields.\"\"\"

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        dataclasses.dataclass(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        jax.tree_util.register_pytree_with_keys(
            cls,
            lambda m: ([(jax.tree_util.GetAttrKey(n), getattr(m, n)) for n in names], None),
            lambda _, kids: cls(*kids),
        )
"""
_FAKE_EQUINOX_NN = """
import jax
import jax.numpy as jnp

from equinox import Module


class Linear(Module):
    weight: jax.Array

    def __call__(self, x):
        with jax.named_scope("eqx.nn.Linear"):  # what Equinox's layers do
            return x @ self.weight
"""


def test_equinox_layers_are_named_by_their_field_paths(tmp_path, monkeypatch):
    """Equinox's layers name their calls by class (``eqx.nn.Linear``): two layers of a
    model read alike, and ``select="fc2"`` matched nothing but the outputs. Their ops
    are named by the model's field paths (``fc1``, ``blocks/1/fc``), as NNX modules' are,
    and placed at the user's line (a stand-in package of Equinox's shape; Equinox itself
    is no dependency)."""
    import sys

    pkg = tmp_path / "site-packages" / "equinox"
    (pkg / "nn").mkdir(parents=True)
    (pkg / "__init__.py").write_text(_FAKE_EQUINOX)
    (pkg / "nn" / "__init__.py").write_text(_FAKE_EQUINOX_NN)
    monkeypatch.syspath_prepend(str(tmp_path / "site-packages"))
    for name in ("equinox", "equinox.nn"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import equinox
    import equinox.nn

    for name in ("equinox", "equinox.nn"):  # gone again after the test
        monkeypatch.setitem(sys.modules, name, sys.modules[name])

    class Block(equinox.Module):
        fc: equinox.nn.Linear

        def __call__(self, x):
            return jnp.tanh(self.fc(x))

    class Net(equinox.Module):
        fc1: equinox.nn.Linear
        blocks: list
        fc2: equinox.nn.Linear

        def __call__(self, x):
            x = self.fc1(x)
            for block in self.blocks:
                x = block(x)
            return self.fc2(x)

    def lin(n, m):
        return equinox.nn.Linear(jnp.full((n, m), 0.1))

    net = Net(lin(4, 8), [Block(lin(8, 8)), Block(lin(8, 8))], lin(8, 2))

    def loss(net, x):
        return jnp.sum(net(x) ** 2)

    table = ss.instrument(jax.grad(loss), scalify=False).op_table(net, jnp.ones((3, 4)))
    fwd = [r.name for r in table if r.primitive == "dot_general" and r.pass_ == "fwd"]
    assert fwd == [
        "fc1/dot_general",
        "blocks/0/fc/dot_general",
        "blocks/1/fc/dot_general",
        "fc2/dot_general",
    ], fwd
    assert all("eqx." not in r.name for r in table)
    # the model's lines that call each layer, not the layer's line inside the package
    first = inspect.getsourcelines(Net)[1]
    calls = {f"{__file__}:{first + k}" for k in (6, 9)}  # self.fc1(x), self.fc2(x)
    dots = {r.source for r in table if r.primitive == "dot_general"}
    assert calls < dots and all(s.startswith(f"{__file__}:") for s in dots), dots


@jax.jit
def _jitted_body(x):
    y = jnp.sqrt(x)
    z = jnp.where(y > 1, y, 0.0)
    return z * 3.0


def test_ops_in_a_jitted_function_get_their_own_lines():
    """A ``@jax.jit`` train step called from another function (Flax's examples decorate
    theirs): each op is placed at its own line in the body, not at the caller's. jnp's
    helpers (``jnp.sqrt``, ``x * 3``) are inlined jits whose frames sit innermost: they
    are not where the body begins."""
    lines, first = inspect.getsourcelines(_jitted_body)
    at = ((2, "sqrt"), (3, "select_n"), (4, "mul"))
    here = {prim: f"{__file__}:{first + k}" for k, prim in at}

    def step(x):
        return _jitted_body(x)

    table = ss.instrument(step, scalify=False).op_table(jnp.ones(4))
    got = {r.primitive: r.source for r in table if r.primitive in here and r.pass_ == "fwd"}
    assert got == here


def test_nnx_names_do_not_depend_on_an_earlier_plain_trace():
    """Flax's NNX examples jit their train step with ``nnx.jit``; a plain call of it (a
    baseline, a first step) filled JAX's trace cache with a trace made without the module
    hook, and the probe then read every layer's ops unnamed (``dot_general``)."""

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(8, 16, rngs=rngs)
            self.l2 = nnx.Linear(16, 4, rngs=rngs)

        def __call__(self, x):
            return self.l2(nnx.relu(self.l1(x)))

    @nnx.jit
    def train_step(model, x):
        return nnx.value_and_grad(lambda m: (m(x) ** 2).mean())(model)[0]

    model, x = Net(nnx.Rngs(0)), jnp.ones((2, 8))
    train_step(model, x)  # the plain call, traced first
    graph, state = nnx.split(model)

    def step(state, x):
        return train_step(nnx.merge(graph, state), x)

    table = ss.instrument(step, scalify=False).op_table(state, x)
    dots = [r.name for r in table if r.primitive == "dot_general" and r.pass_ == "fwd"]
    assert dots == ["l1/dot_general", "l2/dot_general"]


def test_a_users_folder_named_like_a_library_is_the_users_code(tmp_path, monkeypatch):
    """Running Flax's examples from a clone of google/flax puts the model in
    ``.../flax/examples/...``: a library is told by the folder it is imported from, not by
    a folder name, so the model's ops keep the model's lines."""
    folder = tmp_path / "flax" / "examples" / "toy"
    folder.mkdir(parents=True)
    (folder / "toy_model.py").write_text(
        "from flax import linen as nn\n\n\n"
        "class MLP(nn.Module):\n"
        "    @nn.compact\n"
        "    def __call__(self, x):\n"
        "        return nn.Dense(3)(nn.relu(nn.Dense(5)(x)))\n"
    )
    monkeypatch.syspath_prepend(str(folder))
    from toy_model import MLP

    model, x = MLP(), jnp.ones((2, 4))
    params = model.init(jax.random.key(0), x)
    table = ss.instrument(lambda p: model.apply(p, x).sum(), scalify=False).op_table(params)
    dots = [r.source for r in table if r.primitive == "dot_general"]
    assert dots and all(s == f"{folder / 'toy_model.py'}:7" for s in dots), dots


def test_a_trainstates_moment_updates_are_named_after_their_parameter():
    """Flax's ``TrainState`` (every linen example) holds the inner parameter dict, so
    Adam's moments ``opt_state/0/mu/kernel`` do not mirror a ``params/...`` tree leaf for
    leaf: their updates kept bare names (``mul``, ``integer_pow``)."""
    from flax.training import train_state

    model = linen.Dense(4)
    params = model.init(jax.random.key(0), jnp.ones((2, 8)))["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))

    def train_step(state, x):
        loss = lambda p: (state.apply_fn({"params": p}, x) ** 2).mean()  # noqa: E731
        return state.apply_gradients(grads=jax.grad(loss)(state.params))

    table = ss.instrument(train_step, scalify=False).op_table(state, jnp.ones((2, 8)))
    shaped = [r for r in table if r.pass_ == "opt" and r.shape in ((8, 4), (4,))]
    assert shaped and not [r.name for r in shaped if "/" not in r.name]
    moments = {r.name for r in shaped if r.primitive in ("integer_pow", "mul")}
    assert {"params/kernel/integer_pow", "params/kernel/mul", "params/bias/mul"} <= moments


def _tanh_model(p, x):
    return jnp.tanh(x @ p["w"]).sum()


def test_a_gradient_taken_inside_a_body_keeps_the_models_lines():
    """``jax.grad`` inside a jit, a scan or a shard_map body: JAX's differentiation of
    jnp's inlined helpers puts its own frames innermost, and the model's line must still
    be found past them (not the line that called the body)."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    line = f"{__file__}:{inspect.getsourcelines(_tanh_model)[1] + 1}"
    step = jax.grad(_tanh_model)
    jitted = jax.jit(step)
    mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
    mapped = jax.shard_map(step, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False)

    def scanned(p, x):
        return jax.lax.scan(lambda c, _: (c, step(p, x)), 0.0, None, length=2)[1]

    p, x = {"w": jnp.ones((4, 4))}, jnp.ones((2, 4))
    for name, fn in (("jit", lambda p, x: jitted(p, x)), ("shard_map", mapped), ("scan", scanned)):
        table = ss.instrument(fn, scalify=False).op_table(p, x)
        got = {r.source for r in table if r.primitive in ("tanh", "dot_general")}
        assert got == {line}, (name, got)


def _relu_model(p, x):
    return jax.nn.relu(x @ p["w"]).sum()


def test_a_custom_jvp_differentiated_inside_a_body_keeps_the_models_line(tmp_path):
    """``jax.nn.relu`` is a custom JVP: differentiated under a ``jax.grad`` inside a jit
    body (``nnx.jit``, or any jit the step calls), its ops are traced past JAX's
    custom-derivative machinery, live, and the model's line lies beyond it (they were
    placed at the jit's call line, which for a tracked ``nnx.jit`` step was scalescope's
    own wrapper in store/stateful.py)."""
    import optax
    from flax import nnx

    line = f"{__file__}:{inspect.getsourcelines(_relu_model)[1] + 1}"
    jitted = jax.jit(jax.grad(_relu_model))
    p, x = {"w": jnp.ones((4, 4))}, jnp.ones((2, 4))
    table = ss.instrument(lambda p, x: jitted(p, x), scalify=False).op_table(p, x)
    got = {r.source for r in table if r.primitive in ("max", "gt", "select_n")}
    assert got == {line}, got

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 4, rngs=rngs)

        def __call__(self, x):
            return jax.nn.relu(self.lin(x))

    model = Model(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, x):
        opt.update(model, nnx.grad(lambda m: m(x).sum())(model))

    with ss.Run(tmp_path / "run") as run:
        run.track(step, scalify=False)(model, opt, x)
    ops = ss.open_run(tmp_path / "run").ops
    call = f"{__file__}:{inspect.getsourcelines(Model.__call__)[1] + 1}"
    relu = ops[ops["primitive"].isin(["max", "gt", "select_n"])]
    assert len(relu) and set(relu["source"]) == {call}, relu[["name", "source"]]
    assert not ops["source"].str.contains("scalescope").any()


def _dp_loss(w, x):
    return jnp.mean(jnp.tanh(x @ w) ** 2)


@pytest.mark.parametrize("check_vma", [True, False])
def test_the_gradients_all_reduce_is_the_backward_pass(check_vma):
    """Data parallelism's ``lax.pmean`` (or ``psum``) of the gradients finishes the
    backward pass: its collective and pmean's division are ``bwd``; the update that reads
    them is ``opt``, the loss's pmean ``fwd``; a collective inside the optimizer's own
    scope stays there."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))

    def local(w, x):
        loss, g = jax.value_and_grad(_dp_loss)(w, x)
        g = jax.lax.pmean(g, "batch")
        loss = jax.lax.pmean(loss, "batch")
        g2 = jax.lax.psum(g * g, "batch")  # computed from the all-reduced gradients
        return w - 0.1 * g - 0.01 * g2, loss

    step = jax.shard_map(
        local, mesh=mesh, in_specs=(P(), P("batch")), out_specs=(P(), P()), check_vma=check_vma
    )
    w, x = jnp.full((8, 4), 0.1), jnp.ones((4, 8))
    ops = [r for r in ss.instrument(step, scalify=False).op_table(w, x) if r.pass_ != "input"]
    by_pass = {}
    for r in ops:
        by_pass.setdefault(r.pass_, []).append(r.primitive)
    # the gradients' pmean ends the backward pass: its collective, then its division
    assert by_pass["bwd"][-2:] in (["psum", "div"], ["psum_invariant", "div"]), by_pass
    assert "div" not in by_pass["opt"], by_pass
    # the loss's pmean in fwd; the update, and the psum of the squared (updated)
    # gradients it reads, in opt
    assert {"psum", "psum_invariant"} & set(by_pass["fwd"]), by_pass
    assert {"mul", "sub"} <= set(by_pass["opt"]), by_pass
    assert {"psum", "psum_invariant"} & set(by_pass["opt"]), by_pass
