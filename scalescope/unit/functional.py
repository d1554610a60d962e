"""Unit-scaled ops: the JAX counterparts of Graphcore's ``unit_scaling.functional``.

Each op computes the usual function and multiplies its output (forward) and its input
gradients (backward) by static constants chosen so that unit-variance inputs give
unit-variance outputs and gradients. The constants are those of the PyTorch library's
current (u-μP era) rules; docs/unit.md lists every formula and where we differ.

Conventions: weights are ``(in, out)``; attention takes ``[..., seq, head_dim]``;
`cross_entropy` takes integer labels. Scales are Python floats computed from static
shapes, so the ops trace once under `jax.jit` and run unchanged under `scalify`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .constraints import apply_constraint, validate_constraint
from .scale import check_float, logarithmic_interpolation, scale_bwd, scale_fwd

Array = jax.Array


# -- helpers -----------------------------------------------------------------------------


def _shape_error(op: str, what: str, **arrays: Any) -> ValueError:
    named = ", ".join(f"{k}.shape={tuple(jnp.shape(v))}" for k, v in arrays.items())
    return ValueError(f"{op}: {what}; got {named}")


def _check_mult(mult: float, op: str) -> float:
    if not (isinstance(mult, numbers.Real) and math.isfinite(mult) and mult > 0):
        raise ValueError(f"{op}: mult must be a positive finite number, got {mult!r}")
    return float(mult)


def _check_tau(tau: float, op: str) -> float:
    if not (isinstance(tau, numbers.Real) and math.isfinite(tau) and tau >= 0):
        raise ValueError(f"{op}: tau must be a non-negative finite number, got {tau!r}")
    return float(tau)


def _sigmoid_log(z: float) -> float:
    """``sigmoid(log(z)) = z / (1 + z)``: the interpolation weight of the u-μP rules."""
    return z / (1.0 + z)


def _compute_dtype(dtype: Any) -> Any:
    """At least float32 for reductions (norm statistics, losses)."""
    return jnp.promote_types(dtype, jnp.float32)


def _scale_elementwise(
    f: Callable[[Array], Array],
    x: Array,
    output_scale: float,
    grad_input_scale: float,
    constraint: str | None,
    op: str,
) -> Array:
    """``scale_fwd(f(scale_bwd(x, g)), o)`` with (o, g) tied by ``constraint``."""
    o, g = apply_constraint(constraint, output_scale, grad_input_scale, op=op)
    return scale_fwd(f(scale_bwd(x, g)), o)


def scale_elementwise(
    f: Callable[..., Array],
    output_scale: float,
    grad_input_scale: float,
    constraint: str | None = "to_output_scale",
) -> Callable[..., Array]:
    """``f`` (an elementwise function of its first argument) with its output scaled by
    ``output_scale`` and its input gradient by ``grad_input_scale``, tied by
    ``constraint``: the building block of the elementwise ops, for your own."""
    validate_constraint(constraint, "scale_elementwise")

    def scaled(x: Array, *args: Any, **kwargs: Any) -> Array:
        x = check_float(x, "scale_elementwise", "x")
        return _scale_elementwise(
            lambda v: f(v, *args, **kwargs),
            x,
            output_scale,
            grad_input_scale,
            constraint,
            "scale_elementwise",
        )

    return scaled


REDUCTIONS = ("mean", "sum")


def _reduce_loss(total: Array, count: int, reduction: str, op: str) -> Array:
    """The loss value: ``total`` or its mean; the gradient is the same either way (unit
    scaling scales it, it is never divided by ``count``)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return total if reduction == "sum" else scale_fwd(total, 1.0 / max(count, 1))


def _broadcast_shape(op: str, **shapes: tuple[int, ...]) -> tuple[int, ...]:
    try:
        return tuple(jnp.broadcast_shapes(*shapes.values()))
    except ValueError:
        named = ", ".join(f"{k}={tuple(v)}" for k, v in shapes.items())
        raise ValueError(f"{op}: shapes are not broadcast-compatible; got {named}") from None


# -- scale formulas (shared with `unit_scale`, which applies them to a jaxpr) -------------


def gelu_scales(mult: float = 1.0) -> tuple[float, float]:
    """``(output, input-gradient)`` scales of `gelu` before any constraint."""
    alpha = _sigmoid_log(4 * mult**2)
    output_scale = logarithmic_interpolation(alpha, 2.0, (2 / (1 - 1 / math.pi)) ** 0.5)
    return output_scale, logarithmic_interpolation(alpha, 2.0, 2.0**0.5)


def silu_scales(mult: float = 1.0) -> tuple[float, float]:
    """``(output, input-gradient)`` scales of `silu` before any constraint."""
    output_scale = logarithmic_interpolation(
        _sigmoid_log(4 * mult**2), 2.0, (2 / (1 - 1 / math.pi)) ** 0.5
    )
    return output_scale, logarithmic_interpolation(_sigmoid_log(mult**2), 2.0, 2.0**0.5)


def softmax_scales(n: int, mult: float = 1.0) -> tuple[float, float]:
    """``(output, input-gradient)`` scales of `softmax` over an axis of size ``n``."""
    alpha = _sigmoid_log(mult**2 / 4)
    output_scale = logarithmic_interpolation(alpha, n, n**0.5)
    return output_scale, logarithmic_interpolation(alpha, n / mult, (n / mult) ** 0.5)


def dot_scales(k: int, lhs_free: int, rhs_free: int) -> tuple[float, float, float]:
    """``(output, lhs-gradient, rhs-gradient)`` scales of a product contracting ``k``
    elements: ``k^-1/2`` forward; each operand's gradient sums over the other operand's
    free (non-contracted, non-batch) elements. `matmul` and `linear` are special cases."""
    return k**-0.5, max(rhs_free, 1) ** -0.5, max(lhs_free, 1) ** -0.5


def attention_scale(seq_k: int, d: int, mult: float = 1.0, is_causal: bool = False) -> float:
    """The one scale of `scaled_dot_product_attention` (output and q, k, v gradients) for
    ``seq_k`` keys, head size ``d`` and logits ``mult · q k^T / d``: ``1 / interp(...)``
    between the flat-attention limit ``sqrt(c / seq_k)`` (``c = ln(seq_k)`` when causal,
    else 1) and 1."""
    c = math.log(seq_k) if is_causal and seq_k > 1 else 1.0
    return 1.0 / logarithmic_interpolation(_sigmoid_log(mult**2 / (4 * d)), (c / seq_k) ** 0.5, 1.0)


def cross_entropy_grad_scale(vocab: int) -> float:
    """The logits-gradient scale of `cross_entropy`: unit gradients at a flat softmax."""
    return vocab / (vocab - 1) ** 0.5


def residual_scales(tau: float) -> tuple[float, float]:
    """``(residual, skip)`` weights of `residual_split`/`residual_add` for ``tau``."""
    denom = (1 + tau**2) ** 0.5
    return tau / denom, 1 / denom


# -- activations -------------------------------------------------------------------------


def gelu(
    x: Array,
    mult: float = 1.0,
    constraint: str | None = "to_output_scale",
    approximate: bool | str = False,
) -> Array:
    """Unit-scaled GELU, ``gelu(mult * x) / mult``.

    Exact (erf) GELU by default, as in PyTorch; ``approximate=True`` uses the tanh form.
    PyTorch's spellings ``"none"`` and ``"tanh"`` are accepted too.
    """
    approximate = _gelu_approximate(approximate)
    x = check_float(x, "gelu", "x")
    mult = _check_mult(mult, "gelu")
    validate_constraint(constraint, "gelu")
    output_scale, grad_scale = gelu_scales(mult)

    def f(v: Array) -> Array:
        if mult == 1:
            return jax.nn.gelu(v, approximate=approximate)
        return jax.nn.gelu(v * mult, approximate=approximate) / mult

    return _scale_elementwise(f, x, output_scale, grad_scale, constraint, "gelu")


_GELU_APPROXIMATE = {"none": False, "tanh": True}


def _gelu_approximate(approximate: bool | str) -> bool:
    """``approximate`` as a bool: a bool, or PyTorch's ``"none"``/``"tanh"`` (any other
    string would be truthy and silently select the tanh form)."""
    if isinstance(approximate, (bool, np.bool_)):
        return bool(approximate)
    if isinstance(approximate, str) and approximate in _GELU_APPROXIMATE:
        return _GELU_APPROXIMATE[approximate]
    raise ValueError(
        f"gelu: approximate must be True, False, 'none' or 'tanh', got {approximate!r}"
    )


def _silu(x: Array, mult: float) -> Array:
    return x * jax.nn.sigmoid(x * mult) if mult != 1 else jax.nn.silu(x)


def silu(x: Array, mult: float = 1.0, constraint: str | None = "to_output_scale") -> Array:
    """Unit-scaled SiLU (swish), ``x * sigmoid(mult * x)``."""
    x = check_float(x, "silu", "x")
    mult = _check_mult(mult, "silu")
    validate_constraint(constraint, "silu")
    output_scale, grad_scale = silu_scales(mult)
    return _scale_elementwise(
        lambda v: _silu(v, mult), x, output_scale, grad_scale, constraint, "silu"
    )


def silu_glu(x: Array, gate: Array, mult: float = 1.0) -> Array:
    """Unit-scaled gated linear unit ``x * silu(gate)`` (SwiGLU's non-linearity).

    One scale serves the output and both input gradients (as in the library), so there
    is no constraint to choose.
    """
    x = check_float(x, "silu_glu", "x")
    gate = check_float(gate, "silu_glu", "gate")
    if x.shape != gate.shape:
        raise _shape_error("silu_glu", "x and gate must have the same shape", x=x, gate=gate)
    mult = _check_mult(mult, "silu_glu")
    scale = logarithmic_interpolation(_sigmoid_log(mult**2), 2.0, 2.0**0.5)
    out = scale_bwd(x, scale) * _silu(scale_bwd(gate, scale), mult)
    return scale_fwd(out, scale)


def softmax(
    x: Array,
    axis: int = -1,
    mult: float = 1.0,
    constraint: str | None = "to_output_scale",
) -> Array:
    """Unit-scaled ``softmax(mult * x)`` along ``axis``.

    The scales blend the flat limit (``n``) and the one-hot limit (``sqrt(n)``) by
    ``mult``, where ``n`` is the size of ``axis``.
    """
    x = check_float(x, "softmax", "x")
    if x.ndim == 0:
        raise ValueError("softmax: x must have at least one axis, got a scalar")
    mult = _check_mult(mult, "softmax")
    validate_constraint(constraint, "softmax")
    output_scale, grad_scale = softmax_scales(x.shape[axis], mult)
    return _scale_elementwise(
        lambda v: jax.nn.softmax(v * mult, axis=axis),
        x,
        output_scale,
        grad_scale,
        constraint,
        "softmax",
    )


def dropout(
    x: Array, rate: float, key: Array | None = None, *, deterministic: bool = False
) -> Array:
    """Unit-scaled dropout: kept values are divided by ``sqrt(1 - rate)`` (not
    ``1 - rate``), which keeps the variance rather than the mean, forward and backward.

    ``rate == 0`` or ``deterministic=True`` is the identity (no key needed).
    """
    x = check_float(x, "dropout", "x")
    if not (isinstance(rate, numbers.Real) and 0 <= rate < 1):
        raise ValueError(f"dropout: rate must be in [0, 1), got {rate!r}")
    if deterministic or rate == 0:
        return x
    if key is None:
        raise ValueError("dropout: a PRNG key is required when rate > 0")
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x, jnp.zeros_like(x)) * jnp.asarray((1.0 - rate) ** -0.5, x.dtype)


# -- matrix products ---------------------------------------------------------------------


def matmul(a: Array, b: Array, constraint: str | None = "to_output_scale") -> Array:
    """Unit-scaled ``a @ b`` for ``a: [..., m, k]`` and ``b: [..., k, n]``.

    Output scale ``k^-1/2``; gradient scales ``(n * bcast_a)^-1/2`` for ``a`` and
    ``(m * bcast_b)^-1/2`` for ``b``, where ``bcast`` counts the batch copies an operand
    is broadcast to (1 without broadcasting, as the library assumes).
    """
    a = check_float(a, "matmul", "a")
    b = check_float(b, "matmul", "b")
    if a.ndim < 2 or b.ndim < 2 or a.shape[-1] != b.shape[-2]:
        raise _shape_error(
            "matmul", "expected a: [..., m, k] and b: [..., k, n] (at least 2-D)", a=a, b=b
        )
    validate_constraint(constraint, "matmul", 3)
    batch = _broadcast_shape("matmul", a_batch=a.shape[:-2], b_batch=b.shape[:-2])
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    bcast_a = math.prod(batch) // max(math.prod(a.shape[:-2]), 1)
    bcast_b = math.prod(batch) // max(math.prod(b.shape[:-2]), 1)
    out_s, a_s, b_s = apply_constraint(
        constraint, k**-0.5, (n * bcast_a) ** -0.5, (m * bcast_b) ** -0.5, op="matmul"
    )
    return scale_fwd(jnp.matmul(scale_bwd(a, a_s), scale_bwd(b, b_s)), out_s)


def _check_linear(op: str, x: Array, w: Array, b: Array | None) -> tuple[Array, Array, Any]:
    x = check_float(x, op, "x")
    w = check_float(w, op, "w")
    if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != w.shape[0]:
        raise _shape_error(op, "expected x: [..., in] and w: [in, out]", x=x, w=w)
    if b is not None:
        b = check_float(b, op, "b")
        if b.shape != (w.shape[1],):
            raise _shape_error(op, "expected b: [out]", w=w, b=b)
    return x, w, b


def _linear(
    op: str,
    x: Array,
    w: Array,
    b: Array | None,
    constraint: str | None,
    scale_power: tuple[float, float, float],
) -> Array:
    x, w, b = _check_linear(op, x, w, b)
    validate_constraint(constraint, op)
    fan_in, fan_out = w.shape
    batch = max(x.size // fan_in, 1)
    out_s, x_s = apply_constraint(
        constraint, fan_in ** -scale_power[0], fan_out ** -scale_power[1], op=op
    )
    param_s = batch ** -scale_power[2]
    y = scale_bwd(x, x_s) @ scale_bwd(w, param_s)
    if b is not None:
        y = y + scale_bwd(b, param_s)
    return scale_fwd(y, out_s)


def linear(
    x: Array,
    w: Array,
    b: Array | None = None,
    constraint: str | None = "to_output_scale",
    scale_power: tuple[float, float, float] = (0.5, 0.5, 0.5),
) -> Array:
    """Unit-scaled ``x @ w + b`` with ``w: (in, out)``.

    Output scale ``in^-1/2``, input-gradient scale ``out^-1/2``, weight and bias gradient
    scale ``batch^-1/2`` (``batch = x.size / in``). ``scale_power`` overrides the three
    exponents (the library's knob; `linear_readout` uses ``(1, 1/2, 1/2)``).
    """
    return _linear("linear", x, w, b, constraint, scale_power)


def conv1d(
    x: Array,
    w: Array,
    b: Array | None = None,
    stride: int = 1,
    padding: int | str = 0,
    dilation: int = 1,
    groups: int = 1,
    constraint: str | None = "to_output_scale",
    scale_power: tuple[float, float, float] = (0.5, 0.5, 0.5),
) -> Array:
    """Unit-scaled 1-D convolution, channels last as Flax's ``nn.Conv``: ``x: [...,
    length, in]``, ``w: [kernel, in / groups, out]``, ``b: [out]``. ``padding``: zeros
    on each side, or ``"SAME"`` / ``"VALID"``.

    The library's rule: output scale ``(in / groups * kernel)^-1/2``, input-gradient
    scale ``(stride * groups / (out * kernel))^1/2``, weight and bias gradient scale
    ``batch^-1/2`` with ``batch`` the output positions of all leading dimensions.
    """
    x = check_float(x, "conv1d", "x")
    w = check_float(w, "conv1d", "w")
    for name, v in (("stride", stride), ("dilation", dilation), ("groups", groups)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise ValueError(f"conv1d: {name} must be a positive int, got {v!r}")
    if x.ndim < 2 or w.ndim != 3 or w.shape[1] * groups != x.shape[-1] or w.shape[2] % groups:
        raise _shape_error(
            "conv1d",
            f"expected x: [..., length, in] and w: [kernel, in / groups, out] with "
            f"groups={groups} dividing out",
            x=x,
            w=w,
        )
    if b is not None:
        b = check_float(b, "conv1d", "b")
        if b.shape != (w.shape[2],):
            raise _shape_error("conv1d", "expected b: [out]", w=w, b=b)
    if isinstance(padding, str):
        if padding.upper() not in ("SAME", "VALID"):
            raise ValueError(f"conv1d: padding must be an int, 'SAME' or 'VALID', got {padding!r}")
        pads: Any = padding.upper()
    elif isinstance(padding, numbers.Integral) and not isinstance(padding, bool) and padding >= 0:
        pads = [(int(padding), int(padding))]
    else:
        raise ValueError(f"conv1d: padding must be a non-negative int, got {padding!r}")
    validate_constraint(constraint, "conv1d")
    kernel, fan_in, fan_out = w.shape
    lead = x.shape[:-2]
    flat = x.reshape((-1, *x.shape[-2:]))

    def conv(x: Array, w: Array) -> Array:
        return jax.lax.conv_general_dilated(
            x,
            w,
            (stride,),
            pads,
            rhs_dilation=(dilation,),
            dimension_numbers=("NWC", "WIO", "NWC"),
            feature_group_count=groups,
        )

    out_shape = jax.eval_shape(conv, flat, w).shape
    batch = max(out_shape[0] * out_shape[1], 1)  # every output position of every row
    out_s, x_s = apply_constraint(
        constraint,
        (fan_in * kernel) ** -scale_power[0],
        (stride * groups / (fan_out * kernel)) ** scale_power[1],
        op="conv1d",
    )
    param_s = batch ** -scale_power[2]
    y = conv(scale_bwd(flat, x_s), scale_bwd(w, param_s))
    if b is not None:
        y = y + scale_bwd(b, param_s)
    return scale_fwd(y.reshape((*lead, *y.shape[1:])), out_s)


def linear_readout(
    x: Array, w: Array, b: Array | None = None, constraint: str | None = None
) -> Array:
    """Unit-scaled linear for the final output (u-μP readout): output scale ``1/in``.

    Unconstrained by default: the input gradient is scaled by ``out^-1/2``.
    """
    return _linear("linear_readout", x, w, b, constraint, (1.0, 0.5, 0.5))


def scaled_dot_product_attention(
    q: Array,
    k: Array,
    v: Array,
    mask: Array | None = None,
    is_causal: bool = False,
    mult: float = 1.0,
) -> Array:
    """Unit-scaled attention ``softmax(mult * q k^T / d + mask) v`` on ``[..., seq, d]``.

    u-μP uses ``1/d`` (not ``1/sqrt(d)``) inside the softmax. One scale ``s`` multiplies
    the output and the gradients of ``q``, ``k`` and ``v``: ``1 / interp(...)`` between the
    flat-attention limit ``sqrt(c / seq)`` (``c = ln(seq)`` when causal, else 1) and 1.
    ``mask``: boolean (True attends) or additive float, broadcastable to
    ``[..., seq_q, seq_k]``; ``is_causal`` masks keys after the query position.
    """
    op = "scaled_dot_product_attention"
    q, k, v = (check_float(t, op, n) for t, n in ((q, "q"), (k, "k"), (v, "v")))
    if (
        q.ndim < 2
        or not (q.ndim == k.ndim == v.ndim)
        or q.shape[:-2] != k.shape[:-2]
        or k.shape[:-2] != v.shape[:-2]
        or q.shape[-1] != k.shape[-1]
        or k.shape[-2] != v.shape[-2]
    ):
        raise _shape_error(
            op,
            "expected q: [..., seq_q, d], k: [..., seq_k, d], v: [..., seq_k, d_v]",
            q=q,
            k=k,
            v=v,
        )
    mult = _check_mult(mult, op)
    seq_q, seq_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = attention_scale(seq_k, d, mult, is_causal)
    q, k, v = (scale_bwd(t, scale) for t in (q, k, v))
    logits = jnp.einsum("...qd,...kd->...qk", q, k) * jnp.asarray(mult / d, q.dtype)
    logits = logits.astype(_compute_dtype(logits.dtype))
    neg = jnp.finfo(logits.dtype).min
    if is_causal:
        logits = jnp.where(jnp.tril(jnp.ones((seq_q, seq_k), bool)), logits, neg)
    if mask is not None:
        mask = jnp.asarray(mask)
        try:
            jnp.broadcast_shapes(mask.shape, logits.shape)
        except ValueError:
            raise _shape_error(
                op, "mask must broadcast to [..., seq_q, seq_k]", mask=mask, q=q, k=k
            ) from None
        if mask.dtype == jnp.bool_:
            logits = jnp.where(mask, logits, neg)
        elif jnp.issubdtype(mask.dtype, jnp.floating):
            logits = logits + mask.astype(logits.dtype)
        else:
            raise TypeError(f"{op}: mask must be boolean or floating point, got {mask.dtype}")
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return scale_fwd(jnp.einsum("...qk,...kd->...qd", probs, v), scale)


# -- normalisation and lookup ------------------------------------------------------------


def _norm_axes(op: str, x: Array, params: Sequence[Array | None]) -> tuple[int, ...]:
    """The trailing axes a norm works over: ``weight.ndim`` (or ``bias.ndim``) of them,
    the last axis when there is no parameter; parameters must match those axes."""
    given = [p for p in params if p is not None]
    nd = given[0].ndim if given else 1
    if x.ndim < max(nd, 1):
        raise _shape_error(op, "x has fewer axes than the normalised shape", x=x)
    for p in given:
        if p.ndim == 0 or p.shape != x.shape[x.ndim - nd :]:
            raise _shape_error(op, "weight/bias must equal the trailing axes of x", x=x, param=p)
    return tuple(range(x.ndim - nd, x.ndim))


def _param_grad_scale(x: Array, axes: tuple[int, ...]) -> float:
    """``(normalised size / x.size)^1/2 = batch^-1/2``: parameter gradients sum over batch."""
    return (math.prod(x.shape[a] for a in axes) / x.size) ** 0.5


def layer_norm(
    x: Array, weight: Array | None = None, bias: Array | None = None, eps: float = 1e-5
) -> Array:
    """Layer normalisation over the last ``weight.ndim`` axes (the last without a weight).

    The output is unit by construction; only the weight and bias gradients are scaled,
    by ``batch^-1/2``. Statistics are computed in at least float32.
    """
    x = check_float(x, "layer_norm", "x")
    weight = None if weight is None else check_float(weight, "layer_norm", "weight")
    bias = None if bias is None else check_float(bias, "layer_norm", "bias")
    axes = _norm_axes("layer_norm", x, (weight, bias))
    xf = x.astype(_compute_dtype(x.dtype))
    mean = jnp.mean(xf, axis=axes, keepdims=True)
    centred = xf - mean
    var = jnp.mean(centred * centred, axis=axes, keepdims=True)
    y = (centred * jax.lax.rsqrt(var + eps)).astype(x.dtype)
    s = _param_grad_scale(x, axes)
    if weight is not None:
        y = y * scale_bwd(weight, s)
    if bias is not None:
        y = y + scale_bwd(bias, s)
    return y


def rms_norm(x: Array, weight: Array | None = None, eps: float = 1e-5) -> Array:
    """RMS normalisation ``x / sqrt(mean(x^2) + eps) * weight`` over the last
    ``weight.ndim`` axes (the last without a weight); weight gradient scaled by
    ``batch^-1/2``."""
    x = check_float(x, "rms_norm", "x")
    weight = None if weight is None else check_float(weight, "rms_norm", "weight")
    axes = _norm_axes("rms_norm", x, (weight,))
    xf = x.astype(_compute_dtype(x.dtype))
    ms = jnp.mean(xf * xf, axis=axes, keepdims=True)
    y = (xf * jax.lax.rsqrt(ms + eps)).astype(x.dtype)
    if weight is not None:
        y = y * scale_bwd(weight, _param_grad_scale(x, axes))
    return y


def embedding(ids: Array, table: Array) -> Array:
    """Look up rows of ``table: (vocab, dim)``; the table gradient is scaled by
    ``(vocab / ids.size)^1/2`` (each row receives about ``ids.size / vocab`` updates)."""
    ids = jnp.asarray(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"embedding: ids must be integers, got dtype {ids.dtype}")
    table = check_float(table, "embedding", "table")
    if table.ndim != 2:
        raise _shape_error("embedding", "expected table: (vocab, dim)", table=table)
    s = (table.shape[0] / max(ids.size, 1)) ** 0.5
    return jnp.take(scale_bwd(table, s), ids, axis=0)


# -- additions and residuals -------------------------------------------------------------


def add(a: Array | float, b: Array | float, constraint: str | None = "to_output_scale") -> Array:
    """Unit-scaled ``a + b``: output scale ``2^-1/2`` (1 when an operand has one element),
    gradient scales ``bcast^-1/2`` per operand (``bcast``: copies made by broadcasting).

    Adding a Python number is a plain add: a constant shift does not change the scale.
    """
    validate_constraint(constraint, "add", 3)
    if isinstance(a, int | float) or isinstance(b, int | float):
        return jnp.add(a, b)
    a = check_float(a, "add", "a")
    b = check_float(b, "add", "b")
    out_size = math.prod(_broadcast_shape("add", a=a.shape, b=b.shape))
    scalar = a.size == 1 or b.size == 1
    out_s, a_s, b_s = apply_constraint(
        constraint,
        1.0 if scalar else 2**-0.5,
        (out_size // max(a.size, 1)) ** -0.5,
        (out_size // max(b.size, 1)) ** -0.5,
        op="add",
    )
    return scale_fwd(scale_bwd(a, a_s) + scale_bwd(b, b_s), out_s)


def residual_split(x: Array, tau: float = 1.0) -> tuple[Array, Array]:
    """Split ``x`` into ``(residual, skip)`` for a residual branch weighted by ``tau``.

    Identity forward; backward the gradients are scaled by ``tau / sqrt(1 + tau^2)``
    (residual) and ``1 / sqrt(1 + tau^2)`` (skip), so their sum stays unit. Pair with
    `residual_add` using the same ``tau``.
    """
    x = check_float(x, "residual_split", "x")
    residual_s, skip_s = residual_scales(_check_tau(tau, "residual_split"))
    return scale_bwd(x, residual_s), scale_bwd(x, skip_s)


def residual_add(residual: Array, skip: Array, tau: float = 1.0) -> Array:
    """``tau / sqrt(1 + tau^2) * residual + 1 / sqrt(1 + tau^2) * skip`` (forward only:
    gradients pass unchanged to both; `residual_split` scales them)."""
    residual = check_float(residual, "residual_add", "residual")
    skip = check_float(skip, "residual_add", "skip")
    if residual.shape != skip.shape:
        raise _shape_error(
            "residual_add",
            "residual and skip must have the same shape",
            residual=residual,
            skip=skip,
        )
    residual_s, skip_s = residual_scales(_check_tau(tau, "residual_add"))
    return scale_fwd(residual, residual_s) + scale_fwd(skip, skip_s)


def residual_apply(fn: Callable[[Array], Array], x: Array, tau: float = 1.0) -> Array:
    """``residual_add(fn(residual), skip, tau)`` after ``residual_split(x, tau)``."""
    residual, skip = residual_split(x, tau)
    return residual_add(fn(residual), skip, tau)


def transformer_residual_scaling_rule(
    residual_mult: float = 1.0, residual_attn_ratio: float = 1.0
) -> Callable[[int, int], float]:
    """The library's depth rule: ``tau(index, layers)`` for a stack that alternates
    attention (even index) and MLP (odd index) branches after an embedding.

    Every attention branch contributes equally, every MLP branch equally, all of them
    together ``residual_mult`` times the embedding (in variance), attention relative to
    MLP ``residual_attn_ratio`` (u-μP, appendix G). ``layers`` counts branches (2 per
    transformer layer).
    """
    alpha_mlp = residual_mult * (2 / (1 + residual_attn_ratio**2)) ** 0.5
    alpha_attn = residual_attn_ratio * alpha_mlp

    def tau(index: int, layers: int) -> float:
        n_attn, n_mlp = (index + 1) // 2, index // 2
        alpha = alpha_attn if index % 2 == 0 else alpha_mlp
        return alpha / (layers / 2 + n_attn * alpha_attn**2 + n_mlp * alpha_mlp**2) ** 0.5

    return tau


# -- losses ------------------------------------------------------------------------------


def cross_entropy(
    logits: Array, labels: Array, mult: float = 1.0, reduction: str = "mean"
) -> Array:
    """Mean cross entropy of ``mult * logits: [..., vocab]`` against integer ``labels: [...]``.

    The value is the standard mean loss (the sum with ``reduction="sum"``). Its gradient
    is not divided by the batch size and the logits gradient is scaled by
    ``vocab / sqrt(vocab - 1)``, so it is unit at a flat softmax (the gradient of the
    mean loss times ``batch * vocab / sqrt(vocab - 1)``), whatever the reduction.
    """
    logits = check_float(logits, "cross_entropy", "logits")
    labels = jnp.asarray(labels)
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"cross_entropy: labels must be integers, got dtype {labels.dtype}")
    if logits.ndim < 1 or labels.shape != logits.shape[:-1]:
        raise _shape_error(
            "cross_entropy",
            "expected logits: [..., vocab] and labels: [...]",
            logits=logits,
            labels=labels,
        )
    vocab = logits.shape[-1]
    if vocab < 2:
        raise ValueError(f"cross_entropy: need at least 2 classes, got {vocab}")
    mult = _check_mult(mult, "cross_entropy")
    x = scale_fwd(scale_bwd(logits, cross_entropy_grad_scale(vocab)), mult)
    logp = jax.nn.log_softmax(x.astype(_compute_dtype(x.dtype)), axis=-1)
    picked = jnp.take_along_axis(logp, labels[..., None], axis=-1)
    return _reduce_loss(-jnp.sum(picked), labels.size, reduction, "cross_entropy")


def mse_loss(input: Array, target: Array, reduction: str = "mean") -> Array:
    """Mean squared error (standard value; the sum with ``reduction="sum"``); both
    gradients scaled by ``8^-1/2`` and not divided by the size, which makes them unit for
    unit, independent input and target."""
    input = check_float(input, "mse_loss", "input")
    target = check_float(target, "mse_loss", "target")
    if input.shape != target.shape:
        raise _shape_error(
            "mse_loss", "input and target must have the same shape", input=input, target=target
        )
    s = 8**-0.5
    diff = scale_bwd(input, s) - scale_bwd(target, s)
    diff = diff.astype(_compute_dtype(diff.dtype))
    return _reduce_loss(jnp.sum(diff * diff), input.size, reduction, "mse_loss")


__all__ = [
    "add",
    "cross_entropy",
    "cross_entropy_grad_scale",
    "dot_scales",
    "dropout",
    "embedding",
    "gelu",
    "gelu_scales",
    "layer_norm",
    "linear",
    "linear_readout",
    "matmul",
    "mse_loss",
    "residual_add",
    "residual_apply",
    "residual_scales",
    "residual_split",
    "rms_norm",
    "scale_elementwise",
    "scaled_dot_product_attention",
    "silu",
    "silu_glu",
    "silu_scales",
    "softmax",
    "softmax_scales",
    "transformer_residual_scaling_rule",
]
