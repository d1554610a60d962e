"""The Scalify paper's table on the sample char GPT: final losses per precision recipe.

Trains the sample GPT (Shakespeare, character level) from the same seed on the same
batches for N steps in each recipe, with no statistics recorded (no probe: a numerics
benchmark), and prints a Markdown table: final training loss (mean of the last 5 % of
steps), validation loss, gap to fp32 in %, steps/s. Rows:

- ``fp32``: FP32 weights and AdamW state, plain JAX;
- ``fp16``: scalified, FP16 master weights and FP16 AdamW state;
- ``fp8``: scalified, E4M3 forward / E5M2 backward matmul casts (each cast input re-centred),
  FP16 master weights, FP32 AdamW state;
- ``fp8-fp16-opt``: the same FP8 recipe with FP16 AdamW state (``scalescope train
  --precision fp8``);
- ``fp8-naive``: the same FP8 casts on plain values, no scale propagation (FP32 weights and
  state, so only the casts differ from fp32);
- ``unit-fp8``: static unit scaling instead of scalify: the same plain GPT transformed by
  ``ss.unit_scale``, unit-std weights, the same FP8 casts, FP32 weights and state, peak
  learning rate 0.1 (re-tuned, as the unit-scaling library does: see
  `sample_models.precision`).

Goal (the Scalify paper's bar: GPT-2 168M on WikiText-103, training loss FP32 2.87, FP8
2.92-2.93, i.e. +1.7 to +2.1 %): scalified fp8 within 2 % of fp32, naive fp8 clearly worse.

    python benchmarks/bench_numerics.py [--steps 1000] [--layers 2] [--d-model 128]
        [--data {auto,vendored}] [--rows fp32,fp8,...] [--json out.json] [--check]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

GOAL_GAP_PCT = 2.0  # scalified fp8 within this of fp32 (the paper's bar)
NAIVE_WORSE_PCT = 5.0  # naive fp8 "clearly worse": at least this far above fp32, or NaN
PAPER = (
    "Scalify paper (GPT-2 168M, WikiText-103, train loss): FP32 2.87, FP8 2.92-2.93 (+1.7-2.1 %)"
)


@dataclass(frozen=True)
class Row:
    """One line of the table: a `sample_models` recipe and its AdamW state dtype."""

    name: str
    precision: str  # a `sample_models.precision` recipe
    opt_state_dtype: str | None  # None: the parameters' dtype
    weights: str
    state: str
    what: str


ROWS: dict[str, Row] = {
    r.name: r
    for r in (
        Row("fp32", "fp32", None, "fp32", "fp32", "FP32 baseline, plain JAX"),
        Row("fp16", "fp16", None, "fp16", "fp16", "scalified FP16"),
        Row("fp8", "fp8", "float32", "fp16", "fp32", "scalified FP8 matmuls (E4M3 fwd, E5M2 bwd)"),
        Row("fp8-fp16-opt", "fp8", None, "fp16", "fp16", "scalified FP8, FP16 optimizer state"),
        Row("fp8-naive", "fp8-naive", None, "fp32", "fp32", "the same FP8 casts, no scalify"),
        Row("unit-fp8", "unit-fp8", None, "fp32", "fp32", "unit-scaled model (static), FP8 casts"),
    )
}
DEFAULT_ROWS = tuple(ROWS)


def gap_pct(value: float | None, ref: float | None) -> float | None:
    """``100 * (value - ref) / ref``; None when either is missing; inf when ``value`` is
    not finite (a diverged run)."""
    if value is None or ref is None or not math.isfinite(ref) or ref == 0:
        return None
    if not math.isfinite(value):
        return math.inf
    return 100.0 * (value - ref) / ref


def add_gaps(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each result with ``train_gap_pct`` and ``val_gap_pct`` against the ``fp32`` row."""
    ref = next((r for r in results if r["row"] == "fp32"), None)
    out = []
    for r in results:
        out.append(
            {
                **r,
                "train_gap_pct": gap_pct(r.get("train_loss"), ref and ref.get("train_loss")),
                "val_gap_pct": gap_pct(r.get("val_loss"), ref and ref.get("val_loss")),
            }
        )
    return out


def _num(x: float | None, fmt: str = "{:.4f}") -> str:
    if x is None:
        return "–"
    if not math.isfinite(x):
        return "nan" if math.isnan(x) else ("+inf" if x > 0 else "-inf")
    return fmt.format(x)


def _pct(x: float | None) -> str:
    if x is None:
        return "–"
    if math.isinf(x):
        return "diverged"
    return f"{0.0 if abs(x) < 0.005 else x:+.2f} %"


def format_table(results: list[dict[str, Any]]) -> str:
    """A Markdown table of results (with gaps, see `add_gaps`)."""
    head = (
        "| precision | weights / opt state | train loss | val loss | gap to fp32 (train) "
        "| gap to fp32 (val) | steps/s |"
    )
    lines = [head, "|---|---|---:|---:|---:|---:|---:|"]
    for r in results:
        row = ROWS.get(r["row"])
        state = f"{row.weights} / {row.state}" if row else "?"
        nan = f" (NaN from step {r['nan_step']})" if r.get("nan_step") is not None else ""
        ref = "(ref)" if r["row"] == "fp32" else ""
        lines.append(
            f"| {r['row']} | {state} | {_num(r.get('train_loss'))}{nan} | "
            f"{_num(r.get('val_loss'))} | {ref or _pct(r.get('train_gap_pct'))} | "
            f"{ref or _pct(r.get('val_gap_pct'))} | {_num(r.get('steps_per_s'), '{:.2f}')} |"
        )
    return "\n".join(lines)


def goal(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The goal's verdicts: ``fp8_ok`` (scalified fp8 within 2 % of fp32 on both losses),
    ``naive_worse`` (naive fp8 at least 5 % worse on validation, or diverged), each None
    when its rows were not run; ``lines``: the verdicts as text."""
    by = {r["row"]: r for r in results}
    lines, fp8_ok, naive_worse = [PAPER], None, None

    def worst(r: dict[str, Any]) -> float | None:
        gaps = [g for g in (r.get("train_gap_pct"), r.get("val_gap_pct")) if g is not None]
        return max(gaps) if gaps else None

    for name in ("fp8", "fp8-fp16-opt"):
        if name in by and worst(by[name]) is not None:
            ok = worst(by[name]) <= GOAL_GAP_PCT
            if name == "fp8":
                fp8_ok = ok
            lines.append(
                f"goal: scalified {name} within {GOAL_GAP_PCT:g} % of fp32 (at most that much "
                f"above it, train and val): "
                f"{'PASS' if ok else 'FAIL'} (train {_pct(by[name]['train_gap_pct'])}, "
                f"val {_pct(by[name]['val_gap_pct'])})"
            )
    if "fp8-naive" in by and by["fp8-naive"].get("val_gap_pct") is not None:
        g = by["fp8-naive"]["val_gap_pct"]
        naive_worse = g >= NAIVE_WORSE_PCT
        lines.append(
            f"goal: naive fp8 clearly worse (val gap >= {NAIVE_WORSE_PCT:g} % or diverged): "
            f"{'PASS' if naive_worse else 'FAIL'} (val {_pct(g)})"
        )
    return {"fp8_ok": fp8_ok, "naive_worse": naive_worse, "lines": lines}


def machine() -> dict[str, Any]:
    import jax

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "devices": [str(d) for d in jax.devices()],
        "jax": jax.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def run_row(row: Row, args: argparse.Namespace, log=sys.stderr) -> dict[str, Any]:
    """Train one recipe for ``args.steps`` steps without recording; final losses and speed."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import scalescope as ss
    from scalescope.sample_models.precision import SCALIFIED
    from scalescope.sample_models.train import (
        TrainConfig,
        learning_rate_schedule,
        make_adamw,
        make_task,
        peak_learning_rate,
    )
    from scalescope.sample_models.train_step import make_train_step

    cfg = TrainConfig(
        model="gpt",
        precision=row.precision,
        steps=args.steps,
        seed=args.seed,
        batch=args.batch,
        eval_batches=args.eval_batches,
        data=args.data,
        gpt={
            "seq_len": args.seq_len,
            "d_model": args.d_model,
            "n_heads": args.heads,
            "n_layers": args.layers,
        },
        opt_state_dtype=row.opt_state_dtype,
        learning_rate=args.lr,
    )
    task = make_task(cfg)  # same seed: same initial weights (up to dtype), same batches
    scalified = cfg.precision in SCALIFIED
    opt = make_adamw(cfg, learning_rate_schedule(cfg))
    step = make_train_step(task.loss_fn, opt)
    params, opt_state = task.params, opt.init(task.params)
    if scalified:
        step, loss_fn = ss.scalify(step), ss.scalify(task.loss_fn)
        params, opt_state = ss.as_scaled_array(params, "rms"), ss.as_scaled_array(opt_state, "rms")
    else:
        loss_fn = task.loss_fn

    def to_float(x: Any) -> float:
        return float(np.asarray(ss.asarray(x), np.float64))

    def next_batch() -> dict[str, Any]:
        return {k: jnp.asarray(v) for k, v in next(task.train_batches).items()}

    first = next_batch()
    t0 = time.perf_counter()
    step_c = jax.jit(step).lower(params, opt_state, first).compile()
    compile_s = time.perf_counter() - t0
    losses = []
    report_every = max(1, args.steps // 10)
    t0 = time.perf_counter()
    batch = first
    for i in range(args.steps):
        params, opt_state, loss = step_c(params, opt_state, batch)
        losses.append(loss)
        if i + 1 < args.steps:
            batch = next_batch()
        if (i + 1) % report_every == 0 or i + 1 == args.steps:
            elapsed = time.perf_counter() - t0
            print(
                f"  {row.name}: step {i + 1}/{args.steps}  loss {to_float(loss):.4f}  "
                f"{(i + 1) / elapsed:.2f} steps/s",
                file=log,
                flush=True,
            )
    jax.block_until_ready((params, opt_state, losses[-1]))
    elapsed = time.perf_counter() - t0
    values = np.array([to_float(x) for x in losses])
    bad = np.flatnonzero(~np.isfinite(values))
    tail = values[-max(1, len(values) // 20) :]
    eval_fn = jax.jit(loss_fn)
    val = float(np.mean([to_float(eval_fn(params, b)) for b in task.eval_batches]))
    return {
        "row": row.name,
        "precision": row.precision,
        "scalify": scalified,
        "weights": row.weights,
        "opt_state": row.state,
        "steps": args.steps,
        "lr": peak_learning_rate(cfg),
        "train_loss": float(np.mean(tail)),
        "val_loss": val,
        "nan_step": int(bad[0]) if bad.size else None,
        "steps_per_s": args.steps / elapsed,
        "compile_s": compile_s,
        "dataset": task.info["dataset"],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1000, help="training steps per recipe")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-batches", type=int, default=8, help="validation batches")
    p.add_argument(
        "--data",
        choices=("auto", "vendored"),
        default="auto",
        help="auto: the full Shakespeare corpus (downloaded once), else the vendored subset",
    )
    p.add_argument(
        "--rows",
        default=",".join(DEFAULT_ROWS),
        help=f"comma-separated recipes to run, from {','.join(ROWS)}",
    )
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="peak learning rate for every row run (default: each recipe's own, 2e-3; 0.1 "
        "for unit-fp8); for sweeps, one row at a time",
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--check", action="store_true", help="exit 1 if a goal fails")
    args = p.parse_args(argv)
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in args.rows if r not in ROWS]
    if unknown:
        p.error(f"unknown rows {unknown}; expected some of {list(ROWS)}")
    if args.steps < 1:
        p.error("--steps must be positive")
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        p.error(f"--lr must be a positive number, got {args.lr}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python benchmarks/bench_numerics.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    info = machine()
    print(
        f"# bench_numerics  jax {info['jax']}  {info['devices'][0]}  {info['cpu']}  "
        f"({info['cores']} cores)  GPT {args.layers}x{args.d_model}, seq {args.seq_len}, "
        f"batch {args.batch}, {args.steps} steps, seed {args.seed}, data {args.data}",
        flush=True,
    )
    t0 = time.perf_counter()
    results = []
    for name in args.rows:
        print(f"{name}: {ROWS[name].what}", file=sys.stderr, flush=True)
        results.append(run_row(ROWS[name], args))
    results = add_gaps(results)
    verdict = goal(results)
    total = time.perf_counter() - t0
    print(f"dataset: {results[0]['dataset']}; wall time {total / 60:.1f} min (compile: ", end="")
    print(", ".join(f"{r['row']} {r['compile_s']:.0f} s" for r in results) + ")")
    print(format_table(results))
    print("\n".join(verdict["lines"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "command": command.strip(),
                    "machine": info,
                    "args": vars(args),
                    "rows": {name: asdict(ROWS[name]) for name in args.rows},
                    "results": results,
                    "goal": verdict,
                    "wall_s": total,
                },
                f,
                indent=2,
            )
    failed = verdict["fp8_ok"] is False or verdict["naive_worse"] is False
    return 1 if args.check and failed else 0


if __name__ == "__main__":
    sys.exit(main())
