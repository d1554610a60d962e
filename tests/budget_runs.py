"""Runs as an overhead budget or element sampling leaves them, made from any recorded run
for the view tests: `sparsify` drops the rows of the (op, step) pairs a rotating budget
would not have measured and writes the new metadata keys (``statistics``, ``budget``) and
op-table column (``group``)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from scalescope.store import layout as L


def measured_at(op: np.ndarray, index: np.ndarray, period: int) -> np.ndarray:
    """Whether op ``op`` is measured at the ``index``-th recorded step when a budget
    measures each op every ``period``-th recorded step, the ops taking turns."""
    return (np.asarray(op) + np.asarray(index)) % period == 0


def sparsify(
    src: Path,
    dst: Path,
    *,
    period: int = 3,
    statistics: str | None = None,
    budget: float | None = None,
    sample: int | None = None,
    group: bool = True,
    keep: Any = None,
) -> Path:
    """Copy run ``src`` to ``dst`` keeping only the rows of the (op, step) pairs of
    `measured_at` (``period`` 1 keeps every row; ``keep(op, step_index)`` overrides), and
    set the metadata keys given (None: left out, as an old run has them)."""
    shutil.copytree(src, dst)
    meta = L.read_metadata(dst)
    for k in ("statistics", "budget"):
        meta.pop(k, None)
    if statistics is not None:
        meta["statistics"] = statistics
    if budget is not None:
        meta["budget"] = budget
    meta["sample"] = sample
    meta["name"] = Path(dst).name
    L.write_json_atomic(dst / L.RUN_FILE, meta)
    if group:
        ops = pd.read_parquet(dst / L.OPS_FILE)
        ops["group"] = np.where(ops["stats_op"] >= 0, ops["op"] % 2, -1).astype(np.int64)
        L.write_parquet_atomic(dst / L.OPS_FILE, L.ops_table(ops.set_index("op")))
    parts = L.list_parts(dst / L.STATS_DIR)
    steps = np.unique(
        np.concatenate([pq.read_table(p, columns=["step"])["step"].to_numpy() for p in parts])
    )
    for part in parts:
        table = pq.read_table(part)
        op = table["op"].to_numpy()
        index = np.searchsorted(steps, table["step"].to_numpy())
        mask = keep(op, index) if keep is not None else measured_at(op, index, period)
        L.write_parquet_atomic(part, table.filter(np.asarray(mask, bool)))
    return dst
