"""What emulating a precision policy costs: the emulated step against the plain jitted step.

The sample GPT's training step (AdamW, as ``scalescope train`` builds it) is compiled
plain and under `ss.emulate` with policies that hold every matmul operand (weights,
activations and the gradients the backward matmuls read; ``@matmul``) in a format or a
recipe. Printed side by side, measured in one run: compile time and the median step
time over ``--steps`` steps after a warm-up, and their ratio to plain. Goal: an emulated
step at most 1.5x the plain one.

    python benchmarks/bench_emulate.py [--steps 30] [--d-model 128] [--layers 2]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TARGETS = ("e4m3", "mxfp8_e4m3", "mxfp8_e4m3_rceil", "nvfp4", "fp8_block128")


def _timed(fn, state, batches, steps: int) -> tuple[float, float]:
    """(compile + first step seconds, median step seconds after a warm-up)."""
    import jax

    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*state, batches[0]))
    first = time.perf_counter() - t0
    state = out[:-1]
    times = []
    for i in range(steps + 3):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*state, batches[(i + 1) % len(batches)]))
        times.append(time.perf_counter() - t0)
        state = out[:-1]
    return first, float(np.median(times[3:]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    import scalescope as ss
    from scalescope.analysis import exact_pattern, matmul_table, op_label_series
    from scalescope.sample_models.train import TrainConfig, make_adamw, make_task
    from scalescope.sample_models.train_step import make_train_step

    gpt = {"seq_len": args.seq_len, "d_model": args.d_model, "n_heads": 4}
    gpt["n_layers"] = args.layers
    cfg = TrainConfig(model="gpt", batch=args.batch, gpt=gpt, data="vendored", steps=100)
    task = make_task(cfg)
    opt = make_adamw(cfg)
    step = make_train_step(task.loss_fn, opt)
    state = (task.params, opt.init(task.params))
    batches = [{k: jnp.asarray(v) for k, v in next(task.train_batches).items()} for _ in range(8)]
    ops = ss.instrument(step).op_table(*state, batches[0]).to_frame()
    labels = op_label_series(ops)
    table = matmul_table(ops)
    held = {labels[x] for col in ("fwd_operands", "bwd_gradients") for ids in table[col]
            for x in ids if x >= 0}  # fmt: skip

    rows = [("plain", *_timed(jax.jit(step), state, batches, args.steps))]
    for target in TARGETS:
        policy = ss.Policy([(exact_pattern(label), f"{target}@matmul") for label in held])
        fn = jax.jit(ss.emulate(step, policy))
        rows.append((target, *_timed(fn, state, batches, args.steps)))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"{platform.node()}  load {load:.1f}  gpt d={args.d_model} layers={args.layers} "
        f"seq={args.seq_len} batch={args.batch}: {len(held)} matmul operands held, "
        f"median of {args.steps} steps"
    )
    print("| policy (every matmul operand) | compile + 1st step s | step ms | step / plain |")
    print("|---|---|---|---|")
    base = rows[0][2]
    for name, first, t in rows:
        print(f"| {name} | {first:.1f} | {1e3 * t:.2f} | {t / base:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
