"""Record a small step into a run under a file size limit, for the fault tests.

    python fault_writer.py RUN_DIR --steps N --flush-steps K [--fsize BYTES --after S]

``--fsize``: RLIMIT_FSIZE for this process from step ``--after`` on (a write past it
fails with "File too large", as on a full disk). Prints ``step i`` per step,
``error: TYPE: ...`` when the run raised, and ``closed`` once ``close()`` returned (or
``close error: TYPE: ...``); TYPE is the error's class, ``+OSError`` when it is one.
"""

from __future__ import annotations

import argparse
import resource

import jax
import jax.numpy as jnp

import scalescope as ss


def step(w, x):
    def loss_fn(w):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    loss, g = jax.value_and_grad(loss_fn)(w)
    return w - 0.1 * g, loss


def _kind(err: BaseException) -> str:
    return type(err).__name__ + ("+OSError" if isinstance(err, OSError) else "")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--flush-steps", type=int, required=True)
    parser.add_argument("--fsize", type=int)
    parser.add_argument("--after", type=int, default=0)
    args = parser.parse_args()
    run = ss.Run(
        args.run, every=1, flush_steps=args.flush_steps, histograms=False, flush_seconds=60.0
    )
    tracked = run.track(step, scalify=False)
    w, x = jnp.full((16, 16), 0.1, jnp.float32), jnp.ones((8, 16), jnp.float32)
    tracked.warmup(w, x)
    try:
        for i in range(args.steps):
            if args.fsize and i == args.after:
                run.flush()  # steps before --after are on disk; the limit hits the next part
                resource.setrlimit(resource.RLIMIT_FSIZE, (args.fsize, args.fsize))
            w, loss = tracked(w, x)
            run.log(i, loss=loss)
            print(f"step {i}", flush=True)
    except ss.RunError as err:
        print(f"error: {_kind(err)}: {err}", flush=True)
    try:
        run.close()
        print("closed", flush=True)
    except ss.RunError as err:
        print(f"close error: {_kind(err)}: {err}", flush=True)


if __name__ == "__main__":
    main()
