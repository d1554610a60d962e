"""Precision policies: which values of a step to hold in which format or recipe.

A `Policy` is an ordered list of rules ``(pattern, target)``. A pattern matches the
probe's op labels (``pass/name``: ``fwd/blocks/0/mlp/dot_general``, ``bwd/loss/add_any``,
``opt/mul#3``, ``input/params/w``; `label_of`); the first rule
that matches an op decides its target, a format of `scalescope.formats` (``e4m3``,
``e5m2``, ``fp16``, ``bf16``, ``fp32``: fp32 keeps a value as it is) or a block-scaled
recipe of `scalescope.core.recipes` (``mxfp8_e4m3``, ``nvfp4``...). A target written
``mxfp8_e4m3@matmul`` rounds the value for the matmuls that read it only (what a
low-precision GEMM reads), while other ops (the optimizer updating a weight, a residual
path carrying a gradient) keep it as computed. ``nvfp4:0`` blocks a recipe along axis 0
instead of the probe's layout (a GEMM operand along its contracted axes, else the last).

Patterns are globs over the whole label: ``*`` matches within one ``/``-separated part,
``**`` across parts, ``?`` one character of a part, ``[...]`` a character class. A
pattern written ``re:<regex>`` is a Python regex searched in the label (as ``select``).

A policy is data: ``Policy.from_dict``, ``to_json``/``from_json`` round-trip it, and
``describe(op_table)`` says which ops each rule reaches, so that a rule that reaches
nothing (a typo, a renamed module) is an error naming the nearest op labels instead of a
silently unchanged run.
"""

from __future__ import annotations

import difflib
import json
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import formats as _formats
from . import recipes as _recipes

#: Version of the JSON layout written by `Policy.to_json`.
POLICY_VERSION = 1
_REGEX_PREFIX = "re:"


class PolicyError(ValueError):
    """A policy that cannot be used: a malformed rule or file, an unknown target, or a
    rule that reaches no op. The message names the rule and what to do."""


def targets() -> tuple[str, ...]:
    """Every name a rule may target: the formats, then the block-scaled recipes."""
    return tuple(_formats.names()) + tuple(_recipes.names())


def glob_regex(pattern: str) -> str:
    """The regex (anchored at both ends) of a glob over ``/``-separated labels: ``**``
    any characters, and as a whole part (``a/**/b``, ``**/b``) any number of parts, none
    included (``fwd/**/dot_general`` matches ``fwd/dot_general``); ``*`` any within one
    part, ``?`` one character of a part, ``[...]`` a class (``[!...]`` negated);
    everything else literal."""
    out, i, n = [], 0, len(pattern)
    while i < n:
        c = pattern[i]
        if pattern.startswith("**/", i) and (i == 0 or pattern[i - 1] == "/"):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            end = pattern.find("]", i + 2 if pattern.startswith("[!", i) else i + 1)
            if end < 0:
                raise PolicyError(f"pattern {pattern!r}: '[' at {i} has no closing ']'")
            body = pattern[i + 1 : end]
            if body.startswith("!"):
                body = "^" + body[1:]
            out.append("[" + body.replace("\\", "\\\\") + "]")
            i = end + 1
        else:
            out.append(re.escape(c))
            i += 1
    return "^" + "".join(out) + "$"


#: Who reads a rule's rounded value: every op (``all``, the value itself is held in the
#: target), or only the matmuls (``matmul``: what a low-precision GEMM reads, while the
#: optimizer and elementwise ops keep the value as computed). Written ``target@matmul``.
READS = ("all", "matmul")


@dataclass(frozen=True)
class Rule:
    """One rule of a `Policy`: ops whose label matches ``pattern`` get ``target``, read
    by every op or only by matmuls (``reads``), a recipe's blocks along ``axis`` (None:
    the probe's layout, a GEMM operand along its contracted axes, else the last axis).
    The target may be written with both: ``"mxfp8_e4m3:0@matmul"``."""

    pattern: str
    target: str
    reads: str = "all"
    axis: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str) or not self.pattern.strip():
            raise PolicyError(f"rule {self.pattern!r}: a pattern must be a non-empty string")
        if not isinstance(self.target, str):
            raise PolicyError(
                f"rule {self.pattern!r}: the target must be a format or recipe name, "
                f"got {type(self.target).__name__}"
            )
        if "@" in self.target:
            target, _, reads = self.target.partition("@")
            object.__setattr__(self, "target", target)
            object.__setattr__(self, "reads", reads)
        if ":" in self.target:
            target, _, axis = self.target.partition(":")
            try:
                value = int(axis)
            except ValueError:
                raise PolicyError(
                    f"rule {self.pattern!r}: ':{axis}' is not a block axis; write "
                    "'recipe:AXIS' with an integer axis (-1: the last)"
                ) from None
            object.__setattr__(self, "target", target)
            object.__setattr__(self, "axis", value)
        if self.reads not in READS:
            raise PolicyError(
                f"rule {self.pattern!r}: '@{self.reads}' is not a reader; write the target "
                f"alone (every op reads the rounded value) or with '@matmul'"
            )
        if self.target not in targets():
            near = difflib.get_close_matches(self.target, targets(), n=3)
            hint = f" (did you mean {', '.join(near)}?)" if near else ""
            raise PolicyError(
                f"rule {self.pattern!r}: unknown format or recipe {self.target!r}{hint}; "
                f"known: {', '.join(targets())}"
            )
        if self.axis is not None and not _recipes.is_recipe(self.target):
            raise PolicyError(
                f"rule {self.pattern!r}: a block axis applies to a recipe; {self.target!r} "
                "is a format (it rounds each element alone)"
            )
        try:
            object.__setattr__(self, "_rx", re.compile(self.regex))
        except re.error as err:
            raise PolicyError(f"rule {self.pattern!r}: not a valid regex: {err}") from None

    @property
    def spec(self) -> str:
        """The target as written: ``target[:axis][@matmul]``."""
        out = self.target if self.axis is None else f"{self.target}:{self.axis}"
        return out if self.reads == "all" else f"{out}@{self.reads}"

    @property
    def regex(self) -> str:
        """The pattern as a regex: after ``re:`` as written, a glob translated."""
        if self.pattern.startswith(_REGEX_PREFIX):
            return self.pattern[len(_REGEX_PREFIX) :]
        return glob_regex(self.pattern)

    def matches(self, label: str) -> bool:
        """True when ``label`` (``pass/name``) is one this rule reaches."""
        return self._rx.search(label) is not None  # type: ignore[attr-defined]


class Policy:
    """Ordered rules ``(pattern, target)``; the first rule matching an op's label wins
    (see the module docstring).

        policy = ss.Policy.from_dict({"fwd/**/mlp/dot_general": "mxfp8_e4m3",
                                      "bwd/**": "bf16"})
        policy.target("fwd/blocks/0/mlp/dot_general")   # 'mxfp8_e4m3'
    """

    def __init__(
        self, rules: Iterable[Rule | tuple[str, str] | Sequence[str]] | Mapping[str, str] = ()
    ) -> None:
        if isinstance(rules, Mapping):  # {pattern: target}, as from_dict
            rules = rules.items()
        built = []
        for i, rule in enumerate(rules):
            if isinstance(rule, Rule):
                built.append(rule)
                continue
            if isinstance(rule, str) or not isinstance(rule, Sequence) or len(rule) != 2:
                raise PolicyError(f"rule {i}: expected a (pattern, target) pair, got {rule!r}")
            built.append(Rule(rule[0], rule[1]))
        self.rules: tuple[Rule, ...] = tuple(built)

    @classmethod
    def from_dict(cls, mapping: Mapping[str, str]) -> Policy:
        """A policy from ``{pattern: target}``, rules in the mapping's order."""
        if not isinstance(mapping, Mapping):
            raise PolicyError(f"Policy.from_dict: expected a mapping, got {type(mapping).__name__}")
        return cls(mapping.items())

    def to_dict(self) -> dict[str, str]:
        """``{pattern: target}`` in rule order (a pattern used twice keeps its first rule,
        the only one that can match)."""
        out: dict[str, str] = {}
        for rule in self.rules:
            out.setdefault(rule.pattern, rule.spec)
        return out

    def to_json(self, path: str | Path | None = None) -> str:
        """The policy as JSON (``{"version": 1, "rules": [[pattern, target], ...]}``);
        also written to ``path`` when given (whole or not at all: a temporary file
        renamed into place)."""
        rules = ",\n".join(f"  {json.dumps([r.pattern, r.spec])}" for r in self.rules)
        text = (
            f'{{"version": {POLICY_VERSION}, "rules": [\n{rules}\n]}}'
            if rules
            else (f'{{"version": {POLICY_VERSION}, "rules": []}}')
        )
        if path is not None:
            path = Path(path)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(text + "\n")
            tmp.replace(path)
        return text

    @classmethod
    def from_json(cls, source: str | Path) -> Policy:
        """A policy from JSON text or a file: ``{"rules": [[pattern, target], ...]}``
        (what `to_json` writes) or a plain ``{pattern: target}`` object."""
        where = "policy"
        text = source
        if isinstance(source, Path) or (
            isinstance(source, str) and not source.lstrip().startswith(("{", "["))
        ):
            where = str(source)
            try:
                text = Path(source).read_text()
            except OSError as err:
                raise PolicyError(f"{where}: cannot read the policy file: {err}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise PolicyError(
                f"{where}: not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})"
            ) from None
        if isinstance(data, dict) and "rules" in data:
            version = data.get("version", POLICY_VERSION)
            if version != POLICY_VERSION:
                raise PolicyError(f"{where}: policy version {version!r}, expected {POLICY_VERSION}")
            rules = data["rules"]
            if not isinstance(rules, list):
                raise PolicyError(f"{where}: 'rules' must be a list of [pattern, target] pairs")
            try:
                return cls(rules)
            except PolicyError as err:
                raise PolicyError(f"{where}: {err}") from None
        if isinstance(data, dict):
            try:
                return cls.from_dict(data)
            except PolicyError as err:
                raise PolicyError(f"{where}: {err}") from None
        raise PolicyError(
            f"{where}: expected an object ({{pattern: target}} or {{'rules': [...]}}), "
            f"got {type(data).__name__}"
        )

    def rule_for(self, label: str) -> Rule | None:
        """The first rule reaching ``label``, or None."""
        for rule in self.rules:
            if rule.matches(label):
                return rule
        return None

    def target(self, label: str) -> str | None:
        """The format or recipe the first matching rule gives ``label``, or None."""
        if not isinstance(label, str):
            raise TypeError(f"target: an op label (a str), got {label!r}")
        rule = self.rule_for(label)
        return None if rule is None else rule.target

    def targets(self) -> tuple[str, ...]:
        """The formats and recipes the rules round values to, in rule order (``fp32``
        keeps a value as it is: not listed). A run that records them can judge them."""
        return tuple(dict.fromkeys(r.target for r in self.rules if r.target != "fp32"))

    def describe(self, ops: Any, *, strict: bool = True) -> list[dict[str, Any]]:
        """Which ops each rule reaches (first match wins): one dict per rule with its
        ``pattern``, ``target`` and ``ops`` (labels). ``ops``: an `OpTable`, a run's op
        frame (``reader.ops``: ``pass`` and ``name`` columns) or labels. Only values that
        carry floats are reached (integer and empty values are skipped). ``strict``: a
        rule that reaches no op is a `PolicyError` naming the nearest labels."""
        labels = op_labels(ops)
        reached: list[list[str]] = [[] for _ in self.rules]
        for label in labels:
            for i, rule in enumerate(self.rules):
                if rule.matches(label):
                    reached[i].append(label)
                    break
        if strict:
            for i, (rule, got) in enumerate(zip(self.rules, reached)):
                if not got:
                    raise PolicyError(_no_match(rule, labels, self.rules[:i], ops))
        return [
            {
                "pattern": r.pattern,
                "target": r.target,
                "reads": r.reads,
                "axis": r.axis,
                "ops": got,
            }  # fmt: skip
            for r, got in zip(self.rules, reached)
        ]

    def __iter__(self) -> Iterator[Rule]:
        return iter(self.rules)

    def __len__(self) -> int:
        return len(self.rules)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Policy) and self.rules == other.rules

    def __hash__(self) -> int:
        return hash(self.rules)

    def __repr__(self) -> str:
        inner = ", ".join(f"{r.pattern!r}: {r.spec!r}" for r in self.rules)
        return f"Policy({{{inner}}})"


def as_policy(policy: Policy | Mapping[str, str] | str | Path) -> Policy:
    """A `Policy` from a policy, a ``{pattern: target}`` mapping, or JSON text or a file
    (`Policy.from_json`)."""
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, Mapping):
        return Policy.from_dict(policy)
    if isinstance(policy, str | Path):
        return Policy.from_json(policy)
    raise PolicyError(
        "expected a Policy, a {pattern: target} mapping or a JSON policy (text or file), "
        f"got {type(policy).__name__}"
    )


#: Ops no rule can reach: no float elements to quantise, or a function output (the same
#: value as the op that computed it, which rules reach).
UNREACHABLE = ("not float", "empty", "output")


def label_of(pass_: str, name: str) -> str:
    """The label a rule matches: ``pass/name`` (``fwd/blocks/0/mlp/dot_general``); an
    input's name already starts with its pass (``input/params/w``)."""
    return name if name == pass_ or name.startswith(pass_ + "/") else f"{pass_}/{name}"


def unique_labels(passes: Sequence[str], names: Sequence[str]) -> list[str]:
    """One label per op, in op-id order: `label_of`, plus ``#k`` (its k-th occurrence,
    from 1) where several ops share it (``fwd/blocks/0/attn/dot_general#2``): the names
    the dashboard and the report show, without the shape."""
    base = [label_of(str(p), str(n)) for p, n in zip(passes, names, strict=True)]
    total = Counter(base)
    seen: Counter[str] = Counter()
    out = []
    for b in base:
        seen[b] += 1
        out.append(f"{b}#{seen[b]}" if total[b] > 1 else b)
    return out


def without_shape(label: str) -> str:
    """``label`` as the views show it (``fwd/dot_general#2 [16x64]``) without the shape:
    the unique label `unique_labels` gives."""
    return re.sub(r" \[[0-9x]*\]$", "", label)


def op_labels(ops: Any) -> list[str]:
    """Labels (`unique_labels`) of the ops a rule can reach, from an `OpTable`, a run's
    op frame (``pass``, ``name`` and optionally ``note`` columns, indexed by op id) or a
    list of labels: integer, empty and output values left out."""
    labels, notes = _labels_and_notes(ops)
    return [lab for lab, note in zip(labels, notes) if note not in UNREACHABLE]


def _labels_and_notes(ops: Any) -> tuple[list[str], list[str]]:
    """Every op's label and note (`op_labels` before leaving out the unreachable)."""
    if isinstance(ops, str):
        raise PolicyError("describe: expected an op table, an op frame or labels, got a str")
    if hasattr(ops, "ops") and not hasattr(ops, "columns"):  # an OpTable
        ops = ops.ops
    if hasattr(ops, "columns"):  # a frame
        if not {"pass", "name"} <= set(ops.columns):
            raise PolicyError("describe: the op frame needs 'pass' and 'name' columns")
        ops = ops.sort_index()
        passes, names = list(ops["pass"].astype(str)), list(ops["name"].astype(str))
        notes = list(ops["note"].astype(str)) if "note" in ops.columns else [""] * len(ops)
    else:
        ops = list(ops)
        if all(isinstance(op, str) for op in ops):
            return ops, [""] * len(ops)
        bad = [op for op in ops if not (hasattr(op, "pass_") and hasattr(op, "name"))]
        if bad:
            raise PolicyError(f"describe: cannot read an op label from {bad[0]!r}")
        passes, names = [op.pass_ for op in ops], [op.name for op in ops]
        notes = [getattr(op, "note", "") for op in ops]
    return unique_labels(passes, names), notes


def _no_match(
    rule: Rule, labels: Sequence[str], earlier: Sequence[Rule] = (), ops: Any = None
) -> str:
    """Why ``rule`` reaches nothing: every label it matches is taken by an ``earlier``
    rule (first match wins), or holds nothing to round (integers, booleans, empty
    values: from ``ops``), or it matches none (the nearest labels)."""
    mine = [lab for lab in labels if rule.matches(lab)]
    if not mine and ops is not None:
        every, notes = _labels_and_notes(ops)
        idle = [lab for lab, note in zip(every, notes) if note in UNREACHABLE and rule.matches(lab)]
        if idle:
            return (
                f"rule {rule.pattern!r} -> {rule.spec!r} reaches no op: what it matches "
                f"({', '.join(idle[:3])}{' ...' if len(idle) > 3 else ''}) holds no float "
                "elements to round (integer, boolean or empty values, or a function output: "
                "name the op that computes the output)"
            )
    if mine:
        takers = list(dict.fromkeys(next(r.pattern for r in earlier if r.matches(lab))
                                    for lab in mine))  # fmt: skip
        return (
            f"rule {rule.pattern!r} -> {rule.spec!r} reaches no op: the {len(mine)} it "
            f"matches ({', '.join(mine[:3])}{' ...' if len(mine) > 3 else ''}) are taken by "
            f"the earlier rule{'s' if len(takers) > 1 else ''} {', '.join(map(repr, takers))} "
            "(the first matching rule wins: put the narrower rule first)"
        )
    shape = re.search(r" \[[0-9x]*\]$", rule.pattern)
    if shape is not None:
        bare = rule.pattern[: shape.start()]
        if any(Rule(bare, rule.spec).matches(lab) for lab in labels):
            return (
                f"rule {rule.pattern!r} -> {rule.spec!r} reaches no op: it ends in a shape, "
                f"as the report and the dashboard show a label; the rule names the label "
                f"alone: {bare!r}"
            )
    probe = rule.pattern.removeprefix(_REGEX_PREFIX).replace("*", "")
    near = difflib.get_close_matches(probe, list(dict.fromkeys(labels)), n=3, cutoff=0.3)
    hint = f"; nearest op names: {', '.join(near)}" if near else ""
    return f"rule {rule.pattern!r} -> {rule.spec!r} reaches no op{hint}"


__all__ = [
    "POLICY_VERSION",
    "READS",
    "UNREACHABLE",
    "Policy",
    "PolicyError",
    "Rule",
    "as_policy",
    "glob_regex",
    "label_of",
    "op_labels",
    "targets",
    "unique_labels",
]
