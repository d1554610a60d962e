"""Precision recipes for the sample models: which dtypes the dense layers use.

Every dense layer of the sample models calls `Precision.matmul`, so one object decides
the whole model's recipe: the dtype its parameters live in, and optional quantise-dequantise
casts of the matmul inputs (forward) and of the output gradient (backward). Attention score
and value products stay in the compute dtype, uncast, as in common FP8 recipes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes

from scalescope.ops.cast import cast_on_backward, cast_on_forward
from scalescope.ops.scaling import dynamic_rescale_l2, dynamic_rescale_l2_grad

DType = Any


@dataclass(frozen=True)
class Precision:
    """A named precision recipe.

    fwd_dtype: if set, both matmul operands are rounded to it in the forward pass.
    bwd_dtype: if set, the gradient flowing into each matmul output is rounded to it.
    param_dtype: the dtype the parameters are initialised and stored in.
    rescale: under scalify, re-centre each value to unit RMS right before its FP8 cast
        (`dynamic_rescale_l2` forward, `dynamic_rescale_l2_grad` backward), as per-tensor
        FP8 scaling recipes do. Identities outside scalify.
    unit: static unit scaling instead of scalify: the loss is transformed by
        `scalescope.unit_scale` and the weights start at unit standard deviation
        (`unit_init`), so the casts see unit-scale values with no runtime scales at all.
    """

    name: str
    fwd_dtype: DType | None = None
    bwd_dtype: DType | None = None
    param_dtype: DType = jnp.float32
    rescale: bool = False
    unit: bool = False
    learning_rate: float = 2e-3  # the peak AdamW rate `scalescope train` uses by default

    def matmul(self, x: jax.Array, w: jax.Array) -> jax.Array:
        """Dense-layer product ``x @ w`` (``x``: [..., d_in], ``w``: [d_in, d_out]).

        Operands are cast on the forward pass and the output gradient on the backward pass
        when the recipe says so; the product accumulates and returns in ``x``'s dtype.
        """
        w = w.astype(x.dtype)
        if self.fwd_dtype is not None:
            if self.rescale:
                x, w = dynamic_rescale_l2(x), dynamic_rescale_l2(w)
            x = cast_on_forward(x, self.fwd_dtype)
            w = cast_on_forward(w, self.fwd_dtype)
        out = jnp.matmul(x, w, preferred_element_type=x.dtype)
        if self.bwd_dtype is not None:
            out = cast_on_backward(out, self.bwd_dtype)
            if self.rescale:  # runs first in the backward pass: rescale, then cast
                out = dynamic_rescale_l2_grad(out)
        return out


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32"),
    "fp16": Precision("fp16", param_dtype=jnp.float16),
    "fp8": Precision(
        "fp8",
        fwd_dtype=ml_dtypes.float8_e4m3fn,
        bwd_dtype=ml_dtypes.float8_e5m2,
        param_dtype=jnp.float16,
        rescale=True,
    ),
    # The same casts with static scale propagation only: backward values drift to 2^-14
    # and underflow E5M2 (what the advisor flags, and `rescale` fixes).
    "fp8-static": Precision(
        "fp8-static",
        fwd_dtype=ml_dtypes.float8_e4m3fn,
        bwd_dtype=ml_dtypes.float8_e5m2,
        param_dtype=jnp.float16,
    ),
    # The same FP8 casts with no scale propagation: values beyond E4M3's 448 become NaN
    # and small ones flush to zero. FP32 weights and optimizer, so only the casts differ.
    "fp8-naive": Precision(
        "fp8-naive",
        fwd_dtype=ml_dtypes.float8_e4m3fn,
        bwd_dtype=ml_dtypes.float8_e5m2,
    ),
    # Two more failures without scale propagation, for the verdict's labelled corpus
    # (benchmarks/bench_verdicts.py). FP16 casts with no loss scaling: the backward
    # values of a mean loss sit near FP16's subnormal range, so small gradients lose
    # their precision or flush to zero.
    "fp16-naive": Precision("fp16-naive", fwd_dtype=jnp.float16, bwd_dtype=jnp.float16),
    # E5M2 (two mantissa bits) for the forward matmul inputs, the format meant for
    # gradients: activations and weights keep a quarter of E4M3's precision.
    "e5m2-fwd-naive": Precision("e5m2-fwd-naive", fwd_dtype=ml_dtypes.float8_e5m2),
    # The unit-scaled model with no cast: unit-fp8's baseline (the same weights, the same
    # learning rate; only the FP8 casts differ).
    "unit-fp32": Precision("unit-fp32", unit=True, learning_rate=0.1),
    # Static unit scaling (Graphcore's method): the plain model transformed by
    # `ss.unit_scale`, unit-std weights, the same FP8 casts, FP32 weights and optimizer.
    "unit-fp8": Precision(
        "unit-fp8",
        fwd_dtype=ml_dtypes.float8_e4m3fn,
        bwd_dtype=ml_dtypes.float8_e5m2,
        unit=True,
        # unit-std weights move 50x less per AdamW step than N(0, 0.02) ones at the same
        # rate: re-tuned on the char GPT (2x64, 400 steps; 2e-3 .. 1.0, best at 0.1)
        learning_rate=0.1,
    ),
}

#: Recipes run under `scalescope.scalify` by `scalescope train`; the others run as written.
SCALIFIED = frozenset({"fp16", "fp8", "fp8-static"})


def get_precision(name: str) -> Precision:
    """Look up a preset recipe by name (`PRECISIONS`: "fp32", "fp16", "fp8", "fp8-static",
    "fp8-naive", "fp16-naive", "e5m2-fwd-naive", "unit-fp32", "unit-fp8")."""
    try:
        return PRECISIONS[name]
    except KeyError:
        known = ", ".join(sorted(PRECISIONS))
        raise ValueError(f"unknown precision {name!r}; expected one of: {known}") from None


#: Parameter names (dict keys) of the sample models' weight matrices and tables.
WEIGHT_KEYS = frozenset({"w", "wte", "wpe"})


def unit_init(params: Any, key: jax.Array) -> Any:
    """``params`` with every weight matrix and table (keys in `WEIGHT_KEYS`) redrawn from
    N(0, 1): unit scaling assumes unit-std weights and puts the 1/sqrt(fan-in) into the
    ops. Biases and LayerNorm gains are kept (zeros and ones)."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    keys = iter(jax.random.split(key, max(len(leaves), 1)))

    def redraw(path, leaf):
        k = next(keys)
        name = getattr(path[-1], "key", None) if path else None
        if name in WEIGHT_KEYS:
            return jax.random.normal(k, leaf.shape, jnp.float32).astype(leaf.dtype)
        return leaf

    return jax.tree_util.tree_map_with_path(redraw, params)
