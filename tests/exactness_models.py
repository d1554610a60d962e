"""Small functions a new user would scalify, for the scale-exactness tests.

A pre-LN transformer written the plain way (a ``-inf`` causal mask, einsum attention,
GELU, log-softmax cross-entropy), its gradient, an ``optax.adamw`` step, and three loops
(``fori_loop``, ``scan``, ``while_loop``). Every function takes a dict of float leaves
(plus integer-free inputs), so each leaf can be given its own scale.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

VOCAB, D, T, B = 12, 16, 8, 2


def transformer_params(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    return {
        "emb": normal((VOCAB, D), 1.0),
        "wq": normal((D, D), D**-0.5),
        "wk": normal((D, D), D**-0.5),
        "wv": normal((D, D), D**-0.5),
        "wo": normal((D, D), D**-0.5),
        "w1": normal((D, 4 * D), D**-0.5),
        "w2": normal((4 * D, D), 0.02),
        "g1": np.ones(D, np.float32),
        "g2": np.ones(D, np.float32),
        "gf": (1.0 + normal((D,), 0.1)).astype(np.float32),
    }


def transformer_batch(seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    eye = np.eye(VOCAB, dtype=np.float32)
    return {
        "x": eye[rng.integers(0, VOCAB, (B, T))],
        "y": eye[rng.integers(0, VOCAB, (B, T))],
    }


def _layer_norm(x, g):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * g


def transformer_loss(p, batch):
    h = batch["x"] @ p["emb"]
    a = _layer_norm(h, p["g1"])
    q, k, v = a @ p["wq"], a @ p["wk"], a @ p["wv"]
    s = jnp.einsum("btd,bsd->bts", q, k) / jnp.sqrt(q.shape[-1])
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -jnp.inf)
    h = h + jnp.einsum("bts,bsd->btd", jax.nn.softmax(s, -1), v) @ p["wo"]
    h = h + jax.nn.gelu(_layer_norm(h, p["g2"]) @ p["w1"]) @ p["w2"]
    logits = _layer_norm(h, p["gf"]) @ p["emb"].T
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * batch["y"], -1))


transformer_grad = jax.grad(transformer_loss)

OPT = optax.adamw(1e-3, weight_decay=0.1)


def adamw_inputs(seed: int = 0) -> dict:
    """Parameters, a batch and an AdamW state after one step (non-zero moments)."""
    params = transformer_params(seed)
    batch = transformer_batch(seed + 1)
    state = OPT.init(params)
    grads = transformer_grad(params, batch)
    _, state = OPT.update(grads, state, params)
    state = jax.tree.map(np.asarray, state)
    return {"params": params, "batch": batch, "state": state}


def adamw_step(inputs):
    params, batch, state = inputs["params"], inputs["batch"], inputs["state"]
    loss, grads = jax.value_and_grad(transformer_loss)(params, batch)
    updates, state = OPT.update(grads, state, params)
    return loss, optax.apply_updates(params, updates), state


def loop_inputs(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "c": (rng.standard_normal((4, 4)) * 0.3).astype(np.float32),
        "w": (rng.standard_normal((4, 4)) * 0.5).astype(np.float32),
        "xs": rng.standard_normal((5, 4)).astype(np.float32),
    }


def fori(inp):
    return jax.lax.fori_loop(0, 4, lambda i, c: c @ c.T / 3.0 + c, inp["c"])


def scan(inp):
    def body(h, x):
        h = jnp.tanh(h @ inp["w"] + x) + 0.5 * h
        return h, h * h

    return jax.lax.scan(body, inp["c"][0], inp["xs"])


def while_(inp):
    def body(state):
        i, c = state
        return i + 1, c * 1.5 + inp["w"] * 0.25

    return jax.lax.while_loop(
        lambda s: (jnp.sum(s[1] * s[1]) < 400.0) & (s[0] < 50), body, (0, inp["c"])
    )


MODELS = {
    "transformer_loss": (transformer_loss, lambda: (transformer_params(), transformer_batch())),
    "transformer_grad": (transformer_grad, lambda: (transformer_params(), transformer_batch())),
    "adamw_step": (adamw_step, lambda: (adamw_inputs(),)),
    "fori_loop": (fori, lambda: (loop_inputs(),)),
    "scan": (scan, lambda: (loop_inputs(),)),
    "while_loop": (while_, lambda: (loop_inputs(),)),
}
