"""A stateful Flax NNX step under `Run.track`: what the step assigns to the NNX objects
passed in (``optimizer.update(model, grads)``, BatchNorm statistics, dropout's RNG
counter) is written back into the caller's objects, as ``nnx.jit`` does. Flax's own NNX
examples write their training step this way; before, a tracked step changed copies made
while tracing and the model never trained (a warning only)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import fail_on_warnings

import scalescope as ss

nnx = pytest.importorskip("flax.nnx")


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(8, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.l2 = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l2(self.drop(jax.nn.relu(self.bn(self.l1(x)))))


def train_step(model: Net, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
    """As Flax's NNX MNIST example writes it: the objects are updated in place."""

    def loss_fn(model: Net) -> jax.Array:
        return jnp.mean((model(x) - y) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def _objects() -> tuple[Net, nnx.Optimizer]:
    model = Net(nnx.Rngs(0, dropout=1))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def _batches(n: int, bad: int = -1) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        x = rng.normal(size=(32, 8)).astype(np.float32)
        if i == bad:
            x[0, 0] = np.nan
        out.append((x, 2 * x[:, :1]))
    return out


def _leaves(*objects: object) -> list[np.ndarray]:
    def host(v: jax.Array) -> np.ndarray:
        if jnp.issubdtype(v.dtype, jax.dtypes.prng_key):
            return np.asarray(jax.random.key_data(v))
        return np.asarray(v)

    return [host(v) for v in jax.tree.leaves(nnx.state(objects))]


def test_a_stateful_nnx_step_trains_as_under_nnx_jit(tmp_path):
    batches = _batches(4)
    model, optimizer = _objects()
    initial = _leaves(model, optimizer)
    ref_model, ref_opt = _objects()
    reference = nnx.jit(train_step)
    with ss.Run(tmp_path / "r", every=2) as run, warnings.catch_warnings():
        fail_on_warnings()  # no "not written back" warning
        step = run.track(train_step, scalify=False)  # plain arguments: recorded as written
        for x, y in batches:
            loss = step(model, optimizer, x, y)
            ref_loss = reference(ref_model, ref_opt, x, y)
            assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    after, expected = _leaves(model, optimizer), _leaves(ref_model, ref_opt)
    # every leaf moved as under nnx.jit: the parameters, Adam's moments and count, the
    # BatchNorm statistics and the dropout RNG's counter
    for a, e, i in zip(after, expected, initial, strict=True):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)
        assert not np.array_equal(a, i) or np.array_equal(e, i)
    assert int(optimizer.step[...]) == len(batches)
    assert float(jnp.abs(model.bn.mean[...]).sum()) > 0
    # each object's state is named after its argument
    names = ss.open_run(tmp_path / "r").ops["name"].tolist()
    assert "input/model/l1/kernel/value" in names
    assert any(n.startswith("input/optimizer/opt_state/") for n in names)
    assert not any("/0/" in n for n in names if n.startswith("input/model"))


def test_a_shared_variable_stays_one_variable(tmp_path):
    """Two objects holding one variable (a tied head) are split together: the step
    updates it once, and both objects still hold the same variable after it."""
    model, optimizer = _objects()
    head = nnx.Linear(16, 1, rngs=nnx.Rngs(2))
    head.kernel = model.l2.kernel  # shared

    def step(model, optimizer, head, x, y):
        loss = train_step(model, optimizer, x, y)
        return loss + 0.0 * jnp.sum(head.kernel[...])

    with ss.Run(tmp_path / "r", every=1000) as run:
        tracked = run.track(step, scalify=False)
        x, y = _batches(1)[0]
        before = np.asarray(model.l2.kernel[...])
        tracked(model, optimizer, head, x, y)
    assert head.kernel is model.l2.kernel
    assert not np.array_equal(np.asarray(model.l2.kernel[...]), before)


@pytest.mark.parametrize("mode", ["skip", "stop"])
def test_a_bad_step_leaves_the_objects_as_the_last_healthy_step_left_them(tmp_path, mode):
    """``on_nonfinite="skip"`` writes back the state of the last healthy step; "stop"
    raises before anything is written: either way the model holds no NaN."""
    batches = _batches(3, bad=2)
    model, optimizer = _objects()
    run = ss.Run(tmp_path / mode, every=1000, on_nonfinite=mode)
    step = run.track(train_step, scalify=False)
    for x, y in batches[:2]:
        step(model, optimizer, x, y)
    healthy = _leaves(model, optimizer)
    x, y = batches[2]
    if mode == "stop":
        with pytest.raises(ss.NonFiniteStep):
            step(model, optimizer, x, y)
    else:
        step(model, optimizer, x, y)
    run.close()
    for a, h in zip(_leaves(model, optimizer), healthy, strict=True):
        np.testing.assert_array_equal(a, h)
    assert not run.healthy


def test_warmup_writes_nothing_back(tmp_path):
    model, optimizer = _objects()
    before = _leaves(model, optimizer)
    with ss.Run(tmp_path / "r", every=1) as run:
        run.track(train_step, scalify=False).warmup(model, optimizer, *_batches(1)[0])
    for a, b in zip(_leaves(model, optimizer), before, strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_functional_api_s_pure_state_is_a_pytree_as_before(tmp_path):
    """`nnx.split`'s ``State`` of variables (the functional API) is no object to write
    into: it passes as a pytree, the step's returned state is the new one, and the
    caller's ``State`` keeps its values."""
    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    before = _leaves(params)
    tx = optax.adam(1e-2)

    def step(p, s, x):
        loss, g = jax.value_and_grad(lambda p: jnp.mean(nnx.merge(graphdef, p)(x) ** 2))(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    x = jnp.ones((8, 4))
    new, _, loss = jax.jit(step)(params, tx.init(params), x)
    with ss.Run(tmp_path / "r", every=1) as run:
        got, _, got_loss = run.track(step, scalify=False)(params, tx.init(params), x)
    assert float(got_loss) == float(loss)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(new), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(_leaves(params), before, strict=True):
        np.testing.assert_array_equal(a, b)
