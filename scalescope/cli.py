"""The ``scalescope`` command.

For now it has one subcommand, ``demo``: it trains the sample MLP in four ways on a
synthetic, learnable classification task and prints the losses side by side. The four
ways are FP32, FP16 run naively, FP16 under scalify (FP16 master weights and AdamW state
included), and FP8 under scalify (E4M3 forward, E5M2 backward).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import scalescope as ss


def _synthetic_classification(n: int, dim: int, classes: int, seed: int = 0):
    """Gaussian clusters: a task a small MLP learns in a few dozen steps."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(0.0, 1.0, (classes, dim)).astype(np.float32)
    y = rng.integers(0, classes, n)
    x = centres[y] + rng.normal(0.0, 3.0, (n, dim)).astype(np.float32)
    return x, y.astype(np.int32)


def _cast_floats(tree, dtype):
    return jax.tree.map(
        lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree
    )


def demo(steps: int = 60, batch: int = 64, seed: int = 0) -> dict[str, list[float]]:
    """Train the sample MLP in four precisions; returns the loss curves."""
    from sample_models.mlp import MLPConfig, init_mlp, mlp_loss
    from sample_models.precision import PRECISIONS
    from sample_models.train_step import make_optimizer, make_train_step

    cfg = MLPConfig(in_dim=64, hidden=(256, 256), n_classes=10)
    x, y = _synthetic_classification(batch * steps, cfg.in_dim, cfg.n_classes, seed)
    opt = make_optimizer(1e-3)
    params32 = init_mlp(jax.random.key(seed), cfg)

    runs = {}
    for name, precision, dtype, scalified in [
        ("fp32", "fp32", jnp.float32, False),
        ("fp16 naive", "fp16", jnp.float16, False),
        ("fp16 scalify", "fp16", jnp.float16, True),
        ("fp8 scalify", "fp8", jnp.float16, True),
    ]:
        step = make_train_step(
            functools.partial(mlp_loss, cfg=cfg, precision=PRECISIONS[precision]), opt
        )
        params = _cast_floats(params32, dtype)
        state = _cast_floats(opt.init(params), dtype)
        if scalified:
            step = ss.scalify(step)
            params, state = ss.as_scaled_array(params, "rms"), ss.as_scaled_array(state, "rms")
        runs[name] = (jax.jit(step), params, state, dtype)

    curves: dict[str, list[float]] = {name: [] for name in runs}
    t0 = time.perf_counter()
    for i in range(steps):
        sl = slice(i * batch, (i + 1) * batch)
        for name, (step, params, state, dtype) in runs.items():
            b = {"x": jnp.asarray(x[sl], dtype), "y": jnp.asarray(y[sl])}
            params, state, loss = step(params, state, b)
            runs[name] = (step, params, state, dtype)
            curves[name].append(float(ss.asarray(loss, jnp.float32)))
        if (i + 1) % max(1, steps // 10) == 0 or i == steps - 1:
            row = "  ".join(f"{n}={c[-1]:8.4f}" for n, c in curves.items())
            print(f"step {i + 1:4d}/{steps}  {row}  ({time.perf_counter() - t0:.1f}s)")
            sys.stdout.flush()
    return curves


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scalescope", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser(
        "demo",
        help="train the sample MLP in FP32/FP16/FP8, with and "
        "without scalify, and print the losses",
    )
    p_demo.add_argument("--steps", type=int, default=60)
    p_demo.add_argument("--batch", type=int, default=64)
    p_demo.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "demo":
        if args.steps < 1 or args.batch < 1:
            parser.error("--steps and --batch must be positive")
        curves = demo(args.steps, args.batch, args.seed)
        tail = max(1, args.steps // 5)
        final = {name: float(np.mean(c[-tail:])) for name, c in curves.items()}
        print(f"\nloss, mean of the last {tail} steps (gap to fp32):")
        for name, value in final.items():
            gap = (value - final["fp32"]) / final["fp32"] * 100
            print(f"  {name:14s} {value:10.4f}  ({gap:+.1f} %)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
