"""benchmarks/gpu_suite.py --smoke: every section runs on a tiny model on CPU, through
the pure-XLA probe kernel a GPU takes, so the GPU suite cannot rot between GPU sessions."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_suite_smoke_runs_every_section(tmp_path):
    # the checkout first (the suite imports sample_models as a folder, as on the GPU
    # machine), then what the run already has (the opt-in compile log)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "SCALESCOPE_PROBE_KERNEL": "xla", "PYTHONPATH": path}
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu_suite.py"),
            "--smoke",
            "--out",
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["sections"]) == {"env", "fp8_gemms", "throughput", "probe", "numerics"}
    assert all(s["error"] is None for s in results["sections"].values())
    assert results["ui_modules_imported"] == []  # the GPU image has no Panel or Bokeh
    env_ = results["env"]
    assert env_["probe_kernel"] == "xla"
    # every primitive of the FP8 and FP16 GPT steps has a scalify rule
    assert env_["missing_rules"] == {"fp8": [], "fp16": []}
    assert env_["traces"] == {"scalify": "ok", "instrument": "ok"}
    gemms = results["fp8_gemms"]
    assert gemms["gemms"] > 0 and gemms["fp8_cast_gemms"] > 0
    assert gemms["fp8_cast_gemms"] <= gemms["fp8_cast_gemms_per_step"]
    # on CPU no GEMM is FP8: the program compiled without excess precision is counted too
    assert gemms["fp8_gemms"] == 0 and gemms["without_excess_precision"]["gemms"] > 0
    assert gemms["without_excess_precision"]["step"] == "fp8-naive"  # on CPU: the cheap one
    assert gemms["evidence"] is False  # on CPU: no claim about FP8 GEMMs
    assert (tmp_path / gemms["not_fp8_patterns"]).is_file()
    rows = results["throughput"]["steps"]
    assert set(rows) == {"bf16", "fp8", "fp8-naive"}
    assert all(r["tokens_per_s"] > 0 for r in rows.values())
    probe = results["probe"]
    assert probe["probe_kernel"] == "xla"
    assert probe["select"] == "dot_general"  # the smoke records the matmuls only
    for key in ("instrument_step_x", "instrument_temp_x"):
        assert math.isfinite(probe[key]) and probe[key] > 0
    assert probe["run_every10"]["every"] == 10 and probe["run_budget"]["budget"] == 0.05
    assert probe["run_detect"]["ratio"] > 0 and probe["run_detect"]["start_step"] == 1
    # the flight recorder's check where CPU puts it (after the step), then inside it
    assert probe["run_detect"]["check"] == "after the step"
    assert probe["run_detect_other"]["check"] == "in the step"
    assert probe["run_detect_other"]["ratio"] > 0
    numerics = results["numerics"]
    assert numerics["finite"] and math.isfinite(numerics["gap"])
    md = (tmp_path / "results.md").read_text()
    for heading in ("## FP8 GEMMs", "## Throughput", "## The probe", "## Numerics"):
        assert heading in md
    assert "did not finish" not in md and "not measured" not in md


def _suite():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT))
    import gpu_suite

    return gpu_suite


def test_fp8_cast_gemms_are_counted_as_the_compiled_text_holds_them():
    """A scanned layer's dense GEMMs stand once in the program's text (the HLO's GEMM
    count is compared with this), once per layer in a step."""
    g = _suite()
    size = g.Size(layers=3, d_model=16, heads=2, seq=8, batch=2, vocab=65)
    scanned, unrolled = g._dense_matmuls(size, scan=True), g._dense_matmuls(size, scan=False)
    per_layer = (unrolled - scanned) // 2
    assert per_layer >= 4 and unrolled == scanned + 2 * per_layer


def test_a_cublas_gemms_context_names_its_operands():
    """cuBLAS calls return a tuple: the operands are found after the op's name, not in
    the result type's parentheses."""
    g = _suite()
    hlo = """
  %p0 = f8e4m3fn[64,32]{1,0} parameter(0)
  %p1 = f8e4m3fn[32,16]{1,0} parameter(1)
  %cvt = f16[32,16]{1,0} convert(%p1)
  %gemm = (f16[64,16]{1,0}, s8[1024]{0}) custom-call(%p0, %cvt), custom_call_target="__cublas$gemm"
"""
    text = g.hlo_context(g.hlo_definitions(hlo), "gemm")
    lines = text.splitlines()
    assert lines[0].startswith("%gemm") and len(lines) == 3, text
    assert "parameter(0)" in lines[1] and "convert(%p1)" in lines[2]


def test_a_suite_killed_or_past_its_deadline_says_what_it_did_not_measure():
    g = _suite()
    results = {
        "model": "GPT",
        "smoke": False,
        "sections": {
            "throughput": {"seconds": 9.0, "error": "Traceback\nRuntimeError: rows failed"},
            "probe": {"running": True, "started_s": 401.0, "error": None},
        },
        "throughput": {
            "steps": {
                "bf16": {"compile_s": 1.0, "step_ms": 10.0, "tokens_per_s": 800.0},
                "fp8": {"error": "Traceback\nKeyError: 'num_consts'"},
                "fp8-naive": {"skipped": "deadline"},
            }
        },
        "probe": {
            "probe_kernel": "xla",
            "instrument_step_x": 1.2,
            "instrument_temp_x": 1.05,
            "instrument_compile_x": 2.0,
            "run_every10": {"steps": 100, "ratio": 1.01, "every": 10},
            "run_budget": {"skipped": "deadline", "budget": 0.05},
        },
    }
    md = g.markdown(results)
    assert "| fp8 | not measured: KeyError: 'num_consts' |" in md
    assert "| fp8-naive | not measured: deadline |" in md
    assert "Scalified FP8 / BF16: not measured" in md
    assert "Run(every=10): 1.010x (goal <= 1.05 met) over 100 steps" in md
    assert "Run(budget=0.05): not measured (deadline)" in md
    assert "detection only (the flight recorder): not measured" in md
    assert "probe did not finish (started 401 s into the suite)" in md


def test_without_a_gpu_the_full_suite_refuses_to_start(tmp_path, capsys):
    g = _suite()
    assert g.main(["--out", str(tmp_path)]) == 2
    assert "JAX found no GPU" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


def test_a_smoke_run_compiles_with_the_test_suites_xla_flags(monkeypatch):
    gpu_suite = _suite()
    # a caller's optimisation level is kept as it is (the test suite sets its own)
    chosen = "--xla_backend_optimization_level=1"
    assert gpu_suite.smoke_xla_flags(chosen) == chosen
    # otherwise the flags this XLA takes are added after the caller's
    flags = gpu_suite.smoke_xla_flags("--xla_cpu_enable_fast_math=false").split()
    assert flags[0] == "--xla_cpu_enable_fast_math=false"
    assert "--xla_backend_optimization_level=0" in flags
    # a flag this XLA does not know is left out rather than aborting the run
    monkeypatch.setattr(
        gpu_suite, "SMOKE_XLA_FLAGS", ("--xla_backend_optimization_level=0", "--no_such_xla_flag")
    )
    assert gpu_suite.smoke_xla_flags("") == "--xla_backend_optimization_level=0"
