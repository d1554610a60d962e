"""What scale arithmetic costs XLA's compiler, on a synthetic chain, side by side.

A chain of layers (``x @ w``, ``tanh``, an add), each carrying a float32 scale through
``--ops`` scalar ops (bitcasts and selects on the exponent field, as scalify's rules do),
compiled in four variants:

- *duplicated*: the scale chain is left to XLA, which copies it into every fusion that
  reads it (compile time grows with the chain's length);
- *materialised, identical*: each layer's scale is computed once (`fmod(s, inf)`, as
  ``scalify.common.materialized`` does) by kernels that are all the same computation;
- *materialised, distinct*: the same, each layer with its own constant (as each rule's
  factors differ), so every scale kernel is a distinct computation;
- *materialised, constants behind a barrier*: the constants read from a table that XLA
  cannot fold (does reading them at run time make the kernels identical again?).

XLA compiles an identical fused computation once, so the distinct variant shows the
cost per distinct scale kernel: the lever for issue 14's compile goal.

    python benchmarks/bench_scale_kernels.py [--layers 120] [--ops 4,24]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

VARIANTS = ("duplicated", "identical", "distinct", "barrier")


def _scalar_ops(s: jax.Array, n_ops: int) -> jax.Array:
    """About ``n_ops`` scalar ops on ``s``'s exponent field; the value stays a power of
    two."""
    for _ in range(n_ops // 4):
        bits = lax.bitcast_convert_type(s, jnp.int32)
        bits = lax.select(bits > 0x3F800000, bits - (1 << 23), bits + (1 << 23))
        s = lax.bitcast_convert_type(bits, jnp.float32) * np.float32(1.0)
    return s


def chain(variant: str, layers: int, n_ops: int):
    """The step of one variant: ``(ws, x, s) -> (loss, final scale)``."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r} (choose from {VARIANTS})")
    step = 1e-3 if variant in ("distinct", "barrier") else 0.0
    consts = np.asarray([0.5 + i * step for i in range(layers)], np.float32)

    def f(ws, x, s):
        table = lax.optimization_barrier(jnp.asarray(consts)) if variant == "barrier" else None
        for i, w in enumerate(ws):
            y = x @ w
            s = _scalar_ops(s * (consts[i] if table is None else table[i]), n_ops)
            if variant != "duplicated":
                s = lax.rem(s, np.float32(np.inf))
            x = jnp.tanh(y * s) + x * s
        return x.sum(), s

    return f


def measure(variant: str, layers: int, n_ops: int) -> tuple[float, int]:
    """(compile seconds, fusions) of one variant."""
    ws = [jnp.full((64, 64), 0.01, jnp.float32) for _ in range(layers)]
    x, s = jnp.ones((32, 64), jnp.float32), jnp.float32(1.0)
    lowered = jax.jit(chain(variant, layers, n_ops)).lower(ws, x, s)
    t0 = time.perf_counter()
    compiled = lowered.compile()
    return time.perf_counter() - t0, compiled.as_text().count(" fusion(")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=120)
    parser.add_argument("--ops", default="4,24", help="scalar ops per layer, comma-separated")
    args = parser.parse_args()
    # compile times are measured: the persistent compilation cache would hide them
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        op_counts = [int(k) for k in args.ops.split(",")]
    except ValueError:
        parser.error(f"--ops: expected comma-separated integers, got {args.ops!r}")
    if args.layers < 1 or any(k < 0 for k in op_counts):
        parser.error("--layers must be >= 1 and --ops >= 0")
    print(
        f"# bench_scale_kernels  jax {jax.__version__}  {jax.devices()[0].platform}  "
        f"{platform.processor() or platform.machine()}  load average {os.getloadavg()[0]:.2f}"
    )
    jax.jit(lambda a: a + 1).lower(jnp.ones(4)).compile()  # the compiler's one-time start
    print(f"# {args.layers} layers; compile time of each variant, and over 'identical'")
    print(f"{'ops':>4s}  {'variant':12s}{'compile s':>10s}{'fusions':>9s}{'x ident.':>10s}")
    for n_ops in op_counts:
        results = {v: measure(v, args.layers, n_ops) for v in VARIANTS}
        base = results["identical"][0]
        for variant, (seconds, fusions) in results.items():
            print(f"{n_ops:4d}  {variant:12s}{seconds:10.2f}{fusions:9d}{seconds / base:10.2f}")


if __name__ == "__main__":
    main()
