"""Heatmap rows grouped by module path and pass, collapsible.

A model of 12-100 layers has tens of thousands of ops: one heatmap row per op is
unreadable. `group_keys` gives each op a group, ``pass/scope`` cut at a depth (the
op's name without its primitive: ``block_0/attn/dot_general`` in the forward pass is in
``fwd/block_0`` at depth 1, ``fwd/block_0/attn`` at depth 2; a numeric path component
stays with its parent, so ``layers/3/mlp/mul`` is in ``fwd/layers/3`` at depth 1).
`group_matrix` turns an op x step matrix into rows: a *collapsed* group is one row whose
cell at each step is its worst member's value for the metric (the metric's bad direction,
`scalescope.analysis.metric_direction`: max of a fraction, min of an SNR, larger
magnitude of a log2, mean where a metric has no bad direction), and names that member; an
*expanded* group shows its members' rows. Groups come in the order of their first op.
Values constant by construction (a mask's fill, optimizer scalars) form a group of their
own beside their scope's, so a collapsed row's worst member is a value that is judged.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from .frames import metric_direction, require_columns
from .relevance import constant_ops

#: Above this many ops a heatmap opens with its groups collapsed (below: expanded, one
#: row per op as before).
COLLAPSE_ABOVE = 300

#: Group depth the views start with.
DEFAULT_DEPTH = 1


def scope_key(name: str, pass_: str, depth: int) -> str:
    """The group key of one op: ``pass`` then the first ``depth`` components of the
    name's scope path (the name without its last component, the primitive; a leading
    component equal to the pass is dropped; a numeric component joins its parent)."""
    parts = str(name).split("/")[:-1]
    if parts and parts[0] == pass_:
        parts = parts[1:]
    levels: list[str] = []
    for part in parts:
        if part.isdigit() and levels:
            levels[-1] += "/" + part
        else:
            levels.append(part)
    return "/".join([str(pass_), *levels[: max(depth, 0)]])


#: Appended to the group key of ops constant by construction (mask fills, optimizer
#: scalars: `scalescope.analysis.relevance`), which form groups of their own: a collapsed
#: row shows its worst member, and a -1e9 fill would otherwise be every step's worst.
CONSTANTS_SUFFIX = " (constants)"


def group_keys(ops: pd.DataFrame, depth: int = DEFAULT_DEPTH) -> pd.Series:
    """Group key per op id (`scope_key` of each row of the op table); ops constant by
    construction get their scope's key with `CONSTANTS_SUFFIX`."""
    require_columns(ops, ("name", "pass"), "ops")
    if depth < 0:
        raise ValueError(f"depth: must be >= 0, got {depth}")
    keys = [scope_key(n, p, depth) for n, p in zip(ops["name"], ops["pass"])]
    out = pd.Series(keys, index=ops.index, name="group", dtype=object)
    constant = out.index.isin(constant_ops(ops))
    out[constant] = out[constant] + CONSTANTS_SUFFIX
    return out


def max_depth(ops: pd.DataFrame) -> int:
    """The deepest group depth that still splits some group (1 when names have no
    scope)."""
    if not len(ops):
        return 1
    depth = 1
    while depth < 16:
        if group_keys(ops, depth + 1).nunique() == group_keys(ops, depth).nunique():
            break
        depth += 1
    return depth


@dataclass
class GroupedMatrix:
    """The rows of a grouped heatmap (see the module docstring).

    ``values``: rows x columns (float64, NaN: no value); ``measured``: rows x columns,
    True where some (member) op was measured (None when not known); ``columns``: the
    steps; per row: ``keys`` (its group), ``ops`` (op id; -1 for a collapsed group row),
    ``sizes`` (ops in the group), ``collapsed`` (bool); ``worst``: rows x columns, the op id
    of the member holding a collapsed row's value (-1 elsewhere, and for a ``mean``
    metric); ``groups``: every group key in row order, ``expanded``: those expanded."""

    values: np.ndarray
    measured: np.ndarray | None
    columns: np.ndarray
    keys: np.ndarray
    ops: np.ndarray
    sizes: np.ndarray
    collapsed: np.ndarray
    worst: np.ndarray
    groups: list[str]
    expanded: frozenset[str]

    @property
    def group_starts(self) -> np.ndarray:
        """First row of each group (in row order)."""
        if not len(self.keys):
            return np.zeros(0, np.int64)
        new = np.ones(len(self.keys), bool)
        new[1:] = self.keys[1:] != self.keys[:-1]
        return np.flatnonzero(new)


def default_expanded(n_ops: int, groups: Sequence[str]) -> frozenset[str]:
    """Every group when there are at most `COLLAPSE_ABOVE` ops, none otherwise."""
    return frozenset(groups) if n_ops <= COLLAPSE_ABOVE else frozenset()


def group_matrix(
    matrix: pd.DataFrame,
    groups: pd.Series,
    metric: str,
    expanded: Collection[str] | None = None,
    measured: pd.DataFrame | np.ndarray | None = None,
) -> GroupedMatrix:
    """Rows of ``matrix`` (index: op id, columns: steps) grouped by ``groups`` (op id ->
    key, `group_keys`); ``expanded``: keys shown op by op (None: `default_expanded`).

    A collapsed row's cell is the worst member value in ``metric``'s direction over the
    members measured there (``measured``, aligned with ``matrix``; None: every cell
    counts); a measured NaN makes it NaN (non-finite data is worse than any number), and
    ``worst`` names that member (the first in op order on a tie)."""
    ops = matrix.index.to_numpy(np.int64)
    dtype = np.float32 if len(matrix.dtypes) and (matrix.dtypes == np.float32).all() else np.float64
    values = matrix.to_numpy(dtype)
    mask = _mask(matrix, measured)
    key_of = groups.reindex(ops)
    if key_of.isna().any():
        missing = ops[key_of.isna().to_numpy()][:3].tolist()
        raise KeyError(f"groups: no group for op(s) {missing}")
    codes, uniques = pd.factorize(key_of.to_numpy(object))  # order of first appearance
    names = [str(n) for n in uniques]
    sizes = np.bincount(codes, minlength=len(names)).astype(np.int64)
    opened = frozenset(default_expanded(len(ops), names) if expanded is None else expanded)
    # A group of one op is shown as that op: collapsing it would hide its name.
    is_open = np.array([n in opened for n in names], bool) | (sizes == 1)
    expanded_keys = frozenset(n for n in names if n in opened)
    if is_open.all():  # every op on its own row, in op order (a small run, as before)
        return GroupedMatrix(
            values=values,
            measured=mask,
            columns=matrix.columns.to_numpy(np.int64),
            keys=np.asarray(names, object)[codes] if len(ops) else np.zeros(0, object),
            ops=ops,
            sizes=sizes[codes],
            collapsed=np.zeros(len(ops), bool),
            worst=np.full(values.shape, -1, np.int64),
            groups=names,
            expanded=expanded_keys,
        )
    if (np.diff(codes) < 0).any():  # members of a group not contiguous: sort by group
        order = np.argsort(codes, kind="stable")
        codes, ops, values = codes[order], ops[order], values[order]
        mask = None if mask is None else mask[order]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    n_rows = int(np.where(is_open, sizes, 1).sum())
    n_cols = values.shape[1]
    out = np.empty((n_rows, n_cols), dtype)
    out_mask = None if mask is None else np.empty((n_rows, n_cols), bool)
    worst = np.full((n_rows, n_cols), -1, np.int64)
    row_ops = np.full(n_rows, -1, np.int64)
    row_group = np.empty(n_rows, np.int64)
    direction = metric_direction(metric)
    row = 0
    for g, (start, size) in enumerate(zip(starts, sizes)):
        block = slice(start, start + size)
        if is_open[g]:
            out[row : row + size] = values[block]
            if out_mask is not None:
                out_mask[row : row + size] = mask[block]
            row_ops[row : row + size] = ops[block]
            row_group[row : row + size] = g
            row += size
            continue
        here = None if mask is None else mask[block]
        value, pick = _worst_rows(values[block], here, direction)
        out[row] = value
        if out_mask is not None:
            out_mask[row] = here.any(axis=0)
        if pick is not None:
            worst[row] = np.where(pick >= 0, ops[block][np.maximum(pick, 0)], -1)
        row_group[row] = g
        row += 1
    collapsed = row_ops < 0
    return GroupedMatrix(
        values=out,
        measured=out_mask,
        columns=matrix.columns.to_numpy(np.int64),
        keys=np.asarray(names, object)[row_group] if n_rows else np.zeros(0, object),
        ops=row_ops,
        sizes=sizes[row_group],
        collapsed=collapsed,
        worst=worst,
        groups=names,
        expanded=expanded_keys,
    )


def _worst_rows(
    block: np.ndarray, here: np.ndarray | None, direction: str
) -> tuple[np.ndarray, np.ndarray | None]:
    """Worst value per column of one group's member rows in ``direction`` over the
    measured cells (``here``; None: all), and the member row holding it (-1: none measured;
    None for ``mean``). NaN is worse than any number: a measured NaN wins."""
    cols = np.arange(block.shape[1])
    count = block.shape[0] if here is None else here.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        if direction == "mean":
            total = block.sum(axis=0) if here is None else np.where(here, block, 0).sum(axis=0)
            return np.where(count > 0, total / np.maximum(count, 1), np.nan), None
        hi_src = block if here is None else np.where(here, block, -np.inf)
        lo_src = block if here is None else np.where(here, block, np.inf)
        if direction in ("max", "abs"):
            hi_at = hi_src.argmax(axis=0)  # argmax/argmin stop at the first NaN
            hi = hi_src[hi_at, cols]
        if direction in ("min", "abs"):
            lo_at = lo_src.argmin(axis=0)
            lo = lo_src[lo_at, cols]
        if direction == "max":
            value, pick = hi, hi_at
        elif direction == "min":
            value, pick = lo, lo_at
        else:
            take_hi = (np.abs(hi) >= np.abs(lo)) | np.isnan(hi)
            value, pick = np.where(take_hi, hi, lo), np.where(take_hi, hi_at, lo_at)
    none = count == 0
    value = value.astype(block.dtype, copy=True)
    value[none] = np.nan
    return value, np.where(none, -1, pick)


def _mask(matrix: pd.DataFrame, measured: pd.DataFrame | np.ndarray | None) -> np.ndarray | None:
    if measured is None:
        return None
    if isinstance(measured, pd.DataFrame):
        aligned = measured.reindex(index=matrix.index, columns=matrix.columns, fill_value=False)
        return aligned.to_numpy(bool)
    mask = np.asarray(measured, bool)
    if mask.shape != matrix.shape:
        raise ValueError(f"measured: shape {mask.shape} differs from the matrix's {matrix.shape}")
    return mask
