"""A training process for the store's crash test: records every step of a small MLP and
prints ``step N`` after each tracked call returns (its statistics are then queued).

Usage: python store_writer_script.py RUN_DIR FLUSH_STEPS STEPS [SLEEP_S]
"""

import sys
import time

import jax
import jax.numpy as jnp

import scalescope as ss


def step(w, x):
    def loss_fn(w):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    loss, g = jax.value_and_grad(loss_fn)(w)
    with jax.named_scope("opt"):
        w = w - 0.1 * g
    return w, loss


def main() -> None:
    path, flush_steps, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    sleep_s = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    w = jax.random.normal(jax.random.key(0), (32, 16)) * 0.3
    x = jax.random.normal(jax.random.key(1), (8, 32))
    run = ss.Run(path, every=1, flush_steps=flush_steps, flush_seconds=60.0)
    tracked = run.track(step, scalify=False)
    for i in range(steps):
        w, loss = tracked(w, x)
        run.log(i, loss=loss)
        print(f"step {i}", flush=True)
        time.sleep(sleep_s)
    run.close()
    print("closed", flush=True)


if __name__ == "__main__":
    main()
