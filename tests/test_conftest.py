"""The test suite's own machinery: the compilation cache it shares between runs, and the
opt-in compile log (`SCALESCOPE_COMPILE_LOG`) that says where a run's time goes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import COMPILE_LOG, jax_cache_dir, load_benchmark, prune_cache


def test_prune_cache_drops_least_recently_used_entries_first(tmp_path):
    for i, name in enumerate(["old", "mid", "new"]):
        path = tmp_path / name
        path.write_bytes(b"x" * 100)
        os.utime(path, (1000 + i, 1000 + i))
    prune_cache(tmp_path, 250)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mid", "new"]
    prune_cache(tmp_path, 1000)  # within the bound: nothing goes
    assert len(list(tmp_path.iterdir())) == 2
    prune_cache(tmp_path, 0)
    assert list(tmp_path.iterdir()) == []


def test_cache_dir_follows_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert jax_cache_dir() == tmp_path / "scalescope" / "jax-cache"
    assert jax_cache_dir().is_dir()


def _python(code: str, env: dict[str, str]) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_the_compile_log_follows_subprocesses_and_sums_up(tmp_path, capsys):
    log = tmp_path / "log"
    skip = ("SCALESCOPE_COMPILE_LOG", "_SCALESCOPE_COMPILE_LOG_PID")  # a logged run's own
    env = {k: v for k, v in os.environ.items() if k not in skip}
    env.update(PYTHONPATH=str(COMPILE_LOG), JAX_PLATFORMS="cpu")
    env["PYTEST_CURRENT_TEST"] = "tests/test_x.py::test_y (call)"
    # off (no variable): the hook is inert, JAX is not imported by it
    assert _python("import sys; print('jax' in sys.modules)", env).strip() == "False"
    env["SCALESCOPE_COMPILE_LOG"] = str(log)
    log.mkdir()
    # on, in a process that never imports JAX: nothing written, JAX still not imported
    assert _python("import sys; print('jax' in sys.modules)", env).strip() == "False"
    assert not list(log.iterdir())
    # on, in a process that compiles: each compile logged with the test that caused it
    code = "import jax, jax.numpy as jnp; jax.jit(lambda x: jnp.sin(x) * 3.0)(jnp.ones(7))"
    _python(code, env)
    (path,) = log.glob("*.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    mine = [r for r in rows if r.get("fun") == "jit(<lambda>)"]
    assert {r["event"] for r in mine} >= {"backend_compile_duration"}
    assert all(r["test"] == env["PYTEST_CURRENT_TEST"] and r["seconds"] >= 0 for r in mine)
    profile = load_benchmark("compile_profile")
    assert profile.main([str(log), "--top", "5"]) == 0
    out = capsys.readouterr().out
    assert "## By test\n" in out and "tests/test_x.py::test_y" in out
    assert "jit(<lambda>)" in out
    # a torn last line (a killed process) is skipped, not fatal
    with path.open("a") as f:
        f.write('{"event": "backend_compile_dur')
    assert profile.main([str(log)]) == 0
    assert "unreadable line skipped" in capsys.readouterr().err
    assert profile.main([str(tmp_path)]) == 2  # a folder without a log
    # a program two processes compile (the cache never written): listed by its cache key
    twice = tmp_path / "twice"
    twice.mkdir()
    env2 = dict(env, SCALESCOPE_COMPILE_LOG=str(twice))
    env2.update(JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"),
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="1e9")  # fmt: skip
    for _ in range(2):
        _python(code, env2)
    rows = profile.read_log(twice)
    compiles = [r for r in rows if r["event"] == "backend_compile_duration"]
    keys = [r["key"] for r in compiles if r["fun"] == "jit(<lambda>)"]
    assert len(keys) == 2 and keys[0] and keys[0] == keys[1]
    assert keys[0] in [k for k, _ in profile.compiled_twice(rows)]
    assert profile.main([str(twice)]) == 0
    assert "## Compiled more than once" in capsys.readouterr().out
    # a log that cannot be written says so once and lets the process run
    env["SCALESCOPE_COMPILE_LOG"] = str(path)  # a file, not a folder
    proc = subprocess.run(
        [sys.executable, "-c", code + "; print('ran')"], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ran", proc.stderr[-2000:]
    assert proc.stderr.count("compile log: writing") == 1


def test_the_compile_profile_pairs_each_key_with_its_threads_compile(tmp_path):
    """A budgeted run compiles its statistics program in a thread of its own while the
    step compiles in the main one: each cache key or hit goes with its thread's compile."""
    rows = [
        {"event": "cache_miss", "key": "k-main", "thread": 1},
        {"event": "cache_miss", "key": "k-bg", "thread": 2},
        {"event": "cache_hit", "thread": 2},
        {"event": "backend_compile_duration", "fun": "jit(a)", "seconds": 2.0, "thread": 1},
        {"event": "backend_compile_duration", "fun": "jit(b)", "seconds": 0.1, "thread": 2},
        {"event": "cache_miss", "key": "k-lost", "thread": 1},
        {"event": "jaxpr_trace_duration", "fun": "c", "seconds": 0.1, "thread": 1},
        {"event": "backend_compile_duration", "fun": "jit(c)", "seconds": 1.0, "thread": 1},
    ]
    (tmp_path / "1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    profile = load_benchmark("compile_profile")
    compiles = [r for r in profile.read_log(tmp_path) if r["event"] == "backend_compile_duration"]
    assert [(r["fun"], r["hit"], r["key"]) for r in compiles] == [
        ("jit(a)", False, "k-main"),
        ("jit(b)", True, None),
        ("jit(c)", False, None),  # its key was not the one logged before another event
    ]
