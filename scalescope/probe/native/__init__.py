"""The probe's native CPU kernel: statistics of one value in one read (XLA FFI).

XLA on CPU compiles the per-element rounding statistics into scalar loops (compares and
selects keep LLVM from vectorising them) and takes minutes to compile one reduction per
value. `stats.cc` does the same work in a vectorised loop per value, as a custom call
XLA does not need to compile. It is built once per machine with the system C++ compiler
against the XLA FFI headers that jaxlib ships, and cached (``SCALESCOPE_CACHE`` or
``~/.cache/scalescope``). Where no compiler is found the probe uses its pure-XLA kernel,
as it does on GPUs (where XLA's fused reductions are bandwidth-bound).

``SCALESCOPE_PROBE_KERNEL=xla`` forces the pure-XLA kernel; ``=native`` makes a failed
build an error instead of a warning. The build tries ``-march=native`` first (the CPU's
vector width) and then no ``-march``; ``SCALESCOPE_NATIVE_MARCH`` names another target
(``haswell``) or ``none`` for only the portable build (the tests use it). A
``-march=native`` library is cached under a key that holds the CPU's model and feature
flags, so a shared home or a prebuilt image never loads it on a CPU that lacks an
instruction it uses. The compiler gets ``SCALESCOPE_NATIVE_TIMEOUT`` seconds (300). Any
failure to build, load or register the kernel falls back to the pure-XLA kernel with one
warning per process that says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ...core.formats import Format
from ...core.recipes import Recipe

log = logging.getLogger("scalescope")

TARGET = "scalescope_stats"
ASYNC_TARGET = "scalescope_stats_async"
SAME_TARGET = "scalescope_same"
RECIPES_TARGET = "scalescope_recipes"
RECIPES_ASYNC_TARGET = "scalescope_recipes_async"
_HERE = Path(__file__).parent
SOURCES = (_HERE / "stats.cc", _HERE / "recipes.cc")
HEADERS = (_HERE / "common.h",)
_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-w")
_NATIVE_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(jnp.bfloat16))
_lock = threading.Lock()
_state: dict[str, object] = {}


class NativeBuildError(RuntimeError):
    """The native kernel could not be built (no compiler, or the compiler failed)."""


def _cache_dir() -> Path:
    root = os.environ.get("SCALESCOPE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "scalescope"
    )
    return Path(root) / "native"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _marches() -> tuple[tuple[str, ...], ...]:
    """The ``-march`` flags to try, in order (the last: none, a portable build)."""
    march = os.environ.get("SCALESCOPE_NATIVE_MARCH", "native").strip()
    if march in ("", "none"):
        return ((),)
    return ((f"-march={march}",), ())


def cpu_signature() -> str:
    """The CPU's model and instruction-set flags (what ``-march=native`` compiles for):
    part of a native build's cache key."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    wanted = ("model name", "flags", "Features", "CPU part", "isa")
    fields = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        name = name.strip()
        if name in wanted and name not in fields:  # the first core's: all are alike here
            fields[name] = " ".join(sorted(value.split()))
    return "|".join(f"{k}={fields[k]}" for k in sorted(fields)) or platform.machine()


def library_path(cxx: str, marches: tuple[tuple[str, ...], ...]) -> Path:
    """Where the kernel built by ``cxx`` for ``marches`` is cached: keyed by the sources,
    jax, the compiler, the machine and the targets, and the CPU's features for a
    ``-march=native`` build."""
    src = b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
    parts = [src, jax.__version__.encode(), cxx.encode(), os.uname().machine.encode()]
    parts.append(repr(marches).encode())
    if any("-march=native" in arch for arch in marches):
        parts.append(cpu_signature().encode())
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    return _cache_dir() / f"libscalescope_stats-{key}.so"


def _timeout() -> float:
    raw = os.environ.get("SCALESCOPE_NATIVE_TIMEOUT", "300")
    try:
        return float(raw)
    except ValueError:
        raise NativeBuildError(f"SCALESCOPE_NATIVE_TIMEOUT={raw!r} is not a number") from None


def _build(cxx: str) -> Path:
    """Compile the kernels into the cache (once per source, jaxlib, machine and target)."""
    include = jax.ffi.include_dir()
    marches = _marches()
    out = library_path(cxx, marches)
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    timeout = _timeout()
    # -march=native first (AVX2 or AVX-512 where the CPU has them); plain -O3 if the
    # compiler refuses.
    for arch in marches:
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            tmp_out = Path(tmp) / out.name
            cmd = [cxx, *_FLAGS, *arch, f"-I{include}", f"-I{_HERE}", *map(str, SOURCES)]
            cmd += ["-o", str(tmp_out)]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            except subprocess.TimeoutExpired:
                errors.append(f"{' '.join(cmd)}\ntimed out after {timeout:g} s")
                continue
            if proc.returncode == 0:
                os.replace(tmp_out, out)  # atomic: a concurrent build finds a whole file
                return out
            errors.append(f"{' '.join(cmd)}\n{proc.stderr[-2000:]}")
    raise NativeBuildError("building the native probe kernel failed:\n" + "\n".join(errors))


def _load(cxx: str) -> ctypes.CDLL:
    """Build (or find) the library, load it and register its FFI targets."""
    lib = ctypes.cdll.LoadLibrary(str(_build(cxx)))
    for target, symbol in (
        (TARGET, "ScalescopeStats"),
        (ASYNC_TARGET, "ScalescopeStatsAsync"),
        (SAME_TARGET, "ScalescopeSame"),
        (RECIPES_TARGET, "ScalescopeRecipes"),
        (RECIPES_ASYNC_TARGET, "ScalescopeRecipesAsync"),
    ):
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return lib


def available() -> bool:
    """Build (once) and register the CPU kernel; False where it cannot be used."""
    mode = os.environ.get("SCALESCOPE_PROBE_KERNEL", "auto")
    if mode == "xla":
        return False
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        try:
            cxx = _compiler()
            if cxx is None:
                raise NativeBuildError("no C++ compiler (g++, c++ or clang++) on PATH")
            _state["lib"] = _load(cxx)
            _state["ok"] = True
        except Exception as err:  # any failure to build, load or register: same remedy
            if mode == "native":
                if isinstance(err, NativeBuildError):
                    raise
                raise NativeBuildError(f"the native probe kernel failed to load: {err!r}") from err
            log.warning(
                "scalescope: the native CPU probe kernel is not available, so statistics "
                "use the pure-XLA kernel (slower to compile and run on CPU): %s",
                err,
            )
            _state["ok"] = False
        return bool(_state["ok"])


def clock() -> tuple[float, int]:
    """(seconds spent inside the native kernel, calls) since it was loaded: benchmarks
    compare it with the step time to see what the kernel itself costs."""
    lib = _state.get("lib")
    if lib is None:
        return 0.0, 0
    lib.scalescope_stats_nanos.restype = ctypes.c_uint64
    lib.scalescope_stats_calls.restype = ctypes.c_uint64
    return lib.scalescope_stats_nanos() * 1e-9, int(lib.scalescope_stats_calls())


def recipe_lanes() -> int:
    """Float32 lanes per vector of the loaded recipe kernel: 16 (AVX-512), 8 (AVX), 4
    (a portable build); 0 where none is loaded."""
    lib = _state.get("lib")
    return int(lib.scalescope_recipes_lanes()) if lib is not None else 0


def use_native() -> bool:
    """Whether traced statistics should call the native kernel: on CPU, when built."""
    return jax.default_backend() == "cpu" and available()


def _byte_float(dtype: np.dtype) -> bool:
    """An 8-bit float type: the kernel widens it through a 256-entry table."""
    return dtype.itemsize == 1 and jax.dtypes.issubdtype(dtype, np.floating)


def _lut(dtype: Any) -> np.ndarray:
    """The float32 value of each of the 256 bit patterns of an 8-bit float type (empty
    for other types): how the kernels widen 8-bit values."""
    dtype = np.dtype(dtype)
    if not _byte_float(dtype):
        return np.zeros((0,), np.float32)
    return np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)


def _attrs(data: jax.Array, formats: Sequence[Format], hist_lo: int, hist_hi: int) -> dict:
    return dict(
        lut=_lut(data.dtype),
        mantissa=np.array([f.mantissa_bits for f in formats], np.int64),
        fmax=np.array([f.max for f in formats], np.float32),
        min_normal=np.array([f.min_normal for f in formats], np.float32),
        min_subnormal=np.array([f.min_subnormal for f in formats], np.float32),
        hist_lo=np.int64(hist_lo),
        hist_hi=np.int64(hist_hi),
        threads=np.int64(os.cpu_count() or 1),
    )


def _raw_shapes(formats: Sequence[Format], hist_range: tuple[int, int] | None):
    nf = len(formats)
    lo, hi = hist_range if hist_range is not None else (0, -1)
    n_hist = hi - lo + 5 if hist_range is not None else 0
    shapes = (
        jax.ShapeDtypeStruct((7 + nf,), jnp.float32),
        jax.ShapeDtypeStruct((3 + 3 * nf + n_hist,), jnp.int32),
    )
    return shapes, lo, hi


def value_raw(
    data: jax.Array, formats: Sequence[Format], hist_range: tuple[int, int] | None
) -> tuple[jax.Array, jax.Array]:
    """Raw statistics of one value: ``(floats, ints)`` where floats are ``[sum, sumsq,
    m2, err2 per format..., absmax, max, -min, -absmin]`` (sums in units of the abs-max's
    power of two; the last three over finite elements, -inf when none) and ints
    are ``[n, zero, nonfinite, (under, sub, over) per format..., histogram...]``."""
    if not available():
        raise NativeBuildError("the native probe kernel is not available on this machine")
    shapes, lo, hi = _raw_shapes(formats, hist_range)
    data = jnp.ravel(data)
    if not passes_through(data.dtype):
        data = data.astype(jnp.float32)
    call = jax.ffi.ffi_call(TARGET, shapes, vmap_method="sequential")
    return call(data, **_attrs(data, formats, lo, hi))


def passes_through(dtype: Any) -> bool:
    """Whether the kernel reads values of this dtype as they are (others are widened to
    float32 first; `measure_through` refuses them)."""
    dtype = np.dtype(dtype)
    return _byte_float(dtype) or dtype in _NATIVE_DTYPES


def measure_through(
    data: jax.Array, formats: Sequence[Format], hist_range: tuple[int, int] | None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(data', floats, ints)``: ``data`` handed back in its own buffer by a custom call,
    and `value_raw`'s statistics of it, computed asynchronously on XLA's thread pool.

    Consumers that use ``data'`` read the value from memory instead of XLA recomputing it
    inside each of their fusions (which it does for values it had fused away), and they
    do not wait for the statistics: only what reads ``floats``/``ints`` does, so the
    kernel runs beside the program rather than on its critical path."""
    if not available():
        raise NativeBuildError("the native probe kernel is not available on this machine")
    if not passes_through(data.dtype):
        raise TypeError(f"measure_through: unsupported dtype {data.dtype}")
    shapes, lo, hi = _raw_shapes(formats, hist_range)
    flat = jnp.ravel(data)
    same = jax.ffi.ffi_call(
        SAME_TARGET,
        jax.ShapeDtypeStruct(flat.shape, flat.dtype),
        vmap_method="sequential",
        input_output_aliases={0: 0},
    )(flat)
    stats = jax.ffi.ffi_call(ASYNC_TARGET, shapes, vmap_method="sequential")
    floats, ints = stats(same, **_attrs(flat, formats, lo, hi))
    return same.reshape(data.shape), floats, ints


def recipe_call(
    data: jax.Array,
    recipes: Sequence[Recipe],
    axes: Sequence[int] | None,
    *,
    asynchronous: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """The kernel's raw row of one value under ``recipes``: ``(floats, ints)``, per
    recipe three floats (the sum, then two maxima) and four counts; `recipe_columns`
    splits rows into `recipe_kernel.recipe_group_raw`'s columns (``asynchronous``: on
    XLA's thread pool, waited for only by the readers of the results). Split once for
    all values a scope measures, not per value: a slice per value is a kernel XLA
    compiles of its own (a tiny GPT: 1 400 of them, 8 s of its 19 s compile)."""
    if not available():
        raise NativeBuildError("the native probe kernel is not available on this machine")
    from ..recipe_kernel import block_view

    x = block_view(data, axes)
    if not passes_through(x.dtype):
        x = x.astype(jnp.float32)
    n = len(recipes)
    shapes = (
        jax.ShapeDtypeStruct((3 * n,), jnp.float32),
        jax.ShapeDtypeStruct((4 * n,), jnp.int32),
    )
    target = RECIPES_ASYNC_TARGET if asynchronous else RECIPES_TARGET
    floats, ints = jax.ffi.ffi_call(target, shapes, vmap_method="sequential")(
        x,
        lut=_lut(x.dtype),
        rule=np.array([r.rule_code for r in recipes], np.int64),
        block=np.array([r.block for r in recipes], np.int64),
        rows=np.array([r.rows for r in recipes], np.int64),
        mantissa=np.array([r.element.mantissa_bits for r in recipes], np.int64),
        emax=np.array([r.emax for r in recipes], np.int64),
        fmax=np.array([r.element.max for r in recipes], np.float32),
        min_normal=np.array([r.element.min_normal for r in recipes], np.float32),
        min_subnormal=np.array([r.element.min_subnormal for r in recipes], np.float32),
    )
    return floats, ints


def recipe_columns(
    floats: jax.Array, ints: jax.Array, n: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(sums, counts, maxima)`` of raw rows of `recipe_call` (``[..., 3n]`` floats,
    ``[..., 4n]`` ints) for ``n`` recipes: ``[..., n]``, ``[..., 4n]``, ``[..., 2n]``."""
    lead = floats.shape[:-1]
    f = floats.reshape(*lead, n, 3)
    return f[..., 0], ints, f[..., 1:].reshape(*lead, 2 * n)


def recipe_raw(
    data: jax.Array,
    recipes: Sequence[Recipe],
    axes: Sequence[int] | None,
    *,
    asynchronous: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(sums, counts, maxima)`` of one value under ``recipes``, as
    `recipe_kernel.recipe_group_raw` computes them per value, by the native kernel."""
    raw = recipe_call(data, recipes, axes, asynchronous=asynchronous)
    return recipe_columns(*raw, len(recipes))
