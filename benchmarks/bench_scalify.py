"""Cost of scalify on training steps, measured side by side in one process.

Prints, for the plain jitted step and the scalified jitted step (AdamW update included):
trace+compile time, steady-state step time, their ratios (goals: step <= 1.10x,
trace+compile <= 1.5x), and the HLO size of each: StableHLO ops emitted by tracing and
instructions after XLA's optimisation (scalar scale chains duplicated into fusions show
up there). Models: the sample GPT (unrolled), an MLP 784-512-512-10 (a peer's
benchmark) and a small transformer (the GPT at 1 layer, d=64).

    python benchmarks/bench_scalify.py [--layers 2] [--d-model 128] [--steps 30] [--scan]
        [--models gpt,mlp,small]
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from _compile_cache import add_option, apply  # (benchmarks/ is on the path)

import scalescope as ss
from scalescope.sample_models.gpt import GPTConfig, gpt_loss, init_gpt
from scalescope.sample_models.mlp import MLPConfig, init_mlp, mlp_loss
from scalescope.sample_models.precision import PRECISIONS
from scalescope.sample_models.train_step import make_optimizer, make_train_step


def _block(tree):
    jax.tree.map(lambda x: x.block_until_ready(), jax.tree.leaves(tree))


def _hlo_size(lowered, compiled) -> tuple[int, int]:
    """(StableHLO ops as traced, HLO instructions after optimisation)."""
    traced = sum(1 for line in lowered.as_text().splitlines() if "= stablehlo." in line)
    optimised = sum(1 for line in compiled.as_text().splitlines() if " = " in line)
    return traced, optimised


SIZES: dict[str, tuple[int, int]] = {}


def _measure(step, args, n_steps: int, label: str = "") -> tuple[float, float]:
    """(trace + compile seconds, median seconds per step); HLO sizes go to SIZES."""
    t0 = time.perf_counter()
    lowered = jax.jit(step).lower(*args)
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    SIZES[label] = _hlo_size(lowered, compiled)
    out = compiled(*args)
    _block(out)
    times = []
    for _ in range(n_steps):
        t0 = time.perf_counter()
        out = compiled(*args)
        _block(out)
        times.append(time.perf_counter() - t0)
    return compile_s, float(np.median(times))


def _gpt(args, layers: int, d_model: int):
    cfg = GPTConfig(
        vocab_size=65,
        seq_len=args.seq,
        d_model=d_model,
        n_heads=4,
        n_layers=layers,
        scan_layers=args.scan,
    )
    prec = PRECISIONS[args.precision]
    params = jax.tree.map(lambda a: a.astype(prec.param_dtype), init_gpt(jax.random.key(0), cfg))
    rng = np.random.default_rng(0)
    batch = {
        k: jnp.asarray(rng.integers(0, 65, (args.batch, args.seq)), jnp.int32)
        for k in ("inputs", "targets")
    }
    label = (
        f"GPT {layers}x{d_model} seq {args.seq} batch {args.batch} "
        f"{'scan' if args.scan else 'unrolled'}"
    )
    return label, functools.partial(gpt_loss, cfg=cfg, precision=prec), params, batch


def _mlp(args):
    cfg = MLPConfig(in_dim=784, hidden=(512, 512), n_classes=10)
    params = init_mlp(jax.random.key(0), cfg)
    rng = np.random.default_rng(0)
    batch = {
        "x": jnp.asarray(rng.standard_normal((128, 784)), jnp.float32),
        "y": jnp.asarray(rng.integers(0, 10, 128), jnp.int32),
    }
    return "MLP 784-512-512-10 batch 128", functools.partial(mlp_loss, cfg=cfg), params, batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--scan", action="store_true", help="layers under lax.scan")
    parser.add_argument("--precision", default="fp32", choices=sorted(PRECISIONS))
    parser.add_argument("--models", default="gpt,mlp,small", help="comma-separated subset")
    add_option(parser)
    args = parser.parse_args()
    apply(args)

    builders = {
        "gpt": lambda: _gpt(args, args.layers, args.d_model),
        "mlp": lambda: _mlp(args),
        "small": lambda: _gpt(args, 1, 64),
    }
    print(
        f"# bench_scalify  jax {jax.__version__}  {jax.devices()[0].platform}  "
        f"{platform.processor() or platform.machine()}  load average "
        f"{os.getloadavg()[0]:.2f}"
    )
    print(f"# precision={args.precision}, AdamW step, {args.steps} timed steps")
    head = f"{'':34s}{'plain':>10s}{'scalified':>11s}{'ratio':>8s}{'goal':>8s}"
    for name in args.models.split(","):
        if name not in builders:
            parser.error(f"--models: unknown model {name!r} (choose from {sorted(builders)})")
        label, loss, params, batch = builders[name]()
        step = make_train_step(loss, make_optimizer())
        opt_state = make_optimizer().init(params)
        plain_c, plain_t = _measure(step, (params, opt_state, batch), args.steps, "plain")
        scaled = (ss.as_scaled_array(params, "rms"), ss.as_scaled_array(opt_state, "rms"), batch)
        scal_c, scal_t = _measure(ss.scalify(step), scaled, args.steps, "scalified")
        (p_ops, p_ins), (s_ops, s_ins) = SIZES["plain"], SIZES["scalified"]
        print(f"\n## {label}\n{head}")
        print(
            f"{'trace+compile (s)':34s}{plain_c:10.2f}{scal_c:11.2f}"
            f"{scal_c / plain_c:8.2f}{'<= 1.5':>8s}"
        )
        print(
            f"{'step time (ms)':34s}{plain_t * 1e3:10.2f}{scal_t * 1e3:11.2f}"
            f"{scal_t / plain_t:8.2f}{'<= 1.10':>8s}"
        )
        print(f"{'StableHLO ops (traced)':34s}{p_ops:10d}{s_ops:11d}{s_ops / p_ops:8.2f}")
        print(f"{'HLO instructions (optimised)':34s}{p_ins:10d}{s_ins:11d}{s_ins / p_ins:8.2f}")


if __name__ == "__main__":
    main()
