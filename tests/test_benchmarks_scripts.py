"""The benchmark scripts: `bench_numerics.py` (the paper's table), `check_gpu_fp8.py`,
`bench_scale_kernels.py` and `bench_scale_floor.py`; the speed benchmarks (`bench_probe`,
`bench_scalify`, `bench_scale`, `bench_run`) run end to end on a tiny GPT, so that none
of them rots (their figures come from full-size runs, docs/benchmarks.md)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def _run(script: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


# --- check_gpu_fp8.py ---------------------------------------------------------------


def test_check_gpu_fp8_on_cpu_says_it_needs_a_gpu_and_claims_nothing():
    proc = _run("check_gpu_fp8.py", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "needs a GPU" in proc.stdout and "nothing claimed" in proc.stdout
    assert "RESULT" not in proc.stdout and "FP8 GEMMs" not in proc.stdout


# GPU-style optimized HLO: operands printed with their shapes, a cuBLASLt fp8 call, a
# cuBLAS f16 GEMM, and a Triton GEMM fusion whose dot takes f8 parameters.
GPU_HLO = """
HloModule jit_step

%triton_gemm_computation (param_0.1: f8e5m2[64,128], param_1.1: f8e4m3fn[128,32]) -> f16[64,32] {
  %param_0.1 = f8e5m2[64,128]{1,0} parameter(0)
  %param_1.1 = f8e4m3fn[128,32]{1,0} parameter(1)
  ROOT %dot.7 = f16[64,32]{1,0} dot(%param_0.1, %param_1.1), lhs_contracting_dims={1}
}

ENTRY %main (p0: f16[64,128], p1: f16[128,32]) -> f16[64,32] {
  %p0 = f16[64,128]{1,0} parameter(0)
  %p1 = f16[128,32]{1,0} parameter(1)
  %convert.1 = f8e4m3fn[64,128]{1,0} convert(f16[64,128]{1,0} %p0)
  %convert.2 = f8e4m3fn[128,32]{1,0} convert(f16[128,32]{1,0} %p1)
  %cublas-lt-matmul.3 = (f16[64,32]{1,0}, s8[33554432]{0}) custom-call(f8e4m3fn[64,128]{1,0} %convert.1, f8e4m3fn[128,32]{1,0} %convert.2, f32[] %c, f32[] %c), custom_call_target="__cublas$lt$matmul$f8", backend_config={}
  %cublas-gemm.4 = (f16[64,64]{1,0}, s8[0]{0}) custom-call(f16[64,128]{1,0} %p0, f16[128,64]{1,0} %t), custom_call_target="__cublas$gemm"
  %fusion = f16[64,32]{1,0} fusion(%convert.5, %convert.2), kind=kCustom, calls=%triton_gemm_computation
  %other = f32[4]{0} custom-call(f32[4]{0} %x), custom_call_target="SomethingElse"
  ROOT %dot.9 = f32[64,64]{1,0} dot(f32[64,128]{1,0} %a, f32[128,64]{1,0} %b), lhs_contracting_dims={1}
}
"""  # noqa: E501


def test_check_gpu_fp8_parser_counts_fp8_and_other_gemms():
    mod = load_benchmark("check_gpu_fp8")
    summary = mod.parse_hlo(GPU_HLO)
    assert len(summary.gemms) == 4  # not the unrelated custom call
    assert {g.name for g in summary.fp8_gemms} == {"cublas-lt-matmul.3", "dot.7"}
    assert {g.name for g in summary.other_gemms} == {"cublas-gemm.4", "dot.9"}
    dot7 = next(g for g in summary.gemms if g.name == "dot.7")
    assert dot7.operand_dtypes == ("f8e5m2", "f8e4m3fn")  # looked up by name
    assert summary.f8_converts == 2
    lines = []
    mod.report(summary, 9, evidence=True, out=_Lines(lines))
    text = "\n".join(lines)
    assert "FP8 GEMMs (f8 operands or fp8 cuBLASLt call): 2" in text
    assert "RESULT: yes, 2 of 4 GEMMs run in FP8" in text and "27 GEMMs" in text
    lines.clear()
    mod.report(mod.parse_hlo(GPU_HLO), 9, evidence=False, out=_Lines(lines))
    assert all("NOT evidence" in line for line in lines) and not any("RESULT" in x for x in lines)


class _Lines:
    def __init__(self, lines: list[str]) -> None:
        self.lines = lines

    def write(self, s: str) -> None:
        self.lines.extend(x for x in s.splitlines() if x)

    def flush(self) -> None:
        pass


# --- bench_numerics.py --------------------------------------------------------------


def _fake(row: str, train: float, val: float) -> dict:
    return {"row": row, "train_loss": train, "val_loss": val, "steps_per_s": 2.5, "nan_step": None}


def test_bench_numerics_gaps_table_and_goal():
    mod = load_benchmark("bench_numerics")
    results = mod.add_gaps(
        [
            _fake("fp32", 1.80, 1.80),
            _fake("fp16", 1.81, 1.80),
            _fake("fp8", 1.827, 1.818),
            _fake("fp8-fp16-opt", 1.90, 1.89),
            {**_fake("fp8-naive", math.nan, math.nan), "nan_step": 7},
        ]
    )
    by = {r["row"]: r for r in results}
    assert by["fp8"]["train_gap_pct"] == pytest.approx(1.5)
    assert by["fp8"]["val_gap_pct"] == pytest.approx(1.0)
    assert math.isinf(by["fp8-naive"]["val_gap_pct"])
    table = mod.format_table(results)
    lines = table.splitlines()
    assert lines[0].startswith("| precision |") and len(lines) == 2 + 5
    assert "| fp8 | fp16 / fp32 | 1.8270 | 1.8180 | +1.50 % | +1.00 % | 2.50 |" in table
    assert "(ref)" in lines[2] and "diverged" in lines[6] and "NaN from step 7" in lines[6]
    verdict = mod.goal(results)
    assert verdict["fp8_ok"] is True and verdict["naive_worse"] is True
    text = "\n".join(verdict["lines"])
    assert "2.87" in text and "fp8-fp16-opt within 2 % of fp32" in text and "FAIL" in text
    # without an fp32 row there is no gap and no verdict
    alone = mod.add_gaps([_fake("fp8", 1.8, 1.8)])
    assert alone[0]["val_gap_pct"] is None and mod.goal(alone)["fp8_ok"] is None
    assert "–" in mod.format_table(alone)


def test_bench_numerics_rejects_unknown_rows():
    mod = load_benchmark("bench_numerics")
    with pytest.raises(SystemExit):
        mod.parse_args(["--rows", "fp32,fp4"])
    assert mod.parse_args(["--rows", "fp32, fp8"]).rows == ["fp32", "fp8"]
    assert mod.parse_args([]).lr is None and mod.parse_args(["--lr", "0.03"]).lr == 0.03
    for bad in ("0", "-1", "nan"):
        with pytest.raises(SystemExit):
            mod.parse_args(["--lr", bad])


@pytest.mark.slow
def test_bench_numerics_runs_a_tiny_config_end_to_end(tmp_path):
    out = tmp_path / "numerics.json"
    args = ["--steps", "3", "--layers", "1", "--d-model", "32", "--seq-len", "16"]
    args += ["--batch", "4", "--eval-batches", "1", "--data", "vendored"]
    proc = _run("bench_numerics.py", *args, "--rows", "fp32,fp8", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "| precision | weights / opt state |" in proc.stdout
    assert "goal: scalified fp8 within 2 % of fp32" in proc.stdout
    data = json.loads(out.read_text())
    assert [r["row"] for r in data["results"]] == ["fp32", "fp8"]
    fp8 = data["results"][1]
    assert fp8["scalify"] and fp8["opt_state"] == "fp32" and fp8["steps"] == 3
    assert fp8["lr"] == 2e-3  # the recipe's own peak rate (no --lr)
    assert math.isfinite(fp8["val_loss"]) and math.isfinite(fp8["val_gap_pct"])
    assert data["machine"]["jax"] and data["command"].startswith("python benchmarks/")


# --- bench_scale_kernels.py -----------------------------------------------------------


def test_bench_scale_kernels_prints_every_variant():
    """A tiny chain: each variant compiles and is printed with its fusions; the
    materialised variants share one structure (only constants differ), the duplicated
    one has fewer, larger fusions. Bad options are refused."""
    done = _run("bench_scale_kernels.py", "--layers", "6", "--ops", "4", timeout=300)
    assert done.returncode == 0, done.stderr
    rows = {}
    for line in done.stdout.splitlines():
        parts = line.split()
        if len(parts) == 5 and parts[0] == "4":
            rows[parts[1]] = (float(parts[2]), int(parts[3]), float(parts[4]))
    assert set(rows) == {"duplicated", "identical", "distinct", "barrier"}, done.stdout
    assert all(seconds > 0 for seconds, _, _ in rows.values())
    assert rows["identical"][1] == rows["distinct"][1] == rows["barrier"][1]
    assert rows["duplicated"][1] < rows["identical"][1]
    assert rows["identical"][2] == 1.0
    bad = _run("bench_scale_kernels.py", "--ops", "four", timeout=120)
    assert bad.returncode == 2 and "--ops" in bad.stderr


# --- bench_scale_floor.py -------------------------------------------------------------


def test_bench_scale_floor_prints_every_variant_and_checks_the_ideal_engine():
    """The idealised engine runs the whole MLP training step and its outputs equal the
    plain step's (the script asserts it for each variant, so a wrong model of a primitive
    fails here); each variant is printed with a time and a ratio to plain."""
    done = _run("bench_scale_floor.py", "--models", "mlp", "--reps", "1", timeout=300)
    assert done.returncode == 0, done.stderr
    rows = {}
    for line in done.stdout.splitlines():
        parts = line.rsplit(None, 2)
        if len(parts) == 3 and not line.startswith("#") and parts[1].replace(".", "").isdigit():
            rows[parts[0].strip()] = (float(parts[1]), float(parts[2]))
    expected = {
        "plain",
        "ideal, exponents folded",
        "ideal, traced exponents",
        "ideal, traced, materialised",
        "scalify",
    }
    assert set(rows) == expected, done.stdout
    assert rows["plain"][1] == 1.0
    assert all(seconds > 0 for seconds, _ in rows.values())
    assert "ideal outputs equal the plain step's" in done.stdout
    bad = _run("bench_scale_floor.py", "--models", "resnet", timeout=120)
    assert bad.returncode == 2 and "--models" in bad.stderr


def test_the_ideal_engine_refuses_loops_by_name():
    floor = load_benchmark("bench_scale_floor")
    import jax
    import jax.numpy as jnp

    def loop(x):
        return jax.lax.fori_loop(0, 3, lambda i, c: c * 2.0, x)

    with pytest.raises(NotImplementedError, match="scan.* is not modelled"):
        floor.idealised(loop, traced=False, materialize=False)((jnp.ones(3),))


# --- smoke runs of the speed benchmarks (tiny models: the scripts cannot rot) ----------

#: The tiny GPT of every smoke run (gpu_suite.py's SMOKE too): 1 layer, d=16, 2 heads,
#: seq 8, batch 2, scanned. With ``--compile-cache`` the programs the scripts share (the
#: scalified step, the default instrumented step) compile once per machine.
TINY = ("--layers", "1", "--d-model", "16", "--heads", "2", "--seq", "8", "--batch", "2", "--scan")


def _ratios(line: str) -> list[float]:
    """The numbers of a printed table row (ratios and times), as floats."""
    out = []
    for word in line.replace("(", " ").replace(")", " ").replace("x", " ").split():
        try:
            out.append(float(word))
        except ValueError:
            pass
    return out


@pytest.mark.slow
def test_bench_probe_runs_a_tiny_config():
    # the native kernel: the pure-XLA one (a GPU's) runs in gpu_suite.py's smoke test
    args = ("--steps", "1", "--quick", "--kernel", "native", "--compile-cache")
    proc = _run("bench_probe.py", *TINY, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert any("probe kernel native (native taken)" in line for line in lines), proc.stdout
    for label in (
        "scalified step (baseline)",
        "all ops, histograms (default)",
        "isolate=True (bit-identical out)",
        "Run.track statistics program",
    ):
        row = next(line for line in lines if line.startswith(label))
        numbers = _ratios(row[len(label) :])
        assert len(numbers) == 8 and all(math.isfinite(v) and v >= 0 for v in numbers), row
    goals = [line for line in lines if line.startswith("# goals")]
    assert len(goals) == 2 and all("temporaries" in g and "compile" in g for g in goals)


def test_bench_probe_compile_repeats_count_the_fastest_fresh_compile(monkeypatch):
    """``--compile-repeats N``: the program is traced and compiled N times from scratch
    (a new function each time, so no cache answers) and the fastest time counts."""
    import jax.numpy as jnp

    monkeypatch.syspath_prepend(str(BENCH))  # its sibling `_compile_cache`, as a script
    mod = load_benchmark("bench_probe")
    traced = []

    def fn(x):
        traced.append(1)
        return jnp.sin(x) * 2.0

    clock = iter([0.0, 5.0, 10.0, 12.0, 20.0, 29.0])  # compiles of 5, 2 and 9 s
    monkeypatch.setattr(mod, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    compile_s, step, temp, out = mod._measure(fn, (jnp.ones(8),), 0, repeats=3)
    assert len(traced) == 3 and compile_s == 2.0 and math.isnan(step)
    assert out == 8 * 4 and temp >= 0


@pytest.mark.slow
def test_bench_scalify_runs_a_tiny_config():
    proc = _run(
        "bench_scalify.py", "--models", "small", "--seq", "8", "--batch", "2", "--steps", "2"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line[:34].strip(): _ratios(line[34:]) for line in proc.stdout.splitlines()}
    for label in ("trace+compile (s)", "step time (ms)"):
        plain, scalified, ratio = rows[label][:3]
        assert plain > 0 and scalified > 0, rows[label]
        assert math.isclose(ratio, scalified / plain, rel_tol=0.05, abs_tol=0.01), rows[label]


@pytest.mark.slow
def test_bench_scale_runs_a_tiny_config(tmp_path):
    proc = _run(
        "bench_scale.py",
        "--layers",
        "1",
        "--d-model",
        "16",
        "--heads",
        "2",
        "--seq",
        "8",
        "--batch",
        "2",
        "--steps",
        "1",
        "--records",
        "2",
        "--out",
        str(tmp_path),
        "--compile-cache",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for label in (
        "plain FP32 step",
        "scalified FP8 step",
        "jit(ss.instrument(step))",
        "Run: recorded step",
        "Run: size on disk",
        "reader: open + wide frame",
    ):
        assert label in out, out
    import scalescope as ss

    reader = ss.open_run(tmp_path / "run")
    assert list(reader.steps) == [0, 1] and reader.status == "closed"


@pytest.mark.slow
def test_bench_run_runs_a_tiny_config():
    proc = _run("bench_run.py", *TINY, "--steps", "3", "--repeats", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    for label in (
        "untracked jit(scalify(step))",
        "run.track every=10, exact",
        "run.track every=100, exact",
        "run.track budget=0.05, exact",
        "run.track detection only (flight recorder)",
        "run.track detection only, judged in the call",
        "run.track every=100, detect=False",
        "untracked again",
    ):
        row = next((line for line in lines if line.startswith(label)), None)
        assert row is not None, (label, proc.stdout)
        ms, ratio = _ratios(row[len(label) :])[:2]
        assert ms > 0 and ratio > 0, row
    assert any(line.startswith("replay latency (an incident kept):") for line in lines)


def test_bench_run_check_cost_compares_the_compiled_programs():
    """``--check-cost``: XLA's cost model of the step with the flight recorder's check,
    after it or inside it, over the step without it (a small step: the same function the
    script calls)."""
    import jax
    import jax.numpy as jnp
    import optax

    mod = load_benchmark("bench_run")

    def loss(p, x):
        return jnp.mean(jnp.tanh(x @ p["w"]) ** 2)

    opt = optax.adam(1e-3)

    def step(p, s, x):
        g = jax.grad(loss)(p, x)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss(p, x)

    params = {"w": jnp.ones((64, 64)) * 0.1}
    costs = mod._check_cost(step, params, opt.init(params), jnp.ones((8, 64)))
    # a program of its own after the step (CPU), and inside the step (GPU)
    assert set(costs) == {"after", "inside"}
    for where, (bytes_x, flops_x) in costs.items():
        # the check reads every output leaf and the old parameters: more bytes, a little
        assert 1.0 < bytes_x < 3.0 and 1.0 <= flops_x < 3.0, (where, bytes_x, flops_x)
    line = mod._check_cost_line(*costs["inside"], "inside")
    assert line.startswith("detection's check (inside the step) by XLA's cost model")
    assert "goal <= 1.02x" in line


def test_bench_run_memory_shows_a_donated_tracked_step_holding_what_a_donated_jit_does(capsys):
    """``--memory`` on a small Adam step: compiled memory with and without
    ``donate_argnums=(0, 1)``; tracked without the check it is the user's donated jit's,
    without donation the plain jit's (the state held twice), and donation saves most
    of the state."""
    import jax
    import jax.numpy as jnp
    import optax

    mod = load_benchmark("bench_run")
    opt = optax.adam(1e-3)

    def step(p, s, x):
        loss, g = jax.value_and_grad(lambda p: jnp.mean(jnp.tanh(x @ p["w"]) ** 2))(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    params = {"w": jnp.ones((256, 256)) * 0.01}
    rows = mod._memory(step, params, opt.init(params), jnp.ones((8, 256)))
    out = capsys.readouterr().out
    jit = rows["jax.jit(scalify(step)), donate_argnums=()"]
    jit_donated = rows["jax.jit(scalify(step)), donate_argnums=(0, 1)"]
    state_mib = 3 * 256 * 256 * 4 / 2**20  # w, Adam's mu and nu
    # what XLA can write in place (on CPU it keeps one array of the state apart here)
    assert jit - jit_donated >= 0.5 * state_mib, out
    assert rows["run.track(step, donate_argnums=())"] == jit, out
    assert rows["run.track(step, donate_argnums=(0, 1)), detect=False"] == jit_donated, out
    # with the check: the parameters before the update, at most, beside the donated jit
    with_check = rows["run.track(step, donate_argnums=(0, 1))"]
    assert with_check <= jit_donated + 1.5 * state_mib / 3, out
    assert rows["run.track(step, donate_argnums=(0, 1)): statistics"] > jit_donated, out


def test_bench_zoo_verdicts_labels_each_run_and_prints_the_table(capsys, tmp_path):
    """bench_zoo_verdicts in-process on the optax zoo's MLP, 4 steps: FP8 master weights
    held in place (w8) are judged (the parameters are marked cast to E4M3), the fp32 run
    labels the others, and the table says whether verdict and label agree."""
    mod = load_benchmark("bench_zoo_verdicts")
    out = tmp_path / "rows.json"
    rc = mod.main(
        [
            "--models",
            "optax_adamw_masked",
            "--variants",
            "w8,recipe",
            "--steps",
            "4",
            "--every",
            "2",
            "--json",
            str(out),
        ]  # fmt: skip
    )
    assert rc == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"fp32", "w8", "recipe"}  # fp32 added: the labels need it
    assert rows["fp32"]["gap_pct"] == 0.0 and rows["fp32"]["label"] == "healthy"
    for r in rows.values():
        assert r["label"] in ("healthy", "broken") and r["verdict"] in (
            "healthy",
            "at risk",
            "failing",
        )
        assert r["agree"] == ((r["verdict"] == "healthy") == (r["label"] == "healthy"))
    text = capsys.readouterr().out
    assert "| optax_adamw_masked | w8 |" in text and "runs under a policy" in text
    # the recipe reaches the MLP's matmul operands (exact labels, forward and backward)
    step, args, _ = mod.MODELS["optax_adamw_masked"]()
    table = mod.ss.instrument(step, scalify=False).op_table(*args)
    policy = mod.policy_of("recipe", table)
    assert set(policy.values()) == {"mxfp8_e4m3@matmul", "mxfp8_e5m2@matmul"}
    assert all(r["ops"] for r in mod.ss.Policy.from_dict(policy).describe(table))
    # the held variants reach the parameters, m16 Adam's two moments of every leaf
    for variant in ("w16", "wfp16", "m16"):
        described = mod.ss.Policy.from_dict(mod.policy_of(variant, table)).describe(table)
        assert all(r["ops"] for r in described), variant
    moments = mod.ss.Policy.from_dict(mod.policy_of("m16", table)).describe(table)
    assert sum(len(r["ops"]) for r in moments) == 2 * len(mod.jax.tree_util.tree_leaves(args[0]))
