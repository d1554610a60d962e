"""Run with 4 host devices: a data-parallel tracked step whose batch holds one bad
example on the third device goes NaN at a known step through a known op (``log``); the
incident names that op and that device, for a step partitioned by jit (GSPMD) and for
the same step written with ``shard_map``. Prints one JSON line per case; exits non-zero
on failure."""

from __future__ import annotations

import json
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import scalescope as ss

BAD_STEP, BAD_ROW, ROWS = 3, 9, 16  # row 9 of 16 lies on the third device (rows 8..11)


def loss_of(w: jax.Array, x: jax.Array) -> jax.Array:
    h = x @ w
    return jnp.mean(jnp.log(h * h + x[:, :1]))  # log of a negative: NaN on that row only


def gspmd_step(w: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    loss, g = jax.value_and_grad(loss_of)(w, x)
    return w - 0.01 * g, loss


def scan_loss_of(ws: jax.Array, x: jax.Array) -> jax.Array:
    def layer(h, w):
        h = h @ w
        return h, jnp.log(h * h + x[:, :1])  # the op is inside the scan body

    _, ys = jax.lax.scan(layer, x, ws)
    return jnp.mean(ys)


def scan_step(ws: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    loss, g = jax.value_and_grad(scan_loss_of)(ws, x)
    return ws - 0.01 * g, loss


def make_shard_map_step(mesh: Mesh):
    def per_device(w, x):
        loss, g = jax.value_and_grad(loss_of)(w, x)
        return jax.lax.pmean(loss, "data"), jax.lax.pmean(g, "data")

    body = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()))

    def step(w, x):
        loss, g = body(w, x)
        return w - 0.01 * g, loss

    return step


def batch(step: int) -> np.ndarray:
    x = np.abs(np.random.default_rng(step).normal(size=(ROWS, 8))).astype(np.float32) + 0.5
    if step == BAD_STEP:
        x[BAD_ROW, 0] = -100.0
    return x


def run_case(name: str, step_fn, mesh: Mesh, layers: int = 0) -> dict:
    shape = (layers, 8, 8) if layers else (8, 8)
    w = jax.device_put(np.full(shape, 0.1, np.float32), NamedSharding(mesh, P()))
    with tempfile.TemporaryDirectory() as d, ss.Run(d, every=1000) as run:
        tracked = run.track(step_fn, scalify=False)
        for i in range(BAD_STEP + 1):
            x = jax.device_put(batch(i), NamedSharding(mesh, P("data")))
            w, _ = tracked(w, x)
        incidents = run.incidents
        frame = ss.open_run(d).incidents()
    assert len(incidents) == 1, incidents
    inc = incidents[0]
    out = {
        "case": name,
        "step": inc["step"],
        "trigger": inc["trigger"],
        "primitive": inc["primitive"],
        "devices": inc.get("devices"),
        "detail": inc["detail"],
        "stored_devices": frame["devices"].iloc[0],
    }
    print(json.dumps(out, default=str))
    return out


def main() -> None:
    assert jax.device_count() == 4, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    third = jax.devices()[2]
    cases = (
        ("gspmd", gspmd_step, 0),
        ("gspmd, op in a scan body", scan_step, 2),
        ("shard_map", make_shard_map_step(mesh), 0),
    )
    for name, fn, layers in cases:
        got = run_case(name, fn, mesh, layers)
        assert got["step"] == BAD_STEP and got["trigger"] == "nonfinite", got
        assert got["primitive"] == "log", got
        assert [d["device"] for d in got["devices"]] == [third.id], got
        assert got["devices"][0]["process"] == 0 and got["devices"][0]["nonfinite"] >= 1, got
        assert f"on device {third.id} (process 0) of 4" in got["detail"], got
        assert got["stored_devices"] == got["devices"], got  # as the reader reads it
    print("incidents name the device")


if __name__ == "__main__":
    sys.exit(main())
