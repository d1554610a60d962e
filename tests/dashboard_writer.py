"""Record a small two-layer model into a run, for the dashboard tests.

    python dashboard_writer.py RUN_DIR --steps N [--naive] [--delay SECONDS] [--formats F,R]

``--naive``: no scalify, inputs 2^8 too large, so the E4M3 cast of the first layer's
output overflows (NaN) -- the run the advisor must flag. ``--delay``: sleep between
steps, flushing each one, so a reader can follow the run live. ``--formats``: the run's
``formats=`` (comma-separated; block-scaled recipes such as ``nvfp4`` too; default the
store's). Prints ``step i`` per step.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import ml_dtypes

import scalescope as ss

E4M3 = ml_dtypes.float8_e4m3fn


def step(params, x):
    def loss_fn(params):
        with jax.named_scope("layer0"):
            h = ss.ops.cast_on_forward(x @ params["w0"], E4M3)
            h = jnp.tanh(h)
        with jax.named_scope("layer1"):
            y = h @ params["w1"]
        return jnp.mean(y**2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    with jax.named_scope("opt"):
        params = jax.tree.map(lambda p, g: p - 0.05 * g, params, grads)
    return params, loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--naive", action="store_true")
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--formats", default=None)
    args = parser.parse_args()
    k0, k1, k2 = jax.random.split(jax.random.key(0), 3)
    params = {
        "w0": jax.random.normal(k0, (32, 64)) / 32**0.5,
        "w1": jax.random.normal(k1, (64, 8)) / 64**0.5,
    }
    x = jax.random.normal(k2, (16, 32)) * (2.0**8 if args.naive else 1.0)
    if not args.naive:
        params = ss.as_scaled_array(params)
    flush = 1 if args.delay else 10
    kw = {"formats": tuple(args.formats.split(","))} if args.formats else {}
    with ss.Run(args.run, every=1, flush_steps=flush, config={"steps": args.steps}, **kw) as run:
        tracked = run.track(step, scalify=not args.naive)
        for i in range(run.start_step, run.start_step + args.steps):
            params, loss = tracked(params, x)
            run.log(i, loss=loss)
            if args.delay:
                run.flush()
                print(f"step {i}", flush=True)
                time.sleep(args.delay)


if __name__ == "__main__":
    main()
