"""Where a test run's time goes to JAX: loaded by every Python process of the run when
``SCALESCOPE_COMPILE_LOG`` names a folder (tests/conftest.py then puts this folder on
``PYTHONPATH``, so the CLI, demo, notebook kernels and benchmark scripts the tests start
load it too).

Once the process imports JAX, each trace, lowering and XLA compile (a persistent-cache
hit included, marked as one; a miss with its cache key, so a program compiled twice
shows) is appended to ``FOLDER/<pid>.jsonl`` with the test that caused it
(``PYTEST_CURRENT_TEST``, which subprocesses inherit). Nothing is imported and nothing
changes when the variable is unset. ``benchmarks/compile_profile.py FOLDER``
sums the log up (docs/benchmarks.md, "The test suite on a fresh machine").
"""

from __future__ import annotations

import importlib.abc
import json
import logging
import os
import sys
import threading

ENV = "SCALESCOPE_COMPILE_LOG"
_MARK = "_SCALESCOPE_COMPILE_LOG_PID"  # the process that installed the listener


def install(folder: str) -> None:
    """Log this process's JAX compile events into ``folder`` (once per process)."""
    if os.environ.get(_MARK) == str(os.getpid()):
        return
    os.environ[_MARK] = str(os.getpid())
    import jax.monitoring

    path = os.path.join(folder, f"{os.getpid()}.jsonl")
    argv = " ".join(sys.argv)[:200]

    failed = []

    def write(row: dict) -> None:
        if failed:
            return
        row["test"] = os.environ.get("PYTEST_CURRENT_TEST", "")
        row["thread"] = threading.get_ident()  # a cache miss pairs with its thread's compile
        row["argv"] = argv
        try:
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
        except OSError as err:  # a log must never break the process it watches
            failed.append(err)
            print(f"compile log: writing {path} failed ({err}); not logging", file=sys.stderr)

    def on_duration(event: str, seconds: float, **kw) -> None:
        if event.startswith("/jax/core/compile/"):
            name = event.rsplit("/", 1)[-1]
            write({"event": name, "fun": str(kw.get("fun_name", "")), "seconds": seconds})

    def on_event(event: str, **kw) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            write({"event": "cache_hit"})

    compiler_log = logging.getLogger("jax._src.compiler")
    shown = compiler_log.getEffectiveLevel()

    def misses(record: logging.LogRecord) -> bool:
        """The persistent cache's key of each program compiled, from JAX's own debug log
        (a private logger and message: if they change, the keys are simply not logged).
        Records below the level the logger had are dropped here, so lowering it to DEBUG
        shows nothing more to any handler."""
        msg = record.getMessage()
        if msg.startswith("PERSISTENT COMPILATION CACHE MISS") and " with key " in msg:
            write({"event": "cache_miss", "key": msg.rsplit(" with key ", 1)[1].strip("'")})
        return record.levelno >= shown

    compiler_log.setLevel(logging.DEBUG)
    compiler_log.addFilter(misses)
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)


class _AfterJax(importlib.abc.MetaPathFinder):
    """Installs the listener right after ``import jax`` completes (importing JAX here,
    in every Python process, would slow down the ones that never use it)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def find_spec(self, name, path, target=None):
        if name != "jax":
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec("jax")
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module) -> None:
            run(module)
            try:
                install(self.folder)
            except Exception as err:  # a log must never break the process it watches
                print(f"compile log: not installed ({err})", file=sys.stderr)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get(ENV):
    sys.meta_path.insert(0, _AfterJax(os.environ[ENV]))
