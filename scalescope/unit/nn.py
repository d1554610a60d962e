"""Flax NNX modules built on the unit-scaled ops (`scalescope.unit`).

Weights start unit-variance (``N(0, 1)``; norm scales at 1, biases at 0): the ops carry
the fan-in and batch factors, so no initialisation scale is needed. The transformer
stack follows the library's (u-μP) depth rule for residual weights,
`transformer_residual_scaling_rule`. This module imports Flax; the ops do not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from . import functional as F
from .constraints import validate_constraint

Array = jax.Array


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: Any) -> nnx.Param:
    return nnx.Param(jax.random.normal(rngs.params(), shape, dtype))


def _value(p: nnx.Param | None) -> Array | None:
    return None if p is None else p[...]


class Linear(nnx.Module):
    """Unit-scaled ``x @ kernel + bias`` with ``kernel: (in, out)`` ~ N(0, 1).

    No bias by default, as in the library.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = False,
        constraint: str | None = "to_output_scale",
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ):
        validate_constraint(constraint, type(self).__name__)
        self.in_features, self.out_features = in_features, out_features
        self.constraint = constraint
        self.kernel = _normal(rngs, (in_features, out_features), param_dtype)
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if bias else None

    def __call__(self, x: Array) -> Array:
        return F.linear(x, self.kernel[...], _value(self.bias), self.constraint)


class LinearReadout(Linear):
    """The final projection (u-μP readout): output scale ``1/in``, unconstrained."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = False,
        constraint: str | None = None,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ):
        super().__init__(
            in_features,
            out_features,
            bias=bias,
            constraint=constraint,
            param_dtype=param_dtype,
            rngs=rngs,
        )

    def __call__(self, x: Array) -> Array:
        return F.linear_readout(x, self.kernel[...], _value(self.bias), self.constraint)


class LayerNorm(nnx.Module):
    """Layer normalisation over the last axis; learnable ``scale``/``bias`` only with
    ``elementwise_affine=True`` (off by default, as in the library)."""

    def __init__(
        self,
        num_features: int,
        *,
        eps: float = 1e-5,
        elementwise_affine: bool = False,
        bias: bool = True,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs | None = None,
    ):
        self.eps = eps
        affine = elementwise_affine
        self.scale = nnx.Param(jnp.ones((num_features,), param_dtype)) if affine else None
        use_bias = affine and bias
        self.bias = nnx.Param(jnp.zeros((num_features,), param_dtype)) if use_bias else None

    def __call__(self, x: Array) -> Array:
        return F.layer_norm(x, _value(self.scale), _value(self.bias), self.eps)


class RMSNorm(nnx.Module):
    """RMS normalisation over the last axis; learnable ``scale`` only with
    ``elementwise_affine=True`` (off by default, as in the library)."""

    def __init__(
        self,
        num_features: int,
        *,
        eps: float = 1e-5,
        elementwise_affine: bool = False,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs | None = None,
    ):
        self.eps = eps
        affine = elementwise_affine
        self.scale = nnx.Param(jnp.ones((num_features,), param_dtype)) if affine else None

    def __call__(self, x: Array) -> Array:
        return F.rms_norm(x, _value(self.scale), self.eps)


class Embedding(nnx.Module):
    """Unit-scaled lookup table ``embedding: (num_embeddings, features)`` ~ N(0, 1)."""

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        *,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.embedding = _normal(rngs, (num_embeddings, features), param_dtype)

    def __call__(self, ids: Array) -> Array:
        return F.embedding(ids, self.embedding[...])


class MLP(nnx.Module):
    """SwiGLU MLP: ``linear_2(silu_glu(linear_1(x), linear_gate(x)))``.

    The three linears are unconstrained (as in the library): the forward and backward
    scales of the up and down projections mirror each other.
    """

    def __init__(self, hidden_size: int, expansion_factor: int = 4, *, rngs: nnx.Rngs):
        inner = hidden_size * expansion_factor
        self.linear_1 = Linear(hidden_size, inner, constraint=None, rngs=rngs)
        self.linear_gate = Linear(hidden_size, inner, constraint=None, rngs=rngs)
        self.linear_2 = Linear(inner, hidden_size, constraint=None, rngs=rngs)

    def __call__(self, x: Array) -> Array:
        return self.linear_2(F.silu_glu(self.linear_1(x), self.linear_gate(x)))


class MHSA(nnx.Module):
    """Multi-head self-attention on ``[..., seq, hidden]`` with a fused QKV projection."""

    def __init__(
        self,
        hidden_size: int,
        heads: int,
        *,
        is_causal: bool = False,
        mult: float = 1.0,
        rngs: nnx.Rngs,
    ):
        if heads < 1 or hidden_size % heads:
            raise ValueError(
                f"MHSA: hidden_size ({hidden_size}) must be a multiple of heads ({heads})"
            )
        self.heads, self.is_causal, self.mult = heads, is_causal, mult
        self.linear_qkv = Linear(hidden_size, 3 * hidden_size, rngs=rngs)
        self.linear_o = Linear(hidden_size, hidden_size, rngs=rngs)

    def __call__(self, x: Array) -> Array:
        *lead, seq, hidden = x.shape
        d = hidden // self.heads
        qkv = self.linear_qkv(x).reshape(*lead, seq, 3, self.heads, d)
        q, k, v = (jnp.swapaxes(qkv[..., i, :, :], -2, -3) for i in range(3))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.is_causal, mult=self.mult)
        return self.linear_o(jnp.swapaxes(out, -2, -3).reshape(*lead, seq, hidden))


class TransformerLayer(nnx.Module):
    """Pre-norm transformer layer: attention then MLP, each a residual branch weighted by
    its ``tau`` (`residual_split` / `residual_add`)."""

    def __init__(
        self,
        hidden_size: int,
        heads: int,
        mhsa_tau: float,
        mlp_tau: float,
        *,
        is_causal: bool = True,
        rngs: nnx.Rngs,
    ):
        self.mhsa_tau, self.mlp_tau = float(mhsa_tau), float(mlp_tau)
        self.mhsa_norm = RMSNorm(hidden_size)
        self.mhsa = MHSA(hidden_size, heads, is_causal=is_causal, rngs=rngs)
        self.mlp_norm = RMSNorm(hidden_size)
        self.mlp = MLP(hidden_size, rngs=rngs)

    def __call__(self, x: Array) -> Array:
        x = F.residual_apply(lambda r: self.mhsa(self.mhsa_norm(r)), x, self.mhsa_tau)
        return F.residual_apply(lambda r: self.mlp(self.mlp_norm(r)), x, self.mlp_tau)


class TransformerDecoder(nnx.Module):
    """Causal decoder: embedding, ``layers`` transformer layers, RMS norm, readout.

    Layer ``i`` uses ``tau = residual_scaling(2 i, 2 layers)`` for attention and
    ``residual_scaling(2 i + 1, 2 layers)`` for the MLP (default: the library's
    `transformer_residual_scaling_rule()`). Like the library's, it has no positional
    embedding or padding mask: it demonstrates scaling.
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        layers: int,
        heads: int,
        *,
        residual_scaling: Callable[[int, int], float] | None = None,
        rngs: nnx.Rngs,
    ):
        rule = residual_scaling or F.transformer_residual_scaling_rule()
        self.vocab_size = vocab_size
        self.embedding = Embedding(vocab_size, hidden_size, rngs=rngs)
        self.layers = nnx.List(
            [
                TransformerLayer(
                    hidden_size,
                    heads,
                    mhsa_tau=rule(2 * i, 2 * layers),
                    mlp_tau=rule(2 * i + 1, 2 * layers),
                    rngs=rngs,
                )
                for i in range(layers)
            ]
        )
        self.final_norm = RMSNorm(hidden_size)
        self.projection = LinearReadout(hidden_size, vocab_size, rngs=rngs)

    def __call__(self, ids: Array) -> Array:
        """Logits ``[..., seq, vocab]`` for token ids ``[..., seq]``."""
        x = self.embedding(ids)
        for layer in self.layers:
            x = layer(x)
        return self.projection(self.final_norm(x))

    def loss(self, ids: Array) -> Array:
        """Mean next-token cross entropy: logits at ``ids[..., :-1]`` against
        ``ids[..., 1:]`` (one forward pass over the whole sequence)."""
        ids = jnp.asarray(ids)
        if ids.ndim < 1 or ids.shape[-1] < 2:
            raise ValueError(f"TransformerDecoder.loss: need ids [..., seq >= 2], got {ids.shape}")
        logits = self(ids)[..., :-1, :].astype(jnp.float32)
        return F.cross_entropy(logits.reshape(-1, self.vocab_size), ids[..., 1:].reshape(-1))


__all__ = [
    "MHSA",
    "MLP",
    "Embedding",
    "LayerNorm",
    "Linear",
    "LinearReadout",
    "RMSNorm",
    "TransformerDecoder",
    "TransformerLayer",
]
