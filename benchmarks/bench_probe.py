"""Cost of the probe on the sample GPT training step, measured side by side in one process.

Prints, for the scalified step and the instrumented step (every op, histograms on,
e4m3/e5m2/fp16/bf16, exact statistics: the defaults): trace+compile time, steady-state
step time, and the compiled step's temporaries (``memory_analysis()``), with their ratios
to the scalified step. Then the distance to the floor: the bytes the probe reads per step,
its effective bandwidth (bytes over the time it adds), and the bandwidth of a plain
``jnp.sum`` over as many bytes on the same machine. Goals (issue "The probe cheap enough
to leave on"): step <= 4x (stretch 2x), compile <= 2.5x, temporaries <= 1.25x.

    python benchmarks/bench_probe.py [--layers 2] [--d-model 128] [--scan] [--quick]
    python benchmarks/bench_probe.py --layers 6 --d-model 384 --seq 256 --scan   # nanoGPT
    python benchmarks/bench_probe.py --quick --recipes   # the cost of the eight recipes
    python benchmarks/bench_probe.py --kernel xla --quick --compile-only   # the GPU's path
    python benchmarks/bench_probe.py ... --compile-repeats 3   # compile goals, shared machine
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
from scalescope.core.recipes import names as recipe_names
from scalescope.probe import native
from scalescope.sample_models.gpt import GPTConfig, gpt_loss, init_gpt
from scalescope.sample_models.precision import PRECISIONS
from scalescope.sample_models.train_step import make_optimizer, make_train_step

GOALS = {"step": 4.0, "compile": 2.5, "temp": 1.25}


def _measure(fn, args, n_steps: int, repeats: int = 1) -> tuple[float, float, int, int]:
    """(trace + compile seconds, median seconds per step, temporary bytes, output bytes);
    the step time is NaN when ``n_steps`` is 0 (compile only). With ``repeats`` > 1 the
    program is traced and compiled that many times from scratch and the fastest counts
    (a compile is the same work each time: the fastest is the least disturbed by a
    shared machine, where one compile varies by +-20 %)."""
    times = []
    for _ in range(repeats):
        # a new function (no trace cache hit) named as fn, as jax.jit(fn) names its
        # program: the persistent cache (`--compile-cache`) then serves the same
        # computation compiled by another script, whose key begins with the name
        fresh = functools.wraps(fn)(lambda *a: fn(*a))
        t0 = time.perf_counter()
        compiled = jax.jit(fresh).lower(*args).compile()
        times.append(time.perf_counter() - t0)
    compile_s = min(times)
    mem = compiled.memory_analysis()
    temp = int(getattr(mem, "temp_size_in_bytes", 0)) if mem is not None else 0
    out = int(getattr(mem, "output_size_in_bytes", 0)) if mem is not None else 0
    if n_steps == 0:
        return compile_s, float("nan"), temp, out
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(n_steps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return compile_s, float(np.median(times)), temp, out


def _sum_bandwidth(n_bytes: int) -> float:
    """Bytes per second of a jitted ``jnp.sum`` over ``n_bytes`` of float32."""
    n = max(1, n_bytes // 4)
    x = jnp.ones((n,), jnp.float32)
    f = jax.jit(jnp.sum)
    jax.block_until_ready(f(x))
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        times.append(time.perf_counter() - t0)
    return n * 4 / float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    parser.add_argument("--heads", type=int, default=None, help="default: max(4, d_model/64)")
    parser.add_argument("--scan", action="store_true", help="layers under lax.scan")
    parser.add_argument("--precision", default="fp8", choices=sorted(PRECISIONS))
    parser.add_argument("--quick", action="store_true", help="only the two main variants")
    parser.add_argument(
        "--compile-repeats",
        type=int,
        default=1,
        help="compile each program this many times, the fastest counts (3 for goals on a "
        "shared machine)",
    )
    parser.add_argument(
        "--recipes",
        action="store_true",
        help="also the statistics program with all eight block-scaled recipes (goal: <= 2x "
        "the one without)",
    )
    parser.add_argument(
        "--kernel",
        default="auto",
        choices=("auto", "native", "xla"),
        help="the probe's kernel: xla is the path a GPU takes (SCALESCOPE_PROBE_KERNEL)",
    )
    parser.add_argument(
        "--compile-only",
        action="store_true",
        help="compile time and memory only, no timed steps (large models on a small CPU)",
    )
    add_option(parser)
    args = parser.parse_args()
    apply(args)
    os.environ["SCALESCOPE_PROBE_KERNEL"] = args.kernel
    n_steps = 0 if args.compile_only else args.steps

    cfg = GPTConfig(
        vocab_size=65,
        seq_len=args.seq,
        d_model=args.d_model,
        n_heads=args.heads or max(4, args.d_model // 64),
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

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"# bench_probe  jax {jax.__version__}  {jax.devices()[0].platform}  "
        f"{platform.processor() or platform.machine()}  {os.cpu_count()} cores  "
        f"load {load:.2f}"
    )
    print(
        f"# GPT: {args.layers} layers, d={args.d_model}, seq={args.seq}, batch={args.batch}, "
        f"{'scan' if args.scan else 'unrolled'}, precision={args.precision}, AdamW step, "
        f"probe kernel {args.kernel} ({'native' if native.use_native() else 'xla'} taken)"
    )
    base_steps = max(n_steps, 5) if n_steps else 0
    base_c, base_t, base_m, base_o = _measure(
        ss.scalify(step), step_args, base_steps, args.compile_repeats
    )
    # the default variant first: its trace gives the op table (no abstract pass of its own)
    default = ss.instrument(step)
    measured = {"all ops, histograms (default)": _measure(
        default, step_args, n_steps, args.compile_repeats
    )}  # fmt: skip
    table = default.op_table(*step_args)
    recorded = [op for op in table if op.recorded]
    elements = sum(int(np.prod(op.shape)) * op.n_rows for op in recorded)
    n_bytes = sum(
        int(np.prod(op.shape)) * op.n_rows * np.dtype(jnp.dtype(op.dtype)).itemsize
        for op in recorded
    )
    aliases = sum(op.note == "alias" for op in table)
    print(
        f"# {len(table)} ops, {len(recorded)} recorded ({aliases} aliases of another), "
        f"{table.n_rows} rows, {elements / 1e6:.1f} M elements = {n_bytes / 2**20:.0f} MiB "
        "measured per step"
    )
    variants = [("all ops, histograms (default)", {})]
    # The shadow copy behind a barrier that makes `out` bit-identical (a second evaluation).
    variants.append(("isolate=True (bit-identical out)", {"isolate": True}))
    # What Run.track compiles for recorded steps: the statistics alone, in a program of its
    # own (the outputs come from the plain program, bit for bit).
    variants.append(("Run.track statistics program", {"isolate": False, "_stats_only": True}))
    if args.recipes:
        every_recipe = ("e4m3", "e5m2", "fp16", "bf16", *recipe_names())
        variants.append(
            (
                "Run.track stats + 8 recipes",
                {"isolate": False, "_stats_only": True, "formats": every_recipe},
            )  # fmt: skip
        )
    if not args.quick:
        variants.append(("all ops, no histograms", {"histograms": False}))
        variants += [
            ("sample=4096, histograms", {"sample": 4096}),
            ("select dot_general", {"select": "dot_general"}),
        ]
    # "temp+out": the memory a program needs beyond its arguments. The statistics program
    # computes the step's outputs and drops them, so they count among its temporaries,
    # while the step returns them: compare footprints, not temporaries alone, there.
    head = f"{'variant':34s}{'compile s':>10s}{'step ms':>10s}{'temp MiB':>10s}{'out MiB':>9s}"
    print(head + f"{'step x':>8s}{'compile x':>10s}{'temp x':>8s}{'temp+out x':>11s}")
    base_f = max(base_m + base_o, 1)
    print(
        f"{'scalified step (baseline)':34s}{base_c:10.2f}{base_t * 1e3:10.2f}"
        f"{base_m / 2**20:10.1f}{base_o / 2**20:9.1f}{1.0:8.2f}{1.0:10.2f}{1.0:8.2f}{1.0:11.2f}"
    )
    results = {}
    for label, kw in variants:
        kw = dict(kw)
        stats_only = kw.pop("_stats_only", False)
        if label in measured:
            c, t, m, o = measured[label]
        else:
            inst = ss.instrument(step, **kw)
            # (named as the step: `Run.track`'s statistics program is the same one)
            fn = functools.wraps(inst)(lambda *a, inst=inst: inst(*a)[1]) if stats_only else inst
            c, t, m, o = _measure(fn, step_args, n_steps, args.compile_repeats)
        results[label] = (c, t, m, o)
        print(
            f"{label:34s}{c:10.2f}{t * 1e3:10.2f}{m / 2**20:10.1f}{o / 2**20:9.1f}"
            f"{t / base_t:8.2f}{c / base_c:10.2f}{m / max(base_m, 1):8.2f}"
            f"{(m + o) / base_f:11.2f}",
            flush=True,
        )
    if n_steps:
        added = max(results["Run.track statistics program"][1] - base_t, 1e-9)
        sum_bw = _sum_bandwidth(n_bytes)
        print(
            f"# floor: the probe reads {n_bytes / 2**20:.0f} MiB per step; over the "
            f"{added * 1e3:.1f} ms it adds that is {n_bytes / added / 2**30:.2f} GiB/s; a "
            f"plain jnp.sum over as many bytes runs at {sum_bw / 2**30:.2f} GiB/s "
            f"({n_bytes / sum_bw * 1e3:.1f} ms)"
        )
    kernel_s, calls = native.clock()
    if calls:
        print(f"# native kernel: {kernel_s / calls * 1e3:.3f} ms per call on average")
    verdict = lambda r, g: "met" if r <= g else "MISSED"
    if args.recipes:
        plain_t = results["Run.track statistics program"][1]
        with_t = results["Run.track stats + 8 recipes"][1]
        ratio = with_t / plain_t
        print(
            f"# recipes: the statistics program with all eight recipes takes {ratio:.2f}x the "
            f"one without (goal <= 2.0 {verdict(ratio, 2.0)})"
        )
    for label in ("all ops, histograms (default)", "Run.track statistics program"):
        c, t, m, o = results[label]
        # A recorded Run step runs the plain program and the statistics program.
        step_x = t / base_t if label.startswith("all") else (t + base_t) / base_t
        mem_x = m / max(base_m, 1)
        memory = f"temporaries {mem_x:.2f}x <= {GOALS['temp']} {verdict(mem_x, GOALS['temp'])}"
        if not label.startswith("all"):  # it drops the outputs the step returns
            foot_x = (m + o) / base_f
            memory += (
                f" (footprint, temporaries + outputs: {foot_x:.2f}x "
                f"{verdict(foot_x, GOALS['temp'])})"
            )
        step = (
            f"step {step_x:.2f}x <= {GOALS['step']} {verdict(step_x, GOALS['step'])}"
            if n_steps
            else "step not timed"
        )
        print(
            f"# goals, {label}: {step}; compile {c / base_c:.2f}x <= "
            f"{GOALS['compile']} {verdict(c / base_c, GOALS['compile'])}; {memory}"
        )


if __name__ == "__main__":
    main()
