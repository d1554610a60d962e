"""A GPT-2-small-sized step recorded on this machine: what a real model costs end to end.

The sample GPT at GPT-2-small size (12 layers, d=768, 12 heads, seq 256, batch 4, the
char vocabulary, layers under `lax.scan`; ``--unrolled`` for one traced copy per layer),
run in one process, phase after phase:

* the plain FP32 step, the scalified FP8 step and ``jit(ss.instrument(step))``:
  trace+compile seconds, seconds per step, the compiled step's temporaries;
* the op table: ops, recorded values, rows, elements measured per step, time to build;
* a recording `ss.Run` (``every=1``): registration and compilation (``warmup``), seconds
  per recorded step, the writer's close, and the run's size on disk per recorded step;
* reading it back: `open_run`, the wide statistics frame, the advisor, and the reader's
  memory;
* the process's peak resident memory after each phase.

Nothing is asserted; figures are printed with the machine's load average.

    python benchmarks/bench_scale.py [--layers 12] [--d-model 768] [--heads 12]
        [--seq 256] [--batch 4] [--records 3] [--unrolled]
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import resource
import shutil
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from _compile_cache import add_option, apply
from bench_probe import _measure  # (run as a script: benchmarks/ is on the path)

import scalescope as ss
from scalescope.sample_models.gpt import GPTConfig, gpt_loss, init_gpt
from scalescope.sample_models.precision import PRECISIONS
from scalescope.sample_models.train_step import make_optimizer, make_train_step


def _peak_mib() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rss_mib() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:  # not Linux
        return float("nan")


def _compile_and_time(fn, args, n_steps: int) -> tuple[float, float, float]:
    """(trace+compile s, median s per step, temporaries MiB): bench_probe's measure."""
    compile_s, step_s, temp, _ = _measure(fn, args, n_steps)
    return compile_s, step_s, temp / 2**20


def _dir_bytes(path: Path, sub: str = "") -> int:
    root = path / sub if sub else path
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _line(label: str, value: str) -> None:
    print(f"{label:44s}{value}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per compiled step")
    parser.add_argument("--records", type=int, default=3, help="recorded steps of the Run")
    parser.add_argument("--unrolled", action="store_true", help="layers unrolled, not scanned")
    parser.add_argument("--skip-instrument", action="store_true", help="no ss.instrument step")
    parser.add_argument("--out", default=None, help="keep the run here (default: a temp dir)")
    add_option(parser)
    args = parser.parse_args()
    apply(args)

    cfg = GPTConfig(
        vocab_size=65,
        seq_len=args.seq,
        d_model=args.d_model,
        n_heads=args.heads,
        n_layers=args.layers,
        scan_layers=not args.unrolled,
    )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"# bench_scale  jax {jax.__version__}  {jax.devices()[0].platform}  "
        f"{platform.processor() or platform.machine()}  {os.cpu_count()} cores  "
        f"load {load:.2f}"
    )
    print(
        f"# GPT {args.layers} layers, d={args.d_model}, {args.heads} heads, seq {args.seq}, "
        f"batch {args.batch}, {'unrolled' if args.unrolled else 'scan'}; AdamW step"
    )
    opt = make_optimizer()
    rng = np.random.default_rng(0)
    batch = {
        k: jnp.asarray(rng.integers(0, 65, (args.batch, args.seq)), jnp.int32)
        for k in ("inputs", "targets")
    }
    fp32, fp8 = PRECISIONS["fp32"], PRECISIONS["fp8"]
    params = init_gpt(jax.random.key(0), cfg)
    n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
    _line("parameters", f"{n_params / 1e6:.1f} M")

    plain = make_train_step(functools.partial(gpt_loss, cfg=cfg, precision=fp32), opt)
    c0, t0, m0 = _compile_and_time(plain, (params, opt.init(params), batch), args.steps)
    _line("plain FP32 step", f"compile {c0:7.1f} s  step {t0:7.2f} s  temp {m0:8.0f} MiB")
    _line("  peak host memory", f"{_peak_mib():.0f} MiB")

    params8 = jax.tree.map(lambda a: a.astype(fp8.param_dtype), params)
    step = make_train_step(functools.partial(gpt_loss, cfg=cfg, precision=fp8), opt)
    step_args = (
        ss.as_scaled_array(params8, "rms"),
        ss.as_scaled_array(opt.init(params8), "rms"),
        batch,
    )
    c1, t1, m1 = _compile_and_time(ss.scalify(step), step_args, args.steps)
    _line(
        "scalified FP8 step",
        f"compile {c1:7.1f} s  step {t1:7.2f} s  temp {m1:8.0f} MiB"
        f"  ({c1 / c0:.2f}x / {t1 / t0:.2f}x / {m1 / m0:.2f}x plain)",
    )
    _line("  peak host memory", f"{_peak_mib():.0f} MiB")

    t = time.perf_counter()
    table = ss.instrument(step).op_table(*step_args)
    table_s = time.perf_counter() - t
    recorded = [op for op in table if op.recorded]
    elements = sum(int(np.prod(op.shape)) * op.n_rows for op in recorded)
    _line(
        "op table",
        f"{len(table)} ops, {len(recorded)} recorded, {table.n_rows} rows, "
        f"{elements / 1e9:.2f} G elements per step; built in {table_s:.1f} s",
    )

    if not args.skip_instrument:
        c2, t2, m2 = _compile_and_time(ss.instrument(step), step_args, args.steps)
        _line(
            "jit(ss.instrument(step))",
            f"compile {c2:7.1f} s  step {t2:7.2f} s  temp {m2:8.0f} MiB"
            f"  ({c2 / c1:.2f}x / {t2 / t1:.2f}x / {m2 / m1:.2f}x scalified)",
        )
        _line("  peak host memory", f"{_peak_mib():.0f} MiB")

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench_scale_"))
    run_dir = out / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    run = ss.Run(run_dir, every=1)
    tracked = run.track(step)
    t = time.perf_counter()
    tracked.warmup(*step_args)
    warm_s = time.perf_counter() - t
    _line("Run: register + compile both programs", f"{warm_s:.1f} s")
    times = []
    p, o = step_args[0], step_args[1]
    for i in range(args.records):
        t = time.perf_counter()
        p, o, loss = jax.block_until_ready(tracked(p, o, batch))
        times.append(time.perf_counter() - t)
        run.log(i, loss=loss)
    t = time.perf_counter()
    run.close()
    close_s = time.perf_counter() - t
    rec_s = float(np.median(times))
    _line(
        "Run: recorded step (plain + statistics)",
        f"{rec_s:.2f} s ({rec_s / t1:.2f}x the scalified step); close {close_s:.2f} s",
    )
    stats_bytes = _dir_bytes(run_dir, "stats")
    _line(
        "Run: size on disk",
        f"{stats_bytes / args.records / 2**20:.2f} MiB of statistics per recorded step; "
        f"ops.parquet {(run_dir / 'ops.parquet').stat().st_size / 2**10:.0f} KiB; "
        f"total {_dir_bytes(run_dir) / 2**20:.1f} MiB",
    )
    _line("  peak host memory", f"{_peak_mib():.0f} MiB")

    before = _rss_mib()
    t = time.perf_counter()
    reader = ss.open_run(run_dir)
    wide = reader.stats(wide=True, steps=slice(None))
    read_s = time.perf_counter() - t
    t = time.perf_counter()
    findings = reader.advise()
    advise_s = time.perf_counter() - t
    _line(
        "reader: open + wide frame",
        f"{read_s:.2f} s, {len(wide)} rows x {wide.shape[1]} columns, "
        f"+{_rss_mib() - before:.0f} MiB resident",
    )
    _line("reader: advisor", f"{advise_s:.2f} s, {len(findings)} findings")
    _line("peak host memory (whole run)", f"{_peak_mib():.0f} MiB")
    if not args.out:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
