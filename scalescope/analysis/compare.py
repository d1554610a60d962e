"""Compare one metric between two runs whose op tables differ (an FP32 baseline and an
FP8 run differ by the convert and rescale ops the low-precision step inserts).

Ops are matched by ``(pass, name, primitive, shape)`` and, among the ops sharing that
key, by order of appearance: the k-th ``fwd/block_0/attn/dot_general [32x64x384]`` of
one run is the k-th of the other. Ops without a partner are reported, not guessed.

Mask fill values are not differences. Attention masks often stand for -inf with a
finite sentinel (``jnp.finfo(dtype).min``, ``-1e30``, ``-1e9 * large``): a value of
magnitude at least `FILL_MAGNITUDE` (1e30) in a statistic, or in an op's value abs-max
(``absmax * scale``: the op holds such a sentinel, which then dominates its RMS, abs-max,
SNR and clipping statistics), says nothing about precision, yet the sentinel of one run
(``finfo(float32).min``, 3.4e38) against the other's (``finfo(bfloat16).min`` or
``-1e30``) would rank first by any difference. Those rows keep their values but are left
out of the differences (``difference`` and ``log2_ratio`` are NaN, as for non-finite
values), flagged in the ``mask_fill`` column, and `largest_differences` never ranks them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from .frames import POSITIVE_METRICS, check_stats, metric_values, op_labels, op_table
from .relevance import FILL_MAGNITUDE, fill_rows

MATCH_KEY = ("pass", "name", "primitive", "shape")

__all__ = [
    "FILL_MAGNITUDE",
    "Comparison",
    "compare_readers",
    "compare_runs",
    "largest_differences",
    "mask_fills",
    "match_ops",
]


class Comparison(NamedTuple):
    """What `compare_runs` returns; unpacks as ``values, unmatched = compare_runs(...)``.

    ``values``: one row per matched op, step and loop iteration recorded in both runs.
    ``unmatched``: the ops of either run with no partner in the other."""

    values: pd.DataFrame
    unmatched: pd.DataFrame


def _check_names(names: Sequence[str]) -> tuple[str, str]:
    if (
        isinstance(names, str)
        or len(names) != 2
        or not all(isinstance(n, str) and n for n in names)
        or names[0] == names[1]
    ):
        raise ValueError(f"names: expected two distinct non-empty strings, got {names!r}")
    return str(names[0]), str(names[1])


def _keyed(ops: pd.DataFrame) -> pd.DataFrame:
    table = op_table(ops)
    shape = [tuple(int(d) for d in s) if s is not None else () for s in table["shape"]]
    keyed = pd.DataFrame(
        {
            "op": table.index.to_numpy(np.int64),
            "label": op_labels(table).to_numpy(),
            "pass": table["pass"].astype(str).to_numpy(),
            "name": table["name"].astype(str).to_numpy(),
            "primitive": table["primitive"].astype(str).to_numpy(),
            "shape": shape,
            "note": table["note"].to_numpy(),
        }
    )
    key = keyed[list(MATCH_KEY)].astype(str).agg("\x1f".join, axis=1) if len(keyed) else []
    keyed["key"] = key
    keyed["occurrence"] = keyed.groupby("key").cumcount() if len(keyed) else []
    return keyed


def match_ops(
    ops_a: pd.DataFrame, ops_b: pd.DataFrame, *, names: Sequence[str] = ("a", "b")
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Pair the ops of two op tables (see the module docstring).

    Returns ``(matches, unmatched)``: ``matches`` has ``op_<a>``, ``op_<b>``, ``label``
    (of run a), pass, name, primitive, shape, one row per pair, in op order of run a;
    ``unmatched`` has ``run`` (the run's name), op, label, pass, name, primitive, shape
    and note (``""``: the op has statistics), ops of run a first."""
    a, b = _check_names(names)
    ka, kb = _keyed(ops_a), _keyed(ops_b)
    merged = ka.merge(
        kb[["key", "occurrence", "op"]],
        on=["key", "occurrence"],
        how="outer",
        suffixes=(f"_{a}", f"_{b}"),
        indicator=True,
    )
    both = merged[merged["_merge"] == "both"].sort_values(f"op_{a}")
    matches = both[[f"op_{a}", f"op_{b}", "label", "pass", "name", "primitive", "shape"]]
    matches = matches.astype({f"op_{a}": np.int64, f"op_{b}": np.int64}).reset_index(drop=True)
    only_a = merged.loc[merged["_merge"] == "left_only", f"op_{a}"]
    only_b = merged.loc[merged["_merge"] == "right_only", f"op_{b}"]
    cols = ["op", "label", "pass", "name", "primitive", "shape", "note"]
    unmatched = pd.concat(
        [
            ka.set_index("op").loc[only_a.astype(np.int64)].reset_index()[cols].assign(run=a),
            kb.set_index("op").loc[only_b.astype(np.int64)].reset_index()[cols].assign(run=b),
        ],
        ignore_index=True,
    )
    return matches, unmatched[["run", *cols]]


def compare_runs(
    stats_a: pd.DataFrame,
    ops_a: pd.DataFrame,
    stats_b: pd.DataFrame,
    ops_b: pd.DataFrame,
    metric: str,
    *,
    names: Sequence[str] = ("a", "b"),
) -> Comparison:
    """One metric (recorded or derived, e.g. ``value_rms``) of the matched ops of two runs.

    Returns a `Comparison` (a named tuple: ``values, unmatched = compare_runs(...)``).
    ``values`` columns: ``op_<a>``, ``op_<b>``, label (run a's), pass, name, primitive,
    step, iteration, ``value_<a>``, ``value_<b>``, ``difference`` (b - a) and, for
    metrics that are never negative (rms, absmax, scale, std, count, value_*),
    ``log2_ratio`` = log2(b / a), and ``mask_fill``: True where either run's value is a
    mask fill or comes from an op holding one (a finite magnitude >= `FILL_MAGNITUDE`
    in the metric, or in the op's value abs-max ``absmax * scale`` when recorded; see the
    module docstring): there ``difference`` and ``log2_ratio`` are NaN, so that no
    ranking puts a sentinel first. Only steps and loop iterations recorded in both runs
    appear. ``unmatched``: see `match_ops`. With the default ``names`` the columns are
    ``value_a``/``value_b``."""
    a, b = _check_names(names)
    stats_a = check_stats(stats_a, "stats_a")
    stats_b = check_stats(stats_b, "stats_b")
    matches, unmatched = match_ops(ops_a, ops_b, names=(a, b))

    def values(stats: pd.DataFrame, run: str) -> pd.DataFrame:
        value = metric_values(stats, metric).to_numpy(np.float64)
        return pd.DataFrame(
            {
                f"op_{run}": stats["op"].to_numpy(np.int64),
                "step": stats["step"].to_numpy(np.int64),
                "iteration": stats["iteration"].to_numpy(np.int64),
                f"value_{run}": value,
                f"_fill_{run}": mask_fills(stats, value),
            }
        )

    out = matches.drop(columns="shape").merge(values(stats_a, a), on=f"op_{a}")
    out = out.merge(values(stats_b, b), on=[f"op_{b}", "step", "iteration"])
    fill = out.pop(f"_fill_{a}").to_numpy(bool) | out.pop(f"_fill_{b}").to_numpy(bool)
    out["difference"] = np.where(fill, np.nan, out[f"value_{b}"] - out[f"value_{a}"])
    if metric in POSITIVE_METRICS:
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.log2(out[f"value_{b}"] / out[f"value_{a}"])
        out["log2_ratio"] = np.where(fill, np.nan, ratio)
    out["mask_fill"] = fill
    out = out.sort_values([f"op_{a}", "step", "iteration"], kind="stable")
    return Comparison(out.reset_index(drop=True), unmatched)


def mask_fills(stats: pd.DataFrame, values: np.ndarray | None = None) -> np.ndarray:
    """Per row of a wide statistics frame: whether it is, or comes from, a mask fill
    value (see the module docstring and `scalescope.analysis.relevance.fill_rows`)."""
    return fill_rows(stats, values)


def largest_differences(values: pd.DataFrame, names: Sequence[str] = ("a", "b")) -> pd.DataFrame:
    """One row per matched op of a `compare_runs` frame at the last step recorded in
    both runs, largest difference first: ``op_<a>``, label, step, ``value_<a>``,
    ``value_<b>`` (max over loop iterations) and ``log2_ratio`` (metrics that are never
    negative) or ``difference`` (the iteration of larger magnitude). Mask fills
    (``mask_fill``) and non-finite differences are never ranked: those ops come last,
    with a NaN difference."""
    a, b = _check_names(names)
    diff = "log2_ratio" if "log2_ratio" in values.columns else "difference"
    cols = [f"op_{a}", "label", "step", f"value_{a}", f"value_{b}", diff]
    if values.empty:
        return pd.DataFrame(columns=cols)
    last = values[values["step"].to_numpy() == values["step"].max()]
    d = last[diff].to_numpy(np.float64)
    if "mask_fill" in last.columns:
        d = np.where(last["mask_fill"].to_numpy(bool), np.nan, d)
    d = np.where(np.isfinite(d), d, np.nan)
    key = np.abs(d)
    frame = pd.DataFrame(
        {
            f"op_{a}": last[f"op_{a}"].to_numpy(np.int64),
            "label": last["label"].to_numpy(),
            "step": last["step"].to_numpy(np.int64),
            f"value_{a}": last[f"value_{a}"].to_numpy(np.float64),
            f"value_{b}": last[f"value_{b}"].to_numpy(np.float64),
            diff: d,
            "_key": np.where(np.isnan(key), -1.0, key),
        }
    )
    # per op: the iteration of largest |difference| (first on ties), the values' max
    order = np.lexsort((-frame["_key"].to_numpy(), frame[f"op_{a}"].to_numpy()))
    frame = frame.iloc[order]
    per_op = frame.drop_duplicates(f"op_{a}").set_index(f"op_{a}")
    grouped = frame.groupby(f"op_{a}", sort=False)
    per_op[f"value_{a}"] = grouped[f"value_{a}"].max()
    per_op[f"value_{b}"] = grouped[f"value_{b}"].max()
    per_op = per_op.reset_index()
    rank = np.argsort(-per_op["_key"].to_numpy(), kind="stable")
    return per_op.iloc[rank][cols].reset_index(drop=True)


def compare_readers(
    reader_a: Any, reader_b: Any, metric: str, *, names: Sequence[str] | None = None
) -> Comparison:
    """`compare_runs` of two recorded runs (names default to the runs' names, or
    ``a``/``b`` when those are equal)."""
    if names is None:
        names = (reader_a.name, reader_b.name)
        if names[0] == names[1] or not all(names):
            names = ("a", "b")
    return compare_runs(
        reader_a.stats(wide=True),
        reader_a.ops,
        reader_b.stats(wide=True),
        reader_b.ops,
        metric,
        names=names,
    )
