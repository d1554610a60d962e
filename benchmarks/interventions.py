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
than the row's gap threshold above the plain run's (or NaN). BF16 rows are the controls:
the gap a harmless rounding makes, the noise floor of one trajectory against another. A
model's threshold is twice the largest |gap| of its controls, at least 0.5 %.

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
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from scalescope.core import recipes as _recipes

#: A held layer whose loss ends more than this far (%) above plain FP32's is unsafe.
GAP_PCT = 0.5
#: Recipes of the table (every one scalescope knows), and BF16 as the control.
RECIPES = _recipes.names()
CONTROL = "bf16"


def record_reference(model: str, steps: int, seed: int, root: Path) -> Path:
    """The model's FP32 run, every recipe audited (trained once, reused after)."""
    import scalescope as ss
    from scalescope.sample_models.train import TrainConfig, train

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

    from scalescope.sample_models.train import TrainConfig, make_adamw, make_task
    from scalescope.sample_models.train_step import make_train_step

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
    from scalescope.analysis import format_whatif
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
    only = getattr(args, "layers", None)
    named = [(layer, layer) for layer in layers if only is None or re.search(only, layer)]
    if getattr(args, "all_layers", False):
        named.append(("all", layers))  # every linear layer at once
    for name, layer in named:
        for direction in ("fwd", "bwd"):
            for recipe in (*args.recipes, CONTROL):
                policy = matmul_policy(reader.ops, layer, recipe, direction=direction, merge=merge)
                predicted, evidence = predict(policy, whatif, reader.ops, recipe)
                t0 = time.perf_counter()
                loss, t_step = _train(jax.jit(ss.emulate(step, policy)), state, batches)
                gap = tail_gap(loss, ref)
                measured = "unsafe" if not gap <= GAP_PCT else "safe"
                row = {
                    "model": model,
                    "layer": name,
                    "direction": direction,
                    "recipe": recipe,
                    "values": len(policy),
                    "predicted": predicted,
                    **evidence,
                    "gap_pct": gap,
                    "measured": measured,
                    "agree": predicted == measured,
                    "step_ratio": t_step / t_plain,
                    "seconds": time.perf_counter() - t0,
                }
                rows.append(row)
                print(
                    f"  {model} {name} {direction} {recipe}: predicted {predicted}, gap "
                    f"{gap:+.2f}% -> {measured}",
                    file=sys.stderr,
                )
    return rows


def predict(policy, whatif, ops, recipe: str) -> tuple[str, dict[str, float]]:
    """The what-if's verdict of ``policy`` and its evidence: the worst SNR (dB),
    clipped and flushed fractions of ``recipe`` over the values held."""
    from scalescope.analysis import predict_policy, predicted_verdict

    prediction = predict_policy(policy, whatif, ops)
    ids = [int(ops["stats_op"].get(op, op)) for op in prediction["op"]]
    ids = [i for i in ids if i in whatif.index]
    group = whatif.loc[ids, recipe] if ids else None
    evidence = {
        "snr_db": float(group["snr"].min()) if group is not None else math.nan,
        "overflow": float(group["overflow"].max()) if group is not None else math.nan,
        "underflow": float(group["underflow"].max()) if group is not None else math.nan,
    }
    return predicted_verdict(prediction), evidence


def rejudge(rows: list[dict[str, Any]], root: Path, thresholds=None) -> list[dict[str, Any]]:
    """The rows' predictions again, from the recorded runs, under ``thresholds`` (the
    measured gaps stay): how a threshold change moves the agreement, without training."""
    import scalescope as ss
    from scalescope.analysis import format_whatif
    from scalescope.analysis.policies import matmul_policy, matmul_table

    out, cache = [], {}
    for row in rows:
        model = row["model"]
        if model not in cache:
            reader = ss.open_run(root / f"{model}-fp32-recipes")
            whatif = format_whatif(
                reader.stats(wide=True), reader.ops, meta=reader.meta, thresholds=thresholds
            )
            cache[model] = (reader, whatif)
        reader, whatif = cache[model]
        layer = row["layer"]
        if layer == "all":
            table = matmul_table(reader.ops, merge=model == "gpt")
            layer = list(dict.fromkeys(table[table["params"]]["layer"]))
        policy = matmul_policy(
            reader.ops, layer, row["recipe"], direction=row["direction"], merge=model == "gpt"
        )
        predicted, evidence = predict(policy, whatif, reader.ops, row["recipe"])
        new = {**row, "predicted": predicted, **evidence}
        new["agree"] = predicted == new["measured"]
        out.append(new)
    return out


def _key(row: dict[str, Any]) -> tuple[str, str, str]:
    return row["model"], row["layer"], row["direction"]


def measured_with(rows: list[dict[str, Any]], gap_pct: dict[Any, float]) -> list[dict[str, Any]]:
    """The rows measured again under a gap threshold (%) per (model, layer, direction)."""
    out = []
    for row in rows:
        limit = gap_pct.get(_key(row), GAP_PCT)
        measured = "unsafe" if not row["gap_pct"] <= limit else "safe"
        new = {**row, "threshold_pct": limit, "measured": measured}
        new["agree"] = row["predicted"] == measured
        out.append(new)
    return out


def noise_floor(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per model, the largest |gap| of its BF16 control rows (%)."""
    out: dict[str, float] = {}
    for row in rows:
        if row["recipe"] == CONTROL and math.isfinite(row["gap_pct"]):
            out[row["model"]] = max(out.get(row["model"], 0.0), abs(row["gap_pct"]))
    return out


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return "NaN" if math.isnan(value) else "inf" if math.isinf(value) else f"{value:+.2f}"
    return str(value)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | layer | dir | recipe | worst SNR dB | clipped | flushed | predicted "
        "| loss gap % | threshold % | measured | agree |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['layer']} | {r['direction']} | {r['recipe']} "
            f"| {r.get('snr_db', math.nan):.1f} | {r.get('overflow', math.nan):.2e} "
            f"| {r.get('underflow', math.nan):.2e} "
            f"| {r['predicted']} | {_cell(r['gap_pct'])} | {r.get('threshold_pct', GAP_PCT):.2f} "
            f"| {r['measured']} "
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


#: A model's gap threshold is this many times its noise floor (the largest |gap| of its
#: BF16 controls), and at least `GAP_PCT`. The floor is the model's: how far two of its
#: trajectories drift apart does not depend on which layer is perturbed, and one control
#: alone underestimates it (the MLP's six controls: 0.03 % to 1.75 %).
NOISE_FACTOR = 2.0


def thresholds_of(rows: list[dict[str, Any]]) -> dict[Any, float]:
    """The gap threshold (%) of each (model, layer, direction): its model's."""
    floor = noise_floor(rows)
    return {_key(row): max(GAP_PCT, NOISE_FACTOR * floor.get(row["model"], 0.0)) for row in rows}


#: Candidate recipe SNR thresholds (dB) the calibration scans.
SNR_CANDIDATES = (13.5, 15.0, 16.0, 17.0, 18.0, 19.0, 20.0, 21.0, 22.0, 25.0)


def calibration(rows: list[dict[str, Any]], root: Path) -> str:
    """Agreement of the recipe rows under each candidate ``recipe_snr_db`` (the measured
    verdicts fixed): the table the default threshold is chosen from."""
    from scalescope.analysis import Thresholds

    gaps = thresholds_of(rows)
    lines = ["| recipe_snr_db | agree (recipes) | predicted unsafe |", "|---|---|---|"]
    for snr in SNR_CANDIDATES:
        judged = measured_with(rejudge(rows, root, Thresholds(recipe_snr_db=snr)), gaps)
        main = [r for r in judged if r["recipe"] != CONTROL]
        agree = sum(r["agree"] for r in main)
        unsafe = sum(r["predicted"] == "unsafe" for r in main)
        lines.append(f"| {snr:g} | {agree}/{len(main)} | {unsafe} |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    root = Path(args.out) if args.out else Path("/tmp/bench-interventions")
    root.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    if getattr(args, "rejudge", False):
        if not args.json or not Path(args.json).is_file():
            raise SystemExit("--rejudge needs --json FILE written by an earlier run")
        rows = rejudge(json.loads(Path(args.json).read_text()), root)
    else:
        for model in args.models:
            rows += intervene(model, args, root)
            if args.json:
                Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    gaps = thresholds_of(rows)
    rows = measured_with(rows, gaps)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    floor = noise_floor(rows)
    print(f"{platform.node()}  load {load:.1f}  steps {args.steps}")
    for model, noise in floor.items():
        print(
            f"{model}: noise floor (largest |gap| of its BF16 controls) {noise:.2f} %; "
            f"unsafe above max({GAP_PCT} %, {NOISE_FACTOR:g} x that)"
        )
    print(table(rows))
    print(summary(rows))
    if getattr(args, "calibrate", False):
        print(calibration(rows, root))
    return 0
