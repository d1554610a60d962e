"""Do the scalified FP8 GPT's matmuls run as FP8 GEMMs? Compile and look at the HLO.

Compiles the sample GPT's training step in the ``fp8`` recipe
(``jax.jit(ss.scalify(step)).lower(...).compile()``), reads the optimized HLO
(``compiled.as_text()``) and counts the GEMMs: ``dot``/``convolution`` instructions (also
inside fusions, e.g. Triton GEMMs) and cuBLAS/cuBLASLt custom calls. A GEMM counts as FP8
when its operands are ``f8e4m3fn``/``f8e5m2`` (or another f8 type) or its custom-call
target is an fp8 one (``__cublas$lt$matmul$f8``).

The recipe writes each FP8 matmul as quantise-dequantise: ``convert(f16 -> f8)``,
``convert(f8 -> f16)``, then the ``dot``. On GPUs with FP8 tensor cores (compute
capability 8.9+: Ada, Hopper, Blackwell) XLA's GEMM rewriter fuses such a pattern into an
FP8 GEMM; elsewhere the dot runs in the wider type. This script reports which happened.

Without a GPU it prints that it needs one and exits 0, claiming nothing; with
``--force-cpu-inspect`` it still prints what the CPU HLO holds, labelled as not evidence.

    python benchmarks/check_gpu_fp8.py [--precision fp8] [--layers 2] [--d-model 128]
        [--dump-hlo hlo.txt] [--strict] [--force-cpu-inspect]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from dataclasses import dataclass, field
from typing import Any

GEMM_OPS = ("dot", "convolution")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_OP = re.compile(r"(?:^|[\s)}])(?P<op>[a-z][\w\-]*)\(")
_TYPE = re.compile(r"\b(?P<dtype>pred|[subf]\d+[a-z0-9]*|bf16|c64|c128|token)\[")
_TARGET = re.compile(r'custom_call_target="(?P<target>[^"]*)"')
_GEMM_TARGET = re.compile(r"cublas|gemm|matmul|\$conv|cudnn", re.I)


@dataclass
class Gemm:
    name: str
    op: str  # dot | convolution | custom-call
    operand_dtypes: tuple[str, ...]
    target: str | None = None

    @property
    def fp8(self) -> bool:
        operands = self.operand_dtypes[:2]
        f8_operands = len(operands) == 2 and all(d.startswith("f8") for d in operands)
        return f8_operands or bool(self.target and "f8" in self.target.lower())

    @property
    def kind(self) -> str:
        types = " x ".join(self.operand_dtypes[:2]) or "?"
        where = f"custom-call {self.target}" if self.target else self.op
        return f"{where} ({types})"


@dataclass
class HloSummary:
    gemms: list[Gemm] = field(default_factory=list)
    f8_converts: int = 0  # convert instructions producing an f8 type

    @property
    def fp8_gemms(self) -> list[Gemm]:
        return [g for g in self.gemms if g.fp8]

    @property
    def other_gemms(self) -> list[Gemm]:
        return [g for g in self.gemms if not g.fp8]

    def counts(self, gemms: list[Gemm]) -> dict[str, int]:
        return dict(collections.Counter(g.kind for g in gemms).most_common())


def _split_operands(rest: str, start: int) -> str:
    """The text between the parenthesis at ``start`` and its match."""
    depth = 0
    for i in range(start, len(rest)):
        if rest[i] == "(":
            depth += 1
        elif rest[i] == ")":
            depth -= 1
            if depth == 0:
                return rest[start + 1 : i]
    return rest[start + 1 :]


def _top_level(operands: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in operands:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur).strip())
    return parts


def parse_hlo(text: str) -> HloSummary:
    """Find the GEMMs of an HLO module's text and the dtypes of their operands."""
    result_dtype: dict[str, str] = {}
    instrs: list[tuple[str, str, int, str]] = []
    for line in text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        name, rest = m["name"], m["rest"]
        op = _OP.search(rest)
        if not op:
            continue
        ty = _TYPE.search(rest[: op.start("op")])
        if ty:
            result_dtype[name] = ty["dtype"]
        instrs.append((name, op["op"], op.end() - 1, rest))
    summary = HloSummary()
    for name, op, paren, rest in instrs:
        if op == "convert" and result_dtype.get(name, "").startswith("f8"):
            summary.f8_converts += 1
        target = None
        if op == "custom-call":
            t = _TARGET.search(rest)
            target = t["target"] if t else ""
            if not _GEMM_TARGET.search(target):
                continue
        elif op not in GEMM_OPS:
            continue
        dtypes = []
        for operand in _top_level(_split_operands(rest, paren)):
            ty = _TYPE.search(operand)
            if ty:  # printed with its shape: "f8e4m3fn[32,128]{1,0} %convert.3"
                dtypes.append(ty["dtype"])
            else:  # bare name: look up the instruction that defines it
                dtypes.append(result_dtype.get(operand.lstrip("%").strip(), "?"))
        summary.gemms.append(Gemm(name, op, tuple(dtypes), target))
    return summary


def count_dense_matmuls(loss_fn, params, batch) -> int:
    """How many `Precision.matmul` calls (FP8-cast dense layers) one forward traces."""
    import jax

    from sample_models.precision import Precision

    calls = 0
    original = Precision.matmul

    def counting(self, x, w):
        nonlocal calls
        calls += 1
        return original(self, x, w)

    Precision.matmul = counting
    try:
        jax.eval_shape(loss_fn, params, batch)
    finally:
        Precision.matmul = original
    return calls


def compile_step(args: argparse.Namespace) -> tuple[str, int, Any]:
    """Lower and compile the recipe's training step; (optimized HLO text, dense matmuls per
    forward, the compiled object)."""
    import functools

    import jax
    import numpy as np

    import scalescope as ss
    from sample_models.gpt import GPTConfig, gpt_loss, init_gpt
    from sample_models.precision import SCALIFIED, get_precision
    from sample_models.train import TrainConfig, make_adamw
    from sample_models.train_step import make_train_step

    cfg = GPTConfig(
        vocab_size=65,
        seq_len=args.seq_len,
        d_model=args.d_model,
        n_heads=args.heads,
        n_layers=args.layers,
    )
    prec = get_precision(args.precision)
    params = init_gpt(jax.random.key(0), cfg, prec.param_dtype)
    tcfg = TrainConfig(precision=args.precision, steps=100, opt_state_dtype=args.opt_state_dtype)
    opt = make_adamw(tcfg)
    loss_fn = functools.partial(gpt_loss, cfg=cfg, precision=prec)
    step = make_train_step(loss_fn, opt)
    opt_state = opt.init(params)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1))
    batch = {
        "inputs": jax.numpy.asarray(tokens[:, :-1], jax.numpy.int32),
        "targets": jax.numpy.asarray(tokens[:, 1:], jax.numpy.int32),
    }
    dense = count_dense_matmuls(loss_fn, params, batch)
    if args.precision in SCALIFIED:
        step = ss.scalify(step)
        params, opt_state = ss.as_scaled_array(params, "rms"), ss.as_scaled_array(opt_state, "rms")
    compiled = jax.jit(step).lower(params, opt_state, batch).compile()
    return compiled.as_text(), dense, compiled


def report(summary: HloSummary, dense: int, *, evidence: bool, out=sys.stdout) -> None:
    def p(*a: Any) -> None:
        print(*a, file=out)

    label = "" if evidence else "[CPU HLO, NOT evidence of FP8 GEMMs] "
    fp8, other = summary.fp8_gemms, summary.other_gemms
    p(f"{label}GEMMs in the optimized HLO: {len(summary.gemms)}")
    p(f"{label}  FP8 GEMMs (f8 operands or fp8 cuBLASLt call): {len(fp8)}")
    for kind, n in summary.counts(fp8).items():
        p(f"{label}    {n:4d}  {kind}")
    p(f"{label}  other GEMMs: {len(other)}")
    for kind, n in summary.counts(other).items():
        p(f"{label}    {n:4d}  {kind}")
    p(f"{label}convert instructions to f8 types: {summary.f8_converts}")
    p(
        f"{label}FP8-cast dense matmuls: {dense} per forward, so {3 * dense} GEMMs "
        f"(forward, input gradient, weight gradient) could run in FP8; attention products "
        f"stay in the compute dtype by design"
    )
    if not evidence:
        p(f"{label}on CPU, XLA runs every dot in a wider type: this says nothing about a GPU")
    elif fp8:
        p(f"RESULT: yes, {len(fp8)} of {len(summary.gemms)} GEMMs run in FP8")
    else:
        p(
            "RESULT: no, the matmuls do not run as FP8 GEMMs (the f8 casts stay "
            "quantise-dequantise around wider GEMMs)"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--precision", default="fp8", help="a sample_models recipe (default fp8)")
    p.add_argument(
        "--opt-state-dtype", default="float32", help="AdamW state dtype (default float32)"
    )
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--dump-hlo", metavar="PATH", help="write the optimized HLO text there")
    p.add_argument("--strict", action="store_true", help="exit 1 on a GPU with no FP8 GEMM")
    p.add_argument(
        "--force-cpu-inspect",
        action="store_true",
        help="without a GPU, still compile on CPU and print what its HLO holds (not evidence)",
    )
    args = p.parse_args(argv)

    import jax

    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        print(
            "check_gpu_fp8: needs a GPU: JAX sees no GPU "
            f"(devices: {', '.join(str(d) for d in jax.devices())}); nothing checked, "
            'nothing claimed. Install a CUDA build (pip install -U "jax[cuda13]") on a '
            "machine with an FP8-capable GPU (compute capability 8.9+) and run this again."
        )
        if not args.force_cpu_inspect:
            return 0
        print("--force-cpu-inspect: compiling on CPU anyway (NOT evidence of FP8 GEMMs)")
    else:
        d = gpus[0]
        cc = getattr(d, "compute_capability", "?")
        print(f"GPU: {d.device_kind} (compute capability {cc}), jax {jax.__version__}")
    text, dense, _ = compile_step(args)
    if args.dump_hlo:
        with open(args.dump_hlo, "w") as f:
            f.write(text)
    summary = parse_hlo(text)
    report(summary, dense, evidence=bool(gpus))
    if gpus and args.strict and not summary.fp8_gemms:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
