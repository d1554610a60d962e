"""`scalescope demo`: two recorded GPT runs (naive and scalified FP8), the dashboard on
them, a clean stop on Ctrl-C, and clear errors for bad options."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from conftest import free_port

import scalescope as ss
from scalescope.cli import main
from scalescope.sample_models.demo import DEMO_RUNS, DemoError, demo_folder

REPO = Path(__file__).resolve().parents[1]
# The demo trains once in this module (`served_demo`); the `train` test after it runs the
# same model and options (steps and every are compiled into the step: the learning-rate
# schedule), so it reads the compiled steps from the session's JAX compilation cache
# (conftest; `make test` hands a whole module to one xdist worker).
DEMO_STEPS = 4
DEMO_ARGS = ["--steps", str(DEMO_STEPS), "--every", "2"]


def _env() -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env.pop("BOKEH_RESOURCES", None)
    return env


def _default_sigint() -> None:
    # A job started in the background by a non-interactive shell inherits SIGINT
    # ignored, and Python then never raises KeyboardInterrupt: give the demo the
    # disposition a terminal gives it, whatever launched the test run.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _demo_process(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "scalescope.cli", "demo", "--data", "vendored", *args],
        cwd=cwd,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_default_sigint,
    )


def _reap(proc: subprocess.Popen) -> None:
    """Kill ``proc`` if it is still running (a test that failed before it stopped)."""
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def _check_runs(root: Path, steps: int) -> dict[str, ss.RunReader]:
    readers = {}
    for name, precision in DEMO_RUNS:
        reader = ss.open_run(root / name)
        assert reader.config["precision"] == precision
        assert reader.config["scalify"] is (precision != "fp8-naive")
        loss = reader.scalars["loss"]
        assert len(loss) == steps
        assert len(reader.steps) >= 1 and len(reader.ops) > 100
        assert reader.status == "closed"
        readers[name] = reader
    return readers


@pytest.fixture(scope="module")
def served_demo(tmp_path_factory) -> dict:
    """One whole demo, as a user starts it: `scalescope demo` in a process of its own,
    the dashboard served live, the page fetched while it serves, then Ctrl-C. The tests
    of its runs, its summary and its serving all read this one run (each demo run traces
    and runs both GPT steps again, ~45 s)."""
    cwd = tmp_path_factory.mktemp("served-demo")
    port = free_port()
    proc = _demo_process([*DEMO_ARGS, "--port", str(port)], cwd)
    lines: list[str] = []
    page: dict = {}
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "dashboard on both runs" in line:
                break
        if any("dashboard on both runs" in line for line in lines):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=60) as response:
                page = {
                    "status": response.status,
                    "body": response.read().decode("utf-8", "replace"),
                }
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        _reap(proc)
    folders = list((cwd / "runs" / "demo").iterdir()) if (cwd / "runs" / "demo").is_dir() else []
    return {
        "port": port,
        "lines": "".join(lines),
        "rest": rest,
        "returncode": proc.returncode,
        "page": page,
        "folders": folders,
    }


def _check_summary(text: str, readers: dict[str, ss.RunReader]) -> None:
    """What the demo prints after training: the verdicts first (the run that needs
    attention most on top), then the losses, then what NVFP4 would do."""
    assert text.index("verdicts:") < text.index("final losses")
    verdicts = text[text.index("verdicts:") :].splitlines()[1:3]
    assert verdicts[0].startswith("  fp8-naive  failing from step 0: e5m2 underflow"), text
    assert verdicts[1].startswith("  fp8        healthy"), text
    assert "why fp8-naive is failing:" in text and "fix: run.track(step, scalify=True)" in text
    # the demo audits two block-scaled recipes and says what NVFP4 would do; one op count
    scaled = readers["fp8"]
    assert scaled.recipes == ("mxfp8_e4m3", "nvfp4")
    from scalescope import analysis as A

    n_ops = len(A.format_whatif_run(scaled))
    summary = text[text.index("nvfp4 on fp8:") :].splitlines()
    assert f" {n_ops} ops" in summary[0], summary
    assert "opt/opt/" not in text
    shown = [line for line in summary[1:] if line.startswith("  ")]
    assert len(shown) == len(set(shown))  # no line twice


@pytest.mark.slow
def test_demo_serves_the_runs_live_and_stops_on_ctrl_c(served_demo):
    demo = served_demo
    lines, port = demo["lines"], demo["port"]
    assert "dashboard on both runs" in lines, lines + demo["rest"]
    assert f"http://127.0.0.1:{port}/" in lines
    assert demo["page"], "the page was not fetched: " + lines + demo["rest"]
    assert demo["page"]["status"] == 200
    assert "bokeh" in demo["page"]["body"].lower()
    assert demo["returncode"] == 0, lines + demo["rest"]
    assert "stopped" in demo["rest"] and "Traceback" not in lines + demo["rest"]
    (root,) = demo["folders"]  # the default folder, runs/demo/<time>
    readers = _check_runs(root, DEMO_STEPS)
    # recorded at steps 0 and 2, in both runs, with the same ops (same graph but scalify)
    for reader in readers.values():
        assert reader.steps.tolist() == [0, 2]
    scaled = readers["fp8"]
    assert np.isfinite(scaled.scalars["loss"].to_numpy(np.float64)).all()
    assert set(scaled.ops["pass"]) >= {"fwd", "bwd", "opt"}
    _check_summary(lines, readers)


@pytest.mark.slow
def test_demo_no_serve_ends_with_the_runs_and_how_to_serve_them(
    served_demo, tmp_path, capsys, monkeypatch
):
    """`--no-serve` on the served demo's runs: the training (the same code as the served
    demo's, checked above) is replaced by a copy of those runs; the verdicts, the losses
    and the recipe summary are computed from them as the demo computes its own."""
    import shutil

    from scalescope.sample_models import demo as demo_module

    (served,) = served_demo["folders"]

    def copied_runs(opts, root, **_):
        summaries = {}
        for name, _precision in DEMO_RUNS:
            shutil.copytree(served / name, root / name)
            loss = ss.open_run(root / name).scalars["loss"]
            summaries[name] = {"train_loss": float(loss.iloc[-1])}
        return summaries

    monkeypatch.setattr(demo_module, "train_demo_runs", copied_runs)
    out = tmp_path / "demo"
    argv = ["demo", *DEMO_ARGS, "--no-serve", "--data", "vendored"]
    assert main([*argv, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    readers = _check_runs(out, DEMO_STEPS)
    _check_summary(text, readers)
    assert text.rstrip().endswith(f"see them with: scalescope serve {out}")
    # an existing demo folder is never overwritten: refused before anything is written
    before = (out / "fp8-naive" / "run.json").read_bytes()
    assert main([*argv, "--out", str(out)]) == 2
    assert "never overwrites" in capsys.readouterr().err
    assert (out / "fp8-naive" / "run.json").read_bytes() == before


@pytest.mark.slow
def test_train_gpt_fp8_writes_a_readable_run_with_formats_and_recipes(tmp_path):
    """`scalescope train gpt --precision fp8 --formats ...` on the demo's model and
    options (after the demo test in this module: its programs come from the compilation
    cache, as the demo's second run does)."""
    from scalescope.sample_models.demo import DEMO_FORMATS, DEMO_GPT

    run = tmp_path / "gpt-fp8"
    model = ["--layers", str(DEMO_GPT["n_layers"]), "--d-model", str(DEMO_GPT["d_model"])]
    model += ["--seq-len", str(DEMO_GPT["seq_len"]), "--heads", str(DEMO_GPT["n_heads"])]
    model += ["--scan"] if DEMO_GPT["scan_layers"] else []
    argv = ["train", "gpt", "--precision", "fp8", *DEMO_ARGS, "--batch", "16"]
    argv += [*model, "--data", "vendored", "--formats", ",".join(DEMO_FORMATS)]
    assert main([*argv, "--run", str(run), "--quiet"]) == 0
    reader = ss.open_run(run)
    assert reader.status == "closed" and reader.config["precision"] == "fp8"
    assert reader.config["scalify"] is True
    assert list(reader.steps) == [0, 2] and list(reader.scalars.index) == [0, 1, 2, 3]
    assert {"loss", "lr", "val_loss"} <= set(reader.scalars.columns)
    assert {"fwd", "bwd", "opt"} <= set(reader.ops["pass"])
    dots = reader.stats("rms", ops=r"^fwd/.*dot_general", steps=0)
    assert len(dots) > 0 and np.isfinite(dots["value"]).all()
    # --formats records the recipes next to the formats
    assert reader.formats == ("e4m3", "e5m2", "fp16", "bf16")
    assert reader.recipes == ("mxfp8_e4m3", "nvfp4")
    flush = reader.stats("block_flush_nvfp4", ops=r"^fwd/.*dot_general", steps=0)
    assert len(flush) > 0 and ((flush["value"] >= 0) & (flush["value"] <= 1)).all()
    assert reader.config["vocab_size"] > 60 and reader.config["dataset"] == "shakespeare (vendored)"
    assert any("attn" in name for name in reader.ops["name"])
    meta = json.loads((run / "run.json").read_text())
    assert meta["every"] == 2 and meta["graph"]["n_ops"] == len(reader.ops)


@pytest.mark.slow
def test_ctrl_c_during_training_keeps_the_runs(tmp_path):
    out = tmp_path / "demo"
    proc = _demo_process(
        ["--steps", "100000", "--every", "1", "--no-serve", "--out", str(out)], tmp_path
    )
    try:
        parts = out / DEMO_RUNS[0][0] / "stats"
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and not (parts.is_dir() and any(parts.glob("*.parquet"))):
            assert proc.poll() is None, proc.communicate()[0]
            time.sleep(0.5)
        assert any(parts.glob("*.parquet")), "no part written in time"
        proc.send_signal(signal.SIGINT)
        text, _ = proc.communicate(timeout=120)
    finally:
        _reap(proc)
    assert proc.returncode == 130, text
    assert "interrupted" in text and str(out) in text
    assert "Traceback" not in text
    reader = ss.open_run(out / DEMO_RUNS[0][0])
    assert reader.status == "closed"  # closed, so flushed
    assert len(reader.steps) >= 1
    # every recorded step is whole: each has a row for every measured op
    counts = reader.stats("rms").groupby("step")["op"].nunique()
    assert counts.nunique() == 1
    assert not (out / DEMO_RUNS[1][0]).exists()  # the second run never started


def test_bad_options_fail_before_training(tmp_path, capsys):
    assert main(["demo", "--steps", "0", "--no-serve", "--out", str(tmp_path / "d")]) == 2
    assert "--steps must be a positive integer" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert main(["demo", "--no-serve", "--out", str(tmp_path / "file")]) == 2
    assert "is a file" in capsys.readouterr().err
    with socket.socket() as sock:  # a port in use
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert main(["demo", "--port", str(port), "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err and "--no-serve" in err
    assert not (tmp_path / "d").exists() and not (tmp_path / "p").exists()


def test_demo_folder_is_new_each_time(tmp_path, monkeypatch):
    import datetime as dt

    monkeypatch.chdir(tmp_path)
    now = dt.datetime(2026, 1, 2, 3, 4, 5)
    first = demo_folder(None, now)
    assert first == Path("runs/demo/20260102-030405")
    first.mkdir(parents=True)
    assert demo_folder(None, now) == Path("runs/demo/20260102-030405-2")
    (tmp_path / "x" / "fp8").mkdir(parents=True)
    with pytest.raises(DemoError, match="already holds fp8"):
        demo_folder(str(tmp_path / "x"))
