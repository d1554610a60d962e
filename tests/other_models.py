"""Training steps of models written the way Flax's own examples write them (MNIST CNN,
ResNet block, SST-2 LSTM, VAE, a decoder LM, an NNX model, GroupNorm with depthwise and
transposed convolutions), at toy sizes, for `test_other_models.py`.

Each builder returns ``(step, args, loss_index)``: ``step(*args)`` is one training step
returning a tuple of the new parameters, the new optimizer state (and new batch statistics
where the model has them) and the loss, at position ``loss_index``. Everything random in
the step comes from a key passed as an argument.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx

Built = tuple[Callable[..., Any], tuple[Any, ...], int]
BATCH = 4


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _xent(logits, labels):
    return optax.softmax_cross_entropy(logits, jax.nn.one_hot(labels, logits.shape[-1])).mean()


# -- 1. MNIST-style CNN (flax/examples/mnist) ------------------------------------------


class CNN(nn.Module):
    pool: str = "avg"

    @nn.compact
    def __call__(self, x):
        pool = nn.avg_pool if self.pool == "avg" else nn.max_pool
        x = nn.Conv(features=8, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nn.Conv(features=16, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.Dense(features=32)(x)
        x = nn.relu(x)
        return nn.Dense(features=10)(x)


def mnist_cnn(pool: str = "avg") -> Built:
    model = CNN(pool=pool)
    rng = _rng(1)
    images = jnp.asarray(rng.uniform(size=(BATCH, 8, 8, 1)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 10, BATCH), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), images)["params"]
    tx = optax.sgd(0.1, momentum=0.9)

    def step(params, opt_state, images, labels):
        def loss_fn(params):
            logits = model.apply({"params": params}, images)
            return _xent(logits, labels), logits

        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, tx.init(params), images, labels), 2


# -- 2. ResNet-style block with BatchNorm (flax/examples/imagenet) ---------------------


class ResNetBlock(nn.Module):
    filters: int

    @nn.compact
    def __call__(self, x):
        norm = lambda: nn.BatchNorm(use_running_average=False, momentum=0.9, epsilon=1e-5)  # noqa: E731
        residual = x
        y = nn.Conv(self.filters, (3, 3), use_bias=False)(x)
        y = norm()(y)
        y = nn.relu(y)
        y = nn.Conv(self.filters, (3, 3), use_bias=False)(y)
        y = norm()(y)
        if residual.shape != y.shape:
            residual = nn.Conv(self.filters, (1, 1), use_bias=False, name="conv_proj")(residual)
            residual = norm()(residual)
        return nn.relu(residual + y)


class ResNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(8, (3, 3), use_bias=False, name="conv_init")(x)
        x = nn.BatchNorm(use_running_average=False, name="bn_init")(x)
        x = nn.relu(x)
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        x = ResNetBlock(16)(x)  # with the 1x1 projection shortcut
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(10)(x)


def resnet() -> Built:
    model = ResNet()
    rng = _rng(2)
    images = jnp.asarray(rng.normal(size=(BATCH, 8, 8, 3)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 10, BATCH), jnp.int32)
    variables = model.init(jax.random.PRNGKey(0), images)
    params, batch_stats = variables["params"], variables["batch_stats"]
    tx = optax.adamw(1e-3, weight_decay=1e-4)

    def step(params, batch_stats, opt_state, images, labels):
        def loss_fn(params):
            logits, new_state = model.apply(
                {"params": params, "batch_stats": batch_stats}, images, mutable=["batch_stats"]
            )
            return _xent(logits, labels), new_state["batch_stats"]

        (loss, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_stats, opt_state, loss

    return step, (params, batch_stats, tx.init(params), images, labels), 3


# -- 3. LSTM text classifier (flax/examples/sst2) --------------------------------------

VOCAB, SEQ = 20, 10


class TextClassifier(nn.Module):
    hidden: int = 16

    @nn.compact
    def __call__(self, tokens, lengths):
        x = nn.Embed(VOCAB, 8)(tokens)
        # the example's embedding dropout is left out: this model has no rng
        lstm = nn.Bidirectional(
            nn.RNN(nn.OptimizedLSTMCell(self.hidden), return_carry=True),
            nn.RNN(nn.OptimizedLSTMCell(self.hidden), return_carry=True),
            return_carry=True,
        )
        (fwd_carry, bwd_carry), outputs = lstm(x, seq_lengths=lengths)
        # the last hidden state of each direction (the carry at each sequence's length)
        final = jnp.concatenate([fwd_carry[1], bwd_carry[1]], axis=-1)
        # and a masked mean over the valid positions
        mask = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
        mean = jnp.sum(outputs * mask[..., None], axis=1) / lengths[:, None]
        h = nn.tanh(nn.Dense(16)(jnp.concatenate([final, mean], axis=-1)))
        return nn.Dense(2)(h)


def lstm() -> Built:
    model = TextClassifier()
    rng = _rng(3)
    lengths = jnp.asarray([SEQ, 3, 7, 1], jnp.int32)
    tokens = jnp.asarray(rng.integers(1, VOCAB, (BATCH, SEQ)), jnp.int32)
    tokens = jnp.where(jnp.arange(SEQ)[None] < lengths[:, None], tokens, 0)
    labels = jnp.asarray(rng.integers(0, 2, BATCH), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), tokens, lengths)["params"]
    tx = optax.adam(1e-3)

    def step(params, opt_state, tokens, lengths, labels):
        def loss_fn(params):
            logits = model.apply({"params": params}, tokens, lengths)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, tx.init(params), tokens, lengths, labels), 2


# -- 4. VAE (flax/examples/vae) --------------------------------------------------------

LATENTS, PIXELS = 4, 36


class Encoder(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(24, name="fc1")(x))
        return nn.Dense(LATENTS, name="fc2_mean")(x), nn.Dense(LATENTS, name="fc2_logvar")(x)


class Decoder(nn.Module):
    @nn.compact
    def __call__(self, z):
        z = nn.relu(nn.Dense(24, name="fc1")(z))
        return nn.Dense(PIXELS, name="fc2")(z)


def reparameterize(rng, mean, logvar):
    std = jnp.exp(0.5 * logvar)
    eps = jax.random.normal(rng, logvar.shape)
    return mean + eps * std


class VAE(nn.Module):
    def setup(self):
        self.encoder = Encoder()
        self.decoder = Decoder()

    def __call__(self, x, z_rng):
        mean, logvar = self.encoder(x)
        z = reparameterize(z_rng, mean, logvar)
        return self.decoder(z), mean, logvar


def _bce_with_logits(logits, labels):
    logits = nn.log_sigmoid(logits)
    return -jnp.sum(labels * logits + (1.0 - labels) * jnp.log(-jnp.expm1(logits)))


def _kl_divergence(mean, logvar):
    return -0.5 * jnp.sum(1 + logvar - jnp.square(mean) - jnp.exp(logvar))


def vae() -> Built:
    model = VAE()
    rng = _rng(4)
    images = jnp.asarray(rng.uniform(size=(BATCH, PIXELS)) > 0.5, jnp.float32) * 0.9 + 0.05
    key = jax.random.PRNGKey(7)
    params = model.init(jax.random.PRNGKey(0), images, key)["params"]
    tx = optax.adam(1e-3)

    def step(params, opt_state, images, z_rng):
        def loss_fn(params):
            recon, mean, logvar = model.apply({"params": params}, images, z_rng)
            bce = jax.vmap(_bce_with_logits)(recon, images).mean()
            kld = jax.vmap(_kl_divergence)(mean, logvar).mean()
            return bce + kld, nn.sigmoid(recon)

        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, tx.init(params), images, key), 2


# -- 5. small decoder LM (flax/examples/lm1b, wmt) -------------------------------------

LM_VOCAB, LM_SEQ, LM_D, LM_HEADS = 24, 8, 16, 2


class DecoderBlock(nn.Module):
    @nn.compact
    def __call__(self, x, mask, deterministic):
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(
            num_heads=LM_HEADS,
            dropout_rate=0.1,
            deterministic=deterministic,
            use_bias=False,  # as lm1b's; a key bias has gradient 0 (softmax shift)
        )(h, h, mask=mask)
        x = x + nn.Dropout(0.1)(h, deterministic=deterministic)
        h = nn.LayerNorm()(x)
        h = nn.Dense(4 * LM_D)(h)
        h = nn.gelu(h)
        h = nn.Dense(LM_D)(h)
        return x + nn.Dropout(0.1)(h, deterministic=deterministic)


class DecoderLM(nn.Module):
    @nn.compact
    def __call__(self, tokens, deterministic=False):
        embed = nn.Embed(LM_VOCAB, LM_D)
        pos = self.param("pos_embedding", nn.initializers.normal(0.02), (1, LM_SEQ, LM_D))
        x = embed(tokens) + pos
        x = nn.Dropout(0.1)(x, deterministic=deterministic)
        mask = nn.make_causal_mask(tokens)
        x = DecoderBlock()(x, mask, deterministic)
        x = nn.LayerNorm()(x)
        return embed.attend(x)  # tied output embedding


def decoder_lm() -> Built:
    model = DecoderLM()
    rng = _rng(5)
    tokens = jnp.asarray(rng.integers(0, LM_VOCAB, (BATCH, LM_SEQ + 1)), jnp.int32)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    params = model.init(jax.random.PRNGKey(0), inputs, deterministic=True)["params"]
    schedule = optax.warmup_cosine_decay_schedule(1e-4, 1e-3, 10, 100, 1e-5)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    dropout_key = jax.random.PRNGKey(11)

    def step(params, opt_state, inputs, targets, dropout_rng):
        def loss_fn(params):
            logits = model.apply(
                {"params": params}, inputs, deterministic=False, rngs={"dropout": dropout_rng}
            )
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, tx.init(params), inputs, targets, dropout_key), 2


# -- 6. Flax NNX, functional split/merge -----------------------------------------------


class NNXModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.lin1 = nnx.Linear(
            12, 24, use_bias=False, rngs=rngs
        )  # a bias before BatchNorm has gradient 0
        self.bn = nnx.BatchNorm(24, momentum=0.9, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.lin2 = nnx.Linear(24, 24, rngs=rngs)
        self.ln = nnx.LayerNorm(24, rngs=rngs)
        self.out = nnx.Linear(24, 5, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn(self.lin1(x)))
        x = self.drop(x)
        x = nnx.gelu(self.ln(self.lin2(x)))
        return self.out(x)


def nnx_model() -> Built:
    model = NNXModel(nnx.Rngs(params=0, dropout=1))
    model.train()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    rng = _rng(6)
    x = jnp.asarray(rng.normal(size=(BATCH * 2, 12)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 5, BATCH * 2), jnp.int32)
    tx = optax.adamw(1e-3)

    def step(params, rest, opt_state, x, y):
        model = nnx.merge(graphdef, params, rest)

        def loss_fn(model):
            return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)  # wrt nnx.Param
        updates, opt_state = tx.update(grads, opt_state, params)
        _, _, new_rest = nnx.split(model, nnx.Param, ...)  # batch statistics, rng counts
        return optax.apply_updates(params, updates), new_rest, opt_state, loss

    return step, (params, rest, tx.init(params), x, y), 3


# -- 7. GroupNorm, depthwise conv, transposed conv -------------------------------------


class ConvNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(16, (3, 3), strides=(2, 2))(x)
        x = nn.GroupNorm(num_groups=4)(x)
        x = nn.swish(x)
        x = nn.Conv(16, (3, 3), feature_group_count=16)(x)  # depthwise
        x = nn.GroupNorm(num_groups=4)(x)
        x = nn.relu(x)
        x = nn.ConvTranspose(8, (2, 2), strides=(2, 2))(x)
        return nn.Conv(3, (1, 1))(x)


def groupnorm_convs() -> Built:
    model = ConvNet()
    rng = _rng(7)
    images = jnp.asarray(rng.normal(size=(BATCH, 12, 12, 3)), jnp.float32)
    targets = jnp.asarray(rng.normal(size=(BATCH, 12, 12, 3)), jnp.float32)
    params = model.init(jax.random.PRNGKey(0), images)["params"]
    tx = optax.adam(1e-3)

    def step(params, opt_state, images, targets):
        def loss_fn(params):
            return jnp.mean((model.apply({"params": params}, images) - targets) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, tx.init(params), images, targets), 2


MODELS: dict[str, Callable[[], Built]] = {
    "mnist_cnn_avg_pool": lambda: mnist_cnn("avg"),
    "mnist_cnn_max_pool": lambda: mnist_cnn("max"),
    "resnet_batchnorm": resnet,
    "lstm_sst2": lstm,
    "vae": vae,
    "decoder_lm": decoder_lm,
    "nnx_functional": nnx_model,
    "groupnorm_depthwise_transpose": groupnorm_convs,
}
