"""Scalify and the probe across devices: collective rules, shard_map, jit shardings.

The multi-device checks run in a subprocess with 8 host devices
(``collectives_check.py``); the rest run here on whatever devices the process has.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import xla_flags_with as _flags
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import scalescope as ss
from scalescope.core.scaled_array import ScaledArray
from scalescope.scalify import has_rule, primitives_in

CHECK = Path(__file__).with_name("collectives_check.py")


def _run_check(*checks: str, **env_vars: str) -> None:
    env = dict(os.environ, XLA_FLAGS=_flags("--xla_force_host_platform_device_count=8"), **env_vars)
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, str(CHECK), *checks],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all collective checks passed" in proc.stdout, proc.stdout


@pytest.mark.slow
def test_collectives_on_8_devices():
    _run_check()


@pytest.mark.slow
def test_probe_inside_shard_map_with_the_xla_kernel():
    """The pure-XLA statistics kernel (the GPU path) inside a shard_map body."""
    _run_check("probe-semantics", SCALESCOPE_PROBE_KERNEL="xla")


def _collectives(x):
    perm = [(0, 0)]
    y = lax.psum(x, "d") + lax.pmean(x, "d") + lax.pmax(x, "d") + lax.pmin(x, "d")
    y = y + lax.ppermute(x, "d", perm) + lax.axis_index("d").astype(x.dtype)
    g = lax.all_gather(x, "d", tiled=True)
    s = lax.psum_scatter(x, "d", tiled=True)
    a = lax.all_to_all(x, "d", 0, 0, tiled=True)
    return y, g, s, a


def test_every_collective_primitive_has_a_rule():
    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    for check_vma in (True, False):
        fn = jax.shard_map(
            _collectives,
            mesh=mesh,
            in_specs=P("d"),
            out_specs=(P("d"),) * 4,
            check_vma=check_vma,
        )
        prims = primitives_in(jax.make_jaxpr(fn)(jnp.ones((4, 2))))
        assert "shard_map" in prims
        missing = sorted(p for p in prims if not has_rule(p))
        assert not missing, f"primitives without a scaled rule: {missing}"


def test_scalify_shard_map_on_one_device():
    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    fn = jax.shard_map(_collectives, mesh=mesh, in_specs=P("d"), out_specs=(P("d"),) * 4)
    x = jnp.linspace(-3.0, 5.0, 8).reshape(4, 2)
    want = fn(x)
    got = ss.scalify(fn)(ss.as_scaled_array(x, "rms"))
    for g, w in zip(got, want):
        assert isinstance(g, ScaledArray)
        np.testing.assert_allclose(np.asarray(g.to_array()), np.asarray(w), rtol=1e-6)


def test_psum_agrees_on_one_scale_under_vmap():
    """A named vmap axis has no varying-axes typing: the scales are always agreed on."""
    x = jnp.arange(12.0).reshape(4, 3) + 1.0
    scales = 2.0 ** jnp.arange(4.0)  # one scale per mapped element

    def one(data, scale):
        out = ss.scalify(lambda v: (lax.psum(v, "i"), lax.pmax(v, "i")))(ScaledArray(data, scale))
        return out[0].to_array(), out[0].scale, out[1].to_array()

    total, out_scales, top = jax.vmap(one, axis_name="i")(x / scales[:, None], scales)
    np.testing.assert_allclose(np.asarray(total), np.broadcast_to(x.sum(0), (4, 3)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(top), np.broadcast_to(x.max(0), (4, 3)), rtol=1e-6)
    # the largest scale (8) times pow2(sqrt(4)) = 2 for the sum of 4 terms
    np.testing.assert_array_equal(np.asarray(out_scales), np.full(4, 16.0, np.float32))


def test_collectives_of_an_exact_zero():
    """Scale 0 marks an all-zero tensor: collectives keep it exactly zero (no 0/0)."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    fn = jax.shard_map(_collectives, mesh=mesh, in_specs=P("d"), out_specs=(P("d"),) * 4)
    zero = ss.as_scaled_array(jnp.zeros((4, 2)), "rms")
    assert float(zero.scale) == 0.0
    for out in ss.scalify(fn)(zero):
        np.testing.assert_array_equal(np.asarray(out.to_array()), 0.0)
        assert np.isfinite(float(out.scale))


def test_pbroadcast_sends_the_scale_with_the_data():
    """pbroadcast has no CPU lowering: check the scalified trace broadcasts both."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))

    def body(x):
        s = jnp.exp2(lax.axis_index("d").astype(jnp.float32))  # a scale per device
        out = ss.scalify(lambda v: lax.pbroadcast(v, "d", 0))(ScaledArray(x / s, s))
        return out.data, out.scale[None]

    fn = jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=(P("d"), P("d")))
    inner = jax.make_jaxpr(fn)(jnp.ones((4, 2))).jaxpr.eqns[0].params["jaxpr"]
    shapes = [e.outvars[0].aval.shape for e in inner.eqns if e.primitive.name == "pbroadcast"]
    assert sorted(shapes) == [(), (4, 2)], shapes


@pytest.mark.parametrize("name", ["psum", "pmean", "pmax", "pmin", "psum_scatter"])
def test_a_vmap_axis_collective_inside_scalify_reduces_the_datas_own_axis(name):
    """``jax.vmap(..., axis_name="i")`` inside the scalified function: once batched, the
    collective names a positional axis of the data, which one scale covers."""
    ops = {
        "psum": lambda v: lax.psum(v, "i"),
        "pmean": lambda v: lax.pmean(v, "i"),
        "pmax": lambda v: lax.pmax(v, "i"),
        "pmin": lambda v: lax.pmin(v, "i"),
        "psum_scatter": lambda v: lax.psum_scatter(v, "i", tiled=True),
    }
    values = np.array([[0.5, -1.25, 3.0, 2.0], [2.0, 0.75, -4.0, 0.25]], np.float32)
    x = ScaledArray(jnp.asarray(values / 4.0), jnp.float32(4.0))
    fn = lambda a: jax.vmap(ops[name], axis_name="i")(a)  # noqa: E731
    got = np.asarray(ss.asarray(ss.scalify(fn)(x)))
    reduce = {"psum": np.sum, "pmean": np.mean, "pmax": np.max, "pmin": np.min}
    if name == "psum_scatter":
        want = values.sum(0).reshape(2, 2)  # example i keeps the i-th half of the sum
    else:
        want = np.broadcast_to(reduce[name](values, axis=0), values.shape)
    np.testing.assert_allclose(got, want, rtol=1e-6)
