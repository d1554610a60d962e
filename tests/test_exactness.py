"""Scale exactness over whole models: scalify gives the plain function's values whatever
the scales, as long as the data stays in range.

Two families of inputs, each float leaf at its own scale 2^k, k in [-40, 40]:

- *same values*: ``as_scaled_array(leaf, scale=2**k)``, so the data is ``leaf / 2**k``
  (far from unit RMS) and the value is the leaf itself; the reference is the plain
  float32 function on the leaves.
- *any magnitude*: data is the leaf (raw) or the leaf at unit RMS, times scale 2^k,
  so the values themselves span 2^±40. The reference is the plain function in float64;
  an example counts where the plain float32 function is finite and accurate there
  (otherwise float32 itself cannot hold the result and there is nothing to match) and
  where the data of every intermediate value stayed within 2^±DATA_RANGE, measured by
  the probe: the guarantee's stated limit. (Static propagation cannot see cancellation:
  a weight 2^33 times its neighbours makes a LayerNorm backward's data drift to 2^-90.)

Wherever the reference holds, the scalified outputs equal it within float32 rounding
(rtol 1e-4, plus 1e-5 of the leaf's largest magnitude for elements that cancel).
More examples: raise ``max_examples`` in `SETTINGS` (each costs a compile).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from exactness_models import MODELS, fori, transformer_params
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from jax import lax

import scalescope as ss

RTOL, ATOL_REL = 1e-4, 1e-5
DATA_RANGE = 60  # data squared stays a normal float32
COMPARED: dict[str, int] = {}  # examples of the any-magnitude family that were compared
K = st.integers(min_value=-40, max_value=40)
SETTINGS = settings(
    max_examples=8,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)


def _is_float(x) -> bool:
    return np.issubdtype(np.asarray(x).dtype, np.floating)


def _float_leaf_count(args) -> int:
    return sum(_is_float(x) for x in jax.tree.leaves(args))


def _map_float_leaves(fn, args, ks, modes=None):
    """Apply ``fn(leaf, k, mode)`` to the float leaves of ``args`` in order."""
    leaves, tree = jax.tree.flatten(args)
    out, i = [], 0
    for leaf in leaves:
        if _is_float(leaf):
            out.append(fn(np.asarray(leaf), ks[i], None if modes is None else modes[i]))
            i += 1
        else:
            out.append(leaf)
    return jax.tree.unflatten(tree, out)


@functools.cache
def _compiled(name: str):
    fn, make = MODELS[name]
    return jax.jit(ss.scalify(fn)), jax.jit(fn), make()


@functools.cache
def _instrumented(name: str):
    return jax.jit(ss.instrument(MODELS[name][0], formats=(), histograms=False))


def _data_in_range(name: str, scaled) -> bool:
    """Whether every recorded value's data abs-max stayed within 2^±DATA_RANGE."""
    _, stats = _instrumented(name)(*scaled)
    absmax = np.asarray(stats["absmax"], np.float64)
    absmax = absmax[np.isfinite(absmax) & (absmax > 0)]
    return absmax.size == 0 or bool(np.all(np.abs(np.log2(absmax)) <= DATA_RANGE))


def _plain64(name: str, args):
    fn, _ = MODELS[name]
    with jax.enable_x64(True):
        args64 = jax.tree.map(lambda x: np.asarray(x, np.float64) if _is_float(x) else x, args)
        out = jax.jit(fn)(*args64)
        return jax.tree.map(lambda x: np.asarray(x, np.float64), out)


def _close(actual, expected, rtol=RTOL) -> list[str]:
    """Names of the output leaves that differ beyond float32 rounding."""
    bad = []
    flat_a, _ = jax.tree_util.tree_flatten_with_path(actual)
    flat_e = jax.tree.leaves(expected)
    for (path, a), e in zip(flat_a, flat_e, strict=True):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        if not np.issubdtype(e.dtype, np.floating):
            if not np.array_equal(a, e):
                bad.append(jax.tree_util.keystr(path))
            continue
        atol = ATOL_REL * float(np.max(np.abs(e), initial=0.0))
        if not (np.all(np.isfinite(a)) and np.allclose(a, e, rtol=rtol, atol=atol)):
            err = np.nanmax(np.abs(a - e) / (np.abs(e) + atol + 1e-300)) if a.size else 0
            bad.append(f"{jax.tree_util.keystr(path)} (max rel err {err:.3g})")
    return bad


def _all_finite(tree) -> bool:
    return all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(tree) if _is_float(x))


def _same_values(name: str, ks):
    scalified, plain, args = _compiled(name)
    scaled = _map_float_leaves(lambda x, k, _: ss.as_scaled_array(x, scale=2.0**k), args, ks)
    expected = plain(*args)
    assert _all_finite(expected)
    got = ss.asarray(scalified(*scaled))
    assert not _close(got, expected), f"{name} at scales 2^{list(ks)}: {_close(got, expected)}"


def _any_magnitude(name: str, ks, modes):
    scalified, plain, args = _compiled(name)

    def data_of(x, mode):
        if mode == "unit":
            rms = float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))
            return (x / 2.0 ** np.floor(np.log2(rms))).astype(np.float32) if rms > 0 else x
        return x

    scaled = _map_float_leaves(
        lambda x, k, m: ss.ScaledArray(jnp.asarray(data_of(x, m)), jnp.float32(2.0**k)),
        args,
        ks,
        modes,
    )
    values = _map_float_leaves(lambda x, k, m: data_of(x, m) * np.float32(2.0**k), args, ks, modes)
    plain32 = plain(*values)
    reference = _plain64(name, values)
    # float32 itself must be able to hold the result, or there is nothing to match
    assume(_all_finite(plain32) and not _close(plain32, reference, rtol=RTOL / 5))
    assume(_data_in_range(name, scaled))
    COMPARED[name] = COMPARED.get(name, 0) + 1
    got = ss.asarray(scalified(*scaled))
    assert not _close(got, plain32), f"{name} at 2^{list(ks)} {list(modes)}: {_close(got, plain32)}"


def _ks(name):
    n = _float_leaf_count(_compiled(name)[2])
    return st.lists(K, min_size=n, max_size=n)


def _near_ks(name):
    """Per-leaf scales 2^(base + offset): base in [-40, 40], offsets in [-3, 3]. Fully
    independent 2^±40 per leaf makes float32 itself lose the values (g**2 of a weight
    2^40 times its neighbours), leaving nothing to compare."""
    n = _float_leaf_count(_compiled(name)[2])
    offsets = st.lists(st.integers(-3, 3), min_size=n, max_size=n)
    return st.builds(lambda base, off: [base + o for o in off], K, offsets)


def _modes(name):
    n = _float_leaf_count(_compiled(name)[2])
    return st.lists(st.sampled_from(["raw", "unit"]), min_size=n, max_size=n)


def _uniform(name, k):
    return [k] * _float_leaf_count(_compiled(name)[2])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_same_values_at_every_scale(name):
    @SETTINGS
    @given(ks=_ks(name))
    @example(ks=_uniform(name, -12))
    @example(ks=_uniform(name, -24))
    @example(ks=_uniform(name, 20))
    @example(ks=_uniform(name, 40))
    @example(ks=_uniform(name, -40))
    def check(ks):
        _same_values(name, ks)

    check()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_any_magnitude_matches_plain_where_float32_holds(name):
    n = _float_leaf_count(_compiled(name)[2])

    @settings(SETTINGS, max_examples=10, suppress_health_check=list(HealthCheck))
    @given(ks=_near_ks(name), modes=_modes(name))
    @example(ks=[0] * n, modes=["raw"] * n)
    @example(ks=[-40] * n, modes=["unit"] * n)
    def check(ks, modes):
        _any_magnitude(name, ks, modes)

    COMPARED[name] = 0
    check()
    # never vacuous: most draws hold, the filters only drop what float32 cannot
    assert COMPARED[name] >= 3, f"{name}: only {COMPARED[name]} examples were comparable"


# -- the failures that were reported, as regression tests ------------------------------


@pytest.mark.parametrize("k", [-12, -24, 20])
def test_reported_adamw_and_loss_at_extreme_scales(k):
    _same_values("adamw_step", _uniform("adamw_step", k))
    _same_values("transformer_loss", _uniform("transformer_loss", k))


def test_reported_fori_loop_at_scale_2_20():
    x = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32) * 0.3
    f = lambda x: fori({"c": x})  # noqa: E731
    out = ss.asarray(jax.jit(ss.scalify(f))(ss.as_scaled_array(jnp.asarray(x), scale=2.0**20)))
    np.testing.assert_allclose(np.asarray(out), np.asarray(f(x)), rtol=1e-5, atol=1e-6)


def test_adamw_keeps_the_scale_invariant_under_check_mode():
    """k = -12 used to give g**2 with scale 0 and data up to 3.4e38."""
    _, _, args = _compiled("adamw_step")
    scaled = _map_float_leaves(
        lambda x, k, _: ss.as_scaled_array(x, scale=2.0**k), args, _uniform("adamw_step", -12)
    )
    out = jax.jit(ss.scalify(MODELS["adamw_step"][0], check=True))(*scaled)
    assert _all_finite(ss.asarray(out))


def _negate_scale(x):  # a rule bug: the scale comes out negative, the data unchanged
    # (built as rules build theirs, unchecked: the public constructor refuses a negative
    # scale it can read, and under jit it reads none)
    return ss.ScaledArray.trusted(-x.data, -x.scale) if isinstance(x, ss.ScaledArray) else -x


def _neg_twice(a):
    return lax.neg(lax.neg(a)) * 3.0


@pytest.mark.parametrize("jitted", [False, True])
def test_check_mode_raises_on_a_broken_rule_and_names_it(monkeypatch, jitted):
    """What makes the AdamW test above mean something: with a rule that breaks the
    invariant, check mode raises naming the primitive and the source line (eagerly, and
    through the host callback under jit); without check mode the same step runs."""
    from scalescope.scalify import registry

    monkeypatch.setitem(registry.RULES, "neg", registry.Rule(_negate_scale))
    x = ss.as_scaled_array(jnp.linspace(1.0, 2.0, 8), scale=1.0)
    unchecked = ss.scalify(_neg_twice, check=False)
    checked = ss.scalify(_neg_twice, check=True)
    if jitted:
        unchecked, checked = jax.jit(unchecked), jax.jit(checked)
    np.testing.assert_allclose(ss.asarray(unchecked(x)), 3.0 * np.linspace(1.0, 2.0, 8))
    with pytest.raises(Exception) as info:
        jax.block_until_ready(checked(x))
    msg = str(info.value)
    assert "scalify check: 'neg'" in msg and "a negative scale (-1.0)" in msg, msg
    assert "test_exactness.py" in msg, msg


def test_normalize_moves_far_data_into_the_scale_and_keeps_near_data():
    params = transformer_params()
    far = ss.as_scaled_array(params["wq"], scale=2.0**-30)  # data = wq * 2**30
    near = ss.as_scaled_array(params["wq"], scale=2.0**-3)
    from scalescope.scalify import normalize_input

    nf, nn = normalize_input(far), normalize_input(near)
    assert 1.0 <= float(np.max(np.abs(np.asarray(nf.data)))) < 2.0
    np.testing.assert_array_equal(np.asarray(nf.to_array()), np.asarray(far.to_array()))
    np.testing.assert_array_equal(np.asarray(nn.data), np.asarray(near.data))  # untouched
    assert float(nn.scale) == 2.0**-3
    # FP8 data is the user's representation: never normalised
    fp8 = ss.ScaledArray(jnp.asarray(params["wq"] * 200, jnp.float8_e4m3fn), jnp.float32(1))
    n8 = normalize_input(fp8)
    assert n8.data is fp8.data and float(n8.scale) == 1.0
    # normalize=False: the data reaches the rules as passed
    out = ss.scalify(lambda a: a * 1.0, normalize=False)(far)
    np.testing.assert_array_equal(np.asarray(out.data), np.asarray(far.data))


@pytest.mark.parametrize("k", [-50, 17, 50])
def test_all_zero_inputs_get_scale_zero_and_leave_sums_alone(k):
    """A zero-initialised bias passed at scale 2^k: its scale must not become the scale
    of every sum it joins (the data would be 2^k times too small, and a LayerNorm
    backward through it underflowed to zero: issue found on a Flax decoder LM)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(4, 16)), jnp.float32)
    w = jnp.asarray(0.3 * rng.normal(size=(16, 16)), jnp.float32)
    t = jnp.asarray(rng.normal(size=(4, 16)), jnp.float32)

    def layer_norm(h):
        c = h - h.mean(-1, keepdims=True)
        return c * lax.rsqrt((c**2).mean(-1, keepdims=True) + 1e-6)

    grad = jax.grad(lambda w, b: jnp.sum(layer_norm(x @ w + b) * t), argnums=(0, 1))
    expected = grad(w, jnp.zeros(16))
    zero_bias = ss.as_scaled_array(jnp.zeros(16), scale=2.0**k)
    got = ss.asarray(jax.jit(ss.scalify(grad))(ss.as_scaled_array(w), zero_bias))
    for g, e in zip(got, expected):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-6)

    from scalescope.scalify import normalize_input

    for dtype in (jnp.float32, jnp.float16, jnp.float8_e4m3fn):
        z = normalize_input(ss.as_scaled_array(jnp.zeros(4, dtype), scale=2.0**k))
        assert float(z.scale) == 0.0, dtype
    # an additive mask (0 and -inf) has no finite non-zero element but is not zero
    mask = jnp.where(jnp.tril(jnp.ones((4, 4))) > 0, 0.0, -jnp.inf)
    m = normalize_input(ss.as_scaled_array(mask, scale=2.0**k))
    np.testing.assert_array_equal(np.asarray(m.to_array()), np.asarray(mask))
    # a NaN scale stays NaN (the value is NaN)
    nan = normalize_input(ss.ScaledArray(jnp.zeros(4), jnp.float32(np.nan)))
    assert np.isnan(float(nan.scale))
