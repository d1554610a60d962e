"""The flight recorder (issue 38): every tracked step is checked, recorded or not; a step
that goes non-finite or spikes is replayed fully instrumented and kept as an incident
naming the first bad op and its source line; ``on_nonfinite`` records, stops or skips.

The model: a small layer whose output feeds a value ``0.1 · 2^-t`` cast to E4M3 (FP8)
and then a ``log``. E4M3's smallest subnormal is 2^-9; from t = 7 on (0.1 · 2^-7 <
2^-10) the cast flushes it to zero and the log is -inf: the NaN/Inf starts at that op,
at that step, and spreads to the loss and the update.
"""

from __future__ import annotations

import gc
import inspect
import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from conftest import xla_flags_with

import scalescope as ss

E4M3 = ml_dtypes.float8_e4m3fn
BAD_STEP = 7
SPIKE_STEP = 40


def step(w, x, t):
    def loss_fn(w):
        with jax.named_scope("layer"):
            h = jnp.tanh(x @ w)
        with jax.named_scope("tail"):
            small = (0.1 * 2.0 ** (-t.astype(jnp.float32))).astype(E4M3).astype(jnp.float32)
            tail = jnp.log(small)
        return jnp.mean(h**2) + 1e-3 * tail

    loss, g = jax.value_and_grad(loss_fn)(w)
    with jax.named_scope("opt"):
        w = w - 0.1 * g
    return w, loss


LOG_LINE = inspect.getsourcelines(step)[1] + 6  # the line of jnp.log(small)


def spiky(w, x, t):
    """A healthy step whose loss jumps 100x at SPIKE_STEP only (a bad batch)."""

    def loss_fn(w):
        with jax.named_scope("layer"):
            h = jnp.tanh(x @ w)
        with jax.named_scope("spike"):
            h = h * jnp.where(t == SPIKE_STEP, 100.0, 1.0)
        return jnp.mean(h**2)

    loss, g = jax.value_and_grad(loss_fn)(w)
    return w - 1e-3 * g, loss


SPIKE_LINE = inspect.getsourcelines(spiky)[1] + 7  # the line of the where()


def _inputs():
    w = jnp.asarray(np.random.default_rng(0).normal(0, 0.3, (16, 16)), jnp.float32)
    x = jnp.asarray(np.random.default_rng(1).normal(0, 1, (8, 16)), jnp.float32)
    return w, x


def _train(run, fn, steps, **track):
    tracked = run.track(fn, scalify=False, **track)
    w, x = _inputs()
    trail = []
    for i in range(steps):
        w, loss = tracked(w, x, jnp.int32(i))
        trail.append((w, loss))
    return trail


def test_the_incident_names_the_op_and_step_where_nan_starts(tmp_path, caplog):
    seen = []
    run = ss.Run(tmp_path / "r", every=1000, on_incident=seen.append)
    with caplog.at_level(logging.WARNING, logger="scalescope"):
        trail = _train(run, step, 10)
    run.close()
    assert not run.healthy and len(seen) == 1  # the NaN spreads: one incident, not three
    (said,) = [r.getMessage() for r in caplog.records if "incident at step" in r.getMessage()]
    where = f"incident at step {BAD_STEP} (nonfinite): fwd/tail/log at {__file__}:{LOG_LINE}; "
    assert said.startswith(f"scalescope: {where}") and "all of its elements" in said
    reader = ss.open_run(tmp_path / "r")
    (row,) = reader.incidents().to_dict("records")
    assert row["step"] == BAD_STEP and row["trigger"] == "nonfinite"
    assert row["name"] == "fwd/tail/log" and row["source"] == f"{__file__}:{LOG_LINE}"
    assert "all of its elements" in row["detail"]
    # log(0) of a finite zero: made at that op (float32: no format's range to quote)
    assert "its inputs are finite: the NaN/Inf is made here;" in row["detail"], row["detail"]
    assert "largest finite" not in row["detail"]
    # its input is the flushed value: finite, zero
    (inp,) = [i for i in row["inputs"] if "convert_element_type" in i["name"]]
    assert inp["absmax"] == 0.0 and inp["frac_nonfinite"] == 0.0
    # and says where the zeros come from: a cast to FP8 flushed them
    assert (
        "holds exact zeros (100 % of it), made by its cast to float8_e4m3fn, which flushes "
        "small values to zero: log is infinite there" in row["detail"]
    ), row["detail"]
    # the replayed step is recorded in full beside the steps `every` recorded
    assert list(reader.steps) == [0, BAD_STEP]
    log_op = int(row["op"])
    nan = reader.stats("frac_nonfinite", ops=[log_op], steps=BAD_STEP)["value"]
    assert float(nan.iloc[0]) == 1.0
    # steps before it were healthy, and the run went on recording its losses
    assert all(np.isfinite(float(loss)) for _, loss in trail[:BAD_STEP])
    assert not np.isfinite(float(trail[BAD_STEP][1]))


def test_an_fp16_overflow_is_said_to_be_made_at_its_op_and_an_input_nan_is_not(tmp_path):
    """A float16 product of finite inputs that overflows: the incident says the op made
    the Inf and quotes float16's largest finite value; a NaN that comes in with the
    batch is named at the input, with no such claim."""

    def fp16_step(w, x):
        with jax.named_scope("layer"):
            h = (x.astype(jnp.float16) * w.astype(jnp.float16)).astype(jnp.float32)
        return w - 1e-3 * jnp.sum(h), jnp.sum(h)

    run = ss.Run(tmp_path / "r", every=1000)
    tracked = run.track(fp16_step, scalify=False)
    w = jnp.full((4,), 300.0, jnp.float32)
    tracked(w, jnp.full((4,), 100.0, jnp.float32))  # 3e4: finite in float16
    tracked(w, jnp.full((4,), 300.0, jnp.float32))  # 9e4: past 65504, inf
    tracked(w, jnp.full((4,), np.nan, jnp.float32).at[0].set(1.0))
    run.close()
    rows = ss.open_run(tmp_path / "r").incidents().to_dict("records")
    assert [r["step"] for r in rows] == [1], rows  # the NaN stretch goes on: one incident
    (row,) = rows
    assert row["name"].endswith("layer/mul"), row["name"]
    assert row["detail"].startswith("5 non-finite element(s) in the step's outputs; ")
    assert "first op with a NaN/Inf output: all of its elements" in row["detail"]
    assert (
        "its inputs are finite: the NaN/Inf is made here (float16 output: largest finite 65504)"
        in row["detail"]
    )

    run = ss.Run(tmp_path / "s", every=1000)
    tracked = run.track(fp16_step, scalify=False)
    tracked(w, jnp.full((4,), np.nan, jnp.float32))
    run.close()
    (row,) = ss.open_run(tmp_path / "s").incidents().to_dict("records")
    assert row["name"] == "input/x", row["name"]
    assert "made here" not in row["detail"], row["detail"]


def test_no_made_here_claim_without_every_input_measured(tmp_path):
    """The claim needs every float input measured exactly: not under ``sample=`` (an
    input's NaN can be outside the sample), not for an op reading a value that has no
    record of its own (a loop's output)."""

    def fp16_step(w, x):
        with jax.named_scope("layer"):
            h = (x.astype(jnp.float16) * w.astype(jnp.float16)).astype(jnp.float32)
        return w - 1e-3 * jnp.sum(h), jnp.sum(h)

    run = ss.Run(tmp_path / "r", every=1000, sample=64)
    tracked = run.track(fp16_step, scalify=False)
    tracked(jnp.full((4,), 300.0), jnp.full((4,), 300.0))
    run.close()
    (row,) = ss.open_run(tmp_path / "r").incidents().to_dict("records")
    assert row["name"] == "fwd/layer/mul" and "made here" not in row["detail"], row

    def looped(x):
        y = jax.lax.fori_loop(0, 2, lambda i, v: v * 2.0, x)
        return jnp.sin(y) + jnp.cos(x)

    table = ss.instrument(looped, scalify=False).op_table(jnp.ones(3))
    by = {rec.name: rec for rec in table.ops}
    assert not by["sin"].inputs_complete  # reads the loop's output, which has no record
    assert by["cos"].inputs_complete and by["add"].inputs_complete


@pytest.mark.parametrize(
    ("tail", "said"),
    [(lambda z: 1.0 / z, "the division"), (lambda z: z**-2, "the negative power")],
    ids=["reciprocal", "negative-power"],
)
def test_a_pole_at_zero_hit_by_a_flushed_value_names_the_cast(tmp_path, tail, said):
    """``1 / x`` (a literal numerator: the divisor is the op's only recorded input) and
    ``x ** -2`` of a value an E4M3 cast flushed to zero: the incident says the zeros made
    the Inf and which cast made the zeros."""

    def pole_step(w, x):
        with jax.named_scope("tail"):
            z = (1e-4 * x).astype(E4M3).astype(jnp.float32)  # below 2^-9: flushed
            y = tail(z)
        return w - 1e-3 * jnp.sum(y), jnp.sum(y)

    run = ss.Run(tmp_path / "r", every=1000)
    run.track(pole_step, scalify=False)(jnp.ones((4,)), jnp.ones((4,)))
    run.close()
    (row,) = ss.open_run(tmp_path / "r").incidents().to_dict("records")
    assert row["name"].startswith("fwd/tail/") and "made here" in row["detail"], row
    assert (
        "holds exact zeros (100 % of it), made by its cast to float8_e4m3fn, which flushes "
        f"small values to zero: {said} is infinite there" in row["detail"]
    ), row["detail"]


def test_which_input_of_an_op_is_its_pole_at_zero():
    """`pole_at_zero`: the divisor, not the numerator; a negative power, not a positive
    one; a literal exponent of ``pow`` only when it is negative."""
    from scalescope.probe.recorder import pole_at_zero

    def poles(fn, *args):
        return [pole_at_zero(e) for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns]

    x = jnp.ones(3)
    assert poles(lambda a, b: a / b, x, x) == [1]
    assert poles(lambda a: a**-3, x) == [0] and poles(lambda a: a**3, x) == [None]
    assert poles(lambda a: jax.lax.pow(a, -0.5), x) == [0]
    assert poles(lambda a: jax.lax.pow(a, 0.5), x) == [None]
    assert poles(lambda a, b: jax.lax.pow(a, b), x, x) == [None]  # exponent not known
    assert poles(jnp.log, x) == [0] and poles(jnp.exp, x) == [None]


def test_an_incident_without_an_op_says_why_without_a_placeholder(tmp_path, caplog):
    """The log line of an incident that names no op (the NaN is in an output the probe
    does not record) gives the reason, not "no op at ?"."""
    run = ss.Run(tmp_path / "r")
    why = "no recorded op holds a NaN/Inf"
    with caplog.at_level(logging.WARNING, logger="scalescope"):
        run._incident({"step": 3, "trigger": "nonfinite", "name": "", "source": "", "detail": why})
    run.close()
    (said,) = [r.getMessage() for r in caplog.records if "incident at step" in r.getMessage()]
    assert said == f"scalescope: incident at step 3 (nonfinite): {why}"


@pytest.mark.parametrize("in_step", [False, True], ids=["check_after_step", "check_in_step"])
def test_a_step_is_judged_by_the_next_call_or_when_asked(tmp_path, monkeypatch, in_step):
    """With on_nonfinite="record" a step's health is read once it has run (a thread),
    and its incident is taken in at the next call; `healthy` (what checkpoint code
    asks) takes it in at once, so a bad last step is never missed. The check runs in a
    program of its own after the step (CPU's default) or inside the step (GPU's)."""
    from scalescope.store import flight

    assert not flight.check_in_step()  # CPU: after the step
    monkeypatch.setattr(flight, "IN_STEP", in_step)
    seen = []
    run = ss.Run(tmp_path / "r", every=1000, on_incident=seen.append)
    tracked = run.track(step, scalify=False)
    assert tracked.in_step is in_step
    w, x = _inputs()
    for i in range(BAD_STEP + 1):  # the bad step is the last call
        w, _ = tracked(w, x, jnp.int32(i))
    assert seen == []  # not yet taken in: no call came after it
    assert not run.healthy and [s["step"] for s in seen] == [BAD_STEP]
    w, _ = tracked(w, x, jnp.int32(BAD_STEP + 1))
    run.close()
    assert [s["step"] for s in run.incidents] == [BAD_STEP]  # NaN spreads: one incident


def masked_step(w, x, t):
    """`step` behind a causal attention whose mask is -inf: NaN/Inf by construction at
    every step, never an incident's start."""

    def loss_fn(w):
        with jax.named_scope("attn"):
            q = x @ w
            s = q @ q.T
            causal = jnp.tril(jnp.ones(s.shape, bool))
            s = jnp.where(causal, s, -jnp.inf)
            h = jax.nn.softmax(s, axis=-1) @ q
        with jax.named_scope("tail"):
            small = (0.1 * 2.0 ** (-t.astype(jnp.float32))).astype(E4M3).astype(jnp.float32)
            tail = jnp.log(small)
        return jnp.mean(h**2) + 1e-3 * tail

    loss, g = jax.value_and_grad(loss_fn)(w)
    return w - 0.01 * g, loss


def test_a_mask_that_is_inf_by_construction_is_not_the_incidents_op(tmp_path):
    run = ss.Run(tmp_path / "r", every=1000)
    _train(run, masked_step, BAD_STEP + 1)
    run.close()
    (incident,) = run.incidents
    assert incident["step"] == BAD_STEP and incident["name"] == "fwd/tail/log", incident
    masked = ss.open_run(tmp_path / "r").stats("frac_nonfinite", ops=r"^fwd/attn/", steps=0)
    assert (masked["value"] > 0).any()  # the mask's -inf is there at every step


def _rsqrt_schedule(count):
    """Flax lm1b's warm-up-then-rsqrt schedule: ``0 ** -0.5`` (inf) where the count is
    the boundary's distance, which `optax.join_schedules` evaluates and drops."""
    return 1e-3 * (count + 2) ** -0.5 * 2**0.5


_JOINED = optax.join_schedules([optax.linear_schedule(0.0, 1e-3, 2), _rsqrt_schedule], [2])


def _fp8_overflow_step(params, opt_state, step, x):
    lr = _JOINED(step)  # computed before the forward pass, as lm1b's train_step does
    tx = optax.adamw(_JOINED)

    def loss_fn(p):
        h = ss.ops.cast_on_forward(x * 1000.0, jnp.float8_e4m3fn)  # overflows e4m3
        return jnp.mean((h @ p["w"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, lr


def test_a_nan_nothing_downstream_keeps_is_not_blamed_for_the_one_that_spreads(tmp_path):
    """A schedule's unused rsqrt branch is inf at step 0 and computed before the forward
    pass; an FP8 overflow then makes the loss NaN. The incident and the verdict name
    the overflowing cast, not the schedule's inf that `join_schedules` drops (found on
    Flax's lm1b train_step: its verdict led with "NaN/inf in 6 opt ops" at the
    schedule's line and ranked the overflow third)."""
    params = {"w": jax.random.normal(jax.random.key(0), (16, 4)) / 4}
    opt_state = optax.adamw(_JOINED).init(params)
    x = jax.random.normal(jax.random.key(1), (8, 16))
    cast_line = f"{__file__}:{inspect.getsourcelines(_fp8_overflow_step)[1] + 5}"
    with ss.Run(tmp_path / "r") as run:
        step = run.track(_fp8_overflow_step, scalify=False)
        for i in range(2):
            params, opt_state, loss, lr = step(params, opt_state, jnp.int32(i), x)
            run.log(i, loss=loss)
            assert np.isnan(float(loss)) and np.isfinite(float(lr))
    reader = ss.open_run(tmp_path / "r")
    first = reader.incidents().iloc[0]
    assert (first["step"], first["name"], first["source"]) == (
        0,
        "fwd/convert_element_type",
        cast_line,
    )
    v = reader.verdict()
    assert v.status == "failing", v
    causes = [r.cause for r in v.reasons]
    assert "e4m3 overflow" in causes[1] and "fix that first" in v.reasons[0].fix, str(v)
    assert not any(" opt op" in c for c in causes), str(v)
    assert "e4m3 overflow" in v.reasons[0].fix
    # the schedule's inf is there, and held by design
    sched = reader.stats("frac_nonfinite", ops=r"^opt/pow", steps=0)
    assert (sched["value"] > 0).any()


def test_the_replayed_step_equals_the_one_that_triggered(tmp_path):
    run = ss.Run(tmp_path / "r", every=1000)
    trail = _train(run, step, BAD_STEP + 1)
    run.close()
    (incident,) = run.incidents
    assert incident["replayed"] and incident["replay_equal"]
    # and both equal the plain step, run independently on the same inputs
    w, x = _inputs()
    for i in range(BAD_STEP + 1):
        w, loss = jax.jit(step)(w, x, jnp.int32(i))
    got_w, got_loss = trail[BAD_STEP]
    np.testing.assert_array_equal(np.asarray(got_w), np.asarray(w))
    np.testing.assert_array_equal(np.asarray(got_loss), np.asarray(loss))


def test_a_loss_spike_is_caught_at_its_step_and_op(tmp_path):
    run = ss.Run(tmp_path / "r", every=1000)
    _train(run, spiky, SPIKE_STEP + 5)
    run.close()
    (incident,) = run.incidents  # the steps before and after are quiet
    assert incident["step"] == SPIKE_STEP and incident["trigger"] == "loss_spike"
    # the jump starts at the where() that multiplies by 100 (downstream ops jump more)
    assert incident["name"] == "fwd/spike/select_n", incident["name"]
    assert incident["source"] == f"{__file__}:{SPIKE_LINE}"
    assert "jumped" in incident["detail"] and "x100 " in incident["detail"]


def test_steps_that_update_nothing_are_no_norm_samples(tmp_path):
    """Gradient accumulation (`optax.MultiSteps`, 4 micro-steps per update) changes the
    parameters on 1 step in 4: no incident over a healthy run (every update was a
    "norm spike" against a median of 0, and replayed), and an update 100 times the usual
    one is still caught."""
    tx = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=4)

    def step(p, s, x, boost):
        loss, g = jax.value_and_grad(lambda p: jnp.mean((x @ p - x.sum(1, keepdims=True)) ** 2))(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, jax.tree.map(lambda v: v * boost, u)), s, loss

    p = jnp.zeros((8, 1))
    s = tx.init(p)
    run = ss.Run(tmp_path / "r", every=1000, triggers=ss.Triggers(warmup=8))
    tracked = run.track(step, scalify=False)
    for i in range(48):  # 12 updates: judged from the 9th on
        x = jax.random.normal(jax.random.key(i), (32, 8))
        p, s, _ = tracked(p, s, x, jnp.float32(100.0 if i == 43 else 1.0))
    run.close()
    (incident,) = run.incidents
    assert incident["step"] == 43 and incident["trigger"] == "norm_spike", incident


def _scanned(reverse: bool):
    """A step whose scan body is ``log(tanh(h @ w))``: the log of a negative tanh is NaN
    in the first iteration that runs (the last one for a reversed scan), and every later
    iteration's matmul reads that NaN from the carry."""

    def step(ws, x):
        def body(h, w):
            h = jnp.tanh(h @ w)
            return jnp.log(h), None

        h, _ = jax.lax.scan(body, x, ws, reverse=reverse)
        return ws, jnp.mean(h**2)

    return step


@pytest.mark.parametrize("reverse", [False, True])
def test_inside_a_scan_the_incident_names_the_op_and_iteration_that_ran_first(tmp_path, reverse):
    """The first row computed, not the lowest op id: the body's matmul comes first in
    program order but only reads the NaN one iteration after the log made it."""
    ws = jax.random.normal(jax.random.key(0), (3, 8, 8)) * 0.3
    x = jax.random.normal(jax.random.key(1), (4, 8))
    first = 2 if reverse else 0  # the iteration that runs first
    h = np.tanh(np.asarray(x, np.float64) @ np.asarray(ws[first], np.float64))
    assert (h < 0).any() and (h > 0).any()  # the reference: NaN made there, from finite
    with ss.Run(tmp_path / "r", every=1000) as run:
        run.track(_scanned(reverse))(ws, x)
    (row,) = ss.open_run(tmp_path / "r").incidents().to_dict("records")
    assert row["name"] == "fwd/log", row
    assert f"in iteration {first} of 3: {100 * (h < 0).mean():.1f} %" in row["detail"], row
    assert "its inputs are finite: the NaN/Inf is made here" in row["detail"]


def test_a_typed_key_among_the_outputs_does_not_break_a_replay(tmp_path):
    """A step returning a new PRNG key (``jax.random.key``) that goes NaN on a step that
    is not recorded: the replay compares the outputs, keys by their key data."""

    def keyed(w, scale, key):
        return w - 0.1 * scale * jax.random.normal(key, w.shape), jax.random.split(key)[0]

    w, key = jnp.ones(4), jax.random.key(0)
    with ss.Run(tmp_path / "r", every=1000) as run:
        tracked = run.track(keyed)
        for scale in (1.0, 1.0, float("nan")):
            w, key = tracked(w, jnp.float32(scale), key)
    assert not run.healthy
    (row,) = ss.open_run(tmp_path / "r").incidents().to_dict("records")
    assert row["step"] == 2 and row["trigger"] == "nonfinite"


def test_skip_returns_the_state_of_the_last_healthy_step(tmp_path):
    run = ss.Run(tmp_path / "r", every=1000, on_nonfinite="skip")
    trail = _train(run, step, BAD_STEP + 3)
    run.close()
    before, before_loss = trail[BAD_STEP - 1]
    for w, loss in trail[BAD_STEP:]:  # every later step is non-finite: each one skipped
        assert w is before and loss is before_loss
    assert np.isfinite(np.asarray(before)).all()
    assert len(run.incidents) == 1


def test_stop_raises_naming_the_op_and_the_step(tmp_path):
    run = ss.Run(tmp_path / "r", every=1000, on_nonfinite="stop")
    with pytest.raises(ss.NonFiniteStep, match=rf"step {BAD_STEP} .*fwd/tail/log") as caught:
        _train(run, step, BAD_STEP + 3)
    run.close()
    assert caught.value.incident["name"] == "fwd/tail/log"
    assert ss.open_run(tmp_path / "r").incidents()["step"].tolist() == [BAD_STEP]


def test_detection_off_keeps_the_plain_programs_and_records_nothing(tmp_path):
    run = ss.Run(tmp_path / "r", every=1000, detect=False)
    _train(run, step, BAD_STEP + 2)
    run.close()
    assert run.healthy and run.incidents == []
    assert ss.open_run(tmp_path / "r").incidents().empty


def test_the_recorder_keeps_no_copy_of_the_training_state(tmp_path):
    """What the replay needs (the step's inputs) is what the caller holds during the
    call; once a step has run and is judged healthy the recorder lets its inputs go and
    keeps only the last measured statistics (a few numbers per op). Live device memory
    after a run with detection (and with ``skip``, which keeps the last healthy outputs:
    the caller's own arrays) equals the run without it, up to those statistics."""

    def live(detect: bool, mode: str, name: str) -> int:
        # Only arrays made during this run count: the worker's other tests leave
        # arrays that the garbage collector frees at times of its own (held here, so
        # that no id is reused).
        gc.collect()
        held = jax.live_arrays()
        before = {id(a) for a in held}
        run = ss.Run(tmp_path / name, every=5, detect=detect, on_nonfinite=mode)
        tracked = run.track(spiky, scalify=False)
        w, x = _inputs()
        for i in range(12):
            w, loss = tracked(w, x, jnp.int32(i))
        assert run.healthy  # every step judged (by the watcher thread, as each one ran)
        run.flush()  # the writer's queue holds each step's health (3 floats) until written
        stats_bytes = sum(
            a.nbytes for a in jax.tree_util.tree_leaves(tracked._last_stats or {})
        ) + sum(a.nbytes for a in jax.tree_util.tree_leaves(tracked._prev_stats or {}))
        gc.collect()
        total = sum(a.nbytes for a in jax.live_arrays() if id(a) not in before)
        del held
        run.close()
        del tracked, w, loss
        return total - stats_bytes

    base = live(False, "record", "off")
    assert live(True, "record", "on") <= base + 64
    assert live(True, "skip", "skip") <= base + 64


def test_a_donated_state_is_not_held_twice_and_its_bad_step_is_named_not_replayed(tmp_path):
    """``run.track(step, donate_argnums=0)``: the program overwrites the weights passed in
    (the caller's arrays are deleted, as under ``jax.jit(..., donate_argnums=0)``), so the
    training state is not held twice; outputs are those of the step without donation,
    bit for bit. Nothing is left to replay a bad step from: the incident names its step
    and trigger and says why no op; a bad step that was recorded names its op from its
    own statistics. ``warmup`` leaves the caller's arrays alone."""
    plain = [loss for _, loss in _train(ss.Run(tmp_path / "plain", every=1000), step, 10)]
    for every, replayed_op in ((1000, ""), (BAD_STEP, "fwd/tail/log")):
        run = ss.Run(tmp_path / f"donated{every}", every=every)
        tracked = run.track(step, scalify=False, donate_argnums=0)
        w, x = _inputs()
        tracked.warmup(w, x, jnp.int32(0))
        assert not w.is_deleted()
        program = tracked._plain.trace(w, x, jnp.int32(0)).lower().compile()
        assert program.memory_analysis().alias_size_in_bytes == w.nbytes  # w is reused
        losses = []
        for i in range(10):
            given = w
            w, loss = tracked(given, x, jnp.int32(i))
            assert given.is_deleted() and not x.is_deleted()
            losses.append(loss)
        run.close()
        np.testing.assert_array_equal(np.asarray(losses), np.asarray(plain))
        (row,) = ss.open_run(tmp_path / f"donated{every}").incidents().to_dict("records")
        assert row["step"] == BAD_STEP and row["trigger"] == "nonfinite"
        assert row["name"] == replayed_op and row["replayed"] is False
        if not replayed_op:
            assert row["op"] == -1
            assert "not replayed: the step's inputs were donated" in row["detail"]


def test_a_nan_first_seen_in_a_steps_inputs_is_said_to_come_from_an_earlier_step(tmp_path):
    """Donated, every 4: the bad step (7) is neither recorded nor replayed, and the next
    recorded step (8) receives NaN weights. The verdict must not send the user to
    ``jax_debug_nans`` at an input as if it were made there: it says an earlier step
    made it and how to find it."""
    from scalescope.analysis import verdict_run

    def spreads(w, x, t):  # a NaN gradient at BAD_STEP only: the weights carry it on
        loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
        return w - 0.1 * g * jnp.where(t == BAD_STEP, jnp.nan, 1.0), loss

    run = ss.Run(tmp_path / "r", every=4)
    tracked = run.track(spreads, scalify=False, donate_argnums=0)
    w, x = _inputs()
    for i in range(10):
        w, _ = tracked(w, x, jnp.int32(i))
    run.close()
    v = verdict_run(ss.open_run(tmp_path / "r"))
    reason = next(r for r in v.reasons if r.cause == "NaN/inf in 1 input op")
    assert reason.fix.startswith(
        "find the step that made it: the NaN/inf is already in the step's inputs (input/w "
    ), reason
    assert "jax_debug_nans" not in reason.fix
    later = next(r for r in v.reasons if r.op.startswith("fwd/"))
    assert later.fix == "fix the earliest op with NaN/inf first: input/w [16x16]", later


def test_a_step_jitted_with_donation_is_told_to_donate_under_track(tmp_path):
    """A step already wrapped in ``jax.jit(..., donate_argnums=0)``: its donation does
    nothing inside the tracked program, which is said once with the argument to pass;
    not with ``donate_argnums`` given, nor for a step that donates nothing."""
    donating = jax.jit(step, donate_argnums=0)
    w, x = _inputs()
    with ss.Run(tmp_path / "a", every=1000) as run:
        with pytest.warns(
            UserWarning, match=r"donates its arguments \(0,\) .*donate_argnums=\(0,\)"
        ):
            run.track(donating, scalify=False)(w, x, jnp.int32(0))
    for name, fn, kw in (("b", donating, {"donate_argnums": 0}), ("c", jax.jit(step), {})):
        with ss.Run(tmp_path / name, every=1000) as run, warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            w, _ = _inputs()
            run.track(fn, scalify=False, **kw)(w, x, jnp.int32(0))


def test_donation_is_refused_where_it_cannot_work(tmp_path):
    with pytest.raises(ValueError, match="on_nonfinite='skip'.*donation frees"):
        ss.Run(tmp_path / "a", on_nonfinite="skip").track(step, donate_argnums=(0,))
    run = ss.Run(tmp_path / "b")
    with pytest.raises(ValueError, match="step takes 3 argument.*no argument 3"):
        run.track(step, donate_argnums=(0, 3))
    for bad in ("0", 1.0, True):
        with pytest.raises(TypeError, match="donate_argnums"):
            run.track(step, donate_argnums=bad)
    assert run.track(step, donate_argnums=-3).donate == (0,)  # from the last, as jax.jit
    run.close()


def test_the_steps_own_loss_is_the_runs_loss_when_none_is_logged(tmp_path, nan_run):
    """Every checked step's health is written (`reader.health`): a run that logs no
    ``loss`` gets the step's own loss output under that name (the verdict, report and
    dashboard read it), bit for bit what the step returned; a logged loss is kept as
    logged; a step without a loss output gives none. The NaN run, which logs nothing,
    then reads "failing" from the step its loss turned NaN."""
    run = ss.Run(tmp_path / "own", every=1000)
    trail = _train(run, spiky, 6)
    run.close()
    reader = ss.open_run(tmp_path / "own")
    health = reader.health()
    assert health["step"].tolist() == list(range(6)) and (health["nonfinite"] == 0).all()
    np.testing.assert_array_equal(health["loss"], [np.float32(loss) for _, loss in trail])
    assert not reader.loss_logged
    np.testing.assert_array_equal(reader.scalars["loss"], health["loss"])
    assert (health["norm"] > 0).all()

    with ss.Run(tmp_path / "logged", every=1000) as run:
        tracked = run.track(spiky, scalify=False)
        w, x = _inputs()
        for i in range(3):
            w, loss = tracked(w, x, jnp.int32(i))
            run.log(i, loss=2 * loss)
    reader = ss.open_run(tmp_path / "logged")
    assert reader.loss_logged and len(reader.health()) == 3
    np.testing.assert_allclose(reader.scalars["loss"], 2 * reader.health()["loss"], rtol=1e-6)

    with ss.Run(tmp_path / "none", every=1000) as run:
        tracked = run.track(lambda w, x: jnp.tanh(x @ w), scalify=False)
        for _ in range(2):
            tracked(*_inputs())
    reader = ss.open_run(tmp_path / "none")
    assert reader.health()["loss"].isna().all() and "loss" not in reader.scalars

    from scalescope.analysis import verdict_run

    v = verdict_run(ss.open_run(nan_run))
    assert v.headline == f"verdict: failing from step {BAD_STEP}: the loss turned NaN/inf", v


def test_health_counts_scaled_arrays_by_their_values():
    """A dynamic rescale doubles a scale and halves the data: the value, its update and
    the health are unchanged (the scale is no value of its own: before this, a rescale
    read as an update of norm ~128, a false norm spike)."""
    from scalescope.store.flight import health

    rng = np.random.default_rng(0)
    old = rng.normal(0, 1, (64,)).astype(np.float32)
    new = old + rng.normal(0, 1e-3, (64,)).astype(np.float32)
    loss = jnp.float32(0.5)
    dense = health((jnp.asarray(old),), (jnp.asarray(new), loss))
    before = ss.ScaledArray(jnp.asarray(old / 4), jnp.float32(4))
    after = ss.ScaledArray(jnp.asarray(new / 256), jnp.float32(256))  # rescaled 64x
    scaled = health((before,), (after, loss))
    want = np.sqrt(np.sum((new.astype(np.float64) - old) ** 2))
    assert float(dense["norm"]) == pytest.approx(want, rel=1e-5)
    assert float(scaled["norm"]) == pytest.approx(want, rel=1e-4)
    assert float(scaled["nonfinite"]) == 0 and float(scaled["loss"]) == 0.5


def test_health_counts_every_nan_and_inf_of_every_output_leaf():
    """NaNs and infinities anywhere in the outputs (the new parameters, the optimizer
    state, a scaled leaf) are counted; the norm is the update's over its finite
    elements (NumPy reference)."""
    from scalescope.store.flight import health

    rng = np.random.default_rng(1)
    old = rng.normal(0, 1, (8, 16)).astype(np.float32)
    new = old + rng.normal(0, 1e-2, (8, 16)).astype(np.float32)
    new[2, 3], new[5, 1] = np.nan, np.inf
    mu = rng.normal(0, 1, (300,)).astype(np.float32)
    mu[[0, 7, 299]] = [np.inf, -np.inf, np.nan]
    nu = np.abs(rng.normal(0, 1, (4, 5, 6))).astype(np.float16)
    nu[1, 2, 3] = np.inf
    scaled = ss.ScaledArray(jnp.asarray(nu), jnp.float32(2.0**-3))
    state = {"mu": jnp.asarray(mu), "nu": scaled, "count": jnp.int32(3)}
    out = jax.jit(health)((jnp.asarray(old), state), (jnp.asarray(new), state, jnp.float32(1.5)))
    assert float(out["nonfinite"]) == 2 + 3 + 1
    d = new.astype(np.float64) - old
    want = np.sqrt(np.sum(d[np.isfinite(d)] ** 2))
    assert float(out["norm"]) == pytest.approx(want, rel=1e-5)
    assert float(out["loss"]) == 1.5
    # without an update (first output not the first argument's layout): the norm of the
    # non-scalar outputs' finite elements
    out = jax.jit(health)((jnp.float32(0),), (jnp.asarray(mu), jnp.float32(2.0)))
    assert float(out["nonfinite"]) == 3
    m = mu.astype(np.float64)
    assert float(out["norm"]) == pytest.approx(np.sqrt(np.sum(m[np.isfinite(m)] ** 2)), rel=1e-5)
    # a complex leaf counts by its modulus
    z = np.array([1 + 1j, np.nan + 0j, 2 - 1j], np.complex64)
    out = jax.jit(health)((jnp.float32(0),), (jnp.asarray(z), jnp.float32(2.0)))
    assert float(out["nonfinite"]) == 1 and float(out["norm"]) == pytest.approx(np.sqrt(7.0))


def test_the_loss_watched_is_the_steps_loss_not_a_metric_or_a_state_scalar():
    """The loss a spike is judged on: in a metrics dict, the leaf named ``loss`` (Flax's
    examples return ``{"accuracy": ..., "loss": ...}``, which flattens accuracy first) or
    ending in ``loss``; a scalar inside a state the step returns anew (a scalar
    parameter, ``optax.inject_hyperparams``' learning rate in the optimizer state) is
    not one; a bare scalar output is, as before."""
    from scalescope.store.flight import health

    w = jnp.ones((4, 4))
    params = {"temperature": jnp.float32(7.0), "w": w}
    opt = {"hyperparams": {"learning_rate": jnp.float32(1e-3)}, "mu": w}
    f32 = jnp.float32
    cases = [
        # (args, outputs, the loss)
        ((params, opt), (params, opt, f32(2.5)), 2.5),
        ((params,), (params, {"accuracy": f32(0.75), "loss": f32(2.5)}), 2.5),
        ((params,), (params, {"accuracy": f32(0.75), "train_loss": f32(2.5)}), 2.5),
        ((params,), (params, {"accuracy": f32(0.75), "loss_scale": f32(2.0**15)}), 0.75),
        ((w,), (w, f32(2.5), f32(0.75)), 2.5),  # mnist's apply_model: grads, loss, accuracy
        ((w, f32(0.1)), (w, f32(2.5)), 2.5),  # a scalar output beside a scalar argument
        ((params,), (params,), 7.0),  # no loss output: the first scalar float anywhere
    ]
    for args, out, want in cases:
        assert float(jax.jit(health)(args, out)["loss"]) == want, (args, out)


def test_health_of_leaves_of_one_shape_read_together_matches_numpy():
    """Leaves of one shape are reduced together (one kernel per shape): parameters,
    their optimizer moments and updates sharing a shape, with NaN/Inf in some of them.
    The count covers every leaf; the norm only the parameters' updates (NumPy)."""
    from scalescope.store.flight import health

    rng = np.random.default_rng(2)
    shapes = {"w1": (16, 8), "w2": (16, 8), "b1": (8,), "b2": (8,), "g": (8,)}
    old = {k: rng.normal(0, 1, s).astype(np.float32) for k, s in shapes.items()}
    new = {k: v + rng.normal(0, 1e-2, v.shape).astype(np.float32) for k, v in old.items()}
    new["w2"][0, 0], new["b1"][3], new["g"][0] = np.nan, -np.inf, np.inf
    mu = {k: rng.normal(0, 1e-3, v.shape).astype(np.float32) for k, v in old.items()}
    mu["w1"][1, 1] = np.nan
    nu = {k: np.abs(rng.normal(0, 1, v.shape)).astype(np.float16) for k, v in old.items()}
    nu["b2"][5] = np.inf
    state = {"mu": mu, "nu": nu}
    tree = lambda t: jax.tree.map(jnp.asarray, t)  # noqa: E731
    out = jax.jit(health)((tree(old), tree(state)), (tree(new), tree(state), jnp.float32(3.0)))
    want_bad = sum(
        int((~np.isfinite(x.astype(np.float64))).sum()) for x in jax.tree.leaves((new, state))
    )
    assert want_bad == 5 and float(out["nonfinite"]) == want_bad
    d = np.concatenate([(new[k].astype(np.float64) - old[k]).ravel() for k in shapes])
    want = np.sqrt(np.sum(d[np.isfinite(d)] ** 2))
    assert float(out["norm"]) == pytest.approx(want, rel=1e-5)
    assert float(out["loss"]) == 3.0


def test_a_spike_where_nothing_grew_names_the_largest_value():
    """A loss that spikes while no op's abs-max grew since the last measured step (the
    state itself changed, e.g. restarted): the op of largest abs-max, no crash."""
    from scalescope.store.flight import describe_incident

    w, x = _inputs()
    table = ss.instrument(spiky, histograms=False).op_table(w, x, jnp.int32(0))
    n = len(table.row_op)
    stats = {k: np.ones(n) for k in ("frac_nonfinite", "absmax", "rms")}
    stats["frac_nonfinite"] = np.zeros(n)
    stats["absmax"] = np.linspace(1.0, 2.0, n)
    found = describe_incident(table, stats, "loss_spike", dict(stats), ())
    last = int(np.asarray(table.row_op)[-1])
    assert found["op"] == last and "largest abs-max" in found["detail"]


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="on_nonfinite must be one of record, stop, skip"):
        ss.Run(tmp_path / "a", on_nonfinite="ignore")
    with pytest.raises(ValueError, match="loss_spike"):
        ss.Triggers(loss_spike=-1)
    with pytest.raises(ValueError, match="window"):
        ss.Triggers(window=0)
    with pytest.raises(TypeError, match="triggers must be a Triggers"):
        ss.Run(tmp_path / "b", triggers={"loss_spike": 3})


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory):
    """A run of `step` over 10 steps, recorded every 1000: one incident, at BAD_STEP."""
    path = tmp_path_factory.mktemp("flight") / "nan"
    run = ss.Run(path, every=1000)
    _train(run, step, 10)
    run.close()
    return path


def test_the_report_lists_incidents_and_the_gate_fails_on_them(nan_run, tmp_path, capsys):
    from scalescope.cli import main

    out = tmp_path / "a.json"
    argv = ["report", str(nan_run), "--json", str(out), "-o", str(tmp_path / "a.html")]
    assert main([*argv, "--fail-on", "incidents>0"]) == 1
    printed = capsys.readouterr()
    assert f"1 incident(s), the first at step {BAD_STEP} at fwd/tail/log" in printed.out
    doc = json.loads(out.read_text())
    (inc,) = doc["incidents"]
    assert inc["step"] == BAD_STEP and inc["name"] == "fwd/tail/log"
    page = (tmp_path / "a.html").read_text()
    assert "Incidents: 1 step(s) went wrong" in page and "fwd/tail/log" in page
    assert main(["report", str(nan_run), "--fail-on", "incidents>1"]) == 0
    assert main(["report", str(nan_run), "--fail-on", "incidents>-1"]) == 2


def test_the_dashboard_marks_incidents_and_opens_their_op(nan_run):
    from types import SimpleNamespace

    from scalescope.app.dashboard import TABS, Dashboard
    from scalescope.app.data import RunSet

    dash = Dashboard(RunSet(nan_run), poll_ms=0)
    assert f"incident at step {BAD_STEP} (nonfinite): fwd/tail/log" in dash.alarms.object
    assert dash.incident_table.visible
    # named as the findings name the op: its unique label (with its shape)
    reader = ss.open_run(nan_run)
    (op,) = reader.incidents()["op"].tolist()
    label = ss.analysis.op_labels(reader.ops)[op]
    assert label.startswith("fwd/tail/log")
    assert dash.incident_table.value["label"].tolist() == [label]
    marks = dash.loss_pane.object.select(name="incidents")
    assert len(marks) == 1 and list(marks[0].data_source.data["step"]) == [BAD_STEP]
    dash._on_incident_click(SimpleNamespace(row=0))
    assert dash.tabs.active == TABS.index("Op detail")
    assert "fwd/tail/log" in dash.op_info.object


SHARDED_INCIDENT = Path(__file__).with_name("sharded_incident_check.py")


@pytest.mark.slow
def test_a_sharded_incident_names_the_device_of_the_first_nonfinite_value():
    """Issue 38 item 5, on 4 host devices (a process of its own): one bad example on the
    third device; the incident names that device, for a jit-partitioned step, for one
    whose op is inside a scan body, and for a shard_map step (the check asserts it)."""
    env = dict(os.environ, XLA_FLAGS=xla_flags_with("--xla_force_host_platform_device_count=4"))
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, str(SHARDED_INCIDENT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "incidents name the device" in proc.stdout
    assert proc.stdout.count('"devices": [{"device": 2, "process": 0') == 3, proc.stdout
