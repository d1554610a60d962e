"""Cost of the probe on the sample GPT training step, measured side by side in one process.

Prints trace+compile time and steady-state step time for: the scalified step; the
instrumented step with every op recorded and histograms on (goal: <= 1.5x the scalified
step); histograms off; and the cheap modes (isolate=False, per-value sampling, select).

    python benchmarks/bench_probe.py [--layers 2] [--d-model 128] [--scan] [--quick]
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


def _measure(fn, args, n_steps: int) -> tuple[float, float]:
    """(trace + compile seconds, median seconds per step)."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(n_steps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return compile_s, float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    parser.add_argument("--scan", action="store_true", help="layers under lax.scan")
    parser.add_argument("--precision", default="fp8", choices=sorted(PRECISIONS))
    parser.add_argument("--quick", action="store_true", help="only the two main variants")
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
    rng = np.random.default_rng(0)
    batch = {
        k: jnp.asarray(rng.integers(0, 65, (args.batch, args.seq)), jnp.int32)
        for k in ("inputs", "targets")
    }
    step = make_train_step(functools.partial(gpt_loss, cfg=cfg, precision=prec), opt)
    step_args = (
        ss.as_scaled_array(params, "rms"),
        ss.as_scaled_array(opt.init(params), "rms"),
        batch,
    )

    print(
        f"# bench_probe  jax {jax.__version__}  {jax.devices()[0].platform}  "
        f"{platform.processor() or platform.machine()}"
    )
    print(
        f"# GPT: {args.layers} layers, d={args.d_model}, seq={args.seq}, batch={args.batch}, "
        f"{'scan' if args.scan else 'unrolled'}, precision={args.precision}, AdamW step"
    )
    base_c, base_t = _measure(ss.scalify(step), step_args, max(args.steps, 10))
    table = ss.instrument(step).op_table(*step_args)
    recorded = [op for op in table if op.recorded]
    elements = sum(int(np.prod(op.shape)) * op.n_rows for op in recorded)
    print(
        f"# {len(table)} ops, {len(recorded)} recorded, {table.n_rows} rows, "
        f"{elements / 1e6:.1f} M elements measured per step"
    )
    variants = [
        ("all ops, histograms", {}),
        ("all ops, no histograms", {"histograms": False}),
    ]
    if not args.quick:
        variants += [
            ("histograms, isolate=False", {"isolate": False}),
            ("sample=4096, histograms", {"sample": 4096}),
            (
                "sample=1024, no hist, no isolate",
                {"sample": 1024, "histograms": False, "isolate": False},
            ),
            ("select dot_general", {"select": "dot_general"}),
        ]
    print(
        f"{'variant':36s}{'compile s':>10s}{'step ms':>10s}{'step ratio':>12s}"
        f"{'compile ratio':>15s}"
    )
    print(
        f"{'scalified step (baseline)':36s}{base_c:10.2f}{base_t * 1e3:10.2f}{1.0:12.2f}{1.0:15.2f}"
    )
    for label, kw in variants:
        c, t = _measure(ss.instrument(step, **kw), step_args, args.steps)
        print(
            f"{label:36s}{c:10.2f}{t * 1e3:10.2f}{t / base_t:12.2f}{c / base_c:15.2f}", flush=True
        )
    print("# goal: 'all ops, histograms' step ratio <= 1.5")


if __name__ == "__main__":
    main()
