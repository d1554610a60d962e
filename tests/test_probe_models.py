"""The probe on whole training steps: the sample GPT's op table, bit-identical outputs,
and data-parallel (sharded) statistics equal to single-device ones."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import xla_flags_with as _flags
from test_engine_models import _gpt

import scalescope as ss
from scalescope.scalify import get_rule, primitives_in


@pytest.fixture(scope="module", params=[False, True], ids=["unrolled", "scan"])
def gpt_table(request):
    scan = request.param
    step, params, opt_state, batch = _gpt(scan)
    args = (ss.as_scaled_array(params, "rms"), ss.as_scaled_array(opt_state, "rms"), batch)
    inst = ss.instrument(step)
    return scan, step, args, inst, inst.op_table(*args)


def test_gpt_op_table_lists_every_primitive(gpt_table):
    _, step, args, _, table = gpt_table
    closed = jax.make_jaxpr(step)(*ss.asarray(args))
    prims = {p for p in primitives_in(closed) if not (get_rule(p) and get_rule(p).higher_order)}
    listed = {op.primitive for op in table}
    assert prims <= listed, sorted(prims - listed)


def test_gpt_op_table_tells_passes_and_modules_apart(gpt_table):
    scan, _, _, _, table = gpt_table
    by_pass = {p: [op for op in table if op.pass_ == p] for p in ("fwd", "bwd", "opt")}
    assert all(by_pass.values())
    for p in ("fwd", "bwd"):
        assert any(op.primitive == "dot_general" and "attn" in op.name for op in by_pass[p])
    assert all(op.name.startswith("opt/") for op in by_pass["opt"] if op.recorded)
    layer = "blocks" if scan else "block_1"
    for part in ("attn", "mlp", "ln_1"):
        assert any(op.name.startswith(f"{layer}/{part}/") for op in table), part
    recorded = [op for op in table if op.recorded]
    assert sum(op.n_rows for op in recorded) == table.n_rows
    if scan:
        # One row per layer for every recorded op inside the scanned blocks.
        # (The causal mask is built once, outside the scan, under the same scope.)
        in_blocks = [op for op in recorded if op.name.startswith("blocks/")]
        looped = [op for op in in_blocks if op.loop]
        assert len(looped) > 0.9 * len(in_blocks)
        assert all(op.loop == (2,) and op.n_rows == 2 for op in looped)
        assert {op.pass_ for op in looped} == {"fwd", "bwd"}


@pytest.mark.slow
def test_gpt_instrumented_step_is_bit_identical_and_finite():
    # The scanned GPT only: its loop bodies are the probe's hardest path, and compiling
    # the unrolled variant too would double a minute of CI for little more coverage
    # (test_probe checks bit-identity of unrolled models).
    step, params, opt_state, batch = _gpt(True)
    args = (ss.as_scaled_array(params, "rms"), ss.as_scaled_array(opt_state, "rms"), batch)
    inst = ss.instrument(step, isolate=True)
    expected = jax.jit(ss.scalify(step))(*args)
    out, stats = jax.jit(inst)(*args)
    table = inst.op_table(*args)  # the table of that trace: no abstract pass of its own
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(out)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert set(stats) >= set(table.stat_names) | {"hist"}
    for name in table.stat_names:
        assert stats[name].shape == (table.n_rows,)
    # Only the causal mask (-inf logits before the softmax) holds non-finite values.
    nonfinite = np.flatnonzero(np.asarray(stats["frac_nonfinite"]) > 0)
    names = {table[int(table.row_op[r])].name for r in nonfinite}
    assert all("attn" in n for n in names), names
    assert np.all(np.isfinite(np.asarray(stats["rms"])))
    hist = np.asarray(stats["hist"])
    np.testing.assert_array_equal(hist.sum(axis=1), np.asarray(stats["count"]))


SHARDED = Path(__file__).with_name("sharded_probe_check.py")


@pytest.mark.slow
def test_sharded_statistics_equal_single_device():
    env = dict(os.environ, XLA_FLAGS=_flags("--xla_force_host_platform_device_count=4"))
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, str(SHARDED)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "sharded stats equal single-device stats" in proc.stdout
