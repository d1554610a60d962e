"""The overhead budget: masked groups in one program, the controller's plan, and a real
budgeted run whose rows are exact where measured and absent elsewhere."""

from __future__ import annotations

import logging
import math
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scalescope as ss
from scalescope.store.budget import MAX_STEP_OVERHEAD, TARGET, BudgetController, hot_groups


def _step(w, x):
    def loss(w):
        h = jnp.tanh(x @ w)
        for _ in range(3):
            h = jnp.tanh(h @ w) + h
        return jnp.mean(h * h)

    value, g = jax.value_and_grad(loss)(w)
    return w - 0.01 * g, value


W = jax.random.normal(jax.random.key(0), (32, 32)) / 6
X = jax.random.normal(jax.random.key(1), (16, 32))


def test_masked_groups_measure_exactly_the_groups_asked_for():
    inst = ss.instrument(_step, scalify=False, groups=4)
    table = inst.op_table(W, X)
    assert table.n_groups == 4
    groups = table.row_group
    assert set(groups.tolist()) == {0, 1, 2, 3}
    assert np.all(np.diff(groups) >= 0), "groups are consecutive in order of computation"
    # Groups are of comparable cost.
    elements = np.array(table.group_elements)
    assert elements.min() > 0 and elements.max() < 4 * elements.mean()
    _, full = jax.jit(inst)(W, X)
    masked = jax.jit(inst.masked)
    for mask in ([True, False, False, False], [False, True, False, True]):
        _, stats = masked(np.array(mask), W, X)
        on = np.array(mask)[groups]
        count = np.asarray(stats["count"])
        assert np.all(count[on] == np.asarray(full["count"])[on])
        assert np.all(count[~on] == 0)
        for name in ("rms", "absmax", "snr_e4m3", "underflow_e5m2"):
            # The same values, computed in a differently fused program: last-bit agreement
            # (an SNR in dB moves by ~1e-5 relative when a divide is fused differently).
            np.testing.assert_allclose(
                np.asarray(stats[name])[on], np.asarray(full[name])[on], rtol=1e-4
            )
            assert np.all(np.isnan(np.asarray(stats[name])[~on]))
    with pytest.raises(ValueError, match="shape"):
        masked(np.array([True, False]), W, X)
    with pytest.raises(ValueError, match="groups"):
        ss.instrument(_step, groups=-1)


def test_masked_groups_inside_a_scan():
    def f(x):
        def body(c, _):
            return jnp.sin(c) * 1.5 + c, None

        c, _ = jax.lax.scan(body, x, None, length=5)
        return jnp.sum(c * c)

    inst = ss.instrument(jax.grad(f), scalify=False, groups=3)
    x = jnp.linspace(-1, 1, 64)
    table = inst.op_table(x)
    _, full = jax.jit(inst)(x)
    for g in range(3):
        mask = np.arange(3) == g
        _, stats = jax.jit(inst.masked)(mask, x)
        on = table.row_group == g
        assert on.any()
        np.testing.assert_allclose(
            np.asarray(stats["rms"])[on], np.asarray(full["rms"])[on], rtol=1e-5
        )
        assert np.all(np.asarray(stats["count"])[~on] == 0)


def _simulate(ctrl: BudgetController, steps: int, t_plain: float, cost) -> list[int]:
    """Drive the controller with synthetic timings; returns the recorded steps."""
    recorded = []
    ctrl.observe_plain(t_plain)
    for step in range(steps):
        mask = ctrl.plan(step)
        if mask is not None:
            ctrl.observe_record(cost(mask), mask)
            recorded.append(step)
    return recorded


def test_controller_keeps_the_overhead_within_budget_and_covers_every_group():
    elements = [1000, 1200, 800, 1000, 1000, 900, 1100, 1000]
    ctrl = BudgetController(0.05, elements, fixed_share=1.0)
    t = 0.1
    # A recorded step costs one step (the shadow copy) plus 1 step per 4000 elements.
    cost = lambda m: t + t * np.asarray(elements)[m].sum() / 4000
    recorded = _simulate(ctrl, 3000, t, cost)
    assert recorded
    assert ctrl.spent <= TARGET * 0.05 * 3000 * t + 1e-9  # a tenth of the budget kept back
    assert ctrl.spent >= 0.03 * 3000 * t, "the budget is used, not left idle"
    # Every group measured, within the period the controller predicts.
    assert ctrl.first_full_cover is not None
    assert ctrl.first_full_cover <= 1.5 * ctrl.coverage_period()
    # Measuring more than one group per record once the fixed cost is known.
    assert ctrl.groups_per_record() > 1


def test_the_flight_recorders_check_is_paid_from_the_budget_first():
    """On CPU the check is a program of its own after every step: the budget pays it
    first and recording gets the rest, so recording and checking together stay within
    the budget; a check that takes the whole budget leaves nothing to record."""
    elements = [1000] * 8
    t, check = 0.1, 0.02 * 0.1  # the check costs 2 % of a step
    cost = lambda m: t + t * np.asarray(elements)[m].sum() / 4000  # noqa: E731
    plain = BudgetController(0.05, elements, fixed_share=1.0)
    _simulate(plain, 3000, t, cost)
    checked = BudgetController(0.05, elements, fixed_share=1.0)
    checked.observe_check(check)
    _simulate(checked, 3000, t, cost)
    assert checked.t_step == pytest.approx(t + check)
    total = checked.spent + 3000 * check
    assert total <= TARGET * 0.05 * 3000 * t + 1e-9
    assert checked.spent < plain.spent and checked.spent >= 0.02 * 3000 * t
    assert checked.coverage_period() > plain.coverage_period()
    starved = BudgetController(0.05, elements, fixed_share=1.0)
    starved.observe_check(0.05 * t)
    assert _simulate(starved, 3000, t, cost) == [] and starved.starved
    assert starved.coverage_period() == math.inf


def test_hot_groups_are_measured_more_often():
    elements = [1000] * 8
    ctrl = BudgetController(0.05, elements, fixed_share=0.1)
    ctrl.observe_findings({5})
    counts = np.zeros(8, int)

    def cost(mask):
        counts[mask] += 1
        return 0.01 + 0.02 * mask.sum()  # measuring dominates: one group per record

    _simulate(ctrl, 4000, 0.1, cost)
    assert ctrl.groups_per_record() == 1
    others = np.delete(counts, 5)
    assert counts[5] > 4 * others.max()
    assert others.min() > 0, "cold groups still come round"


def test_no_recorded_step_is_planned_past_the_ceiling():
    """Measuring every group at once would cost 3 plain steps on top of the fixed one:
    once the costs are learned, each recorded step measures only what fits under
    `MAX_STEP_OVERHEAD`, records come more often, and every group still comes round."""
    elements = [1000] * 16
    t = 0.1
    ctrl = BudgetController(0.05, elements, fixed_share=1.0)
    costs = []

    def cost(mask):
        costs.append(t + 3 * t * mask.sum() / 16)
        return costs[-1]

    recorded = _simulate(ctrl, 6000, t, cost)
    assert len(recorded) > 10
    learned = costs[3:]  # the first records teach the controller the two costs
    assert max(learned) <= MAX_STEP_OVERHEAD * t * 1.001, max(learned)
    assert ctrl.groups_per_record() > 1, "still several groups per record"
    assert ctrl.first_full_cover is not None
    assert ctrl.spent <= TARGET * 0.05 * 6000 * t + 1e-9


def test_hot_groups_take_turns_when_they_do_not_fit_one_step():
    elements = [1000] * 8
    t = 0.1
    ctrl = BudgetController(0.05, elements, fixed_share=1.0)
    ctrl.observe_findings(set(range(8)))  # every group hot
    counts = np.zeros(8, int)
    sizes = []

    def cost(mask):
        counts[mask] += 1
        sizes.append(int(mask.sum()))
        return t + 2 * t * mask.sum() / 8  # all eight: 2 plain steps of measuring

    _simulate(ctrl, 4000, t, cost)
    room = ctrl.groups_per_step()
    assert room < 8 and max(sizes[3:]) <= room
    assert counts.min() > 0.5 * counts.max(), counts  # each hot group in turn


def test_one_group_a_step_alternates_hot_and_cold_groups():
    """A group costs most of what one step may spend: each recorded step measures one
    group, a hot one and a cold one in turn, never two."""
    elements = [1000] * 8
    t = 0.1
    ctrl = BudgetController(0.05, elements, fixed_share=1.0)
    ctrl.observe_findings({1, 4, 6})
    counts = np.zeros(8, int)
    sizes = []

    def cost(mask):
        counts[mask] += 1
        sizes.append(int(mask.sum()))
        return t + 0.4 * t * mask.sum()  # fixed one step, 0.4 a group: one fits in 1.5

    _simulate(ctrl, 20000, t, cost)
    assert ctrl.groups_per_step() == 1
    assert set(sizes[3:]) == {1}
    hot, cold = counts[[1, 4, 6]], np.delete(counts, [1, 4, 6])
    assert cold.min() > 0, "cold groups still come round"
    assert hot.min() > 2 * cold.max(), counts
    assert math.isfinite(ctrl.coverage_period())


def test_controller_rejects_bad_budgets():
    for bad in (0, 1, -0.1, 1.5, "5%"):
        with pytest.raises(ValueError, match="budget"):
            BudgetController(bad, [1])
    with pytest.raises(ValueError, match="budget"):
        ss.Run("/nonexistent/never-created", budget=2.0)


def test_hot_groups_from_findings():
    n = 6
    stats = {
        "rms": np.array([1.0, 1.0, 100.0, 1.0, 1.0, 1.0]),
        "frac_nonfinite": np.array([0, 0.5, 0, 0, 0, 0.0]),
        "overflow_e4m3": np.array([0, 0, 0, 0.01, 0, 0.0]),
        "underflow_e5m2": np.array([0, 0, 0, 0, 0.5, 0.0]),
    }
    row_group = np.arange(n)
    measured = np.ones(n, bool)
    measured[4] = False  # an unmeasured row never counts
    prev = np.full(n, np.nan)
    cast = ["", "", "", "e4m3", "e5m2", ""]
    scaled = np.array([True, True, True, False, False, True])
    assert hot_groups(stats, row_group, measured, cast, scaled, prev) == {1, 2, 3}
    # A growing trend: rms up by 2x (1 in log2) since the last measurement.
    stats["rms"] = np.array([2.0, 1.0, 100.0, 1.0, 1.0, 1.0])
    stats["frac_nonfinite"] = np.zeros(n)
    assert 0 in hot_groups(stats, row_group, measured, cast, scaled, prev)


MAX_STEPS = 20_000


def test_budgeted_run_writes_only_measured_rows(tmp_path):
    path = tmp_path / "run"
    w = W
    # A generous budget: the plan follows measured times, and on a loaded machine a
    # recorded step costs thousands of (microsecond) plain steps, each paid back by a gap
    # of (1 - budget) / budget times its cost (at 0.3, 2.3x: 440 s of a loaded CI worker
    # to cover every group; at 0.9, 0.11x). Run until every group is covered (bounded),
    # then check what was written.
    with ss.Run(path, budget=0.9, groups=4) as run:
        step = run.track(_step, scalify=False)
        step.warmup(w, X)
        for i in range(MAX_STEPS):
            w, _ = step(w, X)
            # until every group is measured and the check timed (a plain step times it
            # every 32 steps, after the call that compiled it: where the plan records at
            # most of those, it can take a few hundred steps)
            ctrl = step.controller
            if i >= 150 and ctrl.first_full_cover is not None and ctrl.t_check > 0:
                break
        ctrl = step.controller
    assert ctrl.first_full_cover is not None, f"every group measured within {MAX_STEPS} steps"
    # the flight recorder's check (a program of its own on CPU) is timed apart: the
    # budget pays it first
    assert not step.in_step and ctrl.t_check > 0 and ctrl.t_step > ctrl.t_check
    reader = ss.open_run(path)
    assert reader.budget == 0.9 and reader.statistics == "exact"
    stats = reader.stats(wide=True)
    groups = reader.ops["group"]
    rows_per_step = stats.groupby("step").op.nunique()
    recorded_ops = (groups >= 0).sum()
    assert (rows_per_step < recorded_ops).any(), "some steps measured a subset"
    # Each step's rows are whole groups.
    for _, frame in stats.groupby("step"):
        measured_groups = set(groups.loc[frame.op.unique()])
        whole = set(groups[groups.isin(measured_groups)].index)
        assert set(frame.op.unique()) == whole
    last = reader.last_measured()
    assert last.loc[groups[groups >= 0].index].notna().all()
    assert reader.verdict().coverage == ""  # every op measured: no caveat
    # an op not measured at a step: said so, with when it was (some step measured a
    # subset, asserted above)
    assert reader.hist_columns
    step0 = int(rows_per_step.idxmin())
    absent = sorted(set(groups[groups >= 0].index) - set(stats[stats.step == step0].op))
    with pytest.raises(KeyError, match=r"not measured at step .*budget.*last measured"):
        reader.hist(int(absent[0]), step=step0)
    # The rows are exact: equal to an instrumented call on the same inputs.
    w0 = W
    inst = ss.instrument(_step, scalify=False)
    first = int(stats.step.min())
    for _ in range(first):
        w0, _ = _step(w0, X)
    _, exact = jax.jit(inst)(w0, X)
    table = inst.op_table(w0, X)
    got = stats[stats.step == first].set_index("op")["rms"]
    want = np.asarray(exact["rms"])
    for op, value in got.items():
        np.testing.assert_allclose(value, want[table.rows(op)][0], rtol=1e-5)


def test_train_cli_budget(tmp_path, capsys):
    from scalescope.cli import main

    with pytest.raises(SystemExit):
        main(["train", "gpt", "--budget", "5", "--run", str(tmp_path / "x")])
    assert "--budget must be a fraction" in capsys.readouterr().err
    run = tmp_path / "gpt"
    # fp32: the CLI's budget is what is tested here; a budgeted FP8 GPT under scalify runs
    # in the bench_run and GPU suite smoke tests (its two programs compile ~20x longer)
    # 160 steps of a step large enough that the flight recorder's check (a program of
    # its own after each step on CPU, paid from the budget first) is a small share of it:
    # at d=16, seq 8, batch 2 it recorded 12 steps on a quiet machine, 1 to 4 under load
    # (three busy loops on two cores: 3); at d=64, seq 32, batch 8, 21 and 12, in the
    # same time (13.6 s)
    argv = ["train", "gpt", "--precision", "fp32", "--steps", "160", "--budget", "0.5"]
    argv += ["--layers", "1", "--d-model", "64", "--seq-len", "32", "--batch", "8"]
    argv += ["--data", "vendored", "--every", "1", "--run", str(run), "--quiet"]
    assert main(argv) == 0
    reader = ss.open_run(run)
    assert reader.budget == 0.5 and reader.config["budget"] == 0.5
    assert len(reader.steps) >= 1, "a generous budget records"
    last = reader.last_measured()
    assert last.notna().any()


def _held_compile(monkeypatch) -> tuple[threading.Event, list[float], list[int]]:
    """Hold `Tracked`'s background compile until the returned event is set; the first
    list gets the time each compile finished, the second the number of arrays handed to
    each run of a compiled program in the thread."""
    from scalescope.store import writer

    release, done = threading.Event(), []
    real = writer.Tracked._compile_async
    runs: list[int] = []  # arrays handed to each run of the compiled program in the thread

    class Held:
        def __init__(self, traced):
            self.traced = traced

        def lower(self):
            return self

        def compile(self):
            release.wait(timeout=60)  # a failed test must not hang in close()
            out = self.traced.lower().compile()
            done.append(time.perf_counter())

            def counted(*args):
                runs.append(len(jax.tree.leaves(args)))
                return out(*args)

            return counted

    monkeypatch.setattr(
        writer.Tracked, "_compile_async", lambda self, t, *rest: real(self, Held(t), *rest)
    )
    return release, done, runs


def test_budget_steps_run_plain_while_the_statistics_program_compiles(tmp_path, monkeypatch):
    """Under a budget no step waits for the statistics program: it compiles in a thread,
    steps run plain (and give the plain outputs) meanwhile, and recording starts once it
    is ready."""
    release, done, runs = _held_compile(monkeypatch)
    plain = jax.jit(_step)
    with ss.Run(tmp_path / "run", budget=0.5, groups=2) as run:
        step = run.track(_step, scalify=False)
        w = W
        for _ in range(5):  # a step that waited for the held compile would never return
            w_next, _ = step(w, X)
            np.testing.assert_array_equal(np.asarray(w_next), np.asarray(plain(w, X)[0]))
            w = w_next
        assert not done and step._compile_thread.is_alive()
        # steps that share the machine with the compile are not timed into the plans
        assert step.controller.t_plain is None
        run.flush()
        assert len(ss.open_run(tmp_path / "run").steps) == 0, "nothing recorded before ready"
        release.set()
        step._compile_thread.join()
        assert done
        # on CPU the program ran once in the thread, on the first call's arrays (XLA
        # finishes preparing a program at its first run: not in a recorded step)
        assert runs == [3]  # the mask, w and x
        for _ in range(MAX_STEPS):
            w, _ = step(w, X)
            if step.controller.slot:  # a recorded step
                break
        assert step.controller.slot, "recording starts once the program is compiled"
    assert len(ss.open_run(tmp_path / "run").steps) >= 1


def test_closing_while_compiling_warns_and_waits(tmp_path, monkeypatch, caplog):
    release, done, _ = _held_compile(monkeypatch)
    run = ss.Run(tmp_path / "run", budget=0.05)
    step = run.track(_step, scalify=False)
    step(W, X)

    def release_once_told(record: logging.LogRecord) -> bool:
        # the compile is held until close has said so (not a timer: a race)
        if "still compiling" in record.getMessage():
            release.set()
        return True

    logger = logging.getLogger("scalescope")
    logger.addFilter(release_once_told)
    fallback = threading.Timer(60, release.set)  # a failure, not a hang
    fallback.start()
    try:
        with caplog.at_level("WARNING", logger="scalescope"):
            run.close()
    finally:
        logger.removeFilter(release_once_told)
        fallback.cancel()
    assert "still compiling" in caplog.text and "warmup" in caplog.text
    assert done and not step._compile_thread.is_alive(), "no compile outlives the run"
    assert ss.open_run(tmp_path / "run").status == "closed"


def test_warmup_waits_for_the_background_compile(tmp_path, monkeypatch):
    release, done, _ = _held_compile(monkeypatch)
    threading.Timer(0.3, release.set).start()
    with ss.Run(tmp_path / "run", budget=0.5) as run:
        step = run.track(_step, scalify=False)
        step.warmup(W, X)
        assert done, "warmup returned before the statistics program compiled"


def test_a_check_that_takes_the_whole_budget_is_said_once(tmp_path):
    """Where checking each step costs the whole budget, nothing can record: the run
    says so once, naming the share and the ways out."""
    with ss.Run(tmp_path / "run", budget=0.01, groups=2) as run:
        step = run.track(_step, scalify=False)
        step(W, X)  # registers the run's graph (the controller)
        ctrl = step.controller
        ctrl.observe_plain(0.1)
        ctrl.observe_check(0.005)  # 5 % of a step
        with pytest.warns(UserWarning, match=r"takes 5\.0% of a step.*detect=False"):
            step._warn_if_starved()
        step._warn_if_starved()  # once
