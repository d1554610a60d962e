"""`unit_scale(fn)`: unit scaling applied automatically to a JAX function's jaxpr.

``fn`` is traced with `jax.make_jaxpr` and its jaxpr interpreted equation by equation.
Before a (sub-)jaxpr is run, a pattern pass finds the ops to rewrite; running it then
multiplies chosen operands by `scale_bwd` (gradient only) and chosen outputs by
`scale_fwd` (value only), so the backward scales come from those custom_vjp functions
and the result composes with `jax.jit` and `jax.grad`. docs/unit.md ("unit_scale")
lists what is rewritten, how patterns are recognised and the limits.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from ..scalify import traverse
from ..scalify.interpreter import bind_plain, written_at
from ..scalify.source import format_source
from .calibrate import (
    _ITER,
    Calibration,
    _calibrate,
    _generic,
    _gradient_tap,
    _inverse,
    _is_dynamic,
    _replaced,
    _rms,
    check_signature,
)
from .constraints import validate_constraint
from .patterns import _CALL_PRIMS, _is_float
from .plan import (
    ACT,
    CONST,
    ELEMENTWISE_SCALES,
    PARAM,
    Rewrite,
    _analyse,
    _flag,
    _Options,
    _Plan,
)
from .scale import scale_bwd, scale_fwd

# -- the interpreter ---------------------------------------------------------------------


def _scaled(x: Any, fwd: float, bwd: float) -> Any:
    if bwd != 1.0:
        x = scale_bwd(x, bwd)
    if fwd != 1.0:
        x = scale_fwd(x, fwd)
    return x


def _contains(jaxpr: Any, prim: str) -> bool:
    """Whether ``prim`` occurs in ``jaxpr`` or any of its sub-jaxprs."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == prim:
            return True
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            if _contains(sub, prim):
                return True
    return False


class _Interpreter:
    """Runs jaxprs with the rewrites of `_analyse`; records them in ``log``."""

    def __init__(self, opts: _Options, cal: Calibration | None = None):
        self.opts = opts
        self.log: list[Rewrite] = []
        self.before_residual = False  # the call being interpreted has a residual add after it
        self.cal = cal
        self.path: tuple = ()  # indices of the higher-order equations being interpreted
        self.keys: set[tuple] = set()  # calibration keys this trace looked up
        self.unrolling = False  # measuring inside a scan unrolled in Python
        self.iteration: dict[tuple, Any] = {}  # the current iteration's multipliers

    def _calibrated(self, key: tuple, val: Any, forward: bool, backward: bool) -> Any:
        """``val`` with the calibration's multipliers for ``key`` (measuring them first
        while calibrating)."""
        cal = self.cal
        self.keys.add(key)
        if forward:
            if cal.mode == "forward" and not isinstance(val, jax.core.Tracer):
                cal.forward[key] = _inverse(_rms(val))
            if (f := self._multiplier(key, "forward")) is not None:
                val = scale_fwd(val, f)
        if backward:
            if cal.mode == "backward":
                val = _gradient_tap(val, key, cal.backward)
            elif (f := self._multiplier(key, "backward")) is not None:
                val = scale_bwd(val, f)
        return val

    def _multiplier(self, key: tuple, kind: str) -> Any:
        """The ``kind`` ("forward" or "backward") multiplier of ``key``: the current
        scan iteration's (traced), else the calibration's; None where it is 1."""
        if (key, kind) in self.iteration:
            return self.iteration[(key, kind)]
        f = getattr(self.cal, kind).get(key, 1.0)
        return None if f == 1.0 else f

    def _iteration_multipliers(self, length: int) -> dict[tuple, np.ndarray]:
        """Per-iteration multipliers of the scan being interpreted (at ``self.path``), as
        arrays of ``length`` keyed by ``(generic key, "forward" | "backward")``."""
        prefix = self.path
        out: dict[tuple, np.ndarray] = {}
        for kind, table in (("forward", self.cal.forward), ("backward", self.cal.backward)):
            for (path, var), f in table.items():
                if len(path) <= len(prefix) or path[: len(prefix)] != prefix:
                    continue
                step = path[len(prefix)]
                if not (isinstance(step, tuple) and step[0] == _ITER):
                    continue
                key = ((*prefix, _ITER, *path[len(prefix) + 1 :]), var)
                out.setdefault((key, kind), np.ones(length, np.float32))[step[1]] = f
        return out

    def run_closed(self, closed: Any, args: Sequence[Any], flags: Sequence[str]) -> list[Any]:
        return self.run(closed.jaxpr, closed.consts, args, flags)

    def run(
        self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], flags: Sequence[str]
    ) -> list[Any]:
        plan = _analyse(jaxpr, flags, self.opts, self.log, self.before_residual)
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))
        cache: dict[tuple[Any, tuple[float, float]], Any] = {}
        define = self._definer(jaxpr, plan)
        for v in jaxpr.invars:
            env[v] = define(v, env[v])

        def read(v: Any, i: int, pos: int) -> Any:
            if isinstance(v, Literal):
                return v.val
            fb = plan.operand.get((i, pos), plan.default_read.get(v))
            if fb is None or fb == (1.0, 1.0):
                return env[v]
            if (v, fb) not in cache:
                cache[(v, fb)] = _scaled(env[v], *fb)
            return cache[(v, fb)]

        for i, eqn in enumerate(jaxpr.eqns):
            # what this equation becomes (its unit-scaled version, the scales around it)
            # is placed where the user wrote it, not in this interpreter: the probe,
            # the advisor's fixes and errors name the user's line
            with written_at(eqn):
                invals = [read(v, i, pos) for pos, v in enumerate(eqn.invars)]
                if i in plan.loss_mean:
                    outvals = [scale_fwd(invals[0], plan.loss_mean[i])]
                elif i in plan.call_groups:
                    outvals = bind_plain(eqn, invals)
                else:
                    sub_flags = [_flag(v, plan.param_like, plan.live) for v in eqn.invars]
                    outer, self.before_residual = self.before_residual, i in plan.constrained
                    outer_path, self.path = self.path, (*self.path, i)
                    try:
                        outvals = self.apply(eqn, invals, sub_flags)
                    finally:
                        self.before_residual, self.path = outer, outer_path
                for v, out in zip(eqn.outvars, outvals, strict=True):
                    env[v] = define(v, scale_fwd(out, plan.output[v]) if v in plan.output else out)
        return [read(v, -1, -1) for v in jaxpr.outvars]

    def _definer(self, jaxpr: Any, plan: _Plan) -> Callable[[Any, Any], Any]:
        """``define(var, value)``: the value a variable of ``jaxpr`` is bound to, with
        the calibration's multipliers (the value itself when not calibrating)."""
        if self.cal is None:
            return lambda v, val: val
        index = {
            v: n
            for n, v in enumerate(
                [*jaxpr.constvars, *jaxpr.invars, *(o for e in jaxpr.eqns for o in e.outvars)]
            )
        }
        forward = (set(plan.output) - plan.keep_output) | plan.calibrated_output
        read = {jaxpr.eqns[i].invars[pos] for i, pos in plan.operand} | set(plan.default_read)
        backward = {v for v in read if not isinstance(v, Literal)}
        path = self.path

        def define(v: Any, val: Any) -> Any:
            fwd, bwd = v in forward, v in backward
            if not (fwd or bwd) or not _is_float(v):
                return val
            return self._calibrated((path, index[v]), val, fwd, bwd)

        return define

    def apply(self, eqn: Any, invals: list[Any], flags: list[str]) -> list[Any]:
        """Bind ``eqn``, recursing into the bodies of higher-order primitives (calls,
        checkpoints, loops, branches; a custom_jvp function only when it has a matmul)."""
        name = eqn.primitive.name
        if not _traversed(eqn):
            return bind_plain(eqn, invals)
        if name in ("scan", "while"):
            # a loop body feeds its next iteration: everything in it stays constrained
            self.before_residual = True
        if name == "scan":
            return self._scan(eqn, invals, flags)
        body = functools.partial(self._body, flags)
        return traverse.apply(eqn, invals, body, scope=_call_scope)

    def _body(
        self, flags: list[str], closed: Any, args: list[Any], where: traverse.Where
    ) -> tuple[list[Any], Any]:
        """Run one body (a `traverse.Body`) with the flags of the operands feeding it
        (carries are activations); a branch under a path of its own; a while loop's
        predicate as it is."""
        if where.kind == traverse.WHILE_COND:
            return jax.extend.core.jaxpr_as_fun(closed)(*args), ()
        path = (*self.path, where.index) if where.kind == traverse.BRANCH else self.path
        return self._run_at(path, self.iteration, closed, args, flags, where), ()

    def _run_at(
        self,
        path: tuple,
        iteration: dict,
        closed: Any,
        args: list[Any],
        flags: list[str],
        where: traverse.Where,
    ) -> list[Any]:
        """``run_closed`` of a body at ``path`` with the multipliers ``iteration``."""
        outer = self.path, self.iteration
        self.path, self.iteration = path, iteration
        try:
            return self.run_closed(closed, args, traverse.body_operands(where, flags, ACT))
        finally:
            self.path, self.iteration = outer

    def _scan(self, eqn: Any, invals: list[Any], flags: list[str]) -> list[Any]:
        cal, length = self.cal, eqn.params["length"]
        if cal is not None and cal.mode != "apply" and not self.unrolling and length > 0:
            # run in Python while calibrating, so that the body's values are concrete
            # and each iteration gets multipliers of its own
            self.unrolling = True
            try:
                return traverse.scan_unrolled(
                    eqn, invals, functools.partial(self._iteration, flags)
                )
            finally:
                self.unrolling = False
        mult = {}
        if cal is not None and cal.mode == "apply" and not self.iteration:
            mult = self._iteration_multipliers(length)
        names = sorted(mult)
        step = functools.partial(self._step, flags, names)
        return traverse.scan(eqn, invals, step, aux_xs=[jnp.asarray(mult[n]) for n in names])[0]

    def _step(
        self,
        flags: list[str],
        names: list[tuple],
        closed: Any,
        args: list[Any],
        where: traverse.Where,
    ) -> tuple[list[Any], Any]:
        """A scan body: at the scan's generic iteration path, with this iteration's
        multipliers (``where.aux``, named by ``names``) where it has any."""
        iteration = dict(zip(names, where.aux, strict=True)) or self.iteration
        return self._run_at((*self.path, _ITER), iteration, closed, args, flags, where), ()

    def _iteration(
        self, flags: list[str], closed: Any, args: list[Any], where: traverse.Where
    ) -> tuple[list[Any], Any]:
        """A scan body run unrolled: at the path of its iteration (``where.index``)."""
        path = (*self.path, (_ITER, where.index))
        return self._run_at(path, self.iteration, closed, args, flags, where), ()


def _traversed(eqn: Any) -> bool:
    """Whether unit_scale interprets ``eqn``'s bodies: calls, checkpoints, loops and
    branches; a custom_jvp function (``jax.nn.relu``'s kind) only when it has a matmul."""
    name = eqn.primitive.name
    if name == "custom_jvp_call":
        return _contains(eqn.params["call_jaxpr"].jaxpr, "dot_general")
    return name in _CALL_PRIMS or name in traverse.CHECKPOINTS or name in ("scan", "while", "cond")


def _call_scope(eqn: Any) -> str | None:
    """The name scope of an inlined call: its name, else its primitive's (none for a
    custom_jvp function)."""
    if eqn.primitive.name in _CALL_PRIMS:
        return eqn.params.get("name") or eqn.primitive.name
    return None


# -- the public transform ----------------------------------------------------------------


def _backward_at(jaxpr: Any) -> str | None:
    """Where ``jaxpr`` (or a body in it) holds a backward pass, ``name stack at
    file:line`` of its first equation; None when it has none."""
    for eqn in jaxpr.eqns:
        stack = str(getattr(eqn.source_info, "name_stack", ""))
        if "transpose(" in stack:
            return f"{eqn.primitive.name} under {stack} at {format_source(eqn.source_info)}"
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found = _backward_at(getattr(sub, "jaxpr", sub))
            if found is not None:
                return found
    return None


def unit_scale(
    fn: Callable[..., Any],
    *,
    tau: float = 1.0,
    constraint: str | None = "to_output_scale",
    readout: bool = True,
    calibrate: Sequence[Any] | None = None,
) -> Callable[..., Any]:
    """Unit-scale ``fn`` automatically: the same function with unit-scaled ops.

    ``fn`` is traced to a jaxpr on its array arguments (other leaves are static) and
    interpreted: dot_generals become unit-scaled matmuls (linear when one operand is a
    parameter, the u-μP readout when it produces the logits of a recognised loss),
    ``softmax(c·q k^T [mask]) v`` becomes one unit-scaled attention, GELU, SiLU, ReLU,
    tanh, sigmoid and softmax get their unit scales, a log-softmax followed
    by a mean keeps its value and gets `U.cross_entropy`'s gradient scale, and an add
    whose operands share an ancestor becomes residual_split/residual_add with ``tau``.
    Weights are used as they are: initialise them with unit std. ``constraint`` ties
    each op's output and input-gradient scales as in `scalescope.unit`; ``readout=False``
    treats the logits projection as an ordinary linear.

    ``calibrate=(arg, ...)``: example positional arguments. The library's constants
    assume unit-normal data and large sizes; calibration measures, once, on these
    arguments (eagerly, op by op, in the order of the forward and then the backward
    pass), the RMS each rewritten op's output and each gradient of a value such an op
    reads actually has, and folds its inverse into the constants, so that on these
    arguments they are exactly 1. The constants stay static afterwards. The readout's
    logits keep their u-μP scale; a `lax.scan` is unrolled while measuring, so each
    iteration gets its own multipliers (scanned along with the loop's inputs); `cond`
    branches keep the library's constants. The measured multipliers are in the
    ``calibration`` attribute (a `Calibration`). It sets forward and backward scales
    independently, so it needs ``constraint=None``.

    The returned function has ``fn``'s signature and outputs, composes with `jax.jit`
    and `jax.grad`, and has a ``rewrites`` attribute: the list of `Rewrite` made by its
    latest trace.
    """
    if not callable(fn):
        raise TypeError(f"unit_scale: fn must be callable, got {type(fn).__name__}")
    if isinstance(tau, bool) or not (isinstance(tau, int | float) and math.isfinite(tau)):
        raise ValueError(f"unit_scale: tau must be a finite number >= 0, got {tau!r}")
    if tau < 0:
        raise ValueError(f"unit_scale: tau must be a finite number >= 0, got {tau!r}")
    validate_constraint(constraint, "unit_scale")
    opts = _Options(float(tau), constraint, bool(readout))
    cal = None
    if calibrate is not None:
        if not isinstance(calibrate, tuple | list):
            raise TypeError(
                "unit_scale: calibrate must be a tuple of example positional arguments "
                f"for fn, got {type(calibrate).__name__}"
            )
        if constraint is not None:
            raise ValueError(
                "unit_scale: calibrate= sets each forward and backward scale on its own, "
                f"which needs constraint=None; got constraint={constraint!r}"
            )
        cal = Calibration()

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if cal is not None:
            check_signature(cal, (args, kwargs))
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        dyn = [i for i, leaf in enumerate(leaves) if _is_dynamic(leaf)]

        def flat_fn(*vals: Any) -> Any:
            a, k = jax.tree_util.tree_unflatten(treedef, _replaced(leaves, dyn, vals))
            return fn(*a, **k)

        dyn_vals = [leaves[i] for i in dyn]
        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*dyn_vals)
        backward = _backward_at(closed.jaxpr)
        if backward is not None:
            raise ValueError(
                f"unit_scale: {getattr(fn, '__name__', 'fn')} computes gradients itself "
                f"({backward}). Its backward pass is already written out, so unit-scaling "
                "its forward ops would leave the gradients unscaled, and an optimizer's "
                "arithmetic would be read as residual adds. Unit-scale the loss (or the "
                "model) and differentiate that: jax.grad(ss.unit_scale(loss_fn))."
            )
        interp = _Interpreter(opts, cal)
        flags = [PARAM if _is_float(v) else CONST for v in closed.jaxpr.invars]
        outs = interp.run_closed(closed, dyn_vals, flags)
        wrapped.rewrites = interp.log
        if cal is not None and cal.mode == "apply":
            missing = {_generic(k) for k in (*cal.forward, *cal.backward)} - interp.keys
            if missing:
                raise ValueError(
                    f"unit_scale: calibrated on a program with {len(missing)} values this "
                    "call does not have; call the function with arguments structured as "
                    "calibrate= (the same pytree, dtypes and ranks)"
                )
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)

    wrapped.rewrites = []
    if cal is not None:
        _calibrate(wrapped, cal, tuple(calibrate))
        wrapped.calibration = cal
    return wrapped


__all__ = ["ELEMENTWISE_SCALES", "Calibration", "Rewrite", "unit_scale"]
