"""Precision policies from the what-if, and what the what-if predicts for a policy.

`recommend_policy` turns the what-if's per-value verdicts into a `Policy`: each matmul
operand (``OpRecord.gemm``) in the cheapest recipe that keeps it safe, BF16 where none
does (and nothing where BF16 does not either), written as few rules as the labels allow
(layer indices become ``*`` where every layer gets the same target). `predict_policy`
says, for each value a policy reaches, whether the what-if calls its target safe there:
the prediction `scalescope.verify` sets beside the measured loss gap.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np
import pandas as pd

from ..core.policy import UNREACHABLE, Policy, Rule, glob_regex, unique_labels
from .whatif import CHEAPEST, whatif_groups

#: Passes whose matmul operands a recommendation covers (weights are ``input`` values).
RECOMMEND_PASSES = ("input", "fwd", "bwd")
#: What `predict_policy` returns per reached value.
PREDICTION_COLUMNS = ("op", "label", "target", "safe", "reason")


def op_label_series(ops: pd.DataFrame) -> pd.Series:
    """The rule-matching label of every op (`unique_labels`), indexed by op id."""
    ops = ops.sort_index()
    labels = unique_labels(list(ops["pass"].astype(str)), list(ops["name"].astype(str)))
    return pd.Series(labels, index=ops.index, name="label")


def _reachable(ops: pd.DataFrame) -> np.ndarray:
    note = ops["note"].astype(str) if "note" in ops.columns else pd.Series("", index=ops.index)
    return ~note.isin(UNREACHABLE).to_numpy()


def _stats_op(ops: pd.DataFrame) -> pd.Series:
    """The op whose statistics stand for each op (itself, or an alias's source)."""
    if "stats_op" not in ops.columns:
        return pd.Series(ops.index, index=ops.index)
    return ops["stats_op"].astype(np.int64)


def _verdict(whatif: pd.DataFrame, op: int, target: str) -> tuple[bool | None, str]:
    """(safe, reason) of ``target`` for the statistics of op ``op``; None when the run
    did not measure it (an op without statistics, or a target not recorded)."""
    if target == "fp32":
        return True, "ok (kept as computed)"
    if op < 0 or op not in whatif.index:
        return None, "no statistics (constant or not recorded)"
    if (target, "safe") not in whatif.columns:
        return None, f"{target} not recorded in this run"
    return bool(whatif.at[op, (target, "safe")]), str(whatif.at[op, (target, "reason")])


def predict_policy(policy: Policy, whatif: pd.DataFrame, ops: pd.DataFrame) -> pd.DataFrame:
    """For each op ``policy`` reaches: its ``label``, ``target``, ``safe`` (the
    what-if's verdict of the target on the op's statistics; None where it has none) and
    the ``reason``. A rule that reaches no op is a `PolicyError` (`Policy.describe`)."""
    policy.describe(ops, strict=True)
    labels = op_label_series(ops)
    stats_op = _stats_op(ops.sort_index())
    reach = _reachable(ops.sort_index())
    rows = []
    for (op, label), ok in zip(labels.items(), reach):
        target = policy.target(label) if ok else None
        if target is None:
            continue
        safe, reason = _verdict(whatif, int(stats_op[op]), target)
        rows.append((int(op), label, target, safe, reason))
    return pd.DataFrame(rows, columns=list(PREDICTION_COLUMNS))


def predicted_verdict(prediction: pd.DataFrame) -> str:
    """``"unsafe"`` when the what-if calls any reached value's target unsafe, ``"safe"``
    when it calls them all safe, ``"unknown"`` when some were not measured."""
    safe = prediction["safe"]
    if (safe == False).any():  # noqa: E712 (None means not measured)
        return "unsafe"
    if len(safe) and safe.notna().all():
        return "safe"
    return "unknown"


_LAYER_INDEX = re.compile(r"(?<=[/_])\d+(?=/|$)|^\d+(?=/)")
_ANY_DIGITS = re.compile(r"\d+")


def _generalised(label: str, level: int) -> str:
    """``label`` as a glob over its layers: level 0 turns every run of digits into
    ``*`` (``fwd/block_*/ln_*/add#2``), level 1 only layer indices (a whole path part,
    or a part's ``_N`` ending: ``fwd/block_*/ln_1/add#2``); the ``#k`` occurrence suffix
    stays."""
    head, sep, tail = label.partition("#")
    rx = _ANY_DIGITS if level == 0 else _LAYER_INDEX
    return rx.sub("*", head) + sep + tail


def _compress(picks: dict[str, str], labels: Sequence[str], level: int = 0) -> list[Rule]:
    """Rules giving each label of ``picks`` its target, and no other label of ``labels``
    any: labels merged into one glob (`_generalised`) where every label that glob matches
    is picked with the same target, with a finer glob where not, else one rule each."""
    if level > 1:
        return [Rule(exact_pattern(label), target) for label, target in picks.items()]
    groups: dict[tuple[str, str], dict[str, str]] = {}
    for label, target in picks.items():
        groups.setdefault((_generalised(label, level), target), {})[label] = target
    rules = []
    for (pattern, target), members in groups.items():
        rx = re.compile(glob_regex(pattern))
        matched = [lab for lab in labels if rx.match(lab)]
        if len(members) > 1 and all(picks.get(lab) == target for lab in matched):
            rules.append(Rule(pattern, target))
        else:
            rules.extend(_compress(members, labels, level + 1))
    return rules


def exact_pattern(label: str) -> str:
    """A glob matching exactly ``label`` (its ``*?[`` made literal)."""
    return re.sub(r"([*?\[])", r"[\1]", label)


def _float_bits(dtype: str) -> int:
    """Bits of a floating-point dtype named ``dtype`` (float8 and float4 included; 0
    when it is not one)."""
    try:
        return int(ml_dtypes.finfo(dtype).bits)
    except (TypeError, ValueError):
        return 0


def _already_rounded(ops: pd.DataFrame, stats_op: pd.Series, keep: np.ndarray) -> list[str]:
    """Labels of the kept values that the step itself rounds: a value whose statistics are
    those of a narrower float (a cast's round trip, ``x.astype(float8).astype(float32)``,
    reads as an alias of the float8 value). A policy would round them again."""
    dtype = ops["dtype"].astype(str) if "dtype" in ops.columns else None
    if dtype is None:
        return []
    labels = op_label_series(ops)
    out = []
    for op, ok in zip(ops.index, keep):
        src = int(stats_op[op])
        if not ok or src == op or src not in dtype.index:
            continue
        narrow, wide = _float_bits(dtype[src]), _float_bits(dtype[op])
        if 0 < narrow < wide:
            out.append(f"{labels[op]} (widened from {dtype[src]})")
    return out


def recommend_policy(
    whatif: pd.DataFrame,
    ops: pd.DataFrame,
    *,
    passes: Sequence[str] = RECOMMEND_PASSES,
    gemm_only: bool = True,
    fallback: str = "bf16",
) -> Policy:
    """A policy from a `format_whatif` frame with recipes: each value of ``passes``
    (by default only the matmul operands, ``gemm``, held as the matmuls read them:
    ``recipe@matmul``) gets its cheapest safe recipe, else ``fallback`` where that is
    safe; values safe in neither get no rule (they stay as computed). Rules are merged
    across layers where the targets agree.

    Raises ValueError when the step itself rounds a value it would cover (a cast's
    round trip, as in a naive FP8 run: the policy would stack on that cast), when the
    frame holds no recipe (record with ``formats=(...,
    "mxfp8_e4m3", "nvfp4")``) or the op table no ``gemm`` column (a run recorded
    before scalescope marked matmul operands: pass ``gemm_only=False``)."""
    if (CHEAPEST, "") not in whatif.columns:
        raise ValueError(
            "recommend_policy: the run records no block-scaled recipe; record with "
            "formats=(..., 'mxfp8_e4m3', 'nvfp4', ...) to be recommended one"
        )
    if gemm_only and "gemm" not in ops.columns:
        raise ValueError(
            "recommend_policy: the op table does not mark matmul operands (a run recorded "
            "by an older scalescope); pass gemm_only=False to cover every value"
        )
    ops = ops.sort_index()
    labels = op_label_series(ops)
    stats_op = _stats_op(ops)
    keep = _reachable(ops) & ops["pass"].astype(str).isin(passes).to_numpy()
    if gemm_only:
        keep &= ops["gemm"].fillna(False).astype(bool).to_numpy()
    rounded = _already_rounded(ops, stats_op, keep)
    if rounded:
        raise ValueError(
            f"recommend_policy: {len(rounded)} matmul operand(s) of this run are already "
            f"rounded by the step itself (e.g. {rounded[0]}): a policy would round them "
            "again on top of those casts. Recommend from a run of the step without its "
            "casts (its fp32 run): the policy then stands in for them"
        )
    has_fallback = fallback in whatif_groups(whatif)
    picks: dict[str, str] = {}
    for op, ok in zip(ops.index, keep):
        src = int(stats_op[op])
        if not ok or src not in whatif.index:
            continue
        target = str(whatif.at[src, (CHEAPEST, "")])
        if not target and has_fallback and bool(whatif.at[src, (fallback, "safe")]):
            target = fallback
        if target:
            picks[labels[op]] = f"{target}@matmul" if gemm_only else target
    reachable = [lab for lab, ok in zip(labels, _reachable(ops)) if ok]
    return Policy(_compress(picks, reachable))


#: Columns of `matmul_table`.
MATMUL_COLUMNS = ("op", "label", "layer", "params", "fwd_operands", "bwd_gradients")


def _source(stats_op: pd.Series, op: int) -> int:
    return int(stats_op.get(op, op)) if op >= 0 else -1


def matmul_table(ops: pd.DataFrame, *, merge: bool = True) -> pd.DataFrame:
    """One row per forward matmul (``dot_general``) of a run's op table.

    Columns: ``op``, ``label``; ``layer``, with ``merge`` the label with layer indices
    as ``*`` (one name for the same matmul of every block), else the label; ``params``,
    True when an operand is an argument (a linear layer's weight); ``fwd_operands``, the
    op ids of the two values it reads; ``bwd_gradients``, those of the gradients its
    backward matmuls read (the backward-pass operands of the backward ``dot_general``
    ops that also read one of its operands or an alias of one). Needs the ``operands``
    column (runs recorded since scalescope marks matmul operands)."""
    if "operands" not in ops.columns:
        raise ValueError(
            "matmul_table: the op table has no 'operands' column (a run recorded by an older "
            "scalescope); record the run again"
        )
    ops = ops.sort_index()
    labels = op_label_series(ops)
    stats_op = _stats_op(ops)
    passes = ops["pass"].astype(str)
    dots = ops[ops["primitive"].astype(str) == "dot_general"]
    bwd = [
        (int(op), tuple(int(x) for x in reads))
        for op, reads in dots["operands"].items()
        if passes[op] == "bwd"
    ]
    rows = []
    for op, reads in dots["operands"].items():
        if passes[op] != "fwd":
            continue
        reads = tuple(int(x) for x in reads)
        sources = {_source(stats_op, x) for x in reads if x >= 0}
        grads: list[int] = []
        for _, other in bwd:
            if not sources & {_source(stats_op, x) for x in other if x >= 0}:
                continue
            grads += [x for x in other if x >= 0 and passes[x] == "bwd" and x not in grads]
        rows.append(
            (
                int(op),
                labels[op],
                _generalised(labels[op], 1) if merge else labels[op],
                any(x >= 0 and passes[x] == "input" for x in reads),
                reads,
                tuple(grads),
            )
        )
    return pd.DataFrame(rows, columns=list(MATMUL_COLUMNS))


def matmul_policy(
    ops: pd.DataFrame,
    layer: str | Sequence[str],
    target: str,
    *,
    direction: str = "fwd",
    merge: bool = True,
) -> Policy:
    """A policy holding the operands of the matmuls of ``layer`` (a `matmul_table`
    layer name, or several) in ``target`` as the matmuls read them (``target@matmul``: the optimizer
    and the residual path keep the values as computed): their forward operands
    (``direction="fwd"``) or the gradients their backward matmuls read (``"bwd"``)."""
    if direction not in ("fwd", "bwd"):
        raise ValueError(f"matmul_policy: direction must be 'fwd' or 'bwd', got {direction!r}")
    table = matmul_table(ops, merge=merge)
    wanted = [layer] if isinstance(layer, str) else list(layer)
    missing = [name for name in wanted if name not in set(table["layer"])]
    if missing or not wanted:
        known = ", ".join(sorted(set(table["layer"])))
        raise ValueError(f"matmul_policy: no matmul layer {missing or wanted!r}; layers: {known}")
    rows = table[table["layer"].isin(wanted)]
    labels = op_label_series(ops)
    column = "fwd_operands" if direction == "fwd" else "bwd_gradients"
    picked = dict.fromkeys(labels[x] for ids in rows[column] for x in ids if x >= 0)
    if not picked:
        raise ValueError(f"matmul_policy: layer {layer!r} has no {direction} operand to hold")
    return Policy([(exact_pattern(label), f"{target}@matmul") for label in picked])


def policy_text(rules: Sequence[Sequence[str]], shown: int = 3) -> str:
    """A policy (``[[pattern, target], ...]``) in a few words: its first rules, and how
    many more."""
    rules = list(rules)
    text = "; ".join(f"{p} -> {t}" for p, t in rules[:shown]) or "(no rule)"
    more = len(rules) - shown
    return text + (f"; and {more} more rule{'s' * (more > 1)}" if more > 0 else "")


def agreement(record: dict[str, Any]) -> str:
    """Whether a verification's measured verdict is the predicted one: ``yes``, ``no``
    or ``-`` (no prediction)."""
    predicted = record.get("predicted") or ""
    if predicted not in ("safe", "unsafe") or record.get("verdict") not in ("safe", "unsafe"):
        return "-"
    return "yes" if predicted == record.get("verdict") else "no"


def verification_line(record: dict[str, Any]) -> str:
    """One line for a kept verification (`RunReader.verifications`): the policy, the
    measured gap and verdict, and whether the what-if predicted it."""
    line = (
        f"policy {policy_text(record['policy'], 2)}: measured {100 * float(record['gap']):+.2f} %"
        f" over {record['steps']} steps ({record['verdict']})"
    )
    noise = record.get("noise")
    if noise is not None and noise == noise:  # not NaN
        line += f", noise floor {100 * float(noise):+.2f} %"
    if record.get("predicted"):
        line += f"; predicted {record['predicted']} (agrees: {agreement(record)})"
    return line
