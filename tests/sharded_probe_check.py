"""Run with 4 host devices: a data-parallel instrumented step gives the same statistics
as the same step on one device (same batch): counts exactly, histograms up to values
that another all-reduce order moves across a bin edge, the rest to float32 rounding.
Prints a verdict; exits non-zero if not."""

from __future__ import annotations

import sys

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_engine_models import _mlp  # noqa: E402

import scalescope as ss  # noqa: E402


def main() -> None:
    assert jax.device_count() == 4, jax.devices()
    step, params, opt_state, batch = _mlp()
    args = (ss.as_scaled_array(params, "rms"), ss.as_scaled_array(opt_state, "rms"), batch)
    inst = ss.instrument(step)
    single_out, single = jax.jit(inst)(*jax.device_put(args, jax.devices()[0]))

    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated = NamedSharding(mesh, P())
    data = NamedSharding(mesh, P("data"))
    sharded_args = (
        jax.device_put(args[0], replicated),
        jax.device_put(args[1], replicated),
        jax.device_put(batch, data),
    )
    assert len(sharded_args[2]["x"].sharding.device_set) == 4
    out, stats = jax.jit(inst)(*sharded_args)
    # Another all-reduce order changes the last bits of the gradients, and the optimizer
    # carries them into the outputs: agree to ~1e-4 (float32 sums of 4 partial gradients).
    for a, b in zip(jax.tree.leaves(single_out), jax.tree.leaves(out)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    table = inst.op_table(*args)
    assert table.n_rows == stats["rms"].shape[0]
    for name, value in single.items():
        a, b = np.asarray(value), np.asarray(stats[name])
        if name == "hist":
            # Same totals per row; a value that the other all-reduce order moves across a
            # power of two changes bin, so allow one element in 1000 to move.
            np.testing.assert_array_equal(a.sum(axis=1), b.sum(axis=1), err_msg=name)
            moved = np.abs(a - b).sum(axis=1) / 2
            assert np.all(moved <= 1e-3 * a.sum(axis=1) + 1), moved.max()
        elif a.dtype.kind == "i":
            np.testing.assert_array_equal(a, b, err_msg=name)
        elif name == "dynamic_range":
            # log2(abs-max / smallest non-zero magnitude): the smallest element of a
            # gradient moves by its last bits with the all-reduce order (seen: 6.5e-5)
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-3, err_msg=name)
        elif name.startswith("snr_"):
            # The sharded step's gradients differ from the single-device ones in the last
            # bits (another all-reduce order), which moves a high SNR by ~0.01 dB.
            np.testing.assert_allclose(a, b, rtol=0, atol=0.05, err_msg=name)
        else:
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)
    print(f"{table.n_rows} rows, {len(single)} statistics")
    spread_across_devices(mesh)
    print("sharded stats equal single-device stats")


def spread_across_devices(mesh: Mesh) -> None:
    """A value whose shards have means 0.5 apart around 1000 and a spread of 0.01
    within each: folded across devices, its std is NumPy's (Chan's pooling; the float32
    mean square minus the squared mean cancelled to nothing here)."""
    from scalescope.probe import kernel

    rng = np.random.default_rng(3)
    value = 1000 + np.repeat(np.arange(4) * 0.5, 300) + 0.01 * rng.normal(size=1200)
    value = value.astype(np.float32)
    spec = kernel.StatSpec((), histograms=False)

    def body(x):
        raw = kernel.across_devices(kernel.group_raw([(x, None)], spec), None, ("data",))
        stats = kernel.finalize(raw, spec)
        return stats["std"], stats["mean"]

    std, mean = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P(), check_vma=False)
    )(value)
    exact = value.astype(np.float64)
    np.testing.assert_allclose(float(std[0]), exact.std(), rtol=1e-4)
    np.testing.assert_allclose(float(mean[0]), exact.mean(), rtol=1e-7)


if __name__ == "__main__":
    main()
