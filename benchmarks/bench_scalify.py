"""Cost of scalify on the sample GPT training step, measured side by side in one process.

Prints, for the plain jitted step and the scalified jitted step (AdamW update included):
trace+compile time, steady-state step time, and their ratios (goals: step <= 1.10x,
trace+compile <= 2x).

    python benchmarks/bench_scalify.py [--layers 2] [--d-model 128] [--steps 30] [--scan]
"""

from __future__ import annotations

import argparse
import functools
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

import scalescope as ss
from sample_models.gpt import GPTConfig, gpt_loss, init_gpt
from sample_models.precision import PRECISIONS
from sample_models.train_step import make_optimizer, make_train_step


def _block(tree):
    jax.tree.map(lambda x: x.block_until_ready(), jax.tree.leaves(tree))


def _measure(step, args, n_steps: int) -> tuple[float, float]:
    """(trace + compile seconds, median seconds per step)."""
    t0 = time.perf_counter()
    compiled = jax.jit(step).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    out = compiled(*args)
    _block(out)
    times = []
    for _ in range(n_steps):
        t0 = time.perf_counter()
        out = compiled(*args)
        _block(out)
        times.append(time.perf_counter() - t0)
    return compile_s, float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--scan", action="store_true", help="layers under lax.scan")
    parser.add_argument("--precision", default="fp32", choices=sorted(PRECISIONS))
    args = parser.parse_args()

    cfg = GPTConfig(
        vocab_size=65,
        seq_len=args.seq,
        d_model=args.d_model,
        n_heads=4,
        n_layers=args.layers,
        scan_layers=args.scan,
    )
    prec = PRECISIONS[args.precision]
    params = jax.tree.map(lambda a: a.astype(prec.param_dtype), init_gpt(jax.random.key(0), cfg))
    opt = make_optimizer()
    opt_state = opt.init(params)
    rng = np.random.default_rng(0)
    batch = {
        k: jnp.asarray(rng.integers(0, 65, (args.batch, args.seq)), jnp.int32)
        for k in ("inputs", "targets")
    }
    step = make_train_step(functools.partial(gpt_loss, cfg=cfg, precision=prec), opt)

    plain_c, plain_t = _measure(step, (params, opt_state, batch), args.steps)
    scaled_args = (ss.as_scaled_array(params, "rms"), ss.as_scaled_array(opt_state, "rms"), batch)
    scal_c, scal_t = _measure(ss.scalify(step), scaled_args, args.steps)

    print(
        f"# bench_scalify  jax {jax.__version__}  {jax.devices()[0].platform}  "
        f"{platform.processor() or platform.machine()}"
    )
    print(
        f"# GPT: {args.layers} layers, d={args.d_model}, seq={args.seq}, batch={args.batch}, "
        f"{'scan' if args.scan else 'unrolled'}, precision={args.precision}, AdamW step"
    )
    print(f"{'':24s}{'plain':>12s}{'scalified':>12s}{'ratio':>9s}{'goal':>8s}")
    print(
        f"{'trace+compile (s)':24s}{plain_c:12.2f}{scal_c:12.2f}{scal_c / plain_c:9.2f}{'<= 2':>8s}"
    )
    print(
        f"{'step time (ms)':24s}{plain_t * 1e3:12.2f}{scal_t * 1e3:12.2f}"
        f"{scal_t / plain_t:9.2f}{'<= 1.10':>8s}"
    )


if __name__ == "__main__":
    main()
