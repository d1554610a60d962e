"""Block-scaled recipes (docs/probe.md, "Block-scaled recipes"): the independent reference
on cases worked out by hand, then the probe's recipe statistics (both kernels) against
the reference."""

from __future__ import annotations

import functools
import math
from fractions import Fraction

import jax
import ml_dtypes
import numpy as np
import pytest
from recipe_reference import (
    E2M1,
    E4M3,
    E5M2,
    RECIPES,
    STATS,
    blocks,
    f32_round,
    q_exact,
    q_f64,
    recipe_stats,
)

import scalescope as ss
from scalescope.probe import native

F32 = np.float32
ELEMS = {"e4m3": (E4M3, ml_dtypes.float8_e4m3fn), "e5m2": (E5M2, ml_dtypes.float8_e5m2)}
ELEMS["e2m1"] = (E2M1, ml_dtypes.float4_e2m1fn)
UP_448 = float(np.nextafter(F32(448), F32(np.inf)))  # 448 + 2**-15


def _grid(dtype) -> np.ndarray:
    """Every finite non-negative value of a narrow format (ml_dtypes' own list)."""
    bits = np.arange(256 if np.dtype(dtype).itemsize == 1 else 0, dtype=np.uint8)
    v = bits.view(dtype).astype(np.float64)
    return np.unique(v[np.isfinite(v) & (v >= 0)])


def _ties_and_neighbours(dtype) -> np.ndarray:
    """Midpoints of neighbouring grid values, one float32 ulp either side, the grid itself
    and a few values past the max (all float32, both signs)."""
    g = _grid(dtype)
    mid = ((g[:-1] + g[1:]) / 2).astype(F32)  # exact in float32
    past = F32(g[-1]) * F32([1.0001, 1.07, 1.2, 3.0])
    v = np.concatenate([mid, np.nextafter(mid, F32(0)), np.nextafter(mid, F32(np.inf))])
    v = np.concatenate([v, g.astype(F32), past, [np.nextafter(F32(g[-1]), F32(np.inf))]])
    return np.concatenate([v, -v]).astype(F32)


def _stats(d, recipe, axis=-1):
    return recipe_stats(np.asarray(d, F32), recipe, axis)


# -- the reference on its own --------------------------------------------------------------


def test_element_grids_are_ml_dtypes_grids():
    """The element formats' parameters give exactly ml_dtypes' grids."""
    for name, (fmt, dtype) in ELEMS.items():
        info = ml_dtypes.finfo(dtype)
        assert fmt.max == float(info.max), name
        assert 2.0**fmt.emin == float(info.smallest_normal), name
        assert 2.0 ** (fmt.emin - fmt.mant) == float(info.smallest_subnormal), name
        assert fmt.mant == int(info.nmant), name
    assert list(_grid(ml_dtypes.float4_e2m1fn)) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]


@pytest.mark.parametrize("name", list(ELEMS))
def test_rounding_matches_ml_dtypes_and_rationals(name):
    """q_f64 (vectorised) == q_exact (rationals) == ml_dtypes' cast of float32 values
    (clipped to the max first: ml_dtypes overflows to NaN/inf, the recipes saturate)."""
    fmt, dtype = ELEMS[name]
    v = _ties_and_neighbours(dtype)
    rng = np.random.default_rng(0)
    v = np.concatenate([v, (rng.normal(size=500) * fmt.max / 4).astype(F32)])
    cast = np.clip(v, -fmt.max, fmt.max).astype(dtype).astype(np.float64)
    fast = q_f64(v.astype(np.float64), fmt)
    exact = np.array([float(q_exact(Fraction(float(x)), fmt)) for x in v])
    np.testing.assert_array_equal(fast, cast)
    np.testing.assert_array_equal(exact, cast)


@pytest.mark.parametrize("name", list(ELEMS))
def test_the_xla_kernels_element_rounding_matches_ml_dtypes(name):
    """The XLA kernel's element cast, compiled, rounds ties, their float32 neighbours and
    the max like ml_dtypes (E2M1 is rounded in arithmetic: XLA's elemental CPU emitter
    rounds 5.0002 to 4)."""
    from scalescope.core import formats as F
    from scalescope.core import recipes as R
    from scalescope.probe.recipe_kernel import _cast

    fmt, dtype = ELEMS[name]
    el = R.E2M1 if name == "e2m1" else F.get(name)
    v = np.abs(_ties_and_neighbours(dtype))
    v = np.concatenate([v, F32(fmt.max) * F32([0.99, 1.0, 1.01, 3.0])])
    want = np.minimum(v, F32(fmt.max)).astype(dtype).astype(F32)
    got = np.asarray(jax.jit(lambda x: _cast(x, el))(v))
    np.testing.assert_array_equal(got, want)


def test_rounding_of_rationals_ties_to_even():
    assert q_exact(Fraction(17, 16), E4M3) == 1  # 1 + ulp/2: tie, 1 is even
    assert q_exact(Fraction(19, 16), E4M3) == Fraction(5, 4)  # tie between 9/8 and 5/4
    assert q_exact(Fraction(1, 1024), E4M3) == 0  # half the smallest subnormal
    assert q_exact(Fraction(1025, 1024 * 1024), E4M3) == Fraction(1, 512)
    assert q_exact(Fraction(1, 3), E4M3) == Fraction(11, 32)  # 0.333.. -> 0.34375
    assert q_exact(Fraction(-(10**6)), E4M3) == -448 and q_exact(Fraction(470), E4M3) == 448
    assert q_exact(Fraction(10**9), E5M2) == 57344


def test_e2m1_ties():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert [float(q_exact(Fraction(t), E2M1)) for t in ties] == want
    assert list(q_f64(np.array(ties), E2M1)) == want
    assert float(q_exact(Fraction(-5), E2M1)) == -4.0
    assert float(q_exact(Fraction(7), E2M1)) == 6.0


def test_float32_rounding_of_quotients():
    """f32_round(a/b) is the correctly rounded float32 (float64 division then float32 is
    too, for float32 operands: double rounding is innocuous for a quotient)."""
    rng = np.random.default_rng(1)
    a = rng.uniform(1, 3000, 300).astype(F32)
    b = (rng.normal(size=300) * np.exp2(rng.integers(-60, 60, 300))).astype(F32)
    b = np.abs(b[b != 0])
    for x, y in zip(a, b):
        want = float(F32(np.float64(x) / np.float64(y)))
        assert f32_round(Fraction(float(x)) / Fraction(float(y))) == want
    assert f32_round(Fraction(448, 449)) == 8369925 / 2**23
    assert f32_round(Fraction(448) / Fraction(UP_448)) == 1 - 2**-24
    assert f32_round(Fraction(10) ** 40) == math.inf


def test_block_layout():
    def sizes(shape, recipe, axis=-1):
        return [b.size for b in blocks(shape, recipe, axis)]

    assert sizes((3, 100), "mxfp8_e4m3") == [32, 32, 32, 4] * 3
    assert sizes((7, 33), "nvfp4") == [16, 16, 1] * 7
    assert sizes((7, 33), "fp8_block128") == [33] * 7
    assert sizes((7, 33), "e4m3_tensor") == [231]
    assert sizes((), "mxfp4") == [1] and sizes((), "fp8_block128x128") == [1]
    assert sizes((300,), "fp8_block128x128") == [128, 128, 44]
    big = [128 * 128, 128 * 128, 128 * 4, 2 * 128, 2 * 128, 2 * 4] * 2
    assert sizes((2, 130, 260), "fp8_block128x128") == big
    # Along axis 0 of a [k, n] operand: blocks are runs of k in one column.
    (first, *_) = blocks((64, 3), "mxfp8_e4m3", axis=0)
    np.testing.assert_array_equal(first, np.arange(32) * 3)
    assert sizes((64, 3), "mxfp8_e4m3", axis=0) == [32] * 6
    # 128x128 tiles of w [k=256, n=8] along k: (n, k) tiles of 8 x 128.
    tiles = blocks((256, 8), "fp8_block128x128", axis=0)
    assert [t.size for t in tiles] == [1024, 1024]
    np.testing.assert_array_equal(np.sort(tiles[1]), np.arange(128 * 8, 256 * 8))


def test_e4m3_tensor_at_the_max():
    """amax 448: s = 1, elements on the grid are exact."""
    r = _stats([448.0, 1.0, 0.5, -3.0], "e4m3_tensor")
    assert r == {
        "underflow": 0.0,
        "overflow": 0.0,
        "snr": math.inf,
        "block_flush": 0.0,
        "scale_log2_min": 0.0,
        "scale_log2_max": 0.0,
    }


def test_e4m3_tensor_just_above_the_max():
    """amax 449: s = f32(448/449) = 8369925 * 2**-23 rounds down, 449 * s = 448 - 59 * 2**-23:
    not clipped. amax 448 + 2**-15 (the next float32): s = 1 - 2**-24 rounds up,
    d * s = 448 + (2**21 - 1) * 2**-39 > 448: clipped (counted as overflow) although it
    quantises to 448 / s, within 4e-6 of d."""
    s = Fraction(8369925, 2**23)
    assert Fraction(449) * s == 448 - Fraction(59, 2**23)
    r = _stats([449.0, 1.0], "e4m3_tensor")
    assert r["overflow"] == 0.0 and r["underflow"] == 0.0 and r["block_flush"] == 0.0
    assert r["scale_log2_min"] == r["scale_log2_max"] == -math.log2(8369925 / 2**23)
    # Both elements land on the grid: 448 and 1 (0.9977.. rounds to 1).
    err2 = (449 - 448 / s) ** 2 + (1 - 1 / s) ** 2
    sig = 449**2 + 1
    assert r["snr"] == pytest.approx(10 * math.log10(sig / err2), rel=1e-12)

    s = Fraction(2**24 - 1, 2**24)
    assert Fraction(UP_448) * s == 448 + Fraction(2**21 - 1, 2**39)
    r = _stats([UP_448, 1.0], "e4m3_tensor")
    assert r["overflow"] == 0.5 and r["underflow"] == 0.0
    assert r["scale_log2_min"] == -math.log2(1 - 2**-24)
    err2 = (Fraction(UP_448) - 448 / s) ** 2 + (1 - 1 / s) ** 2
    assert r["snr"] == pytest.approx(10 * math.log10((UP_448**2 + 1) / err2), rel=1e-12)


def test_mx_floor_clips_and_rceil_does_not():
    """amax 511: floor(log2 511) = 8, E4M3 (emax 8) scale 2**0: 449, 480 and 511 clip to
    448. RCEIL: 2**ceil(log2(511/448)) = 2, nothing clips (511/2 = 255.5 -> 256 -> 512)."""
    d = np.zeros(40, F32)  # a block of 32 and a partial block of 8 zeros
    d[:6] = [511.0, 480.0, 449.0, 448.0, 1.0, -(2.0**-9)]
    r = _stats(d, "mxfp8_e4m3")
    assert r["overflow"] == 3 / 40 and r["underflow"] == 0.0
    assert r["scale_log2_min"] == r["scale_log2_max"] == 0.0
    err2 = 63**2 + 32**2 + 1**2
    sig = 511**2 + 480**2 + 449**2 + 448**2 + 1 + 2.0**-18
    assert r["snr"] == pytest.approx(10 * math.log10(sig / err2), rel=1e-12)
    assert r["block_flush"] == 0.0

    for recipe in ("mxfp8_e4m3_rceil", "fp8_block128"):
        r = _stats(d, recipe)
        assert r["overflow"] == 0.0, recipe
        assert r["scale_log2_min"] == r["scale_log2_max"] == 1.0, recipe
        # X = 2: 255.5 -> 256 (err 1), 240 exact, 224.5 -> 224 (err 1), 224, 0.5, -2**-10 -> 0
        assert r["underflow"] == 1 / 40, recipe
        err2 = 1 + 1 + 2.0**-18
        assert r["snr"] == pytest.approx(10 * math.log10(sig / err2), rel=1e-12)

    # E5M2 (emax 15): X = 2**-7, 511, 480 and 449 times 128 exceed 57344 (448 * 128 is
    # the max); E2M1 (emax 2): X = 64, 511, 480, 449 and 448 all exceed 6 * 64 = 384.
    assert _stats(d, "mxfp8_e5m2")["overflow"] == 3 / 40
    r = _stats(d, "mxfp4")
    assert r["overflow"] == 4 / 40 and r["scale_log2_max"] == 6.0
    # 1 / 64 and 2**-9 / 64 are below 0.25 (half the smallest E2M1 subnormal 0.5).
    assert r["underflow"] == 2 / 40


def test_mxfp4_element_ties():
    """Block amax 6: E = floor(log2 6) - 2 = 0, X = 1; every E2M1 tie rounds to even."""
    d = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5]
    r = _stats(d, "mxfp4")
    assert r["underflow"] == 2 / 10  # 0.25 and -0.25
    assert r["overflow"] == 0.0 and r["block_flush"] == 0.0
    assert r["scale_log2_min"] == r["scale_log2_max"] == 0.0
    err2 = 5 * 0.25**2 + 2 * 0.5**2 + 0.5**2 + 1.0  # 0.25s; 2.5s; 3.5; 5
    sig = sum(x * x for x in d)
    assert err2 == 2.0625 and sig == 91.0625
    assert r["snr"] == 10 * math.log10(sig / err2)


def test_nvfp4_block_scale_rounding_to_zero_flushes_the_block():
    """amax 2688 = 448 * 6: S_enc = 1. Block 0: s_b = 448. Block 1 (amax 0.005):
    0.005 / 6 < 2**-10 (half E4M3's smallest subnormal), s_b = 0, the block flushes.
    Block 2 (amax 6 * 2**-10): a tie, s_b rounds to even 0, flushes. Block 3 (amax the
    next float32 up): s_b = 2**-9, its element is 3 * 2**-9 (within 1e-9)."""
    above = float(np.nextafter(F32(6 * 2**-10), F32(1)))
    d = np.zeros(64, F32)
    d[0] = 2688.0
    d[16:18] = [0.005, -0.003]
    d[32] = 6 * 2**-10
    d[48] = above
    r = _stats(d, "nvfp4")
    assert r["block_flush"] == 2 / 4  # blocks 1 and 2 flush, 0 and 3 keep their element
    assert r["underflow"] == 3 / 64 and r["overflow"] == 0.0
    assert r["scale_log2_min"] == -9.0 and r["scale_log2_max"] == math.log2(448)
    flushed = float(F32(0.005)) ** 2 + float(F32(0.003)) ** 2 + (6 * 2**-10) ** 2
    err2 = flushed + (above - 3 * 2**-9) ** 2  # one float32 ulp of 6 * 2**-10
    sig = 2688.0**2 + flushed + above**2
    assert r["snr"] == pytest.approx(10 * math.log10(sig / err2), rel=1e-12)
    # The same data in MX keeps every block (power-of-two scales never flush a block).
    assert _stats(d, "mxfp8_e4m3")["block_flush"] == 0.0


def test_nvfp4_rounded_block_scale_can_clip():
    """S_enc = 2688 / 2688 = 1, one element per block of 16. Amax 6.3: s_b =
    RN_e4m3(1.05) = 1 (ulp 0.125), 6.3 > 6 clips to 6. Amax 13: s_b = RN(2.1667) = 2.25
    (ulp 0.25), 13 / 2.25 = 5.78 -> 6, q = 13.5, no clip. Amax 12.4: s_b = RN(2.0667) = 2,
    12.4 / 2 = 6.2 clips, q = 12."""
    d = np.zeros(64, F32)
    d[[0, 16, 32, 48]] = [2688.0, 6.3, 13.0, 12.4]
    r = _stats(d, "nvfp4")
    assert r["overflow"] == 2 / 64 and r["underflow"] == 0.0 and r["block_flush"] == 0.0
    assert r["scale_log2_min"] == 0.0 and r["scale_log2_max"] == math.log2(448)
    a, b = float(F32(6.3)), float(F32(12.4))
    sig = 2688.0**2 + a**2 + 13.0**2 + b**2
    err2 = (a - 6.0) ** 2 + (13.0 - 13.5) ** 2 + (b - 12.0) ** 2
    assert r["snr"] == pytest.approx(10 * math.log10(sig / err2), rel=1e-12)
    # Block scales log2(2.25) and 1 lie between.
    r = _stats(d[16:], "nvfp4")  # amax 13: S_enc = f32(2688 / 13), block scales differ
    assert r["scale_log2_max"] > r["scale_log2_min"]


def test_zero_blocks_partial_blocks_and_specials():
    # Row 0 all zero (two blocks); row 1: a block of ones, a partial block of 8 zeros.
    d = np.zeros((2, 40), F32)
    d[1, :32] = 1.0
    r = _stats(d, "mxfp8_e4m3")
    assert r["block_flush"] == 0.0 and r["underflow"] == 0.0 and r["overflow"] == 0.0
    assert r["scale_log2_min"] == r["scale_log2_max"] == -8.0  # floor(log2 1) - 8
    assert r["snr"] == math.inf

    # A partial trailing block has its own scale: 2**-17 survives next to 1 (X = 2**-8,
    # 2**-17 / X = 2**-9, the smallest subnormal) but not next to 300 (X = 1).
    d = np.zeros(40, F32)
    d[[0, 1, 32, 33]] = [1.0, 2.0**-17, 300.0, 2.0**-17]
    r = _stats(d, "mxfp8_e4m3")
    assert r["underflow"] == 1 / 40
    assert (r["scale_log2_min"], r["scale_log2_max"]) == (-8.0, 0.0)
    sig, err2 = 1 + 300.0**2 + 2 * 2.0**-34, 12.0**2 + 2.0**-34  # 300 -> 288 (ulp 32)
    assert r["snr"] == pytest.approx(10 * math.log10(sig / err2), rel=1e-12)
    assert _stats(d.reshape(1, 40), "mxfp8_e4m3", axis=-1) == r
    assert _stats(d.reshape(2, 20), "mxfp8_e4m3", axis=0)["underflow"] == 0.0  # pairs
    assert _stats(d, "fp8_block128")["underflow"] == 2 / 40  # one block of 40: X = 1

    # -0 is zero, NaN is neither under- nor overflow, each inf overflows.
    d = [-0.0, np.nan, np.inf, -np.inf, 1.0, 2.0**-40]
    # amax 1: 1 is exact under every recipe, 2**-40 underflows under every recipe (the
    # smallest: MX E5M2, 2**-40 / 2**-15 = 2**-25 < 2**-17).
    for recipe in RECIPES:
        r = _stats(d, recipe)
        assert r["overflow"] == 2 / 6, recipe
        assert r["underflow"] == 1 / 6, recipe
        assert r["block_flush"] == 0.0, recipe
        assert r["snr"] == 10 * math.log10((1 + 2.0**-80) / 2.0**-80), recipe
    assert _stats(d, "mxfp8_e4m3")["scale_log2_min"] == -8.0
    assert _stats(d, "mxfp4")["scale_log2_min"] == -2.0
    assert _stats(d, "fp8_block128")["scale_log2_min"] == -8.0  # 448 / 1 -> 256
    assert _stats(d, "e4m3_tensor")["scale_log2_min"] == -math.log2(448)
    assert _stats(d, "nvfp4")["scale_log2_min"] == math.log2(448) - math.log2(2688)


def test_all_zero_all_nan_and_float32_subnormals():
    for recipe in RECIPES:
        r = _stats(np.zeros((3, 5)), recipe)
        assert r["underflow"] == r["overflow"] == r["block_flush"] == 0.0
        assert r["snr"] == math.inf
        assert math.isnan(r["scale_log2_min"]) and math.isnan(r["scale_log2_max"])
        r = _stats([np.nan, np.nan], recipe)
        assert r["underflow"] == r["overflow"] == r["block_flush"] == 0.0
        assert math.isnan(r["snr"]) and math.isnan(r["scale_log2_max"])
        # A float32 subnormal counts as zero: no underflow, no scale.
        r = _stats([1e-40, 0.0], recipe)
        assert r["underflow"] == 0.0 and math.isnan(r["scale_log2_min"]), recipe


def test_scalar_and_one_element_blocks():
    """A 0-d value is one block: its single element maps to the top of the grid."""
    r = _stats(np.float32(2.5), "mxfp8_e4m3")  # E = 1 - 8: 2.5 * 128 = 320 on the grid
    assert r["scale_log2_min"] == -7.0 and r["snr"] == math.inf
    r = _stats(np.float32(2.5), "fp8_block128")  # 448 / 2.5 = 179.2 -> 128: X = 2**-7
    assert r["scale_log2_min"] == -7.0 and r["snr"] == math.inf
    r = _stats(np.float32(2.5), "mxfp4")  # X = 2**-1: 5 -> 4 (tie to even)
    assert r["scale_log2_min"] == -1.0 and r["snr"] == 10 * math.log10(6.25 / 0.25)
    # nvfp4: S_enc = f32(1075.2) = 1075 + 1638 * 2**-13 < 1075.2, s_b = RN(448 - 1e-5)
    # = 448, 2.5 * S_enc / 448 just below 6: no clip, q = 2688 / S_enc.
    s_enc = 1075 + 1638 * 2**-13
    assert f32_round(Fraction(2688) / Fraction(5, 2)) == s_enc
    r = _stats(np.float32(2.5), "nvfp4")
    assert r["overflow"] == 0.0 and r["underflow"] == 0.0
    assert r["scale_log2_min"] == math.log2(448) - math.log2(s_enc)
    err = Fraction(5, 2) - Fraction(2688) / Fraction(s_enc)
    assert r["snr"] == pytest.approx(10 * math.log10(6.25 / float(err) ** 2), rel=1e-9)


def test_fp8_block128_equals_rceil_on_one_block():
    """Two spellings of one rule: the largest E with amax * 2**E <= 448 is
    -ceil(log2(amax / 448)); on rows of 32 (one block for both) the statistics agree."""
    rng = np.random.default_rng(2)
    d = (rng.normal(size=(9, 32)) * np.exp2(rng.integers(-30, 30, (9, 1)))).astype(F32)
    d[:6] = rng.uniform(-0.01, 0.01, (6, 32))
    d[:6, 0] = [448.0, UP_448, 224.0, 449.0, 2.0**-120, 3e38]
    d[4, 1:] = 0.0  # amax 2**-120: 2**128 * amax <= 448, E capped at 127
    for row in d:
        a, b = _stats(row, "fp8_block128"), _stats(row, "mxfp8_e4m3_rceil")
        assert a == b
        amax = float(np.abs(row).max())
        assert a["scale_log2_max"] == math.ceil(math.log2(amax / 448)) or amax < 2.0**-100
    assert [_stats(row, "fp8_block128")["scale_log2_max"] for row in d[:4]] == [0, 1, -1, 1]
    assert _stats(d[4], "fp8_block128")["scale_log2_max"] == -127  # E capped at 127


# -- the probe against the reference ---------------------------------------------------------


def _tie_rows(dtype, scale: float) -> np.ndarray:
    """Ties of an element grid times ``scale``, 15 a row after the value 448: every block
    along the last axis (16 or 32, or the 16 of a row) has amax 448 and the scale that
    maps the grid onto the values."""
    v = _ties_and_neighbours(dtype).astype(np.float64) * scale
    v = v[(np.abs(v) < 448) & ((v == 0) | (np.abs(v) >= np.finfo(F32).tiny))].astype(F32)
    v = np.concatenate([v, np.zeros(-v.size % 15, F32)]).reshape(-1, 15)
    return np.concatenate([np.full((v.shape[0], 1), 448.0, F32), v], axis=1)


def _probe_data() -> dict[str, np.ndarray]:
    """Few values (the XLA kernel compiles each): random data of several scales and
    shapes, and the hand-worked cases, rows of one value where the rows' blocks keep
    them apart."""
    rng = np.random.default_rng(10)
    band = np.exp2(rng.integers(-8, 9, size=(2, 130, 1)))
    rows40 = np.zeros((5, 40))
    rows40[0, :6] = [511.0, 480.0, 449.0, 448.0, 1.0, -(2.0**-9)]  # MX FLOOR clips
    rows40[1, :10] = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5]  # E2M1 ties
    rows40[3, :32] = 1.0  # row 2 all zero, row 3 a block of ones and 8 zeros
    rows40[4, [0, 1, 32, 33]] = [1.0, 2.0**-17, 300.0, 2.0**-17]  # a partial block
    nv = np.zeros((2, 64))  # S_enc = 1
    nv[0, [0, 16, 17, 32, 48]] = [2688.0, 0.005, -0.003, 6 * 2**-10, 0.0]
    nv[0, 48] = float(np.nextafter(F32(6 * 2**-10), F32(1)))  # block scales flush
    nv[1, [0, 16, 32, 48]] = [2688.0, 6.3, 13.0, 12.4]  # rounded block scales clip
    # NVFP4 element ties and their float32 neighbours: S_enc = 1, block scales 1 and 1.5.
    up_, down_ = (
        (lambda v: float(np.nextafter(F32(v), F32(9)))),
        (lambda v: float(np.nextafter(F32(v), F32(0)))),
    )
    nv_ties = np.zeros((2, 32))
    nv_ties[0, 0] = 2688.0
    nv_ties[0, 16:32] = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0,
                         up_(0.25), down_(0.75), up_(1.25), down_(1.75),
                         up_(2.5), down_(3.5), up_(5.0), down_(5.0)]  # fmt: skip
    nv_ties[1, 0:16] = [9.0, 0.375, 1.125, 1.875, 2.625, 3.75, 5.25, 7.5,
                        down_(0.375), up_(1.125), down_(1.875), up_(2.625),
                        down_(3.75), up_(5.25), down_(7.5), up_(7.5)]  # fmt: skip
    nv_ties[1, 16:20] = [6.0, down_(6.0), 5.5, -up_(0.25)]
    ties = [
        _tie_rows(ml_dtypes.float8_e4m3fn, 1.0),  # X = 1 (the E4M3 recipes)
        _tie_rows(ml_dtypes.float8_e5m2, 2.0**-7),  # X = 2**-7 (mxfp8_e5m2)
        _tie_rows(ml_dtypes.float4_e2m1fn, 64.0),  # X = 64 (mxfp4)
    ]
    d = {
        "normal_1e-3": rng.normal(size=(3, 100)) * 1e-3,
        "normal_1": rng.normal(size=(3, 100)),
        "normal_1e3": rng.normal(size=(3, 100)) * 1e3,
        "heavy": rng.standard_t(1.5, size=(7, 33)),
        "wide": rng.normal(size=(7, 33)) * np.exp2(rng.uniform(-24, 24, (7, 33))),
        "tiles": rng.normal(size=(2, 130, 260)) * band,
        "scalar": np.float32(2.5),
        "vector": rng.normal(size=45) * 7,
        "amax_448": np.array([448.0, 1.0, 0.5, -3.0]),
        "amax_449": np.array([449.0, 1.0, 300.0, -0.01]),
        "amax_448_up": np.array([UP_448, 1.0, -UP_448, 2.0**-12]),
        "rows40": rows40,
        "ties": np.concatenate(ties),
        "nv_ties": nv_ties,
        "nvfp4": nv,
        "specials": np.array([-0.0, np.nan, np.inf, -np.inf, 1.0, 2.0**-40]),
        # abs-max below 448 / f32max: the tensor factors clamp to float32's max
        "tiny": rng.normal(size=(2, 32)) * 2e-38 + np.eye(2, 32) * 1e-37,
        "tiny_edge": np.array([448 / float(np.finfo(F32).max), -3e-37, 1e-38, 2.0**-126]),
        # abs-max of 2**127 or more: 1 / amax and 2**-127 are no normal float32 (the
        # XLA kernel read every element as clipped here)
        "huge": np.array([2e38, 1e38, -1.5e38, 3e37, 1.0, -7e36]),
        "near_max": np.array([3.4e38, -3e38, 1e30, 2.0**127]),
        "all_zero": np.zeros(5),
        "all_nan": np.full(3, np.nan),
    }
    return {k: np.asarray(v, F32) for k, v in d.items()}


DATA = _probe_data()
_REF: dict[tuple, dict] = {}


def _ref(name: str, recipe: str, axis: int = -1) -> dict:
    key = (name, recipe, axis)
    if key not in _REF:
        _REF[key] = recipe_stats(DATA[name], recipe, axis)
    return _REF[key]


def _use_kernel(mp: pytest.MonkeyPatch, which: str) -> None:
    if which == "native":
        if jax.default_backend() != "cpu":
            pytest.skip("the native kernel is the CPU path")
        mp.setenv("SCALESCOPE_PROBE_KERNEL", "native")
        if not native.available():
            pytest.fail("native kernel unavailable")
    else:
        mp.setenv("SCALESCOPE_PROBE_KERNEL", "xla")


def _rows(inst, stats, *args) -> dict[str, dict[str, np.ndarray]]:
    """Each input's statistics, by input name (``input/...`` rows)."""
    table = inst.op_table(*args)
    rows = {op.name: table.rows(op) for op in table if op.primitive == "input"}
    return {k: {s: np.squeeze(np.asarray(v)[r]) for s, v in stats.items()} for k, r in rows.items()}


FORMATS = ("e4m3", *RECIPES)
#: Above this SNR the quantisation error is within a few float32 ulps of each element.
SNR_EXACT_DB = 100.0


@pytest.fixture(scope="module", params=["native", "xla"])
def probed(request):
    """The probe's statistics of every DATA value, one instrument call per kernel."""
    with pytest.MonkeyPatch.context() as mp:
        _use_kernel(mp, request.param)
        inst = ss.instrument(lambda xs: xs, scalify=False, formats=FORMATS)
        _, stats = jax.jit(inst)(DATA)
        got = _rows(inst, stats, DATA)
    return {k.removeprefix("input/xs/"): v for k, v in got.items()}


def _same(got, ref: float, label: str) -> None:
    """Exactly equal, as the probe stores it (a float32 count / n is correctly rounded)."""
    g = np.asarray(got)
    if math.isnan(ref):
        assert np.isnan(g), f"{label}: {g} != NaN"
    else:
        want = np.asarray(ref).astype(g.dtype)
        assert g == want, f"{label}: {float(g)!r} != {float(want)!r} (reference {ref!r})"


def _check(got: dict, ref: dict, recipe: str, label: str) -> None:
    for stat in ("underflow", "overflow", "block_flush"):
        _same(got[f"{stat}_{recipe}"], ref[stat], f"{label}: {stat}_{recipe}")
    for stat in ("scale_log2_min", "scale_log2_max"):
        name, g, r = f"{stat}_{recipe}", float(got[f"{stat}_{recipe}"]), ref[stat]
        if recipe in ("e4m3_tensor", "nvfp4") and not math.isnan(r):
            # log2 of a scale that is no power of two: float32 log2, not exact
            assert abs(g - r) <= 1e-5 + 1e-6 * abs(r), f"{label}: {name} {g} != {r}"
        else:
            _same(got[name], r, f"{label}: {name}")
    g, r = float(got[f"snr_{recipe}"]), ref["snr"]
    if math.isnan(r):
        assert math.isnan(g), f"{label}: snr_{recipe} {g} != NaN"
    elif r > SNR_EXACT_DB:
        # Errors at float32's resolution of d: a float32 dequantisation X * Q may round
        # to d itself (error 0, +inf), the reference keeps the real error.
        assert g > SNR_EXACT_DB, f"{label}: snr_{recipe} {g} != {r}"
    else:
        assert g == pytest.approx(r, rel=1e-5), f"{label}: snr_{recipe} {g} != {r}"


@pytest.mark.parametrize("recipe", RECIPES)
def test_probe_matches_reference(probed, recipe):
    assert set(probed) == set(DATA)
    for name in DATA:
        _check(probed[name], _ref(name, recipe), recipe, name)


def test_adversarial_data_exercises_every_statistic():
    """The probe data really clips, underflows and flushes where the hand cases say."""
    for recipe in RECIPES:
        refs = [_ref(name, recipe) for name in DATA]
        assert max(r["underflow"] for r in refs) > 0, recipe
        assert max(r["overflow"] for r in refs) > 0, recipe
        assert any(0 < r["snr"] < math.inf for r in refs), recipe
    assert _ref("nvfp4", "nvfp4")["block_flush"] == 2 / 8
    assert _ref("nvfp4", "nvfp4")["overflow"] == 2 / 128
    assert _ref("rows40", "mxfp8_e4m3")["overflow"] == 3 / 200
    assert _ref("rows40", "mxfp8_e4m3_rceil")["overflow"] == 0.0
    assert _ref("rows40", "mxfp4")["underflow"] == 6 / 200  # 2 ties to 0, 4 tiny values
    assert _ref("amax_449", "e4m3_tensor")["overflow"] == 0.0
    assert _ref("amax_448_up", "e4m3_tensor")["overflow"] == 2 / 4
    # The tie rows are ties for the recipe they are made for: every row has that scale.
    for recipe, log2 in (("mxfp8_e4m3", 0.0), ("mxfp8_e5m2", -7.0), ("mxfp4", 6.0)):
        r = _ref("ties", recipe)
        assert r["scale_log2_min"] == r["scale_log2_max"] == log2, recipe
    assert _ref("ties", "e4m3_tensor")["scale_log2_max"] == 0.0


def test_stat_names(probed):
    some = next(iter(probed.values()))
    for recipe in RECIPES:
        for stat in STATS:
            assert f"{stat}_{recipe}" in some, f"{stat}_{recipe}"
    for stat in ("underflow", "subnormal", "overflow", "snr"):
        assert f"{stat}_e4m3" in some
    assert "snr_e5m2" not in some  # only the formats asked for


def _dot_data():
    rng = np.random.default_rng(11)
    x = rng.normal(size=(4, 256)).astype(F32)
    # One scale per row of w: blocks along k (columns) mix 2**-12 .. 2**12, blocks along
    # n (rows) do not.
    rows = np.exp2(rng.integers(-12, 13, size=(256, 1)))
    w = (rng.normal(size=(256, 8)) * rows).astype(F32)
    u = (rng.normal(size=(256, 8)) * rows[::-1]).astype(F32)
    v = (rng.normal(size=(256, 8)) * rows).astype(F32)
    return x, w, u, v


@pytest.mark.parametrize("kernel", ["native", "xla"])
def test_dot_operands_are_blocked_along_the_contracting_axis(kernel, monkeypatch):
    """w and u are only GEMM operands (contracting axis 0): blocked along axis 0. v is
    also used elementwise: blocked along its last axis."""
    _use_kernel(monkeypatch, kernel)
    x, w, u, v = _dot_data()

    def fn(x, w, u, v):
        return x @ w, x @ u, (x * 2.0) @ u, x @ v, v * 2.0

    only_inputs = lambda op: op.primitive == "input"  # noqa: E731 (fewer values to compile)
    inst = ss.instrument(fn, scalify=False, formats=FORMATS, select=only_inputs)
    _, stats = jax.jit(inst)(x, w, u, v)
    got = _rows(inst, stats, x, w, u, v)
    assert {"input/x", "input/w", "input/u", "input/v"} <= set(got)
    data = {"x": (x, -1), "w": (w, 0), "u": (u, 0), "v": (v, -1)}
    for recipe in RECIPES:
        for name, (value, axis) in data.items():
            ref = recipe_stats(value, recipe, axis)
            _check(got[f"input/{name}"], ref, recipe, f"{kernel}:{name}:axis {axis}")
        if recipe not in ("e4m3_tensor", "fp8_block128x128"):  # same blocks either way
            for value in (w, v):  # the test tells the axes apart
                along_k, along_n = recipe_stats(value, recipe, 0), recipe_stats(value, recipe, -1)
                # (a scale that never clips leaves E5M2's relative error the same either
                # way: the block scales tell the axes apart)
                told = ("snr", "underflow", "scale_log2_min", "scale_log2_max")
                assert any(along_k[s] != along_n[s] for s in told), recipe


# -- the native kernel's code paths against the XLA kernel -----------------------------------


def _path_recipes():
    """The eight recipes and custom ones that take the native kernel's other paths."""
    from scalescope.core import formats
    from scalescope.core import recipes as rc

    e4m3, e5m2, bf16 = (formats.get(n) for n in ("e4m3", "e5m2", "bf16"))
    custom = (
        rc.Recipe("blocks_24", e4m3, "mx_floor", 24),  # blocks of no whole number of vectors
        rc.Recipe("nv_8", rc.E2M1, "nvfp4", 8),  # blocks narrower than a vector
        rc.Recipe("rceil_48", e5m2, "mx_rceil", 48),  # 3 AVX-512 vectors: not a power of two
        rc.Recipe("tiles_3x24", e4m3, "pow2_floor", 24, rows=3),  # tiles of part vectors
        rc.Recipe("tiles_4x64", e4m3, "mx_floor", 64, rows=4),  # a second tile recipe
        rc.Recipe("wide_32", bf16, "mx_floor", 32),  # an element format of float32's range
        rc.Recipe("tensor_32", e4m3, "tensor", 32),  # the tensor's FP32 scale, blocked
    )
    return tuple(rc.get(n) for n in RECIPES) + custom


def _path_values() -> dict[str, np.ndarray]:
    """Values whose shapes take the native kernel's chunking paths."""
    rng = np.random.default_rng(12)
    band = lambda shape: np.exp2(rng.integers(-10, 11, shape[:-1] + (1,)))  # noqa: E731
    d = {
        # rows longer than a chunk: segments of 4096 and a partial one
        "long_rows": rng.normal(size=(3, 9000)) * band((3, 9000)),
        # short rows packed several to a chunk, 65 no multiple of a vector
        "odd_rows": (rng.standard_t(2, size=(300, 65)), np.float16),
        # row counts no multiple of the tile rows
        "tiles": rng.normal(size=(2, 130, 200)) * band((2, 130, 200)),
        "bytes": (rng.normal(size=(40, 96)) * 8, ml_dtypes.float8_e4m3fn),
        "tiny": rng.normal(size=(3,)),
        "scalar": np.float32(3.0),
        # more than 2^20 elements in short rows: the float lanes are folded between chunks
        "fold": rng.normal(size=(1100, 1000)),
    }
    return {k: np.asarray(*v) if isinstance(v, tuple) else np.asarray(v, F32) for k, v in d.items()}


PATH_VALUES = _path_values()


@functools.cache
def _xla_path_rows() -> dict[str, tuple[np.ndarray, ...]]:
    """The XLA kernel's rows for every value of `PATH_VALUES`, from one program (the
    kernel sums per value, so a value's row does not depend on the others'; one compile
    instead of one per shape)."""
    from scalescope.probe import recipe_kernel

    recipes = _path_recipes()
    values = [jax.numpy.asarray(v) for v in PATH_VALUES.values()]
    fn = jax.jit(lambda *vs: recipe_kernel.recipe_group_raw([(v, None) for v in vs], recipes))
    rows = [np.asarray(v) for v in fn(*values)]
    return {name: tuple(r[i] for r in rows) for i, name in enumerate(PATH_VALUES)}


@pytest.mark.parametrize("name", PATH_VALUES)
def test_native_code_paths_match_the_xla_kernel(name):
    """Counts and scale ranges exactly as the XLA kernel computes them, error sums to
    float32 summation order, for every chunking path and custom block shapes (the XLA
    kernel's one-block-per-row design has no such paths)."""
    if jax.default_backend() != "cpu" or not native.available():
        pytest.skip("the native kernel is the CPU path")
    recipes = _path_recipes()
    x = jax.numpy.asarray(PATH_VALUES[name])
    nf, ni, nm = (np.asarray(v) for v in native.recipe_raw(x, recipes, None))
    xf, xi, xm = _xla_path_rows()[name]
    for i, r in enumerate(recipes):
        label = f"{name}: {r.name}"
        np.testing.assert_array_equal(ni[4 * i : 4 * i + 4], xi[4 * i : 4 * i + 4], label)
        exact = r.rule not in ("tensor", "nvfp4")  # else float32 log2 of the scales
        tol = 0 if exact else 1e-5
        np.testing.assert_allclose(nm[2 * i : 2 * i + 2], xm[2 * i : 2 * i + 2], 0, tol, label)
        if r.name != "wide_32":  # its dequantised values underflow the native kernel's units
            np.testing.assert_allclose(nf[i], xf[i], 1e-4, 1e-10 * x.size, label)


_PORTABLE = """
import json, sys
import jax, numpy as np
sys.path.insert(0, {tests!r})
import test_recipes as t
from scalescope.probe import native
assert native.available()
out = {{"lanes": native.recipe_lanes()}}
for name in ("long_rows", "odd_rows", "tiles", "fold"):
    r = native.recipe_raw(jax.numpy.asarray(t.PATH_VALUES[name]), t._path_recipes(), None)
    out[name] = [np.asarray(v).tolist() for v in r]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_native_portable_build_matches(tmp_path):
    """The kernel built without -march (4-lane vectors, no FMA: the loader's fallback)
    gives the same counts and scale ranges as this process's build, and its error sums to
    float32 summation order."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    if jax.default_backend() != "cpu" or not native.available():
        pytest.skip("the native kernel is the CPU path")
    env = dict(os.environ, SCALESCOPE_NATIVE_MARCH="none", SCALESCOPE_CACHE=str(tmp_path))
    env["SCALESCOPE_PROBE_KERNEL"] = "native"
    code = _PORTABLE.format(tests=str(Path(__file__).parent))
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got.pop("lanes") == 4
    recipes = _path_recipes()
    for name, (pf, pi, pm) in got.items():
        nf, ni, nm = (np.asarray(v) for v in native.recipe_raw(PATH_VALUES[name], recipes, None))
        np.testing.assert_array_equal(np.asarray(pi), ni, name)
        np.testing.assert_array_equal(np.asarray(pm, F32), nm, name)
        np.testing.assert_allclose(np.asarray(pf, F32), nf, 1e-4, 1e-10 * PATH_VALUES[name].size)
