"""A made-up run in the store's layout, written without JAX: for tests of the views and
the analysis that need a run of a given size, not a real recording."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa


def synthetic_run(path: Path, n_ops: int, n_steps: int, part_steps: int = 50) -> None:
    """A run directory in the store's layout (run.json, ops.parquet, stats parts with
    every statistic of four formats and exponent histograms, a logged loss), with
    made-up values: a few ops drift, overflow E4M3 or underflow E5M2."""
    from scalescope.core import formats as F
    from scalescope.probe.kernel import HIST_COLUMNS, HIST_HI, HIST_LO, StatSpec
    from scalescope.store import layout as L

    fmts = ("e4m3", "e5m2", "fp16", "bf16")
    stat_names = StatSpec(formats=tuple(F.get(f) for f in fmts)).stat_names()
    path.mkdir(parents=True)
    rng = np.random.default_rng(0)
    passes = np.where(np.arange(n_ops) < n_ops // 2, "fwd", "bwd")
    passes[-n_ops // 10 :] = "opt"
    prims = np.array(["dot_general", "add", "mul", "tanh", "reduce_sum"])[np.arange(n_ops) % 5]
    cast = np.where(prims == "dot_general", np.where(passes == "fwd", "e4m3", "e5m2"), "")
    records = [
        {
            "op": i,
            "name": f"block_{i // 50}/{prims[i]}",
            "pass": str(passes[i]),
            "primitive": str(prims[i]),
            "shape": [64, 256],
            "dtype": "float32",
            "scaled": True,
            "note": "",
            "stats_op": i,
            "row_start": i,
            "n_rows": 1,
            "loop": [],
            "in_while": False,
            "in_cond": False,
            "source": f"model.py:{10 + i % 300}",
            "cast_to": str(cast[i]),
        }
        for i in range(n_ops)
    ]
    meta = {
        "format": L.FORMAT_NAME,
        "version": L.FORMAT_VERSION,
        "name": path.name,
        "status": "closed",
        "config": {"steps": n_steps},
        "every": 1,
        "formats": list(fmts),
        "format_info": {
            f: {
                "max": F.get(f).max,
                "min_normal": F.get(f).min_normal,
                "min_subnormal": F.get(f).min_subnormal,
                "mantissa_bits": F.get(f).mantissa_bits,
            }
            for f in fmts
        },
        "histograms": True,
        "hist_columns": list(HIST_COLUMNS),
        "hist_exponents": [HIST_LO, HIST_HI],
        "stat_names": list(stat_names),
        "graph": {"scalify": True, "n_ops": n_ops, "n_rows": n_ops},
    }
    L.write_json_atomic(path / L.RUN_FILE, meta)
    L.write_parquet_atomic(path / L.OPS_FILE, L.ops_table(L.ops_frame(records)))
    drift = np.zeros(n_ops)
    drift[rng.choice(n_ops, n_ops // 50, replace=False)] = 0.03  # log2 rms per step
    base = rng.normal(0.0, 1.0, n_ops)
    for seq, first in enumerate(range(0, n_steps, part_steps)):
        steps = np.arange(first, min(first + part_steps, n_steps))
        rows = len(steps) * n_ops
        l2 = (base[None, :] + drift[None, :] * steps[:, None]).ravel()
        rms = np.exp2(l2).astype(np.float32)
        cols = {
            "step": np.repeat(steps, n_ops).astype(np.int64),
            "op": np.tile(np.arange(n_ops, dtype=np.int32), len(steps)),
            "iteration": np.zeros(rows, np.int32),
            "process": np.zeros(rows, np.int32),
        }
        for name in stat_names:
            if name.startswith("snr_"):
                fmt = name[4:]
                value = 6.02 * F.get(fmt).mantissa_bits + 13.5 - np.abs(l2) * 2
            elif name in ("rms", "std"):
                value = rms
            elif name == "absmax":
                value = rms * 4
            elif name == "scale":
                value = np.ones(rows)
            elif name == "count":
                value = np.full(rows, 64 * 256)
            elif name.startswith("overflow_"):
                value = np.where(l2 > 6, 0.01, 0.0)
            elif name.startswith("underflow_"):
                value = np.where(l2 < -6, 0.05, 0.0)
            else:
                value = np.zeros(rows)
            cols[name] = np.asarray(value, np.float32)
        hist = np.zeros((rows, len(HIST_COLUMNS)), np.int32)
        centre = np.clip(np.floor(l2).astype(int) - HIST_LO + 2, 2, len(HIST_COLUMNS) - 3)
        for shift, count in ((-2, 1000), (-1, 5000), (0, 8000), (1, 2000), (2, 384)):
            hist[np.arange(rows), centre + shift] += count
        for i, col in enumerate(L.hist_column_names(len(HIST_COLUMNS))):
            cols[col] = hist[:, i]
        L.write_parquet_atomic(path / L.STATS_DIR / L.part_name(seq, 0), pa.table(cols))
    scalars = pa.table(
        {
            "step": pa.array(np.arange(n_steps), pa.int64()),
            "name": pa.array(["loss"] * n_steps),
            "value": pa.array(3.0 / (1 + np.arange(n_steps) / 50), pa.float64()),
            "process": pa.array(np.zeros(n_steps, np.int32)),
        }
    )
    L.write_parquet_atomic(path / L.SCALARS_DIR / L.part_name(0, 0), scalars)
