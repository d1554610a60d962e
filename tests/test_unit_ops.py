"""scalescope.unit ops: values against NumPy references, unit scale of outputs and gradients,
the constraint rules (recomputed here from the formulas in docs/unit.md), exactness of
scale_fwd/scale_bwd, jit/vmap/scalify, and input validation."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scalescope as ss
import scalescope.unit as U

RNG = np.random.default_rng(0)


def normal(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def vjp(f, *args, seed: int = 1):
    """Output and input gradients of ``f`` for a unit-normal cotangent (1 for scalars)."""
    y, back = jax.vjp(f, *(jnp.asarray(a) for a in args))
    if y.ndim:
        ct = np.random.default_rng(seed).standard_normal(y.shape).astype(np.float32)
    else:
        ct = np.float32(1.0)
    return np.asarray(y), [np.asarray(g) for g in back(jnp.asarray(ct))], ct


def assert_unit(t, tol: float = 0.1):
    assert abs(float(np.std(t)) - 1.0) < tol, float(np.std(t))


# -- reference formulas (independent of the implementation) ---------------------------------


def interp(alpha, lower, upper):
    return lower ** (1 - alpha) * upper**alpha


def constrain(constraint, out, *grads):
    """The constraint table of docs/unit.md."""
    if constraint is None:
        return (out, *grads)
    value = {
        "to_output_scale": out,
        "to_grad_input_scale": float(np.prod(grads)) ** (1 / len(grads)),
        "gmean": float(np.prod((out, *grads))) ** (1 / (1 + len(grads))),
        "hmean": (1 + len(grads)) / sum(1 / s for s in (out, *grads)),
        "amean": sum((out, *grads)) / (1 + len(grads)),
        "to_left_grad_scale": grads[0],
        "to_right_grad_scale": grads[-1],
    }[constraint]
    return (value,) * (1 + len(grads))


CONSTRAINTS = [None, "to_output_scale", "to_grad_input_scale", "gmean", "hmean", "amean"]
_erf = np.vectorize(math.erf, otypes=[np.float64])


def np_gelu(x):
    return 0.5 * x * (1 + _erf(x / math.sqrt(2)))


def np_gelu_grad(x):
    return 0.5 * (1 + _erf(x / math.sqrt(2))) + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def np_sigmoid(x):
    return 1 / (1 + np.exp(-x))


def np_softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def np_log_softmax(x):
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


X = normal(64, 1024)  # 65k elements: std estimates to about 1%
G = normal(64, 1024)
T = 2.0 / (1.0 - 1.0 / math.pi)


# -- scale_fwd / scale_bwd ------------------------------------------------------------------


@pytest.mark.parametrize("s", [0.1, 3.0, 2.0**-7])
def test_scale_fwd_bwd_exact(s):
    x, ct = X[:8], G[:8]
    y, (gx,), _ = vjp(lambda x: U.scale_fwd(x, s), x)
    assert np.array_equal(y, x * np.float32(s))
    g = jax.vjp(lambda x: U.scale_fwd(x, s), jnp.asarray(x))[1](jnp.asarray(ct))[0]
    assert np.array_equal(np.asarray(g), ct)
    y, back = jax.vjp(lambda x: U.scale_bwd(x, s), jnp.asarray(x))
    assert np.array_equal(np.asarray(y), x)
    assert np.array_equal(np.asarray(back(jnp.asarray(ct))[0]), ct * np.float32(s))
    # bfloat16 keeps its dtype and rounds once, like NumPy's multiply in that dtype
    xb = jnp.asarray(x, jnp.bfloat16)
    yb = U.scale_fwd(xb, s)
    assert yb.dtype == jnp.bfloat16
    expect = np.asarray(xb) * np.asarray(jnp.asarray(s, jnp.bfloat16))
    assert np.array_equal(np.asarray(yb), expect)


def test_scale_ops_under_jit_vmap_and_traced_scale():
    x = jnp.asarray(X[:4, :16])
    f = jax.jit(jax.grad(lambda x, s: jnp.sum(U.scale_bwd(U.scale_fwd(x, s), s) ** 2)))
    got = f(x, 0.5)
    assert np.allclose(np.asarray(got), 2 * 0.5**2 * np.asarray(x), rtol=1e-6)
    vm = jax.vmap(lambda r: U.scale_fwd(r, 3.0))(x)
    assert np.array_equal(np.asarray(vm), np.asarray(x) * np.float32(3.0))
    gs = jax.grad(lambda s: jnp.sum(U.scale_fwd(x, s)))(2.0)
    assert float(gs) == 0.0  # the scale is a constant, not a parameter
    per_row = jax.vmap(jax.grad(lambda r, s: jnp.sum(U.scale_bwd(r, s))))(x, jnp.arange(4.0))
    assert np.array_equal(np.asarray(per_row), np.broadcast_to(np.arange(4.0)[:, None], x.shape))


def test_scale_ops_under_scalify():
    x = jnp.asarray(X[:8, :32])

    def f(x):
        return jnp.sum(U.scale_bwd(U.scale_fwd(x, 0.3), 0.7) ** 2)

    for k in (-6, 0, 5):
        sx = ss.as_scaled_array(x, scale=2.0**k)
        assert np.allclose(np.asarray(ss.asarray(ss.scalify(f)(sx))), f(x), rtol=1e-5)
        g = ss.asarray(ss.scalify(jax.grad(f))(sx))
        np.testing.assert_allclose(np.asarray(g), np.asarray(jax.grad(f)(x)), rtol=1e-5)


# -- element-wise ops -----------------------------------------------------------------------


def gelu_scales(mult):
    a = 1 / (1 + 0.25 / mult**2)
    return interp(a, 2.0, T**0.5), interp(a, 2.0, 2**0.5)


def silu_scales(mult):
    return interp(1 / (1 + 0.25 / mult**2), 2.0, T**0.5), interp(1 / (1 + 1 / mult**2), 2.0, 2**0.5)


def softmax_scales(n, mult):
    a = 1 / (1 + 4 / mult**2)
    return interp(a, n, n**0.5), interp(a, n / mult, (n / mult) ** 0.5)


@pytest.mark.parametrize("constraint", CONSTRAINTS)
@pytest.mark.parametrize("mult", [1.0, 2.5])
def test_gelu(constraint, mult):
    y, (g,), ct = vjp(lambda x: U.gelu(x, mult=mult, constraint=constraint), X)
    o, s = constrain(constraint, *gelu_scales(mult))
    x = X.astype(np.float64)
    np.testing.assert_allclose(y, o * np_gelu(mult * x) / mult, rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(g, s * ct * np_gelu_grad(mult * x), rtol=2e-4, atol=2e-5)
    if constraint is None and mult == 1.0:
        assert_unit(y)
        assert_unit(g)


def test_gelu_takes_pytorch_approximate_names():
    x = jnp.asarray(X)
    exact, tanh = U.gelu(x), U.gelu(x, approximate=True)
    assert float(jnp.max(jnp.abs(exact - tanh))) > 1e-4  # the two forms differ
    np.testing.assert_array_equal(U.gelu(x, approximate="none"), exact)
    np.testing.assert_array_equal(U.gelu(x, approximate="tanh"), tanh)
    with pytest.raises(ValueError, match="approximate"):
        U.gelu(x, approximate="erf")


@pytest.mark.parametrize("constraint", CONSTRAINTS)
def test_silu(constraint):
    mult = 1.0
    y, (g,), ct = vjp(lambda x: U.silu(x, constraint=constraint), X)
    o, s = constrain(constraint, *silu_scales(mult))
    x = X.astype(np.float64)
    sig = np_sigmoid(x)
    np.testing.assert_allclose(y, o * x * sig, rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(g, s * ct * sig * (1 + x * (1 - sig)), rtol=2e-4, atol=2e-5)
    if constraint is None:
        assert_unit(y)
        assert_unit(g)


def test_silu_mult():
    y = np.asarray(U.silu(jnp.asarray(X), mult=3.0, constraint=None))
    o, _ = silu_scales(3.0)
    np.testing.assert_allclose(y, o * X * np_sigmoid(3.0 * X.astype(np.float64)), rtol=2e-4)


def test_silu_glu():
    y, (gx, gg), ct = vjp(U.silu_glu, X, G)
    s = interp(0.5, 2.0, 2**0.5)
    x, g = X.astype(np.float64), G.astype(np.float64)
    sig = np_sigmoid(g)
    np.testing.assert_allclose(y, s * x * g * sig, rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(gx, s * ct * g * sig, rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(gg, s * ct * x * sig * (1 + g * (1 - sig)), rtol=2e-4, atol=2e-5)
    for t in (y, gx, gg):
        assert_unit(t)


@pytest.mark.parametrize("constraint", CONSTRAINTS)
@pytest.mark.parametrize("mult", [1.0, 4.0])
def test_softmax(constraint, mult):
    x = X[:, :256]
    y, (g,), ct = vjp(lambda x: U.softmax(x, axis=-1, mult=mult, constraint=constraint), x)
    o, s = constrain(constraint, *softmax_scales(256, mult))
    p = np_softmax(mult * x.astype(np.float64))
    np.testing.assert_allclose(y, o * p, rtol=1e-4, atol=1e-6)
    ref_g = s * mult * p * (ct - np.sum(ct * p, axis=-1, keepdims=True))
    np.testing.assert_allclose(g, ref_g, rtol=1e-3, atol=1e-5)
    # The u-μP model is empirical: at mult=1 the output is ~0.75 for n=256, not unit.
    assert abs(np.std(y) - o * np.std(p)) < 1e-3 * o * np.std(p)


def test_softmax_axis():
    x = X[:256, :32].T.copy()  # softmax over axis 0
    y = np.asarray(U.softmax(jnp.asarray(x), axis=0, constraint=None))
    o, _ = softmax_scales(32, 1.0)
    np.testing.assert_allclose(y, o * np_softmax(x.astype(np.float64), axis=0), rtol=1e-4)


def test_dropout():
    key = jax.random.PRNGKey(3)
    y, (g,), ct = vjp(lambda x: U.dropout(x, 0.3, key), X)
    kept = y != 0
    assert abs(kept.mean() - 0.7) < 0.01
    np.testing.assert_allclose(y[kept], X[kept] / math.sqrt(0.7), rtol=1e-6)
    np.testing.assert_allclose(g, np.where(kept, ct / math.sqrt(0.7), 0), rtol=1e-6)
    assert_unit(y)
    assert_unit(g)
    np.testing.assert_array_equal(np.asarray(U.dropout(jnp.asarray(X), 0.0)), X)
    np.testing.assert_array_equal(np.asarray(U.dropout(jnp.asarray(X), 0.5, deterministic=True)), X)


# -- matrix products ------------------------------------------------------------------------


XL = normal(512, 128)
WL = normal(128, 256)
BL = normal(256)


@pytest.mark.parametrize("constraint", CONSTRAINTS)
def test_linear(constraint):
    fan_in, fan_out, batch = 128, 256, 512
    y, (gx, gw, gb), ct = vjp(lambda x, w, b: U.linear(x, w, b, constraint=constraint), XL, WL, BL)
    o, s = constrain(constraint, fan_in**-0.5, fan_out**-0.5)
    x, w, c = XL.astype(np.float64), WL.astype(np.float64), ct.astype(np.float64)
    np.testing.assert_allclose(y, o * (x @ w + BL), rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(gx, s * c @ w.T, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(gw, batch**-0.5 * x.T @ c, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(gb, batch**-0.5 * c.sum(0), rtol=1e-3, atol=1e-4)
    assert_unit(gw)
    assert_unit(gb)
    if constraint is None:
        assert_unit(np.asarray(U.linear(XL, WL, constraint=None)))
        assert_unit(gx)
    if constraint == "to_output_scale":  # the backward keeps the forward's 1/sqrt(in)
        assert abs(np.std(gx) - math.sqrt(fan_out / fan_in)) < 0.1


def _conv1d_reference(x, w, stride, padding, dilation, groups):
    """NumPy's 1-D convolution, channels last: x [n, length, in], w [kernel, in/g, out]."""
    x = np.pad(x.astype(np.float64), ((0, 0), (padding, padding), (0, 0)))
    kernel, per_group, out = w.shape
    span = dilation * (kernel - 1) + 1
    length = (x.shape[1] - span) // stride + 1
    y = np.zeros((x.shape[0], length, out))
    step = out // groups
    for g in range(groups):
        xs = x[..., g * per_group : (g + 1) * per_group]
        ws = w[..., g * step : (g + 1) * step].astype(np.float64)
        for t in range(length):
            window = xs[:, t * stride : t * stride + span : dilation]  # [n, kernel, in/g]
            y[:, t, g * step : (g + 1) * step] = np.einsum("nki,kio->no", window, ws)
    return y


@pytest.mark.parametrize(("stride", "padding", "dilation", "groups"), [(1, 0, 1, 1), (3, 4, 2, 2)])
def test_conv1d(stride, padding, dilation, groups):
    """The unit-scaling library's conv1d rule (channels last): values are the NumPy
    convolution times ``(in / groups * kernel)^-1/2``; unconstrained, the output and the
    input, weight and bias gradients of unit-normal inputs have unit scale."""
    n, length, d_in, d_out, kernel = 16, 96, 48, 80, 5
    x, w = normal(n, length, d_in), normal(kernel, d_in // groups, d_out)
    b = np.zeros(d_out, np.float32)

    def f(x, w, b):
        return U.conv1d(x, w, b, stride, padding, dilation, groups, constraint=None)

    y, (gx, gw, gb), _ = vjp(f, x, w, b)
    ref = _conv1d_reference(x, w, stride, padding, dilation, groups)
    np.testing.assert_allclose(y, ref / math.sqrt(d_in // groups * kernel), rtol=1e-3, atol=1e-4)
    for t in (y, gx, gw, gb):
        assert_unit(t, tol=0.2)
    # channels-last leading dimensions fold into the batch; bad arguments are named
    y2 = U.conv1d(
        jnp.asarray(x).reshape(4, 4, length, d_in), w, None, stride, padding, dilation, groups
    )
    np.testing.assert_allclose(np.asarray(y2).reshape(y.shape), y, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="conv1d: expected x"):
        U.conv1d(x, normal(kernel, d_in + 1, d_out))
    with pytest.raises(ValueError, match="conv1d: stride must be a positive int"):
        U.conv1d(x, w, stride=0, groups=groups)


def test_linear_batched_input():
    x = XL.reshape(4, 128, 128)
    y = np.asarray(U.linear(jnp.asarray(x), jnp.asarray(WL)))
    np.testing.assert_allclose(y, (x @ WL) / math.sqrt(128), rtol=1e-4, atol=1e-4)
    _, (_, gw), _ = vjp(lambda x, w: U.linear(x, w, constraint=None), x, WL)
    assert_unit(gw)


def test_linear_readout():
    y, (gx, gw), ct = vjp(U.linear_readout, XL, WL)  # default: unconstrained
    np.testing.assert_allclose(y, XL.astype(np.float64) @ WL / 128, rtol=1e-3, atol=1e-5)
    assert abs(np.std(y) * math.sqrt(128) - 1) < 0.1  # u-μP readout: std 1/sqrt(in)
    np.testing.assert_allclose(gx, ct @ WL.T.astype(np.float64) / 16, rtol=1e-3, atol=1e-4)
    assert_unit(gx)
    assert_unit(gw)


A = normal(256, 128)
B = normal(128, 192)


@pytest.mark.parametrize("constraint", [*CONSTRAINTS, "to_left_grad_scale", "to_right_grad_scale"])
def test_matmul(constraint):
    m, k, n = 256, 128, 192
    y, (ga, gb), ct = vjp(lambda a, b: U.matmul(a, b, constraint=constraint), A, B)
    o, sa, sb = constrain(constraint, k**-0.5, n**-0.5, m**-0.5)
    a, b, c = A.astype(np.float64), B.astype(np.float64), ct.astype(np.float64)
    np.testing.assert_allclose(y, o * a @ b, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(ga, sa * c @ b.T, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(gb, sb * a.T @ c, rtol=1e-3, atol=1e-4)
    if constraint is None:
        for t in (y, ga, gb):
            assert_unit(t)


def test_matmul_broadcast_operand_gradient_is_unit():
    a = A.reshape(4, 64, 128)
    y, (ga, gb), _ = vjp(lambda a, b: U.matmul(a, b, constraint=None), a, B)
    for t in (y, ga, gb):
        assert_unit(t)


# -- additions and residuals ----------------------------------------------------------------


@pytest.mark.parametrize("constraint", CONSTRAINTS)
def test_add(constraint):
    y, (ga, gb), ct = vjp(lambda a, b: U.add(a, b, constraint=constraint), X, G)
    o, sa, sb = constrain(constraint, 2**-0.5, 1.0, 1.0)
    np.testing.assert_allclose(y, o * (X.astype(np.float64) + G), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ga, sa * ct, rtol=1e-6)
    np.testing.assert_allclose(gb, sb * ct, rtol=1e-6)
    if constraint is None:
        for t in (y, ga, gb):
            assert_unit(t)


def test_add_broadcast_and_constants():
    bias = G[0]
    y, (ga, gb), ct = vjp(lambda a, b: U.add(a, b, constraint=None), X, bias)
    np.testing.assert_allclose(gb, ct.sum(0) / 8, rtol=1e-4, atol=1e-5)  # 64 copies
    assert_unit(gb)
    np.testing.assert_allclose(np.asarray(U.add(jnp.asarray(X[:2]), 1.5)), X[:2] + 1.5)
    scalar = np.asarray(U.add(jnp.asarray(X[:2]), jnp.float32(2.0)))
    np.testing.assert_allclose(scalar, X[:2] + 2.0, rtol=1e-6)  # one-element operand: scale 1


@pytest.mark.parametrize("tau", [1.0, 0.3])
def test_residuals(tau):
    d = math.sqrt(1 + tau**2)
    (res, skip), back = jax.vjp(lambda x: U.residual_split(x, tau), jnp.asarray(X))
    np.testing.assert_array_equal(np.asarray(res), X)
    np.testing.assert_array_equal(np.asarray(skip), X)
    (gx,) = back((jnp.asarray(X), jnp.asarray(G)))  # independent unit cotangents
    np.testing.assert_allclose(np.asarray(gx), (tau * X + G) / d, rtol=1e-5, atol=1e-6)
    assert_unit(gx)
    y, (gr, gs), ct = vjp(lambda r, s: U.residual_add(r, s, tau), X, G)
    np.testing.assert_allclose(y, (tau * X + G) / d, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(gr, ct)
    np.testing.assert_array_equal(gs, ct)
    assert_unit(y)
    y2 = U.residual_apply(lambda v: jnp.asarray(G) + 0 * v, jnp.asarray(X), tau)
    np.testing.assert_allclose(np.asarray(y2), (tau * G + X) / d, rtol=1e-5, atol=1e-6)


def test_transformer_residual_scaling_rule():
    rule = U.transformer_residual_scaling_rule()
    taus = [rule(i, 4) for i in range(4)]
    np.testing.assert_allclose(taus, [1 / math.sqrt(n) for n in (2, 3, 4, 5)])
    # variance bookkeeping through the residual adds (unit branches): every branch ends
    # with the same share, and all attention branches together match the embedding
    var_embed, var_branch = 1.0, []
    for tau in taus:
        var_embed, var_branch = (
            var_embed / (1 + tau**2),
            [v / (1 + tau**2) for v in var_branch] + [tau**2 / (1 + tau**2)],
        )
    np.testing.assert_allclose(var_branch, [var_embed / 2] * 4)
    np.testing.assert_allclose(var_embed + sum(var_branch), 1.0)


# -- norms and lookup -----------------------------------------------------------------------


def np_layer_norm(x, axes, eps=1e-5):
    x = x.astype(np.float64)
    m = x.mean(axes, keepdims=True)
    return (x - m) / np.sqrt(x.var(axes, keepdims=True) + eps)


def test_layer_norm():
    x = X[:, :512] * 3 + 1
    w, b = np.ones(512, np.float32), np.zeros(512, np.float32)
    y, (gx, gw, gb), ct = vjp(U.layer_norm, x, w, b)
    xn = np_layer_norm(x, -1)
    np.testing.assert_allclose(y, xn, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gw, (ct * xn).sum(0) / 8, rtol=1e-3, atol=1e-4)  # batch 64
    np.testing.assert_allclose(gb, ct.sum(0) / 8, rtol=1e-3, atol=1e-4)
    for t in (y, gw, gb):
        assert_unit(t)
    assert abs(np.std(gx) * 3 - 1) < 0.1  # input std 3: gradient std 1/3
    y2 = U.layer_norm(jnp.asarray(x.reshape(8, 8, 512)), jnp.ones((8, 512)))  # two axes
    np.testing.assert_allclose(
        np.asarray(y2), np_layer_norm(x.reshape(8, 8, 512), (1, 2)), atol=1e-4
    )
    assert np.allclose(np.asarray(U.layer_norm(jnp.asarray(x))), xn, atol=1e-4)


def test_rms_norm():
    x = X[:, :512]
    w = np.ones(512, np.float32)
    y, (gx, gw), ct = vjp(U.rms_norm, x, w)
    xn = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(y, xn, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gw, (ct * xn).sum(0) / 8, rtol=1e-3, atol=1e-4)
    for t in (y, gx, gw):
        assert_unit(t)


def test_embedding():
    table = normal(64, 32)
    ids = RNG.integers(0, 64, size=(16, 256))
    y, (gt,), ct = vjp(lambda t: U.embedding(jnp.asarray(ids), t), table)
    np.testing.assert_array_equal(y, table[ids])
    ref = np.zeros((64, 32))
    np.add.at(ref, ids.reshape(-1), ct.reshape(-1, 32))
    np.testing.assert_allclose(gt, ref * math.sqrt(64 / ids.size), rtol=1e-4, atol=1e-5)
    assert_unit(y)
    assert_unit(gt)


# -- attention ------------------------------------------------------------------------------


def np_attention(q, k, v, scale, causal, mult=1.0):
    logits = np.einsum("...qd,...kd->...qk", q, k) * mult / q.shape[-1]
    if causal:
        logits = np.where(np.tril(np.ones(logits.shape[-2:], bool)), logits, -np.inf)
    return scale * np.einsum("...qk,...kd->...qd", np_softmax(logits), v)


QKV = [normal(2, 4, 128, 32) for _ in range(3)]


@pytest.mark.parametrize("causal", [False, True])
def test_attention(causal):
    y, (gq, gk, gv), ct = vjp(
        lambda q, k, v: U.scaled_dot_product_attention(q, k, v, is_causal=causal), *QKV
    )
    seq, d = 128, 32
    c = math.log(seq) if causal else 1.0
    scale = 1 / interp(1 / (1 + 4 * d), math.sqrt(c / seq), 1.0)
    ref = np_attention(*(t.astype(np.float64) for t in QKV), scale, causal)
    np.testing.assert_allclose(y, ref, rtol=1e-3, atol=1e-4)
    assert_unit(y)
    assert_unit(gv)
    # near-flat attention at init: q and k gradients are small (by design of the rule)
    assert np.std(gq) < 0.5 and np.std(gk) < 0.5


def test_attention_masks():
    q, k, v = (jnp.asarray(t) for t in QKV)
    causal = np.tril(np.ones((128, 128), bool))
    plain = U.scaled_dot_product_attention(q, k, v, mask=jnp.asarray(causal))
    additive = U.scaled_dot_product_attention(q, k, v, mask=jnp.where(causal, 0.0, -1e9))
    np.testing.assert_allclose(np.asarray(plain), np.asarray(additive), rtol=1e-5, atol=1e-6)
    scale = 1 / interp(1 / (1 + 4 * 32), math.sqrt(1 / 128), 1.0)
    ref = np_attention(*(t.astype(np.float64) for t in QKV), scale, True)
    np.testing.assert_allclose(np.asarray(plain), ref, rtol=1e-3, atol=1e-4)
    mult = U.scaled_dot_product_attention(q, k, v, mult=8.0)
    scale8 = 1 / interp(64 / (64 + 4 * 32), math.sqrt(1 / 128), 1.0)
    ref8 = np_attention(*(t.astype(np.float64) for t in QKV), scale8, False, mult=8.0)
    np.testing.assert_allclose(np.asarray(mult), ref8, rtol=1e-3, atol=1e-4)


# -- losses ---------------------------------------------------------------------------------


LOGITS = normal(128, 256)
LABELS = RNG.integers(0, 256, size=128)


@pytest.mark.parametrize("mult", [1.0, 0.5])
def test_cross_entropy(mult):
    loss, (g,), _ = vjp(lambda x: U.cross_entropy(x, jnp.asarray(LABELS), mult=mult), LOGITS)
    logp = np_log_softmax(mult * LOGITS.astype(np.float64))
    ref = -logp[np.arange(128), LABELS].mean()
    assert abs(float(loss) - ref) < 1e-5 * ref
    onehot = np.eye(256)[LABELS]
    v = 256
    np.testing.assert_allclose(
        g, (np.exp(logp) - onehot) * v / math.sqrt(v - 1), rtol=1e-4, atol=1e-6
    )
    if mult == 1.0:
        assert_unit(g)  # not divided by the batch size (128), unlike the mean's gradient


def test_cross_entropy_batched_labels():
    logits = LOGITS.reshape(4, 32, 256)
    labels = LABELS.reshape(4, 32)
    a = U.cross_entropy(jnp.asarray(logits), jnp.asarray(labels))
    b = U.cross_entropy(jnp.asarray(LOGITS), jnp.asarray(LABELS))
    assert abs(float(a) - float(b)) < 1e-6 * float(b)


def test_mse_loss():
    loss, (gi, gt), _ = vjp(U.mse_loss, X, G)
    d = X.astype(np.float64) - G
    assert abs(float(loss) - (d**2).mean()) < 1e-5 * (d**2).mean()
    np.testing.assert_allclose(gi, 2 * d / math.sqrt(8), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gt, -2 * d / math.sqrt(8), rtol=1e-5, atol=1e-6)
    assert_unit(gi)
    assert_unit(gt)


@pytest.mark.parametrize("name", ["cross_entropy", "mse_loss"])
def test_loss_sum_reduction_changes_the_value_not_the_gradient(name):
    if name == "cross_entropy":
        x, other, count = LOGITS, jnp.asarray(LABELS), LABELS.size
    else:
        x, other, count = X, jnp.asarray(G), X.size
    fn = getattr(U, name)
    mean_v, (mean_g,), _ = vjp(lambda v: fn(v, other), x)
    sum_v, (sum_g,), _ = vjp(lambda v: fn(v, other, reduction="sum"), x)
    np.testing.assert_allclose(float(sum_v), float(mean_v) * count, rtol=1e-5)
    np.testing.assert_array_equal(sum_g, mean_g)
    with pytest.raises(ValueError, match="reduction"):
        fn(jnp.asarray(x), other, reduction="none")


def test_scale_elementwise_builds_an_op():
    op = U.scale_elementwise(jnp.tanh, 3.0, 0.5, constraint=None)
    y, (g,), ct = vjp(op, X)
    x = X.astype(np.float64)
    np.testing.assert_allclose(y, 3.0 * np.tanh(x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g, 0.5 * ct * (1 - np.tanh(x) ** 2), rtol=1e-4, atol=1e-6)
    tied = U.scale_elementwise(jnp.tanh, 3.0, 0.5)  # to_output_scale: both scales 3
    _, (g3,), ct3 = vjp(tied, X)
    np.testing.assert_allclose(g3, 3.0 * ct3 * (1 - np.tanh(x) ** 2), rtol=1e-4, atol=1e-6)


# -- jit and scalify ------------------------------------------------------------------------


def _cases():
    x, w, b = XL[:64], WL[:, :96], BL[:96]
    lw, lb = np.ones(128, np.float32) * 1.5, np.full(128, 0.25, np.float32)
    return {
        "linear": (lambda x, w, b: U.linear(x, w, b, constraint=None), (x, w, b)),
        "softmax": (lambda x: U.softmax(x, mult=2.0), (x,)),
        "layer_norm": (lambda x, w, b: U.layer_norm(x, w, b), (x, lw, lb)),
        "cross_entropy": (lambda x: U.cross_entropy(x, jnp.asarray(LABELS[:64] % 128)), (x,)),
        "gelu": (lambda x: U.gelu(x, constraint="gmean"), (x,)),
        "matmul": (lambda a, b: U.matmul(a, b), (x, w)),
        "attention": (
            lambda q: U.scaled_dot_product_attention(q, q, q, is_causal=True),
            (x.reshape(2, 32, 128),),
        ),
    }


def _loss(f):
    """A scalar of ``f``'s output with a fixed, non-uniform weighting (for gradients)."""

    def loss(*args):
        y = f(*args)
        return jnp.sum(y * jnp.cos(jnp.arange(y.size, dtype=y.dtype).reshape(y.shape)))

    return loss


@pytest.mark.parametrize("name", ["linear", "softmax", "layer_norm", "cross_entropy"])
def test_jit_matches_eager(name):
    f, args = _cases()[name]
    args = [jnp.asarray(a) for a in args]
    eager, jitted = np.asarray(f(*args)), np.asarray(jax.jit(f)(*args))
    np.testing.assert_allclose(jitted, eager, rtol=1e-5, atol=1e-6)
    grad = jax.grad(_loss(f), argnums=tuple(range(len(args))))
    for a, b in zip(jax.jit(grad)(*args), grad(*args), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", list(_cases()))
def test_scalify_matches_plain(name):
    f, args = _cases()[name]
    args = [jnp.asarray(a) for a in args]
    grad = jax.grad(_loss(f), argnums=tuple(range(len(args))))
    ref_out, ref_grads = f(*args), grad(*args)
    for k in (-5, 3):
        sargs = [ss.as_scaled_array(a, scale=2.0**k) for a in args]
        out = ss.asarray(ss.scalify(f)(*sargs))
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-4, atol=1e-6)
        grads = ss.asarray(ss.scalify(grad)(*sargs))
        for a, b in zip(grads, ref_grads, strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_vmap_linear():
    x, w = jnp.asarray(XL[:8].reshape(2, 4, 128)), jnp.asarray(WL)
    got = jax.vmap(lambda r: U.linear(r, w))(x)
    # per-example batch size differs from the whole batch only in the weight gradient
    np.testing.assert_allclose(np.asarray(got), np.asarray(x @ w) / math.sqrt(128), rtol=1e-4)


# -- validation -----------------------------------------------------------------------------


def test_bad_constraint_names_the_allowed_ones():
    x = jnp.asarray(X[:2, :4])
    with pytest.raises(ValueError, match="to_output_scale.*gmean.*None"):
        U.gelu(x, constraint="geometric")
    with pytest.raises(ValueError, match="linear: constraint"):
        U.linear(x, jnp.ones((4, 3)), constraint="mean")
    with pytest.raises(ValueError, match="softmax"):
        U.softmax(x, constraint="to_left_grad_scale")  # only for two-input ops
    U.matmul(x, jnp.ones((4, 3)), constraint="to_left_grad_scale")


def test_shape_and_dtype_errors():
    x = jnp.asarray(X[:2, :4])
    with pytest.raises(ValueError, match=r"linear: .*x\.shape=\(2, 4\).*w\.shape=\(5, 3\)"):
        U.linear(x, jnp.ones((5, 3)))
    with pytest.raises(ValueError, match=r"linear: .*b\.shape=\(4,\)"):
        U.linear(x, jnp.ones((4, 3)), jnp.ones(4))
    with pytest.raises(ValueError, match=r"matmul: .*a\.shape=\(2, 4\)"):
        U.matmul(x, jnp.ones((3, 3)))
    with pytest.raises(ValueError, match="mse_loss"):
        U.mse_loss(x, x[:1])
    with pytest.raises(ValueError, match="cross_entropy"):
        U.cross_entropy(x, jnp.zeros(3, jnp.int32))
    with pytest.raises(TypeError, match="cross_entropy: labels must be integers"):
        U.cross_entropy(x, jnp.zeros(2))
    with pytest.raises(TypeError, match="gelu: x must be a floating-point"):
        U.gelu(jnp.arange(4))
    with pytest.raises(TypeError, match="embedding: ids must be integers"):
        U.embedding(jnp.zeros(3), jnp.ones((4, 2)))
    with pytest.raises(ValueError, match="layer_norm"):
        U.layer_norm(x, jnp.ones(3))
    with pytest.raises(ValueError, match="scaled_dot_product_attention"):
        U.scaled_dot_product_attention(x, x[:, :3], x)
    with pytest.raises(ValueError, match="dropout"):
        U.dropout(x, 0.5)  # no key
    with pytest.raises(ValueError, match="add: shapes"):
        U.add(x, jnp.ones(3))
    with pytest.raises(ValueError, match="scale_fwd"):
        U.scale_fwd(x, jnp.ones(2))


def test_the_probe_records_unit_scaled_ops_at_unit_scale():
    """`ss.instrument` sees through `scale_fwd`/`scale_bwd` (custom_vjp): the matmul inside
    `U.linear` is recorded at RMS ~sqrt(fan_in) and the scaled output right after it at ~1."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((64, 256)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((256, 128)), jnp.float32)

    def loss(x, w):
        return jnp.sum(U.linear(x, w) ** 2)

    fn = ss.instrument(jax.value_and_grad(loss, argnums=1), scalify=False)
    _, stats = fn(x, w)
    frame = ss.stats_frame(fn.op_table(x, w), stats)
    fwd = frame[frame["pass"] == "fwd"].reset_index(drop=True)
    dot = fwd.index[fwd["primitive"] == "dot_general"][0]
    assert fwd.loc[dot, "rms"] == pytest.approx(16.0, rel=0.1)  # sqrt(256)
    assert fwd.loc[dot + 1, "primitive"] == "mul"  # scale_fwd's product
    assert fwd.loc[dot + 1, "rms"] == pytest.approx(1.0, abs=0.1)
    assert (frame["pass"] == "bwd").any()
