"""ScaledArray, formats and power-of-two helpers against independent references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import scalescope as ss
from scalescope.core import pow2_round_down, pow2_round_nearest, pow2_round_up


def test_scaled_array_is_a_pytree_with_data_metadata():
    x = ss.ScaledArray(jnp.ones((2, 3), jnp.float16), jnp.float32(4.0))
    leaves, treedef = jax.tree.flatten(x)
    assert len(leaves) == 2
    y = jax.tree.unflatten(treedef, leaves)
    assert isinstance(y, ss.ScaledArray)
    assert x.shape == (2, 3) and x.dtype == np.float16 and x.ndim == 2 and x.size == 6
    assert x.aval.shape == (2, 3) and x.aval.dtype == np.float16
    np.testing.assert_array_equal(np.asarray(x), np.full((2, 3), 4.0, np.float16))
    doubled = jax.jit(lambda a: ss.ScaledArray(a.data, a.scale * 2))(x)
    assert float(doubled.scale) == 8.0


def test_to_array_computes_in_float32_then_casts():
    # data * scale overflows float16 if multiplied in float16 first; the value fits in f32
    x = ss.ScaledArray(jnp.full((2,), 60000.0, jnp.float16), jnp.float32(2.0**-4))
    np.testing.assert_allclose(np.asarray(x.to_array(jnp.float32)), 60000.0 / 16, rtol=1e-3)
    assert x.to_array().dtype == np.float16
    f8 = ss.ScaledArray(jnp.ones((3,), jnp.float8_e4m3fn), jnp.float32(2.0**20))
    assert float(f8.to_array(jnp.float32)[0]) == 2.0**20


def test_as_scaled_array_and_asarray_round_trip_mixed_trees():
    tree = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "n": np.int32(3), "s": "x"}
    scaled = ss.as_scaled_array(tree, scale=2.0**-10)
    assert isinstance(scaled["w"], ss.ScaledArray)
    assert scaled["n"] is tree["n"] and scaled["s"] == "x"
    np.testing.assert_array_equal(np.asarray(scaled["w"].data), tree["w"] * 1024)
    back = ss.asarray(scaled)
    np.testing.assert_array_equal(np.asarray(back["w"]), tree["w"])
    default = ss.as_scaled_array(jnp.ones(3))
    assert float(default.scale) == 1.0


def test_asarray_with_a_dtype_casts_every_array_leaf_as_jnp_asarray_does():
    """As jax-scalify's asarray: an integer array given a float dtype is cast too."""
    out = ss.asarray(np.array([1, 2]), dtype=np.float16)
    assert out.dtype == np.float16
    np.testing.assert_array_equal(np.asarray(out), np.array([1, 2], np.float16))
    tree = {"x": jnp.array([1.0, 2.0]), "y": ss.ScaledArray(jnp.array([3.0, 4.0]), 0.5), "s": "a"}
    back = ss.asarray(tree, dtype=jnp.float16)
    assert back["x"].dtype == back["y"].dtype == np.float16 and back["s"] == "a"
    np.testing.assert_array_equal(np.asarray(back["y"]), np.array([1.5, 2.0], np.float16))


def test_an_integer_scale_is_a_float32_scale_and_astype_keeps_the_value():
    """A scale given as an integer or a Python/float64 number (jax-scalify's tests give
    ``scale=3.0``) is a float32 array of shape (): rules that read the scale as a float32
    array (its dtype, is_finite) work on it."""
    for scale in (2, np.int32(2), np.array(2), jnp.asarray(2), True, 2.0, np.float64(2.0)):
        x = ss.ScaledArray(jnp.array([2.0, np.inf, np.nan]), scale)
        assert x.scale.dtype == np.float32 and x.scale.shape == ()
        assert float(x.scale) == float(scale)
        assert isinstance(x.scale, jax.Array) == isinstance(scale, jax.Array)  # library kept
        got = ss.scalify(jnp.isfinite, normalize=False)(x)
        np.testing.assert_array_equal(np.asarray(got), [True, False, False])
    y = ss.ScaledArray(jnp.array([1.5, -3.0], jnp.float16), 4.0).astype(jnp.float32)
    assert isinstance(y, ss.ScaledArray) and y.dtype == np.float32 and float(y.scale) == 4.0
    np.testing.assert_array_equal(np.asarray(y), np.array([6.0, -12.0], np.float32))


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_as_scaled_array_rejects_bad_scales(bad):
    with pytest.raises(ValueError, match="scale"):
        ss.as_scaled_array(jnp.ones(3), scale=bad)


def test_scale_must_be_scalar():
    with pytest.raises(ValueError, match="scalar"):
        ss.as_scaled_array(jnp.ones(3), scale=jnp.ones(2))


@pytest.mark.parametrize(
    "name,dtype,max_,min_normal,mant",
    [
        ("e4m3", ml_dtypes.float8_e4m3fn, 448.0, 2.0**-6, 3),
        ("e5m2", ml_dtypes.float8_e5m2, 57344.0, 2.0**-14, 2),
        ("fp16", np.float16, 65504.0, 2.0**-14, 10),
        ("bf16", ml_dtypes.bfloat16, float(ml_dtypes.finfo(ml_dtypes.bfloat16).max), 2.0**-126, 7),
        ("fp32", np.float32, float(np.finfo(np.float32).max), 2.0**-126, 23),
    ],
)
def test_formats_match_the_standards(name, dtype, max_, min_normal, mant):
    fmt = ss.formats.get(name)
    assert fmt.dtype == np.dtype(dtype)
    assert fmt.max == max_ and fmt.min_normal == min_normal and fmt.mantissa_bits == mant
    assert fmt.min_subnormal == min_normal * 2.0**-mant
    assert ss.formats.get(np.dtype(dtype)) is fmt


def test_unknown_format_names_the_known_ones():
    with pytest.raises(KeyError, match="e4m3"):
        ss.formats.get("fp7")


def _np_pow2_down(x):
    x = np.abs(x)
    return np.where(x > 0, 2.0 ** np.floor(np.log2(np.where(x > 0, x, 1))), 0.0)


@settings(max_examples=50, deadline=None, derandomize=True)
@given(st.floats(min_value=1e-30, max_value=1e30, allow_nan=False, allow_infinity=False))
def test_pow2_rounding_against_numpy(v):
    x = np.float32(v)
    down = float(pow2_round_down(x))
    up = float(pow2_round_up(x))
    near = float(pow2_round_nearest(x))
    ref_down = float(_np_pow2_down(np.float64(x)))
    assert down == ref_down
    assert up == (ref_down if ref_down == float(x) else 2 * ref_down)
    assert near in (down, up)
    assert abs(np.log2(near) - np.log2(float(x))) <= 0.5 + 1e-6


def test_pow2_rounding_special_values():
    vals = jnp.array([0.0, jnp.inf, -8.0, 3.0], jnp.float32)
    np.testing.assert_array_equal(np.asarray(pow2_round_down(vals)), [0.0, np.inf, 8.0, 2.0])


def test_pow2_reciprocal_and_even_sqrt_are_exact_against_numpy():
    """The bit-level reciprocal and square root of powers of two equal float64's, traced
    and static (NumPy in, NumPy out), over float32's whole normal range."""
    from scalescope.core.pow2 import is_static, pow2_reciprocal, pow2_sqrt_even

    p = np.ldexp(np.float32(1), np.arange(-126, 128)).astype(np.float32)
    ref = (1.0 / p.astype(np.float64)).astype(np.float32)  # 2^-127 is subnormal
    np.testing.assert_array_equal(np.asarray(jax.jit(pow2_reciprocal)(p)), ref)
    even = np.concatenate([np.ldexp(np.float32(1), np.arange(-126, 127, 2)), [0.0]])
    even = even.astype(np.float32)
    ref_sqrt = np.sqrt(even.astype(np.float64)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(pow2_sqrt_even)(even)), ref_sqrt)
    for e in (-126, -3, 0, 5, 127):
        r = pow2_reciprocal(np.float32(2.0**e))
        assert is_static(r) and float(r) == 2.0**-e
    assert is_static(pow2_round_down(3.0)) and float(pow2_round_down(np.float32(3.0))) == 2.0
