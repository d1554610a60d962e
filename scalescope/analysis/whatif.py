"""Format what-if: would each op survive a cast to FP8 / FP16 / BF16, or a block-scaled
FP8 / FP4 recipe?

Every recorded op is audited against every format on the device (overflow, underflow,
SNR of the cast), whether or not the run casts it, and against every recipe the run
records (``formats=("mxfp8_e4m3", "nvfp4", ...)``: clipped and flushed elements, flushed
blocks, SNR); this module turns those statistics into a verdict per op and format or
recipe, with the reason, names the cheapest recipe that keeps each op safe, and counts
verdicts per pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd

from .frames import (
    check_stats,
    format_list,
    op_table,
    pass_rank,
    recorded_recipes,
    require_columns,
    worst_by_op,
)
from .masks import fill_ops, mask_ops
from .percent import pct
from .thresholds import Thresholds

WHATIF_FIELDS = ("safe", "reason", "snr", "overflow", "underflow")
#: Fields of a recipe's column group (a format's, plus its worst flushed-block fraction).
RECIPE_FIELDS = (*WHATIF_FIELDS, "block_flush")
#: Column of `format_whatif` naming each op's cheapest safe recipe ("" when none is).
CHEAPEST = "cheapest recipe"


def _last_steps(stats: pd.DataFrame, last_steps: int | None) -> pd.DataFrame:
    if last_steps is None:
        return stats
    if isinstance(last_steps, bool) or not isinstance(last_steps, int | np.integer):
        raise TypeError(f"last_steps: expected an int or None, got {last_steps!r}")
    if last_steps < 1:
        raise ValueError(f"last_steps: must be >= 1, got {last_steps}")
    keep = np.unique(stats["step"].to_numpy())[-last_steps:]
    return stats[stats["step"].isin(keep)]


# -- reasons, built only where a criterion fails -------------------------------------------

#: One criterion: where it fails (bool per op) and the text of each failing op's value.
Failure = tuple[np.ndarray, Callable[[np.ndarray], list[str]]]


def _reasons(n: int, failures: Sequence[Failure]) -> np.ndarray:
    """``"ok"`` or the failing criteria joined by ``"; "``, per op (object array). The
    text of a criterion is formatted for the ops where it fails only."""
    out = np.full(n, "", dtype=object)
    for fails, text in failures:
        idx = np.flatnonzero(fails)
        if not len(idx):
            continue
        head = out[idx]
        sep = np.where(head == "", "", "; ").astype(object)
        out[idx] = head + sep + np.asarray(text(idx), dtype=object)
    out[out == ""] = "ok"
    return out


def _fraction(kind: str, values: np.ndarray) -> Callable[[np.ndarray], list[str]]:
    return lambda idx: [f"{kind} {pct(v)}" for v in values[idx]]


def _snr_text(values: np.ndarray, threshold: np.ndarray) -> Callable[[np.ndarray], list[str]]:
    return lambda idx: [f"snr {v:.1f} dB < {t:g} dB" for v, t in zip(values[idx], threshold[idx])]


def _verdicts(
    worst: pd.DataFrame,
    name: str,
    nonfinite: np.ndarray,
    thresholds: Thresholds,
    meta: dict[str, Any] | None,
    recipe: bool,
    gradient: np.ndarray,
) -> pd.DataFrame:
    """The column group of one format or recipe from the per-op worst statistics.

    A format fails on NaN/inf data, overflow above ``thresholds.overflow``, underflow
    above ``thresholds.underflow`` or SNR under its threshold; a recipe on NaN/inf data,
    SNR under ``thresholds.recipe_snr_db``, clipping above ``thresholds.recipe_overflow``
    or underflow above ``thresholds.recipe_underflow`` (its flushed blocks are shown,
    their cost is in the SNR); a ``gradient`` (backward value, per op) in a recipe under
    the stricter `Thresholds.recipe_limits`."""
    over = worst[f"overflow_{name}"].to_numpy()
    under = worst[f"underflow_{name}"].to_numpy()
    snr = worst[f"snr_{name}"].to_numpy()
    limits = [thresholds.recipe_limits(name, meta, gradient=g) for g in (False, True)]
    snr_thr = np.where(gradient, limits[1][0], limits[0][0])
    under_thr = np.where(gradient, limits[1][1], limits[0][1])
    with np.errstate(invalid="ignore"):  # NaN (no finite element) fails nothing
        failures: list[Failure] = [
            (nonfinite > thresholds.nonfinite, _fraction("nonfinite", nonfinite)),
            (over > thresholds.overflow_for(name), _fraction("overflow", over)),
            (under > under_thr, _fraction("underflow", under)),
            (snr < snr_thr, _snr_text(snr, snr_thr)),
        ]
        if recipe:
            flush = worst[f"block_flush_{name}"].to_numpy()
    reason = _reasons(len(worst), failures)
    group = {"safe": reason == "ok", "reason": reason, "snr": snr, "overflow": over}
    group["underflow"] = under
    if recipe:
        group["block_flush"] = flush
    return pd.DataFrame(group, index=worst.index)


def format_whatif(
    stats: pd.DataFrame,
    ops: pd.DataFrame,
    formats: str | Sequence[str] | None = None,
    *,
    thresholds: Thresholds | None = None,
    last_steps: int | None = None,
    meta: dict[str, Any] | None = None,
) -> pd.DataFrame:
    """Verdict per op (index: op id, ascending) and format or recipe (default: every
    audited format, then every recorded recipe, of ``stats``).

    Columns: a MultiIndex ``(format, field)`` with fields ``safe`` (bool), ``reason``
    (``"ok"`` or the failures joined by ``"; "``: ``"nonfinite 100.0%"``,
    ``"overflow 0.3%"``, ``"underflow 4.1%"``, ``"snr 12.3 dB < 25.5 dB"``,
    ``"block_flush 2.0%"``), ``snr`` (worst dB), ``overflow`` and ``underflow`` (worst
    fractions); a recipe's group also has ``block_flush`` (worst fraction of flushed
    blocks). With recipes, a last column ``("cheapest recipe", "")`` (``whatif["cheapest
    recipe"]`` is a Series) names each op's cheapest safe recipe (`cheapest_recipe`; ""
    when none is safe).

    The worst value over all recorded steps and loop iterations decides (only the last
    ``last_steps`` recorded steps when given). An op whose data already holds NaN/inf is
    not safe in any format or recipe (neither can repair it), unless it is a mask (the
    same share of -inf at every recorded step, as the advisor's nonfinite rule sees it).
    A format is safe when it
    overflows at most ``thresholds.overflow``, underflows at most ``thresholds.underflow``
    and keeps its SNR at or above ``thresholds.snr_for(format)``; a recipe when it keeps
    its SNR at or above ``thresholds.recipe_snr_db``, clips at most
    ``thresholds.recipe_overflow`` and flushes at most ``thresholds.recipe_underflow``
    of its non-zero elements (see `Thresholds`: recipes are judged by the noise they
    add, clipping and flushed blocks included), a gradient (a ``bwd`` value) to
    ``thresholds.recipe_grad_snr_db`` (8-bit elements) and
    ``thresholds.recipe_grad_underflow`` when those are stricter
    (`Thresholds.recipe_limits`). ``thresholds``: the advisor's
    (`Thresholds`); ``meta``: run metadata, only to derive the SNR threshold of a format
    missing from ``thresholds.snr_db``.

    Vectorised: the worst values come from one pass per column (`worst_by_op`) and the
    reasons are formatted for failing (op, criterion) pairs only.
    """
    thresholds = Thresholds() if thresholds is None else thresholds
    if not isinstance(thresholds, Thresholds):
        raise TypeError(f"thresholds: expected a Thresholds, got {type(thresholds).__name__}")
    stats = _last_steps(check_stats(stats), last_steps)
    table = op_table(ops)
    names = format_list(formats, stats, "formats", recipes=True)
    recipes = set(recorded_recipes(stats))
    unknown = np.setdiff1d(stats["op"].unique(), table.index.to_numpy())
    if len(unknown):
        raise KeyError(f"ops: op id {int(unknown[0])} appears in stats but not in ops")
    columns: dict[str, Any] = {}
    if "frac_nonfinite" in stats.columns:
        columns["frac_nonfinite"] = "max"
    for name in names:
        columns |= {f"overflow_{name}": "max", f"underflow_{name}": "max", f"snr_{name}": "min"}
        if name in recipes:
            columns[f"block_flush_{name}"] = "max"
    worst = worst_by_op(stats, columns)
    ids = worst.index
    nonfinite = np.zeros(len(ids))
    if "frac_nonfinite" in worst:
        # a mask (-inf by construction, the same share at every step) stays a mask in any
        # format: only values that went bad are unsafe everywhere
        nonfinite = worst["frac_nonfinite"].to_numpy(np.float64, copy=True)
        masks = _masks(stats, thresholds.mask_min_steps, fill_ops(table))
        nonfinite[ids.isin(masks)] = 0.0
    gradient = (table["pass"].astype(str) == "bwd").reindex(ids, fill_value=False).to_numpy()
    parts = {
        name: _verdicts(worst, name, nonfinite, thresholds, meta, name in recipes, gradient)
        for name in names
    }
    if not parts:
        columns_ = pd.MultiIndex.from_arrays([[], []], names=["format", "field"])
        return pd.DataFrame(index=pd.Index(ids, name="op"), columns=columns_)
    out = pd.concat(parts, axis=1, names=["format", "field"])
    out.index.name = "op"
    if any(name in recipes for name in names):
        out[(CHEAPEST, "")] = cheapest_recipe(out).to_numpy()
    return out


def _masks(stats: pd.DataFrame, min_steps: int, fills: np.ndarray) -> np.ndarray:
    """Op ids holding a mask (`scalescope.analysis.mask_ops`: the same non-finite share,
    below 1, at every one of at least ``min_steps`` recorded steps)."""
    bad = stats["frac_nonfinite"].to_numpy(np.float64) > 0
    if not bad.any():
        return np.zeros(0, np.int64)
    ops = np.unique(stats["op"].to_numpy()[bad])
    rows = stats[stats["op"].isin(ops)]
    per_step = rows.groupby(["op", "step"])["frac_nonfinite"].max()
    return mask_ops(per_step, min_steps, fills)


# -- recipes: which is cheapest ------------------------------------------------------------


def recipe_cost(name: str) -> tuple[int, int, int, int]:
    """Sort key of a recipe, cheapest first: fewer bits per element; then one scale per
    tensor before scales per block; then larger blocks (fewer scales to store and apply)
    first; then `scalescope.core.recipes.RECIPES` order."""
    from ..core import recipes

    r = recipes.get(name)
    order = list(recipes.RECIPES).index(r.name)
    return (r.bits, 0 if r.per_tensor else 1, -r.block * r.rows, order)


def whatif_groups(whatif: pd.DataFrame) -> list[str]:
    """Formats and recipes of a `format_whatif` frame (its column groups with a verdict),
    in column order."""
    if not isinstance(whatif.columns, pd.MultiIndex) or whatif.columns.nlevels != 2:
        raise ValueError("whatif: expected a format_whatif frame ((format, field) columns)")
    return [n for n in dict.fromkeys(whatif.columns.get_level_values(0)) if (n, "safe") in whatif]


def whatif_recipes(whatif: pd.DataFrame) -> list[str]:
    """Recipes of a `format_whatif` frame (the groups with a ``block_flush`` field),
    cheapest first (`recipe_cost`)."""
    names = [n for n in whatif_groups(whatif) if (n, "block_flush") in whatif]
    return sorted(names, key=recipe_cost)


def cheapest_recipe(whatif: pd.DataFrame) -> pd.Series:
    """Per op of a `format_whatif` frame, the cheapest recipe (`recipe_cost`) that keeps
    it safe, ``""`` when none does (or the frame has no recipe). One argmax over an
    ops x recipes boolean matrix."""
    names = whatif_recipes(whatif)
    if not names:
        return pd.Series("", index=whatif.index, dtype=object, name=CHEAPEST)
    safe = np.column_stack([whatif[(n, "safe")].to_numpy(bool) for n in names])
    first = np.asarray(names, dtype=object)[safe.argmax(axis=1)]
    return pd.Series(np.where(safe.any(axis=1), first, ""), index=whatif.index, name=CHEAPEST)


def _check_ops(whatif: pd.DataFrame, ops: pd.DataFrame) -> pd.Series:
    """The pass of each op of ``whatif`` (str), after checking ``ops`` holds them."""
    require_columns(ops, ("pass",), "ops")
    missing = whatif.index.difference(ops.index)
    if len(missing):
        raise KeyError(f"ops: op id {int(missing[0])} of whatif is not in ops")
    return ops["pass"].reindex(whatif.index).astype(str)


def verdict_counts(
    whatif: pd.DataFrame, ops: pd.DataFrame, *, as_text: bool = False
) -> pd.DataFrame:
    """Safe ops per pass and format or recipe, from a `format_whatif` frame: index pass
    (input, fwd, bwd, opt, ... then ``all``), columns ``(format, "safe")`` and ``(format,
    "total")`` (ints). ``as_text=True``: one column per format holding ``"safe/total"``,
    for the report's summary table."""
    formats = whatif_groups(whatif)
    passes = _check_ops(whatif, ops)
    order = pass_rank(passes)
    data = {}
    for fmt in formats:
        safe = whatif[(fmt, "safe")].astype(bool)
        by_pass = safe.groupby(passes.to_numpy())
        data[(fmt, "safe")] = by_pass.sum().reindex(order).tolist() + [int(safe.sum())]
        data[(fmt, "total")] = by_pass.size().reindex(order).tolist() + [len(safe)]
    index = pd.Index(order + ["all"], name="pass")
    columns = pd.MultiIndex.from_tuples(data.keys(), names=["format", "count"])
    out = pd.DataFrame(data, index=index, columns=columns).astype(np.int64)
    if as_text:
        text = {
            f: out[(f, "safe")].astype(str) + "/" + out[(f, "total")].astype(str) for f in formats
        }
        return pd.DataFrame(text, index=index)
    return out


def cheapest_counts(whatif: pd.DataFrame, ops: pd.DataFrame) -> pd.DataFrame:
    """Ops per pass whose cheapest safe recipe is each recipe, from a `format_whatif`
    frame: index pass (as `verdict_counts`, then ``all``), one int column per recipe,
    cheapest first, then ``none`` (no recipe keeps the op safe). No column at all when the
    frame has no recipe."""
    names = whatif_recipes(whatif)
    passes = _check_ops(whatif, ops)
    order = pass_rank(passes)
    index = pd.Index(order + ["all"], name="pass")
    if not names:
        return pd.DataFrame(index=index)
    if whatif.empty:
        return pd.DataFrame(0, index=index, columns=[*names, "none"], dtype=np.int64)
    pick = cheapest_recipe(whatif).replace("", "none")
    table = pd.crosstab(passes.to_numpy(), pick.to_numpy())
    table = table.reindex(index=order, columns=[*names, "none"], fill_value=0)
    table.loc["all"] = table.sum(axis=0)
    table.index.name, table.columns.name = "pass", None
    return table.astype(np.int64)


def block_scales(stats: pd.DataFrame, recipes: Sequence[str]) -> pd.DataFrame:
    """The block-scale range of each recipe per step, for the rows of one op: the
    smallest ``scale_log2_min_R`` and the largest ``scale_log2_max_R`` over its loop
    iterations (NaN skipped). Index: step; columns as in ``stats`` (absent ones left
    out)."""
    how: dict[str, str] = {}
    for r in recipes:
        how |= {f"scale_log2_min_{r}": "min", f"scale_log2_max_{r}": "max"}
    how = {c: h for c, h in how.items() if c in stats.columns}
    return stats.groupby("step")[list(how)].agg(how).astype(np.float64)


def recipe_elements(recipes: Sequence[str]) -> dict[str, Any]:
    """Each recipe's element `Format` (`scalescope.core.recipes`): the exponent range a
    block holds, drawn by `scalescope.viz.scale_ranges`."""
    from ..core import recipes as _recipes

    return {r: _recipes.get(r).element for r in recipes}


def recipe_rule_text(thresholds: Thresholds) -> str:
    """The rule a block-scaled recipe is judged safe by, in words, with ``thresholds``'
    numbers (what the report and the dashboard print beside the recipe verdicts)."""
    t = thresholds
    clip = (
        "its clipping is judged through the SNR"
        if t.recipe_overflow >= 1
        else f"it clips at most {pct(t.recipe_overflow)} of the elements"
    )
    return (
        "A block-scaled recipe is safe for an op when, at every recorded step, its "
        f"quantisation SNR stays at or above {t.recipe_snr_db:g} dB (a recipe's own entry "
        "in the SNR thresholds where it has one; the SNR counts what it clips and what "
        f"its flushed blocks lose), {clip}, it flushes at most {pct(t.recipe_underflow)} "
        "of the non-zero values to zero and the op holds no NaN/inf. A gradient (a "
        "backward value) is held to more, since a weight gradient adds its errors up over "
        f"every token: an SNR at or above {t.recipe_grad_snr_db:g} dB with 8-bit elements, "
        f"and at most {pct(t.recipe_grad_underflow)} flushed."
    )
