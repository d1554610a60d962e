"""Scaled rules for collectives: values that cross devices inside `jax.shard_map`.

Inside a ``shard_map`` body every device holds its own `ScaledArray`. The data is the
device's shard; the scale is a scalar that *may differ per device* when it was derived
from local data (a dynamic rescale, a plain operand split by its local abs-max). A
collective that combines shards must therefore first agree on one scale.

**One scale across devices.** A reducing or gathering collective (``psum``, ``pmax``,
``pmin``, ``all_gather``, ``psum_scatter``, ``all_to_all``) takes the largest per-device
scale, ``S = pmax(scale)`` over the same axes (and ``axis_index_groups``), re-expresses
each device's data in it (``data * scale / S``: a power-of-two ratio <= 1, exact unless
the data format underflows), then runs the collective on the data. Every device ends with
the same scale, so the result is invariant where the collective's result is. The largest
scale is the one that cannot overflow: each shard's data stays <= its own magnitude.
The extra ``pmax`` is one scalar all-reduce; it is skipped when JAX's varying-manual-axes
typing (``check_vma=True``) shows the scale is already invariant along those axes.

**Unit scaling.** ``psum`` and ``psum_scatter`` add ``N`` terms (``N``: the product of
the reduced axis sizes, or the group size), like ``reduce_sum``: the data is divided by
the power of two of ``sqrt(N)`` (known at trace time) and the scale multiplied by it, as
`scaled_reduce_sum` does. The division happens before the sum (one rescale, fused with
the alignment), so narrow formats do not overflow while adding. ``pmean`` is not a
primitive on current JAX: it is ``psum`` then a division by ``N``, which the ``div`` rule
moves into the scale exactly.

**Moving data.** ``ppermute`` and ``pbroadcast`` deliver another device's data: the scale
travels with it (the same collective on the scale). Devices that receive nothing get zero
data (and, where the scale travels, scale 0: the exact-zero marker). ``pvary`` (an
invariant-to-varying cast) keeps the scale. ``axis_index`` has no inputs and is never
scaled; it is listed so coverage sees a rule.

**shard_map** is a higher-order rule: the body is interpreted inside a new
`jax.shard_map` on the same mesh, a `ScaledArray` operand entering as its data (with the
operand's spec) and its scale (replicated, ``P()``). A scaled result leaves the same way,
its scale first made the same on every device (``pmax`` over the manual axes it may vary
along, the data rescaled to it).

Every rule re-binds the primitive with its own ``**params``: their parameters change
between JAX releases.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax import lax
from jax.sharding import PartitionSpec

from .common import is_scaled, make_scaled, positive_or_one, pow2_sqrt_static, rescale_data
from .registry import register_rule
from .rules_control import _CarryMaskChanged, _conform


def varying_axes(x: Any) -> frozenset:
    """Manual mesh axes along which ``x`` may differ between devices, as JAX's
    ``check_vma`` typing records them (empty outside ``shard_map`` or without it)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def _axes(names: Any) -> tuple:
    return tuple(names) if isinstance(names, (tuple, list)) else (names,)


def _named(axes: tuple) -> tuple:
    """The named (device or ``vmap``) axes among ``axes``. A named ``vmap`` axis reaches
    the engine batched, as a positional (integer) axis of the data: the collective then
    reduces over the data's own dimension, which one scale already covers."""
    return tuple(a for a in axes if not isinstance(a, int))


def _group_size(axes: tuple, groups: Any, shape: tuple) -> int:
    """Terms each output sums: the devices of the group (or of the named axes) times the
    extent of the positional axes."""
    positional = math.prod(shape[a] for a in axes if isinstance(a, int))
    if groups:
        return len(groups[0]) * positional
    return int(math.prod(lax.axis_size(a) for a in _named(axes)) * positional)


def _tracked(data: Any, axes: tuple) -> bool:
    """Whether JAX types ``data`` as varying along ``axes``: then the scale's own typing
    tells if it can differ between devices. Otherwise (``check_vma=False``, a named
    ``vmap`` axis) nothing is known and scales must be agreed on."""
    return bool(set(axes) & varying_axes(data))


def to_varying(x: Any, axes: tuple) -> Any:
    """``x`` typed as varying along ``axes`` (a no-op where typing is off, and along axes
    ``x`` already varies over)."""
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return lax.pcast(x, missing, to="varying") if missing else x


def _common(x: Any, axes: Any, groups: Any = None, divide: float = 1.0) -> tuple[Any, Any]:
    """``x``'s data expressed in one scale shared by every device along ``axes`` (and
    divided by ``divide``), and that scale: the largest per-device scale (scale 0, an
    exact-zero shard, never wins over a positive one; all zero gives 1). A scale typed
    invariant along ``axes`` is already everyone's: no collective, no rescale; so is a
    scale over positional axes only (a batched ``vmap`` axis)."""
    axes = _named(_axes(axes))
    if not axes or (_tracked(x.data, axes) and not set(axes) & varying_axes(x.scale)):
        data = x.data if divide == 1.0 else rescale_data(x.data, 1.0 / divide)
        return data, x.scale
    s = positive_or_one(lax.pmax(x.scale, axes, axis_index_groups=groups))
    return rescale_data(x.data, (x.scale / s) * (1.0 / divide)), s


# -- reductions --------------------------------------------------------------------------


def _summed(prim, x, axes, keyword: str, params):
    """A sum over devices: one scale, the data divided by pow2(sqrt(N)), summed (the axes
    passed back under ``keyword``, as the primitive names them)."""
    groups = params.get("axis_index_groups")
    f = pow2_sqrt_static(_group_size(_axes(axes), groups, x.shape))
    data, s = _common(x, axes, groups, divide=f)
    return make_scaled(prim.bind(data, **{keyword: axes}, **params), s * f)


def scaled_psum(prim, x, *, axes, **params):
    """psum (and psum_invariant)."""
    return _summed(prim, x, axes, "axes", params)


def scaled_pextremum(prim, x, *, axes, **params):
    """pmax / pmin: one scale, then the extremum of the data."""
    data, s = _common(x, axes, params.get("axis_index_groups"))
    return make_scaled(prim.bind(data, axes=axes, **params), s)


def scaled_reduce_scatter(prim, x, *, axis_name, **params):
    """psum_scatter: as psum, each device keeping its piece of the sum."""
    return _summed(prim, x, axis_name, "axis_name", params)


# -- gathers and exchanges ----------------------------------------------------------------


def scaled_regroup(prim, x, *, axis_name, **params):
    """all_gather / all_to_all: pieces of every device end up side by side, so they must
    share one scale first."""
    data, s = _common(x, axis_name, params.get("axis_index_groups"))
    return make_scaled(prim.bind(data, axis_name=axis_name, **params), s)


def scaled_move(prim, x, *, axis_name, **params):
    """ppermute / pbroadcast: the data received is the sender's, in the sender's scale,
    so the scale goes through the same collective (unless it is typed invariant: then
    every device's scale is the same, and a device that receives nothing gets zero
    data, which any scale represents)."""
    data = prim.bind(x.data, axis_name=axis_name, **params)
    axes = _axes(axis_name)
    scale = x.scale
    if not _tracked(x.data, axes) or set(axes) & varying_axes(scale):
        scale = prim.bind(to_varying(scale, axes), axis_name=axis_name, **params)
    return make_scaled(data, scale)


def scaled_pvary(prim, x, *, axes, **params):
    """Invariant -> varying cast: the data is cast, the (invariant) scale is kept. Data
    already typed varying along an axis (rescaled by a scale that varies) is not cast
    along it again."""
    missing = tuple(a for a in _axes(axes) if a not in varying_axes(x.data))
    data = prim.bind(x.data, axes=missing, **params) if missing else x.data
    return make_scaled(data, x.scale)


def scaled_axis_index(prim, **params):
    """axis_index has no inputs, so it is never scaled; listed so coverage sees a rule."""
    return prim.bind(**params)


# -- shard_map ------------------------------------------------------------------------------


def manual_axes(params: dict) -> tuple:
    """The mesh axes a ``shard_map`` equation makes manual, in mesh order."""
    names = tuple(params["mesh"].axis_names)
    manual = params.get("newly_manual_axes", params.get("axis_names")) or names
    return tuple(a for a in names if a in manual)


def check_vma_of(params: dict) -> bool:
    return bool(params.get("check_vma", params.get("check_rep", True)))


def invariant_scale(x: Any, axes: tuple, check_vma: bool) -> Any:
    """``x`` with one scale on every device of the manual ``axes``: a shard_map output's
    scale is returned replicated. With ``check_vma`` only the axes the scale is typed as
    varying along are agreed on; without it nothing is known, so all of them are."""
    if check_vma:
        axes = tuple(a for a in axes if a in varying_axes(x.scale))
    if not axes:
        return x
    s = positive_or_one(lax.pmax(x.scale, axes))
    return make_scaled(rescale_data(x.data, x.scale / s), s)


def scaled_shard_map(ctx, eqn, invals):
    """Interpret a ``shard_map`` body inside a new `jax.shard_map` on the same mesh.

    A `ScaledArray` operand enters as two: its data with the operand's spec, its scale
    replicated (``P()``). Scaled outputs leave the same way, their scales made invariant
    over the manual axes first (`invariant_scale`). Which outputs are scaled is found as
    for loop carries: trace with a guess, widen and retrace when a plain guess comes back
    scaled. An observer's body outputs (the probe's statistics) leave replicated: the
    observer reduces them across devices itself (see `Observer.nested`, kind
    ``"shard_map"``).
    """
    p = eqn.params
    body = p["jaxpr"]
    consts = list(getattr(body, "consts", ()))
    body = getattr(body, "jaxpr", body)
    axes, check_vma = manual_axes(p), check_vma_of(p)
    in_mask = [is_scaled(v) for v in invals]
    flat_in, in_specs = [], []
    for v, spec in zip(invals, p["in_specs"], strict=True):
        if is_scaled(v):
            flat_in += [v.data, v.scale]
            in_specs += [spec, PartitionSpec()]
        else:
            flat_in.append(v)
            in_specs.append(spec)
    mask = [False] * len(p["out_specs"])
    bodies, inner = [], []  # contexts and outputs of the body traces (the last one counts)

    while True:

        def run(*flat, mask=mask):
            it = iter(flat)
            args = [make_scaled(next(it), next(it)) if m else next(it) for m in in_mask]
            sub = ctx.nested(eqn, "shard_map")
            bodies.append(sub)
            _link(sub, invals, args)
            outs = _conform(sub.eval_jaxpr(body, consts, args), mask)
            inner.append(outs)
            flat_out = []
            for o in outs:
                if is_scaled(o):
                    o = invariant_scale(o, axes, check_vma)
                    flat_out += [o.data, o.scale]
                else:
                    flat_out.append(o)
            return flat_out, sub.body_outputs()

        out_specs = []
        for spec, m in zip(p["out_specs"], mask, strict=True):
            out_specs += [spec, PartitionSpec()] if m else [spec]
        mapped = jax.shard_map(
            run,
            mesh=p["mesh"],
            in_specs=tuple(in_specs),
            out_specs=(out_specs, PartitionSpec()),
            axis_names=frozenset(axes),
            check_vma=check_vma,
        )
        try:
            flat_out, extra = mapped(*flat_in)
        except _CarryMaskChanged as change:
            mask = change.mask
            continue
        ctx.adopt(bodies[-1], extra, "shard_map")
        it = iter(flat_out)
        outs = [make_scaled(next(it), next(it)) if m else next(it) for m in mask]
        _link(ctx, inner[-1], outs)
        return outs


def _link(ctx, sources, values) -> None:
    """Tell an observer that values on both sides of the shard_map boundary are the same
    (the per-device pieces of one global value)."""
    if ctx.observer is not None:
        for src, dst in zip(sources, values, strict=True):
            ctx.observer.same_value(src, dst)


#: Every collective's rule, by primitive name. Each binds the equation's own primitive
#: (``with_primitive``): several are not exported by JAX, and a name this JAX release
#: lacks never meets its rule.
RULES = {
    "psum": scaled_psum,
    "psum_invariant": scaled_psum,
    "pmax": scaled_pextremum,
    "pmin": scaled_pextremum,
    "reduce_scatter": scaled_reduce_scatter,
    "all_gather": scaled_regroup,
    "all_gather_invariant": scaled_regroup,
    "all_to_all": scaled_regroup,
    "ppermute": scaled_move,
    "pbroadcast": scaled_move,
    "pvary": scaled_pvary,
    "axis_index": scaled_axis_index,
}

#: Primitives that reduce or move a value across devices: every collective rule's but
#: ``axis_index`` (which reads no value).
COLLECTIVES = frozenset(RULES) - {"axis_index"}

for _name, _rule in RULES.items():
    register_rule(_name, _rule, with_primitive=True)
register_rule("shard_map", scaled_shard_map, higher_order=True)
