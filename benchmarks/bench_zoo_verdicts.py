"""The verdict on models it was not tuned on: Flax-style training steps under precision
policies, each run's verdict against what its training did.

The models are the builders of ``tests/other_models.py`` (written the way Flax's own
examples and a Gemma-style NNX decoder write them). Each trains ``--steps`` steps on its
one batch, recorded every ``--every`` by ``ss.Run`` + ``run.track(step, scalify=False,
policy=P)`` (the plain step, each value a rule reaches rounded as `ss.emulate` rounds it),
in these variants:

- ``fp32``: no policy, the baseline;
- ``control``: every matmul operand ``bf16@matmul`` (the noise floor of emulation);
- ``recipe``: matmul operands ``mxfp8_e4m3@matmul`` forward, ``mxfp8_e5m2@matmul``
  backward (the operands are the op table's GEMM operands);
- ``naive``: every forward value E4M3, every backward value E5M2, no scaling;
- ``w8``: the parameters held in E4M3 in place (FP8 master weights);
- ``w16``, ``wfp16``: the parameters held in BF16, in FP16 (16-bit master weights);
- ``m16``: Adam's moments (``mu``, ``nu``) held in BF16.

A run is labelled as in ``bench_verdicts.py``: broken when its final training loss (mean
of the last 5 % of steps) is more than 2 % above its model's fp32 run, or NaN; healthy
otherwise. Printed per run: the gap, the label, the verdict and its first reason, the
causes per severity, and whether verdict and label agree (healthy with healthy; broken
with failing or at risk).

    python benchmarks/bench_zoo_verdicts.py [--models decoder_lm,...] [--variants ...]
        [--steps 100] [--every 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from other_models import MODELS  # noqa: E402

import scalescope as ss  # noqa: E402
from scalescope.probe.quantise import unique_labels  # noqa: E402

GAP = 0.02
VARIANTS = ("fp32", "control", "recipe", "naive", "w8", "w16", "wfp16", "m16")
HELD = {"w8": "e4m3", "w16": "bf16", "wfp16": "fp16"}
DEFAULT_MODELS = ("decoder_lm", "gemma_nnx", "wmt_encoder_decoder", "lstm_sst2")
FORMATS = ("e4m3", "e5m2", "fp16", "bf16", "mxfp8_e4m3", "mxfp8_e5m2")


def gemm_operands(table) -> dict[str, str]:
    """``{exact label: pass}`` of every value a matmul reads (the op table's GEMM operands
    and each ``dot_general``'s recorded operands)."""
    ops = table.ops
    labels = unique_labels([o.pass_ for o in ops], [o.name for o in ops])
    idx = {i for i, o in enumerate(ops) if o.gemm}
    for o in ops:
        if o.primitive == "dot_general":
            idx |= {i for i in o.operands if i >= 0}
    return {labels[i]: ops[i].pass_ for i in sorted(idx)}


def policy_of(variant: str, table) -> dict[str, str] | None:
    if variant == "fp32":
        return None
    if variant == "naive":
        return {"fwd/**": "e4m3", "bwd/**": "e5m2"}
    if variant in HELD:
        return {"input/params/**": HELD[variant]}
    if variant == "m16":
        return {"input/**/mu/**": "bf16", "input/**/nu/**": "bf16"}
    rules = {}
    for label, pass_ in gemm_operands(table).items():
        if variant == "control":
            target = "bf16@matmul"
        else:
            target = "mxfp8_e5m2@matmul" if pass_ == "bwd" else "mxfp8_e4m3@matmul"
        rules["re:^" + re.escape(label) + "$"] = target
    return rules


def train(model: str, variant: str, steps: int, every: int, root: Path) -> dict:
    step, args, li = MODELS[model]()
    args = list(args)
    policy = policy_of(variant, ss.instrument(step, scalify=False).op_table(*args))
    path = root / model / variant
    losses = []
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # emulate's notes on values no matmul reads
        with ss.Run(path, every=every, formats=FORMATS) as run:
            tracked = run.track(step, scalify=False, policy=policy)
            for i in range(steps):
                out = tracked(*args)
                losses.append(float(np.asarray(out[li])))
                run.log(i, loss=losses[-1])
                args[:li] = out[:li]
    reader = ss.open_run(path)
    verdict = reader.verdict()
    found = reader.advise()
    severity = found["severity"].value_counts().to_dict() if len(found) else {}
    tail = max(1, round(0.05 * steps))
    reasons = verdict.as_dict().get("reasons", [])
    return {
        "model": model,
        "variant": variant,
        "final_loss": float(np.mean(losses[-tail:])),
        "verdict": verdict.status,
        "reason": (f"{reasons[0]['severity']} {reasons[0]['cause']}" if reasons else ""),
        "trend": verdict.trend,
        "severity": {k: int(severity.get(k, 0)) for k in ("critical", "high", "medium")},
        "seconds": round(time.perf_counter() - t0, 1),
    }


def label(rows: list[dict]) -> None:
    base = {r["model"]: r["final_loss"] for r in rows if r["variant"] == "fp32"}
    for r in rows:
        b, f = base.get(r["model"]), r["final_loss"]
        r["gap_pct"] = 100 * (f - b) / b if b and math.isfinite(f) else math.inf
        broken = not math.isfinite(f) or r["gap_pct"] > 100 * GAP
        r["label"] = "broken" if broken else "healthy"
        r["agree"] = (r["verdict"] == "healthy") == (r["label"] == "healthy")
        # a healthy run said to diverge is noise, as a false alarm is
        r["agree"] = r["agree"] and not (r["label"] == "healthy" and r.get("trend"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(DEFAULT_MODELS))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--json", default=None, help="write the rows as JSON")
    args = p.parse_args(argv)
    models, variants = args.models.split(","), args.variants.split(",")
    unknown = [m for m in models if m not in MODELS] + [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown model(s) or variant(s): {unknown}")
    if "fp32" not in variants:
        variants = ["fp32", *variants]  # the labels need it
    print(f"jax {jax.__version__}, {args.steps} steps, every {args.every}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="zoo_verdicts_") as tmp:
        for model in models:
            for variant in variants:
                try:
                    rows.append(train(model, variant, args.steps, args.every, Path(tmp)))
                except ss.PolicyError as err:  # e.g. m16 on an optimizer without moments
                    print(f"  {model}/{variant}: skipped ({str(err).splitlines()[0]})")
                    continue
                r = rows[-1]
                print(f"  {model}/{variant}: {r['verdict']} ({r['seconds']} s)", flush=True)
    label(rows)
    print("\n| model | variant | loss gap | label | verdict | crit/high/med | agree |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        s = r["severity"]
        print(
            f"| {r['model']} | {r['variant']} | {r['gap_pct']:+.1f} % | {r['label']} | "
            f"{r['verdict']} {r['reason']} | {s['critical']}/{s['high']}/{s['medium']} | "
            f"{'yes' if r['agree'] else 'NO'} |"
        )
    judged = [r for r in rows if r["variant"] != "fp32"]
    print(f"\nagree: {sum(r['agree'] for r in judged)} of {len(judged)} runs under a policy")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
