"""The public API on models written the way Flax's own examples write them: an MNIST CNN
(average and max pooling), a ResNet block with BatchNorm, the SST-2 LSTM classifier, the
VAE, a decoder LM with dropout and a warmup-cosine AdamW, an NNX model trained with
split/merge, GroupNorm with depthwise and transposed convolutions, the seq2seq LSTM
(nn.scan, teacher forcing), a graph network (segment sum/max/mean, masked BCE), the WMT
encoder-decoder transformer (padding masks, cross-attention, label smoothing), the PPO
loss, lm1b's sampling loop (while_loop, KV cache, top-k categorical), a Gemma-style NNX
decoder (RoPE, grouped-query attention, soft-capping, a sliding window), and optax
optimizers one by one on an MLP (`other_models`).

For each training step:

- ``jit(scalify(step))`` on the parameters and optimizer state at scale 1 gives the plain
  jitted step's loss, parameters, optimizer state (and batch statistics);
- so it does with every float input at scale 2^k (same values: the data is ``x / 2^k``);
- ``instrument(step)`` runs under jit, with one statistics row per recorded op and a
  finite RMS for the loss.

For the models the probe records, the scalified step is the one the instrumented program
computes (``instrument(step)`` returns ``scalify(step)``'s outputs, by the same rules):
one compiled program per model checks both, instead of two that differ only by the
probe's reads (each model's scalified step costs 3-19 s of XLA compile on CPU).

The default fallback ("raise") is used throughout: a primitive without a scaled rule fails.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from other_models import MODELS

import scalescope as ss

RTOL, ATOL = 1e-4, 1e-5
SCALES = (-20, 17)


def _is_float(x) -> bool:
    return isinstance(x, jax.Array | np.ndarray) and jnp.issubdtype(x.dtype, jnp.floating)


def _scaled(args, k: int | None):
    """Float leaves as ScaledArrays holding the same values: scale 1 (``k=None``) or 2^k
    (data ``x / 2^k``); other leaves (labels, lengths, keys) as they are."""
    if k is None:
        return ss.as_scaled_array(args)
    return jax.tree.map(lambda x: ss.as_scaled_array(x, scale=2.0**k) if _is_float(x) else x, args)


def _comparable(x) -> np.ndarray:
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def _mismatches(got, expected) -> list[str]:
    """Leaves of ``got`` that differ from ``expected`` (rtol 1e-4, atol 1e-5)."""
    flat_e, tree_e = jax.tree_util.tree_flatten_with_path(expected)
    flat_g, tree_g = jax.tree.flatten(got)
    if tree_g != tree_e:
        return [f"output structure {tree_g} != {tree_e}"]
    bad = []
    for (path, e), g in zip(flat_e, flat_g, strict=True):
        e, g = _comparable(e), _comparable(g)
        where = jax.tree_util.keystr(path)
        if e.shape != g.shape or e.dtype != g.dtype:
            bad.append(f"{where}: {g.dtype}{g.shape} != {e.dtype}{e.shape}")
            continue
        try:
            if np.issubdtype(e.dtype, np.floating):
                np.testing.assert_allclose(g, e, rtol=RTOL, atol=ATOL)
            else:
                np.testing.assert_array_equal(g, e)
        except AssertionError:
            with np.errstate(all="ignore"):
                diff = np.abs(g.astype(np.float64) - e.astype(np.float64))
            bad.append(
                f"{where}: max abs err {np.nanmax(diff):.3g} (max |expected| "
                f"{np.max(np.abs(e)):.3g}), nonfinite {int(np.sum(~np.isfinite(g)))}/{g.size}"
            )
    return bad


# The optimizer zoo shares one model: its forward ops, which the instrument test records,
# are the same for every optimizer, so one of them stands for all. The transformers'
# forward ops (attention, layer norms, embeddings) are recorded by the probe's own GPT
# tests (test_probe_models.py); their compile is the module's largest, so they are left
# out here.
INSTRUMENTED = sorted(
    name
    for name in MODELS
    if (not name.startswith("optax_") or name == "optax_adafactor")
    and name not in ("wmt_encoder_decoder", "decoder_lm")
)


class Case:
    """One model's step, its arguments, the plain jitted result and the jitted scalify
    (inside the instrumented program, for the models the probe records)."""

    def __init__(self, name: str):
        self.name = name
        self.step, self.args, self.loss_index = MODELS[name]()
        self.expected = jax.device_get(jax.jit(self.step)(*self.args))
        if name in INSTRUMENTED:
            # light: forward ops only, statistics read from the values themselves
            self.probe = ss.instrument(
                self.step, formats=(), histograms=False, select="^fwd/", isolate=False
            )
            self.instrumented = jax.jit(self.probe)
            self.scalified = lambda *args: self.instrumented(*args)[0]
        else:
            self.scalified = jax.jit(ss.scalify(self.step))

    def check(self, k: int | None) -> None:
        got = ss.asarray(self.scalified(*_scaled(self.args, k)))
        bad = _mismatches(got, self.expected)
        label = "scale 1" if k is None else f"scale 2^{k}"
        shown = "\n".join(bad[:12]) + ("\n..." if len(bad) > 12 else "")
        assert not bad, f"{self.name} at {label}: {len(bad)} leaves differ:\n{shown}"


_CASES: dict[str, Case] = {}


def _case(name: str) -> Case:
    if name not in _CASES:
        _CASES[name] = Case(name)
    return _CASES[name]


@pytest.fixture(scope="module", params=sorted(MODELS))
def case(request) -> Case:
    return _case(request.param)


def test_plain_step_is_sane(case):
    loss = case.expected[case.loss_index]
    assert np.isfinite(loss) and loss > 0, loss


def test_scalify_at_scale_one_matches_plain(case):
    case.check(None)
    if case.name in INSTRUMENTED:  # scalify itself traced too (no compile): its outputs
        scaled = _scaled(case.args, None)
        got = jax.eval_shape(lambda *a: ss.asarray(ss.scalify(case.step)(*a)), *scaled)
        expected = jax.eval_shape(case.step, *case.args)
        layout = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)  # noqa: E731
        assert layout(got) == layout(expected)


@pytest.mark.parametrize("k", SCALES)
def test_scalify_at_scale_2k_matches_plain(case, k):
    case.check(k)


@pytest.mark.parametrize("name", INSTRUMENTED)
def test_instrument_records_every_op_and_the_loss(name):
    case = _case(name)
    args = _scaled(case.args, None)
    out, stats = case.instrumented(*args)
    table = case.probe.op_table(*args)
    assert table.n_rows > 0
    assert all(np.shape(v)[0] == table.n_rows for v in stats.values())
    assert sum(op.n_rows for op in table if op.recorded) == table.n_rows
    (loss_op,) = [op for op in table if op.name == f"output/{case.loss_index}"]
    rows = table.rows(loss_op)
    rms = np.asarray(stats["rms"])[rows]
    assert rms.size == 1 and np.all(np.isfinite(rms)) and np.all(rms > 0), rms
    # the loss itself
    loss = float(ss.asarray(out[case.loss_index]))
    np.testing.assert_allclose(loss, case.expected[case.loss_index], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(
        rms, abs(loss) / float(np.asarray(stats["scale"])[rows][0]), rtol=1e-5
    )


def test_typed_prng_key_argument():
    """Flax's examples now pass ``jax.random.key`` (typed) keys; NNX keeps them in the
    module state. A step taking one next to scaled arrays must run."""
    x = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32)

    def f(key, x):
        return x * jax.random.normal(key, x.shape)

    key = jax.random.key(0)
    got = ss.asarray(jax.jit(ss.scalify(f))(key, ss.as_scaled_array(x)))
    np.testing.assert_allclose(got, f(key, x), rtol=RTOL, atol=ATOL)


def test_typed_prng_key_through_instrument_and_run(tmp_path):
    """The probe with a typed key in and out: keys are listed in the op table and never
    measured, and a Run records the step."""

    def f(key, x):
        k1, k2 = jax.random.split(key)
        return x * (1.0 + 0.1 * jax.random.normal(k1, x.shape)), k2

    x = ss.as_scaled_array(jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32))
    inst = ss.instrument(f)
    (y, k2), _ = jax.jit(inst)(jax.random.key(0), x)
    np.testing.assert_allclose(ss.asarray(y), f(jax.random.key(0), ss.asarray(x))[0], rtol=RTOL)
    assert jnp.issubdtype(k2.dtype, jax.dtypes.prng_key)
    table = inst.op_table(jax.random.key(0), x)
    keys = [op for op in table if op.dtype.startswith("key")]
    assert keys and not any(op.recorded for op in keys)
    with ss.Run(tmp_path / "run", every=1) as run:
        step = run.track(f)
        key = jax.random.key(0)
        for _ in range(2):
            x, key = step(key, x)
    assert list(ss.open_run(tmp_path / "run").steps) == [0, 1]
