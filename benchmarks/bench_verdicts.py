"""Calibration of the run verdict: a labelled corpus of sample-model runs, measured.

Each case trains a sample model (`sample_models.train`) in one precision recipe, records
it every ``--every`` steps, and asks for its verdict (`scalescope.analysis.verdict_run`).
A case's label comes from what training did, not from the recipe's name: **broken** when
its final training loss (mean of the last 5 % of steps) is more than `GAP_PCT` above the
same model's fp32 run from the same seed and batches, or NaN; **healthy** otherwise.

Printed per case: loss gap, label, verdict, causes per severity, the first step with a high
(or critical) cause, the step the verdict turned, and the step where the loss departs
(its 10-step running mean more than `GAP_PCT` above fp32's, or NaN). Goals:

- every healthy run ``healthy``, with no high cause and at most `MAX_MEDIUM` medium ones;
- every broken run ``failing`` or ``at risk``, its expected cause (rule, format, pass)
  among the first 3 reasons, and flagged (the verdict's step) before the loss departs.

    python benchmarks/bench_verdicts.py [--cases gpt-fp32,...] [--steps 200] [--every 10]
        [--out DIR] [--json out.json] [--fast] [--check]

``--interventions``: the intervention table of `interventions` (predicted vs measured
per linear layer and recipe, 300 steps unless ``--steps``).

``--fast``: a 1-layer d=32 GPT (the MLP as it is); the test (tests/test_verdict_runs.py)
runs mlp-fp8 and mlp-fp8-naive-x255 at 200 steps.

mlp-fp8-naive-x90 sits on an edge: its label and its verdict both turn on the last bits of
the arithmetic (with XLA's CPU backend unoptimised, --xla_backend_optimization_level=0,
it trains within 1 % of fp32 and flushes 74 % of the loss gradient; optimised, +19 % and
77 %). The verdict follows the label either way; it is no test of either.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

GAP_PCT = 2.0  # a run more than this far above fp32 (final train loss) is broken
MAX_MEDIUM = 5  # a healthy run may show at most this many medium causes
DEPART_WINDOW = 10  # steps in the running mean that decides where the loss departs


@dataclass(frozen=True)
class Case:
    """One run of the corpus: model, recipe, settings; ``cause``: the (rule, format,
    pass) a broken run's verdict must name among its first 3 reasons."""

    name: str
    model: str
    precision: str
    baseline: str  # the fp32 case it is measured against
    cause: tuple[str, str, str] | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    what: str = ""


X90 = {"input_scale": 90.0}  # unnormalised inputs
X90_CAUSE = ("underflow", "e5m2", "bwd")
X255 = {"input_scale": 255.0}  # the raw bytes: the first layer overflows E4M3
SMALL = {"input_scale": 1 / 64}  # pixels under E4M3's smallest subnormal flush

CASES: dict[str, Case] = {
    c.name: c
    for c in (
        Case("gpt-fp32", "gpt", "fp32", "gpt-fp32", what="FP32 baseline"),
        Case("gpt-fp16", "gpt", "fp16", "gpt-fp32", what="scalified FP16"),
        Case("gpt-fp8", "gpt", "fp8", "gpt-fp32", what="scalified FP8 (E4M3 fwd, E5M2 bwd)"),
        Case("gpt-fp8-static", "gpt", "fp8-static", "gpt-fp32", what="FP8, static scales only"),
        Case("gpt-unit-fp32", "gpt", "unit-fp32", "gpt-unit-fp32", what="unit-scaled model"),
        Case("gpt-unit-fp8", "gpt", "unit-fp8", "gpt-unit-fp32", what="unit-scaled model, FP8"),
        Case(
            "gpt-fp8-naive",
            "gpt",
            "fp8-naive",
            "gpt-fp32",
            cause=("underflow", "e5m2", "bwd"),
            what="FP8 casts without scalify",
        ),
        Case(
            "gpt-fp16-naive",
            "gpt",
            "fp16-naive",
            "gpt-fp32",
            cause=("underflow", "fp16", "bwd"),
            what="FP16 casts, no loss scaling",
        ),
        Case(
            "gpt-e5m2-fwd-naive",
            "gpt",
            "e5m2-fwd-naive",
            "gpt-fp32",
            cause=("snr", "e5m2", "fwd"),
            what="E5M2 forward casts",
        ),
        Case("mlp-fp32", "mlp", "fp32", "mlp-fp32", what="FP32 baseline"),
        Case("mlp-fp8", "mlp", "fp8", "mlp-fp32", what="scalified FP8"),
        Case("mlp-fp32-x90", "mlp", "fp32", "mlp-fp32-x90", settings=X90, what="inputs x90"),
        Case(
            "mlp-fp8-naive-x90",
            "mlp",
            "fp8-naive",
            "mlp-fp32-x90",
            cause=X90_CAUSE,
            settings=X90,
            what="inputs x90, FP8 casts without scalify",
        ),
        Case("mlp-fp32-x255", "mlp", "fp32", "mlp-fp32-x255", settings=X255, what="raw bytes"),
        Case(
            "mlp-fp8-naive-x255",
            "mlp",
            "fp8-naive",
            "mlp-fp32-x255",
            cause=("overflow", "e4m3", "fwd"),
            settings=X255,
            what="raw 0..255 inputs, FP8 casts without scalify (E4M3 overflow: NaN)",
        ),
        Case("mlp-fp32-small", "mlp", "fp32", "mlp-fp32-small", settings=SMALL, what="inputs /64"),
        Case(
            "mlp-fp8-naive-small",
            "mlp",
            "fp8-naive",
            "mlp-fp32-small",
            cause=("underflow", "e4m3", "input"),
            settings=SMALL,
            what="inputs /64, FP8 casts without scalify (E4M3 underflow)",
        ),
    )
}


def fast_settings(model: str) -> dict[str, Any]:
    """The test's variant: a 1-layer d=32 GPT; the MLP as it is (it trains in seconds)."""
    if model == "gpt":
        return {"gpt": {"seq_len": 32, "d_model": 32, "n_heads": 2, "n_layers": 1}, "batch": 16}
    return {}


def running_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Mean of the last ``window`` values at each position (fewer at the start); NaN
    propagates."""
    out = np.empty(len(values))
    for i in range(len(values)):
        out[i] = np.mean(values[max(0, i + 1 - window) : i + 1])
    return out


def departure_step(loss: np.ndarray, ref: np.ndarray, steps: np.ndarray) -> int | None:
    """First step where the loss is NaN, or its running mean exceeds the reference's by
    more than `GAP_PCT` (None: never)."""
    n = min(len(loss), len(ref))
    a, b = running_mean(loss[:n], DEPART_WINDOW), running_mean(ref[:n], DEPART_WINDOW)
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(a) | (a > b * (1 + GAP_PCT / 100.0))
    hit = np.flatnonzero(bad)
    return int(steps[hit[0]]) if len(hit) else None


def final_loss(loss: np.ndarray) -> float:
    tail = loss[-max(1, len(loss) // 20) :]
    return float(np.mean(tail)) if np.all(np.isfinite(tail)) else math.nan


def train_case(case: Case, args: argparse.Namespace, root: Path) -> Path:
    from scalescope.sample_models.train import TrainConfig, train

    settings = dict(case.settings)
    if args.fast:
        settings = {**fast_settings(case.model), **settings}
    cfg = TrainConfig(
        model=case.model, precision=case.precision, steps=args.steps, seed=args.seed, **settings
    )
    run = root / case.name
    if run.exists():
        import scalescope as ss

        reader = ss.open_run(run)
        done = reader.status == "closed" and len(reader.scalars) == args.steps
        if done and not args.retrain:
            return run  # trained before: judged again as it is
        shutil.rmtree(run)  # cut short, or --retrain: trained anew (train would append)
    t0 = time.perf_counter()
    out = train(cfg, str(run), every=args.every, progress=False, stop_on_nan=False)
    print(
        f"  trained {case.name}: {out['steps']} steps in {time.perf_counter() - t0:.0f} s",
        file=sys.stderr,
    )
    return run


def loss_curve(reader) -> tuple[np.ndarray, np.ndarray]:
    from scalescope.analysis import logged_loss

    loss = logged_loss(reader.scalar_rows())
    return loss.index.to_numpy(np.int64), loss.to_numpy(np.float64)


def judge(case: Case, run: Path, ref_run: Path) -> dict[str, Any]:
    import scalescope as ss
    from scalescope import analysis as A

    reader = ss.open_run(run)
    steps, loss = loss_curve(reader)
    _, ref = loss_curve(ss.open_run(ref_run))
    final, ref_final = final_loss(loss), final_loss(ref)
    gap = math.inf if not math.isfinite(final) else 100.0 * (final - ref_final) / ref_final
    label = "broken" if not gap <= GAP_PCT else "healthy"
    t0 = time.perf_counter()
    findings = reader.advise()
    v = A.verdict_run(reader, findings=findings)
    seconds = time.perf_counter() - t0
    causes = A.causes(findings)
    sev = causes["severity"].value_counts().to_dict() if len(causes) else {}
    high = causes[causes["severity"].isin(["high", "critical"])]
    first_high = int(high["first_step"].min()) if len(high) else None
    depart = departure_step(loss, ref, steps) if case.name != case.baseline else None
    rank = None
    if case.cause is not None:
        rule, fmt, pass_ = case.cause
        for k, r in enumerate(v.reasons[:3]):
            row = causes[causes["cause"] == r.cause]
            if len(row) and tuple(row.iloc[0][["rule", "format", "pass"]]) == (rule, fmt, pass_):
                rank = k + 1
                break
    if label == "healthy":
        ok = v.status == "healthy" and not len(high) and sev.get("medium", 0) <= MAX_MEDIUM
        ok = ok and not v.trend  # a healthy run's loss falls: "diverged" would be noise
    else:
        early = v.step is not None and (depart is None or v.step <= depart)
        ok = v.status != "healthy" and (case.cause is None or rank is not None) and early
    return {
        "case": case.name,
        "what": case.what,
        "final_loss": final,
        "gap_pct": gap,
        "label": label,
        "verdict": v.status,
        "critical": sev.get("critical", 0),
        "high": sev.get("high", 0),
        "medium": sev.get("medium", 0),
        "low": sev.get("low", 0),
        "findings": len(findings),
        "first_high_step": first_high,
        "verdict_step": v.step,
        "departs_step": depart,
        "cause_rank": rank,
        "reasons": [r.cause for r in v.reasons],
        "trend": v.trend,
        "verdict_seconds": seconds,
        "ok": bool(ok),
    }


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "NaN" if math.isnan(value) else "inf" if math.isinf(value) else f"{value:+.1f}"
    return str(value)


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| case | loss gap % | label | verdict | crit/high/med | first high | verdict step "
        "| loss departs | cause rank | goal |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        counts = f"{r['critical']}/{r['high']}/{r['medium']}"
        lines.append(
            f"| {r['case']} | {_cell(r['gap_pct'])} | {r['label']} | {r['verdict']} | {counts} "
            f"| {_cell(r['first_high_step'])} | {_cell(r['verdict_step'])} "
            f"| {_cell(r['departs_step'])} | {_cell(r['cause_rank'])} "
            f"| {'met' if r['ok'] else 'MISSED'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="run folder (default: a temporary one)")
    p.add_argument("--retrain", action="store_true", help="train even where a run exists")
    p.add_argument("--fast", action="store_true", help="small models (the test's variant)")
    p.add_argument("--json", default=None, help="write the rows as JSON")
    p.add_argument("--check", action="store_true", help="exit 1 unless every goal is met")
    p.add_argument(
        "--interventions",
        action="store_true",
        help="the intervention table instead (benchmarks/interventions.py): each linear "
        "layer of --models held in each recipe, predicted vs measured",
    )
    p.add_argument("--models", default="gpt,mlp", help="--interventions: models (gpt,mlp)")
    p.add_argument(
        "--layers", default=None, help="--interventions: only the layers this regex finds"
    )
    p.add_argument(
        "--all-layers",
        action="store_true",
        help="--interventions: also hold every linear layer at once (rows 'all')",
    )
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="--interventions: also the agreement under each candidate recipe SNR threshold",
    )
    p.add_argument(
        "--rejudge",
        action="store_true",
        help="--interventions: judge the rows of --json again (current thresholds, no training)",
    )
    p.add_argument(
        "--recipes", default=None, help="--interventions: comma-separated recipes (default all)"
    )
    args = p.parse_args(argv)
    if args.interventions:
        import interventions

        args.models = [m.strip() for m in args.models.split(",") if m.strip()]
        recipes = interventions.RECIPES if args.recipes is None else args.recipes.split(",")
        args.recipes = tuple(r.strip() for r in recipes if r.strip())
        if "--steps" not in " ".join(argv or sys.argv):
            args.steps = 300
        return interventions.main(args)
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        p.error(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    wanted = list(dict.fromkeys(CASES[n].baseline for n in names)) + names
    wanted = list(dict.fromkeys(wanted))
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench-verdicts-"))
    root.mkdir(parents=True, exist_ok=True)
    print(
        f"# bench_verdicts: {len(names)} case(s), {args.steps} steps, every {args.every}"
        f"{' (fast)' if args.fast else ''}; runs in {root}",
        file=sys.stderr,
    )
    runs = {n: train_case(CASES[n], args, root) for n in wanted}
    rows = [judge(CASES[n], runs[n], runs[CASES[n].baseline]) for n in names]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{platform.node()}  load {load:.1f}  steps {args.steps}  every {args.every}")
    print(table(rows))
    for r in rows:
        print(f"  {r['case']}: {' | '.join(r['reasons']) or '-'}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    return 0 if (not args.check or all(r["ok"] for r in rows)) else 1


if __name__ == "__main__":
    sys.exit(main())
