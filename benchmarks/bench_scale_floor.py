"""The compile-cost floor of in-graph scale propagation, next to plain and scalify.

scalify keeps each tensor's scale as a traced float32 value in the step, with range
guards and input normalisation that make it exact at any scale (docs/engine.md). How
much of its trace+compile cost is inherent to carrying scales through the graph at all?
This script compiles an *idealised* engine, the cheapest one that still propagates a
traced scale per value:

- every float value carries an int32 exponent ``e`` (value = data * 2**e), so a product
  of scales is one integer add and can never over- or underflow (no guards);
- ``mul``/``dot_general`` add exponents; shape ops, reductions and ``neg``/``abs`` pass
  them through; ``add``/``sub``/``max``/``min``/comparisons/``select_n``/
  ``concatenate`` align their scaled operands to the largest exponent; any other
  primitive unscales its inputs and returns exponent 0;
- no input normalisation, no output renormalisation, no unit-scaling constants, and a
  literal is used as it is.

It is a cost model, not an engine: its values are right only when every exponent is
0, which is how it is run here (its outputs are checked against the plain step's).
Anything a real engine must add (range handling, unit-scaling factors, renormalising
non-linear outputs) only adds operations, so its compile time bounds scalify's from
below. Variants: exponents known at trace time (XLA folds the whole scale program: the
cost of the data-side multiplies alone), and traced exponents with and without
materialisation (`scalescope.scalify.common.materialized`'s float remainder).

    python benchmarks/bench_scale_floor.py [--models mlp,gpt] [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable
from functools import reduce
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

import scalescope as ss
from scalescope.sample_models.train_step import make_optimizer, make_train_step

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_scalify import _gpt, _mlp  # noqa: E402  (the same models as bench_scalify)

PASS_THROUGH = {
    "neg", "abs", "sign", "reshape", "transpose", "broadcast_in_dim", "squeeze",
    "expand_dims", "slice", "dynamic_slice", "dynamic_update_slice", "gather", "rev",
    "pad", "copy", "copy_p", "reduce_sum", "reduce_max", "reduce_min", "cumsum",
    "convert_element_type", "stop_gradient", "scatter-add", "scatter_add",
    "select_and_scatter_add", "reduce_precision",
}  # fmt: skip
MULTIPLY = {"mul", "dot_general"}
ALIGN = {
    "add", "add_any", "sub", "max", "min", "select_n", "concatenate",
    "eq", "ne", "lt", "le", "gt", "ge",
}  # fmt: skip
CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr",
         "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
         "remat": "jaxpr", "checkpoint": "jaxpr"}  # fmt: skip
UNSUPPORTED = {"scan", "while", "cond"}


def exp2(e: jax.Array, dtype: Any) -> jax.Array:
    """``2**e`` for an int32 ``e``, built in the float32 exponent field (clamped to the
    normal range)."""
    biased = lax.clamp(np.int32(1), e + np.int32(127), np.int32(254))
    return lax.bitcast_convert_type(lax.shift_left(biased, np.int32(23)), jnp.float32).astype(dtype)


def _materialize(e: jax.Array) -> jax.Array:
    """``e`` computed once by XLA, not inside every fusion that reads it (the float
    remainder scalify uses, through float32: exact for any exponent that matters)."""
    as_float = lax.convert_element_type(e, np.float32)
    return lax.convert_element_type(lax.rem(as_float, np.float32(np.inf)), np.int32)


def _is_float(v: Any) -> bool:
    dtype = getattr(getattr(v, "aval", None), "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def _apply(eqn, ins: list[tuple[Any, Any]], materialize: bool) -> list[tuple[Any, Any]]:
    """One primitive on ``(data, exponent)`` pairs (exponent None: not scaled)."""
    name = eqn.primitive.name
    if name in UNSUPPORTED:
        raise NotImplementedError(
            f"bench_scale_floor models straight-line steps; {name!r} is not modelled "
            "(use unrolled layers)"
        )
    datas = [d for d, _ in ins]
    exps = [e for _, e in ins if e is not None]
    if not exps or name in PASS_THROUGH:
        e_out = exps[0] if exps else None
        out = eqn.primitive.bind(*datas, **eqn.params)
    elif name in MULTIPLY:
        e_out = exps[0] + exps[1] if len(exps) == 2 else exps[0]
        out = eqn.primitive.bind(*datas, **eqn.params)
    elif name in ALIGN:
        e_out = reduce(lax.max, exps)
        if len(exps) > 1:
            datas = [d if e is None else d * exp2(e - e_out, d.dtype) for d, e in ins]
        out = eqn.primitive.bind(*datas, **eqn.params)
    else:
        datas = [d if e is None else d * exp2(e, d.dtype) for d, e in ins]
        out = eqn.primitive.bind(*datas, **eqn.params)
        e_out = np.int32(0)
    if materialize and isinstance(e_out, jax.core.Tracer) and all(e_out is not e for e in exps):
        e_out = _materialize(e_out)
    outs = out if eqn.primitive.multiple_results else [out]
    return [(d, e_out if _is_float(v) else None) for v, d in zip(eqn.outvars, outs)]


def _eval(jaxpr, consts, args: list[tuple[Any, Any]], materialize: bool):
    env: dict = {}

    def read(v):
        return (v.val, None) if isinstance(v, jcore.Literal) else env[v]

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = (c, None)
    for v, a in zip(jaxpr.invars, args):
        env[v] = a
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        sub = eqn.params.get(CALLS.get(eqn.primitive.name, ""))
        if sub is not None:
            closed = sub if isinstance(sub, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(sub, ())
            outs = _eval(closed.jaxpr, closed.consts, ins, materialize)
        else:
            outs = _apply(eqn, ins, materialize)
        for v, o in zip(eqn.outvars, outs):
            env[v] = o
    return [read(v) for v in jaxpr.outvars]


def idealised(fn: Callable, *, traced: bool, materialize: bool) -> Callable:
    """``fn`` through the idealised engine. ``traced``: the input exponents are
    arguments of the compiled step (``f(args, exponents)``), else trace-time zeros."""

    def run(args, exponents):
        closed = jax.make_jaxpr(fn)(*args)
        it = iter(exponents)
        pairs = [(x, next(it) if _is_float(x) else None) for x in jax.tree.leaves(args)]
        outs = _eval(closed.jaxpr, closed.consts, pairs, materialize)
        return [d if e is None else d * exp2(e, d.dtype) for d, e in outs]

    if traced:
        return run
    return lambda args: run(args, [np.int32(0)] * len(jax.tree.leaves(args)))


def _trace_compile(make: Callable[[], Callable], args: tuple, reps: int) -> tuple[float, Any]:
    """Median trace+lower+compile seconds of a fresh function each time, and the last
    compiled step."""
    times = []
    for _ in range(reps):
        fn = make()
        t0 = time.perf_counter()
        compiled = jax.jit(fn).lower(*args).compile()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), compiled


def _compare(loss: Callable, params: Any, batch: Any, reps: int) -> list[tuple[str, float]]:
    """``(variant, median trace+compile seconds)`` of one model's AdamW step: plain, the
    three idealised variants (their outputs checked against the plain step's), scalify."""
    opt = make_optimizer()
    step = make_train_step(loss, opt)
    plain_args = (params, opt.init(params), batch)
    exponents = [np.int32(0)] * sum(_is_float(x) for x in jax.tree.leaves(plain_args))
    plain_s, plain_c = _trace_compile(lambda: lambda *a: step(*a), plain_args, reps)
    rows = [("plain", plain_s)]
    want = jax.tree.leaves(plain_c(*plain_args))
    for label, traced, mat in (
        ("ideal, exponents folded", False, False),
        ("ideal, traced exponents", True, False),
        ("ideal, traced, materialised", True, True),
    ):
        call = (plain_args, exponents) if traced else (plain_args,)
        seconds, compiled = _trace_compile(
            lambda t=traced, m=mat: idealised(step, traced=t, materialize=m), call, reps
        )
        for w, g in zip(want, compiled(*call), strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
        rows.append((label, seconds))
    scaled = (ss.as_scaled_array(params, "rms"), ss.as_scaled_array(opt.init(params), "rms"))
    scal_s, _ = _trace_compile(lambda: ss.scalify(step), (*scaled, batch), reps)
    rows.append(("scalify", scal_s))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,gpt", help="comma-separated: mlp, gpt, small")
    parser.add_argument("--reps", type=int, default=3, help="compiles per variant (median)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=128)
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    # the models of bench_scalify, fp32, unrolled
    opts = SimpleNamespace(seq=64, batch=16, precision="fp32", scan=False)
    builders = {
        "mlp": lambda: _mlp(opts),
        "gpt": lambda: _gpt(opts, args.layers, args.d_model),
        "small": lambda: _gpt(opts, 1, 64),
    }
    names = args.models.split(",")
    for name in names:
        if name not in builders:
            parser.error(f"--models: unknown model {name!r} (choose from {sorted(builders)})")
    # the persistent compilation cache would hide the compile being measured
    jax.config.update("jax_enable_compilation_cache", False)
    jax.jit(lambda x: x + 1).lower(1.0).compile()  # XLA's one-time start-up, not timed
    print(
        f"# bench_scale_floor  jax {jax.__version__}  {jax.devices()[0].platform}  "
        f"{platform.processor() or platform.machine()}  load average "
        f"{os.getloadavg()[0]:.2f}  median of {args.reps}"
    )
    print(f"{'variant':40s}{'trace+compile s':>16s}{'x plain':>9s}")
    for name in names:
        label, loss, params, batch = builders[name]()
        print(f"## {label}")
        rows = _compare(loss, params, batch, args.reps)
        for vlabel, seconds in rows:
            print(f"{vlabel:40s}{seconds:16.2f}{seconds / rows[0][1]:9.2f}")
    print("# ideal outputs equal the plain step's (exponents 0)")


if __name__ == "__main__":
    main()
