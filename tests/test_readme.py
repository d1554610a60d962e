"""The README's promises: its first lines are the two commands, and its "own training
loop" example runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import scalescope as ss

README = Path(__file__).resolve().parents[1] / "README.md"


def _block(marker: str) -> str:
    text = README.read_text()
    match = re.search(rf"<!-- readme-example: {marker} .*?-->\n```python\n(.*?)```", text, re.S)
    assert match, f"README has no example marked {marker!r}"
    return match.group(1)


def test_readme_opens_with_the_demo_and_test_commands():
    lines = README.read_text().splitlines()
    fence = lines.index("```bash")
    assert lines[fence + 1].startswith("make demo") and lines[fence + 2].startswith("make test")
    makefile = (README.parent / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "make test" in (README.parent / ".ci" / "run").read_text()


@pytest.mark.slow
def test_own_training_loop_example_runs_as_written(tmp_path):
    code = _block("own-loop")
    assert 15 <= len(code.strip().splitlines()) <= 30
    (tmp_path / "example.py").write_text(code)
    done = subprocess.run(
        [sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    reader = ss.open_run(tmp_path / "runs" / "mine")
    assert reader.steps.tolist() == list(range(0, 100, 10))
    loss = reader.scalars["loss"].to_numpy(np.float64)
    assert len(loss) == 100 and np.isfinite(loss).all()
    assert loss[-10:].mean() < loss[:10].mean() / 2  # it trains
    ops = reader.ops
    assert {"fwd", "bwd", "opt"} <= set(ops["pass"])
    assert (ops["cast_to"] == "e4m3").sum() >= 2  # the two FP8 casts are seen
