"""`scalify`: trace a function to a jaxpr and interpret it on `ScaledArray` values.

The interpreter follows JAX's "custom jaxpr interpreter" pattern: walk the equations,
bind those with no scaled input unchanged, and send those with a scaled input to the
primitive's scaled rule. Higher-order primitives (jit, scan, cond, ...) are interpreted
recursively through the same context.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import os
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import source_info_util
from jax.extend.core import Literal

from ..core.pow2 import is_static
from ..core.scaled_array import SCALE_DTYPE, ScaledArray
from .registry import get_rule
from .source import UNKNOWN, body_source, caller_functions, format_source

FALLBACK_POLICIES = ("raise", "unscale")


class ScalifyError(Exception):
    """A primitive could not be run on scaled values."""


@dataclass
class Fallback:
    """A primitive that ran on unscaled values under ``fallback="unscale"``."""

    primitive: str
    source: str


class Observer:
    """Watches an interpretation; the probe subclasses it. Defaults do nothing.

    ``on_eqn`` runs after every equation, at every nesting level. A higher-order rule
    interprets each body (of a call, scan, while or cond) with a child observer from
    ``nested``. Loop and branch bodies may hand extra values out of the body
    (``body_outputs``, traced inside it): a scan stacks them per iteration, a while loop
    folds them with ``accumulate``, a cond returns the taken branch's (zeros of the same
    structure for the others). The rule then gives them back to the parent with ``adopt``.
    A ``shard_map`` body (kind ``"shard_map"``) runs once per device: its body outputs
    leave the body replicated, so the observer must combine them across the manual mesh
    axes itself (the probe does, see `scalescope.probe.recorder`). ``same_value`` tells
    that a rule made a new value with the same elements (a sharding constraint, the
    per-device pieces of a shard_map operand or result).
    """

    def on_eqn(
        self, ctx: Context, eqn: Any, invals: Sequence[Any], outvals: Sequence[Any]
    ) -> Sequence[Any] | None:
        """May return replacements for ``outvals`` holding the same elements (the probe
        hands back values its kernel measured); None keeps them."""
        return None

    def reads(self, eqn: Any, invals: Sequence[Any]) -> Sequence[Any]:
        """The values ``eqn`` computes on, given those its inputs hold (the emulation
        hands a matmul its operands rounded); ``on_eqn`` still sees ``invals``."""
        return invals

    def nested(self, eqn: Any, kind: str) -> Observer:
        return self

    def body_outputs(self) -> Any:
        return ()

    def accumulate(self, acc: Any, new: Any) -> Any:
        return new

    def adopt(self, child: Observer, outputs: Any, kind: str, reverse: bool = False) -> None:
        """Take in a loop or branch body's observations (``kind``: ``scan``, ``while``,
        ``cond``, ``shard_map``; ``reverse``: a scan that runs its iterations last first)."""

    def same_value(self, src: Any, dst: Any) -> None:
        """``dst`` holds exactly ``src``'s elements (a rule added a sharding constraint)."""


@dataclass
class Context:
    """State of one interpretation: the fallback policy and what fell back.

    ``recurse_plain`` makes higher-order primitives be interpreted even when none of
    their inputs is scaled (an observer such as the probe needs to see inside them).
    ``observer``, when set, sees every equation (see `Observer`).
    """

    fallback: str = "raise"
    fallbacks: list[Fallback] = field(default_factory=list)
    recurse_plain: bool = False
    observer: Observer | None = None
    check: bool = True
    scaling: bool = True  # False: a plain interpretation (no rule turns plain into scaled)
    check_scales: bool = False  # assert every rule's scales (see `check_scale_invariant`)
    where: str = UNKNOWN  # the user's line of the enclosing call, for equations without one
    #: (file, function) of the frames the enclosing calls were traced from (`body_source`)
    callers: frozenset = frozenset()
    #: inside the body of a custom derivative (`custom_jvp_call`, `custom_vjp_call`): JAX
    #: traced it once and reuses it, frames and all, so frames past its machinery are
    #: another call's (`body_source`)
    in_custom: bool = False

    def eval_jaxpr(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        return eval_jaxpr(self, jaxpr, consts, args)

    def eval_closed(self, closed: Any, args: Sequence[Any]) -> list[Any]:
        return eval_jaxpr(self, closed.jaxpr, closed.consts, args)

    def nested(self, eqn: Any, kind: str) -> Context:
        """The context for a body of the higher-order ``eqn`` (kind: call, scan, while,
        cond, shard_map, or silent for a while loop's predicate, which records nothing).
        Equations of the body without a line of the user's own (those of JAX's jitted
        helpers such as ``jnp.where``) are placed at ``eqn``'s line (`where`)."""
        where = self.source(eqn)
        callers = self.callers | caller_functions(eqn.source_info)
        custom = self.in_custom or eqn.primitive.name.startswith("custom_")
        moved = {"where": where, "callers": callers, "in_custom": custom}
        if self.observer is None:
            return dataclasses.replace(self, **moved)
        observer = None if kind == "silent" else self.observer.nested(eqn, kind)
        return dataclasses.replace(self, observer=observer, **moved)

    def source(self, eqn: Any) -> str:
        """``file:line`` of ``eqn`` in the user's code; in a body, its line inside the
        body, else the enclosing call's (`source.body_source`)."""
        if self.where == UNKNOWN:
            return format_source(eqn.source_info)
        return body_source(eqn.source_info, self.where, self.callers, custom=self.in_custom)

    def body_outputs(self) -> Any:
        return () if self.observer is None else self.observer.body_outputs()

    def accumulate(self, acc: Any, new: Any) -> Any:
        return new if self.observer is None else self.observer.accumulate(acc, new)

    def adopt(self, child: Context, outputs: Any, kind: str, reverse: bool = False) -> None:
        if self.observer is not None and child.observer is not None:
            self.observer.adopt(child.observer, outputs, kind, reverse)


def _read(env: dict, v: Any) -> Any:
    if isinstance(v, Literal):
        return v.val
    return env[v]


def bind_plain(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """Bind ``eqn``'s primitive on plain values with its own parameters."""
    bound = eqn.primitive.get_bind_params(eqn.params)
    # Older JAX releases return (subfuns, params); current ones return params only.
    subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
    out = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def bind_unscaled(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """Bind ``eqn`` as it is on the values of its inputs (``data * scale`` for scaled
    ones, in their own dtypes): plain outputs."""
    return bind_plain(eqn, [x.to_array() if isinstance(x, ScaledArray) else x for x in invals])


def _static_cast(eqn: Any, invals: Sequence[Any]) -> np.ndarray | None:
    """A static scalar cast to a float type, in NumPy (``jnp.clip(x, -448, 448)`` casts
    its literal bounds inside its jit): rules then see the constant (a clip at a format's
    max, `rules_elementwise._clipping`), and the program holds no operation for it."""
    if eqn.primitive is not lax.convert_element_type_p or len(invals) != 1:
        return None
    (x,) = invals
    dtype = eqn.params.get("new_dtype")
    if not (is_static(x) and np.ndim(x) == 0 and jnp.issubdtype(dtype, jnp.floating)):
        return None
    return np.asarray(x, dtype)


def _apply(ctx: Context, eqn: Any, invals: list[Any]) -> list[Any]:
    prim = eqn.primitive
    scaled = any(isinstance(x, ScaledArray) for x in invals)
    rule = get_rule(prim)
    if rule is not None and rule.higher_order and (scaled or ctx.recurse_plain):
        return list(rule.fn(ctx, eqn, invals))
    if not scaled and not (rule is not None and rule.on_plain and ctx.scaling):
        if (folded := _static_cast(eqn, invals)) is not None:
            return [folded]
        return bind_plain(eqn, invals)
    if rule is None:
        source = ctx.source(eqn)
        if ctx.fallback == "unscale":
            ctx.fallbacks.append(Fallback(prim.name, source))
            return bind_unscaled(eqn, invals)
        raise ScalifyError(
            f"scalify: no scaled rule for primitive '{prim.name}' (at {source}). "
            "Use scalify(fn, fallback='unscale') to run it on unscaled values, or "
            "register a rule with scalescope.scalify.register_rule."
        )
    args = (prim, *invals) if rule.with_primitive else invals
    out = rule.fn(*args, **eqn.params)
    return list(out) if prim.multiple_results else [out]


def _check_outputs(ctx: Context, eqn: Any, outvals: Sequence[Any]) -> None:
    if len(outvals) != len(eqn.outvars):
        raise ScalifyError(
            f"scalify: rule for '{eqn.primitive.name}' returned {len(outvals)} outputs, "
            f"expected {len(eqn.outvars)}"
        )
    for var, out in zip(eqn.outvars, outvals):
        aval = var.aval
        if not hasattr(aval, "shape"):
            continue
        data = out.data if isinstance(out, ScaledArray) else out
        shape, dtype = np.shape(data), getattr(data, "dtype", None)
        if tuple(shape) != tuple(aval.shape) or (dtype is not None and dtype != aval.dtype):
            raise ScalifyError(
                f"scalify: rule for '{eqn.primitive.name}' produced {dtype}{list(shape)}, "
                f"expected {aval.dtype}{list(aval.shape)} (at {ctx.source(eqn)})"
            )
        if isinstance(out, ScaledArray) and (
            np.shape(out.scale) != () or out.scale.dtype != SCALE_DTYPE
        ):
            raise ScalifyError(
                f"scalify: rule for '{eqn.primitive.name}' produced a scale of "
                f"{out.scale.dtype}{list(np.shape(out.scale))}; scales are float32 scalars"
            )


def _higher_order(prim: Any) -> bool:
    rule = get_rule(prim)
    return rule is not None and rule.higher_order


def _materialize_scales(invals: Sequence[Any], outvals: list[Any]) -> list[Any]:
    """Outputs whose scale a rule computed, with that scale materialised once
    (`common.materialized`); scales passed through from an input are left alone."""
    from .common import materialized

    seen = {id(x.scale) for x in invals if isinstance(x, ScaledArray)}
    out = []
    for x in outvals:
        if isinstance(x, ScaledArray) and id(x.scale) not in seen:
            scale = materialized(x.scale)
            seen.update((id(x.scale), id(scale)))
            x = ScaledArray.trusted(x.data, scale)
        out.append(x)
    return out


def array_scales(values: Sequence[Any]) -> list[Any]:
    """``values`` with every static (NumPy) scale made a JAX array: what a transformed
    function returns has JAX arrays as leaves, as its users expect."""
    return [
        ScaledArray.trusted(v.data, jnp.asarray(v.scale, SCALE_DTYPE))
        if isinstance(v, ScaledArray) and not isinstance(v.scale, jax.Array)
        else v
        for v in values
    ]


def eval_jaxpr(ctx: Context, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    """Interpret ``jaxpr`` on values that may be `ScaledArray`."""
    env: dict[Any, Any] = {}
    for v, c in zip(jaxpr.constvars, consts, strict=True):
        env[v] = c
    for v, a in zip(jaxpr.invars, args, strict=True):
        env[v] = a
    for eqn in jaxpr.eqns:
        with written_at(eqn):
            outvals = _eval_eqn(ctx, eqn, [_read(env, v) for v in eqn.invars])
        for v, out in zip(eqn.outvars, outvals):
            env[v] = out
    return [_read(env, v) for v in jaxpr.outvars]


def _eval_eqn(ctx: Context, eqn: Any, invals: list[Any]) -> list[Any]:
    reads = invals if ctx.observer is None else ctx.observer.reads(eqn, invals)
    outvals = _apply(ctx, eqn, list(reads))
    if not _higher_order(eqn.primitive):
        # (a body's own rules materialise their scales; its outputs keep their
        # identity, which the observer relies on)
        outvals = _materialize_scales(invals, outvals)
    if ctx.check:
        _check_outputs(ctx, eqn, outvals)
    if ctx.check_scales:
        check_scale_invariant(eqn, outvals, ctx.source(eqn))
    if ctx.observer is not None:
        outvals = ctx.observer.on_eqn(ctx, eqn, invals, outvals) or outvals
    return outvals


def written_at(eqn: Any) -> Any:
    """A context in which the operations traced carry ``eqn``'s traceback, the name
    stack kept (JAX's public `user_context`): what an equation becomes under scalify or
    emulate (its rule's data and scale arithmetic, the probe's reductions) is placed
    where the user wrote it, as JAX's own transformations place theirs. A program built
    by interpreting ``fn`` then names ``fn``'s lines in its HLO metadata (profilers, XLA
    dumps), and a function that interprets it again (`instrument` of an emulated step)
    finds them."""
    return source_info_util.user_context(
        eqn.source_info.traceback, name_stack=source_info_util.current_name_stack()
    )


# -- inputs ------------------------------------------------------------------------------

# Data dtypes with float32's exponent range: a power-of-two shift of them is exact.
#: Data dtypes `normalize_input` re-centres (narrow FP16/FP8 data is left as it is).
NORMALIZED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(jnp.bfloat16))


# Data whose abs-max is within 2^±NORMALIZE_BAND is left as passed.
NORMALIZE_BAND = 4


def normalize_input(x: Any) -> Any:
    """A scaled input whose float32/float64/bfloat16 data is far from unit, re-expressed
    with data of abs-max in [1, 2) (a power-of-two shift moved into the scale; the value
    is unchanged); an all-zero input of any float dtype gets scale 0.

    The rules follow unit scaling: they assume data near unit and let scales carry
    magnitude. Data passed far from it (``as_scaled_array(x, scale=2**-24)`` holds
    ``x * 2**24``) would drift further at every product and leave float32's range.
    Data whose abs-max is within 2^±4 (unit-RMS data, LayerNorm gains, a one-hot
    batch) is left bit-identical; FP8/FP16 data is the user's chosen
    representation and is never touched. Data holding an inf or a NaN is left as passed.

    Scale 0 marks an exactly-zero tensor, which a sum ignores: a zero-initialised bias
    passed at scale 2^17 would otherwise give every sum it joins scale 2^17 and data
    2^-17 times too small, and a backward pass through it underflowed to zero.
    """
    if not isinstance(x, ScaledArray) or np.size(x.data) == 0:
        return x
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    from .common import renormalized

    # NaN and inf propagate into the abs-max: such data is neither shifted nor zero
    amax = jnp.max(jnp.abs(x.data.astype(SCALE_DTYPE)))
    band = NORMALIZE_BAND if np.dtype(x.dtype) in NORMALIZED_DTYPES else None
    out = renormalized(x, amax, band, zero_scale=True)
    if not isinstance(x.scale, jax.core.Tracer):
        return out
    # A traced scale of inf stays inf (`materialized` makes it NaN, which would turn
    # each infinite value into NaN); its data, whose abs-max is then no usable power of
    # two or whose scale is not finite, was not shifted.
    inf = lax.eq(lax.abs(x.scale.astype(SCALE_DTYPE)), np.float32(np.inf))
    return ScaledArray.trusted(out.data, lax.select(inf, x.scale.astype(SCALE_DTYPE), out.scale))


def normalize_inputs(values: Sequence[Any]) -> list[Any]:
    return [normalize_input(v) for v in values]


# -- the consistency check -------------------------------------------------------------

CHECK_ENV = "SCALESCOPE_SCALIFY_CHECK"


def check_default() -> bool:
    """Default of ``scalify(check=...)``: the environment flag ``SCALESCOPE_SCALIFY_CHECK``."""
    return os.environ.get(CHECK_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _scale_problem(scale: float, data_absmax: float) -> str | None:
    """Why a (scale, max |data|) pair breaks the invariant, or None when it holds:
    a scale is finite and positive, or zero with all-zero data."""
    if not math.isfinite(scale):
        return f"a non-finite scale ({scale})"
    if scale < 0:
        return f"a negative scale ({scale})"
    if scale == 0 and data_absmax != 0 and not math.isnan(data_absmax):
        # (NaN data at scale 0: a product of inf with an all-zero tensor, NaN as plain)
        return f"scale 0 with non-zero data (max |data| = {data_absmax:g})"
    return None


def _raise_scale_problem(where: str, scale: Any, data_absmax: Any) -> None:
    problem = _scale_problem(float(scale), float(data_absmax))
    if problem is not None:
        raise ScalifyError(f"scalify check: {where} produced {problem}")


def check_scale_invariant(eqn: Any, outvals: Sequence[Any], source: str) -> None:
    """Assert the scale invariant on every scaled output of ``eqn``.

    Concrete values are checked at once; traced ones through a host callback that raises
    `ScalifyError` (wrapped by JAX's runtime error) naming the primitive and source line.
    """
    for i, out in enumerate(outvals):
        if not isinstance(out, ScaledArray):
            continue
        where = f"'{eqn.primitive.name}' (output {i}, at {source})"
        data = jnp.asarray(out.data)
        absmax = jnp.max(jnp.abs(data.astype(jnp.float32))) if data.size else jnp.float32(0)
        if isinstance(out.scale, jax.core.Tracer) or isinstance(absmax, jax.core.Tracer):
            jax.debug.callback(functools.partial(_raise_scale_problem, where), out.scale, absmax)
        else:
            _raise_scale_problem(where, out.scale, absmax)


# -- the transform ----------------------------------------------------------------------


def is_array_like(x: Any) -> bool:
    """An array value (a dtype class such as ``np.float16`` has ``shape`` and ``dtype``
    attributes too, but is a static argument)."""
    if isinstance(x, type):
        return False
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) or (
        hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, ScaledArray)
    )


def _manual_type(x: Any) -> tuple[dict, frozenset]:
    """Inside `jax.shard_map`, the varying manual axes JAX types ``x`` with: the trace
    must see them, or collectives would be traced for invariant values (an extra
    ``pvary``, rejected at run time); on a mesh of explicit axes (`jax.make_mesh`'s
    default), its sharding, which is part of its type. Returns ShapeDtypeStruct keyword
    arguments and what the cache key must tell apart."""
    if not isinstance(x, jax.core.Tracer | jax.Array):
        return {}, frozenset()
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    if isinstance(x, jax.core.Tracer) and mat is not None and mat.varying:
        return {"manual_axis_type": mat, "sharding": aval.sharding}, frozenset(mat.varying)
    sharding = explicit_sharding(x)
    if sharding is not None:
        # a mesh of explicit axes types the value with its layout (``f32[8@data, 4]``):
        # traced without it, a shard_map's in_specs or a matmul contracting a sharded
        # axis would not match the value the step receives
        return {"sharding": sharding}, frozenset({("explicit", str(sharding.spec))})
    return {}, frozenset()


def explicit_sharding(x: Any) -> Any:
    """The sharding in ``x``'s type when its mesh has explicit axes (`jax.make_mesh`'s
    default since JAX 0.7: the layout is part of the type), else None."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    types = getattr(getattr(sharding, "mesh", None), "axis_types", ())
    return sharding if any(t == jax.sharding.AxisType.Explicit for t in types) else None


def _signature(leaves: Sequence[Any]) -> tuple[list[Any], list[Any], tuple[Any, ...]]:
    """Split flat leaves into dynamic values, their abstract values, and a cache key."""
    dyn, avals, key = [], [], []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, ScaledArray):
            if np.ndim(leaf.scale) != 0:
                raise ValueError(
                    f"scalify: argument leaf {i} is a ScaledArray whose scale has shape "
                    f"{tuple(np.shape(leaf.scale))}; a scale is a scalar (one scale per "
                    "example comes from jax.vmap over a scalified function: vmap the "
                    "scalified function over these, or ss.asarray them first)"
                )
            shape, dtype = tuple(np.shape(leaf.data)), np.dtype(leaf.data.dtype)
            mat, varying = _manual_type(leaf.data)
            dyn.append(leaf)
            avals.append(jax.ShapeDtypeStruct(shape, dtype, **mat))
            key.append(("scaled", shape, dtype, varying))
        elif is_array_like(leaf):
            aval = jax.typeof(leaf)
            mat, varying = _manual_type(leaf)
            dyn.append(leaf)
            avals.append(
                jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type, **mat)
            )
            key.append(("array", tuple(aval.shape), aval.dtype, aval.weak_type, varying))
        else:
            try:
                hash(leaf)
            except TypeError as err:
                raise TypeError(
                    f"scalify: argument leaf {i} of type {type(leaf).__name__} is neither an "
                    "array nor a hashable static value"
                ) from err
            key.append(("static", type(leaf), leaf))
    return dyn, avals, tuple(key)


def has_tracer(consts: Sequence[Any]) -> bool:
    return any(isinstance(c, jax.core.Tracer) for c in consts)


def trace_to_jaxpr(fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[Any, Any, list]:
    """Trace ``fn`` on the data avals of its (possibly scaled) arguments.

    Returns the closed jaxpr, the output treedef and the dynamic input values.
    """
    leaves, treedef, dyn, avals, _ = flatten_args(args, kwargs)
    closed, out_tree = trace_flat(fn, leaves, treedef, avals)
    return closed, out_tree, dyn


def flatten_args(args: tuple, kwargs: dict):
    """Flat leaves (`ScaledArray` kept whole), treedef, dynamic values, avals, cache key."""
    leaves, treedef = jax.tree_util.tree_flatten(
        (args, kwargs), is_leaf=lambda x: isinstance(x, ScaledArray)
    )
    dyn, avals, key = _signature(leaves)
    # Inside shard_map the trace depends on the mesh (axis sizes of collectives).
    return leaves, treedef, dyn, avals, (treedef, key, jax.sharding.get_abstract_mesh())


def _warn_if_arguments_changed(before: list[Any], args: Any, out: Any, fn: Any) -> None:
    """Warn when ``fn`` assigned to a mutable part of its arguments (an NNX Variable of a
    module passed in: ``optimizer.update(model, grads)``) and does not return the new
    value. Like `jax.jit`, a transform over pytrees does not write such changes back, so
    the caller's objects keep their old values; silently, unless told. (Merging NNX state
    and returning ``nnx.state(...)`` also assigns to the argument's leaves, but returns
    them: no warning.)"""

    def flat(tree: Any) -> list[Any]:
        return jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, ScaledArray))

    after = flat(args)
    if len(after) != len(before):
        changed = after
    else:
        changed = [y for x, y in zip(before, after, strict=True) if x is not y]
    returned = {id(leaf) for leaf in flat(out)}
    if all(id(leaf) in returned for leaf in changed):
        return
    name = getattr(fn, "__name__", type(fn).__name__)
    warnings.warn(
        f"scalescope: {name} assigned new values to (NNX) state of its arguments; as "
        "under jax.jit, such changes are not written back to the objects passed in. "
        "Return the new state instead (nnx.split / nnx.merge; docs/engine.md, "
        "'Stateful arguments'), or track the step with Run.track, which writes it back "
        "as nnx.jit does.",
        stacklevel=4,
    )


def describe_function(fn: Any) -> str:
    """``name (file:line)`` of a user's function, for errors that must point at it."""
    target = fn.func if isinstance(fn, functools.partial) else fn
    target = inspect.unwrap(target)
    name = getattr(target, "__qualname__", None) or type(target).__name__
    code = getattr(target, "__code__", None)
    if code is None:
        return name
    return f"{name} ({code.co_filename}:{code.co_firstlineno})"


_RETURNABLE = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)


class OutTree:
    """The output structure of a traced function that returns some of its non-array
    arguments' leaves (an Equinox model's activation function, in the updated model it
    returns): the program returns the other leaves, and ``unflatten`` puts those back
    around them, as ``eqx.filter_jit`` does. Used where a `PyTreeDef` would be."""

    def __init__(self, treedef: Any, fixed: dict[int, Any]) -> None:
        self.treedef, self.fixed = treedef, fixed

    def unflatten(self, dynamic: Sequence[Any]) -> Any:
        it = iter(dynamic)
        leaves = [self.fixed[i] if i in self.fixed else next(it) for i in range(self.size)]
        return self.treedef.unflatten(leaves)

    @property
    def size(self) -> int:
        return self.treedef.num_leaves

    def dynamic_paths(self) -> list[Any]:
        """The key paths of the leaves the program returns, in order."""
        zeros = self.treedef.unflatten([0] * self.size)
        paths = jax.tree_util.tree_flatten_with_path(zeros)[0]
        return [p for i, (p, _) in enumerate(paths) if i not in self.fixed]


def split_static_outputs(fn: Any, out: Any, static: Sequence[Any]) -> tuple[Any, OutTree | None]:
    """``(out, None)`` when every leaf of ``out`` is an array or a number; else the leaves
    that are, and the `OutTree` that puts the others back, each of which must be one of
    ``static`` (the arguments' non-array leaves, returned as they are). Any other leaf (a
    string, an object the function made) is a `TypeError` naming the function and where in
    its output, not JAX's complaint about our internal wrapper."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        out, is_leaf=lambda x: isinstance(x, ScaledArray)
    )
    fixed = {}
    for i, (path, leaf) in enumerate(flat):
        if isinstance(leaf, (ScaledArray, *_RETURNABLE)) or is_array_like(leaf):
            continue
        if any(leaf is s for s in static):
            fixed[i] = leaf
            continue
        where = f" at {jax.tree_util.keystr(path)}" if path else ""
        shown = repr(leaf)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise TypeError(
            f"{describe_function(fn)} returned a {type(leaf).__name__}{where} ({shown}); "
            "a traced function must return arrays and numbers (any pytree of them), or "
            "non-array leaves of its arguments as they are (an Equinox model's functions)"
        )
    if not fixed:
        return out, None
    return [leaf for i, (_, leaf) in enumerate(flat) if i not in fixed], OutTree(treedef, fixed)


def trace_flat(fn, leaves, treedef, avals):
    """``(closed jaxpr, output tree)`` of ``fn`` on the arguments ``leaves`` (``treedef``),
    the dynamic ones given as ``avals``; the output tree is an `OutTree` where ``fn``
    returns non-array leaves of its arguments (`split_static_outputs`)."""
    dyn_pos = [
        i for i, leaf in enumerate(leaves) if isinstance(leaf, ScaledArray) or is_array_like(leaf)
    ]
    dynamic = set(dyn_pos)
    static = [leaf for i, leaf in enumerate(leaves) if i not in dynamic]
    kept: list[OutTree] = []

    def flat_fn(*dyn_vals):
        full = list(leaves)
        for pos, val in zip(dyn_pos, dyn_vals):
            full[pos] = val
        a, k = jax.tree_util.tree_unflatten(treedef, full)
        out = fn(*a, **k)
        returned, tree = split_static_outputs(fn, out, static)
        _warn_if_arguments_changed(full, (a, k), out, fn)
        if tree is not None:
            kept.append(tree)
        return returned

    try:
        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*avals)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError) as err:
        raise _on_traced_value(err, fn, leaves, treedef, dyn_pos) from err
    except ValueError as err:
        if "Non-hashable static arguments" not in str(err):
            raise
        raise TypeError(
            f"{describe_function(fn)}: a jax.jit inside it takes an argument as static "
            "(static_argnums or static_argnames) that reaches it traced. Run.track traces "
            "Python numbers among the step's arguments as jax.jit does: give it the same "
            "positions, run.track(step, static_argnums=...), or bind the value first "
            "(functools.partial)."
        ) from err
    return closed, kept[-1] if kept else jax.tree_util.tree_structure(out_shape)


def _on_traced_value(err: Exception, fn: Any, leaves, treedef, dyn_pos) -> TypeError:
    """JAX's error for Python control flow on a traced argument (``if config.decode:``),
    said of the user's argument (``args[2].decode``) instead of this module's
    ``flat_fn``/``dyn_vals[N]``, with what to do: bind it before tracking."""
    found = re.search(r"dyn_vals\[(\d+)\]", str(err))
    where = "an argument"
    if found and int(found.group(1)) < len(dyn_pos):
        index = dyn_pos[int(found.group(1))]
        marked = jax.tree_util.tree_unflatten(treedef, list(range(len(leaves))))
        paths = {leaf: path for path, leaf in jax.tree_util.tree_flatten_with_path(marked)[0]}
        path = paths.get(index)
        if path:
            head, rest = path[0], jax.tree_util.keystr(tuple(path[1:]))
            where = ("args" if getattr(head, "idx", 0) == 0 else "kwargs") + rest
            leaf = leaves[index]
            if np.ndim(leaf) == 0 and getattr(getattr(leaf, "aval", None), "weak_type", False):
                where += " (a Python number, traced as jax.jit traces it)"
    first = str(err).strip().splitlines()[0]
    return TypeError(
        f"{describe_function(fn)}: its trace depends on the value of {where}: {first} "
        "Bind a value the step branches on before it is traced, e.g. "
        "functools.partial(step, config=config), or name its position in "
        "run.track(step, static_argnums=...): Run.track traces Python numbers among the "
        "arguments as jax.jit does."
    )


def scalify(
    fn: Callable[..., Any],
    *,
    fallback: str = "raise",
    check: bool | None = None,
    normalize: bool = True,
) -> Callable[..., Any]:
    """Transform ``fn`` so that it runs on `ScaledArray` inputs with scale propagation.

    ``fn`` is traced on the data avals (shape and dtype of each `ScaledArray`'s data) and
    its jaxpr interpreted: every primitive with a scaled input runs its scaled rule, the
    rest run unchanged. Scaled outputs are returned as `ScaledArray`.

    ``fallback``: ``"raise"`` (default) raises `ScalifyError` naming the primitive and
    the user's source line when a primitive with scaled inputs has no rule;
    ``"unscale"`` runs such a primitive on the unscaled values instead and lists it in
    the wrapped function's ``fallbacks`` attribute (reset on every call).

    ``normalize=True`` (default) re-expresses a scaled float32/bfloat16 input whose data
    abs-max is beyond 2^±4 with data of abs-max in [1, 2) before interpreting
    (`normalize_input`): the value is unchanged, data near unit is untouched, and data
    passed far from unit (``as_scaled_array(x, scale=2**k)`` for large ``|k|``) no
    longer drifts out of range through the step. ``normalize=False`` interprets the
    data exactly as passed.

    ``check=True`` (default: the ``SCALESCOPE_SCALIFY_CHECK`` environment flag) asserts
    after every rule that each output scale is finite and positive, or zero with all-zero
    data, and raises `ScalifyError` naming the primitive and the user's source line when
    not. It is a debugging mode: one host callback per scaled value.

    The traced jaxpr is cached per input signature (tree structure, shapes, dtypes,
    which leaves are scaled, static leaves). Non-array leaves are static.
    """
    if not callable(fn):
        raise TypeError(f"scalify: fn must be callable, got {type(fn).__name__}")
    if fallback not in FALLBACK_POLICIES:
        raise ValueError(f"scalify: fallback must be one of {FALLBACK_POLICIES}, got {fallback!r}")
    check = check_default() if check is None else bool(check)
    cache: dict[Any, tuple[Any, Any]] = {}

    @functools.wraps(fn)
    def scalified(*args, **kwargs):
        leaves, treedef, dyn, avals, key = flatten_args(args, kwargs)
        entry = cache.get(key)
        if entry is None:
            entry = trace_flat(fn, leaves, treedef, avals)
            if not has_tracer(entry[0].consts):
                cache[key] = entry
        closed, out_tree = entry
        ctx = Context(fallback=fallback, check_scales=check)
        if normalize:
            dyn = normalize_inputs(dyn)
        outs = array_scales(eval_jaxpr(ctx, closed.jaxpr, closed.consts, dyn))
        scalified.fallbacks = list(ctx.fallbacks)
        for fb in ctx.fallbacks:
            warnings.warn(
                f"scalify: '{fb.primitive}' ran on unscaled values (at {fb.source})",
                stacklevel=2,
            )
        return out_tree.unflatten(outs)

    scalified.fallbacks = []
    scalified.cache_size = lambda: len(cache)
    scalified.scalify_of = (fn, fallback)
    return scalified


def unwrap_scalified(fn: Callable[..., Any], fallback: str) -> tuple[Callable[..., Any], str]:
    """``(fn, fallback)``, or for a function `scalify` returned, the function it wraps and
    the fallback it was given (when ``fallback`` is the default ``"raise"``).

    The probe and `emulate` scalify what they are given: handed ``scalify(step)``, they
    would otherwise interpret the scale arithmetic itself, op by op (the sample FP8 GPT,
    1 layer, d=32: 5 706 measured values instead of 608, and a compile 14x as long).
    """
    inner = getattr(fn, "scalify_of", None)
    if not (isinstance(inner, tuple) and len(inner) == 2 and callable(inner[0])):
        return fn, fallback
    return inner[0], inner[1] if fallback == "raise" else fallback
