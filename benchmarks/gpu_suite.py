"""scalescope on a GPU, in one command: FP8 GEMMs, throughput, the probe's cost, numerics.

Runs on one H100/H200 in at most ~8 minutes and writes ``results.json`` and
``results.md`` to ``--out``. Sections (each timed; one that fails is recorded with its
error and the others still run):

- ``env``: versions, device, which probe kernel is taken (the pure-XLA one off CPU), and
  every primitive of the steps below that scalify has no rule for, by name;
- ``fp8_gemms``: the scalified FP8 GPT step compiled (GPT-2 small: 12 x 768, seq 1024,
  layers scanned); its GEMMs counted as FP8 (f8 operands or an fp8 cuBLASLt call) or not,
  with the HLO of each GEMM that did not become FP8;
- ``throughput``: tokens/s of the plain BF16 step, the scalified FP8 step and the naive
  FP8 step (casts without scales), same model, same batch;
- ``probe``: `ss.instrument`'s step time and temporaries against the scalified step, and
  `Run(every=10)` / `Run(budget=0.05)` / detection only (the flight recorder, its check
  inside the step as on a GPU and after it as on CPU) amortized over a loop, against the
  same loop untracked;
- ``numerics``: the sample GPT (character level, the vendored Shakespeare) trained for
  300 steps scalified FP8 and BF16 from the same initial weights and batches: the gap of
  their final losses.

It imports neither Panel nor Bokeh (the GPU image has neither). ``--smoke`` runs every
section on a tiny model (CPU, about a minute, with the test suite's XLA flags): a test
runs it so that it cannot rot.

    PYTHONPATH=. python3 benchmarks/gpu_suite.py --out DIR [--smoke] [--only a,b]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import check_gpu_fp8  # noqa: E402

import scalescope as ss  # noqa: E402
from sample_models.gpt import GPTConfig, gpt_loss, init_gpt  # noqa: E402
from sample_models.precision import PRECISIONS, SCALIFIED, Precision  # noqa: E402
from sample_models.train_step import make_optimizer, make_train_step  # noqa: E402
from scalescope.probe import native  # noqa: E402
from scalescope.scalify.registry import has_rule, primitives_in  # noqa: E402
from scalescope.store import flight  # noqa: E402

#: In the order run: the probe, the longest (four more compiled programs), last.
SECTIONS = ("env", "fp8_gemms", "throughput", "numerics", "probe")
GOALS = {
    "fp8_vs_bf16_tokens": 1.0,  # scalified FP8 >= BF16 (stretch 1.3)
    "instrument_step": 1.5,
    "instrument_temp": 1.1,
    "run_every10": 1.05,
    "run_budget": 1.02,
    "run_detect": 1.02,
    "run_detect_other": 1.02,
    "numerics_gap": 0.01,
}
BF16 = Precision("bf16", param_dtype=jnp.bfloat16)


@dataclass(frozen=True)
class Size:
    """The model and loop lengths of one suite."""

    layers: int = 12
    d_model: int = 768
    heads: int = 12
    seq: int = 1024
    batch: int = 8
    vocab: int = 50304  # GPT-2's 50257, padded to a multiple of 64
    steps: int = 20  # timed steps per throughput variant
    run_steps: int = 100  # steps per Run loop
    numerics_steps: int = 300
    numerics_gpt: tuple[tuple[str, int], ...] = ()  # the sample GPT's default size
    #: The probe section records only the ops this selects (None: every op). The smoke
    #: test's: the matmuls, so that its statistics programs compile in seconds on a CPU.
    select: str | None = None


FULL = Size()
#: The tiny GPT of the benchmarks' smoke tests (tests/test_benchmarks_scripts.py's
#: TINY): the programs they share compile once per machine.
SMOKE = Size(
    layers=1,
    d_model=16,
    heads=2,
    seq=8,
    batch=2,
    vocab=65,
    steps=2,
    run_steps=11,
    numerics_steps=4,
    numerics_gpt=(("n_layers", 1), ("d_model", 16), ("n_heads", 2), ("seq_len", 8)),
    select="dot_general",
)


#: XLA flags a ``--smoke`` run adds where ``XLA_FLAGS`` sets no optimisation level: the
#: test suite's (tests/conftest.py). The smoke's programs run a few steps each, so their
#: compile is what costs: no LLVM optimisation, and XLA's elemental CPU emitters (the
#: second only where this jaxlib knows it: XLA aborts on an unknown flag). Together they
#: take the smoke from ~105 s to ~70 s on a 2-core VM (each alone gains nothing); the HLO,
#: and so what is computed, is the same.
SMOKE_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def _xla_takes(flags: Sequence[str]) -> bool:
    """Whether this jaxlib's XLA starts with ``flags`` (a short CPU-only subprocess)."""
    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    try:
        return subprocess.run(probe, env=env, capture_output=True, timeout=120).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def smoke_xla_flags(current: str) -> str:
    """``XLA_FLAGS`` for a smoke run: ``current`` plus those of `SMOKE_XLA_FLAGS` this
    XLA takes, or ``current`` alone where it sets an optimisation level already (the test
    suite's run does)."""
    if "xla_backend_optimization_level" in current:
        return current
    known = SMOKE_XLA_FLAGS
    if not _xla_takes(known):  # one subprocess in the usual case, one per flag otherwise
        known = tuple(f for f in SMOKE_XLA_FLAGS if _xla_takes([f]))
    return " ".join([current, *known]).strip()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- the model --------------------------------------------------------------------------


@dataclass
class Model:
    """The GPT of one size in one precision: the step as written (``raw_step``, on
    ``raw_args``) and as run (``step`` on ``args``: scalified where the recipe is)."""

    name: str
    raw_step: Callable[..., Any]
    raw_args: tuple[Any, ...]
    step: Callable[..., Any]
    args: tuple[Any, ...]
    tokens: int  # per step


def gpt_config(size: Size, *, scan: bool = True) -> GPTConfig:
    return GPTConfig(
        vocab_size=size.vocab,
        seq_len=size.seq,
        d_model=size.d_model,
        n_heads=size.heads,
        n_layers=size.layers,
        scan_layers=scan,
    )


def make_batch(size: Size) -> dict[str, jax.Array]:
    """Random tokens: inputs and next-token targets, the same for every model."""
    tok = np.random.default_rng(0).integers(0, size.vocab, (size.batch, size.seq + 1))
    tok = tok.astype(np.int32)
    return {"inputs": jnp.asarray(tok[:, :-1]), "targets": jnp.asarray(tok[:, 1:])}


def make_model(size: Size, precision: str) -> Model:
    prec = BF16 if precision == "bf16" else PRECISIONS[precision]
    cfg = gpt_config(size)
    params = init_gpt(jax.random.key(0), cfg, prec.param_dtype)
    opt = make_optimizer()
    raw = make_train_step(functools.partial(gpt_loss, cfg=cfg, precision=prec), opt)
    state = opt.init(params)
    raw_args = (params, state, make_batch(size))
    step, args = raw, raw_args
    if precision in SCALIFIED:
        step = ss.scalify(raw)
        args = (ss.as_scaled_array(params, "rms"), ss.as_scaled_array(state, "rms"), raw_args[2])
    return Model(precision, raw, raw_args, step, args, size.batch * size.seq)


def compile_fn(
    fn: Callable[..., Any], args: tuple[Any, ...], options: dict[str, Any] | None = None
) -> tuple[Any, float, dict]:
    """(compiled, seconds to trace and compile, memory in bytes); ``options``: XLA's."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile(compiler_options=options)
    seconds = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    memory = {
        k: int(getattr(mem, f"{k}_size_in_bytes", 0) or 0) if mem is not None else 0
        for k in ("temp", "output", "argument")
    }
    return compiled, seconds, memory


def time_steps(compiled: Any, args: tuple[Any, ...], n: int) -> float:
    """Median seconds per call (after one warm call), synchronised on the outputs."""
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(max(n, 1)):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def loop(fn: Callable[..., Any], args: tuple[Any, ...], n: int) -> float:
    """Seconds for ``n`` training steps, each from the last one's state, same batch."""
    params, state, batch = args
    t0 = time.perf_counter()
    for _ in range(n):
        params, state, loss = fn(params, state, batch)
    jax.block_until_ready((params, state, loss))
    return time.perf_counter() - t0


def hlo_definitions(text: str) -> dict[str, str]:
    """Each HLO instruction's defining line, by name (read once for every GEMM)."""
    out = {}
    for line in text.splitlines():
        m = check_gpu_fp8._INSTR.match(line)
        if m:
            out[m["name"]] = line.strip()
    return out


def hlo_context(defs: dict[str, str], name: str, lines: int = 6) -> str:
    """The HLO line defining ``name`` and the lines defining its operands."""
    head = defs.get(name)
    if head is None:
        return f"{name}: not found in the HLO text"
    # the operands' parenthesis follows the op's name (a cuBLAS call's result type is a
    # tuple, itself in parentheses)
    rest = check_gpu_fp8._INSTR.match(head)["rest"]
    op = check_gpu_fp8._OP.search(rest)
    if op is None:
        return head
    operands = check_gpu_fp8._top_level(check_gpu_fp8._split_operands(rest, op.end() - 1))
    out = [head]
    for operand in operands[:lines]:
        line = defs.get(operand.split()[-1].lstrip("%"))
        if line is not None:
            out.append("  <- " + line[:400])
    return "\n".join(out)


# -- sections ---------------------------------------------------------------------------


class Suite:
    """The sections, sharing the compiled scalified FP8 step. A section that measures in
    parts puts what it has in ``results`` and calls ``save`` after each part, so that a
    suite killed at its time limit keeps them; no part starts after ``deadline_at``
    (`time.perf_counter`)."""

    def __init__(
        self,
        size: Size,
        out: Path,
        results: dict[str, Any] | None = None,
        save: Callable[[], None] = lambda: None,
        deadline_at: float = math.inf,
    ):
        self.size, self.out = size, out
        self.results = {} if results is None else results
        self.save, self.deadline_at = save, deadline_at
        self._fp8: tuple[Model, Any, float, dict] | BaseException | None = None

    def fp8(self) -> tuple[Model, Any, float, dict]:
        """The scalified FP8 step, compiled once; a failure is kept and raised again (each
        section that needs the step would otherwise compile it anew, to fail alike)."""
        if self._fp8 is None:
            try:
                model = make_model(self.size, "fp8")
                self._fp8 = (model, *compile_fn(model.step, model.args))
            except Exception as err:
                self._fp8 = err
                raise
        if isinstance(self._fp8, BaseException):
            raise RuntimeError(
                "the scalified FP8 step failed to build (see the first section)"
            ) from self._fp8
        return self._fp8

    def _part(self, section: str, out: dict[str, Any]) -> None:
        self.results[section] = out
        self.save()

    def _late(self) -> bool:
        return time.perf_counter() > self.deadline_at

    def env(self) -> dict[str, Any]:
        versions = {"python": platform.python_version(), "platform": platform.platform()}
        for name in ("jax", "jaxlib", "numpy", "ml_dtypes", "optax", "flax", "pandas", "pyarrow"):
            try:
                versions[name] = __import__(name).__version__
            except Exception as err:  # noqa: BLE001 - a missing package is a finding
                versions[name] = f"missing ({type(err).__name__})"
        missing = {}
        for precision in ("fp8", "fp16"):
            model = make_model(self.size, precision)
            names = primitives_in(jax.make_jaxpr(model.raw_step)(*model.raw_args))
            missing[precision] = sorted(n for n in names if not has_rule(n))
        # scalify and the probe traced on the tiny model (seconds): an engine that breaks
        # on this JAX shows here, before the sections compile GPT-2 to fail alike
        traces = {}
        for what in ("scalify", "instrument"):
            model = make_model(SMOKE, "fp8")
            fn = model.step if what == "scalify" else ss.instrument(model.raw_step)
            try:
                jax.eval_shape(fn, *model.args)
                traces[what] = "ok"
            except Exception as err:  # noqa: BLE001 - a finding, the sections say more
                traces[what] = f"{type(err).__name__}: {err}"[:500]
        dev = jax.devices()[0]
        return {
            "versions": versions,
            "device": {
                "platform": dev.platform,
                "kind": dev.device_kind,
                "count": jax.device_count(),
                "compute_capability": getattr(dev, "compute_capability", None),
            },
            "probe_kernel": "native" if native.use_native() else "xla",
            "missing_rules": missing,
            "traces": traces,
        }

    def fp8_gemms(self) -> dict[str, Any]:
        model, compiled, seconds, memory = self.fp8()
        text = compiled.as_text()
        summary = check_gpu_fp8.parse_hlo(text)
        defs = hlo_definitions(text)
        patterns = [hlo_context(defs, g.name) for g in summary.other_gemms]
        (self.out / "not_fp8_gemms.txt").write_text("\n\n".join(patterns) + "\n")
        out = {
            "compile_s": seconds,
            "temp_bytes": memory["temp"],
            "gemms": len(summary.gemms),
            "fp8_gemms": len(summary.fp8_gemms),
            "fp8_kinds": summary.counts(summary.fp8_gemms),
            "other_kinds": summary.counts(summary.other_gemms),
            "f8_converts": summary.f8_converts,
            # the compiled program's GEMMs are counted in its text, where a scanned
            # layer's are there once: so are these (3 per dense layer: forward, the
            # gradients of its input and of its weight)
            "fp8_cast_gemms": 3 * _dense_matmuls(self.size, scan=True),
            "fp8_cast_gemms_per_step": 3 * _dense_matmuls(self.size, scan=False),
            "evidence": jax.devices()[0].platform == "gpu",
            "not_fp8_patterns": "not_fp8_gemms.txt",
        }
        if out["fp8_gemms"] == 0 and not self._late():
            # XLA may fold a cast to FP8 and back into its GEMM as excess precision (its
            # default allows it), leaving the GEMM in 16 bits: compiled once more without
            # that licence, the count says whether this is why
            self._part("fp8_gemms", out)
            # On a CPU no GEMM is FP8 with or without that licence: the naive FP8 step
            # (casts before its GEMMs too, compiled in a second instead of the scalified
            # step's ten) takes the same path, so that the smoke keeps it from rotting
            which = "fp8-naive" if jax.default_backend() == "cpu" else "fp8"
            target = make_model(self.size, which) if which != "fp8" else model
            strict, s_seconds, _ = compile_fn(
                target.step, target.args, {"xla_allow_excess_precision": False}
            )
            s = check_gpu_fp8.parse_hlo(strict.as_text())
            out["without_excess_precision"] = {
                "step": which,
                "compile_s": s_seconds,
                "gemms": len(s.gemms),
                "fp8_gemms": len(s.fp8_gemms),
                "f8_converts": s.f8_converts,
            }
        return out

    def throughput(self) -> dict[str, Any]:
        """One row per step; a row that fails (or would start past the deadline) is
        recorded as such and the others are still measured."""
        rows: dict[str, dict[str, Any]] = {}
        out: dict[str, Any] = {"steps": rows}
        for name in ("bf16", "fp8", "fp8-naive"):
            if self._late():
                rows[name] = {"skipped": "deadline"}
                continue
            try:
                if name == "fp8":
                    model, compiled, seconds, memory = self.fp8()
                else:
                    model = make_model(self.size, name)
                    compiled, seconds, memory = compile_fn(model.step, model.args)
                t = time_steps(compiled, model.args, self.size.steps)
            except Exception:  # noqa: BLE001 - recorded; the other rows still run
                rows[name] = {"error": traceback.format_exc()}
                log(f"  {name} FAILED:\n{rows[name]['error']}")
                self._part("throughput", out)
                continue
            rows[name] = {
                "compile_s": seconds,
                "step_ms": 1e3 * t,
                "tokens_per_s": model.tokens / t,
                "temp_bytes": memory["temp"],
            }
            log(f"  {name}: {model.tokens / t:,.0f} tokens/s")
            self._part("throughput", out)
        measured = {k: r["tokens_per_s"] for k, r in rows.items() if "tokens_per_s" in r}
        if "fp8" in measured and "bf16" in measured:
            out["fp8_vs_bf16"] = measured["fp8"] / measured["bf16"]
        failed = [k for k, r in rows.items() if "error" in r]
        if failed:
            raise RuntimeError(f"throughput rows failed: {failed} (the others are kept)")
        return out

    def probe(self) -> dict[str, Any]:
        model, compiled, seconds, memory = self.fp8()
        base_t = time_steps(compiled, model.args, self.size.steps)
        i_compiled, i_seconds, i_memory = compile_fn(
            ss.instrument(model.raw_step, select=self.size.select), model.args
        )
        i_t = time_steps(i_compiled, model.args, self.size.steps)
        out = {
            "probe_kernel": "native" if native.use_native() else "xla",
            "select": self.size.select,  # None: every op recorded
            "scalified": {"compile_s": seconds, "step_ms": 1e3 * base_t, **memory},
            "instrument": {"compile_s": i_seconds, "step_ms": 1e3 * i_t, **i_memory},
            "instrument_step_x": i_t / base_t,
            "instrument_temp_x": i_memory["temp"] / max(memory["temp"], 1),
            "instrument_compile_x": i_seconds / max(seconds, 1e-9),
        }
        del i_compiled
        log(
            f"  instrument: step {out['instrument_step_x']:.2f}x, "
            f"temporaries {out['instrument_temp_x']:.2f}x"
        )
        self._part("probe", out)
        n = self.size.run_steps
        default_in_step = flight.check_in_step()
        detect = {"every": 10**9, "start_step": 1}
        variants = (
            ("run_every10", {"every": 10}, None),
            ("run_budget", {"budget": 0.05}, None),
            # the flight recorder alone: every step checked, none recorded (numbered from
            # 1, so that step 0 is not a recorded one: only the plain program compiles);
            # the check where this backend puts it, then in the other place
            # (`flight.check_in_step`: inside the step on a GPU, after it on CPU)
            ("run_detect", detect, default_in_step),
            ("run_detect_other", detect, not default_in_step),
        )
        for key, kw, in_step in variants:
            if self._late():
                out[key] = {"skipped": "deadline", **kw}
                log(f"  {key} skipped: past the deadline")
                continue
            flight.IN_STEP = in_step
            try:
                with tempfile.TemporaryDirectory(prefix="gpu_suite_") as tmp:
                    run = ss.Run(f"{tmp}/run", select=self.size.select, **kw)
                    fn = run.track(model.raw_step)
                    if in_step is not None:
                        loop(fn, model.args, 2)  # compiles the plain program and its check
                    else:
                        fn.warmup(*model.args)
                    loop(compiled, model.args, 2)
                    untracked = loop(compiled, model.args, n)
                    t0 = time.perf_counter()
                    loop(fn, model.args, n)
                    run.flush()
                    tracked = time.perf_counter() - t0
                    run.close()
            finally:
                flight.IN_STEP = None
            out[key] = {"steps": n, "ratio": tracked / untracked, **kw}
            if in_step is not None:
                out[key]["check"] = "in the step" if in_step else "after the step"
            log(f"  {key}: {tracked / untracked:.3f}x over {n} steps")
            self._part("probe", out)
        return out

    def numerics(self) -> dict[str, Any]:
        from sample_models.train import TrainConfig, make_task

        gpt = dict(self.size.numerics_gpt) or TrainConfig().gpt
        cfg = TrainConfig(model="gpt", steps=self.size.numerics_steps, data="vendored", gpt=gpt)
        curves = {}
        for name in ("fp8", "bf16"):
            task = make_task(cfg)  # the same initial weights and batches for both
            prec = BF16 if name == "bf16" else PRECISIONS[name]
            gcfg = task.loss_fn.keywords["cfg"]
            params = jax.tree.map(lambda a, p=prec: a.astype(p.param_dtype), task.params)
            opt = make_optimizer(schedule_steps=cfg.steps)
            step = make_train_step(functools.partial(gpt_loss, cfg=gcfg, precision=prec), opt)
            state = opt.init(params)
            if name in SCALIFIED:
                step = ss.scalify(step)
                params, state = ss.as_scaled_array(params, "rms"), ss.as_scaled_array(state, "rms")
            step = jax.jit(step)
            curve = []
            for _, b in zip(range(cfg.steps), task.train_batches, strict=False):
                params, state, loss = step(params, state, {k: jnp.asarray(v) for k, v in b.items()})
                curve.append(loss)
            curves[name] = np.asarray([float(np.asarray(_unscaled(x))) for x in curve])
            log(f"  {name}: final loss {curves[name][-1]:.4f}")
        tail = max(1, cfg.steps // 10)
        fp8, bf16 = (float(np.mean(curves[k][-tail:])) for k in ("fp8", "bf16"))
        return {
            "steps": cfg.steps,
            "gpt": gpt,
            "loss_fp8": fp8,
            "loss_bf16": bf16,
            "mean_of_last_steps": tail,
            "gap": (fp8 - bf16) / bf16,
            "finite": bool(np.isfinite(curves["fp8"]).all() and np.isfinite(curves["bf16"]).all()),
        }


def _unscaled(x: Any) -> Any:
    return x.to_array() if hasattr(x, "to_array") else x


def _dense_matmuls(size: Size, *, scan: bool) -> int:
    """FP8-cast dense layers the GPT's forward traces (each: three GEMMs per step):
    scanned, a layer's are traced once, as they stand in the compiled program's text;
    unrolled, every layer's, as a step runs them."""
    cfg = gpt_config(size, scan=scan)
    loss = functools.partial(gpt_loss, cfg=cfg, precision=PRECISIONS["fp8-naive"])
    params = jax.eval_shape(lambda: init_gpt(jax.random.key(0), cfg))  # shapes only
    return check_gpu_fp8.count_dense_matmuls(loss, params, make_batch(size))


# -- the report -------------------------------------------------------------------------


def goal(value: float, key: str) -> str:
    """``(goal <= G met)`` for `GOALS`' ``key`` (``>=`` for the throughput ratio)."""
    g = GOALS[key]
    at_least = key == "fp8_vs_bf16_tokens"
    ok = value >= g if at_least else abs(value) <= g
    shown = f"{100 * g:g} %" if key == "numerics_gap" else f"{g:g}"
    return f"(goal {'>=' if at_least else '<='} {shown} {'met' if ok else 'MISSED'})"


def markdown(results: dict[str, Any]) -> str:
    """results.md: what was measured, on which device, against the issue's goals."""
    lines = ["# scalescope GPU suite", ""]
    env = results.get("env", {})
    if "device" in env:
        d, v = env["device"], env["versions"]
        lines += [
            f"Device: {d['kind']} ({d['platform']}, compute capability "
            f"{d.get('compute_capability')}), {d['count']} device(s); jax {v.get('jax')}, "
            f"jaxlib {v.get('jaxlib')}, python {v.get('python')}; probe kernel "
            f"{env['probe_kernel']}. Model: {results['model']}. Smoke: {results['smoke']}.",
            "",
        ]
        for prec, names in env["missing_rules"].items():
            lines.append(
                f"- primitives without a scalify rule ({prec} step): "
                + (", ".join(names) if names else "none")
            )
        for what, outcome in env.get("traces", {}).items():
            lines.append(f"- {what} of the tiny GPT step traced: {outcome}")
        lines.append("")
    g = results.get("fp8_gemms", {})
    if "gemms" in g:
        lines += [
            "## FP8 GEMMs",
            "",
            f"{g['fp8_gemms']} of {g['gemms']} GEMMs in the compiled scalified FP8 step run "
            f"in FP8 ({g['fp8_cast_gemms']} are FP8-cast dense-layer GEMMs); "
            f"{g['f8_converts']} converts to f8; evidence: {g['evidence']}.",
            f"FP8: {g['fp8_kinds']}",
            f"other: {g['other_kinds']} (patterns: {g['not_fp8_patterns']})",
            "",
        ]
        strict = g.get("without_excess_precision")
        if strict:
            lines += [
                f"Compiled without excess precision (`xla_allow_excess_precision=false`), "
                f"the {strict.get('step', 'fp8')} step: {strict['fp8_gemms']} of "
                f"{strict['gemms']} GEMMs in FP8, "
                f"{strict['f8_converts']} converts to f8.",
                "",
            ]
    t = results.get("throughput", {})
    if "steps" in t:
        lines += [
            "## Throughput",
            "",
            "| step | tokens/s | ms/step | compile s |",
            "|---|---|---|---|",
        ]
        for name, row in t["steps"].items():
            if "tokens_per_s" not in row:
                why = row.get("skipped") or row.get("error", "?").strip().splitlines()[-1]
                lines.append(f"| {name} | not measured: {why} | | |")
                continue
            lines.append(
                f"| {name} | {row['tokens_per_s']:,.0f} | {row['step_ms']:.1f} | "
                f"{row['compile_s']:.1f} |"
            )
        r = t.get("fp8_vs_bf16")
        ratio = "not measured" if r is None else f"{r:.2f}x {goal(r, 'fp8_vs_bf16_tokens')}"
        lines += ["", f"Scalified FP8 / BF16: {ratio}; stretch 1.3", ""]
    p = results.get("probe", {})
    if "instrument_step_x" in p:
        lines += [
            "## The probe",
            "",
            f"Kernel: {p['probe_kernel']}. ss.instrument: step {p['instrument_step_x']:.2f}x "
            f"{goal(p['instrument_step_x'], 'instrument_step')}, temporaries "
            f"{p['instrument_temp_x']:.2f}x {goal(p['instrument_temp_x'], 'instrument_temp')}, "
            f"compile {p['instrument_compile_x']:.2f}x the scalified step.",
            "; ".join(
                f"{label}: {_run_ratio(p.get(key), key)}"
                for key, label in (
                    ("run_every10", "Run(every=10)"),
                    ("run_budget", "Run(budget=0.05)"),
                    ("run_detect", "detection only (the flight recorder)"),
                    ("run_detect_other", "the same with the check placed otherwise"),
                )
            )
            + ", each against the same loop untracked.",
            "",
        ]
    n = results.get("numerics", {})
    if "gap" in n:
        lines += [
            "## Numerics",
            "",
            f"Sample GPT {n['gpt']}, {n['steps']} steps: scalified FP8 {n['loss_fp8']:.4f}, "
            f"BF16 {n['loss_bf16']:.4f} (mean of the last {n['mean_of_last_steps']}): gap "
            f"{100 * n['gap']:+.2f} % {goal(n['gap'], 'numerics_gap')}; "
            f"finite: {n['finite']}.",
            "",
        ]
    failed = {k: v["error"] for k, v in results.get("sections", {}).items() if v.get("error")}
    if failed:
        lines += ["## Sections that failed", ""]
        lines += [f"- {k}: {e.strip().splitlines()[-1]}" for k, e in failed.items()]
        lines.append("")
    secs = results.get("sections", {})
    lines.append("Section times: " + ", ".join(_section_time(k, v) for k, v in secs.items()))
    return "\n".join(lines) + "\n"


def _run_ratio(row: dict[str, Any] | None, key: str) -> str:
    if not row or "ratio" not in row:
        return "not measured" + (f" ({row['skipped']})" if row and row.get("skipped") else "")
    where = f", check {row['check']}" if "check" in row else ""
    return f"{row['ratio']:.3f}x {goal(row['ratio'], key)} over {row['steps']} steps{where}"


def _section_time(name: str, section: dict[str, Any]) -> str:
    if section.get("running"):
        return f"{name} did not finish (started {section['started_s']:.0f} s into the suite)"
    if section.get("skipped"):
        return f"{name} skipped ({section['skipped']})"
    return f"{name} {section['seconds']:.0f} s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for results.json and results.md")
    parser.add_argument("--smoke", action="store_true", help="a tiny model (CPU, CI)")
    parser.add_argument("--only", default=None, help=f"comma-separated sections of {SECTIONS}")
    parser.add_argument(
        "--deadline",
        type=float,
        default=420.0,
        help="seconds after which no further section (or part of one) starts (default 420: "
        "a 10-minute device call keeps time to copy the results back)",
    )
    parser.add_argument(
        "--allow-cpu",
        action="store_true",
        help="run the full-size suite even when JAX found no GPU (without it: exit 2)",
    )
    args = parser.parse_args(argv)
    if args.smoke:  # before the backend starts: XLA reads XLA_FLAGS once
        os.environ["XLA_FLAGS"] = smoke_xla_flags(os.environ.get("XLA_FLAGS", ""))
    only = SECTIONS if args.only is None else tuple(args.only.split(","))
    unknown = [s for s in only if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; expected some of {SECTIONS}")
    backend = jax.default_backend()
    if backend == "cpu" and not (args.smoke or args.allow_cpu):
        # JAX falls back to the CPU when CUDA does not start: GPT-2 on a CPU would run
        # into the device call's time limit and say nothing about a GPU
        print(
            "gpu_suite: JAX found no GPU (backend: cpu; devices: "
            f"{jax.devices()}); pass --smoke or --allow-cpu to run on the CPU",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    size = SMOKE if args.smoke else FULL
    results: dict[str, Any] = {
        "smoke": args.smoke,
        "model": f"GPT {size.layers}x{size.d_model}, {size.heads} heads, seq {size.seq}, "
        f"batch {size.batch}, vocab {size.vocab}, layers scanned, AdamW",
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "sections": {},
    }
    t_all = time.perf_counter()
    suite = Suite(size, out, results, lambda: _write(out, results), t_all + args.deadline)
    results["compilation_cache"] = _persistent_cache()
    for name in only:
        if time.perf_counter() - t_all > args.deadline:
            log(f"section {name} skipped: past the {args.deadline:.0f} s deadline")
            results["sections"][name] = {"seconds": 0.0, "error": None, "skipped": "deadline"}
            continue
        log(f"section {name}")
        t0 = time.perf_counter()
        # marked as running until it ends: a suite killed at its time limit says where
        results["sections"][name] = {"running": True, "started_s": t0 - t_all, "error": None}
        _write(out, results)
        try:
            results[name] = getattr(suite, name)()
            error = None
        except Exception:  # noqa: BLE001 - recorded, and the other sections still run
            error = traceback.format_exc()
            log(f"section {name} FAILED:\n{error}")
        results["sections"][name] = {"seconds": time.perf_counter() - t0, "error": error}
        _write(out, results)  # after every section: a killed suite keeps what it measured
    results["seconds"] = time.perf_counter() - t_all
    # The GPU image has neither: nothing the suite ran may have needed them.
    results["ui_modules_imported"] = sorted(
        {m.split(".")[0] for m in sys.modules if m.split(".")[0] in ("panel", "bokeh")}
    )
    _write(out, results)
    print(markdown(results))
    return 1 if any(v.get("error") for v in results["sections"].values()) else 0


def _persistent_cache() -> str:
    """Programs the sections compile twice (the scalified step inside each `Run`) are
    compiled once: JAX's persistent cache, in ``$JAX_COMPILATION_CACHE_DIR`` or a new
    temporary folder (a folder kept from an earlier run would turn the compile times
    measured here into cache reads). Returns the folder."""
    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    folder = os.environ.get("JAX_COMPILATION_CACHE_DIR") or tempfile.mkdtemp(
        prefix="scalescope-gpu-suite-cache-"
    )
    jax.config.update("jax_compilation_cache_dir", folder)
    return folder


def _write(out: Path, results: dict[str, Any]) -> None:
    for name, text in (
        ("results.json", json.dumps(results, indent=1, default=str)),
        ("results.md", markdown(results)),
    ):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)


if __name__ == "__main__":
    sys.exit(main())
