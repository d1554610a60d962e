"""The probe's two kernels (native CPU custom call, pure XLA) against the independent
NumPy + ml_dtypes reference, on the values where rounding is hardest: every format's
subnormals, ties at each rounding boundary, values straddling each format's max, every
stored dtype the native kernel reads directly, and values long enough to be split
across threads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from probe_reference import FNUZ, FORMATS, reference
from test_probe import _check

import scalescope as ss
from scalescope.core import formats as F
from scalescope.probe import kernel, native

SPEC = kernel.StatSpec(tuple(F.get(n) for n in FORMATS), histograms=True)


def _grid(dtype) -> np.ndarray:
    """Every finite positive value of an 8-bit format, or a spread of a wider one."""
    info = ml_dtypes.finfo(dtype)
    if np.dtype(dtype).itemsize == 1:
        v = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)
    else:
        e = np.arange(int(np.log2(info.smallest_subnormal)), int(np.log2(info.max)) + 1)
        m = np.linspace(1, 2, 9, endpoint=False)
        with np.errstate(over="ignore"):
            v = (np.ldexp(1.0, e)[:, None] * m[None, :]).ravel().astype(dtype)
        v = v.astype(np.float32)
    v = v[np.isfinite(v) & (v > 0)]
    return np.unique(v)


def _hard_values(formats: dict = FORMATS) -> np.ndarray:
    """Ties between neighbours of each format, one float32 ulp either side, the max and
    past it, and the subnormal range, with both signs."""
    vals = []
    for dtype, fmax in formats.values():
        g = _grid(dtype).astype(np.float64)
        mid = ((g[:-1] + g[1:]) / 2).astype(np.float32)  # exact ties in float32
        for v in (mid, np.float32(g[0]) / 2, np.float32(fmax)):
            v = np.atleast_1d(np.asarray(v, np.float32))
            vals += [v, np.nextafter(v, np.float32(0)), np.nextafter(v, np.float32(np.inf))]
        with np.errstate(over="ignore"):
            vals.append(np.float32(fmax) * np.float32([1.001, 1.5, 2.0]))
        vals.append(g.astype(np.float32))
    v = np.concatenate(vals)
    v = v[np.abs(v) >= np.finfo(np.float32).tiny]
    return np.concatenate([v, -v])


def _stats(values: list[np.ndarray], which: str, spec: kernel.StatSpec = SPEC) -> list[dict]:
    def fn(*xs):
        vals = [(x, None) for x in xs]
        raw = kernel._native_raw(vals, spec) if which == "native" else kernel.group_raw(vals, spec)
        return kernel.finalize(raw, spec)

    out = jax.jit(fn)(*[jnp.asarray(v) for v in values])
    return [{k: np.asarray(v)[i] for k, v in out.items()} for i in range(len(values))]


needs_native = pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="the native kernel is the CPU path"
)


@pytest.mark.parametrize("which", ["native", "xla"])
def test_a_single_element_or_a_constant_has_no_spread(which):
    """std of one element, or of a constant, is 0 exactly; of nothing finite, NaN."""
    values = [
        np.asarray([0.9], np.float32),
        np.full(700, 0.1, np.float32),
        np.asarray([1.0, 3.0], np.float32),
        np.asarray([np.nan], np.float32),
    ]
    got = [float(g["std"]) for g in _stats(values, which)]
    assert got[:3] == [0.0, 0.0, 1.0]
    assert np.isnan(got[3])


def _spread_values() -> list[np.ndarray]:
    """Values whose mean dwarfs their spread, where ``sumsq/n - mean**2`` cancels in
    float32: a LayerNorm gain after a few steps (1 +- 1e-4; read 0 before), 2^20 plus
    integers in [-8, 8) (read 362), and two halves whose means differ by more than
    their spread, so that pooling pieces must add the means' distance."""
    rng = np.random.default_rng(7)
    halves = np.concatenate([1000 + rng.normal(size=1500), 1001 + rng.normal(size=1700)])
    return [
        (1 + 1e-4 * rng.normal(size=3000)).astype(np.float32),
        (2.0**20 + rng.integers(-8, 8, 2000)).astype(np.float32),
        halves.astype(np.float32),
        (-3e4 + 0.01 * rng.normal(size=(37, 29))).astype(np.float32).ravel(),
    ]


def _assert_std(got: float, value: np.ndarray, label: str) -> None:
    want = value.astype(np.float64).std()
    np.testing.assert_allclose(got, want, rtol=1e-4, err_msg=label)


@pytest.mark.parametrize("which", ["native", "xla"])
def test_std_of_a_value_whose_mean_dwarfs_its_spread(which):
    values = _spread_values()
    for i, (g, v) in enumerate(zip(_stats(values, which), values, strict=True)):
        _assert_std(float(g["std"]), v, f"{which} {i}")


def test_std_survives_every_fold_of_raw_rows(monkeypatch):
    """The spread is pooled (Chan's formula) wherever rows fold: a value split across
    the XLA kernel's buffers, two pieces merged as devices or pieces are (`merge_rows`),
    and a while loop's iterations (`accumulate`)."""
    values = _spread_values()
    monkeypatch.setattr(native, "use_native", lambda: False)
    monkeypatch.setattr(kernel, "GROUP_ELEMENTS", 1024)
    monkeypatch.setattr(kernel, "GROUP_MIN_ELEMENTS", 1024)
    spec = kernel.StatSpec(SPEC.formats, histograms=False, block=64)
    out = _values_stats(values, spec)  # every value spans buffers of 1024 elements
    for i, v in enumerate(values):
        _assert_std(float(out["std"][i]), v, f"split {i}")

    def folded(v):
        a, b = jnp.asarray(v[: len(v) // 3]), jnp.asarray(v[len(v) // 3 :])
        pieces = kernel.group_raw([(a, None), (b, None)], spec)
        merged = kernel.merge_rows(pieces, np.asarray([0, 0]), 1)
        looped = kernel.accumulate(
            kernel.group_raw([(a, None)], spec), kernel.group_raw([(b, None)], spec)
        )
        return [kernel.finalize(r, spec)["std"][0] for r in (merged, looped)]

    for i, v in enumerate(values):
        merged, looped = jax.jit(folded)(v)
        _assert_std(float(merged), v, f"merge_rows {i}")
        _assert_std(float(looped), v, f"accumulate {i}")


def test_a_value_of_one_magnitude_has_dynamic_range_zero():
    """log2(absmax) - log2(absmin) of equal magnitudes is 0 exactly, not the difference of
    two roundings: fused into different kernels (instrumented and isolated programs) the
    two log2 gave -7e-8 and 3e-8 for a single element."""
    for x in ([0.9], [-2.0, 2.0, 2.0, 0.0]):
        stats = kernel.finalize(kernel.group_raw([(jnp.asarray(x, jnp.float32), None)], SPEC), SPEC)
        assert float(stats["dynamic_range"][0]) == 0.0, x
    pair = kernel.finalize(kernel.group_raw([(jnp.asarray([0.5, -8.0]), None)], SPEC), SPEC)
    assert float(pair["dynamic_range"][0]) == 4.0
    zeros = kernel.finalize(kernel.group_raw([(jnp.zeros(3), None)], SPEC), SPEC)
    assert np.isnan(float(zeros["dynamic_range"][0]))


@needs_native
def test_native_kernel_builds():
    assert native.available(), "the native kernel must build on a machine with g++"


@pytest.mark.parametrize("which", ["native", "xla"])
def test_rounding_boundaries_match_reference(which):
    if which == "native" and not native.available():
        pytest.fail("native kernel unavailable")
    hard = _hard_values()
    rng = np.random.default_rng(3)
    pieces = {
        "hard": hard,
        "hard_shuffled_odd_length": rng.permutation(hard)[: (hard.size // 2) * 2 - 3],
        "one": np.array([0.3], np.float32),
        "seven": rng.normal(size=7).astype(np.float32),
        "special": np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1e-30, 3e38], np.float32),
    }
    got = _stats(list(pieces.values()), which)
    for (name, data), g in zip(pieces.items(), got, strict=True):
        _check(g, reference(data), f"{which}:{name}")


@pytest.mark.parametrize("which", ["native", "xla"])
def test_fnuz_formats_match_reference(which):
    """E4M3FNUZ and E5M2FNUZ (what AMD's MI300 casts to; Flax's NANOO FP8 ops): their own
    max (240 for E4M3FNUZ, not E4M3FN's 448) and subnormals, in both kernels."""
    if which == "native" and not native.available():
        pytest.fail("native kernel unavailable")
    spec = kernel.StatSpec(tuple(F.get(n) for n in FNUZ), histograms=True)
    hard = _hard_values(FNUZ)
    rng = np.random.default_rng(4)
    pieces = {"hard": hard, "normal": (rng.normal(size=999) * 100).astype(np.float32)}
    got = _stats(list(pieces.values()), which, spec)
    for (name, data), g in zip(pieces.items(), got, strict=True):
        ref = reference(data, tuple(FNUZ))
        assert ref["overflow_e4m3fnuz"] > 0  # values between 240 and 448 overflow
        _check(g, ref, f"{which}:{name}", formats=tuple(FNUZ))


@pytest.mark.parametrize("which", ["native", "xla"])
def test_extremes_ignore_padding_and_specials(which):
    """min, max, absmin and dynamic_range (Transformer Engine's log2(amax) - log2(nonzero
    amin)) on values whose lengths leave partial blocks and chunks: the padding must not
    count as an element (an all-positive value has no 0 to be its min), non-finite
    elements and float32 subnormals (read as zeros) neither."""
    if which == "native" and not native.available():
        pytest.fail("native kernel unavailable")
    rng = np.random.default_rng(7)
    tiny = np.finfo(np.float32).tiny
    pieces = {
        "positive_1000": rng.uniform(0.5, 3.0, 1000).astype(np.float32),
        "negative_77": -rng.uniform(2.0**-20, 2.0**5, 77).astype(np.float32),
        "zeros": np.zeros(600, np.float32),
        "specials": np.array([np.nan, np.inf, -np.inf, 3.0, -2.0, 0.0], np.float32),
        "subnormal_and_normal": np.array([tiny / 4, -tiny / 8, 2.0**-100, 5.0], np.float32),
        "all_nan": np.full(9, np.nan, np.float32),
    }
    got = _stats(list(pieces.values()), which)
    for (name, data), g in zip(pieces.items(), got, strict=True):
        _check(g, reference(data), f"{which}:{name}")
    by = dict(zip(pieces, got, strict=True))
    assert by["positive_1000"]["min"] >= 0.5 and by["negative_77"]["max"] < 0
    assert by["zeros"]["min"] == by["zeros"]["max"] == 0 and np.isnan(by["zeros"]["absmin"])
    assert by["specials"]["dynamic_range"] == np.float32(np.log2(1.5))
    assert by["subnormal_and_normal"]["absmin"] == np.float32(2.0**-100)
    assert by["subnormal_and_normal"]["dynamic_range"] == np.float32(np.log2(5.0) + 100)
    assert all(np.isnan(by["all_nan"][k]) for k in ("min", "max", "absmin", "dynamic_range"))


@needs_native
@pytest.mark.parametrize(
    "dtype", [jnp.float16, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float64]
)
def test_native_reads_stored_dtypes(dtype):
    """f16/bf16 are widened in the kernel, 8-bit floats through a table, others by XLA."""
    rng = np.random.default_rng(4)
    data = (rng.normal(size=1001) * 3).astype(np.float32)
    data[:5] = [0.0, np.nan, 1e-6, -500.0, 448.0]
    stored = np.asarray(jnp.asarray(data, dtype) if dtype != jnp.float64 else data)
    (got,) = _stats([stored], "native")
    _check(got, reference(stored.astype(np.float32)), str(dtype))


@needs_native
def test_native_large_value_split_across_threads():
    """A value above the threads' threshold (2**22 elements), not a multiple of a chunk."""
    rng = np.random.default_rng(5)
    data = (rng.standard_t(3, size=(1 << 23) + 77) * 0.01).astype(np.float32)
    data[::1000] = 0
    (got,) = _stats([data], "native")
    _check(got, reference(data), "large")


def test_kernels_agree_on_wide_ranges():
    rng = np.random.default_rng(6)
    values = [
        (rng.normal(size=3000) * np.exp2(rng.uniform(-60, 60, 3000))).astype(np.float32),
        (rng.normal(size=(17, 33)) * 1e-20).astype(np.float32),
        (rng.normal(size=513) * 1e30).astype(np.float32),
    ]
    ref = [reference(v) for v in values]
    for which in ("xla", "native") if native.available() else ("xla",):
        for v, g, r in zip(values, _stats(values, which), ref, strict=True):
            _check(g, r, f"{which}:{v.shape}")


def _buffer_sizes(monkeypatch) -> list[list[int]]:
    """Force the pure-XLA kernel; the list it fills with the elements of each buffer's
    pieces (NaN padding not counted)."""
    monkeypatch.setattr(native, "use_native", lambda: False)
    seen: list[list[int]] = []
    real = kernel.group_raw

    def spy(values, spec, pad_to_class=False):
        seen.append([int(np.size(d)) for d, _ in values])
        return real(values, spec, pad_to_class)

    monkeypatch.setattr(kernel, "group_raw", spy)
    return seen


def _values_stats(values, spec=SPEC) -> dict:
    return jax.jit(
        lambda *xs: kernel.finalize(kernel.values_raw([(x, None) for x in xs], spec), spec)
    )(*values)


def test_pack_fills_buffers_exactly_and_gives_big_values_their_own():
    """`kernel.pack`: values under half a buffer are packed in order into buffers of
    exactly ``capacity`` blocks, a value split where one fills up (on a block of the
    value); a value of half a buffer or more is a buffer of its own (read in place);
    an empty value is a row of the open buffer."""
    sizes = [150, 150, 190, 190, 600, 0, 10, 2000, 130, 50]
    assert kernel.pack(sizes, capacity=8, block=64) == [
        [(0, 0, 150), (1, 0, 150), (2, 0, 128)],  # 3 + 3 + 2 blocks
        [(4, 0, 600)],
        [(7, 0, 2000)],
        [(2, 128, 190), (3, 0, 190), (5, 0, 0), (6, 0, 10), (8, 0, 130)],  # 1+3+0+1+3
        [(9, 0, 50)],  # the last, partly filled
    ]


def test_xla_kernel_statistics_of_values_split_across_buffers(monkeypatch):
    """Through `values_raw`: full buffers hold exactly their capacity, and every value's
    statistics are the reference's,
    also for a value split across two buffers whose pieces differ by 2**20 in magnitude
    (sums re-expressed in the larger piece's units) and hold a zero, an inf and a NaN."""
    monkeypatch.setattr(kernel, "GROUP_ELEMENTS", 512)
    monkeypatch.setattr(kernel, "GROUP_MIN_ELEMENTS", 512)
    spec = kernel.StatSpec(SPEC.formats, histograms=True, block=64)
    seen = _buffer_sizes(monkeypatch)
    rng = np.random.default_rng(7)
    sizes = [150, 150, 190, 190, 600, 0, 10, 2000, 130, 50]
    values = [rng.normal(size=n).astype(np.float32) for n in sizes]
    values[2][:128] *= 1e-3
    values[2][128:] *= 1e3
    values[2][[130, 140, 150]] = [0.0, np.inf, np.nan]
    out = _values_stats(values, spec)
    assert seen == [[150, 150, 128], [600], [2000], [62, 190, 0, 10, 130], [50]]
    for i, v in enumerate(values):
        got = {k: np.asarray(a)[i] for k, a in out.items()}
        if not v.size:  # the empty value: nothing counted, no statistic
            assert got["count"] == 0 and np.isnan(got["rms"]) and not got["hist"].any()
            continue
        ref = reference(v)
        _check(got, ref, f"value {i}")
        assert np.array_equal(got["hist"], ref["hist"]), f"hist {i}"
    # No value split, but rows come back in buffer order (the big value's buffer first).
    seen.clear()
    values = [rng.normal(size=n).astype(np.float32) * s for n, s in ((100, 1), (5000, 9), (99, 2))]
    out = _values_stats(values, spec)
    assert seen == [[5000], [100, 99]]
    for i, v in enumerate(values):
        _check({k: np.asarray(a)[i] for k, a in out.items()}, reference(v), f"in order {i}")
    classes = [kernel.size_class(n) for n in (1, 8, 9, 15, 17, 100, 65537)]
    assert classes == [1, 8, 10, 16, 20, 112, 81920]  # four an octave: <= a quarter more


def test_a_small_scope_gets_smaller_xla_buffers(monkeypatch):
    """A scope whose values fill fewer than `GROUPS_PER_SCOPE` full buffers gets buffers
    of 1/`GROUPS_PER_SCOPE` of its elements (at least `GROUP_MIN_ELEMENTS`), rounded down
    to a power of two blocks, so a small model's probe does not hold a copy of every
    value of a scope; the last buffer is padded with NaN blocks up to its `size_class`
    and its values' statistics are still the reference's."""
    monkeypatch.setattr(kernel, "GROUP_ELEMENTS", 10**6)
    monkeypatch.setattr(kernel, "GROUP_MIN_ELEMENTS", 500)
    monkeypatch.setattr(kernel, "GROUPS_PER_SCOPE", 4)
    spec = kernel.StatSpec(SPEC.formats, histograms=True, block=10)
    seen = _buffer_sizes(monkeypatch)
    shapes: list[int] = []  # blocks of each buffer as the passes read it, padding included
    passes = kernel._block_passes
    monkeypatch.setattr(
        kernel, "_block_passes", lambda x, s: shapes.append(x.shape[0]) or passes(x, s)
    )
    rng = np.random.default_rng(3)
    for sizes, buffers, blocks in (
        (  # 3970 elements: 992 a buffer, 64 blocks of 10; the last, 13 blocks, padded to 14
            [100] * 39 + [70],
            [
                [100] * 6 + [40],
                [60] + [100] * 5 + [80],
                [20] + [100] * 6 + [20],
                [80] + [100] * 5 + [60],
                [40] + [100] * 6,
                [100] * 6 + [40],
                [60, 70],
            ],
            [64] * 6 + [14],
        ),
        ([30] * 20, [[30] * 10 + [20], [10] + [30] * 9], [32, 28]),  # 600: the minimum
    ):
        seen.clear()
        shapes.clear()
        values = [rng.normal(size=n).astype(np.float32) for n in sizes]
        out = _values_stats(values, spec)
        assert seen == buffers and shapes == blocks
        for i, v in enumerate(values):
            _check({k: np.asarray(a)[i] for k, a in out.items()}, reference(v), f"value {i}")


@needs_native
@pytest.mark.parametrize(
    "dtype", [jnp.float32, jnp.float16, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2]
)
def test_measure_through_hands_back_the_value_it_measured(dtype):
    """The probe's at-once path: the kernel hands the value back in the same buffer
    (consumers read it from there), bit for bit, with the reference's statistics."""
    hard = _hard_values()
    with np.errstate(over="ignore"):
        stored = np.asarray(jnp.asarray(hard[: hard.size // 6 * 6].reshape(6, -1), dtype))
    hist = (kernel.HIST_LO, kernel.HIST_HI)

    def fn(x):
        same, floats, ints = native.measure_through(x, SPEC.formats, hist)
        raw = kernel._native_raw([kernel.Measured(floats, ints, None)], SPEC)
        return same, kernel.finalize(raw, SPEC)

    same, stats = jax.jit(fn)(stored)
    assert same.shape == stored.shape and same.dtype == stored.dtype
    width = {1: np.uint8, 2: np.uint16, 4: np.uint32}[stored.dtype.itemsize]
    np.testing.assert_array_equal(np.asarray(same).view(width), stored.view(width))
    got = {k: np.asarray(v)[0] for k, v in stats.items()}
    _check(got, reference(stored.astype(np.float32).ravel()), f"through:{dtype}")
    with pytest.raises(TypeError, match="dtype"):
        native.measure_through(jnp.zeros(3, jnp.int32), SPEC.formats, hist)


def test_values_measured_at_once_equal_values_measured_later():
    """Statistics taken where each value is produced (the default on CPU) equal those of
    the deferred path (a group mask), also for a value whose data a rule handed on with
    only its scale changed (measured once, reported for both ops)."""

    def fn(x, w):
        h = jnp.tanh(x @ w)
        h = ss.ops.dynamic_rescale_l2(h)  # new scale; data re-expressed
        h = jax.nn.gelu(h)  # 0.5 * x: scalify moves the 0.5 into the scale, same data
        return jnp.sum(jnp.exp(h) * h)

    rng = np.random.default_rng(7)
    x = ss.as_scaled_array(jnp.asarray(rng.normal(size=(16, 32)), jnp.float32), "rms")
    w = ss.as_scaled_array(jnp.asarray(rng.normal(size=(32, 8)) / 6, jnp.float16), "rms")
    at_once = ss.instrument(fn, isolate=False)
    later = ss.instrument(fn, isolate=False, groups=1)
    out_a, stats_a = jax.jit(at_once)(x, w)
    out_b, stats_b = jax.jit(later.masked)(np.array([True]), x, w)
    assert float(out_a.to_array()) == float(jax.jit(ss.scalify(fn))(x, w).to_array())
    table = at_once.op_table(x, w)
    assert len([op for op in table if op.recorded]) >= 10
    for name in stats_a:
        # The two programs compute a value with different fusions (its last bit can differ,
        # and with it that element's rounding error): SNRs (dB) agree to 0.05 dB.
        tol = {"atol": 0.05} if name.startswith("snr") else {"rtol": 1e-5}
        np.testing.assert_allclose(
            np.asarray(stats_a[name]), np.asarray(stats_b[name]), err_msg=name, **tol
        )


@pytest.mark.parametrize(
    "dtype", [jnp.float16, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float32]
)
def test_hand_off_returns_every_value_bit_for_bit(dtype):
    """`kernel.hand_off` (the pure-XLA pass-through) returns every bit pattern unchanged:
    zeros of both signs, subnormals, the max, infinities, every NaN. Checked on the bits,
    against the input itself."""
    width = np.dtype(dtype).itemsize * 8
    if width == 32:  # every exponent, a spread of mantissas, both signs, the specials
        exp = np.arange(256, dtype=np.uint32) << 23
        man = np.array([0, 1, 2, 3, 1 << 22, (1 << 23) - 1, 0x2AAAAA], np.uint32)
        bits = (exp[:, None] | man[None, :]).ravel()
        bits = np.concatenate([bits, bits | np.uint32(1 << 31)])
    else:
        bits = np.arange(1 << width, dtype=np.uint64).astype(f"uint{width}")
    values = bits.view(np.dtype(dtype))
    out = np.asarray(jax.jit(kernel.hand_off)(jnp.asarray(values)))
    assert np.array_equal(out.view(bits.dtype), bits)


def test_the_xla_kernel_reads_a_value_where_the_step_does(monkeypatch):
    """On the pure-XLA path a measured value is computed once: its producer (a sine here)
    is not recomputed inside the statistics' passes, so the instrumented program holds as
    many sines as the plain one; its outputs are the plain program's."""
    monkeypatch.setattr(native, "use_native", lambda: False)

    def f(x):
        h = jnp.sin(x) * 3.0
        return jnp.cos(h) * h

    x = jnp.linspace(-4.0, 4.0, 1 << 16, dtype=jnp.float32)
    inst = ss.instrument(f)
    plain = jax.jit(f).lower(x).compile().as_text()
    text = jax.jit(inst).lower(x).compile().as_text()
    assert plain.count(" sine(") == 1
    assert text.count(" sine(") == 1, "the sine is recomputed by the statistics' passes"
    out, stats = jax.jit(inst)(x)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.jit(f)(x)))
    table = inst.op_table(x)
    (mul,) = [op for op in table.find("mul") if op.recorded and op.shape == x.shape][:1]
    row = table.rows(mul).start
    h = np.asarray(jax.jit(lambda x: jnp.sin(x) * 3.0)(x))
    _check({k: np.asarray(v)[row] for k, v in stats.items()}, reference(h), "sin(x) * 3")


def test_xla_buffers_keep_the_values_type(monkeypatch):
    """A buffer whose values share a type holds them in it (padded with that type's NaN)
    and one of mixed types in float32; either way every value's statistics are the
    reference's, for values that do not fill whole blocks."""
    monkeypatch.setattr(native, "use_native", lambda: False)
    rng = np.random.default_rng(11)
    raw = [rng.normal(size=n) * s for n, s in ((700, 3.0), (1029, 0.01), (513, 200.0))]
    configs = (
        [jnp.float16] * 3,
        [jnp.bfloat16] * 3,
        [jnp.float8_e4m3fn] * 3,
        [jnp.float8_e5m2] * 3,
        [jnp.float16, jnp.bfloat16, jnp.float32],
    )
    groups = [
        [jnp.asarray(v.astype(np.float32)).astype(t) for v, t in zip(raw, types)]
        for types in configs
    ]
    for types, values in zip(configs, groups):
        shared = len(set(types)) == 1
        assert kernel._buffer_dtype([(v, None) for v in values]) == (
            np.dtype(types[0]) if shared else np.float32
        )
    outs = jax.jit(  # one program, one scope per configuration
        lambda gs: [
            kernel.finalize(kernel.values_raw([(x, None) for x in g], SPEC), SPEC) for g in gs
        ]
    )(groups)
    for types, values, out in zip(configs, groups, outs):
        for i, v in enumerate(values):
            ref = reference(np.asarray(v).astype(np.float32))
            _check({k: np.asarray(a)[i] for k, a in out.items()}, ref, f"{types[i]} {i}")
            assert np.array_equal(np.asarray(out["hist"])[i], ref["hist"]), f"hist {i}"
