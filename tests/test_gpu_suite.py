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
    gemms = results["fp8_gemms"]
    assert gemms["gemms"] > 0 and gemms["fp8_cast_gemms"] > 0
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
    numerics = results["numerics"]
    assert numerics["finite"] and math.isfinite(numerics["gap"])
    md = (tmp_path / "results.md").read_text()
    for heading in ("## FP8 GEMMs", "## Throughput", "## The probe", "## Numerics"):
        assert heading in md
