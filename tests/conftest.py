"""Shared test fixtures: one headless Debian chromium per test process (Playwright allows
one `sync_playwright()` per process), and a free local port.

JAX's persistent compilation cache is on for the whole session, in the user's cache
directory (``~/.cache/scalescope/jax-cache``, beside the native probe kernel the probe
builds once per machine): the xdist workers, the subprocesses the tests start (CLI,
demo, writers, notebook kernels: they inherit the environment) and later runs on the same
machine, from any clone, reuse the compiled XLA programs of each other (the same step
compiled by two tests compiles once). JAX keys each entry by the program's HLO and the
jax/jaxlib versions, so a changed step compiles anew; at the start of a run the cache is
cut to `JAX_CACHE_MAX_BYTES`, least recently used entries first."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import warnings
from pathlib import Path

import pytest

#: Programs that take longer than this to compile are written to the cache: all of them.
#: The eager per-primitive programs compile in 10-200 ms each, and every subprocess (the
#: CLI, the demo, notebook kernels) compiled its few hundred anew: cached, test_demo.py
#: and test_train.py took 351 s instead of 369 s on an empty cache (2-core VM), for
#: 0.9 MB more of it (188 more entries).
JAX_CACHE_MIN_COMPILE_S = "0"


#: Upper bound of the cache on disk; a whole test run writes about 100 MB.
JAX_CACHE_MAX_BYTES = 2 * 2**30

#: XLA flags of the test run (and of every subprocess it starts): no LLVM optimisation of
#: the generated CPU code. The tests' programs are small and run a few times each, so
#: their compile time is what costs: the demo's scalified FP8 GPT recording step compiles
#: in 27 s instead of 36 s (2-core VM). The HLO, and so what is computed, is the same.
XLA_TEST_FLAGS = "--xla_backend_optimization_level=0"

#: Flags added when this jaxlib's XLA knows them (XLA aborts on an unknown flag, and a
#: newer jaxlib may drop one): XLA's elemental CPU code generators instead of its MLIR
#: fusion emitters. They compile a small program in about half the time (the eager
#: per-primitive programs: 18 ms instead of 35 ms each) and the tests' scalified GPT steps
#: in ~25 % less; the cold suite went from 19.8 to 15.3 min (docs/benchmarks.md, "The
#: test suite on a fresh machine"). Their code is slower, which the tests' tiny models do
#: not feel, and fuses differently, so float32 results may differ in the last bits from
#: the default emitters' (what is computed is the same program). They round float32 to
#: E2M1 wrongly just above a tie (5.0002 to 4), which is why the probe rounds E2M1 in
#: arithmetic (`recipe_kernel._cast`), and abort on FP6, which scalescope does not use.
OPTIONAL_XLA_TEST_FLAGS = ("--xla_cpu_use_fusion_emitters=false",)


#: JAX's warning that a persistent-cache entry could not be read or written (another
#: process was writing it at that moment: the cache takes no lock); it compiles instead.
JAX_CACHE_WARNING = r"Error (reading|writing) persistent compilation cache"


def fail_on_warnings() -> None:
    """Inside ``warnings.catch_warnings()``: every warning an error, except
    `JAX_CACHE_WARNING`, which says nothing about the code under test."""
    warnings.simplefilter("error")
    warnings.filterwarnings("ignore", message=JAX_CACHE_WARNING)


def known_xla_flags(flags: tuple[str, ...]) -> list[str]:
    """The ``flags`` that this jaxlib's XLA accepts: each is tried in a short CPU-only
    subprocess (~0.7 s), since an unknown one aborts the process that starts a backend."""
    known = []
    for flag in flags:
        env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
        probe = [sys.executable, "-c", "import jax; jax.devices()"]
        try:
            ok = subprocess.run(probe, env=env, capture_output=True, timeout=120).returncode == 0
        except subprocess.TimeoutExpired:
            ok = False
        if ok:
            known.append(flag)
        else:
            print(f"conftest: XLA does not take {flag}; the tests run without it", file=sys.stderr)
    return known


def xla_flags_with(flag: str) -> str:
    """The run's XLA flags (`XLA_TEST_FLAGS`) plus ``flag``, for a subprocess that needs
    one more (a number of host devices)."""
    return f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()


def jax_cache_dir() -> Path:
    """The tests' JAX compilation cache: ``$XDG_CACHE_HOME/scalescope/jax-cache`` (by
    default under ``~/.cache``), or the temporary directory where no home is writable."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    cache = base / "scalescope" / "jax-cache"
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError:
        cache = Path(tempfile.gettempdir()) / "scalescope-jax-cache"
    return cache


def prune_cache(cache: Path, max_bytes: int) -> None:
    """Delete the least recently used entries of ``cache`` until it holds ``max_bytes``
    or less (JAX's own limit needs the filelock package)."""
    entries = []
    for path in cache.iterdir():
        try:
            st = path.stat()
        except OSError:
            continue
        if path.is_file():
            entries.append((max(st.st_atime, st.st_mtime), st.st_size, path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= max_bytes:
            break
        path.unlink(missing_ok=True)
        total -= size


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` imported as a module (registered in ``sys.modules``:
    dataclasses look their module up while the class is built)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


#: The folder of the opt-in compile log (``SCALESCOPE_COMPILE_LOG=FOLDER make test``).
COMPILE_LOG = Path(__file__).resolve().parent / "compile_log"


def compile_log(folder: str | None) -> None:
    """With ``SCALESCOPE_COMPILE_LOG=FOLDER``: this process and every one it starts log
    their JAX traces, lowerings and compiles into FOLDER, each with its test
    (tests/compile_log/sitecustomize.py; ``benchmarks/compile_profile.py FOLDER`` sums
    them up). Off, it does nothing."""
    if not folder:
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(COMPILE_LOG) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(COMPILE_LOG), *paths])
    spec = importlib.util.spec_from_file_location("_compile_log", COMPILE_LOG / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.install(folder)


def pytest_configure(config: pytest.Config) -> None:
    """Turn the persistent compilation cache on, for this process (jax.config, before
    anything compiles) and for every subprocess (environment), unless the caller chose
    a cache directory already; and the compile log when asked for (`compile_log`)."""
    compile_log(os.environ.get("SCALESCOPE_COMPILE_LOG"))
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = str(jax_cache_dir())
        if "PYTEST_XDIST_WORKER" not in os.environ:  # once per run, before workers start
            prune_cache(Path(os.environ["JAX_COMPILATION_CACHE_DIR"]), JAX_CACHE_MAX_BYTES)
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags:  # before any backend starts
        # the controller (or a plain run) chooses; xdist workers inherit its choice
        extra = " ".join(known_xla_flags(OPTIONAL_XLA_TEST_FLAGS))
        os.environ["XLA_FLAGS"] = f"{flags} {XLA_TEST_FLAGS} {extra}".strip()
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", JAX_CACHE_MIN_COMPILE_S)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    import jax

    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update(
        "jax_persistent_cache_min_compile_time_secs",
        float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
    )
    jax.config.update(
        "jax_persistent_cache_min_entry_size_bytes",
        int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]),
    )


#: Test modules, slowest first: their summed test time in a cold run (clean clone, empty
#: caches, 2-core VM, `--durations=0`; docs/benchmarks.md). `make test` gives whole modules
#: to the xdist workers (--dist loadfile) in collection order (--no-loadscope-reorder), each
#: to the first worker free: longest first, the many quick ones last, both workers end
#: within seconds of each other (a simulation of that run: 1 211 s against 1 237 s in the
#: previous order). Modules not listed (under 10 s each) run after these.
SLOWEST_MODULES = (
    "test_benchmarks_scripts.py",
    "test_other_models.py",
    "test_demo.py",
    "test_notebooks.py",
    "test_dashboard.py",
    "test_rules.py",
    "test_verdict_runs.py",
    "test_gpu_suite.py",
    "test_engine_models.py",
    "test_collectives.py",
    "test_verify.py",
    "test_report.py",
    "test_train.py",
    "test_exactness.py",
    "test_sample_models.py",
    "test_probe_models.py",
    "test_recipes.py",
    "test_unit_ops.py",
    "test_advisor_recorded.py",
    "test_emulate.py",
    "test_unit_scale.py",
    "test_probe_kernels.py",
    "test_store.py",
    "test_faults.py",
    "test_unit_calibrate.py",
    "test_probe.py",
    "test_budget.py",
    "test_scalify.py",
    "test_flight.py",
    "test_names.py",
    "test_multiprocess.py",
    "test_unit_nn.py",
    "test_packaging.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Slowest modules first (a stable sort: each module's tests keep their order)."""
    rank = {name: i for i, name in enumerate(SLOWEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="module", autouse=True)
def _fresh_jax_caches_per_module():
    """JAX's in-memory caches (traces, lowerings, executables) emptied after each module.

    A worker runs a dozen modules; what they leave in JAX's caches makes tracing and
    lowering in later modules slower (test_collectives' shard_map tests after
    test_other_models in one process, warm compilation cache: 10.3 and 9.1 s, 8.4 and
    7.2 s with the caches cleared between the modules, 7.1 and 6.5 s alone). A test
    module shares its programs through its own fixtures; across modules the persistent
    compilation cache serves them."""
    yield
    jax = sys.modules.get("jax")
    if jax is not None:
        jax.clear_caches()
        gc.collect()


CHROMIUM = "/usr/bin/chromium"
CHROME_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def node_binary() -> str:
    """Node.js, which runs the BokehJS formatter code of some tests outside a browser
    (Debian's ``nodejs``; `.ci/run` installs it): missing is a failure, not a skip."""
    import shutil

    node = shutil.which("node") or shutil.which("nodejs")
    if node is None:
        pytest.fail("node missing: apt-get install -y nodejs (.ci/run does)")
    return node


def cli_process(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m scalescope.cli *args`` in a process of its own, as a user runs it
    (exit status, stdout and stderr as text)."""
    return subprocess.run(
        [sys.executable, "-m", "scalescope.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def browser():
    """Debian's chromium, headless, driven by Playwright (never `playwright install`)."""
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} missing: apt-get install -y chromium (.ci/run does)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROME_ARGS)
        yield b
        b.close()


def watch_offline(page, allowed: tuple[str, ...]) -> tuple[list[str], list[str], list[str]]:
    """Abort every request of ``page`` whose URL does not start with one of ``allowed``
    and collect console and page errors. Returns ``(blocked, errors, requests)`` lists
    that fill in as the page runs: "works offline" means both of the first two stay empty."""
    blocked: list[str] = []
    errors: list[str] = []
    requests: list[str] = []

    def route(r) -> None:
        requests.append(r.request.url)
        if r.request.url.startswith(allowed):
            r.continue_()
        else:
            blocked.append(r.request.url)
            r.abort()

    page.route("**/*", route)

    def console(m) -> None:
        if m.type != "error":
            return
        url = (m.location or {}).get("url", "")
        # Chromium may look for /favicon.ico next to a file: page on its own; the page
        # itself never asks for it, so that miss says nothing about the page.
        if url.startswith("file:") and url.endswith("/favicon.ico"):
            return
        errors.append(f"{m.text} ({url})" if url else m.text)

    page.on("console", console)
    page.on("pageerror", lambda e: errors.append(str(e)))
    return blocked, errors, requests


@contextlib.contextmanager
def served_dashboard(path: Path):
    """``scalescope serve PATH`` on a free port: yields its URL and a function giving
    what the server printed so far (read in a thread, so a chatty server never blocks)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "scalescope.cli", "serve", str(path), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.time() + 90
        while True:
            if proc.poll() is not None:
                reader.join(5)
                raise AssertionError(f"serve exited {proc.returncode}: {''.join(lines)}")
            try:
                if urllib.request.urlopen(url, timeout=5).status == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline:
                raise AssertionError("the dashboard did not answer within 90 s")
            time.sleep(0.3)
        yield url, lambda: "".join(lines)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        reader.join(5)
