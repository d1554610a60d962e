"""Amortized cost of recording a training run with `Run.track`, side by side in one process.

Trains the sample GPT (FP8 recipe under scalify) for N steps three ways and prints the
time per step, including the background writer (the run is flushed before the clock
stops): untracked ``jit(scalify(step))``; ``run.track`` with ``every=10`` and exact
statistics (the default); ``every=10`` with the cheap probe settings (sampled values, no
histograms, no shadow copy). Goal: <= 1.05x the untracked step. Compilation of every
variant happens before timing.

    python benchmarks/bench_run.py [--steps 100] [--every 10] [--layers 2] [--d-model 128]
"""

from __future__ import annotations

import argparse
import functools
import platform
import shutil
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import scalescope as ss
from sample_models.gpt import GPTConfig, gpt_loss, init_gpt
from sample_models.precision import PRECISIONS
from sample_models.train_step import make_optimizer, make_train_step


def _state(cfg: GPTConfig, precision: str):
    prec = PRECISIONS[precision]
    params = init_gpt(jax.random.key(0), cfg, prec.param_dtype)
    opt = make_optimizer()
    step = make_train_step(functools.partial(gpt_loss, cfg=cfg, precision=prec), opt)
    return step, ss.as_scaled_array(params, "rms"), ss.as_scaled_array(opt.init(params), "rms")


def _batches(cfg: GPTConfig, batch: int, n: int):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        t = rng.integers(0, cfg.vocab_size, (batch, cfg.seq_len + 1)).astype(np.int32)
        out.append({"inputs": jnp.asarray(t[:, :-1]), "targets": jnp.asarray(t[:, 1:])})
    return out


def _loop(fn, params, state, batches) -> tuple[float, object]:
    t0 = time.perf_counter()
    for b in batches:
        params, state, loss = fn(params, state, b)
    jax.block_until_ready((params, state, loss))
    return time.perf_counter() - t0, loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="timed steps per variant")
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--precision", default="fp8", choices=("fp16", "fp8"))
    parser.add_argument("--sample", type=int, default=1024, help="cheap variant's sample size")
    args = parser.parse_args()

    cfg = GPTConfig(
        vocab_size=65, seq_len=args.seq, d_model=args.d_model, n_heads=4, n_layers=args.layers
    )
    step, params, state = _state(cfg, args.precision)
    batches = _batches(cfg, args.batch, args.steps)
    print(
        f"# bench_run  jax {jax.__version__}  {jax.devices()[0].platform}  "
        f"{platform.processor() or platform.machine()}  GPT {args.layers}x{args.d_model}, "
        f"seq {args.seq}, batch {args.batch}, {args.precision}, {args.steps} steps, "
        f"every={args.every}"
    )
    variants = {
        "exact (default)": {},
        f"sample={args.sample}, no hist, isolate=False": {
            "sample": args.sample,
            "histograms": False,
            "isolate": False,
        },
    }
    tmp = tempfile.mkdtemp(prefix="bench_run_")
    try:
        plain = jax.jit(ss.scalify(step))
        _loop(plain, params, state, batches[:2])  # compile
        tracked = {}
        for i, (name, kw) in enumerate(variants.items()):
            run = ss.Run(f"{tmp}/run{i}", every=args.every, **kw)
            fn = run.track(step)
            t0 = time.perf_counter()
            _loop(fn, params, state, batches[:2])  # compiles both of its variants
            run.flush()
            fn.step = 0
            tracked[name] = (run, fn, time.perf_counter() - t0)

        base, _ = _loop(plain, params, state, batches)
        rows = [("untracked jit(scalify(step))", base, 1.0, 0.0)]
        for name, (run, fn, compile_s) in tracked.items():
            elapsed, _ = _loop(fn, params, state, batches)
            t0 = time.perf_counter()
            run.flush()
            elapsed += time.perf_counter() - t0
            rows.append(
                (f"run.track every={args.every}, {name}", elapsed, elapsed / base, compile_s)
            )
            run.close()
        again, _ = _loop(plain, params, state, batches)  # drift check for the baseline
        rows.append(("untracked again", again, again / base, 0.0))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"{'variant':58s} {'ms/step':>9s} {'ratio':>7s} {'compile s':>10s}")
    for name, elapsed, ratio, compile_s in rows:
        per_step = 1000 * elapsed / args.steps
        print(f"{name:58s} {per_step:9.1f} {ratio:7.3f} {compile_s:10.1f}")


if __name__ == "__main__":
    main()
