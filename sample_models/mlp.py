"""A plain-JAX multi-layer perceptron classifier (MNIST-sized by default)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from .losses import cross_entropy
from .precision import PRECISIONS, Precision

Params = dict[str, Any]


@dataclass(frozen=True)
class MLPConfig:
    """Input width, hidden widths and number of classes."""

    in_dim: int = 784
    hidden: tuple[int, ...] = (256, 256)
    n_classes: int = 10


def init_mlp(key: jax.Array, cfg: MLPConfig, dtype=jnp.float32) -> Params:
    """He-normal weights and zero biases; ``params["layers"]`` is a list of {"w", "b"}."""
    dims = (cfg.in_dim, *cfg.hidden, cfg.n_classes)
    keys = jax.random.split(key, len(dims) - 1)
    layers = []
    for k, d_in, d_out in zip(keys, dims[:-1], dims[1:], strict=True):
        w = jax.random.normal(k, (d_in, d_out), jnp.float32) * math.sqrt(2.0 / d_in)
        layers.append({"w": w.astype(dtype), "b": jnp.zeros((d_out,), dtype)})
    return {"layers": layers}


def mlp_forward(
    params: Params,
    x: jax.Array,
    cfg: MLPConfig,
    precision: Precision = PRECISIONS["fp32"],
) -> jax.Array:
    """Logits [B, n_classes] for inputs [B, in_dim]; ReLU between dense layers."""
    layers = params["layers"]
    if len(layers) != len(cfg.hidden) + 1:
        raise ValueError(f"params have {len(layers)} layers, cfg expects {len(cfg.hidden) + 1}")
    x = x.astype(layers[0]["w"].dtype)
    for i, p in enumerate(layers):
        with jax.named_scope(f"dense_{i}"):
            x = precision.matmul(x, p["w"]) + p["b"].astype(x.dtype)
            if i < len(layers) - 1:
                x = jax.nn.relu(x)
    return x


def mlp_loss(
    params: Params,
    batch: dict[str, jax.Array],
    cfg: MLPConfig,
    precision: Precision = PRECISIONS["fp32"],
) -> jax.Array:
    """Mean cross-entropy; batch holds float "x" [B, in_dim] and int "y" [B]."""
    logits = mlp_forward(params, batch["x"], cfg, precision)
    with jax.named_scope("loss"):
        return cross_entropy(logits, batch["y"])


def mlp_accuracy(
    params: Params,
    batch: dict[str, jax.Array],
    cfg: MLPConfig,
    precision: Precision = PRECISIONS["fp32"],
) -> jax.Array:
    """Fraction of examples whose argmax logit is the label."""
    logits = mlp_forward(params, batch["x"], cfg, precision)
    return jnp.mean(jnp.argmax(logits, axis=-1) == batch["y"])
