"""Independent NumPy + ml_dtypes reference for the block-scaled recipe statistics
(docs/probe.md, "Block-scaled recipes").

Slow and exact on purpose. Every rounding onto an element grid is done once, from the
exact real number:

* power-of-two scales (the MX recipes, ``fp8_block128``, ``fp8_block128x128``): ``d / X``
  is exact in float64 (a float32 divided by ``2**E``, ``|E| <= 127``), rounded to nearest
  even by :func:`q_f64` (float64 ``frexp``/``ldexp``/``rint``, all exact);
* the other scales (``e4m3_tensor``, ``nvfp4``): rational arithmetic with
  :class:`fractions.Fraction`, rounded by :func:`q_exact`.

The tests check these grids against ml_dtypes' casts of float32 values (ml_dtypes casts
float64 through float32, a double rounding this module avoids). Nothing here imports
scalescope.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

RECIPES = (
    "e4m3_tensor",
    "mxfp8_e4m3",
    "mxfp8_e5m2",
    "mxfp8_e4m3_rceil",
    "mxfp8_e5m2_rceil",
    "mxfp4",
    "nvfp4",
    "fp8_block128",
    "fp8_block128x128",
)
STATS = ("underflow", "overflow", "snr", "block_flush", "scale_log2_min", "scale_log2_max")


@dataclass(frozen=True)
class Elem:
    """A saturating element grid: ``mant`` stored mantissa bits, smallest normal
    ``2**emin`` (subnormals below it, spaced ``2**(emin - mant)``), largest value ``max``."""

    name: str
    mant: int
    emin: int
    max: float


E4M3 = Elem("e4m3", 3, -6, 448.0)
E5M2 = Elem("e5m2", 2, -14, 57344.0)
E2M1 = Elem("e2m1", 1, 0, 6.0)
F32_TINY = float(np.finfo(np.float32).tiny)
F32_MAX = float(np.finfo(np.float32).max)


# -- exact rounding -----------------------------------------------------------------------


def floor_log2(a: Fraction) -> int:
    """``floor(log2(a))`` of a positive rational, exactly."""
    n, d = a.numerator, a.denominator
    assert n > 0 and d > 0
    # 2**(e-1) < n/d < 2**(e+1) for e the difference of the bit lengths.
    e = n.bit_length() - d.bit_length()
    below = n < (d << e) if e >= 0 else (n << -e) < d  # n/d < 2**e
    return e - 1 if below else e


def _rne_div(num: int, den: int) -> int:
    """``num / den`` (non-negative integers) rounded to the nearest integer, ties to even."""
    k, rest = divmod(num, den)
    if 2 * rest > den or (2 * rest == den and k % 2 == 1):
        k += 1
    return k


def _round_to_ulp(a: Fraction, ulp_log2: int) -> Fraction:
    """The positive rational ``a`` rounded to nearest even on multiples of ``2**ulp_log2``."""
    n, d = a.numerator, a.denominator
    if ulp_log2 >= 0:
        return Fraction(_rne_div(n, d << ulp_log2) << ulp_log2)
    return Fraction(_rne_div(n << -ulp_log2, d), 1 << -ulp_log2)


def q_exact(y: Fraction | float, fmt: Elem) -> Fraction:
    """``Q_F(y)``: round the real ``y`` to nearest even on F's grid, saturating at F.max."""
    y = Fraction(y)
    a = abs(y)
    if a == 0:
        return Fraction(0)
    top = Fraction(fmt.max)
    if a > top:
        r = top
    else:  # spacing 2**(e - mant) in [2**e, 2**(e+1)), e >= emin (subnormals below)
        r = min(_round_to_ulp(a, max(floor_log2(a), fmt.emin) - fmt.mant), top)
    return r if y > 0 else -r


def q_f64(y: np.ndarray, fmt: Elem) -> np.ndarray:
    """``Q_F`` of float64 values that are the exact reals to round (vectorised)."""
    y = np.asarray(y, np.float64)
    a = np.abs(y)
    _, e = np.frexp(a)  # a = m * 2**e, m in [0.5, 1): floor(log2 a) = e - 1
    ulp = np.ldexp(1.0, np.maximum(e - 1, fmt.emin) - fmt.mant)
    r = np.rint(a / ulp) * ulp  # a / ulp: exact (power of two); rint: ties to even
    r = np.where(a > fmt.max, fmt.max, np.minimum(r, fmt.max))
    return np.where(y < 0, -r, r)


def f32_round(y: Fraction) -> float:
    """The correctly rounded float32 of a positive rational (inf past float32's max)."""
    assert y > 0
    r = _round_to_ulp(y, max(floor_log2(y), -126) - 23)
    return math.inf if r > Fraction(F32_MAX) else float(r)


# -- blocks -------------------------------------------------------------------------------


def blocks(shape: tuple[int, ...], recipe: str, axis: int | None = -1) -> list[np.ndarray]:
    """The flat (row-major) indices of each block of a value of ``shape``."""
    idx = np.arange(int(np.prod(shape, dtype=np.int64))).reshape(shape)
    if recipe == "e4m3_tensor":
        return [idx.ravel()]
    if axis is None:
        idx = idx.ravel()
    elif idx.ndim:
        idx = np.moveaxis(idx, axis, -1)
    if recipe == "fp8_block128x128":
        if idx.ndim < 2:  # a 0-d or 1-D value: one row (tiles of 1 x 128)
            idx = idx.reshape(1, -1)
        out = []
        for plane in idx.reshape(-1, *idx.shape[-2:]):  # per index of the leading axes
            for i in range(0, plane.shape[0], 128):
                for j in range(0, plane.shape[1], 128):
                    out.append(plane[i : i + 128, j : j + 128].ravel())
        return out
    size = {"nvfp4": 16, "fp8_block128": 128}.get(recipe, 32)
    rows = idx.reshape(1, 1) if idx.ndim == 0 else idx.reshape(-1, idx.shape[-1])
    return [row[j : j + size] for row in rows for j in range(0, row.shape[0], size)]


# -- one block ----------------------------------------------------------------------------


@dataclass
class Quantised:
    """One block's finite elements after quantise-dequantise."""

    zero: np.ndarray  # q(d) == 0, exactly
    clipped: np.ndarray  # |d / X| > element max
    err: np.ndarray  # d - q(d), float64 (nearest to the exact difference)
    log2_scale: float | None  # log2(X); None: no scale (amax 0, or X == 0)
    q: list  # q(d): the exact dequantised values (float64 where exact, else Fraction)


def _pow2_block(x: np.ndarray, exponent: Callable[[float], int], fmt: Elem) -> Quantised:
    """A block with a dequantisation scale ``X = 2**exponent(amax)``."""
    amax = float(np.max(np.abs(x), initial=0.0))
    if amax == 0:
        z = np.zeros(x.shape, bool)
        return Quantised(np.ones(x.shape, bool), z, np.zeros(x.shape), None, [0.0] * x.size)
    e = exponent(amax)
    scale = math.ldexp(1.0, e)
    y = x / scale  # exact
    q = q_f64(y, fmt) * scale  # exact
    return Quantised(q == 0, np.abs(y) > fmt.max, x - q, float(e), q.tolist())


def _clamp(e: int) -> int:
    return min(max(e, -127), 127)


def _mx_floor(emax_elem: int) -> Callable[[float], int]:
    """OCP MX: ``E = clamp(floor(log2 amax) - emax_elem, -127, 127)``."""
    return lambda amax: _clamp(floor_log2(Fraction(amax)) - emax_elem)


def _rceil(top: int) -> Callable[[float], int]:
    """Smallest E with ``amax <= top * 2**E`` (``top``: the element format's max, 448 for
    E4M3, 57344 for E5M2), clamped to [-127, 127]."""

    def exponent(amax: float) -> int:
        e = floor_log2(Fraction(amax)) - floor_log2(Fraction(top))
        while Fraction(amax) > top * Fraction(2) ** e:
            e += 1
        while Fraction(amax) <= top * Fraction(2) ** (e - 1):
            e -= 1
        return _clamp(e)

    return exponent


def _block128(amax: float) -> int:
    """``X = 2**-E``, E the largest integer with ``amax * 2**E <= 448`` (E <= 127)."""
    e = 8 - floor_log2(Fraction(amax))
    while Fraction(amax) * Fraction(2) ** e > 448:
        e -= 1
    while Fraction(amax) * Fraction(2) ** (e + 1) <= 448:
        e += 1
    return -min(e, 127)


def _rational_block(
    x: np.ndarray, mul: Fraction | float, fmt: Elem, log2_scale: float | None
) -> Quantised:
    """Elements ``Q(d * mul) / mul`` with a rational ``mul = 1/X`` (single rounding).
    ``mul`` infinite (a float32 scale that overflowed): every element is clipped to the
    max and dequantises to ``max / inf = 0``."""
    zero, clipped, err, qs = [], [], [], []
    for v in x.tolist():
        if math.isinf(mul):
            zero.append(True)
            clipped.append(v != 0)
            err.append(v)
            qs.append(0.0)
            continue
        y = Fraction(v) * mul
        q = q_exact(y, fmt) / mul
        zero.append(q == 0)
        clipped.append(abs(y) > Fraction(fmt.max))
        err.append(float(Fraction(v) - q))
        qs.append(q)
    return Quantised(np.array(zero, bool), np.array(clipped, bool), np.array(err), log2_scale, qs)


def tensor_factor(top: int, amax: float) -> float:
    """The float32 tensor factor ``f32(top / amax)``: 1 for an all-zero value, and
    float32's largest finite value where the quotient overflows (a tensor whose abs-max
    is below ``top / f32max``, as Transformer Engine clamps it)."""
    if amax <= 0:
        return 1.0
    return min(f32_round(Fraction(top) / Fraction(amax)), F32_MAX)


def _tensor_amax(d: np.ndarray) -> float:
    fin = d[np.isfinite(d)]
    return float(np.max(np.abs(fin), initial=0.0))


# -- statistics ---------------------------------------------------------------------------


def flush_f32_subnormals(d) -> np.ndarray:
    """The data widened to float32, float32 subnormals counted as zero."""
    d = np.asarray(d).astype(np.float32)
    return np.where(np.abs(d) < F32_TINY, np.float32(0), d)


def _quantiser(recipe: str, amax_t: float) -> Callable[[np.ndarray], Quantised]:
    """The function quantising one block (finite float64 elements) under ``recipe``, for
    a value whose finite abs-max is ``amax_t``."""
    if recipe == "e4m3_tensor":
        s = tensor_factor(448, amax_t)

        def quantise(x: np.ndarray) -> Quantised:
            has = bool(np.any(x != 0))
            log2 = -math.log2(s) if has else None
            return _rational_block(x, Fraction(s), E4M3, log2)

    elif recipe == "nvfp4":
        s_enc = tensor_factor(2688, amax_t)

        def quantise(x: np.ndarray) -> Quantised:
            amax = float(np.max(np.abs(x), initial=0.0))
            s_b = q_exact(Fraction(amax) * Fraction(s_enc) / 6, E4M3)
            if s_b == 0:  # the block's scale flushed: the whole block is 0, none clipped
                z = np.zeros(x.shape, bool)
                zeros = [0.0] * x.size
                return Quantised(np.ones(x.shape, bool), z, x.astype(np.float64), None, zeros)
            log2 = math.log2(float(s_b)) - math.log2(s_enc)
            return _rational_block(x, Fraction(s_enc) / s_b, E2M1, log2)

    else:
        fmt, exponent = {
            "mxfp8_e4m3": (E4M3, _mx_floor(8)),
            "mxfp8_e5m2": (E5M2, _mx_floor(15)),
            "mxfp4": (E2M1, _mx_floor(2)),
            "mxfp8_e4m3_rceil": (E4M3, _rceil(448)),
            "mxfp8_e5m2_rceil": (E5M2, _rceil(57344)),
            "fp8_block128": (E4M3, _block128),
            "fp8_block128x128": (E4M3, _block128),
        }[recipe]

        def quantise(x: np.ndarray) -> Quantised:
            return _pow2_block(x.astype(np.float64), exponent, fmt)

    return quantise


def recipe_stats(d: np.ndarray, recipe: str, axis: int | None = -1) -> dict[str, float]:
    """The six statistics of ``recipe`` on the value ``d``, blocked along ``axis``
    (``None``: along the flattened value)."""
    if recipe not in RECIPES:
        raise KeyError(recipe)
    d = flush_f32_subnormals(d)
    flat = d.ravel()
    n = flat.size
    if n == 0:
        raise ValueError("empty value")
    amax_t = _tensor_amax(flat)

    quantise = _quantiser(recipe, amax_t)

    underflow = overflow = 0
    sig = err2 = 0.0
    n_finite = 0
    flushed = with_nonzero = 0
    logs: list[float] = []
    for ix in blocks(d.shape, recipe, axis):
        v = flat[ix]
        fin = np.isfinite(v)
        overflow += int(np.sum(np.isinf(v)))
        x = v[fin].astype(np.float64)
        n_finite += x.size
        qb = quantise(x)
        nonzero = x != 0
        underflow += int(np.sum(nonzero & qb.zero))
        overflow += int(np.sum(qb.clipped))
        sig += float(np.sum(x * x))
        err2 += float(np.sum(qb.err * qb.err))
        if np.any(nonzero):
            with_nonzero += 1
            flushed += bool(np.all(qb.zero))
        if qb.log2_scale is not None:
            logs.append(qb.log2_scale)
    if n_finite == 0:
        snr = math.nan  # no finite element: no signal (as for the formats)
    elif err2 == 0:
        snr = math.inf
    else:
        snr = 10 * math.log10(sig / err2)
    return {
        "underflow": underflow / n,
        "overflow": overflow / n,
        "snr": snr,
        "block_flush": flushed / with_nonzero if with_nonzero else 0.0,
        "scale_log2_min": min(logs) if logs else math.nan,
        "scale_log2_max": max(logs) if logs else math.nan,
    }


def dequantise(d: np.ndarray, recipe: str, axis: int | None = -1) -> np.ndarray:
    """``d`` quantised by ``recipe`` and dequantised: each finite element the float32
    nearest to its exact dequantised value (one rounding), non-finite ones unchanged,
    float32 subnormals read as zero (as `recipe_stats` reads them)."""
    if recipe not in RECIPES:
        raise KeyError(recipe)
    src = np.asarray(d).astype(np.float32)
    d = flush_f32_subnormals(src)
    flat = d.ravel()
    out = src.ravel().copy()
    quantise = _quantiser(recipe, _tensor_amax(flat))
    for ix in blocks(d.shape, recipe, axis):
        v = flat[ix]
        fin = np.isfinite(v)
        qb = quantise(v[fin].astype(np.float64))
        vals = []
        for x, q in zip(v[fin].tolist(), qb.q):
            mag = abs(q)
            r = 0.0 if mag == 0 else f32_round(Fraction(mag))
            vals.append(math.copysign(r, x))
        out[ix[fin]] = np.array(vals, np.float32)
    return out.reshape(d.shape)
