"""What a held format keeps of each update (`scalescope.store.updates`) and the advisor's
``stall`` rule: the figures against a NumPy + ml_dtypes reference, the rule's threshold
and grades on hand-made figures. A tracked run under a policy is in test_emulate.py."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pandas as pd
import pytest

from scalescope.analysis import Thresholds
from scalescope.analysis.advisor.detectors_updates import _stall_findings
from scalescope.analysis.advisor.severity import severity_level, severity_of
from scalescope.store import updates

DTYPES = {"e4m3": ml_dtypes.float8_e4m3fn, "bf16": ml_dtypes.bfloat16, "fp16": np.float16}


def _held(v: np.ndarray, fmt: str) -> np.ndarray:
    """Round to nearest even in ``fmt``, saturating at its max; non-finite kept."""
    dtype = DTYPES[fmt]
    top = float(ml_dtypes.finfo(dtype).max)
    out = np.clip(v, -top, top).astype(dtype).astype(np.float32)
    return np.where(np.isfinite(v), out, v)


def _reference(old: np.ndarray, new: np.ndarray, fmt: str) -> list[float]:
    base, kept = _held(old, fmt), _held(new, fmt)
    with np.errstate(invalid="ignore"):  # inf - inf
        d, e = (new - base).astype(np.float64), (kept - new).astype(np.float64)
    finite = np.isfinite(d) & np.isfinite(e)
    moved = finite & (d != 0)
    lost = moved & (kept == base)
    return [moved.sum(), lost.sum(), np.sum(d[finite] ** 2), np.sum(e[finite] ** 2)]


@pytest.mark.parametrize("fmt", list(DTYPES))
def test_held_update_figures_match_the_numpy_reference(fmt):
    rng = np.random.default_rng(3)
    old = (rng.standard_normal((64, 48)) * np.exp(rng.standard_normal((64, 48)))).astype(np.float32)
    # updates over six decades: some under half the spacing (lost), some over it
    size = np.exp(rng.uniform(np.log(1e-6), np.log(1e-1), old.shape))
    step = (rng.choice([-1.0, 1.0], old.shape) * size).astype(np.float32)
    new = _held(old, fmt) + step
    new[0, :5] = _held(old, fmt)[0, :5]  # not moved
    new[1, 0], new[1, 1] = np.nan, np.inf  # left out of every figure
    held = [updates.Held(0, 0, 0, fmt, None)]
    got = updates.figures(held, [jnp.asarray(old)], [jnp.asarray(new)])
    want = _reference(old, new, fmt)
    got = np.asarray(got)[0]
    assert got[:2].tolist() == want[:2]
    assert 0 < want[1] < want[0]  # some lost, some kept: the case is a real one
    np.testing.assert_allclose(got[2:], want[2:], rtol=1e-4)


def _frame(rows):
    return pd.DataFrame(rows, columns=["step", "op", "moved", "lost", "d2", "e2"])


def test_the_stall_rule_judges_the_sustained_share_with_the_models():
    table = pd.DataFrame(
        {"cast_to": ["e4m3", "bf16", "fp16", "e4m3", "bf16", "bf16"]},
        index=pd.Index([0, 1, 2, 3, 4, 5], name="op"),
    )
    rows = [
        (0, 0, 100, 97, 1.0, 0.99),  # nearly all lost at every step
        (10, 0, 100, 98, 1.0, 0.995),
        (20, 0, 100, 96, 1.0, 0.99),
        (0, 1, 100, 30, 1.0, 0.4),  # a fifth to a third
        (10, 1, 100, 20, 1.0, 0.2),
        (20, 1, 100, 10, 1.0, 0.1),
        (0, 2, 100, 1, 1.0, 0.01),  # 1 %: under the threshold
        (0, 3, 0, 0, 0.0, 0.0),  # nothing moved: nothing to say
        (0, 5, 10, 0, 1.0, 0.0),  # lost at its last step only (a converging training)
        (10, 5, 10, 0, 1.0, 0.0),
        (20, 5, 10, 9, 1.0, 0.9),
        (0, 9, 100, 100, 1.0, 1.0),  # an op the table does not hold: skipped
    ]
    found = pd.DataFrame(_stall_findings(_frame(rows), table, Thresholds()))
    assert found["op"].tolist() == [0, 1]
    first = found.iloc[0]
    assert first["value"] == pytest.approx(0.97) and first["_at"] == 10
    assert first["steps"] == 3 and first["first_step"] == 0
    assert first["format"] == "e4m3" and "97.0%" in first["evidence"]
    assert found.iloc[1]["value"] == pytest.approx(0.2) and found.iloc[1]["steps"] == 3
    # the model's share: (97+30+1+0) / 310 at step 0, (98+20+0) / 210, (96+10+9) / 210
    model = np.median([128 / 310, 118 / 210, 115 / 210])
    assert found["_share"].tolist() == pytest.approx([model, model])
    graded = found.rename(columns={"_share": "impact"})
    assert severity_of(severity_level(graded)).tolist() == ["high", "high"]
    # beside a large leaf whose updates are kept, the model loses under 1/8 of its
    # updates: the same two leaves are medium (a norm's scale may stall, the model trains)
    rows += [(step, 4, 2000, 10, 1.0, 0.01) for step in (0, 10, 20)]
    found = pd.DataFrame(_stall_findings(_frame(rows), table, Thresholds()))
    assert found["op"].tolist() == [0, 1] and found["_share"].iloc[0] < 0.0625
    graded = found.rename(columns={"_share": "impact"})
    assert severity_of(severity_level(graded)).tolist() == ["low", "low"]
    # a stricter threshold judges the 1 % op too; a looser one drops the fifth
    assert 2 in {r["op"] for r in _stall_findings(_frame(rows), table, Thresholds(stall=0.005))}
    assert [r["op"] for r in _stall_findings(_frame(rows), table, Thresholds(stall=0.5))] == [0]


def test_the_stall_threshold_is_a_fraction():
    with pytest.raises(ValueError, match="Thresholds.stall"):
        Thresholds(stall=1.5)
    with pytest.raises(ValueError, match="Thresholds.stall"):
        Thresholds(stall=-0.1)


def test_the_weights_are_the_leaves_the_loss_depends_on():
    """`loss_inputs`: the step's loss reads the weights (through a jitted call, a
    custom_jvp and a scan over layers) and the batch, never the optimizer's moments; a
    constant scalar output (adafactor's placeholders) adds nothing."""
    import jax

    @jax.jit
    def loss(p, x):
        def layer(h, w):
            return jax.nn.relu(h @ w), None

        h, _ = jax.lax.scan(layer, x @ p["w_in"], p["blocks"])
        return jnp.mean(h**2)

    def step(p, moments, x):
        value, g = jax.value_and_grad(loss)(p, x)
        mu = jax.tree.map(lambda m, gi: 0.9 * m + 0.1 * gi, moments, g)
        new = jax.tree.map(lambda w, m: w - 1e-3 * m, p, mu)
        return new, mu, jnp.zeros(()), value

    p = {"blocks": jnp.ones((3, 4, 4)), "w_in": jnp.ones((2, 4))}
    moments = jax.tree.map(jnp.zeros_like, p)
    closed = jax.make_jaxpr(step)(p, moments, jnp.ones((5, 2)))
    # flat arguments: the two weights, their two moments, the batch
    assert updates.loss_inputs(closed.jaxpr) == {0, 1, 4}
    # without a scalar output, or with constant ones only, nothing is known
    no_loss = jax.make_jaxpr(lambda p, m, x: step(p, m, x)[:3])(p, moments, jnp.ones((5, 2)))
    assert updates.loss_inputs(no_loss.jaxpr) is None


def test_held_leaves_are_matched_past_static_leaves_and_keyword_arguments():
    """A step whose first argument is static (a string) and whose batch comes by keyword:
    the held weights are still matched to their input ops (the table has none for the
    string), their new values found in the outputs by layout, and the figures are those
    of the NumPy reference; the moments (state the loss does not read) are not held
    weights."""
    import jax

    import scalescope as ss

    def step(tag, p, m, *, x):
        value, g = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(p)
        m = 0.9 * m + g
        return p - 1e-3 * jnp.sign(m), m, value

    rng = np.random.default_rng(0)
    p = jnp.asarray(rng.standard_normal((8, 4)) * 4, jnp.float32)
    args, kwargs = ("tag", p, jnp.zeros_like(p)), {"x": jnp.ones((3, 8))}
    policy = ss.Policy.from_dict({"input/p": "e4m3", "input/m": "bf16"})
    table = ss.instrument(step, scalify=False).op_table(*args, **kwargs)
    closed = jax.make_jaxpr(lambda *a: step(*a[:1], *a[1:3], x=a[3]), static_argnums=0)(
        "tag", args[1], args[2], kwargs["x"]
    )
    model = updates.loss_inputs(closed.jaxpr)
    assert model == {0, 2}  # p and x, not m
    held = updates.held_leaves(table, policy, args, model)
    assert [(h.arg, h.leaf, table.ops[h.op].name, h.target) for h in held] == [
        (1, 0, "input/p", "e4m3")
    ]
    out = step(*args, **kwargs)
    names, got = updates.Measure(held)(args, out)
    assert names == [f"{updates.NAME_PREFIX}{held[0].op}/{f}" for f in updates.FIELDS]
    want = _reference(np.asarray(p), np.asarray(out[0]), "e4m3")
    assert np.asarray(got)[:2].tolist() == want[:2] and want[1] > 0
    # the outputs in another order: the weights are the first output of their layout
    names2, got2 = updates.Measure(held)(args, (out[2], out[0], out[1]))
    assert names2 == names and np.asarray(got2).tolist() == np.asarray(got).tolist()
    assert updates.Measure(held)(args, (out[2],)) is None  # not returned: not state
