"""The probe's observer: decides what to record while scalify interprets a function.

Each loop or branch body is a *scope* with its own list of values, reduced in one fused
pass at the end of the body and handed out as extra body outputs (stacked by scan,
folded by while, per branch by cond). Calls (jit, custom derivatives, remat) share their
caller's scope. Op ids and rows are assigned once the whole function is interpreted, by
walking scopes in order of appearance, so a body traced twice (scalify retraces loop
bodies when a carry becomes scaled) never leaves a trace in the table.

Values whose statistics are known without a reduction are not recorded: data movement
and exact widening casts point at their source (``alias``), values computed from
constants only are skipped (XLA would constant-fold their statistics at great compile
cost), as are integer and boolean values.

Inside a ``shard_map`` body each device sees its shard of a value. The body is a scope of
its own; its raw statistics are reduced across the manual mesh axes before they leave the
body (`kernel.across_devices`), so every row describes the whole (global) value. A value
that JAX types as invariant along an axis (``check_vma``: the same on every device) is
counted once, from the devices at index 0 of that axis; a scaled value whose scale
differs between devices is first re-expressed in the largest scale (exact powers of
two), as the collective rules do. Without ``check_vma`` typing nothing tells replicated
values apart: every value is taken as varying along every manual axis, so counts (and
histogram counts) of replicated values are multiplied by the number of copies, while
moments, maxima and fractions are unaffected.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Literal, jaxprs_in_params

from ..core import formats as _formats
from ..core.pow2 import is_static
from ..core.scaled_array import ScaledArray
from ..scalify.common import positive_or_one, rescale_data
from ..scalify.interpreter import Observer, explicit_sharding
from ..scalify.registry import get_rule
from ..scalify.rules_collective import check_vma_of, manual_axes, to_varying, varying_axes
from ..scalify.source import in_optimizer
from . import blocking, kernel, native, provenance
from .names import PASS_SCOPES, Scope, gradient_comm, op_name, parse, pass_of
from .optable import OpRecord, OpTable

#: Primitives whose output holds exactly the input's elements (each repeated equally
#: often), so every statistic equals the input's.
ALIAS_PRIMITIVES = frozenset(
    {
        "reshape",
        "transpose",
        "squeeze",
        "expand_dims",
        "broadcast_in_dim",
        "copy",
        "copy_p",
        "optimization_barrier",
        "rev",
    }
)


def _is_float(dtype: Any) -> bool:
    return dtype is not None and jax.dtypes.issubdtype(dtype, np.floating)


def _exact_widening(src: Any, dst: Any) -> bool:
    """A float-to-float cast that changes no value."""
    if not (_is_float(src) and _is_float(dst)):
        return False
    s, d = jax.dtypes.finfo(src), jax.dtypes.finfo(dst)
    return d.nmant >= s.nmant and d.maxexp >= s.maxexp and d.minexp <= s.minexp


#: Narrow float dtypes -> format name, for ``OpRecord.cast_to``.
#: Elementwise primitives (and data movement): a value they compute from the step's inputs
#: alone (``b1 * mu``, ``wd * p``, a weight's cast) is cheap to recompute where it is used.
_ELEMENTWISE = ALIAS_PRIMITIVES | {
    "abs",
    "add",
    "add_any",
    "clamp",
    "convert_element_type",
    "div",
    "exp",
    "exp2",
    "integer_pow",
    "log",
    "log2",
    "max",
    "min",
    "mul",
    "neg",
    "pow",
    "reduce_precision",
    "rsqrt",
    "select_n",
    "sign",
    "slice",
    "sqrt",
    "square",
    "sub",
}

_CAST_FORMATS = {
    np.dtype(_formats.get(name).dtype): _formats.get(name).name
    for name in ("e4m3", "e5m2", "e4m3fnuz", "e5m2fnuz", "fp16", "bf16")
}


#: Smallest magnitude of a constant that counts as a fill (``jnp.where(mask, s, -1e9)``):
#: the usual mask fills are -1e4 (FP16-safe), -1e9, -1e30, ``finfo.min`` and -inf.
FILL_MIN = 1e4
#: Primitives that mix a constant into a value elementwise: with a large static operand
#: and a computed one, their output holds a fill (``where(mask, s, -1e9)``, ``s + bias``).
#: Not max/min: ``max(x, -inf)`` (softmax's row max) holds x, not the constant.
_FILL_MAKERS = frozenset({"select_n", "add", "sub"})
#: Primitives whose output still holds the fill of an operand (softmax's ``s - max(s)``,
#: a rescaled or converted fill); exp, reductions and products with other values end it.
_FILL_KEEPS = _FILL_MAKERS | {
    "max",
    "min",
    "add_any",
    "neg",
    "mul",
    "div",
    "convert_element_type",
    "reduce_precision",
    "clamp",
}


def _is_big(value: Any) -> bool:
    """A concrete float constant holding a magnitude of `FILL_MIN` or more (or inf/NaN);
    False for anything abstract."""
    try:
        arr = np.asarray(value)
    except Exception:  # a tracer: not a constant known at trace time
        return False
    if arr.size == 0 or not _is_float(arr.dtype):
        return False
    with np.errstate(invalid="ignore", over="ignore"):
        mag = np.abs(arr.astype(np.float64))
    return bool(np.any(~np.isfinite(mag) | (mag >= FILL_MIN)))


def _fills(prim: str, invars: Sequence[Any], ins: Sequence[_Info | None]) -> bool:
    """Whether the output of ``prim`` holds a constant fill: an operand holds one and
    ``prim`` keeps it (`_FILL_KEEPS`), or ``prim`` mixes a large static operand (a
    literal, a constant, or a value computed from constants and integer inputs such as
    an attention mask) into a computed one (`_FILL_MAKERS`)."""
    if prim not in _FILL_KEEPS:
        return False
    if any(i is not None and i.fill for i in ins):
        return True
    if prim not in _FILL_MAKERS:
        return False
    big = dynamic = False
    for var, i in zip(invars, ins):
        if isinstance(var, Literal):
            big |= _is_big(var.val)
        elif i is not None and i.static:
            big |= i.big
        elif _is_float(getattr(var.aval, "dtype", None)):
            dynamic = True
    return big and dynamic


#: Primitives that clip a value at a bound (`_format_clip`).
_CLIPS = frozenset({"min", "max", "clamp"})


def _format_clip(eqn: Any, invals: Sequence[Any]) -> tuple[int, float] | None:
    """``(operand, bound)`` when ``eqn`` clips operand ``operand`` at ``±bound``, the
    largest value of a narrow format (`scalescope.core.formats.FORMAT_MAXIMA`): a min or
    max with a static scalar operand of that magnitude, or a clamp with such bounds."""
    name = eqn.primitive.name
    if name not in _CLIPS or len(invals) != (3 if name == "clamp" else 2):
        return None
    value = 1 if name == "clamp" else None
    bounds = []
    for k, (var, val) in enumerate(zip(eqn.invars, invals)):
        c = var.val if isinstance(var, Literal) else val
        if not (name == "clamp" and k == 1) and (bound := _formats.format_bound(c)) is not None:
            bounds.append(bound)
        elif is_static(c):  # another constant: not a clip at a format's max
            return None
        elif value is None:
            value = k
        elif value != k:
            return None
    if value is None or not bounds or len(set(bounds)) != 1:
        return None
    return value, bounds[0]


def _warn_unmeasured_casts(records: Sequence[OpRecord], spec: kernel.StatSpec) -> None:
    """Warn when the step casts values to a format this recording does not measure: the
    advisor can judge a cast only in a measured format (an E4M3FNUZ cast read with
    E4M3FN's limits would be judged against a max of 448 instead of 240)."""
    measured = {f.name for f in spec.formats} | {r.name for r in spec.recipes}
    missing = sorted({rec.cast_to for rec in records if rec.cast_to} - measured)
    if missing:
        names = ", ".join(missing)
        warnings.warn(
            f"scalescope: the step casts values to {names}, which this recording does not "
            f"measure, so those casts are not judged; add {names} to formats= to judge them",
            stacklevel=3,
        )


def _guarded(
    records: Sequence[OpRecord],
    reads: dict[int, list[OpRecord]],
    outputs: Sequence[tuple[str, _Info | None]],
) -> list[OpRecord]:
    """Records every path of which to the step's outputs goes through a ``select_n`` (a
    ``jnp.where``): every reader is a where, or such a record itself, and none is an
    output. ``where(amax > 0, 448 / amax / 2**m, scale)``, the safe-division idiom, holds
    NaN/inf the where may discard by design (`OpRecord.origin` "guarded"). Readers that
    only re-view the value (aliases) are looked through."""
    readers: dict[int, list[OpRecord]] = {}
    for rec in records:
        if rec.note == "alias":
            continue
        for src in reads.get(id(rec), ()):
            readers.setdefault(id(src), []).append(rec)
    out = {id(i.record) for _, i in outputs if i is not None and i.record is not None}
    guarded: set[int] = set()
    for rec in reversed(records):  # a reader comes after what it reads
        mine = readers.get(id(rec), ())
        if mine and id(rec) not in out:
            if all(r.primitive == "select_n" or id(r) in guarded for r in mine):
                guarded.add(id(rec))
    return [rec for rec in records if id(rec) in guarded]


@dataclass(eq=False)
class _Info:
    """What the recorder knows about a value flowing through the interpretation."""

    record: OpRecord | None  # the op whose statistics apply (after alias resolution)
    const: bool = False
    grad: bool = False  # computed from gradients (backward pass or later)
    early: bool = False  # computed elementwise from the step's inputs and constants alone
    static: bool = False  # computed from constants and non-float inputs only (a step count)
    big: bool = False  # static, and a constant of magnitude >= FILL_MIN went into it
    fill: bool = False  # holds a large constant fill (see `_fills`)
    parents: tuple[_Info, ...] = ()  # what it is computed from (for `provenance`)
    own: OpRecord | None = None  # the record made for this value itself
    seen: bool = False  # in `_Shared.order`
    #: for a clip at a narrow format's max (`_format_clip`): the value before the first
    #: clip of the chain (``clip(x, -448, 448)`` is a max, then a min)
    unclipped: Any = None


@dataclass(eq=False)
class _Block:
    """A loop or branch body adopted into its parent scope."""

    scope: _Scope
    kind: str
    raw: dict[str, Any]


@dataclass(eq=False)
class _Scope:
    """The values of one body: entries (records and adopted blocks) in order.
    ``pluck``: where the plucked value (`_Shared.pluck`) is non-finite, when this body or
    one it adopted made it."""

    entries: list[OpRecord | _Block] = field(default_factory=list)
    values: list[tuple[Any, Any]] = field(default_factory=list)
    recorded: list[OpRecord] = field(default_factory=list)
    pluck: Any = None

    def records(self) -> list[OpRecord]:
        out = []
        for e in self.entries:
            out.extend(e.scope.records() if isinstance(e, _Block) else [e])
        return out

    def rows(self) -> list[tuple[OpRecord, tuple[int, ...]]]:
        """(op, loop indices) of each raw row, in the order `raw` produces them."""
        rows = [(rec, ()) for rec in self.recorded]
        for e in self.entries:
            if not isinstance(e, _Block):
                continue
            inner = e.scope.rows()
            if e.kind == "scan":
                n = int(e.raw["sum"].shape[0])
                rows += [(rec, (i, *it)) for rec, it in inner for i in range(n)]
            else:
                rows += inner
        return rows

    def raw(self, spec: kernel.StatSpec, mask: Any = None) -> dict[str, Any]:
        if mask is None:
            parts = [kernel.values_raw(self.values, spec)]
        else:
            parts = [_masked_raw(seg, g, mask, spec) for g, seg in self._segments()]
        for e in self.entries:
            if isinstance(e, _Block):
                parts.append(kernel.unstack_scan(e.raw) if e.kind == "scan" else e.raw)
        return kernel.concat_raw(parts, spec)

    def _segments(self) -> list[tuple[int, list[tuple[Any, Any]]]]:
        """Runs of consecutive values of one group: ``(group, values)``."""
        out: list[tuple[int, list[tuple[Any, Any]]]] = []
        for rec, value in zip(self.recorded, self.values, strict=True):
            if not out or out[-1][0] != rec.group:
                out.append((rec.group, []))
            out[-1][1].append(value)
        return out


def _masked_raw(values: list[tuple[Any, Any]], group: int, mask: Any, spec) -> dict[str, Any]:
    """Raw rows of ``values``, computed only where ``mask[group]`` is set (a `lax.cond`:
    the untaken branch costs nothing on CPU); zero rows (count 0: NaN statistics) else."""

    # Inside shard_map both branches must be typed varying along the same manual axes:
    # those of the values measured.
    axes = tuple(sorted(set().union(*(varying_axes(v) for v in jax.tree.leaves(values)))))

    def measure(vals):
        return jax.tree.map(lambda r: to_varying(r, axes), kernel.values_raw(vals, spec))

    def skip(vals):
        shapes = jax.eval_shape(measure, vals)
        return jax.tree.map(lambda s: to_varying(jnp.zeros(s.shape, s.dtype), axes), shapes)

    return lax.cond(mask[group], measure, skip, values)


def _sharded_type(data: Any) -> bool:
    """Whether ``data``'s type carries a layout across devices (``f32[64@data, 16]``, on a
    mesh of explicit axes). A custom call hands back a value typed replicated, which
    the step's other values would then not match (a ``select`` of the two is refused):
    such a value is measured without being handed back."""
    sharding = explicit_sharding(data)
    return sharding is not None and any(axis is not None for axis in sharding.spec)


#: Primitives infinite where one input (by position) is an exact zero: ``log(0)``,
#: ``rsqrt(0)``, ``a / 0``, and the poles of ``lgamma``/``digamma``.
_POLE_AT_ZERO = {"log": 0, "log2": 0, "rsqrt": 0, "div": 1, "lgamma": 0, "digamma": 0}


def pole_at_zero(eqn: Any) -> int | None:
    """The position of the input of ``eqn`` whose exact zeros make its output infinite,
    None when there is none: `_POLE_AT_ZERO`, and a power with a negative exponent
    (``integer_pow`` with ``y < 0``; ``pow`` of a negative literal exponent)."""
    name = eqn.primitive.name
    if name == "integer_pow":
        return 0 if eqn.params.get("y", 0) < 0 else None
    if name == "pow":
        y = eqn.invars[1]
        if isinstance(y, Literal) and np.all(np.asarray(y.val) < 0):
            return 0
        return None
    return _POLE_AT_ZERO.get(name)


@dataclass(eq=False)
class _Shared:
    """Configuration and value knowledge shared by every recorder of one interpretation."""

    spec: kernel.StatSpec
    select: Callable[[OpRecord], bool] | None
    pass_scopes: tuple[str, ...] = PASS_SCOPES
    groups: int = 0  # value groups a mask switches (0: not grouped)
    group_size: float = 0.0  # elements (times loop iterations) per group
    mask: Any = None  # traced bool[groups]: which groups to measure
    weight: float = 0.0  # elements (times loop iterations) recorded so far
    info: dict[int, _Info] = field(default_factory=dict)
    keep: list[Any] = field(default_factory=list)  # keeps ids in `info` from being reused
    measured: dict[int, kernel.Measured] = field(default_factory=dict)  # by id of the data
    block_axes: dict[Any, tuple[int, ...]] = field(default_factory=dict)  # recipes' axes
    gemm: set[Any] = field(default_factory=set)  # variables a dot_general reads
    #: variables cast to a narrow format, with its largest value (`blocking.narrow_casts`)
    narrow_casts: dict[Any, set[float]] = field(default_factory=dict)
    order: list[_Info] = field(default_factory=list)  # every value's info, in order
    scans: list[bool] = field(default_factory=list)  # each adopted scan: reversed?
    inputs: list[str] = field(default_factory=list)  # argument paths of the inputs
    outputs: list[tuple[str, _Info | None]] = field(default_factory=list)
    created: list[OpRecord] = field(default_factory=list)  # every record, as made
    operands: dict[int, list[OpRecord | None]] = field(default_factory=dict)  # of GEMMs
    reads: dict[int, list[OpRecord]] = field(default_factory=dict)  # inputs of every op
    #: the input whose zeros make an op infinite (`OpRecord.zero_pole`), by id of the op
    poles: dict[int, OpRecord] = field(default_factory=dict)
    #: ops some float input of which has no record (a loop's or call's output, ...)
    unread: set[int] = field(default_factory=set)
    #: `emulate`'s `Replacer`: called ``(seq, value, var, primitive)`` on the value made
    #: ``seq``-th, it returns what downstream ops read instead; ``reads(eqn, invals)``
    #: gives a matmul its rounded operands. None: values as computed.
    replace: Any = None
    #: ``(seq, record, target)`` of each value the policy rounds (`finish` marks the
    #: record `OpRecord.cast_to`, unless no matmul read a value held '@matmul')
    casts: list[tuple[int, Any, str]] = field(default_factory=list)
    #: The formats and recipes this recording measures: a value a policy rounds to one
    #: of them is marked cast to it (`OpRecord.cast_to`), so the advisor judges it.
    judged: frozenset[str] = frozenset()
    #: The creation index (`OpTable.sequence`) of a value whose NaN/Inf elements leave
    #: the function whole (`instrument`'s ``nonfinite_where``), None: none. Loop and
    #: branch bodies then hand out ``(raw, pluck or ())``.
    pluck: int | None = None
    #: The mesh and manual axes of the shard_map body the plucked value was made in.
    pluck_devices: Any = None

    @property
    def at_once(self) -> bool:
        """Measure each value where it is produced, with the native kernel handing it
        back (`native.measure_through`): on CPU, exact, not masked by groups."""
        return (
            self.mask is None
            and self.spec.sample is None
            and self.pluck is None  # a custom call GSPMD cannot split: it would gather
            and native.use_native()
        )

    @property
    def hands_off(self) -> bool:
        """Hand each value to its consumers through `kernel.hand_off` (the pure-XLA
        kernel, exact statistics of every element of every group): the value is
        computed once, and the statistics read it where the step does."""
        return self.mask is None and self.spec.sample is None and not native.use_native()

    @property
    def native_args(self) -> tuple[Any, Any]:
        hist = (kernel.HIST_LO, kernel.HIST_HI) if self.spec.histograms else None
        return self.spec.formats, hist

    def lookup(self, value: Any) -> _Info | None:
        return self.info.get(id(value))

    def remember(self, value: Any, info: _Info) -> None:
        self.info[id(value)] = info
        self.keep.append(value)
        if not info.seen:
            info.seen = True
            self.order.append(info)


@dataclass(frozen=True)
class _Devices:
    """The manual mesh axes of the innermost enclosing ``shard_map`` body."""

    axes: tuple[str, ...]
    check_vma: bool
    mesh: Any = None


class Recorder(Observer):
    """Records values of one scope; `nested` gives the recorder of a body."""

    def __init__(
        self,
        shared: _Shared,
        scope: _Scope,
        prefix: Scope,
        mult: int = 1,
        devices: _Devices | None = None,
        reduce_devices: bool = False,
        optimizer: bool = False,
    ):
        self.shared = shared
        self.scope = scope
        self.prefix = prefix
        self.mult = mult  # iterations of the enclosing scans: rows per recorded value
        self.devices = devices  # inside a shard_map body: its manual axes
        self.reduce_devices = reduce_devices  # the body scope of a shard_map
        self.optimizer = optimizer  # inside a call an optimizer library made (`in_optimizer`)

    @classmethod
    def root(
        cls,
        spec: kernel.StatSpec,
        select: Callable[[OpRecord], bool] | None = None,
        pass_scopes: Sequence[str] = PASS_SCOPES,
        groups: int = 0,
        group_size: float = 0.0,
        mask: Any = None,
        jaxpr: Any = None,
    ) -> Recorder:
        """``jaxpr``: the function's jaxpr, to block recipes along GEMMs' contracting
        axes (`blocking`)."""
        shared = _Shared(spec, select, tuple(pass_scopes), groups, group_size, mask)
        if spec.recipes and jaxpr is not None:
            shared.block_axes = blocking.block_axes(jaxpr)
        if jaxpr is not None:
            shared.gemm = blocking.gemm_operands(jaxpr)
            shared.narrow_casts = blocking.narrow_casts(jaxpr)
        return cls(shared, _Scope(), Scope())

    # -- Observer ------------------------------------------------------------------------

    def nested(self, eqn: Any, kind: str) -> Recorder:
        for var in eqn.invars:  # a literal argument is a constant inside the body too
            if isinstance(var, Literal):
                self.mark_const(var.val)
        prefix = self.prefix.join(parse(eqn.source_info.name_stack))
        scope = self.scope if kind == "call" else _Scope()
        mult = self.mult * (int(eqn.params.get("length", 1)) if kind == "scan" else 1)
        devices, reduce_devices = self.devices, False
        if kind == "shard_map":
            devices = _Devices(
                manual_axes(eqn.params), check_vma_of(eqn.params), eqn.params.get("mesh")
            )
            reduce_devices = True
        optimizer = self.optimizer or in_optimizer(eqn.source_info)
        return Recorder(self.shared, scope, prefix, mult, devices, reduce_devices, optimizer)

    def body_outputs(self) -> Any:
        raw = self.scope.raw(self.shared.spec, self.shared.mask)
        if self.reduce_devices:
            raw = self._across_devices(raw)
        if self.shared.pluck is None:
            return raw
        return raw, (() if self.scope.pluck is None else self.scope.pluck)

    def _across_devices(self, raw: dict[str, Any]) -> dict[str, Any]:
        """Raw rows of this shard_map body, per device -> of the whole values: each
        device's rows are combined over the manual axes; along an axis a value does not
        vary over, only the device at index 0 contributes."""
        axes = self.devices.axes
        rows = self.scope.rows()
        if not rows or not axes:
            return raw
        keep = None
        for a in axes:
            varies = np.array([a in rec.varying for rec, _ in rows])
            if varies.all():
                continue
            k = jnp.logical_or(jnp.asarray(varies), lax.axis_index(a) == 0)
            keep = k if keep is None else keep & k
        return kernel.across_devices(raw, keep, axes)

    def reads(self, eqn: Any, invals: Sequence[Any]) -> Sequence[Any]:
        replace = self.shared.replace
        return invals if replace is None else replace.reads(eqn, invals)

    def same_value(self, src: Any, dst: Any) -> None:
        info = self.shared.lookup(src)
        if info is not None and self.shared.lookup(dst) is None:
            self.shared.remember(dst, info)

    def accumulate(self, acc: Any, new: Any) -> Any:
        if self.shared.pluck is None:
            return kernel.accumulate(acc, new)
        # a plucked value is never inside a while body (`Tracked` does not ask for one)
        return kernel.accumulate(acc[0], new[0]), new[1]

    def adopt(self, child: Observer, outputs: Any, kind: str, reverse: bool = False) -> None:
        if self.shared.pluck is not None:
            outputs, plucked = outputs
            if not isinstance(plucked, tuple):
                self.scope.pluck = plucked
        block = _Block(child.scope, kind, outputs)
        serial = len(self.shared.scans)
        if kind == "scan":
            self.shared.scans.append(reverse)
        for rec in child.scope.records():
            if kind == "scan":
                rec.loop = (int(outputs["sum"].shape[0]), *rec.loop)
                rec.scans = ((serial, reverse), *rec.scans)
            rec.in_while |= kind == "while"
            rec.in_cond |= kind == "cond"
        self.scope.entries.append(block)

    def on_eqn(self, ctx: Any, eqn: Any, invals: Sequence[Any], outvals: Sequence[Any]):
        rule = get_rule(eqn.primitive)
        ins = [
            None if isinstance(var, Literal) else self.shared.lookup(val)
            for var, val in zip(eqn.invars, invals)
        ]
        grad_in = any(i is not None and i.grad for i in ins)
        parents = tuple(i for i in ins if i is not None)
        if rule is not None and rule.higher_order and any(jaxprs_in_params(eqn.params)):
            # Outputs of calls are the body's own values; loop/branch outputs were recorded
            # inside the body. Remember only what downstream passes need to know. (A
            # host callback has no body: what it returns is recorded like any op's.)
            for out in outvals:
                if self.shared.lookup(out) is None:
                    self.shared.remember(out, _Info(None, grad=grad_in, parents=parents))
            return
        const = all(
            isinstance(var, Literal) or (i is not None and i.const)
            for var, i in zip(eqn.invars, ins)
        )
        static = all(
            isinstance(var, Literal) or (i is not None and i.static)
            for var, i in zip(eqn.invars, ins)
        )
        big = static and any(
            _is_big(var.val) if isinstance(var, Literal) else i.big
            for var, i in zip(eqn.invars, ins)
        )
        fill = not static and _fills(eqn.primitive.name, eqn.invars, ins)
        early = eqn.primitive.name in _ELEMENTWISE and all(
            isinstance(var, Literal) or (i is not None and (i.const or i.early))
            for var, i in zip(eqn.invars, ins)
        )
        scope = self.prefix.join(parse(eqn.source_info.name_stack))
        optimizer = self.optimizer or in_optimizer(eqn.source_info)
        comm = grad_in and gradient_comm(
            eqn.primitive.name, [i.own for i in ins if i is not None and not i.static]
        )
        pass_ = pass_of(scope, grad_in, self.shared.pass_scopes, optimizer, comm)
        name = op_name(scope, eqn.primitive.name)
        source = ctx.source(eqn)
        if eqn.primitive.name == "convert_element_type" and ins and ins[0] is not None:
            self._mark_cast(ins[0], eqn.params.get("new_dtype"), source)
        unclipped, measure = self._clip_chain(eqn, invals, ins, outvals)
        # the cast of a value the code clipped into the format is part of that code too
        self_scaled = measure is not None or (
            eqn.primitive.name == "convert_element_type"
            and bool(ins)
            and ins[0] is not None
            and ins[0].own is not None
            and ins[0].own.origin == "scaled_cast"
        )
        outs = []
        first = len(self.shared.created)
        for k, (var, out) in enumerate(zip(eqn.outvars, outvals)):
            src = (
                ins[k]
                if eqn.primitive.name == "optimization_barrier"
                else (ins[0] if ins else None)
            )
            outs.append(
                self._record(
                    eqn.primitive.name,
                    name,
                    pass_,
                    source,
                    var.aval,
                    out,
                    const,
                    src,
                    var=var,
                    early=early,
                    parents=parents,
                    origin=(static, big, fill),
                    measure=measure,
                    unclipped=unclipped,
                    self_scaled=self_scaled,
                )
            )
        if eqn.primitive.name == "dot_general":  # the values this GEMM reads
            self.shared.operands[id(self.shared.created[first])] = [
                None if i is None else i.own for i in ins[:2]
            ]
        if len(self.shared.created) > first:  # the values this op reads, for incidents
            self.shared.reads[id(self.shared.created[first])] = [
                i.record for i in ins if i is not None and i.record is not None
            ]
            if not all(
                isinstance(var, Literal) or (i is not None and i.record is not None)
                for var, i in zip(eqn.invars, ins)
                if jnp.issubdtype(getattr(var.aval, "dtype", np.int32), jnp.inexact)
            ):
                self.shared.unread.add(id(self.shared.created[first]))
            at = pole_at_zero(eqn)
            if at is not None and ins[at] is not None and ins[at].record is not None:
                self.shared.poles[id(self.shared.created[first])] = ins[at].record
        return outs

    def _clip_chain(
        self, eqn: Any, invals: Sequence[Any], ins: Sequence[_Info | None], outvals: Sequence[Any]
    ) -> tuple[Any, Any]:
        """``(unclipped, measure)`` for an equation that clips a value at a narrow format's
        largest value (`_format_clip`; else ``(None, None)``): the value before the
        chain's first clip, and, when a cast to that format reads the output and the
        output is plain (or at scale 1), that value unscaled, which is measured for the
        output instead: its overflow is then the share the clip saturates, its SNR the
        clip's error and the cast's (Flax's ``fp8_ops``, qwix, AQT scale into the format
        themselves, and a clipped value never overflows)."""
        clip = _format_clip(eqn, invals)
        if clip is None or len(outvals) != 1:
            return None, None
        k, bound = clip
        src = ins[k]
        unclipped = src.unclipped if src is not None and src.unclipped is not None else invals[k]
        out = outvals[0]
        at_one = not isinstance(out, ScaledArray) or (
            is_static(out.scale) and np.ndim(out.scale) == 0 and float(out.scale) == 1.0
        )
        if not at_one or bound not in self.shared.narrow_casts.get(eqn.outvars[0], ()):
            return unclipped, None
        value = unclipped.to_array() if isinstance(unclipped, ScaledArray) else unclipped
        if getattr(value, "dtype", None) != getattr(out, "dtype", None) or np.shape(
            value
        ) != np.shape(out):
            return unclipped, None
        return unclipped, value

    # -- recording -----------------------------------------------------------------------

    def _record(
        self,
        prim,
        name,
        pass_,
        source,
        aval,
        value,
        const,
        src: _Info | None,
        var=None,
        early=False,
        parents: tuple[_Info, ...] = (),
        origin: tuple[bool, bool, bool] = (False, False, False),
        measure: Any = None,
        unclipped: Any = None,
        self_scaled: bool = False,
    ):
        """Record the value ``value`` of ``prim``; ``measure``: what is measured for it
        instead (`_clip_chain`), ``self_scaled``: a value of code that scales into a
        format itself (``OpRecord.origin`` "scaled_cast")."""
        scaled = isinstance(value, ScaledArray)
        data = value.data if scaled else value
        dtype = getattr(aval, "dtype", None)
        shape = tuple(getattr(aval, "shape", ()))
        rec = OpRecord(name, pass_, prim, shape, str(dtype), scaled, source)
        seq = len(self.shared.created)
        self.shared.created.append(rec)
        if seq == self.shared.pluck and _is_float(dtype):
            self.scope.pluck = self._nonfinite(data, value.scale if scaled else None)
        rec.gemm = var is not None and var in self.shared.gemm
        if self.devices is not None:
            rec.varying = self._varying(aval)
        grad = pass_ != "fwd" and pass_ != "input"
        static, big, fill = origin
        info = _Info(rec, const, grad, early, static, big, fill, parents=parents, own=rec)
        info.unclipped = unclipped
        rec.origin = "fill" if fill else "constant" if static else ""
        if self_scaled and not rec.origin:
            rec.origin = "scaled_cast"
        src_dtype = None if src is None or src.record is None else src.record.dtype
        if not _is_float(dtype):
            rec.note = "not float"
        elif const:
            rec.note = "const"
        elif int(np.prod(shape)) == 0:
            rec.note = "empty"
        elif src is not None and src.const and prim in ALIAS_PRIMITIVES:
            rec.note, info.const = "const", True
        elif src is not None and src.record is not None and self._aliases(prim, src_dtype, dtype):
            rec.note, rec.alias_of = "alias", src.record
            info.record = src.record
        elif self.shared.select is not None and not self.shared.select(rec):
            rec.note = "unselected"
        else:
            self._assign_group(rec, int(np.prod(shape)))
            scale = value.scale if scaled else None
            axes = self.shared.block_axes.get(var) if var is not None else None
            rec.block_axes = axes or ()
            if measure is not None:
                data = measure  # measured in the output's place; the output goes on as it is
            if self.devices is not None:
                self.scope.values.append((*self._on_devices(data, scale), axes))
            elif measure is not None:
                self.scope.values.append((data, scale, axes))
            elif (seen := self.shared.measured.get(id(data))) is not None:
                # The same data as a value measured before (a rule changed only the
                # scale): the same statistics of the data, no second read.
                self.scope.values.append(seen._replace(scale=scale))
            elif (
                not early
                and self.shared.at_once
                and native.passes_through(data.dtype)
                and not _sharded_type(data)
            ):
                # Handed back for consumers to read. Not an input, nor a value computed
                # elementwise from the inputs alone (the optimizer's ``b1 * mu``,
                # ``wd * p``): XLA may compute such a value first thing, and handed back it
                # would then stay in memory until the optimizer reads it, a
                # parameter-sized buffer each (GPT-2 size: 1.63x -> 1.33x the step's
                # temporaries); measured from a copy instead, it is freed once read and
                # recomputed where it is used.
                data, floats, ints = native.measure_through(data, *self.shared.native_args)
                recipes = None
                if self.shared.spec.recipes:
                    recipes = native.recipe_call(
                        data, self.shared.spec.recipes, axes, asynchronous=True
                    )
                measured = kernel.Measured(floats, ints, scale, recipes)
                self.shared.measured[id(data)] = measured
                self.shared.keep.append(data)
                self.scope.values.append(measured)
                value = ScaledArray.trusted(data, value.scale) if scaled else data
            else:
                if not early and self.shared.hands_off:  # (`early`: as above)
                    data = kernel.hand_off(data)
                    value = ScaledArray.trusted(data, value.scale) if scaled else data
                self.scope.values.append((data, scale, axes))
            self.scope.recorded.append(rec)
        if rec.note not in ("", "alias"):
            info.record = None
        self.scope.entries.append(rec)
        if self.shared.replace is not None:
            value = self.shared.replace(seq, value, var, prim)
            # the value measured above is the one the policy rounds: judged in that
            # format (or recipe) as a value cast to it is
            target = self.shared.replace.target_of(seq)
            if target is not None and info.record is not None and target in self.shared.judged:
                # (held '@matmul': judged only once a matmul has read the rounded value)
                self.shared.casts.append((seq, info.record, target))
        self.shared.remember(value, info)
        return value

    def _nonfinite(self, data: Any, scale: Any) -> jax.Array:
        """Where a value is NaN/Inf: a bool array of its shape (sharded as the value is,
        so each device's piece says what that device holds); inside a shard_map body,
        the count on each device of the manual axes (int32[devices], the same on all)."""
        bad = jnp.logical_not(jnp.isfinite(data))
        if scale is not None:
            bad = jnp.logical_or(bad, jnp.logical_not(jnp.isfinite(scale)))
        if self.devices is None:
            return bad
        axes = self.devices.axes
        self.shared.pluck_devices = self.devices
        n = lax.psum(1, axes)
        mine = jnp.arange(n) == lax.axis_index(axes)
        return lax.psum(jnp.where(mine, jnp.sum(bad, dtype=jnp.int32), 0), axes)

    def _varying(self, aval: Any) -> tuple[str, ...]:
        """Manual axes along which a value of the shard_map body differs between devices:
        from the jaxpr's typing (``check_vma``), else all of them (nothing is known)."""
        devices = self.devices
        if not devices.check_vma:
            return devices.axes
        mat = getattr(aval, "mat", None)
        varies = frozenset(getattr(mat, "varying", getattr(aval, "vma", ())))
        return tuple(a for a in devices.axes if a in varies)

    def _on_devices(self, data: Any, scale: Any):
        """Inside a shard_map body: a scaled value whose scale differs between devices is
        re-expressed in the largest one (exact powers of two), as the collectives do."""
        devices = self.devices
        if scale is not None:
            axes = devices.axes
            if devices.check_vma:
                axes = tuple(a for a in axes if a in varying_axes(scale))
            if axes:
                common = positive_or_one(lax.pmax(scale, axes))
                data, scale = rescale_data(data, scale / common), common
        return data, scale

    def _assign_group(self, rec: OpRecord, size: int) -> None:
        """Contiguous groups of about equal cost, in order of recording."""
        sh = self.shared
        if sh.spec.sample is not None:
            size = min(size, sh.spec.sample)
        if sh.groups:
            g = int(sh.weight // sh.group_size) if sh.group_size > 0 else 0
            rec.group = min(g, sh.groups - 1)
        sh.weight += size * self.mult

    @staticmethod
    def _mark_cast(src: _Info, new_dtype: Any, source: str = "") -> None:
        """Note on the source op the narrow format a cast rounds it to, and the cast's
        line (``source``)."""
        rec = src.record
        if rec is None or new_dtype is None or not _is_float(rec.dtype):
            return
        fmt = _CAST_FORMATS.get(np.dtype(new_dtype))
        if fmt is not None and not _exact_widening(np.dtype(rec.dtype), new_dtype):
            rec.cast_to, rec.cast_at = fmt, source

    @staticmethod
    def _aliases(prim: str, src_dtype: Any, dtype: Any) -> bool:
        if prim in ALIAS_PRIMITIVES:
            return True
        return prim == "convert_element_type" and _exact_widening(np.dtype(src_dtype), dtype)

    def record_input(self, path: str, value: Any, var: Any = None) -> None:
        self.shared.inputs.append(path)
        aval = jax.typeof(value.data if isinstance(value, ScaledArray) else value)
        self._record(
            "input",
            f"input/{path}",
            "input",
            "<input>",
            aval,
            value,
            False,
            None,
            var=var,
            early=True,
            origin=(not _is_float(aval.dtype), False, False),
        )

    def mark_const(self, value: Any) -> None:
        self.shared.remember(value, _Info(None, const=True, static=True, big=_is_big(value)))

    def record_output(self, path: str, value: Any) -> None:
        info = self.shared.lookup(value)
        self.shared.outputs.append((path, info))
        scaled = isinstance(value, ScaledArray)
        data = value.data if scaled else value
        # (a typed PRNG key has a JAX dtype that NumPy does not know)
        dtype = getattr(data, "dtype", None) or np.result_type(data)
        shape = tuple(np.shape(data))
        pass_ = "fwd" if info is None or info.record is None else info.record.pass_
        rec = OpRecord(
            f"output/{path}" if path else "output",
            pass_,
            "output",
            shape,
            str(dtype),
            scaled,
            "<output>",
        )
        rec.note = "output"
        rec.alias_of = None if info is None else info.record
        self.scope.entries.append(rec)

    # -- the end -------------------------------------------------------------------------

    def finish(self) -> tuple[OpTable, dict[str, Any]]:
        """Assign op ids and rows; return the op table and the published statistics."""
        spec = self.shared.spec
        shared = self.shared
        unread = set() if shared.replace is None else shared.replace.unread_seqs()
        for seq, rec, target in shared.casts:
            if seq not in unread:
                rec.cast_to = target
        provenance.name_by_parameter(
            shared.order, shared.outputs, shared.inputs, shared.pass_scopes
        )
        records = self.scope.records()
        for i, rec in enumerate(records):
            rec.id = i
        for rec in _guarded(records, shared.reads, shared.outputs):
            rec.origin = rec.origin or "guarded"
        rows = self.scope.rows()
        raw = self.scope.raw(spec, self.shared.mask)
        order = sorted(range(len(rows)), key=lambda r: (rows[r][0].id, rows[r][1]))
        row_op = np.array([rows[r][0].id for r in order], np.int32)
        row_iter = np.array(
            [
                int(np.ravel_multi_index(rows[r][1], rows[r][0].loop)) if rows[r][1] else 0
                for r in order
            ],
            np.int32,
        )
        for rec in records:
            reads = shared.operands.get(id(rec))
            if reads is not None:
                rec.operands = tuple(-1 if r is None else r.id for r in reads)
            rec.inputs = tuple(dict.fromkeys(r.id for r in shared.reads.get(id(rec), ())))
            rec.inputs_complete = id(rec) not in shared.unread
            pole = shared.poles.get(id(rec))
            rec.zero_pole = -1 if pole is None else pole.id
            rec.stats_op = rec.id if rec.recorded else -1
            if rec.alias_of is not None and rec.alias_of.recorded:
                rec.stats_op = rec.alias_of.id
        starts = np.searchsorted(row_op, np.arange(len(records)))
        counts = (
            np.bincount(row_op, minlength=len(records))
            if len(row_op)
            else np.zeros(len(records), int)
        )
        for rec in records:
            if rec.recorded:
                rec.row_start, rec.n_rows = int(starts[rec.id]), int(counts[rec.id])
        if order != list(range(len(rows))):
            raw = kernel.take_rows(raw, np.asarray(order, np.int32))
        stats = kernel.finalize(raw, spec)
        table = OpTable(
            ops=records,
            row_op=row_op,
            row_iter=row_iter,
            stat_names=spec.stat_names(),
            formats=tuple(f.name for f in spec.formats),
            hist_columns=kernel.HIST_COLUMNS if spec.histograms else None,
            n_groups=self.shared.groups,
            group_elements=_group_elements(records, self.shared.groups),
            sequence=tuple(rec.id for rec in self.shared.created),
        )
        _warn_unmeasured_casts(records, spec)
        return table, stats


def _group_elements(records: list[OpRecord], groups: int) -> tuple[int, ...]:
    """Elements measured per group (all rows), the cost a mask switches on."""
    out = [0] * groups
    for rec in records:
        if rec.recorded and rec.group >= 0:
            out[rec.group] += int(np.prod(rec.shape)) * rec.n_rows
    return tuple(out)
