"""The run store: Run writes, RunReader reads back exactly what the probe computed;
crash safety, incremental refresh, corrupt parts, append-or-refuse, clear errors."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pandas as pd
import pytest
from conftest import JAX_CACHE_WARNING, fail_on_warnings

import scalescope as ss
from scalescope import analysis as A
from scalescope.store import layout as L

HERE = Path(__file__).parent
L_DIRS = (L.STATS_DIR, L.SCALARS_DIR)


def mlp_step(w, x):
    def loss_fn(w):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    loss, g = jax.value_and_grad(loss_fn)(w)
    with jax.named_scope("opt"):
        w = w - 0.1 * g
    return w, loss


def wide_step(w, x):
    """Same signature, a different graph (one more op)."""
    w, loss = mlp_step(w, x)
    return w * 1.0, loss + 0.0


def scan_step(ws, x):
    def body(h, w):
        return jnp.tanh(h @ w), jnp.sum(h)

    h, sums = jax.lax.scan(body, x, ws)
    return ws * 0.99, jnp.mean(h**2) + jnp.sum(sums) * 0.0


@pytest.fixture
def data():
    w = jax.random.normal(jax.random.key(0), (16, 16)) * 0.3
    x = jax.random.normal(jax.random.key(1), (4, 16))
    return w, x


def _probe_rows(fn, args, every, n_steps, scalify=False):
    """Statistics of each recorded step computed by `instrument` directly."""
    probe = jax.jit(ss.instrument(fn, scalify=scalify))
    plain = jax.jit(fn)
    expected, state = {}, args[0]
    for i in range(n_steps):
        if i % every == 0:
            _, stats = probe(state, *args[1:])
            expected[i] = {k: np.asarray(v) for k, v in stats.items()}
        state, _ = plain(state, *args[1:])
    return expected


def _record(path, fn, args, n_steps, every=2, **kw):
    state = args[0]
    with ss.Run(path, every=every, **kw) as run:
        tracked = run.track(fn, scalify=False)
        for i in range(n_steps):
            state, loss = tracked(state, *args[1:])
            run.log(i, loss=loss, lr=0.1 * (i + 1))
    return state


# ---------------------------------------------------------------------------------------
# round trip


@pytest.mark.parametrize("fn", [mlp_step, scan_step], ids=["mlp", "scan"])
def test_recorded_run_reads_back_exactly_what_the_probe_returned(tmp_path, data, fn):
    w, x = data
    if fn is scan_step:
        w = jnp.stack([w, w * 0.5, w * 2.0])
    args, n_steps, every = (w, x), 7, 3
    expected = _probe_rows(fn, args, every, n_steps)
    final = _record(tmp_path / "r", fn, args, n_steps, every=every)
    np.testing.assert_array_equal(final, _plain_steps(fn, args, n_steps))

    reader = ss.open_run(tmp_path / "r")
    table = ss.instrument(fn, scalify=False).op_table(*args)
    assert reader.status == "closed"
    assert list(reader.steps) == [0, 3, 6]
    assert len(reader.ops) == len(table)
    assert list(reader.ops["name"]) == [op.name for op in table]
    assert [tuple(s) for s in reader.ops["shape"]] == [op.shape for op in table]
    wide = reader.stats(wide=True)
    assert len(wide) == 3 * table.n_rows
    for step, stats in expected.items():
        rows = wide[wide["step"] == step]
        np.testing.assert_array_equal(rows["op"], table.row_op)
        np.testing.assert_array_equal(rows["iteration"], table.row_iter)
        for name in table.stat_names:
            np.testing.assert_array_equal(rows[name].to_numpy(), stats[name], err_msg=name)
        for r in range(table.n_rows):  # histograms, row by row
            op, it = int(table.row_op[r]), int(table.row_iter[r])
            got = reader.hist(op, step, iteration=it)
            np.testing.assert_array_equal(got.to_numpy(), stats["hist"][r])
    if fn is scan_step:
        assert {tuple(v) for v in reader.ops["loop"]} >= {(3,)}
    # scalars: one row per logged step, in the order logged
    sc = reader.scalars
    assert list(sc.index) == list(range(n_steps))
    np.testing.assert_allclose(sc["lr"], 0.1 * (np.arange(n_steps) + 1))
    assert np.isfinite(sc["loss"]).all()


def _plain_steps(fn, args, n):
    state = args[0]
    for _ in range(n):
        state, _ = jax.jit(fn)(state, *args[1:])
    return state


def test_python_number_arguments_are_traced_as_under_jit(tmp_path):
    """`Run.track` jits the step, which makes ``lr=0.1`` a traced scalar: the op table
    must be traced the same way (it was traced with ``lr`` a constant, one op short, and
    the writer failed on the first recorded step)."""

    def step(p, x, *, lr=0.1):
        loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(p)
        return p - lr * g, loss

    p, x = jnp.ones((4, 3)), jnp.ones((2, 4))
    with ss.Run(tmp_path / "run", every=1) as run:
        tracked = run.track(step)
        for _ in range(2):
            p, _ = tracked(p, x, lr=0.05)
    reader = ss.open_run(tmp_path / "run")
    stats = reader.stats()
    assert sorted(set(stats["step"])) == [0, 1]
    assert set(stats["op"]) <= set(reader.ops.index) and len(stats)


def test_a_tracked_steps_programs_carry_its_name(tmp_path):
    """As ``jax.jit(step)`` names its program: profiles and XLA dumps show the step, and
    the persistent compilation cache (keys begin with the name) serves the same
    computation jitted elsewhere under it."""
    from scalescope.store.jitting import StaticLeafJit

    def my_train_step(p, x, n):
        return p * n + x

    args = (jnp.ones(3), jnp.ones(3), 2)
    text = lambda j: j.trace(*args).lower().as_text()  # noqa: E731
    assert "@jit_my_train_step" in text(StaticLeafJit(my_train_step, "where"))
    named = StaticLeafJit(lambda p, x, n: p, "where", "other")
    assert "@jit_other" in text(named)
    with ss.Run(tmp_path / "run", every=1) as run:
        tracked = run.track(my_train_step)
        tracked(*args)
        for program in (tracked._plain, tracked._recording):
            assert "@jit_my_train_step" in text(program)
    # a partial is named after its function, as jax.jit names it
    with ss.Run(tmp_path / "partial", every=1) as run:
        tracked = run.track(functools.partial(my_train_step, n=3))
        tracked(*args[:2])
        for program in (tracked._plain, tracked._recording):
            assert "@jit_my_train_step" in program.trace(*args[:2]).lower().as_text()


@pytest.mark.parametrize("scalify", [True, False])
@pytest.mark.parametrize("budget", [None, 0.5])
def test_non_array_arguments_are_static_as_with_static_argnums(tmp_path, scalify, budget):
    """A step written for a plain loop takes its optax transformation, a loss function
    and a string among its arguments (as track-and-visualize's examples do). `Run.track`
    keeps "the same signature as fn": such leaves are static, each distinct value its own
    compile, and the outputs equal `jax.jit` with ``static_argnums`` on the same call."""
    optax = pytest.importorskip("optax")

    def update(p, s, optimizer, loss_fn, x, *, act="tanh"):
        g = jax.grad(lambda w: loss_fn(getattr(jnp, act)(x @ w)))(p)
        u, s = optimizer.update(g, s, p)
        return optax.apply_updates(p, u), s

    def mean_square(y):
        return jnp.mean(y**2)

    opt = optax.adam(1e-2)
    p, x = jnp.linspace(-1, 1, 12).reshape(4, 3), jnp.ones((2, 4))
    s = opt.init(p)
    reference = jax.jit(update, static_argnums=(2, 3), static_argnames="act")
    with ss.Run(tmp_path / "run", every=1, budget=budget) as run:
        tracked = run.track(update, scalify=scalify)
        if budget is not None:  # else the steps may all run before it compiles
            tracked.warmup(p, s, opt, mean_square, x, act="tanh")
        for act in ("tanh", "tanh", "sin", "tanh"):
            want = reference(p, s, opt, mean_square, x, act=act)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = tracked(p, s, opt, mean_square, x, act=act)
            jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), got, want)
            # (scalify=True on plain arguments says once that nothing is scaled)
            caught = [
                w
                for w in caught
                if "carries a scale" not in str(w.message)
                and not re.search(JAX_CACHE_WARNING, str(w.message))
            ]
            # sin traces another graph than the run's: it runs, unrecorded, and says so
            assert len(caught) == (act == "sin"), [str(w.message) for w in caught]
            if act == "sin":
                assert "graph other than" in str(caught[0].message)
        with pytest.raises(TypeError, match=r"kwargs\['act'\] is a set.*hashable"):
            tracked(p, s, opt, mean_square, x, act={"tanh"})
        # inside a transformation a step cannot be recorded: refused, nothing submitted
        # (a tracer reaching the writer would fail the run at close)
        for transform in (jax.jit, lambda f: lambda *a: jax.eval_shape(f, *a)):
            with pytest.raises(TypeError, match="inside a JAX transformation"):
                transform(lambda p, x: tracked(p, s, opt, mean_square, x))(p, x)
    reader = ss.open_run(tmp_path / "run")
    assert {"input/p", "input/x"} <= set(reader.ops["name"])
    assert not any("optimizer" in n or "loss_fn" in n for n in reader.ops["name"])
    assert "tanh" in set(reader.ops["primitive"]) and "sin" not in set(reader.ops["primitive"])
    assert 2 not in set(reader.steps) and len(reader.steps) >= 1


def test_a_constant_state_leaf_that_scalify_returns_plain_keeps_every_step_recorded(tmp_path):
    """optax.adafactor returns placeholder zeros for the leaves it does not factor: under
    scalify they come back plain where the first call had ScaledArrays, and the second
    call traced another graph (the run recorded its first step only, and said so in a
    warning that printed the same op twice)."""
    tx = optax.adafactor(1e-2, min_dim_size_to_factor=8)
    p = {"w": jnp.linspace(-1.0, 1.0, 128).reshape(16, 8), "b": jnp.zeros(8)}
    x = jnp.ones((4, 16))

    def step(p, s, x):
        loss, g = jax.value_and_grad(lambda p: jnp.mean((x @ p["w"] + p["b"]) ** 2))(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    p0, s0 = ss.as_scaled_array(p, "rms"), ss.as_scaled_array(tx.init(p), "rms")
    want, got = (p0, s0), (p0, s0)
    with ss.Run(tmp_path / "run", every=1) as run, warnings.catch_warnings():
        fail_on_warnings()  # no "graph other than" warning
        tracked, plain = run.track(step), jax.jit(ss.scalify(step))
        for _ in range(4):
            *got, loss = tracked(*got, x)
            *want, _ = plain(*want, x)
    assert [type(leaf) for leaf in jax.tree.leaves(got[1], is_leaf=ss.is_scaled_array)].count(
        ss.ScaledArray
    ) < len(jax.tree.leaves(s0, is_leaf=ss.is_scaled_array))  # some came back plain
    assert list(ss.open_run(tmp_path / "run").steps) == [0, 1, 2, 3]
    for a, b in zip(jax.tree.leaves(ss.asarray(got)), jax.tree.leaves(ss.asarray(want))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # a bfloat16 constant too (NumPy does not count bfloat16 as floating)
    def reset(p, s):
        return p * 0.5, jnp.zeros(3, jnp.bfloat16)

    b16 = ss.as_scaled_array(jnp.ones(3, jnp.bfloat16))
    with ss.Run(tmp_path / "bf16", every=1) as run, warnings.catch_warnings():
        fail_on_warnings()
        tracked, args = run.track(reset), (b16, b16)
        for _ in range(3):
            args = tracked(*args)
    assert list(ss.open_run(tmp_path / "bf16").steps) == [0, 1, 2]
    # a graph that does differ is still refused, and the warning names what differs
    with ss.Run(tmp_path / "other", every=1) as run:
        tracked = run.track(lambda v: jnp.sin(v) * 2.0)
        tracked(jnp.ones(3))
        with pytest.warns(UserWarning, match=r"graph other than.*\(shape \[3\] -> \[4\]"):
            tracked(jnp.ones(4))
        tracked(jnp.ones(4))
    # and the views say that those calls ran unrecorded
    reader = ss.open_run(tmp_path / "other")
    assert list(reader.steps) == [0]
    assert reader.unrecorded_calls == {"count": 2, "first_step": 1, "functions": {"<lambda>": 2}}
    notes = A.measurement_notes(reader)
    assert any("2 calls of <lambda> (the first at step 1) traced" in n for n in notes), notes
    # and a healthy verdict on the one recorded call says what it did not see
    headline = reader.verdict().headline
    assert headline.startswith("verdict: healthy (") and (
        "2 calls of <lambda> from step 1 traced another graph and ran unrecorded" in headline
    ), headline
    assert ss.open_run(tmp_path / "run").unrecorded_calls is None


def test_the_step_is_interpreted_once_for_the_op_table_and_the_recording(tmp_path, monkeypatch):
    """Registering a tracked step traces the recording program itself, and jit keeps
    that trace: the probe interprets the step once, not once for the op table and again
    for the first recorded step (each is seconds on a transformer)."""
    import importlib

    instrument_module = importlib.import_module("scalescope.probe.instrument")
    built = []
    root = instrument_module.Recorder.root
    monkeypatch.setattr(
        instrument_module.Recorder, "root", lambda *a, **k: built.append(1) or root(*a, **k)
    )

    def step(p, x):
        loss, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(p)
        return p - 0.1 * g, loss

    p, x = jnp.ones((4, 3)), jnp.ones((2, 4))
    for budget in (None, 0.5):
        built.clear()
        with ss.Run(tmp_path / f"run{budget}", every=1, budget=budget) as run:
            tracked = run.track(step)
            if budget is not None:  # else 3 steps may all run before it compiles
                tracked.warmup(p, x)
            for _ in range(3):
                p, _ = tracked(p, x)
        # under a budget, one more abstract pass weighs the values to split into groups
        assert len(built) == (1 if budget is None else 2), budget
        assert len(ss.open_run(tmp_path / f"run{budget}").steps) >= 1


def test_a_second_run_of_the_same_step_reuses_its_programs(tmp_path):
    """`Run.track` of a step already tracked with the same options (a notebook cell run
    again) traces and compiles nothing; each run still counts and records its own steps,
    and other options, or a step function seen longer ago than the cache keeps, trace
    anew."""
    from scalescope.store import tracked as tracked_module

    tracked_module._PROGRAMS.clear()
    traced = []

    def step(p, x):
        traced.append(1)  # runs only while JAX traces the step
        return p - 0.1 * jnp.tanh(x @ p), jnp.mean(p)

    p, x = jnp.ones((3, 3)), jnp.eye(3)

    def train(name: str, **kw) -> int:
        before = len(traced)
        with ss.Run(tmp_path / name, every=2, **kw) as run:
            fn = run.track(step)
            q = p
            for _ in range(4):
                q, _ = fn(q, x)
        assert list(ss.open_run(tmp_path / name).steps) == [0, 2], name
        return len(traced) - before

    assert train("first") > 0
    assert train("again") == 0  # same function, same options
    assert train("fp16 only", formats="fp16") > 0  # other statistics: another program
    for i in range(tracked_module._ProgramCache.SIZE):  # push `step` out of the cache
        with ss.Run(tmp_path / f"other{i}", every=1) as run:
            run.track(lambda q, y, i=i: (q * (i + 2), q.sum()))(p, x)
    assert train("evicted") > 0


def test_long_stats_filters_metric_ops_steps(tmp_path, data):
    _record(tmp_path / "r", mlp_step, data, 5, every=1)
    reader = ss.open_run(tmp_path / "r")
    long = reader.stats("rms")
    assert set(long["metric"]) == {"rms"}
    assert list(long.columns) == [
        "step", "op", "iteration", "name", "pass", "primitive", "metric", "value",
    ]  # fmt: skip
    dots = reader.stats(["rms", "snr_e4m3"], ops=r"^fwd/.*dot_general", steps=slice(1, 3))
    assert set(dots["step"]) == {1, 2}
    assert set(dots["primitive"]) == {"dot_general"} and set(dots["pass"]) == {"fwd"}
    assert set(dots["metric"]) == {"rms", "snr_e4m3"}
    one = reader.stats("absmax", ops=[2], steps=[0, 4])
    assert list(one["op"]) == [2, 2] and list(one["step"]) == [0, 4]
    with pytest.raises(KeyError, match="unknown metric 'rsm'"):
        reader.stats("rsm")
    with pytest.raises(ValueError, match="not a valid regex"):
        reader.stats("rms", ops="(")
    with pytest.raises(KeyError, match="no op with id 999"):
        reader.stats("rms", ops=[999])
    # hist by name, last step; an absent step names the nearest ones
    name = reader.ops.loc[2, "name"]
    h = reader.hist(f"fwd/{name}")
    assert h.attrs["step"] == 4 and h.sum() == 4 * 16
    with pytest.raises(KeyError, match="nearest"):
        reader.hist(2, step=17)


def test_metadata_records_versions_device_formats_and_bins(tmp_path, data):
    _record(tmp_path / "r", mlp_step, data, 2, formats=("e4m3", "fp16"), config={"lr": 0.1})
    meta = json.loads((tmp_path / "r" / "run.json").read_text())
    assert meta["format"] == "scalescope-run" and meta["status"] == "closed"
    assert meta["versions"]["jax"] == jax.__version__
    assert meta["device"]["platform"] == jax.devices()[0].platform
    assert meta["formats"] == ["e4m3", "fp16"] and meta["config"] == {"lr": 0.1}
    assert meta["format_info"]["e4m3"]["max"] == 448.0
    assert len(meta["hist_columns"]) == 68 and meta["hist_exponents"] == [-40, 23]
    assert meta["graph"]["n_ops"] == len(ss.open_run(tmp_path / "r").ops)
    parts = sorted(p.name for p in (tmp_path / "r" / "stats").iterdir())
    assert parts and all(L.parse_part_name(p) for p in parts), parts


# ---------------------------------------------------------------------------------------
# append or refuse


def test_reopening_with_the_same_graph_appends(tmp_path, data):
    w = _record(tmp_path / "r", mlp_step, data, 4, every=2)
    _record(tmp_path / "r", mlp_step, (w, data[1]), 4, every=2)
    reader = ss.open_run(tmp_path / "r")
    # the second session numbers its steps after the last one logged (3)
    assert list(reader.steps) == [0, 2, 4, 6]
    assert len(reader.meta["sessions"]) == 2


def test_reopening_with_a_different_graph_refuses_and_leaves_the_run_intact(tmp_path, data):
    _record(tmp_path / "r", mlp_step, data, 2, every=1)
    before = sorted(os.listdir(tmp_path / "r" / "stats"))
    meta = (tmp_path / "r" / L.RUN_FILE).read_bytes()
    with pytest.raises(ss.RunMismatchError, match="different graph.*op"):
        _record(tmp_path / "r", wide_step, data, 2, every=1)
    assert sorted(os.listdir(tmp_path / "r" / "stats")) == before
    # nothing written: not even the refused session's entry or config in run.json
    assert (tmp_path / "r" / L.RUN_FILE).read_bytes() == meta
    with pytest.raises(ss.RunMismatchError, match="formats"):
        ss.Run(tmp_path / "r", formats=("e5m2",))
    reader = ss.open_run(tmp_path / "r")
    assert list(reader.steps) == [0, 1]


def _eval_loss(w, x):
    return jnp.mean(jnp.tanh(x @ w) ** 2)


def test_an_eval_step_tracked_beside_the_train_step_runs_unrecorded_and_training_goes_on(
    tmp_path, data
):
    """A second function tracked into the run (an eval step) whose graph is not the
    run's: a run holds one graph, so its calls run unrecorded, said once, instead of a
    RunMismatchError in the middle of training; the run counts them by function."""
    w, x = data
    with ss.Run(tmp_path / "r", every=2) as run:
        train = run.track(mlp_step, scalify=False)
        evaluate = run.track(_eval_loss, scalify=False)
        seen = []
        with pytest.warns(UserWarning) as caught:
            for i in range(4):
                w, loss = train(w, x)
                if i % 2:
                    seen.append((evaluate(w, x), w))
    said = [str(c.message) for c in caught if "graph other than" in str(c.message)]
    assert len(said) == 1, said
    assert said[0].startswith(
        f"Run.track: _eval_loss traces a graph other than the one {tmp_path / 'r'} records "
        "(mlp_step's, tracked and called first: "
    )
    assert "calls of _eval_loss run unrecorded (the flight recorder still checks them" in said[0]
    for got, at in seen:
        np.testing.assert_array_equal(got, jax.jit(_eval_loss)(at, x))
    reader = ss.open_run(tmp_path / "r")
    assert list(reader.steps) == [0, 2]
    # numbered by the eval step itself, from the run's count when it was tracked
    assert reader.unrecorded_calls == {"count": 2, "first_step": 0, "functions": {"_eval_loss": 2}}


def test_a_train_step_called_after_another_functions_graph_is_still_checked(tmp_path, data):
    """An eval step called once before training makes its graph the run's; the train
    step's calls then run unrecorded, but the flight recorder still checks each one: a
    NaN is an incident (named by step, not replayed), the run is not healthy, and the
    views count the train step's unrecorded calls by name."""
    w, x = data

    def nan_from_3(w, x, t):
        w, loss = mlp_step(w, x)
        return w, loss * jnp.where(t >= 3, jnp.nan, 1.0)

    with ss.Run(tmp_path / "r", every=2) as run:
        train = run.track(nan_from_3, scalify=False)
        evaluate = run.track(_eval_loss, scalify=False)
        evaluate(w, x)
        with pytest.warns(UserWarning, match="nan_from_3 traces a graph other than"):
            for i in range(5):
                w, loss = train(w, x, jnp.int32(i))
        assert not run.healthy
    reader = ss.open_run(tmp_path / "r")
    (row,) = reader.incidents().to_dict("records")
    assert row["step"] == 3 and row["op"] == -1 and not row["replayed"]
    assert "not replayed: this call of nan_from_3 traced another graph" in row["detail"]
    assert reader.unrecorded_calls["functions"] == {"nan_from_3": 5}


def test_two_trackers_of_one_step_share_the_runs_step_numbers(tmp_path, data):
    """The same step tracked twice (with and without donation, say) before either is
    called, the calls interleaved: each call takes the run's next number, so no two
    record under one step."""
    w, x = data
    with ss.Run(tmp_path / "r", every=1) as run:
        a = run.track(mlp_step, scalify=False)
        b = run.track(mlp_step, scalify=False, donate_argnums=0)
        for _ in range(3):
            w, _ = a(w, x)
            w, _ = b(w, x)
    reader = ss.open_run(tmp_path / "r")
    assert list(reader.steps) == list(range(6)) and reader.unrecorded_calls is None
    rows = reader.stats("rms")
    assert not rows.duplicated(["step", "op", "iteration"]).any()


def test_a_second_writer_on_the_same_run_is_refused(tmp_path):
    with ss.Run(tmp_path / "r"):
        with pytest.raises(ss.RunError, match="being recorded by pid"):
            ss.Run(tmp_path / "r")
    ss.Run(tmp_path / "r").close()  # released on close


# ---------------------------------------------------------------------------------------
# errors


def test_missing_foreign_and_file_paths_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ss.open_run(tmp_path / "nope")
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(ss.NotARunError, match="is a file"):
        ss.open_run(tmp_path / "f.txt")
    with pytest.raises(ss.NotARunError, match="is a file"):
        ss.Run(tmp_path / "f.txt")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.md").write_text("mine")
    with pytest.raises(ss.NotARunError, match="not a scalescope run"):
        ss.open_run(foreign)
    with pytest.raises(ss.NotARunError, match=r"not a scalescope run \(it holds notes.md\)"):
        ss.Run(foreign)
    (foreign / "run.json").write_text("{broken")
    with pytest.raises(ss.RunError, match="unreadable run metadata"):
        ss.open_run(foreign)
    (foreign / "run.json").write_text('{"format": "other"}')
    with pytest.raises(ss.NotARunError, match="no format marker"):
        ss.open_run(foreign)
    with pytest.raises(ValueError, match="every must be an integer >= 1"):
        ss.Run(tmp_path / "x", every=0)


def test_open_run_on_a_directory_of_runs_points_to_list_runs(tmp_path):
    for name in ("b", "a", "nested/c"):
        ss.Run(tmp_path / "runs" / name).close()
    (tmp_path / "runs" / "junk").mkdir()
    with pytest.raises(ss.NotARunError, match="list_runs"):
        ss.open_run(tmp_path / "runs")
    runs = ss.list_runs(tmp_path / "runs")
    assert [p.relative_to(tmp_path / "runs").as_posix() for p in runs] == ["a", "b", "nested/c"]
    assert ss.list_runs(tmp_path / "runs" / "a") == [tmp_path / "runs" / "a"]
    with pytest.raises(FileNotFoundError):
        ss.list_runs(tmp_path / "nope")


def test_log_rejects_bad_values(tmp_path):
    with ss.Run(tmp_path / "r") as run:
        with pytest.raises(ValueError, match="'loss' at step 3 must be a scalar"):
            run.log(3, loss=jnp.ones(2))
        with pytest.raises(TypeError, match="'tag' at step 3 must be a number"):
            run.log(3, tag="x")
        with pytest.raises(ValueError, match="step must be an integer >= 0"):
            run.log(-1, loss=1.0)
        run.log(1, loss=ss.ScaledArray(jnp.float16(0.5), jnp.float32(4.0)))
    assert ss.open_run(tmp_path / "r").scalars.loc[1, "loss"] == 2.0
    with pytest.raises(ss.RunError, match="closed"):
        run.log(2, loss=1.0)


def test_writer_failure_surfaces_in_the_training_thread(tmp_path, monkeypatch):
    def fail(path, table):
        raise OSError("disk full")

    run = ss.Run(tmp_path / "r", flush_steps=1)
    monkeypatch.setattr(L, "write_parquet_atomic", fail)
    run.log(0, loss=1.0)
    with pytest.raises(ss.RunError, match="disk full"):
        run.flush()
    with pytest.raises(ss.RunError, match="disk full"):
        run.log(1, loss=1.0)
    monkeypatch.undo()
    with pytest.raises(ss.RunError):
        run.close()


# ---------------------------------------------------------------------------------------
# corrupt parts, multi-process, live refresh


def test_corrupt_part_is_skipped_with_a_warning_naming_it(tmp_path, data):
    run = ss.Run(tmp_path / "r", every=1, flush_steps=1)
    tracked = run.track(mlp_step, scalify=False)
    w = data[0]
    for _ in range(4):
        w, _ = tracked(w, data[1])
        run.flush()
    run.close()
    parts = L.list_parts(tmp_path / "r" / "stats")
    assert len(parts) == 4
    raw = parts[1].read_bytes()
    parts[1].write_bytes(raw[: len(raw) // 2])  # truncated
    parts[2].write_bytes(b"garbage" * 10)  # not Parquet at all
    with pytest.warns(ss.RunWarning) as caught:
        reader = ss.open_run(tmp_path / "r")
    msgs = " ".join(str(w.message) for w in caught)
    assert parts[1].name in msgs and parts[2].name in msgs
    assert list(reader.steps) == [0, 3]
    assert len(reader.stats("rms", steps=3)) == len(reader.stats("rms", steps=0)) > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert reader.refresh() == 0  # warned once, not on every refresh


def test_processes_write_their_own_parts(tmp_path, data):
    path = tmp_path / "r"
    runs = [ss.Run(path, every=1, process_index=p, flush_steps=1) for p in (0, 1)]
    tracked = [r.track(mlp_step, scalify=False) for r in runs]
    for i in range(3):
        for r, t in zip(runs, tracked):
            t(*data)
            r.log(i, loss=float(i))
    for r in runs:
        r.close()
    keys = {d: [L.parse_part_name(p.name) for p in (path / d).iterdir()] for d in L_DIRS}
    for proc in (0, 1):  # each process numbers its own parts 0, 1, 2... (shared by both dirs)
        seqs = sorted({seq for d in L_DIRS for seq, p in keys[d] if p == proc})
        assert seqs == list(range(len(seqs))), keys
        assert len([k for k in keys["stats"] if k[1] == proc]) == 3, keys
    assert (path / "stats" / "part-000000-p1.parquet").is_file()
    reader = ss.open_run(path)
    both = reader.stats("rms", process=None)
    assert set(both["process"]) == {0, 1}
    assert len(both) == 2 * len(reader.stats("rms"))


def test_reader_following_a_live_run_sees_new_steps(tmp_path, data):
    run = ss.Run(tmp_path / "r", every=1, flush_steps=100, flush_seconds=0.2)
    tracked = run.track(mlp_step, scalify=False)
    w, x = data
    w, _ = tracked(w, x)
    run.flush()
    reader = ss.open_run(tmp_path / "r")
    assert list(reader.steps) == [0] and reader.status == "recording"
    for _ in range(3):
        w, _ = tracked(w, x)
    deadline = time.monotonic() + 10
    while len(reader.steps) < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
        reader.refresh()  # the timed flush (0.2 s) writes without any call from the loop
    assert list(reader.steps) == [0, 1, 2, 3]
    run.close()
    reader.refresh()
    assert reader.status == "closed"


def test_sigkill_loses_at_most_the_unflushed_buffer(tmp_path):
    flush_steps, path = 3, tmp_path / "r"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "store_writer_script.py"), str(path), str(flush_steps),
         "100000", "0.01"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    printed, follower, seen_early = -1, None, 0
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            printed = int(line.split()[1])
            if printed == 20:  # a reader follows the run while another process writes it
                follower = ss.open_run(path)
                seen_early = len(follower.steps)
                # another process holds the lock: a live writer, not an abandoned one
                assert follower.status == "recording" and follower.damage == []
            if printed >= 40:
                break
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        for line in proc.stdout.read().splitlines():  # what it printed before it died
            printed = max(printed, int(line.split()[1]))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert printed >= 40, proc.stderr.read()[-3000:]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every part on disk is whole
        reader = ss.open_run(path)
    steps = list(reader.steps)
    assert steps == list(range(len(steps)))  # every flushed step, in order, no holes
    assert printed - steps[-1] <= 2 * flush_steps + 1
    n_rows = reader.meta["graph"]["n_rows"]
    counts = reader.stats("rms").groupby("step").size()
    assert (counts == n_rows).all()  # no step half written
    # killed, never closed: the run says so, naming the writer, and a gate fails closed
    assert reader.status == "damaged"
    assert any(f"pid {proc.pid} " in note and "without closing" in note for note in reader.damage)
    assert 0 < seen_early < len(steps)
    follower.refresh()
    assert list(follower.steps) == steps
    # what the killed writer left behind is appendable
    with ss.Run(path, every=1) as run:
        assert run.start_step == max(steps[-1], int(reader.scalars.index.max())) + 1
        live = ss.open_run(path)  # a writer records it again: not abandoned
        assert live.status == "recording" and live.damage == []
    # an append that recorded nothing leaves run.json as the killed writer left it, and
    # the killed writer stays the one named (not the session that closed cleanly)
    after = ss.open_run(path)
    assert after.status == "damaged"
    assert any(f"pid {proc.pid} " in note for note in after.damage), after.damage
    assert not any(f"pid {os.getpid()} " in note for note in after.damage), after.damage


def test_stats_frame_matches_reader_wide_rows(tmp_path, data):
    """The reader's wide frame and the probe's own stats_frame agree column for column."""
    _record(tmp_path / "r", mlp_step, data, 1, every=1)
    probe = ss.instrument(mlp_step, scalify=False)
    _, stats = jax.jit(probe)(*data)
    expected = ss.stats_frame(probe.op_table(*data), stats)
    got = ss.open_run(tmp_path / "r").stats(wide=True)
    for col in ("op", "name", "pass", "primitive", "rms", "snr_e5m2"):
        pd.testing.assert_series_equal(
            got[col].reset_index(drop=True), expected[col].reset_index(drop=True),
            check_dtype=False, check_names=False,
        )  # fmt: skip


def test_scalars_keep_nan_and_inf_values(tmp_path):
    """A loss that turns NaN is the value a user looks for: it must read back as NaN,
    and a scalar logged only as NaN must still be a column."""
    with ss.Run(tmp_path / "r") as run:
        run.log(0, loss=1.5, gnorm=float("nan"))
        run.log(1, loss=float("nan"), gnorm=float("nan"))
        run.log(2, loss=float("inf"), gnorm=float("nan"))
    sc = ss.open_run(tmp_path / "r").scalars
    assert list(sc.index) == [0, 1, 2]
    assert sc.loc[0, "loss"] == 1.5
    assert np.isnan(sc.loc[1, "loss"]) and np.isinf(sc.loc[2, "loss"])
    assert "gnorm" in sc.columns and sc["gnorm"].isna().all()


def test_reader_advise_flags_an_overflowing_cast(tmp_path):
    """`reader.advise()` is the advisor on the run: an E4M3 cast of values up to ~1000
    (E4M3's max is 448) is flagged as an overflow of the forward pass."""
    import ml_dtypes

    def step(w, x):
        y = ss.ops.cast_on_forward(x @ w, ml_dtypes.float8_e4m3fn)
        return w, jnp.sum(y.astype(jnp.float32))

    w = jnp.eye(8) * 250.0
    x = jax.random.normal(jax.random.key(0), (64, 8))
    with ss.Run(tmp_path / "r") as run:
        tracked = run.track(step, scalify=False)
        for i in range(2):
            w, loss = tracked(w, x)
            run.log(i, loss=loss)
    ref = np.abs(np.asarray(x @ jnp.eye(8) * 250.0))
    assert ref.max() > 448  # independent check that the data does overflow E4M3
    findings = ss.open_run(tmp_path / "r").advise()
    hit = findings[(findings["rule"] == "overflow") & (findings["format"] == "e4m3")]
    assert len(hit) >= 1 and set(hit["pass"]) == {"fwd"}
    assert hit["first_step"].min() == 0
    expected = float(np.mean(ref > 448))
    assert np.isclose(hit["value"].max(), expected, rtol=1e-6)


def test_store_reader_is_pure_storage_and_open_run_adds_the_views(tmp_path, data):
    """`scalescope.store.open_run` gives the bare reader: plain pandas data, no judgement
    (no advise/heatmap/compare/delayed_scaling). `ss.open_run` gives a `RunView`, the same
    reader (``isinstance`` holds) whose conveniences wrap exactly the stored data."""
    from scalescope import analysis
    from scalescope import notebook as nb
    from scalescope.store import RunReader
    from scalescope.store import open_run as open_stored

    w, x = data
    with ss.Run(tmp_path / "r", every=1) as run:
        tracked = run.track(mlp_step, scalify=False)
        for i in range(3):
            w, loss = tracked(w, x)
            run.log(i, loss=loss)
        run.scale_graph(2, lambda w: jnp.mean(jnp.tanh(x @ w) ** 2), w)
    pure, view = open_stored(tmp_path / "r"), ss.open_run(tmp_path / "r")
    assert type(pure) is RunReader and type(view) is ss.RunView
    assert isinstance(view, ss.RunReader) and repr(view) == repr(pure)
    for name in ("advise", "heatmap", "compare", "delayed_scaling"):
        assert not hasattr(pure, name) and callable(getattr(view, name))

    op = int(pure.ops.index[pure.ops["stats_op"] >= 0][0])
    plain, shown = pure.hist(op, -1), view.hist(op, -1)
    assert type(plain) is pd.Series and isinstance(shown, nb.HistSeries)
    pd.testing.assert_series_equal(pd.Series(shown), plain)
    assert shown.attrs == plain.attrs == {"step": 2, "op": op, "iteration": None}

    graph, drawn = pure.scale_graph(), view.scale_graph()
    assert type(graph) is pd.DataFrame and isinstance(drawn, nb.ScaleGraph)
    pd.testing.assert_frame_equal(pd.DataFrame(drawn), graph)
    assert graph.attrs == {"step": 2} and drawn.attrs["formats"] == ["e4m3", "e5m2", "fp16", "bf16"]

    rows = pure.op_rows(op)
    assert list(rows.columns[:4]) == ["step", "count", "absmax", "scale"]
    assert list(rows.columns[4:]) == list(pure.hist_columns) and rows["step"].tolist() == [0, 1, 2]
    replay = view.delayed_scaling(op, history=2)
    pd.testing.assert_frame_equal(replay, analysis.delayed_scaling_run(pure, op, history=2))
    assert replay.attrs["op"] == op and replay.attrs["label"].endswith(pure.ops.loc[op, "name"])

    pd.testing.assert_frame_equal(pd.DataFrame(view.advise()), analysis.advise_run(pure))


def test_a_step_tracked_again_continues_the_runs_steps(tmp_path, data):
    """A second `track` of the run (a notebook cell run twice) numbers its calls after
    the first one's: it used to restart at 0 and write a second set of rows for step 0.
    Negative steps count from the last recorded one, as `hist` counts them; a step may
    be a device integer (a Flax ``TrainState.step``)."""
    w, x = data
    with ss.Run(tmp_path / "r", every=1) as run:
        first = run.track(mlp_step, scalify=False)
        for i in range(3):
            w, loss = first(w, x)
            run.log(i, loss=loss)
        again = run.track(mlp_step, scalify=False)
        w, loss = again(w, x)
        run.log(jnp.int32(3), loss=loss)
    reader = ss.open_run(tmp_path / "r")
    assert list(reader.steps) == [0, 1, 2, 3] and list(reader.scalars.index) == [0, 1, 2, 3]
    rows = reader.stats("rms").groupby("step").size()
    assert (rows == reader.meta["graph"]["n_rows"]).all(), rows
    assert set(reader.stats("rms", steps=-1)["step"]) == {3}
    assert set(reader.stats("rms", steps=slice(-2, None))["step"]) == {2, 3}
    assert set(reader.stats("rms", steps=slice(None, -2))["step"]) == {0, 1}
    assert set(reader.stats("rms", steps=[0, -1])["step"]) == {0, 3}
    assert set(reader.stats("rms", steps=slice(-9, None))["step"]) == {0, 1, 2, 3}
    with pytest.raises(KeyError, match="steps=-5: only 4 steps are recorded"):
        reader.stats("rms", steps=-5)
    with pytest.raises(TypeError, match=r"metric: a statistic's name .*ops=\[64\]"):
        reader.stats(64)  # an op id where the metric goes
    for names in (
        pd.Index(["rms", "absmax"]),
        np.array(["rms", "absmax"]),
        {"rms": 0, "absmax": 1}.keys(),
    ):
        assert set(reader.stats(names, steps=-1)["metric"]) == {"rms", "absmax"}


def test_a_run_with_no_recorded_step_is_not_judged_healthy(tmp_path):
    with ss.Run(tmp_path / "r") as run:
        run.log(0, loss=1.0)
    v = ss.open_run(tmp_path / "r").verdict()
    assert v.status == "healthy" and v.unjudged == "no step recorded; the logged loss is finite"
    assert v.headline == "verdict: not judged (no step recorded; the logged loss is finite)"
    assert v.as_dict()["unjudged"] == v.unjudged
    with ss.Run(tmp_path / "acc") as run:  # no loss logged: the headline does not claim one
        run.log(0, acc=0.5)
    v = ss.open_run(tmp_path / "acc").verdict()
    assert v.headline == "verdict: not judged (no step recorded; no loss logged)"
    with ss.Run(tmp_path / "nan") as run:
        run.log(0, loss=float("nan"))
    assert ss.open_run(tmp_path / "nan").verdict().status == "failing"  # judged by the loss


def _masked_step(w, x=None, *, mask=None):
    return w - 0.1 * ((x @ w) * mask).T @ x, jnp.sum(mask)


def test_an_argument_given_by_position_or_by_keyword_is_one_graph(tmp_path, recwarn):
    """The op table names inputs as they are passed: ``step(w, x, mask=m)`` then
    ``step(w, x=x, mask=m)`` used to read as another graph and run unrecorded."""
    w, x, m = jnp.ones((4, 4)) * 0.5, jnp.ones((2, 4)), jnp.ones((2, 4))
    with ss.Run(tmp_path / "r", every=1) as run:
        tracked = run.track(_masked_step)
        tracked.warmup(w, x=x, mask=m)
        a = tracked(w, x, mask=m)
        b = tracked(w, x=x, mask=m)
        c = tracked(mask=m, x=x, w=w)
    plain = jax.jit(_masked_step)(w, x, mask=m)
    for out in (a, b, c):
        np.testing.assert_array_equal(out[0], plain[0])
    reader = ss.open_run(tmp_path / "r")
    assert list(reader.steps) == [0, 1, 2] and reader.unrecorded_calls is None
    assert not [w for w in recwarn.list if "graph other than" in str(w.message)]


def _biased_step(p, x):
    g = jax.grad(lambda p: jnp.mean(jnp.tanh(x @ p["w"] + p["b"]) ** 2))(p)
    return optax.apply_updates(p, jax.tree.map(lambda u: -0.1 * u, g))  # strongly typed


def test_a_weakly_typed_parameter_is_one_graph(tmp_path, recwarn):
    """A bias made from a Python number (``jnp.full(n, -1.0)``, weakly typed) comes back
    strongly typed from the step: the second call traced another graph (JAX casts where
    a weak value meets a strong one), and every call after the first ran unrecorded."""
    p = {"w": jnp.ones((4, 4)) / 4, "b": jnp.full((4,), -1.0)}
    assert p["b"].weak_type
    x = jnp.ones((2, 4))
    ref = p
    with ss.Run(tmp_path / "r", every=1) as run:
        tracked = run.track(_biased_step, scalify=False)
        for _ in range(3):
            p, ref = tracked(p, x), jax.jit(_biased_step)(ref, x)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    reader = ss.open_run(tmp_path / "r")
    assert list(reader.steps) == [0, 1, 2] and reader.unrecorded_calls is None
    assert not [w for w in recwarn.list if "graph other than" in str(w.message)]


def test_a_session_ended_by_an_exception_says_so(tmp_path, data):
    """The data is kept and the run is closed, but the views say the training stopped
    there (it used to read as a run that ended normally)."""
    w, x = data
    with pytest.raises(KeyboardInterrupt), ss.Run(tmp_path / "r", every=1) as run:
        tracked = run.track(mlp_step, scalify=False)
        w, _ = tracked(w, x)
        raise KeyboardInterrupt
    reader = ss.open_run(tmp_path / "r")
    assert reader.status == "closed" and list(reader.steps) == [0]
    assert reader.ended_by == "KeyboardInterrupt: "
    notes = ss.analysis.measurement_notes(reader)
    assert any("ended with an exception (KeyboardInterrupt" in n for n in notes), notes
    with ss.Run(tmp_path / "r", every=1) as run:  # a later session that ends normally
        run.track(mlp_step, scalify=False)(w, x)
    assert ss.open_run(tmp_path / "r").ended_by == ""


def test_files_written_together_are_all_renamed_or_none(tmp_path):
    """The report's HTML and JSON: a failure writing the second leaves neither (and no
    temporary file), not a report without its JSON."""
    (tmp_path / "old.html").write_bytes(b"old")
    (tmp_path / "afile").write_bytes(b"")
    pair = [(tmp_path / "old.html", b"new"), (tmp_path / "afile" / "x.json", b"{}")]
    with pytest.raises(L.RunWriteError, match="afile"):
        L.write_files_atomic(pair)
    assert (tmp_path / "old.html").read_bytes() == b"old"  # untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "old.html"]
    L.write_files_atomic([(tmp_path / "old.html", b"new"), (tmp_path / "x.json", b"{}")])
    assert (tmp_path / "old.html").read_bytes() == b"new"
    assert (tmp_path / "x.json").read_bytes() == b"{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "old.html", "x.json"]


def _two_matmuls(w, x):
    return jnp.mean(jnp.tanh(x @ w) @ w)


def test_ops_are_found_by_the_labels_the_views_show(tmp_path):
    """The findings, heatmaps and dashboard name ops ``fwd/dot_general#2``: that label (as
    shown, shape and all) picks the op in the reader and in ss.show; a name two ops share
    lists their labels; a histogram is named by its label (it read input/input/w)."""
    from scalescope.notebook import select_ops

    w, x = jnp.full((4, 4), 0.25), jnp.ones((2, 4))
    with ss.Run(tmp_path / "r") as run:
        run.track(_two_matmuls, scalify=False)(w, x)
    reader = ss.open_run(tmp_path / "r")
    labels = A.op_labels(reader.ops)
    second = int(labels.index[labels.str.startswith("fwd/dot_general#2")][0])
    assert reader.op_id("fwd/dot_general#2") == second
    assert reader.op_id(str(labels[second])) == second  # with the shape, as shown
    with pytest.raises(KeyError, match=r"2 ops named 'fwd/dot_general'.*#1 \(op \d+\)"):
        reader.op_id("fwd/dot_general")
    with pytest.raises(TypeError, match="op: an op id or label"):
        reader.op_id(1.5)
    assert reader.hist("fwd/dot_general#2").name == "fwd/dot_general#2"
    for bad in (None, "0", 0.0, True):
        with pytest.raises(TypeError, match="hist: step must be a step number"):
            reader.hist(second, step=bad)
    with pytest.raises(TypeError, match="ops: an op id, a list of ids or a regex"):
        reader.stats("rms", ops=1.5)
    assert reader.hist(reader.op_id("input/w")).name == "input/w"
    rows = reader.stats("rms", ops=r"dot_general#2$")
    assert set(rows["op"]) == {second}
    table = ss.instrument(_two_matmuls, scalify=False).op_table(w, x)
    (rec,) = select_ops(table, "fwd/dot_general#2")
    assert rec.id == table.find("dot_general")[1].id


def test_a_scalified_step_on_plain_arguments_says_it_runs_unscaled(tmp_path):
    """`Run.track` scalifies by default, but a step whose arguments are plain arrays
    carries no scale: it runs as written. That is said once, at the user's line, and the
    run's graph records it unscaled (so the advisor's fixes are the naive ones); with
    scaled arguments nothing is said and the graph is scalified."""

    def step(w, x):
        loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
        return w - 0.1 * g, loss

    w, x = jnp.linspace(-1, 1, 8).reshape(4, 2), jnp.ones((3, 4))
    for name, arg in (("plain", w), ("scaled", ss.as_scaled_array(w, "rms"))):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with ss.Run(tmp_path / name, every=1) as run:
                tracked = run.track(step)
                for _ in range(3):
                    arg, _loss = tracked(arg, x)
        said = [w for w in caught if "carries a scale" in str(w.message)]
        graph = ss.open_run(tmp_path / name).meta["graph"]
        if name == "plain":
            assert len(said) == 1 and said[0].filename == __file__, said
            assert "ss.as_scaled_array" in str(said[0].message)
            assert graph["scalify"] is False
        else:
            assert said == [] and graph["scalify"] is True


def test_a_python_int_in_the_state_keeps_every_step_recorded(tmp_path):
    """Flax's ``TrainState.create`` starts ``step`` at the Python int 0; the step returns
    it as an array. Traced weakly at the first call and strongly after, the second call's
    graph differed and every call after the first ran unrecorded (wmt, lm1b: 29 of 30)."""
    optax = pytest.importorskip("optax")
    train_state = pytest.importorskip("flax.training.train_state")
    tx = optax.sgd(optax.linear_schedule(0.1, 0.01, 10))
    state = train_state.TrainState.create(apply_fn=None, params={"w": jnp.ones((4, 4))}, tx=tx)
    assert type(state.step) is int

    def step(state, x):
        loss, g = jax.value_and_grad(lambda p: jnp.mean(jnp.tanh(x @ p["w"]) ** 2))(state.params)
        lr = optax.linear_schedule(0.1, 0.01, 10)(state.step)  # as wmt's train_step does
        return loss + 0 * lr, state.apply_gradients(grads=g)

    with ss.Run(tmp_path / "run", every=1) as run:
        tracked = run.track(step, scalify=False)
        for _ in range(4):
            _, state = tracked(state, jnp.ones((2, 4)))
    assert sorted(set(ss.open_run(tmp_path / "run").stats()["step"])) == [0, 1, 2, 3]
