"""The intervention table: does the what-if's verdict of a recipe match what training does?

For a sample model (the GPT and the MLP of ``scalescope train``), one FP32 run is recorded
with every recipe audited. Then each linear layer (a forward matmul reading a weight; for
the GPT the same matmul of every block together) is held, in turn, in each recipe: its
forward operands (``fwd``: activation and weight) or the gradients its backward matmuls
read (``bwd``), as the matmuls read them (``recipe@matmul``: the optimizer and the
residual path keep the values as computed), with `scalescope.emulate`, for ``--steps``
steps from the same initial state on the same batches as the plain FP32 training.

The what-if predicts **unsafe** when it calls the recipe unsafe for any value held.
Training measures **unsafe** when the mean loss of the last tenth of the steps ends more
than the model's gap threshold above the plain run's (or NaN). BF16 rows are the control:
the gap a harmless rounding makes, the noise floor of one trajectory against another.

    python benchmarks/bench_verdicts.py --interventions [--models gpt,mlp] [--steps 300]
        [--recipes ...] [--out DIR] [--json out.json]

Prints one row per (model, layer, direction, recipe): predicted, measured gap, agreement;
then the agreement per recipe and overall, and the step time of the emulated step over
the plain one (median over the run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

#: A held layer whose loss ends more than this far (%) above plain FP32's is unsafe.
GAP_PCT = 0.5
#: Recipes of the table, and BF16 as the control.
RECIPES = (
    "e4m3_tensor",
    "mxfp8_e4m3",
    "mxfp8_e5m2",
    "mxfp8_e4m3_rceil",
    "mxfp4",
    "nvfp4",
    "fp8_block128",
    "fp8_block128x128",
)
CONTROL = "bf16"


def record_reference(model: str, steps: int, seed: int, root: Path) -> Path:
    """The model's FP32 run, every recipe audited (trained once, reused after)."""
    import scalescope as ss
    from sample_models.train import TrainConfig, train

    run = root / f"{model}-fp32-recipes"
    if run.exists():
        reader = ss.open_run(run)
        if reader.status == "closed" and len(reader.steps):
            return run
        import shutil

        shutil.rmtree(run)
    cfg = TrainConfig(model=model, precision="fp32", steps=steps, seed=seed)
    formats = ("e4m3", "e5m2", "fp16", "bf16", *RECIPES)
    t0 = time.perf_counter()
    train(cfg, str(run), every=max(1, steps // 10), formats=formats, progress=False)
    print(f"  recorded {run.name} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return run


def _setup(model: str, steps: int, seed: int):
    """The plain FP32 step, its initial state and the first ``steps`` batches, as
    ``scalescope train`` builds them."""
    import jax.numpy as jnp

    from sample_models.train import TrainConfig, make_adamw, make_task
    from sample_models.train_step import make_train_step

    cfg = TrainConfig(model=model, precision="fp32", steps=steps, seed=seed)
    task = make_task(cfg)
    opt = make_adamw(cfg)
    step = make_train_step(task.loss_fn, opt)
    state = (task.params, opt.init(task.params))
    batches = [
        {k: jnp.asarray(v) for k, v in next(task.train_batches).items()} for _ in range(steps)
    ]
    return step, state, batches


def _train(fn, state, batches) -> tuple[np.ndarray, float]:
    """Losses of ``fn`` over the batches, and its median step time (after the first)."""
    losses, times = [], []
    for batch in batches:
        t0 = time.perf_counter()
        *state, loss = fn(*state, batch)
        losses.append(float(loss))
        times.append(time.perf_counter() - t0)
    return np.asarray(losses), float(np.median(times[1:])) if len(times) > 1 else math.nan


def tail_gap(loss: np.ndarray, ref: np.ndarray) -> float:
    """(loss - ref) / ref in %, each the mean of its last tenth; inf when NaN."""
    tail = max(1, len(ref) // 10)
    a, b = np.mean(loss[-tail:]), np.mean(ref[-tail:])
    return 100.0 * (a - b) / b if np.isfinite(a) else math.inf


def intervene(model: str, args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    import jax

    import scalescope as ss
    from scalescope.analysis import format_whatif, predict_policy, predicted_verdict
    from scalescope.analysis.policies import matmul_policy, matmul_table

    run = record_reference(model, args.steps, args.seed, root)
    reader = ss.open_run(run)
    whatif = format_whatif(reader.stats(wide=True), reader.ops, meta=reader.meta)
    merge = model == "gpt"  # the GPT's blocks share their layers' roles; the MLP's do not
    layers = matmul_table(reader.ops, merge=merge)
    layers = sorted(set(layers[layers["params"]]["layer"]), key=list(layers["layer"]).index)
    step, state, batches = _setup(model, args.steps, args.seed)
    ref, t_plain = _train(jax.jit(step), state, batches)
    print(f"  {model}: plain fp32 loss {np.mean(ref[-len(ref) // 10 :]):.4f}", file=sys.stderr)
    rows = []
    for layer in layers:
        for direction in ("fwd", "bwd"):
            for recipe in (*args.recipes, CONTROL):
                policy = matmul_policy(reader.ops, layer, recipe, direction=direction, merge=merge)
                predicted = predicted_verdict(predict_policy(policy, whatif, reader.ops))
                t0 = time.perf_counter()
                loss, t_step = _train(jax.jit(ss.emulate(step, policy)), state, batches)
                gap = tail_gap(loss, ref)
                measured = "unsafe" if not gap <= GAP_PCT else "safe"
                row = {
                    "model": model,
                    "layer": layer,
                    "direction": direction,
                    "recipe": recipe,
                    "values": len(policy),
                    "predicted": predicted,
                    "gap_pct": gap,
                    "measured": measured,
                    "agree": predicted == measured,
                    "step_ratio": t_step / t_plain,
                    "seconds": time.perf_counter() - t0,
                }
                rows.append(row)
                print(
                    f"  {model} {layer} {direction} {recipe}: predicted {predicted}, gap "
                    f"{gap:+.2f}% -> {measured}",
                    file=sys.stderr,
                )
    return rows


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return "NaN" if math.isnan(value) else "inf" if math.isinf(value) else f"{value:+.2f}"
    return str(value)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | layer | dir | recipe | predicted | loss gap % | measured | agree |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['layer']} | {r['direction']} | {r['recipe']} "
            f"| {r['predicted']} | {_cell(r['gap_pct'])} | {r['measured']} "
            f"| {'yes' if r['agree'] else 'NO'} |"
        )
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> str:
    """Agreement per recipe and overall (control rows apart), and the step-time ratio."""
    lines = [
        "| recipe | rows | agree | predicted unsafe | measured unsafe |",
        "|---|---|---|---|---|",
    ]
    for recipe in dict.fromkeys(r["recipe"] for r in rows):
        sel = [r for r in rows if r["recipe"] == recipe]
        lines.append(
            f"| {recipe} | {len(sel)} | {sum(r['agree'] for r in sel)} "
            f"| {sum(r['predicted'] == 'unsafe' for r in sel)} "
            f"| {sum(r['measured'] == 'unsafe' for r in sel)} |"
        )
    main = [r for r in rows if r["recipe"] != CONTROL]
    agree = sum(r["agree"] for r in main)
    ratio = np.median([r["step_ratio"] for r in rows]) if rows else math.nan
    lines.append(
        f"\nagreement {agree}/{len(main)} = {100.0 * agree / max(1, len(main)):.0f} % "
        f"(recipes; goal >= 90 %); emulated step / plain step: median {ratio:.2f}x"
    )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    root = Path(args.out) if args.out else Path("/tmp/bench-interventions")
    root.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for model in args.models:
        rows += intervene(model, args, root)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{platform.node()}  load {load:.1f}  steps {args.steps}  gap threshold {GAP_PCT} %")
    print(table(rows))
    print(summary(rows))
    return 0
