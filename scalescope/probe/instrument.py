"""`instrument`: a function that also returns statistics of every value it computes."""

from __future__ import annotations

import functools
import inspect
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ..core import recipes as _recipes
from ..core.policy import Policy, as_policy
from ..core.scaled_array import ScaledArray
from ..scalify.common import materialized
from ..scalify.interpreter import (
    FALLBACK_POLICIES,
    Context,
    OutTree,
    array_scales,
    eval_jaxpr,
    flatten_args,
    has_tracer,
    is_array_like,
    normalize_inputs,
    trace_flat,
    unwrap_scalified,
)
from .blocking import block_axes
from .kernel import DEFAULT_BLOCK, StatSpec
from .modules import module_scopes
from .names import PASS_SCOPES
from .optable import OpRecord, OpTable
from .quantise import Plan, Replacer
from .recorder import Recorder

Select = str | Callable[[OpRecord], bool] | None


def _path_name(path: Sequence[Any]) -> str:
    parts = []
    for key in path:
        for attr in ("key", "idx", "name"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def _leaf_paths(tree: Any) -> list[str]:
    paths, _ = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, ScaledArray)
    )
    return [_path_name(p) for p, _ in paths]


def _input_paths(fn: Callable[..., Any], treedef: Any, leaves: list[Any]) -> list[str]:
    """Paths of the argument leaves, the first component named after ``fn``'s parameter
    (``params/layers/0/w``) where the signature tells it."""
    try:
        names = [
            p.name
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        names = []
    out = []
    for path in _leaf_paths(jax.tree_util.tree_unflatten(treedef, leaves)):
        head, _, rest = path.partition("/")
        first, _, tail = rest.partition("/")
        if head == "0":
            i = int(first)
            first = names[i] if i < len(names) else f"arg{i}"
        out.append("/".join(p for p in (first, tail) if p))
    return out


def _is_dynamic(leaf: Any) -> bool:
    return isinstance(leaf, ScaledArray) or is_array_like(leaf)


def _predicate(select: Select) -> Callable[[OpRecord], bool] | None:
    if select is None or callable(select):
        return select
    if isinstance(select, str):
        try:
            rx = re.compile(select)
        except re.error as err:
            raise ValueError(
                f"instrument: select is not a valid regex ({select!r}): {err}"
            ) from err
        return lambda rec: rx.search(rec.label) is not None
    raise TypeError(
        "instrument: select must be a regex string, a predicate on OpRecord, or None; "
        f"got {type(select).__name__}"
    )


def _spec(formats: Sequence[str], histograms: bool, block: int, sample: int | None) -> StatSpec:
    try:
        fmts, recs = _recipes.split(formats)
    except KeyError as err:
        raise KeyError(f"instrument: formats: {err.args[0]}") from None
    except ValueError as err:
        raise ValueError(f"instrument: {err}") from None
    if recs and sample is not None:
        raise ValueError(
            f"instrument: recipes ({', '.join(r.name for r in recs)}) quantise whole blocks "
            "and need every element; they cannot be combined with sample="
        )
    if block < 1:
        raise ValueError(f"instrument: block must be positive, got {block}")
    if sample is not None and (not isinstance(sample, int) or sample < 1):
        raise ValueError(f"instrument: sample must be a positive int or None, got {sample!r}")
    return StatSpec(fmts, bool(histograms), int(block), sample, recs)


def _is_float(v: Any) -> bool:
    """A floating scalar (not an int, a bool or a typed PRNG key)."""
    dtype = getattr(v, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def _after(values: list[Any], outs: Any) -> list[Any]:
    """``values`` with each scale tied by data to the scales (and scalars) of ``outs``.

    An optimization barrier does not order computations on XLA's CPU backend, so the
    shadow computation could run beside the plain one and hold its temporaries at the
    same time (2x). Adding to every input scale an opaque zero that XLA cannot fold (the
    bits set in each output scale, at most 32, shifted right by 6) makes the shadow wait
    for the plain outputs, and their temporaries then share memory: 1.24x instead of
    1.68x on the unrolled sample GPT. Values are unchanged (``scale + 0``). Buffers of
    ``lax.scan`` loops are not shared between loops on CPU at all, so scanned models
    gain nothing.
    """
    leaves = jax.tree_util.tree_leaves(outs, is_leaf=lambda v: isinstance(v, ScaledArray))
    out_scales = [
        v.scale if isinstance(v, ScaledArray) else v
        for v in leaves
        if isinstance(v, ScaledArray) or (jnp.ndim(v) == 0 and _is_float(v))
    ]
    if not out_scales:
        return values
    bits = jnp.zeros((), jnp.uint32)
    for scale in out_scales:
        word = lax.bitcast_convert_type(jnp.asarray(scale, jnp.float32).reshape(()), jnp.uint32)
        bits = bits | (lax.population_count(word) >> 6)
    # computed once: XLA would otherwise copy the whole chain (a few ops per output
    # scale) into every fusion that reads an input scale (isolate=True's tiny FP8 GPT
    # step: 105k lines of optimised HLO instead of 74k, compile 24.6 s instead of 21.0 s)
    zero = materialized(bits.astype(jnp.float32))
    return [
        ScaledArray.trusted(v.data, v.scale + zero.astype(v.scale.dtype))
        if isinstance(v, ScaledArray)
        else v
        for v in values
    ]


def as_jit_passes(tree: Any) -> Any:
    """``tree`` with Python numbers as weakly typed JAX scalars, as `jax.jit` traces them."""

    def convert(leaf: Any) -> Any:
        if isinstance(leaf, bool | int | float | complex):
            return jax.numpy.asarray(leaf)
        return leaf

    return jax.tree_util.tree_map(convert, tree, is_leaf=lambda x: isinstance(x, ScaledArray))


def instrument(
    fn: Callable[..., Any],
    *,
    scalify: bool = True,
    formats: Sequence[str] = ("e4m3", "e5m2", "fp16", "bf16"),
    histograms: bool = True,
    select: Select = None,
    fallback: str = "raise",
    passes: Sequence[str] = PASS_SCOPES,
    block: int = DEFAULT_BLOCK,
    sample: int | None = None,
    isolate: bool = False,
    groups: int = 0,
    policy: Policy | dict[str, str] | str | None = None,
) -> Callable[..., tuple[Any, dict[str, jax.Array]]]:
    """Wrap ``fn`` so that it returns ``(out, stats)``.

    ``out`` is what ``scalify(fn)`` (or ``fn`` itself with ``scalify=False``) returns
    (see ``isolate`` for the last bit). ``stats`` maps each statistic name to an array
    with one row per recorded (op, iteration); ``fn'.op_table(*args)`` gives the static
    op table describing the rows (see `OpTable`), computed by tracing alone. Statistics
    are computed inside the traced function, so wrap the result in `jax.jit` to run it at
    full speed.

    ``formats``: formats to audit (names of `scalescope.formats`) and block-scaled
    recipes (names of `scalescope.core.recipes`: ``"mxfp8_e4m3"``, ``"nvfp4"``...; each
    adds ``underflow_R``, ``overflow_R``, ``snr_R``, ``block_flush_R``,
    ``scale_log2_min_R``, ``scale_log2_max_R``); a sequence of names, or one string of
    them separated by commas (``"e4m3,nvfp4"``). ``histograms``: build
    the exponent histogram (``stats["hist"]``). ``select``: a regex matched against
    ``pass/name`` of each op (``"^bwd/"``, ``"attn/dot_general"``) or a predicate on
    `OpRecord`; other ops get no statistics. ``passes``: top-level `jax.named_scope`
    names that mark a pass of their own (default ``("opt",)``). ``fallback``: scalify's
    policy for primitives without a scaled rule. ``sample``: cheap mode; a value with
    more elements is measured on an evenly strided subset of at most ``sample`` elements
    (statistics become estimates, and ``count`` is the subset's size).

    ``isolate``: by default the statistics read the values the step computes, which
    then exist in memory once each; XLA fuses the step around them, so a value it
    evaluates in another fusion (a reduction, a transcendental, a multiply-add no
    longer contracted into one FMA) may move by float32 rounding (the sample GPT's
    AdamW step: one output of 89, the loss, by one ulp). ``isolate=True`` computes the
    statistics on a shadow copy of the step behind an optimization barrier, so ``out``
    comes from exactly the program the uninstrumented function compiles to, bit for
    bit; it costs a second evaluation and compilation of ``fn`` (and about twice the
    temporaries with scanned layers). `Run` keeps a recorded step's outputs bit for bit
    another way: the statistics are a program of their own, run after the plain step.

    ``groups``: split the recorded values into this many groups of about equal cost
    (consecutive in order of computation; ``OpRecord.group``). ``fn'.masked(mask, *args)``
    then measures only the groups where the boolean ``mask[group]`` is set, in one
    compiled program (each group behind a `lax.cond`); the other groups' rows have count
    0 and NaN statistics. This is how `Run`'s overhead budget rotates what it measures.

    ``policy``: a `Policy` (or its dict or JSON) applied as `emulate` applies it: each
    value a rule reaches is measured as computed, and what reads it gets its
    quantise-dequantise. The statistics are then those of the emulated training.
    """
    if not callable(fn):
        raise TypeError(f"instrument: fn must be callable, got {type(fn).__name__}")
    if fallback not in FALLBACK_POLICIES:
        raise ValueError(
            f"instrument: fallback must be one of {FALLBACK_POLICIES}, got {fallback!r}"
        )
    if scalify:  # instrument(scalify(step)) records step, not its scale arithmetic
        fn, fallback = unwrap_scalified(fn, fallback)
    spec = _spec(formats, histograms, block, sample)
    pred = _predicate(select)
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 0:
        raise ValueError(f"instrument: groups must be a non-negative int, got {groups!r}")
    policy = None if policy is None else as_policy(policy)
    traces: dict[Any, tuple[Any, Any]] = {}
    tables: dict[Any, OpTable] = {}
    weights: dict[Any, float] = {}  # elements recorded per call signature (for groups)
    plans: dict[Any, tuple[Plan, Any]] = {}  # the policy's plan per call signature

    def trace(leaves, treedef, avals, key):
        """The closed jaxpr and output tree of ``fn`` for one call signature (cached)."""
        entry = traces.get(key)
        if entry is None:
            with module_scopes():
                entry = trace_flat(fn, leaves, treedef, avals)
            if not has_tracer(entry[0].consts):
                traces[key] = entry
        return entry

    def replacer(flat, closed):
        """What the recorder hands downstream in place of each value (the policy's
        quantisation), planned on the table of this function without the policy."""
        key = flat[4]
        if key not in plans:
            if instrumented.plain_probe is None:
                instrumented.plain_probe = instrument(
                    fn, scalify=scalify, formats=(), histograms=False, fallback=fallback
                )
                # the same jaxpr: the same values in the same order
                instrumented.plain_probe.trace_flat = trace
            table = instrumented.plain_probe.table_of(flat)
            plans[key] = (Plan.build(table, policy), block_axes(closed.jaxpr))
        return Replacer(*plans[key])

    def run(leaves, treedef, dyn, avals, key, mask=None, grouped=True, pluck=None):
        if not scalify and any(isinstance(x, ScaledArray) for x in dyn):
            raise TypeError(
                "instrument(scalify=False) records a plain function, but an argument is a "
                "ScaledArray; pass plain arrays or use scalify=True"
            )
        closed, out_tree = instrumented.trace_flat(leaves, treedef, avals, key)
        outs = None
        if scalify:
            dyn = normalize_inputs(dyn)
        observed = list(dyn)
        if isolate:
            plain = Context(fallback=fallback, check=False, scaling=scalify)
            outs = eval_jaxpr(plain, closed.jaxpr, closed.consts, dyn)
            observed = _after(jax.lax.optimization_barrier(observed), outs)
        n_groups, group_size = (groups, 0.0) if grouped else (0, 0.0)
        if n_groups:
            if key not in weights:  # one abstract pass to learn the total to split
                jax.eval_shape(
                    lambda *d: run(leaves, treedef, list(d), avals, key, grouped=False)[:2], *dyn
                )
            group_size = weights[key] / n_groups
        recorder = Recorder.root(spec, pred, passes, n_groups, group_size, mask, jaxpr=closed.jaxpr)
        recorder.shared.pluck = pluck
        if policy is not None:
            recorder.shared.replace = replacer((leaves, treedef, dyn, avals, key), closed)
            recorder.shared.judged = frozenset(
                [f.name for f in spec.formats] + [r.name for r in spec.recipes]
            )
        paths = _input_paths(fn, treedef, leaves)
        dyn_paths = [p for p, leaf in zip(paths, leaves) if _is_dynamic(leaf)]
        for path, value, var in zip(dyn_paths, observed, closed.jaxpr.invars, strict=True):
            recorder.record_input(path, value, var)
        for c in closed.consts:
            recorder.mark_const(c)
        ctx = Context(fallback=fallback, recurse_plain=True, observer=recorder, scaling=scalify)
        shadow_outs = eval_jaxpr(ctx, closed.jaxpr, closed.consts, observed)
        if outs is None:
            outs = shadow_outs
        if isinstance(out_tree, OutTree):
            out_paths = [_path_name(p) for p in out_tree.dynamic_paths()]
        else:
            out_paths = _leaf_paths(out_tree.unflatten(list(range(len(outs)))))
        for path, value in zip(out_paths, shadow_outs):
            recorder.record_output(path, value)
        table, stats = recorder.finish()
        tables[key] = table
        weights[key] = recorder.shared.weight
        instrumented.fallbacks = list(ctx.fallbacks)
        for fb in ctx.fallbacks:
            warnings.warn(
                f"scalify: '{fb.primitive}' ran on unscaled values (at {fb.source})", stacklevel=3
            )
        if pluck is not None:
            instrumented.plucked = recorder.scope.pluck, recorder.shared.pluck_devices
        return out_tree.unflatten(array_scales(outs)), stats, table

    @functools.wraps(fn)
    def instrumented(*args, **kwargs):
        out, stats, _ = run(*flatten_args(args, kwargs))
        return out, stats

    def op_table(*args, **kwargs) -> OpTable:
        """The op table for these arguments (shapes and dtypes matter, not values),
        computed by tracing without running anything. Arguments are taken as `jax.jit`
        passes them to the function: a Python number is a traced scalar, not a constant
        (``step(params, batch, lr=0.1)`` under jit multiplies by a traced ``lr``)."""
        return table_of(flatten_args(*as_jit_passes((args, kwargs))))

    def table_of(flat) -> OpTable:
        """The op table for arguments already flattened (`flatten_args`)."""
        leaves, treedef, dyn, avals, key = flat
        if key not in tables:
            positions = [i for i, leaf in enumerate(leaves) if _is_dynamic(leaf)]

            def abstract(*dyn_vals):
                full = list(leaves)
                for pos, val in zip(positions, dyn_vals):
                    full[pos] = val
                _, stats, _ = run(*flatten_args(*jax.tree_util.tree_unflatten(treedef, full)))
                return stats  # (the outputs may hold non-array leaves, `OutTree`)

            jax.eval_shape(abstract, *dyn)
        return tables[key]

    def masked(mask, *args, **kwargs):
        """``(out, stats)`` measuring only the groups set in ``mask`` (bool[groups])."""
        if not groups:
            raise ValueError("instrument: masked() needs groups > 0")
        if getattr(mask, "shape", None) != (groups,):
            raise ValueError(
                f"instrument: the mask must have shape ({groups},), got "
                f"{getattr(mask, 'shape', type(mask).__name__)}"
            )
        out, stats, _ = run(*flatten_args(args, kwargs), mask=jax.numpy.asarray(mask, bool))
        return out, stats

    def nonfinite_where(seq: int, *args, **kwargs) -> Any:
        """Where the value made ``seq``-th (`OpTable.sequence`; not one made inside a
        while or cond body) holds NaN/Inf, as the function's only output: a bool array
        of the value's shape (stacked per iteration inside scans) laid out over the
        devices as the value is, or, inside a ``shard_map`` body, the count on each
        device of its manual axes (``instrumented.plucked_in``, set while tracing, holds
        that body's mesh and axes; None outside one). None when the value is not a
        float. Under `jax.jit` it finds the device where a step's NaN/Inf appeared."""
        run(*flatten_args(args, kwargs), grouped=False, pluck=seq)
        where, instrumented.plucked_in = instrumented.plucked
        return where

    instrumented.op_table = op_table
    # the probe without statistics a policy is planned on (its op table per signature);
    # a Run hands it emulate's, so its two programs share one plan
    instrumented.plain_probe = None
    instrumented.nonfinite_where = nonfinite_where
    instrumented.table_of = table_of
    instrumented.trace_flat = trace
    instrumented.masked = masked
    instrumented.groups = groups
    instrumented.fallbacks = []
    instrumented.formats = tuple(f.name for f in spec.formats)
    instrumented.recipes = tuple(r.name for r in spec.recipes)
    instrumented.histograms = spec.histograms
    return instrumented
