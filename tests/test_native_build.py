"""The native kernel's loader: a build that fails, hangs or loads a broken library falls
back to the pure-XLA kernel with one warning that says why; ``=native`` makes it an
error; a ``-march=native`` build is cached per CPU."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from scalescope.probe import native


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A loader that has not tried yet (this process's own state is restored after),
    building into an empty cache."""
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("SCALESCOPE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SCALESCOPE_PROBE_KERNEL", raising=False)
    return tmp_path


def _script(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_failing_compiler_falls_back_with_one_warning(fresh, monkeypatch, caplog):
    monkeypatch.setenv("CXX", _script(fresh / "cxx", 'echo "cc1plus: fatal error" >&2; exit 1'))
    with caplog.at_level(logging.WARNING, logger="scalescope"):
        assert native.available() is False
        assert native.available() is False  # decided once
        assert native.use_native() is False
    (message,) = _warnings(caplog)
    assert "pure-XLA kernel" in message and "cc1plus: fatal error" in message
    assert not list((fresh / "cache" / "native").glob("*.so"))  # nothing half-written
    with pytest.raises(native.NativeBuildError):  # the traced entry points refuse
        native.value_raw(jnp.ones(4), (), None)


def test_hanging_compiler_times_out(fresh, monkeypatch, caplog):
    monkeypatch.setenv("CXX", _script(fresh / "cxx", "sleep 30"))
    monkeypatch.setenv("SCALESCOPE_NATIVE_TIMEOUT", "0.5")
    with caplog.at_level(logging.WARNING, logger="scalescope"):
        assert native.available() is False
    (message,) = _warnings(caplog)
    assert "timed out after 0.5 s" in message


def test_bad_timeout_is_named(fresh, monkeypatch):
    monkeypatch.setenv("CXX", _script(fresh / "cxx", "exit 1"))
    monkeypatch.setenv("SCALESCOPE_NATIVE_TIMEOUT", "soon")
    monkeypatch.setenv("SCALESCOPE_PROBE_KERNEL", "native")
    with pytest.raises(native.NativeBuildError, match="SCALESCOPE_NATIVE_TIMEOUT='soon'"):
        native.available()


def test_library_without_the_kernels_falls_back(fresh, monkeypatch, caplog):
    """A library that loads but lacks a symbol (a stale or foreign file in the cache) is
    an AttributeError from ctypes: the loader falls back instead of crashing."""

    class Empty:
        def __getattr__(self, name):
            raise AttributeError(f"undefined symbol: {name}")

    monkeypatch.setattr(native, "_build", lambda cxx: fresh / "lib.so")
    monkeypatch.setattr(native.ctypes.cdll, "LoadLibrary", lambda path: Empty())
    with caplog.at_level(logging.WARNING, logger="scalescope"):
        assert native.available() is False
    (message,) = _warnings(caplog)
    assert "undefined symbol: ScalescopeStats" in message


def test_forced_native_turns_any_failure_into_a_build_error(fresh, monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("FFI target registration failed")

    monkeypatch.setenv("SCALESCOPE_PROBE_KERNEL", "native")
    monkeypatch.setattr(native, "_build", lambda cxx: fresh / "lib.so")
    symbols = ("ScalescopeStats", "ScalescopeStatsAsync", "ScalescopeSame")
    symbols += ("ScalescopeRecipes", "ScalescopeRecipesAsync")
    lib = SimpleNamespace(**dict.fromkeys(symbols))
    monkeypatch.setattr(native.ctypes.cdll, "LoadLibrary", lambda path: lib)
    monkeypatch.setattr(native.jax.ffi, "pycapsule", lambda fn: fn)
    monkeypatch.setattr(native.jax.ffi, "register_ffi_target", refuse)
    with pytest.raises(native.NativeBuildError, match="registration failed"):
        native.available()


def test_native_build_is_cached_per_cpu(fresh, monkeypatch):
    native_marches = (("-march=native",), ())
    here = native.library_path("/usr/bin/g++", native_marches)
    assert here == native.library_path("/usr/bin/g++", native_marches)  # stable
    monkeypatch.setattr(native, "cpu_signature", lambda: "flags=sse2")  # an older CPU
    assert native.library_path("/usr/bin/g++", native_marches) != here
    portable = native.library_path("/usr/bin/g++", ((),))
    monkeypatch.setattr(native, "cpu_signature", lambda: "flags=avx512f sse2")
    assert native.library_path("/usr/bin/g++", ((),)) == portable  # runs on any CPU


def test_cpu_signature_holds_the_features():
    sig = native.cpu_signature()
    assert sig
    if os.path.exists("/proc/cpuinfo") and "flags" in Path("/proc/cpuinfo").read_text():
        flags = next(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
        assert all(f in sig for f in flags.split(":", 1)[1].split()[:5])


def test_fallback_statistics_still_compute(fresh, monkeypatch):
    """With the native kernel refused, the probe's statistics come from the XLA kernel
    and agree with NumPy."""
    from scalescope.probe import kernel

    monkeypatch.setenv("CXX", _script(fresh / "cxx", "exit 1"))
    assert native.available() is False
    x = np.linspace(-3.0, 5.0, 1000, dtype=np.float32)
    spec = kernel.StatSpec((), histograms=False)
    stats = kernel.finalize(kernel.values_raw([(jnp.asarray(x), None)], spec), spec)
    assert float(np.asarray(stats["absmax"])[0]) == 5.0
    rms = np.sqrt(np.mean(x.astype(np.float64) ** 2))
    np.testing.assert_allclose(float(np.asarray(stats["rms"])[0]), rms, rtol=1e-5)
