"""The training loop behind ``scalescope train``: a sample model, real data, one precision
recipe, recorded into a run directory.

Recipes (`sample_models.precision`): ``fp32``; ``fp16`` (FP16 weights and AdamW state)
and ``fp8`` (E4M3 matmul inputs forward, E5M2 gradients backward, FP16 weights and
state, each cast input re-centred first), both under `scalescope.scalify`;
``fp8-static``, the FP8 casts with static scale propagation only; ``fp8-naive``, the same
FP8 casts on plain values (FP32 weights), which is what goes wrong without scale
propagation.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import numpy as np
import optax

import scalescope as ss
from scalescope.core.policy import as_policy
from scalescope.store.writer import DEFAULT_FORMATS

from . import data as D
from .gpt import GPTConfig, gpt_loss, init_gpt
from .mlp import MLPConfig, init_mlp, mlp_accuracy, mlp_loss
from .precision import PRECISIONS, SCALIFIED, get_precision, unit_init
from .train_step import make_train_step, with_state_dtype

MODELS = ("gpt", "mlp")
PRECISION_NAMES = tuple(PRECISIONS)
OPT_STATE_DTYPES = ("float32", "float16", "bfloat16")


@dataclass
class TrainConfig:
    """Everything that decides a training run (kept in the run's metadata)."""

    model: str = "gpt"
    precision: str = "fp32"
    steps: int = 1000
    seed: int = 0
    batch: int = 32
    learning_rate: float | None = None  # None: the recipe's (`Precision.learning_rate`)
    weight_decay: float = 0.01
    eval_every: int = 0  # 0: about ten evaluations per run
    eval_batches: int = 8
    data: str = "auto"  # gpt: full | vendored | auto
    data_dir: str | None = None  # mlp: Fashion-MNIST IDX directory
    gpt: dict[str, Any] = field(
        default_factory=lambda: {"seq_len": 64, "d_model": 128, "n_heads": 4, "n_layers": 2}
    )
    mlp_hidden: tuple[int, ...] = (256, 256)
    # mlp: the pixel values in [0, 1] are multiplied by this. 1 is the normalised input;
    # 255 feeds the raw 0..255 bytes (unnormalised features, a common mistake): the
    # first layer's activations then exceed E4M3's 448, which naive FP8 casts turn into NaN.
    input_scale: float = 1.0
    # AdamW's state (moments) and update math: None keeps them in the parameters' dtype
    # (FP16 for the fp16/fp8 recipes); "float32" gives FP16 master weights FP32 state.
    opt_state_dtype: str | None = None

    def check(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; expected one of {MODELS}")
        if self.precision not in PRECISION_NAMES:
            raise ValueError(
                f"unknown precision {self.precision!r}; expected one of {PRECISION_NAMES}"
            )
        for name in ("steps", "batch", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0, got {self.eval_every}")
        lr = self.learning_rate
        if lr is not None and not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"learning_rate must be finite and > 0, got {lr}")
        for name in ("seq_len", "d_model", "n_layers", "n_heads"):
            value = self.gpt.get(name)
            if value is not None and value < 1:
                raise ValueError(f"gpt {name} must be >= 1, got {value}")
        if any(width < 1 for width in self.mlp_hidden):
            raise ValueError(f"mlp_hidden widths must be >= 1, got {list(self.mlp_hidden)}")
        scale = self.input_scale
        if isinstance(scale, bool) or not isinstance(scale, int | float):
            raise ValueError(f"input_scale must be a number, got {scale!r}")
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"input_scale must be finite and > 0, got {scale}")
        if self.model != "mlp" and scale != 1:
            raise ValueError(f"input_scale applies to the mlp only, got {scale} for {self.model}")
        if self.opt_state_dtype is not None and self.opt_state_dtype not in OPT_STATE_DTYPES:
            raise ValueError(
                f"unknown opt_state_dtype {self.opt_state_dtype!r}; "
                f"expected None or one of {OPT_STATE_DTYPES}"
            )


@dataclass
class Task:
    """A model ready to train: loss, initial state, batches, evaluation."""

    loss_fn: Callable[[Any, Any], jax.Array]
    params: Any
    train_batches: Iterator[dict[str, np.ndarray]]
    eval_batches: list[dict[str, np.ndarray]]
    info: dict[str, Any]
    metric_fn: Callable[[Any, Any], jax.Array] | None = None  # e.g. accuracy


def _gpt_task(cfg: TrainConfig) -> Task:
    text = D.load_shakespeare(cfg.data)
    vocab = D.CharVocab.from_text(text)
    train_tok, val_tok = D.split_tokens(vocab.encode(text), 0.1)
    gcfg = GPTConfig(vocab_size=vocab.size, **cfg.gpt)
    precision = get_precision(cfg.precision)
    params = init_gpt(jax.random.key(cfg.seed), gcfg, precision.param_dtype)
    return Task(
        loss_fn=functools.partial(gpt_loss, cfg=gcfg, precision=precision),
        params=params,
        train_batches=D.char_lm_batches(train_tok, cfg.batch, gcfg.seq_len, cfg.seed),
        eval_batches=D.char_lm_eval_batches(val_tok, cfg.batch, gcfg.seq_len, cfg.eval_batches),
        info={
            "dataset": f"shakespeare ({cfg.data})",
            "train_chars": int(train_tok.size),
            "val_chars": int(val_tok.size),
            "vocab_size": vocab.size,
            **asdict(gcfg),
        },
    )


def _mlp_task(cfg: TrainConfig) -> Task:
    x, y = D.load_fashion_mnist("train", cfg.data_dir)
    xv, yv = D.load_fashion_mnist("test", cfg.data_dir)
    if cfg.input_scale != 1:
        x, xv = x * np.float32(cfg.input_scale), xv * np.float32(cfg.input_scale)
    mcfg = MLPConfig(in_dim=x.shape[1], hidden=tuple(cfg.mlp_hidden), n_classes=10)
    precision = get_precision(cfg.precision)
    params = init_mlp(jax.random.key(cfg.seed), mcfg, precision.param_dtype)
    n_eval = min(len(xv), cfg.batch * cfg.eval_batches)
    evals = [
        {"x": xv[i : i + cfg.batch], "y": yv[i : i + cfg.batch]}
        for i in range(0, n_eval - cfg.batch + 1, cfg.batch)
    ]
    return Task(
        loss_fn=functools.partial(mlp_loss, cfg=mcfg, precision=precision),
        params=params,
        train_batches=D.classification_batches(x, y, cfg.batch, cfg.seed),
        eval_batches=evals,
        info={"dataset": "fashion-mnist", "train_examples": len(x), **asdict(mcfg)},
        metric_fn=functools.partial(mlp_accuracy, cfg=mcfg, precision=precision),
    )


def make_task(cfg: TrainConfig) -> Task:
    cfg.check()
    task = _gpt_task(cfg) if cfg.model == "gpt" else _mlp_task(cfg)
    if get_precision(cfg.precision).unit:
        task = _unit_scaled(task, cfg.seed)
    return task


def _unit_scaled(task: Task, seed: int) -> Task:
    """The task's model under static unit scaling: the plain loss (and metric) transformed
    by `ss.unit_scale`, weights redrawn at unit standard deviation."""
    metric = task.metric_fn
    return dataclasses.replace(
        task,
        loss_fn=ss.unit_scale(task.loss_fn),
        metric_fn=None if metric is None else ss.unit_scale(metric),
        params=unit_init(task.params, jax.random.key(seed + 1)),
        info={**task.info, "unit_scaled": True},
    )


def peak_learning_rate(cfg: TrainConfig) -> float:
    """``cfg.learning_rate``, or the recipe's own when it is None (2e-3; 0.1 for the
    statically unit-scaled recipe, whose weights have unit standard deviation)."""
    if cfg.learning_rate is not None:
        return float(cfg.learning_rate)
    return get_precision(cfg.precision).learning_rate


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Cosine decay from ``learning_rate`` to zero over the run, after a short warm-up."""
    warmup = max(1, min(100, cfg.steps // 10))
    return optax.warmup_cosine_decay_schedule(
        0.0, peak_learning_rate(cfg), warmup, max(cfg.steps, warmup + 1)
    )


def make_adamw(
    cfg: TrainConfig, schedule: optax.Schedule | None = None
) -> optax.GradientTransformation:
    """The AdamW of ``scalescope train``: ``schedule`` (default `learning_rate_schedule`),
    eps 1e-6 (representable in FP16), state in ``cfg.opt_state_dtype`` when set."""
    opt = optax.adamw(
        learning_rate_schedule(cfg) if schedule is None else schedule,
        eps=1e-6,
        weight_decay=cfg.weight_decay,
    )
    if cfg.opt_state_dtype is not None:
        opt = with_state_dtype(opt, cfg.opt_state_dtype)
    return opt


class Progress:
    """A one-line progress bar (steps/s, loss) on a terminal; periodic lines otherwise.
    The eta appears once `MIN_TIMED` steps after the first (which compiles) are timed."""

    MIN_TIMED = 3

    def __init__(self, total: int, label: str, stream: TextIO | None = None) -> None:
        self.total, self.label = total, label
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()
        self.last_print = 0.0
        self.last_line_step = -1
        self.timed_from: tuple[int, float] | None = None  # (steps, time) the rate counts from

    def due(self) -> bool:
        return time.perf_counter() - self.last_print >= (0.25 if self.tty else 5.0)

    def update(self, done: int, **values: float) -> None:
        self.last_print = time.perf_counter()
        if self.timed_from is None and done >= 1:
            # the first steps compile: time the rate (and the eta) from the next ones on
            self.timed_from = (done, self.last_print)
        elapsed = self.last_print - self.t0
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = "eta    -"
        if self.timed_from is not None and done - self.timed_from[0] >= self.MIN_TIMED:
            steps, seconds = done - self.timed_from[0], self.last_print - self.timed_from[1]
            rate = steps / seconds if seconds > 0 else rate
            if rate > 0:
                eta = f"eta {(self.total - done) / rate:4.0f}s"
        shown = "  ".join(f"{k} {v:.4f}" for k, v in values.items() if v is not None)
        width = 24
        filled = int(width * done / self.total)
        bar = "#" * filled + "." * (width - filled)
        line = f"{self.label} [{bar}] {done}/{self.total}  {rate:5.1f} steps/s  {shown}  {eta}"
        if self.tty:
            self.stream.write("\r" + line + "\x1b[K")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _to_float(x: Any) -> float:
    return float(np.asarray(ss.asarray(x), np.float64))


def train(
    cfg: TrainConfig,
    run_dir: str,
    *,
    every: int = 10,
    budget: float | None = None,
    sample: int | None = None,
    histograms: bool = True,
    formats: tuple[str, ...] | None = None,
    stop_on_nan: bool = True,
    progress: bool = True,
    stream: TextIO | None = None,
    policy: Any = None,
) -> dict[str, Any]:
    """Train ``cfg.model`` in ``cfg.precision`` for ``cfg.steps`` steps, recording every
    ``every`` steps into ``run_dir`` (or under an overhead ``budget``, see `ss.Run`);
    ``formats``: formats and recipes to audit (default: `ss.Run`'s). ``policy``: a
    precision policy the step trains under (`ss.emulate`, via `Run.track`).
    Returns a summary: final train and validation loss,
    steps done, speed, and the first step whose loss was not finite (or None)."""
    task = make_task(cfg)
    scalified = cfg.precision in SCALIFIED
    schedule = learning_rate_schedule(cfg)
    opt = make_adamw(cfg, schedule)
    step_fn = make_train_step(task.loss_fn, opt)
    params, opt_state = task.params, opt.init(task.params)
    eval_loss = jax.jit(ss.scalify(task.loss_fn) if scalified else task.loss_fn)
    eval_metric = None
    if task.metric_fn is not None:
        eval_metric = jax.jit(ss.scalify(task.metric_fn) if scalified else task.metric_fn)
    if scalified:
        params = ss.as_scaled_array(params, "rms")
        opt_state = ss.as_scaled_array(opt_state, "rms")
    if policy is not None and task.eval_batches:
        # a rule reaching no op fails here, before the run directory exists
        example = {k: jnp.asarray(v) for k, v in task.eval_batches[0].items()}
        ss.emulate(step_fn, policy, scalify=scalified).describe(params, opt_state, example)
    eval_every = cfg.eval_every or max(1, cfg.steps // 10)
    config = {
        **asdict(cfg),
        "learning_rate": peak_learning_rate(cfg),
        "every": every,
        "budget": budget,
        "sample": sample,
        "scalify": scalified,
        **task.info,
    }
    bar = Progress(cfg.steps, f"{cfg.model} {cfg.precision}", stream) if progress else None

    def evaluate() -> dict[str, float]:
        losses = [_to_float(eval_loss(params, b)) for b in task.eval_batches]
        out = {"val_loss": float(np.mean(losses))}
        if eval_metric is not None:
            out["val_accuracy"] = float(
                np.mean([_to_float(eval_metric(params, b)) for b in task.eval_batches])
            )
        return out

    losses: list[Any] = []
    last_val: dict[str, float] = {}
    nan_step = None
    done = 0
    t0 = time.perf_counter()
    extra = {} if formats is None else {"formats": tuple(formats)}
    if policy is not None:  # what the policy rounds to is recorded, so it is judged
        policy = as_policy(policy)
        base = extra.get("formats", DEFAULT_FORMATS)
        extra["formats"] = (*base, *(t for t in policy.targets() if t not in base))
    with ss.Run(
        run_dir,
        every=every,
        budget=budget,
        sample=sample,
        histograms=histograms,
        config=config,
        **extra,
    ) as run:
        tracked = run.track(step_fn, scalify=scalified, policy=policy)
        if budget is not None:
            # Under a budget the statistics program would compile in the background, and
            # a short run could end before it is ready: compile both programs first, on
            # the first batch (which the loop then trains on).
            head = next(task.train_batches)
            task.train_batches = itertools.chain([head], task.train_batches)
            tracked.warmup(params, opt_state, {k: jnp.asarray(v) for k, v in head.items()})
        first = tracked.step
        try:
            for i in range(first, first + cfg.steps):
                batch = {k: jnp.asarray(v) for k, v in next(task.train_batches).items()}
                params, opt_state, loss = tracked(params, opt_state, batch)
                run.log(i, loss=loss, lr=float(schedule(i - first)))
                losses.append(loss)
                done += 1
                last = done == cfg.steps
                if done % eval_every == 0 or last:
                    last_val = evaluate()
                    run.log(i, **last_val)
                if bar is not None and (bar.due() or last):
                    bar.update(done, loss=_to_float(loss), **last_val)
                if stop_on_nan and nan_step is None:
                    # the previous step's loss: that step ran while this one was
                    # dispatched, so reading it leaves the device no idle time (at the
                    # end, the last step's too): training stops one step after a NaN
                    for k in [*([done - 2] if done >= 2 else []), *([done - 1] if last else [])]:
                        if not math.isfinite(_to_float(losses[k])):
                            nan_step = first + k
                            break
                    if nan_step is not None:
                        break
        finally:
            if bar is not None:
                bar.close()
    elapsed = time.perf_counter() - t0
    values = np.array([_to_float(x) for x in losses])
    if nan_step is None:
        bad = np.flatnonzero(~np.isfinite(values))
        nan_step = int(first + bad[0]) if bad.size else None
    tail = values[-max(1, len(values) // 20) :]
    return {
        "model": cfg.model,
        "precision": cfg.precision,
        "steps": done,
        "train_loss": float(np.mean(tail)),
        **last_val,
        "nan_step": nan_step,
        "steps_per_s": done / elapsed if elapsed > 0 else float("nan"),
        "run": str(run_dir),
    }
