"""The op table: one record per value the probe saw, computed at trace time."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: Why an op has no statistics of its own (``OpRecord.note``); "" when it has rows.
NOTES = {
    "": "recorded: statistics in rows row_start .. row_start + n_rows",
    "alias": "same elements as op stats_op (data movement or an exact widening cast)",
    "const": "computed from constants only",
    "not float": "integer or boolean value",
    "empty": "zero elements",
    "unselected": "left out by `select`",
    "output": "a function output: statistics of op stats_op",
}


@dataclass(eq=False)
class OpRecord:
    """One value of the instrumented function.

    ``name`` is the scope path from JAX's name stack plus the primitive
    (``block_0/attn/dot_general``); ``pass_`` is ``fwd``, ``bwd``, ``opt`` (or another
    pass scope), ``input`` names are ``input/<argument path>``. ``loop`` lists the lengths
    of the enclosing scans (outermost first): the op has ``prod(loop)`` rows, one per
    iteration. Inside a while loop (``in_while``) a row aggregates every iteration; inside
    a cond branch (``in_cond``) a row is NaN with count 0 when the branch did not run.
    ``cast_to`` names the format (``e4m3``, ``e5m2``, ``fp16``, ``bf16``) a later op
    rounds this value to (a ``convert_element_type`` that loses precision), or "";
    ``cast_at`` that cast's ``file:line``.
    ``group``: the value group a masked recording switches this op's statistics with
    (see `instrument`'s ``groups``), -1 when not recorded or not grouped.
    ``gemm``: a ``dot_general`` reads this value as an operand (a matmul input: what an
    FP8 training quantises, and what `RunReader.recommend_policy` gives a recipe).
    ``operands``: for a ``dot_general``, the op ids of the two values it reads (-1 for a
    constant), so that a policy can reach the inputs of one matmul.
    ``origin``: "constant" for a value computed from constants and non-float inputs only
    (optax's bias corrections and schedules, from the step count), "fill" for one that
    holds a large constant fill (a mask's -1e9 or ``finfo.min``, and what keeps it
    elementwise, e.g. softmax's ``s - max(s)``), "" otherwise. The advisor judges neither
    kind's scale (they are constant by construction), only the formats they are cast to.
    "scaled_cast" marks code that scales into a narrow format itself: a clip at the
    format's max that a cast to it reads (its statistics are those of the value before
    the clip, so that its overflow is the share clipped) and that cast. "guarded": every
    reader is a ``jnp.where`` (``where(x > 0, c / x, d)``): NaN/inf it holds may be
    discarded by design.

    Inside a ``shard_map`` body ``shape`` is one device's shape and ``varying`` names the
    manual mesh axes along which the value differs between devices: its statistics cover
    every device's piece along those axes, and one copy along the others (where the value
    is the same on every device).
    """

    name: str
    pass_: str
    primitive: str
    shape: tuple[int, ...]
    dtype: str
    scaled: bool
    source: str
    note: str = ""
    id: int = -1
    stats_op: int = -1
    row_start: int = -1
    n_rows: int = 0
    loop: tuple[int, ...] = ()
    in_while: bool = False
    in_cond: bool = False
    cast_to: str = ""
    #: the ``file:line`` of that cast (the value may be made at another line)
    cast_at: str = ""
    group: int = -1
    varying: tuple[str, ...] = ()
    block_axes: tuple[int, ...] = ()
    origin: str = ""
    gemm: bool = False
    operands: tuple[int, ...] = ()
    alias_of: OpRecord | None = field(default=None, repr=False)
    #: Op ids whose statistics describe this op's float inputs: what an incident quotes
    #: as the inputs of its op, and the data flow a NaN/Inf is followed along
    #: (`reach`).
    inputs: tuple[int, ...] = field(default=(), repr=False)
    #: every float input of the op is among ``inputs`` (none is a value without a record,
    #: such as a loop's output): what an incident needs to say the op made a NaN/Inf
    inputs_complete: bool = field(default=False, repr=False)
    #: the op id among ``inputs`` whose exact zeros make this op infinite (``log(x)``,
    #: ``rsqrt(x)``, the divisor of ``a / x`` and of ``1 / x``, ``x ** -2``), -1 for none
    #: (in memory only: what an incident names when such an op made a NaN/Inf)
    zero_pole: int = field(default=-1, repr=False)
    #: the enclosing scans, outermost first, as ``(scan, reverse)`` (in memory only): a
    #: scan's serial number in this table and whether it runs its iterations last first
    #: (the transpose of a scan does), so that rows can be put in the order they ran
    scans: tuple[tuple[int, bool], ...] = field(default=(), repr=False)

    @property
    def recorded(self) -> bool:
        return self.note == ""

    @property
    def label(self) -> str:
        """``pass/name``: what `select` regexes are matched against."""
        return f"{self.pass_}/{self.name}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "op": self.id,
            "name": self.name,
            "pass": self.pass_,
            "primitive": self.primitive,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "scaled": self.scaled,
            "source": self.source,
            "note": self.note,
            "stats_op": self.stats_op,
            "row_start": self.row_start,
            "n_rows": self.n_rows,
            "loop": list(self.loop),
            "in_while": self.in_while,
            "in_cond": self.in_cond,
            "cast_to": self.cast_to,
            "cast_at": self.cast_at,
            "group": self.group,
            "origin": self.origin,
            "gemm": self.gemm,
            "operands": list(self.operands),
            "inputs": list(self.inputs),
        }


@dataclass
class OpTable:
    """Every op of an instrumented function and the layout of its ``stats``.

    ``stats[name][r]`` is statistic ``name`` of row ``r``; ``row_op[r]`` is the op id and
    ``row_iter[r]`` the flat iteration index (row-major over ``OpRecord.loop``) of that
    row. Rows are sorted by op id, then iteration.
    """

    ops: list[OpRecord]
    row_op: np.ndarray
    row_iter: np.ndarray
    stat_names: tuple[str, ...]
    formats: tuple[str, ...]
    hist_columns: tuple[str, ...] | None
    n_groups: int = 0
    group_elements: tuple[int, ...] = ()
    #: The op id of each value in the order the interpretation made them (-1 for a value
    #: of a loop body interpreted again, whose first interpretation left no op): how
    #: `emulate` finds, while it interprets the function, the op a value belongs to.
    sequence: tuple[int, ...] = ()

    @property
    def row_group(self) -> np.ndarray:
        """The group of each row (-1 where statistics are not grouped)."""
        groups = np.array([op.group for op in self.ops], np.int32)
        return groups[self.row_op] if len(groups) else np.zeros(0, np.int32)

    def __len__(self) -> int:
        return len(self.ops)

    def __iter__(self) -> Iterator[OpRecord]:
        return iter(self.ops)

    def __getitem__(self, op: int) -> OpRecord:
        return self.ops[op]

    @property
    def n_rows(self) -> int:
        return int(self.row_op.shape[0])

    def find(self, pattern: str) -> list[OpRecord]:
        """Ops whose ``pass/name`` matches the regex ``pattern`` (`re.search`)."""
        rx = re.compile(pattern)
        return [op for op in self.ops if rx.search(op.label)]

    def rows(self, op: int | OpRecord) -> slice:
        """Rows holding the statistics of ``op`` (its own, or its source's for an alias
        or output); an empty slice when it has none."""
        rec = op if isinstance(op, OpRecord) else self.ops[op]
        if rec.stats_op < 0:
            return slice(0, 0)
        src = self.ops[rec.stats_op]
        return slice(src.row_start, src.row_start + src.n_rows)

    def to_records(self) -> list[dict[str, Any]]:
        return [op.as_dict() for op in self.ops]

    def to_frame(self):
        """The op table as a pandas DataFrame indexed by op id."""
        import pandas as pd

        return pd.DataFrame(self.to_records()).set_index("op")


def stats_frame(table: OpTable, stats: dict[str, Any], names: Sequence[str] | None = None):
    """Scalar statistics as a long-by-row pandas DataFrame: op, iteration, name, pass,
    primitive and one column per statistic."""
    import pandas as pd

    if not isinstance(table, OpTable):
        hint = " (the arguments are (table, stats))" if isinstance(stats, OpTable) else ""
        raise TypeError(f"stats_frame: table must be an OpTable, got {type(table).__name__}{hint}")
    names = list(names or table.stat_names)
    frame = pd.DataFrame({name: np.asarray(stats[name]) for name in names})
    frame.insert(0, "iteration", table.row_iter)
    frame.insert(0, "op", table.row_op)
    meta = pd.DataFrame(
        {
            "name": [op.name for op in table.ops],
            "pass": [op.pass_ for op in table.ops],
            "primitive": [op.primitive for op in table.ops],
        }
    )
    return frame.join(meta, on="op")
