"""A small GPT-style decoder in plain JAX (pre-LayerNorm, causal multi-head attention).

Parameters are a nested dict pytree. Layers run either unrolled (a Python loop,
``params["blocks"]`` is a list of per-layer dicts) or under `jax.lax.scan`
(``cfg.scan_layers``; ``params["blocks"]`` is one dict of stacked leaves). The block function
is written once and used by both, and `jax.named_scope` gives every op a readable name
("block_0/attn/...", "blocks/mlp/...").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from scalescope.ops.scaling import dynamic_rescale_l2_grad

from .losses import cross_entropy
from .precision import PRECISIONS, Precision

Params = dict[str, Any]


@dataclass(frozen=True)
class GPTConfig:
    """Model sizes and layout switches of the GPT decoder."""

    vocab_size: int = 65
    seq_len: int = 64
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 2
    mlp_ratio: int = 4
    tie_embeddings: bool = False
    scan_layers: bool = False
    gelu_approximate: bool = True

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )


# ---------------------------------------------------------------------------------------
# Initialisation


def _normal(key: jax.Array, shape: tuple[int, ...], std: float, dtype) -> jax.Array:
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def _dense(key: jax.Array, d_in: int, d_out: int, std: float, dtype) -> Params:
    return {"w": _normal(key, (d_in, d_out), std, dtype), "b": jnp.zeros((d_out,), dtype)}


def _layer_norm_params(d: int, dtype) -> Params:
    return {"scale": jnp.ones((d,), dtype), "bias": jnp.zeros((d,), dtype)}


def _init_block(key: jax.Array, cfg: GPTConfig, dtype) -> Params:
    d, hidden = cfg.d_model, cfg.mlp_ratio * cfg.d_model
    # GPT-2: residual projections get std scaled by 1/sqrt(2 * n_layers).
    resid_std = 0.02 / math.sqrt(2 * cfg.n_layers)
    k_qkv, k_proj, k_fc, k_out = jax.random.split(key, 4)
    return {
        "ln_1": _layer_norm_params(d, dtype),
        "attn": {
            "qkv": _dense(k_qkv, d, 3 * d, 0.02, dtype),
            "proj": _dense(k_proj, d, d, resid_std, dtype),
        },
        "ln_2": _layer_norm_params(d, dtype),
        "mlp": {
            "fc": _dense(k_fc, d, hidden, 0.02, dtype),
            "proj": _dense(k_out, hidden, d, resid_std, dtype),
        },
    }


def init_gpt(key: jax.Array, cfg: GPTConfig, dtype=jnp.float32) -> Params:
    """Initial parameters: N(0, 0.02) weights, zero biases, unit LayerNorm scales.

    ``params["blocks"]`` is stacked (leading axis ``n_layers``) when ``cfg.scan_layers``,
    else a list of per-layer dicts.
    """
    k_wte, k_wpe, k_head, k_blocks = jax.random.split(key, 4)
    blocks = [_init_block(k, cfg, dtype) for k in jax.random.split(k_blocks, cfg.n_layers)]
    params: Params = {
        "wte": _normal(k_wte, (cfg.vocab_size, cfg.d_model), 0.02, dtype),
        "wpe": _normal(k_wpe, (cfg.seq_len, cfg.d_model), 0.02, dtype),
        "blocks": blocks,
        "ln_f": _layer_norm_params(cfg.d_model, dtype),
    }
    if not cfg.tie_embeddings:
        params["head"] = {"w": _normal(k_head, (cfg.d_model, cfg.vocab_size), 0.02, dtype)}
    return stack_blocks(params) if cfg.scan_layers else params


def stack_blocks(params: Params) -> Params:
    """Unrolled layout -> scanned layout: the list of blocks becomes one stacked dict."""
    blocks = params["blocks"]
    if not isinstance(blocks, list | tuple):
        raise ValueError("params['blocks'] is already stacked")
    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *blocks)
    return {**params, "blocks": stacked}


def unstack_blocks(params: Params) -> Params:
    """Scanned layout -> unrolled layout: one dict per layer, sliced off the leading axis."""
    stacked = params["blocks"]
    if isinstance(stacked, list | tuple):
        raise ValueError("params['blocks'] is already a list of per-layer dicts")
    n_layers = jax.tree.leaves(stacked)[0].shape[0]
    blocks = [jax.tree.map(lambda leaf, i=i: leaf[i], stacked) for i in range(n_layers)]
    return {**params, "blocks": blocks}


# ---------------------------------------------------------------------------------------
# Forward pass


def layer_norm(p: Params, x: jax.Array, eps: float = 1e-5) -> jax.Array:
    """LayerNorm over the last axis, written out (mean, variance, rsqrt).

    Statistics are computed in at least float32 and the result is cast back to ``x``'s
    dtype, as Flax's LayerNorm does: in float16 the gradient of ``rsqrt(var + eps)``
    (``-0.5 * rsqrt / (var + eps)``) overflows for the small variances of a freshly
    initialised model, which would make every unscaled float16 baseline NaN at step 0.
    """
    dtype = x.dtype
    stat_dtype = jnp.promote_types(jnp.float32, dtype)
    x = x.astype(stat_dtype)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    centred = x - mean
    var = jnp.mean(centred * centred, axis=-1, keepdims=True)
    normed = centred * jax.lax.rsqrt(var + eps)
    return (normed * p["scale"].astype(stat_dtype) + p["bias"].astype(stat_dtype)).astype(dtype)


def _dense_apply(p: Params, x: jax.Array, precision: Precision) -> jax.Array:
    return precision.matmul(x, p["w"]) + p["b"].astype(x.dtype)


def causal_attention(p: Params, x: jax.Array, cfg: GPTConfig, precision: Precision) -> jax.Array:
    """Causal multi-head self-attention; x: [B, T, d] -> [B, T, d]."""
    batch, seq, d = x.shape
    head_dim = d // cfg.n_heads
    qkv = _dense_apply(p["qkv"], x, precision)
    q, k, v = (t.reshape(batch, seq, cfg.n_heads, head_dim) for t in jnp.split(qkv, 3, axis=-1))
    q = q * jnp.asarray(1.0 / math.sqrt(head_dim), q.dtype)
    # Scores and softmax in at least float32, as mixed-precision recipes do: the softmax
    # gradient is spiky, and its FP16 products overflow even at unit RMS.
    stat_dtype = jnp.promote_types(jnp.float32, x.dtype)
    scores = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=stat_dtype)
    if precision.rescale:
        # The softmax backward leaves the scores' gradient far from unit scale (data RMS
        # ~2^9.5 after a few hundred steps), and the q/k gradients built from it then
        # overflow FP16 on their way back: re-centre it (identity outside scalify).
        scores = dynamic_rescale_l2_grad(scores)
    mask = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhts,bshd->bthd", probs, v)
    if precision.rescale:
        # The same in the other product: the gradient reaching it from the projection
        # grows spiky (data abs-max 2^10 on random tokens), and its product with v, the
        # probabilities' gradient, then overflows FP16: re-centre it too.
        out = dynamic_rescale_l2_grad(out)
    out = out.reshape(batch, seq, d)
    return _dense_apply(p["proj"], out, precision)


def mlp_block(p: Params, x: jax.Array, cfg: GPTConfig, precision: Precision) -> jax.Array:
    """Position-wise MLP: dense -> GELU -> dense."""
    h = _dense_apply(p["fc"], x, precision)
    # GELU in at least float32: its tanh form cubes its input, and 41**3 already
    # overflows FP16 data.
    stat_dtype = jnp.promote_types(jnp.float32, h.dtype)
    h = jax.nn.gelu(h.astype(stat_dtype), approximate=cfg.gelu_approximate).astype(h.dtype)
    return _dense_apply(p["proj"], h, precision)


def gpt_block(p: Params, x: jax.Array, cfg: GPTConfig, precision: Precision) -> jax.Array:
    """One pre-LayerNorm transformer block; shared by the unrolled and scanned layouts."""
    with jax.named_scope("ln_1"):
        h = layer_norm(p["ln_1"], x)
    with jax.named_scope("attn"):
        x = x + causal_attention(p["attn"], h, cfg, precision)
    with jax.named_scope("ln_2"):
        h = layer_norm(p["ln_2"], x)
    with jax.named_scope("mlp"):
        x = x + mlp_block(p["mlp"], h, cfg, precision)
    return x


def _run_blocks(blocks: Any, x: jax.Array, cfg: GPTConfig, precision: Precision) -> jax.Array:
    if cfg.scan_layers:
        if isinstance(blocks, list | tuple):
            raise ValueError("cfg.scan_layers needs stacked blocks: use stack_blocks(params)")

        def body(carry: jax.Array, p: Params) -> tuple[jax.Array, None]:
            with jax.named_scope("blocks"):
                return gpt_block(p, carry, cfg, precision), None

        with jax.named_scope("blocks"):
            x, _ = jax.lax.scan(body, x, blocks)
        return x
    if not isinstance(blocks, list | tuple):
        raise ValueError("unrolled layers need a list of blocks: use unstack_blocks(params)")
    for i, p in enumerate(blocks):
        with jax.named_scope(f"block_{i}"):
            x = gpt_block(p, x, cfg, precision)
    return x


def gpt_forward(
    params: Params,
    tokens: jax.Array,
    cfg: GPTConfig,
    precision: Precision = PRECISIONS["fp32"],
) -> jax.Array:
    """Logits [B, T, vocab] for int32 tokens [B, T] (T <= cfg.seq_len)."""
    seq = tokens.shape[-1]
    if seq > cfg.seq_len:
        raise ValueError(f"sequence length {seq} exceeds cfg.seq_len={cfg.seq_len}")
    with jax.named_scope("embed"):
        x = jnp.take(params["wte"], tokens, axis=0) + params["wpe"][:seq]
    x = _run_blocks(params["blocks"], x, cfg, precision)
    with jax.named_scope("ln_f"):
        x = layer_norm(params["ln_f"], x)
    with jax.named_scope("head"):
        w = params["wte"].T if cfg.tie_embeddings else params["head"]["w"]
        return precision.matmul(x, w)


def gpt_loss(
    params: Params,
    batch: dict[str, jax.Array],
    cfg: GPTConfig,
    precision: Precision = PRECISIONS["fp32"],
) -> jax.Array:
    """Next-token cross-entropy; batch holds int32 "inputs" and "targets" [B, T]."""
    logits = gpt_forward(params, batch["inputs"], cfg, precision)
    with jax.named_scope("loss"):
        return cross_entropy(logits, batch["targets"])
