"""Training steps of models written the way Flax's own examples write them (MNIST CNN,
ResNet block, SST-2 LSTM, VAE, a decoder LM, an NNX model, GroupNorm with depthwise and
transposed convolutions, the seq2seq LSTM encoder-decoder, an ogbg_molpcba-style graph
network, the WMT encoder-decoder transformer, the PPO loss, lm1b's sampling loop with a
KV cache), a Gemma-style NNX decoder (RoPE, grouped-query attention, soft-capping) and a
zoo of optax optimizers on one MLP, at toy sizes, for
`test_other_models.py`.

Each builder returns ``(step, args, loss_index)``: ``step(*args)`` is one training step
returning a tuple of the new parameters, the new optimizer state (and new batch statistics
where the model has them) and the loss, at position ``loss_index``; the sampling loop is
forward only and returns the sampled tokens, every step's logits and their negative
log-likelihood. Everything random in the step comes from a key passed as an argument.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
from flax import linen as nn
from flax import nnx
from flax.training import common_utils
from jax import lax

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


# -- 8. LSTM encoder-decoder with nn.scan over time (flax/examples/seq2seq) ------------

S2S_VOCAB, S2S_IN, S2S_OUT, S2S_HIDDEN, EOS = 8, 7, 5, 16, 1


class EncoderLSTM(nn.Module):
    """The encoder's recurrence: an LSTM cell scanned over time, carrying its state past
    each sequence's EOS unchanged."""

    @partial(
        nn.scan, variable_broadcast="params", in_axes=1, out_axes=1, split_rngs={"params": False}
    )
    @nn.compact
    def __call__(self, carry, x):
        lstm_state, is_eos = carry
        new_lstm_state, y = nn.LSTMCell(S2S_HIDDEN)(lstm_state, x)

        # pass the previous state forward once EOS has been reached
        def select_carried_state(new_state, old_state):
            return jnp.where(is_eos[:, np.newaxis], old_state, new_state)

        carried = tuple(select_carried_state(*s) for s in zip(new_lstm_state, lstm_state))
        is_eos = jnp.logical_or(is_eos, x[:, EOS])
        return (carried, is_eos), y


class DecoderLSTM(nn.Module):
    teacher_force: bool

    @partial(
        nn.scan,
        variable_broadcast="params",
        in_axes=1,
        out_axes=1,
        split_rngs={"params": False, "lstm": True},
    )
    @nn.compact
    def __call__(self, carry, x):
        lstm_state, last_prediction = carry
        if not self.teacher_force:
            x = last_prediction
        lstm_state, y = nn.LSTMCell(S2S_HIDDEN)(lstm_state, x)
        logits = nn.Dense(features=S2S_VOCAB)(y)
        # sample the predicted token from the logits
        predicted_token = jax.random.categorical(self.make_rng("lstm"), logits)
        prediction = jax.nn.one_hot(predicted_token, S2S_VOCAB, dtype=jnp.float32)
        return (lstm_state, prediction), (logits, prediction)


class Seq2seq(nn.Module):
    teacher_force: bool = True

    @nn.compact
    def __call__(self, encoder_inputs, decoder_inputs):
        batch_size = encoder_inputs.shape[0]
        zeros = jnp.zeros((batch_size, S2S_HIDDEN), encoder_inputs.dtype)
        init_carry = ((zeros, zeros), jnp.zeros(batch_size, dtype=bool))
        (encoder_state, _), _ = EncoderLSTM(name="encoder")(init_carry, encoder_inputs)
        decoder = DecoderLSTM(teacher_force=self.teacher_force, name="decoder")
        inputs = decoder_inputs[:, :-1]
        _, (logits, predictions) = decoder((encoder_state, inputs[:, 0]), inputs)
        return logits, predictions


def _sequence_lengths(sequence_batch):
    """Lengths up to and including the first EOS (the whole length where none)."""
    eos_row = sequence_batch[:, :, EOS]
    eos_idx = jnp.argmax(eos_row, axis=-1)
    has_eos = eos_row[jnp.arange(eos_row.shape[0]), eos_idx]
    return jnp.where(has_eos, eos_idx + 1, sequence_batch.shape[1])


def _mask_sequences(sequence_batch, lengths):
    return sequence_batch * (lengths[:, np.newaxis] > np.arange(sequence_batch.shape[1]))


def seq2seq() -> Built:
    model = Seq2seq(teacher_force=True)
    rng = _rng(8)
    query = rng.integers(2, S2S_VOCAB, (BATCH, S2S_IN))
    query[np.arange(BATCH), [6, 3, 4, 2]] = EOS  # one EOS per query, padding after it
    answer = rng.integers(2, S2S_VOCAB, (BATCH, S2S_OUT))
    answer[:, 0] = 0  # the decoder's start token
    answer[np.arange(BATCH), [4, 2, 3, 4]] = EOS
    query = jnp.asarray(np.eye(S2S_VOCAB)[query], jnp.float32)
    answer = jnp.asarray(np.eye(S2S_VOCAB)[answer], jnp.float32)
    init_rngs = {"params": jax.random.PRNGKey(0), "lstm": jax.random.PRNGKey(1)}
    params = jax.jit(model.init)(init_rngs, query, answer)["params"]
    tx = optax.adam(3e-3)

    def step(params, opt_state, query, answer, lstm_rng):
        labels = answer[:, 1:]

        def loss_fn(params):
            logits, _ = model.apply({"params": params}, query, answer, rngs={"lstm": lstm_rng})
            xe = jnp.sum(nn.log_softmax(logits) * labels, axis=-1)
            return -jnp.mean(_mask_sequences(xe, _sequence_lengths(labels)))

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, tx.init(params), query, answer, jax.random.PRNGKey(9)), 2


# -- 9. graph network with segment sums (flax/examples/ogbg_molpcba) -------------------

GNN_LATENT, GNN_TASKS = 16, 3


def segment_mean(data, segment_ids, num_segments):
    """jraph.segment_mean."""
    nominator = jax.ops.segment_sum(data, segment_ids, num_segments)
    denominator = jax.ops.segment_sum(jnp.ones_like(data), segment_ids, num_segments)
    return nominator / jnp.maximum(denominator, jnp.ones(shape=[], dtype=denominator.dtype))


class MLP(nn.Module):
    features: tuple[int, ...]

    @nn.compact
    def __call__(self, x):
        for size in self.features:
            x = nn.relu(nn.Dense(size)(x))
        return x


class GraphNet(nn.Module):
    """A jraph.GraphNetwork written out: edge, node and global updates on concatenated
    features, edges aggregated into nodes by segment sum and max, nodes and edges pooled
    into their graph by segment mean and sum; skip connections and LayerNorm between
    message-passing steps, and a Dense decoder of the globals. One message-passing step
    and no dropout (covered by `decoder_lm`): each would add compile time, not coverage."""

    steps: int = 1

    @nn.compact
    def __call__(self, nodes, edges, senders, receivers, n_node, n_edge):
        n_graph = n_node.shape[0]
        sum_n_node, sum_n_edge = nodes.shape[0], edges.shape[0]
        node_graph = jnp.repeat(jnp.arange(n_graph), n_node, total_repeat_length=sum_n_node)
        edge_graph = jnp.repeat(jnp.arange(n_graph), n_edge, total_repeat_length=sum_n_edge)
        nodes = nn.Dense(GNN_LATENT)(nodes)
        edges = nn.Dense(GNN_LATENT)(edges)
        globals_ = jnp.zeros((n_graph, GNN_TASKS), nodes.dtype)
        mlp = partial(MLP, (GNN_LATENT, GNN_LATENT))
        for _ in range(self.steps):
            # edge update
            new_edges = mlp()(
                jnp.concatenate(
                    [edges, nodes[senders], nodes[receivers], globals_[edge_graph]], axis=-1
                )
            )
            # node update
            sent = jax.ops.segment_sum(new_edges, senders, sum_n_node)
            received = jax.ops.segment_sum(new_edges, receivers, sum_n_node)
            received_max = jax.ops.segment_max(new_edges, receivers, sum_n_node)
            # -inf where a node receives no edge
            received_max = jnp.where(jnp.isfinite(received_max), received_max, 0.0)
            new_nodes = mlp()(
                jnp.concatenate([nodes, sent, received, received_max, globals_[node_graph]], -1)
            )
            # global update
            pooled_nodes = segment_mean(new_nodes, node_graph, n_graph)
            pooled_edges = jax.ops.segment_sum(new_edges, edge_graph, n_graph)
            new_globals = mlp()(jnp.concatenate([pooled_nodes, pooled_edges, globals_], -1))
            # skip connections and layer norm
            nodes = nn.LayerNorm()(new_nodes + nodes)
            edges = nn.LayerNorm()(new_edges + edges)
            globals_ = new_globals
        return nn.Dense(GNN_TASKS)(globals_)


def gnn() -> Built:
    model = GraphNet()
    rng = _rng(9)
    # three molecules and jraph's padding graph (its second node receives no edge)
    n_node = np.array([4, 3, 5, 2])
    n_edge = np.array([6, 4, 7, 1])
    offsets = np.concatenate([[0], np.cumsum(n_node)[:-1]])
    senders, receivers = [], []
    for g, (nn_, ne) in enumerate(zip(n_node, n_edge)):
        senders.append(offsets[g] + rng.integers(0, nn_, ne))
        receivers.append(offsets[g] + rng.integers(0, nn_, ne))
    senders, receivers = np.concatenate(senders), np.concatenate(receivers)
    senders[-1] = receivers[-1] = offsets[-1]  # the padding graph's self-loop
    nodes = jnp.asarray(rng.normal(size=(n_node.sum(), 9)), jnp.float32)
    edges = jnp.asarray(rng.normal(size=(n_edge.sum(), 3)), jnp.float32)
    labels = rng.integers(0, 2, (len(n_node), GNN_TASKS)).astype(np.float32)
    labels[0, 1] = labels[2, 0] = np.nan  # tasks without a label in molpcba are NaN
    graph = tuple(
        jnp.asarray(a, jnp.int32) for a in (senders, receivers, n_node, n_edge)
    )  # senders, receivers, n_node, n_edge
    labels = jnp.asarray(labels)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), nodes, edges, *graph)["params"]
    tx = optax.adam(1e-3)

    def step(params, opt_state, nodes, edges, graph, labels):
        def loss_fn(params):
            logits = model.apply({"params": params}, nodes, edges, *graph)
            # valid: a label, and a real graph (not jraph's padding graph, the last)
            graph_mask = jnp.arange(labels.shape[0]) < labels.shape[0] - 1
            mask = ~jnp.isnan(labels) & graph_mask[:, None]
            loss = optax.sigmoid_binary_cross_entropy(logits, jnp.where(mask, labels, -1.0))
            return jnp.sum(jnp.where(mask, loss, 0)) / jnp.sum(mask)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, tx.init(params), nodes, edges, graph, labels), 2


# -- 10. encoder-decoder transformer (flax/examples/wmt) -------------------------------

WMT_VOCAB, WMT_IN, WMT_OUT, WMT_D, WMT_HEADS = 20, 7, 6, 16, 2


def sinusoidal_init(max_len=32, min_scale=1.0, max_scale=10000.0):
    def init(key, shape, dtype=np.float32):
        d_feature = shape[-1]
        pe = np.zeros((max_len, d_feature), dtype=np.float32)
        position = np.arange(0, max_len)[:, np.newaxis]
        scale_factor = -np.log(max_scale / min_scale) / (d_feature // 2 - 1)
        div_term = min_scale * np.exp(np.arange(0, d_feature // 2) * scale_factor)
        pe[:, : d_feature // 2] = np.sin(position * div_term)
        pe[:, d_feature // 2 : 2 * (d_feature // 2)] = np.cos(position * div_term)
        return jnp.array(pe[np.newaxis, :, :])

    return init


def add_position_embs(x):
    """The fixed sinusoidal position embedding of the example (no parameter)."""
    return x + sinusoidal_init()(None, (1, 32, x.shape[-1]))[:, : x.shape[1], :]


def shift_right(x, axis=1):
    pad_widths = [(0, 0)] * len(x.shape)
    pad_widths[axis] = (1, 0)
    padded = jnp.pad(x, pad_widths, mode="constant", constant_values=x.dtype.type(0))
    return padded[:, :-1]


class MlpBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        y = nn.relu(nn.Dense(2 * WMT_D)(x))
        return nn.Dense(x.shape[-1])(y)


def _attention():
    return nn.MultiHeadDotProductAttention(num_heads=WMT_HEADS, qkv_features=WMT_D, use_bias=False)


class Encoder1DBlock(nn.Module):
    @nn.compact
    def __call__(self, inputs, encoder_mask):
        x = nn.LayerNorm()(inputs)
        x = _attention()(x, mask=encoder_mask) + inputs
        return x + MlpBlock()(nn.LayerNorm()(x))


class EncoderDecoder1DBlock(nn.Module):
    @nn.compact
    def __call__(self, targets, encoded, decoder_mask, encoder_decoder_mask):
        x = nn.LayerNorm()(targets)
        x = _attention()(x, mask=decoder_mask) + targets
        y = nn.LayerNorm()(x)
        y = _attention()(y, encoded, mask=encoder_decoder_mask) + x  # cross-attention
        return y + MlpBlock()(nn.LayerNorm()(y))


class Transformer(nn.Module):
    """One encoder and one decoder block, without the example's dropout (covered by
    `decoder_lm`; it adds compile time, not coverage)."""

    def setup(self):
        self.shared_embedding = nn.Embed(
            WMT_VOCAB, WMT_D, embedding_init=nn.initializers.normal(stddev=1.0)
        )
        self.encoder_block = Encoder1DBlock()
        self.encoder_norm = nn.LayerNorm()
        self.decoder_block = EncoderDecoder1DBlock()
        self.decoder_norm = nn.LayerNorm()

    def encode(self, inputs):
        # padding rows and columns masked: a padded query attends to nothing
        encoder_mask = nn.make_attention_mask(inputs > 0, inputs > 0)
        x = add_position_embs(self.shared_embedding(inputs.astype("int32")))
        return self.encoder_norm(self.encoder_block(x, encoder_mask))

    def decode(self, encoded, inputs, targets):
        decoder_mask = nn.combine_masks(
            nn.make_attention_mask(targets > 0, targets > 0), nn.make_causal_mask(targets)
        )
        encoder_decoder_mask = nn.make_attention_mask(targets > 0, inputs > 0)
        y = add_position_embs(self.shared_embedding(shift_right(targets).astype("int32")))
        y = self.decoder_block(y, encoded, decoder_mask, encoder_decoder_mask)
        y = self.decoder_norm(y)
        logits = self.shared_embedding.attend(y)  # shared embedding for the logits
        return logits / jnp.sqrt(y.shape[-1])

    def __call__(self, inputs, targets):
        return self.decode(self.encode(inputs), inputs, targets)


def compute_weighted_cross_entropy(logits, targets, weights, label_smoothing=0.1):
    vocab_size = logits.shape[-1]
    confidence = 1.0 - label_smoothing
    low_confidence = (1.0 - confidence) / (vocab_size - 1)
    normalizing_constant = -(
        confidence * jnp.log(confidence)
        + (vocab_size - 1) * low_confidence * jnp.log(low_confidence + 1e-20)
    )
    soft_targets = common_utils.onehot(
        targets, vocab_size, on_value=confidence, off_value=low_confidence
    )
    loss = -jnp.sum(soft_targets * nn.log_softmax(logits), axis=-1)
    loss = loss - normalizing_constant
    return (loss * weights).sum(), weights.sum()


def wmt_transformer() -> Built:
    model = Transformer()
    rng = _rng(10)
    inputs = rng.integers(1, WMT_VOCAB, (BATCH, WMT_IN))
    targets = rng.integers(1, WMT_VOCAB, (BATCH, WMT_OUT))
    for row, (n_in, n_out) in enumerate([(7, 6), (4, 5), (2, 3), (5, 1)]):
        inputs[row, n_in:] = 0  # padding
        targets[row, n_out:] = 0
    inputs, targets = jnp.asarray(inputs, jnp.int32), jnp.asarray(targets, jnp.int32)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), inputs, targets)["params"]
    schedule = optax.join_schedules(
        [optax.linear_schedule(1e-4, 1e-3, 4), lambda step: 1e-3 * jnp.sqrt(4 / (step + 4))],
        [4],
    )  # linear warmup, then rsqrt decay
    tx = optax.adamw(schedule, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.1)

    def step(params, opt_state, inputs, targets):
        weights = jnp.where(targets > 0, 1, 0).astype(jnp.float32)

        def loss_fn(params):
            logits = model.apply({"params": params}, inputs, targets)
            loss, weight_sum = compute_weighted_cross_entropy(logits, targets, weights)
            return loss / weight_sum

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, tx.init(params), inputs, targets), 2


# -- 11. PPO loss (flax/examples/ppo) --------------------------------------------------

PPO_ACTIONS = 4


class ActorCritic(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = x.astype(jnp.float32) / 255.0
        x = nn.relu(nn.Conv(8, (4, 4), strides=(2, 2), name="conv1")(x))
        x = nn.relu(nn.Conv(8, (3, 3), strides=(1, 1), name="conv2")(x))
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(32, name="hidden")(x))
        logits = nn.Dense(PPO_ACTIONS, name="logits")(x)
        policy_log_probabilities = nn.log_softmax(logits)
        value = nn.Dense(1, name="value")(x)
        return policy_log_probabilities, value


def ppo() -> Built:
    model = ActorCritic()
    rng = _rng(11)
    n = 2 * BATCH
    states = jnp.asarray(rng.integers(0, 256, (n, 12, 12, 4)), jnp.float32)
    actions = jnp.asarray(rng.integers(0, PPO_ACTIONS, n), jnp.int32)
    old_log_probs = jnp.asarray(np.log(rng.uniform(0.1, 0.5, n)), jnp.float32)
    returns = jnp.asarray(rng.normal(1.0, 1.0, n), jnp.float32)
    advantages = jnp.asarray(rng.normal(0.0, 2.0, n), jnp.float32)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), states)["params"]
    tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(2.5e-4))
    clip_param, vf_coeff, entropy_coeff = 0.1, 0.5, 0.01

    def step(params, opt_state, minibatch):
        def loss_fn(params):
            states, actions, old_log_probs, returns, advantages = minibatch
            log_probs, values = model.apply({"params": params}, states)
            values = values[:, 0]
            probs = jnp.exp(log_probs)
            value_loss = jnp.mean(jnp.square(returns - values), axis=0)
            entropy = jnp.sum(-probs * log_probs, axis=1).mean()
            log_probs_act_taken = jax.vmap(lambda lp, a: lp[a])(log_probs, actions)
            ratios = jnp.exp(log_probs_act_taken - old_log_probs)
            # advantage normalization (following the OpenAI baselines)
            advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
            pg_loss = ratios * advantages
            clipped_loss = advantages * jnp.clip(ratios, 1.0 - clip_param, 1.0 + clip_param)
            ppo_loss = -jnp.mean(jnp.minimum(pg_loss, clipped_loss), axis=0)
            return ppo_loss + vf_coeff * value_loss - entropy_coeff * entropy

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    minibatch = (states, actions, old_log_probs, returns, advantages)
    return step, (params, tx.init(params), minibatch), 2


# -- 12. sampling loop with a KV cache (flax/examples/lm1b temperature_sampler) --------

DEC_VOCAB, DEC_LEN, DEC_D, DEC_TOPK = 24, 8, 16, 8


class AddPositionEmbs(nn.Module):
    decode: bool = False

    @nn.compact
    def __call__(self, inputs):
        pos_embedding = self.param(
            "pos_embedding", nn.initializers.normal(0.02), (1, DEC_LEN, inputs.shape[-1])
        )
        if self.decode:
            is_initialized = self.has_variable("cache", "cache_index")
            cache_index = self.variable(
                "cache", "cache_index", lambda: jnp.array(0, dtype=jnp.uint32)
            )
            if is_initialized:
                i = cache_index.value
                cache_index.value = i + 1
                pe = lax.dynamic_slice(pos_embedding, jnp.array((0, i, 0)), (1, 1, DEC_D))
                return inputs + pe
        return inputs + pos_embedding[:, : inputs.shape[1], :]


class SamplingLM(nn.Module):
    decode: bool = False

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(DEC_VOCAB, DEC_D)
        x = AddPositionEmbs(decode=self.decode)(embed(tokens))
        mask = None if self.decode else nn.make_causal_mask(tokens)
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(num_heads=2, use_bias=False, decode=self.decode)(
            h, mask=mask
        )  # decode: keys and values go to the cache by lax.dynamic_update_slice
        x = x + h
        h = nn.Dense(DEC_D)(nn.gelu(nn.Dense(4 * DEC_D)(nn.LayerNorm()(x))))
        return embed.attend(nn.LayerNorm()(x + h))


def temperature_sample(prompt_inputs, init_cache, tokens_to_logits, prng_key, temperature):
    """lm1b's temperature_sample with top-k (no EOS: every sequence runs to the end), which
    also keeps each step's logits."""
    batch_size, max_decode_len = prompt_inputs.shape
    i0 = jnp.array(-1)
    token0 = jnp.zeros((batch_size, 1), dtype=jnp.int32)
    logits0 = jnp.zeros((batch_size, max_decode_len, DEC_VOCAB), jnp.float32)

    def sampling_loop_cond_fn(state):
        return state[0] < max_decode_len - 1

    def sampling_loop_body_fn(state):
        i, sequences, cache, cur_token, all_logits, rng = state
        rng1, rng2 = jax.random.split(rng)
        logits, new_cache = tokens_to_logits(cur_token, cache)
        # sample within the top-k logits
        topk_logits, topk_idxs = lax.top_k(logits, DEC_TOPK)
        topk_token = jnp.expand_dims(
            jax.random.categorical(rng1, topk_logits / temperature).astype(jnp.int32), axis=-1
        )
        next_token = jnp.squeeze(jnp.take_along_axis(topk_idxs, topk_token, axis=-1), axis=-1)
        # only use sampled tokens past the prompt
        out_of_prompt = sequences[:, i + 1] == 0
        next_token = next_token * out_of_prompt + sequences[:, i + 1] * ~out_of_prompt
        new_sequences = lax.dynamic_update_slice(sequences, next_token[:, None], (0, i + 1))
        all_logits = lax.dynamic_update_slice(all_logits, logits[:, None], (0, i + 1, 0))
        return i + 1, new_sequences, new_cache, next_token[:, None], all_logits, rng2

    init_state = (i0, prompt_inputs, init_cache, token0, logits0, prng_key)
    _, sequences, _, _, all_logits, _ = lax.while_loop(
        sampling_loop_cond_fn, sampling_loop_body_fn, init_state
    )
    return sequences, all_logits


def lm_sampling() -> Built:
    rng = _rng(12)
    prompts = np.zeros((BATCH, DEC_LEN), np.int32)
    prompts[:, :2] = rng.integers(1, DEC_VOCAB, (BATCH, 2))
    prompts[0, 2] = 5  # prompts of different lengths
    prompts = jnp.asarray(prompts)
    params = jax.jit(SamplingLM().init)(jax.random.PRNGKey(0), prompts)["params"]
    # lm1b: the cache comes from initialising the decoding model on the full length
    model = SamplingLM(decode=True)
    cache = jax.jit(model.init)(jax.random.PRNGKey(0), prompts)["cache"]

    def sample(params, cache, prompts, rng, temperature):
        def tokens_ids_to_logits(ids, cache):
            logits, new_vars = model.apply(
                {"params": params, "cache": cache}, ids, mutable=["cache"]
            )
            return logits.squeeze(axis=1), new_vars["cache"]

        sequences, all_logits = temperature_sample(
            prompts, cache, tokens_ids_to_logits, rng, temperature
        )
        # the negative log-likelihood of the sampled continuation
        log_probs = nn.log_softmax(all_logits[:, :-1])
        nll = -jnp.take_along_axis(log_probs, sequences[:, 1:, None], axis=-1)[..., 0]
        return sequences, all_logits, jnp.mean(nll[:, 1:])

    temperature = jnp.asarray(0.7, jnp.float32)
    return sample, (params, cache, prompts, jax.random.PRNGKey(13), temperature), 2


# -- 13. a Gemma-style decoder in NNX (flax/examples/gemma) ----------------------------
# RoPE, GemmaRMSNorm with a (1 + scale) gain, grouped-query attention (5-D einsums), attention
# and final-logit soft-capping (tanh), a sliding-window layer, a GeGLU feed-forward, tied
# embeddings scaled by sqrt(d), positions from the padding mask, a padded-token mask in
# the loss.

K_MASK = -2.3819763e38
G_VOCAB, G_SEQ, G_D, G_HEADS, G_KV, G_HEAD_DIM, G_FF = 32, 8, 16, 4, 2, 8, 32


def apply_rope(inputs, positions, max_wavelength=10_000):
    first_half, second_half = jnp.split(inputs, 2, axis=-1)
    fraction = 2 * jnp.arange(0, inputs.shape[-1] // 2) / inputs.shape[-1]
    timescale = max_wavelength**fraction
    sinusoid_inp = positions[..., jnp.newaxis] / timescale[jnp.newaxis, jnp.newaxis, :]
    sinusoid_inp = sinusoid_inp[..., jnp.newaxis, :]
    sin, cos = jnp.sin(sinusoid_inp), jnp.cos(sinusoid_inp)
    first_part = first_half * cos - second_half * sin
    second_part = second_half * cos + first_half * sin
    return jnp.concatenate([first_part, second_part], axis=-1).astype(inputs.dtype)


class GemmaRMSNorm(nnx.Module):
    def __init__(self, dim, *, rngs):
        self.scale = nnx.Param(jnp.zeros((dim,)))

    def __call__(self, x):
        var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        normed = x * jax.lax.rsqrt(var + 1e-06)
        scale = jnp.expand_dims(self.scale[...], axis=range(len(x.shape) - 1))
        return normed * (1 + scale)


class GemmaEinsum(nnx.Module):
    def __init__(self, shape, *, rngs):
        self.w = nnx.Param(nnx.initializers.normal(0.2)(rngs.params(), shape))

    def __call__(self, eqn, x):
        return jnp.einsum(eqn, x, self.w[...])


class GemmaAttention(nnx.Module):
    def __init__(self, sliding_window=None, *, rngs):
        self.q_einsum = GemmaEinsum((G_HEADS, G_D, G_HEAD_DIM), rngs=rngs)
        self.kv_einsum = GemmaEinsum((2, G_KV, G_D, G_HEAD_DIM), rngs=rngs)
        self.attn_vec_einsum = GemmaEinsum((G_HEADS, G_HEAD_DIM, G_D), rngs=rngs)
        self.sliding_window = sliding_window
        self.softcap = 50.0

    def __call__(self, x, positions, mask):
        query = self.q_einsum("BTD,NDH->BTNH", x)
        key, value = self.kv_einsum("BSD,CKDH->CBSKH", x)
        query = apply_rope(query, positions)
        query = query * G_HEAD_DIM**-0.5
        key = apply_rope(key, positions)
        b, t, kg, h = query.shape
        query = query.reshape((b, t, G_KV, kg // G_KV, h))
        logits = jnp.einsum("BTKGH,BSKH->BTKGS", query, key)
        b, t, k, g, s = logits.shape
        logits = logits.reshape((b, t, k * g, s))
        logits = jnp.tanh(logits / self.softcap) * self.softcap
        if self.sliding_window is not None:
            all_ones = jnp.ones_like(mask)
            sliding_mask = jnp.triu(all_ones, -1 * self.sliding_window + 1) * jnp.tril(
                all_ones, self.sliding_window - 1
            )
            mask = sliding_mask * mask
        padded = jnp.where(jnp.expand_dims(mask, -2), logits, K_MASK)
        probs = jax.nn.softmax(padded, axis=-1).astype(key.dtype)
        probs = probs.reshape((b, t, k, g, s))
        encoded = jnp.einsum("BTKGS,BSKH->BTKGH", probs, value)
        encoded = encoded.reshape((b, t, k * g, h))
        return self.attn_vec_einsum("BTNH,NHD->BTD", encoded)


class GemmaFeedForward(nnx.Module):
    def __init__(self, *, rngs):
        self.gating = nnx.Param(nnx.initializers.normal(0.2)(rngs.params(), (2, G_D, G_FF)))
        self.linear = nnx.Param(nnx.initializers.normal(0.2)(rngs.params(), (G_FF, G_D)))

    def __call__(self, x):
        ff_gate = jnp.dot(x, self.gating[...][0])
        gate_value = jax.nn.gelu(ff_gate)
        ff1 = jnp.dot(x, self.gating[...][1])
        return jnp.dot(gate_value * ff1, self.linear[...])


class GemmaBlock(nnx.Module):
    def __init__(self, sliding_window, *, rngs):
        self.pre_attention_norm = GemmaRMSNorm(G_D, rngs=rngs)
        self.attn = GemmaAttention(sliding_window, rngs=rngs)
        self.post_attention_norm = GemmaRMSNorm(G_D, rngs=rngs)
        self.pre_ffw_norm = GemmaRMSNorm(G_D, rngs=rngs)
        self.mlp = GemmaFeedForward(rngs=rngs)
        self.post_ffw_norm = GemmaRMSNorm(G_D, rngs=rngs)

    def __call__(self, x, positions, mask):
        attn = self.post_attention_norm(self.attn(self.pre_attention_norm(x), positions, mask))
        x = x + attn
        return x + self.post_ffw_norm(self.mlp(self.pre_ffw_norm(x)))


class Gemma(nnx.Module):
    def __init__(self, *, rngs):
        self.embedding = nnx.Param(nnx.initializers.normal(1.0)(rngs.params(), (G_VOCAB, G_D)))
        self.layers = nnx.List([GemmaBlock(None, rngs=rngs), GemmaBlock(4, rngs=rngs)])
        self.final_norm = GemmaRMSNorm(G_D, rngs=rngs)
        self.final_logit_softcap = 30.0

    def __call__(self, tokens, positions, mask):
        x = self.embedding[...][(tokens,)]
        x *= jnp.sqrt(G_D).astype(x.dtype)
        for layer in self.layers:
            x = layer(x, positions, mask)
        x = self.final_norm(x)
        logits = jnp.dot(x, self.embedding[...].T)
        logits /= self.final_logit_softcap
        logits = jnp.tanh(logits) * self.final_logit_softcap
        return logits


def gemma_lm() -> Built:
    model = Gemma(rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    rng = _rng(14)
    tokens = rng.integers(1, G_VOCAB, (4, G_SEQ + 1))
    tokens[1, -3:] = 0  # padding
    tokens = jnp.asarray(tokens, jnp.int32)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.01))

    def step(params, opt_state, tokens):
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        input_mask = inputs != 0
        positions = jnp.cumsum(input_mask, axis=-1) - 1  # Gemma's build_positions_from_mask
        causal = jnp.tril(jnp.ones((G_SEQ, G_SEQ), jnp.bool_))
        attn_mask = input_mask[:, None, :] & causal[None]

        def loss_fn(params):
            model = nnx.merge(graphdef, params)
            logits = model(inputs, positions, attn_mask)
            one_hot = jax.nn.one_hot(targets, G_VOCAB)
            one_hot = one_hot * (targets != 0)[..., None]
            norm = jnp.sum(targets != 0)
            return -jnp.sum(jax.nn.log_softmax(logits) * one_hot) / norm

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, tx.init(params), tokens), 2


# -- 14. an optax optimizer zoo on one MLP ---------------------------------------------


class ZooMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(16)(x))
        return nn.Dense(8)(x)


def _decay_mask(params):
    return jax.tree.map(lambda p: p.ndim > 1, params)  # kernels, not biases


def _warmup_cosine():
    schedule = optax.warmup_cosine_decay_schedule(1e-4, 1e-2, 3, 50, 1e-5)
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.scale_by_adam(),
        optax.scale_by_schedule(lambda count: -schedule(count)),
    )


# (sgd with Nesterov momentum and adagrad use only the elementwise ops the others cover;
# they matched too and were left out to keep the module's compile time down)
OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    # factored second moments for the 12x16 and 16x8 kernels
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8),
    "lion": lambda: optax.lion(1e-3, weight_decay=1e-2),
    "lamb": lambda: optax.lamb(1e-2, weight_decay=1e-2),
    "rmsprop": lambda: optax.rmsprop(1e-3, momentum=0.9, centered=True),
    "adamw_masked": lambda: optax.adamw(1e-3, weight_decay=1e-2, mask=_decay_mask),
    "multisteps_adam": lambda: optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2),
    "chain_warmup_cosine": _warmup_cosine,
    # Newton-Schulz orthogonalisation of the kernels' momentum (x @ x.T, a @ a)
    "muon": lambda: optax.contrib.muon(1e-3),
}


def optimizer(name: str) -> Built:
    model = ZooMLP()
    rng = _rng(13)
    x = jnp.asarray(rng.normal(size=(2 * BATCH, 12)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 8, 2 * BATCH), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), x)["params"]
    tx = OPTIMIZERS[name]()
    applications = 2 if name.startswith("multisteps") else 1  # accumulate, then apply

    def step(params, opt_state, x, y):
        def loss_fn(params):
            logits = model.apply({"params": params}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        losses = []
        for _ in range(applications):
            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            losses.append(loss)
        # the loss at the step's parameters (a later application's loss is computed from
        # updated parameters, which the probe counts as the optimizer pass)
        return params, opt_state, losses[0]

    # one plain step first, so the optimizer state holds non-zero statistics and a count
    params, opt_state, _ = jax.jit(step)(params, tx.init(params), x, y)
    return step, (params, opt_state, x, y), 2


MODELS: dict[str, Callable[[], Built]] = {
    "mnist_cnn_avg_pool": lambda: mnist_cnn("avg"),
    "mnist_cnn_max_pool": lambda: mnist_cnn("max"),
    "resnet_batchnorm": resnet,
    "lstm_sst2": lstm,
    "vae": vae,
    "decoder_lm": decoder_lm,
    "nnx_functional": nnx_model,
    "groupnorm_depthwise_transpose": groupnorm_convs,
    "seq2seq_lstm_scan": seq2seq,
    "gnn_segment_sum": gnn,
    "wmt_encoder_decoder": wmt_transformer,
    "ppo_loss": ppo,
    "lm_sampling_kv_cache": lm_sampling,
    "gemma_nnx": gemma_lm,
    **{f"optax_{name}": partial(optimizer, name) for name in OPTIMIZERS},
}
