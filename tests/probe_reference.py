"""Independent NumPy + ml_dtypes reference for the probe's statistics (docs/probe.md)."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np

FORMATS = {
    "e4m3": (ml_dtypes.float8_e4m3fn, 448.0),
    "e5m2": (ml_dtypes.float8_e5m2, 57344.0),
    "fp16": (np.float16, 65504.0),
    "bf16": (ml_dtypes.bfloat16, float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)),
}
#: The fnuz FP8 formats (AMD MI300's): no -0 or inf, E4M3FNUZ's max 240 and smallest
#: normal 2^-7. Not among the formats a recording measures by default.
FNUZ = {
    "e4m3fnuz": (ml_dtypes.float8_e4m3fnuz, float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fnuz).max)),
    "e5m2fnuz": (ml_dtypes.float8_e5m2fnuz, float(ml_dtypes.finfo(ml_dtypes.float8_e5m2fnuz).max)),
}
HIST_LO, HIST_HI = -40, 23


def _flush(d: np.ndarray) -> np.ndarray:
    """XLA on CPU flushes float32 subnormals to zero; mirror it there."""
    if jax.default_backend() == "cpu":
        d = np.where(np.abs(d) < np.finfo(np.float32).tiny, np.float32(0), d)
    return d


def reference(data, formats=tuple(FORMATS)) -> dict[str, float]:
    d = _flush(np.asarray(data).astype(np.float32).ravel())
    n = d.size
    fin = np.isfinite(d)
    x = d[fin].astype(np.float64)
    out = {
        "count": n,
        "rms": np.sqrt(np.mean(x * x)) if x.size else np.nan,
        "absmax": np.max(np.abs(x)) if x.size else np.nan,
        "mean": np.mean(x) if x.size else np.nan,
        "std": np.std(x) if x.size else np.nan,
        "frac_zero": np.mean(d == 0),
        "frac_nonfinite": np.mean(~fin),
        "min": np.min(x) if x.size else np.nan,
        "max": np.max(x) if x.size else np.nan,
    }
    nonzero = np.abs(x[x != 0])
    out["absmin"] = np.min(nonzero) if nonzero.size else np.nan
    # Transformer Engine's dynamic_range: log2(amax) - log2(nonzero amin)
    out["dynamic_range"] = (
        np.log2(out["absmax"]) - np.log2(out["absmin"]) if nonzero.size else np.nan
    )
    for name in formats:
        dtype, fmax = {**FORMATS, **FNUZ}[name]
        info = ml_dtypes.finfo(dtype)
        min_normal = float(info.smallest_normal)
        q = np.zeros_like(d, dtype=np.float64)
        q[fin] = np.clip(d[fin], -fmax, fmax).astype(dtype).astype(np.float64)
        aq = np.abs(q)
        out[f"underflow_{name}"] = np.mean(fin & (d != 0) & (q == 0))
        out[f"subnormal_{name}"] = np.mean(fin & (aq > 0) & (aq < min_normal))
        with np.errstate(invalid="ignore"):
            out[f"overflow_{name}"] = np.mean(np.abs(d) > fmax)
        err2 = np.sum((x - q[fin]) ** 2)
        sig = np.sum(x * x)
        if x.size == 0:  # no finite element: no signal to compare against
            out[f"snr_{name}"] = np.nan
        else:
            out[f"snr_{name}"] = np.inf if err2 == 0 else 10 * np.log10(sig / err2)
    hist = np.zeros(HIST_HI - HIST_LO + 5, np.int64)
    hist[0] = np.sum(d == 0)
    hist[-1] = np.sum(~fin)
    nz = np.abs(d[fin & (d != 0)]).astype(np.float64)
    e = np.floor(np.log2(nz)).astype(int)
    hist[1] = np.sum(e < HIST_LO)
    hist[-2] = np.sum(e > HIST_HI)
    for k in range(HIST_LO, HIST_HI + 1):
        hist[2 + k - HIST_LO] = np.sum(e == k)
    out["hist"] = hist
    return out
