"""``scalescope verify RUN``: re-train a recorded sample-model run with a precision
policy and without, and keep the measured loss gap beside the what-if's prediction."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import sys
from pathlib import Path
from typing import Any, TextIO

import jax.numpy as jnp

import scalescope as ss
from scalescope.analysis import predict_policy_run, predicted_verdict
from scalescope.core.policy import as_policy
from scalescope.store import layout as L
from scalescope.verification import GAP_THRESHOLD, Verification

from .precision import SCALIFIED
from .train import TrainConfig, make_adamw, make_task
from .train_step import make_train_step


def config_of(reader: ss.RunReader) -> TrainConfig:
    """The `TrainConfig` a sample-model run was trained with (from its metadata)."""
    config = reader.config
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    if not config.get("model") or not config.get("precision"):
        raise ss.RunError(
            f"{reader.path}: not a run of `scalescope train` (its metadata holds no sample-"
            "model config); for your own step use ss.verify(step, init_args, batches, policy)"
        )
    cfg = TrainConfig(**{k: v for k, v in config.items() if k in fields})
    if isinstance(cfg.mlp_hidden, list):
        cfg.mlp_hidden = tuple(cfg.mlp_hidden)
    return cfg


def verify_run(
    run_dir: str | Path,
    policy: Any,
    *,
    steps: int = 300,
    threshold: float = GAP_THRESHOLD,
    stream: TextIO | None = None,
    save: bool = True,
    control: bool = True,
) -> Verification:
    """Re-train the run's model, precision, seed and batches for ``steps`` steps with
    ``policy`` and without (`ss.verify`), set the what-if's prediction beside the
    measurement and keep it in the run (``verified/``) when ``save``. ``control``: also
    train the BF16 control that sets the noise floor (`ss.verify`)."""
    reader = ss.open_run(run_dir)
    policy = as_policy(policy)
    prediction = predict_policy_run(reader, policy)  # a rule reaching nothing fails here
    cfg = dataclasses.replace(config_of(reader), steps=steps)
    task = make_task(cfg)
    step_fn = make_train_step(task.loss_fn, make_adamw(cfg))
    params, opt_state = task.params, make_adamw(cfg).init(task.params)
    scalified = cfg.precision in SCALIFIED
    if scalified:
        params = ss.as_scaled_array(params, "rms")
        opt_state = ss.as_scaled_array(opt_state, "rms")
    batches = [
        {k: jnp.asarray(v) for k, v in next(task.train_batches).items()} for _ in range(steps)
    ]
    out = stream or sys.stderr
    out.write(
        f"verify: {cfg.model} {cfg.precision}, {steps} steps plain, with the policy "
        f"({len(policy)} rules, {len(prediction)} values){' and the BF16 control' * control}\n"
    )
    result = ss.verify(
        step_fn,
        (params, opt_state),
        batches,
        policy,
        steps=steps,
        scalify=scalified,
        threshold=threshold,
        control=control,
        progress=out,
    )
    result.predicted = predicted_verdict(prediction)
    result.prediction = [
        {k: (None if v is None else v) for k, v in row.items()}
        for row in prediction.to_dict(orient="records")
    ]
    result.meta = {
        "time": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "model": cfg.model,
        "precision": cfg.precision,
        "seed": cfg.seed,
    }
    if save:
        L.write_verification(Path(run_dir), result.to_dict())
    return result
