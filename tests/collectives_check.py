"""Run with 8 host devices (XLA_FLAGS=--xla_force_host_platform_device_count=8): scalify
and instrument across devices.

- every collective rule on ScaledArrays whose scale differs per device (2**device index)
  equals the plain collective on the unscaled values, and leaves one scale on all devices;
- a data-parallel MLP training step (shard_map, pmean'ed gradients, optax adam) scalified
  on 8 devices matches the single-device scalified step and the plain step;
- a tensor-parallel MLP (column- then row-parallel matmul + psum) scalified on 8 devices
  matches the plain single-device computation;
- `ss.instrument` of the data-parallel step on 8 devices gives the statistics of the same
  step on a 1-device mesh (whole values, not shards);
- jit in/out shardings and sharding constraints survive scalify.

Prints one line per check; exits non-zero with a message on the first failure.
"""

from __future__ import annotations

import functools
import sys
import tempfile
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import scalescope as ss
from scalescope.core.scaled_array import ScaledArray

N = 8
RTOL = 1e-6


def fail(msg: str) -> None:
    print(f"FAIL: {msg}")
    sys.exit(1)


def close(name: str, got, want, rtol: float, atol: float = 0.0) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        fail(f"{name}: shape {got.shape} != {want.shape}")
    if not np.allclose(got, want, rtol=rtol, atol=atol):
        err = np.max(np.abs(got - want) / (np.abs(want) * rtol + atol + 1e-300))
        fail(f"{name}: differs from the reference (worst error {err:.3g} x tolerance)")


def is_scaled(x) -> bool:
    return isinstance(x, ScaledArray)


def unscaled(tree):
    return jax.tree.map(
        lambda x: np.asarray(x.to_array() if is_scaled(x) else x), tree, is_leaf=is_scaled
    )


# -- 1. the collective rules ---------------------------------------------------------------


def per_device_scaled(x, axes=("d",)):
    """``x`` (a shard) as a ScaledArray with scale 2**(device index): scales differ."""
    i = sum(lax.axis_index(a) * (k + 1) for k, a in enumerate(axes))
    s = jnp.exp2(i.astype(jnp.float32))
    return ScaledArray(x / s, s)


def check_collectives(check_vma: bool) -> None:
    mesh = Mesh(np.array(jax.devices()), ("d",))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N * 16, 4)).astype(np.float32)  # 16 rows per device
    shards = x.reshape(N, 16, 4)
    perm = [(j, (j + 3) % N) for j in range(N)]
    partial_perm = [(0, 1), (2, 5)]  # devices 1, 5 receive; the others get zeros

    def received(p):
        out = np.zeros_like(shards)
        for src, dst in p:
            out[dst] = shards[src]
        return out.reshape(N * 16, 4)

    a2a = shards.reshape(N, N, 2, 4).transpose(1, 0, 2, 3).reshape(N * 16, 4)
    cases = {
        # name: (collective on the local value, out spec of the result, numpy reference)
        "psum": (lambda v: lax.psum(v, "d"), P(), shards.sum(0)),
        "pmean": (lambda v: lax.pmean(v, "d"), P(), shards.mean(0)),
        "pmax": (lambda v: lax.pmax(v, "d"), P(), shards.max(0)),
        "pmin": (lambda v: lax.pmin(v, "d"), P(), shards.min(0)),
        "all_gather": (lambda v: lax.all_gather(v, "d"), P(), shards),
        "all_gather tiled": (lambda v: lax.all_gather(v, "d", tiled=True), P(), x),
        "psum_scatter": (
            lambda v: lax.psum_scatter(v, "d", tiled=True),
            P("d"),
            shards.sum(0),
        ),
        "ppermute": (lambda v: lax.ppermute(v, "d", perm), P("d"), received(perm)),
        "ppermute partial": (
            lambda v: lax.ppermute(v, "d", partial_perm),
            P("d"),
            received(partial_perm),
        ),
        "all_to_all": (lambda v: lax.all_to_all(v, "d", 0, 0, tiled=True), P("d"), a2a),
    }
    if check_vma:
        cases["all_gather invariant"] = (
            lambda v: lax.all_gather(v, "d", tiled=True, to="invarying"),
            P(),
            x,
        )
    for name, (op, spec, want) in cases.items():

        def body(xs, op=op, name=name):
            out = ss.scalify(op, normalize=False)(per_device_scaled(xs))
            if not is_scaled(out):
                fail(f"{name}: the result is not a ScaledArray")
            # the scale of every device, to check they agree
            return out.to_array(jnp.float32), out.scale[None]

        out_spec = (spec, P("d"))
        if check_vma and name in ("all_gather", "all_gather tiled"):
            # the result is typed varying, though every device holds the same value
            out_spec = (P("d"), P("d"))
        fn = jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=out_spec, check_vma=check_vma)
        )
        got, scales = fn(x)
        got = np.asarray(got)
        if out_spec[0] == P("d") and spec == P():
            got = got.reshape(N, -1, *got.shape[1:])[0].reshape(want.shape)
        close(f"{name} (check_vma={check_vma})", got, want, RTOL, 1e-6)
        scales = np.asarray(scales)
        if name.startswith("ppermute"):
            # the data received comes with the sender's scale (2**sender); none: 0
            p = perm if name == "ppermute" else partial_perm
            want_scales = np.zeros(N, np.float32)
            for src, dst in p:
                want_scales[dst] = 2.0**src
            if not np.array_equal(scales, want_scales):
                fail(f"{name}: scales {scales}, expected the senders' {want_scales}")
        elif not np.all(scales == scales[0]):
            fail(f"{name}: output scales differ between devices: {scales}")
    # one the scalified function itself runs: psum over two axes of a 4x2 mesh
    mesh2 = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))

    def body2(xs):
        out = ss.scalify(lambda v: (lax.psum(v, ("a", "b")), lax.pmax(v, "a")), normalize=False)(
            per_device_scaled(xs, ("a", "b"))
        )
        return out[0].to_array(), out[1].to_array()

    got_sum, got_max = jax.jit(
        jax.shard_map(
            body2,
            mesh=mesh2,
            in_specs=P(("a", "b")),
            out_specs=(P(), P("b")),
            check_vma=check_vma,
        )
    )(x)
    close("psum over two axes", got_sum, shards.sum(0), RTOL, 1e-6)
    # pmax over "a": devices (a, b) hold shard 2a+b; reduce over a for each b
    want_max = np.concatenate([shards[b::2].max(0) for b in range(2)])
    close("pmax over one axis of two", got_max, want_max, RTOL, 1e-6)
    print(f"collective rules agree with the plain collectives (check_vma={check_vma})")


# -- 2. a data-parallel training step -------------------------------------------------------

OPT = optax.adam(1e-2)


def init_mlp(key, d_in=16, hidden=32, d_out=4):
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (d_in, hidden)) / np.sqrt(d_in),
        "b1": jnp.zeros((hidden,)),
        "w2": jax.random.normal(k2, (hidden, d_out)) / np.sqrt(hidden),
        "b2": jnp.zeros((d_out,)),
    }


def mlp_loss(params, x, y):
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    logits = h @ params["w2"] + params["b2"]
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(y, 4), -1))


def plain_step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(mlp_loss)(params, x, y)
    updates, opt_state = OPT.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def dp_step(mesh):
    """Each device differentiates its own copy of the parameters on its batch shard;
    gradients and loss are pmean'ed over ``data``; every device applies the update."""

    def local(params, opt_state, x, y):
        mine = lax.pcast(params, "data", to="varying")
        loss, grads = jax.value_and_grad(mlp_loss)(mine, x, y)
        grads, loss = lax.pmean((grads, loss), "data")
        updates, opt_state = OPT.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(), P(), P("data"), P("data")),
        out_specs=(P(), P(), P()),
    )


def dp_setup():
    params = init_mlp(jax.random.PRNGKey(0))
    opt_state = OPT.init(params)
    # one adam step first, so that the moments are not zero
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(N * 8, 16)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 4, N * 8), jnp.int32)
    params, opt_state, _ = jax.jit(plain_step)(params, opt_state, x, y)
    return params, opt_state, x, y


def on_mesh(args, mesh):
    params, opt_state, x, y = args
    rep, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    return (
        jax.device_put(params, rep),
        jax.device_put(opt_state, rep),
        jax.device_put(x, sharded),
        jax.device_put(y, sharded),
    )


def check_data_parallel() -> None:
    params, opt_state, x, y = dp_setup()
    plain = jax.jit(plain_step)(params, opt_state, x, y)
    scaled = (ss.as_scaled_array(params, "rms"), ss.as_scaled_array(opt_state, "rms"), x, y)
    dev0 = jax.devices()[0]
    single = jax.jit(ss.scalify(plain_step))(*jax.device_put(scaled, dev0))
    mesh = Mesh(np.array(jax.devices()), ("data",))
    step8 = dp_step(mesh)
    sharded = jax.jit(ss.scalify(step8))(*on_mesh(scaled, mesh))
    if not any(is_scaled(v) for v in jax.tree.leaves(sharded, is_leaf=is_scaled)):
        fail("data-parallel: the scalified step returned no ScaledArray")
    plain_sharded = jax.jit(step8)(*on_mesh((params, opt_state, x, y), mesh))
    for name, ref in (("plain", plain), ("single-device scalified", single)):
        for i, (a, b) in enumerate(
            zip(jax.tree.leaves(unscaled(sharded)), jax.tree.leaves(unscaled(ref)))
        ):
            close(f"data-parallel vs {name} (leaf {i})", a, b, 1e-5, 1e-7)
    for i, (a, b) in enumerate(zip(jax.tree.leaves(plain_sharded), jax.tree.leaves(plain))):
        close(f"plain data-parallel vs plain (leaf {i})", a, b, 1e-5, 1e-7)
    print("data-parallel scalified step on 8 devices matches 1 device and the plain step")


# -- 3. a tensor-parallel MLP ----------------------------------------------------------------


def check_tensor_parallel() -> None:
    mesh = Mesh(np.array(jax.devices()), ("model",))
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(8, 16)), jnp.float32)
    w1 = jnp.asarray(rng.normal(size=(16, 64)) / 4, jnp.float32)
    b1 = jnp.asarray(rng.normal(size=(64,)), jnp.float32)
    w2 = jnp.asarray(rng.normal(size=(64, 8)) / 8, jnp.float32)
    b2 = jnp.asarray(rng.normal(size=(8,)), jnp.float32)

    def local(x, w1, b1, w2, b2):
        h = jax.nn.gelu(x @ w1 + b1)  # column-parallel: this device's hidden units
        return lax.psum(h @ w2, "model") + b2  # row-parallel: partial sums added

    tp = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(), P(None, "model"), P("model"), P("model", None), P()),
        out_specs=P(),
    )
    ref = jax.nn.gelu(x @ w1 + b1) @ w2 + b2
    ref = np.asarray(jax.device_put(ref, jax.devices()[0]))
    args = [ss.as_scaled_array(a, "rms") for a in (x, w1, b1, w2, b2)]
    specs = (P(), P(None, "model"), P("model"), P("model", None), P())
    rep = NamedSharding(mesh, P())
    args = [
        jax.device_put(a, ScaledArray(NamedSharding(mesh, s), rep)) for a, s in zip(args, specs)
    ]
    out = jax.jit(ss.scalify(tp))(*args)
    if not is_scaled(out):
        fail("tensor-parallel: the output is not a ScaledArray")
    close("tensor-parallel vs single-device plain", out.to_array(), ref, 1e-5, 1e-6)
    print("tensor-parallel scalified MLP on 8 devices matches the plain computation")


# -- 4. the probe -----------------------------------------------------------------------------


MOMENTS = ("rms", "absmax", "mean")


def row_stats(table, stats, op):
    """Statistics of one op's rows (its own, or its source's for an alias)."""
    rows = table.rows(op)
    return {k: np.asarray(v)[rows] for k, v in stats.items() if k != "hist"}


def expect(name, got, value, scale=1.0, copies=1):
    """``got`` (statistics of one row) describe ``value`` (NumPy, the whole value in
    represented units) stored as ``value / scale``, counted ``copies`` times."""
    v = np.asarray(value, np.float64) / scale
    want = {
        "count": v.size * copies,
        "rms": np.sqrt(np.mean(v * v)),
        "absmax": np.max(np.abs(v)),
        "mean": np.mean(v),
    }
    if int(got["count"][0]) != want["count"]:
        fail(f"probe {name}: count {int(got['count'][0])}, expected {want['count']}")
    for k in ("rms", "absmax", "mean"):
        close(f"probe {name}: {k}", got[k][0], want[k], 1e-5, 1e-6)
    if scale != 1.0 and got["scale"][0] != scale:
        fail(f"probe {name}: scale {got['scale'][0]}, expected {scale}")


def check_probe_semantics(check_vma: bool) -> None:
    """Statistics of values inside a shard_map body describe the whole value: a varying
    value every device's piece, an invariant one a single copy, a scan inside the body
    one row per iteration over all devices, a value whose scale differs per device its
    data in the largest scale. Compared with NumPy on the global arrays."""
    mesh = Mesh(np.array(jax.devices()), ("d",))
    rng = np.random.default_rng(4)
    x = rng.normal(size=(N * 4, 3)).astype(np.float32)
    w = rng.normal(size=(3, 3)).astype(np.float32)

    def body(x, w):
        a = jnp.sin(x)  # varying: this device's rows of sin(X)
        b = jnp.cos(w)  # invariant
        p = jnp.sum(a * 3.0, axis=0)  # varying: a partial sum per device
        q = lax.psum(p, "d")  # invariant
        grow = jnp.exp2(lax.axis_index("d").astype(jnp.float32))  # 2**device index
        r = ss.ops.dynamic_rescale_max(a * grow)  # scalified: a scale per device
        c0 = lax.pcast(jnp.zeros(3), "d", to="varying")
        c, ys = lax.scan(lambda c, row: (c + jnp.exp(row), jnp.tanh(row)), c0, x)
        return q + b[0], r, ys, c

    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P("d"), P()),
        out_specs=(P(), P("d"), P("d"), P("d")),
        check_vma=check_vma,
    )
    xs = x.reshape(N, 4, 3)
    for scalify in (False, True):
        args = (x, w)
        if scalify:
            args = (ss.as_scaled_array(x, "rms"), ss.as_scaled_array(w, "rms"))
        inst = ss.instrument(
            fn, scalify=scalify, formats=("e4m3",), histograms=False, isolate=False
        )
        mesh_args = jax.device_put(args, NamedSharding(mesh, P()))
        out, stats = jax.jit(inst)(*mesh_args)
        table = inst.op_table(*args)

        def op(prim, table=table):
            found = [r for r in table.ops if r.primitive == prim and r.pass_ != "input"]
            if len(found) != 1:
                fail(f"probe: expected one '{prim}' op, found {[r.name for r in found]}")
            return found[0]

        what = f"(scalify={scalify}, check_vma={check_vma})"
        # without check_vma typing, replicated values are counted once per device
        once = 1 if check_vma else N
        sin = op("sin")
        if sin.varying != ("d",) or (check_vma and op("cos").varying != ()):
            fail(f"probe {what}: varying axes {sin.varying}, {op('cos').varying}")
        s_x = float(args[0].scale) if scalify else 1.0
        s_w = float(args[1].scale) if scalify else 1.0
        expect(f"sin {what}", row_stats(table, stats, sin), np.sin(x))
        expect(f"cos {what}", row_stats(table, stats, op("cos")), np.cos(w), copies=once)
        partials = 3 * np.sin(xs).sum(1)  # [devices, 3]
        got = row_stats(table, stats, op("reduce_sum"))
        s_p = got["scale"][0] if scalify else 1.0  # unit scaling moved pow2(sqrt(4)) in
        expect(f"partial sums {what}", got, partials, s_p)
        got = row_stats(table, stats, op("psum_invariant" if check_vma else "psum"))
        expect(f"psum {what}", got, partials.sum(0), got["scale"][0] if scalify else 1.0, once)
        exp_op = op("exp")
        got = np.asarray(stats["count"])[table.rows(exp_op)]
        if exp_op.loop != (4,) or len(got) != 4:
            fail(f"probe {what}: the scan's exp has loop {exp_op.loop}, {len(got)} rows")
        for i in range(4):
            one = {k: v[i : i + 1] for k, v in row_stats(table, stats, exp_op).items()}
            expect(f"exp iteration {i} {what}", one, np.exp(xs[:, i]))
        if scalify:
            del s_x, s_w
            got = row_stats(table, stats, op("dynamic_rescale"))
            value = np.sin(xs.astype(np.float64)) * 2.0 ** np.arange(N)[:, None, None]
            top = 2.0 ** np.floor(np.log2(np.max(np.abs(value))))
            expect(f"rescaled per device {what}", got, value, top)
        if not scalify:
            # groups: a masked recording measures the selected groups only, inside the body
            grouped = ss.instrument(
                fn, scalify=False, formats=("e4m3",), histograms=False, groups=2
            )
            _, part = jax.jit(grouped.masked)(jnp.array([False, True]), *mesh_args)
            groups = grouped.op_table(*args).row_group
            got, full = np.asarray(part["count"]), np.asarray(stats["count"])
            if np.any(got[groups == 0] != 0) or np.any(got[groups == 1] != full[groups == 1]):
                fail(f"probe {what}: a masked recording inside shard_map got counts {got}")
    print(f"probe statistics inside shard_map are whole values (check_vma={check_vma})")


def check_probe() -> None:
    """The data-parallel step instrumented on 8 devices and on a 1-device mesh (the same
    program): rows of values that are the same global value on both agree exactly
    (forward activations, whose pieces make up the global batch; invariant values: the
    pmean'ed gradients, the update, the loss); per-device partial results (gradients
    before the pmean, copies of the parameters) are counted on every device."""
    args = dp_setup()
    mesh8 = Mesh(np.array(jax.devices()), ("data",))
    mesh1 = Mesh(np.array(jax.devices()[:1]), ("data",))
    for scalify in (False, True):
        a = args
        if scalify:
            a = (ss.as_scaled_array(args[0], "rms"), ss.as_scaled_array(args[1], "rms"), *args[2:])
        # the default (isolated: outputs from the uninstrumented program) once
        opts = dict(scalify=scalify, formats=("e4m3",), histograms=False, isolate=scalify)
        inst1 = ss.instrument(dp_step(mesh1), **opts)
        inst8 = ss.instrument(dp_step(mesh8), **opts)
        out1, st1 = jax.jit(inst1)(*on_mesh(a, mesh1))
        out8, st8 = jax.jit(inst8)(*on_mesh(a, mesh8))
        t1, t8 = inst1.op_table(*a), inst8.op_table(*a)
        what = f"instrument(scalify={scalify})"
        if [r.name for r in t1.ops] != [r.name for r in t8.ops] or t1.n_rows != t8.n_rows:
            fail(f"{what}: the op tables of 1 and 8 devices differ")
        for x, y in zip(jax.tree.leaves(unscaled(out1)), jax.tree.leaves(unscaled(out8))):
            close(f"{what}: outputs", y, x, 1e-5, 1e-7)
        kinds = {"global": 0, "sharded": 0, "per-device": 0, "cotangent": 0, "psum": 0}
        for r1, r8 in zip(t1.ops, t8.ops):
            if not r8.recorded:
                continue
            g1, g8 = row_stats(t1, st1, r1), row_stats(t8, st8, r8)
            c1, c8 = int(g1["count"][0]), int(g8["count"][0])
            label = f"{what}: {r8.label}"
            if r8.primitive.startswith("psum"):
                kind = "psum"  # the pmean's sum: of 8 local means on 8 devices, of 1 on 1
            elif not r8.varying or (r8.shape != r1.shape and r8.pass_ == "fwd"):
                kind = "global" if not r8.varying else "sharded"
            elif r8.shape != r1.shape:
                # the batch's cotangents: each device's mean over its own 8 examples
                kind = "cotangent"
            else:
                kind = "per-device"
            kinds[kind] += 1
            if kind == "per-device":
                if c8 != N * c1:
                    fail(f"{label}: count {c8}, expected {N} x {c1} (one piece per device)")
                continue
            if c8 != c1:
                fail(f"{label}: count {c8} on 8 devices, {c1} on one")
            if kind == "cotangent":
                continue
            for name in ("frac_zero", "frac_nonfinite"):
                close(f"{label}: {name}", g8[name], g1[name], 1e-5, 1e-7)
            # moments of the represented values: with scalify a psum over 8 devices moves
            # the pow2(sqrt(8)) unit-scaling factor into the scale, a psum over 1 does not
            times = N if kind == "psum" else 1
            for name in MOMENTS:
                v1, v8 = g1[name] * g1["scale"], g8[name] * g8["scale"]
                close(f"{label}: {name}", v8, times * v1, 1e-5, 1e-6)
        print(f"  {what}: rows by kind {kinds}")
        if not all(kinds.values()):
            fail(f"{what}: expected rows of every kind, got {kinds}")
    print("instrument on 8 devices gives the statistics of the 1-device step")


# -- 5. shardings ------------------------------------------------------------------------------


def check_shardings() -> None:
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    rows, rep = NamedSharding(mesh, P("data", None)), NamedSharding(mesh, P())
    cols = NamedSharding(mesh, P(None, "model"))
    rng = np.random.default_rng(3)
    x = ss.as_scaled_array(jnp.asarray(rng.normal(size=(16, 8)), jnp.float32), "rms")
    w = ss.as_scaled_array(jnp.asarray(rng.normal(size=(8, 8)), jnp.float32), "rms")

    def step(x, w):
        return jnp.tanh(x @ w), x * 2.0

    # (a) jit(scalify(step)) with in/out shardings: the data of the outputs has them
    def shard(s):
        return ScaledArray(s, rep)

    outer = jax.jit(
        ss.scalify(step),
        in_shardings=(shard(rows), shard(rep)),
        out_shardings=(shard(cols), shard(rows)),
    )
    y, z = outer(x, w)
    if not y.data.sharding.is_equivalent_to(cols, 2) or not z.data.sharding.is_equivalent_to(
        rows, 2
    ):
        fail(f"jit(scalify) lost out_shardings: {y.data.sharding}, {z.data.sharding}")
    ref = np.tanh(np.asarray(x.to_array()) @ np.asarray(w.to_array()))
    close("jit(scalify) with shardings", y.to_array(), ref, 1e-5, 1e-6)

    # (b) scalify(jit(step, in/out shardings)): the inner pjit's shardings are kept as
    # constraints on the data. The output shardings differ from what propagation from
    # the inputs would give, so a dropped constraint shows.
    inner = jax.jit(step, in_shardings=(rows, rep), out_shardings=(cols, rep))
    closed = jax.make_jaxpr(ss.scalify(inner))(x, w)
    if "sharding_constraint" not in str(closed):
        fail("scalify(jit(..., shardings)): no sharding constraint in the scalified jaxpr")
    y, z = jax.jit(ss.scalify(inner))(jax.device_put(x, shard(rows)), jax.device_put(w, shard(rep)))
    if not y.data.sharding.is_equivalent_to(cols, 2):
        fail(f"scalify(jit) lost out_shardings: {y.data.sharding} instead of {cols}")
    if not z.data.sharding.is_equivalent_to(rep, 2):
        fail(f"scalify(jit) lost out_shardings: {z.data.sharding} instead of {rep}")
    close("scalify(jit) with shardings", y.to_array(), ref, 1e-5, 1e-6)

    # (c) with_sharding_constraint on a ScaledArray: the data gets the constraint
    def constrained(x):
        return lax.with_sharding_constraint(x * 2.0, cols)

    out = jax.jit(ss.scalify(constrained))(jax.device_put(x, shard(rows)))
    if not out.data.sharding.is_equivalent_to(cols, 2):
        fail(f"sharding_constraint: data sharded {out.data.sharding} instead of {cols}")
    print("jit in/out shardings and sharding constraints are kept")


def check_explicit_mesh() -> None:
    """A mesh of explicit axes (`jax.make_mesh`'s default since JAX 0.7): a sharded value
    carries its layout in its type (``f32[64@data, 16]``). The data-parallel shard_map
    step and the same step under GSPMD (a gradient contracting the sharded batch axis)
    scalified, instrumented and tracked give the plain step's values. scalify traced
    them on unsharded types: shard_map refused its in_specs and the matmul its ambiguous
    output sharding."""
    from jax.sharding import AxisType

    mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Explicit,))
    args = on_mesh(dp_setup(), mesh)
    scaled = (ss.as_scaled_array(args[0], "rms"), ss.as_scaled_array(args[1], "rms"), *args[2:])
    for name, step in (("shard_map", dp_step(mesh)), ("gspmd", plain_step)):
        plain = jax.jit(step)(*args)
        got = jax.jit(ss.scalify(step))(*scaled)
        for i, (a, b) in enumerate(zip(jax.tree.leaves(unscaled(got)), jax.tree.leaves(plain))):
            close(f"explicit mesh, {name}, scalified (leaf {i})", a, b, 1e-5, 1e-7)
        out, stats = jax.jit(ss.instrument(step))(*scaled)
        close(f"explicit mesh, {name}, instrumented loss", unscaled(out)[-1], plain[-1], 1e-5)
        if not np.isfinite(np.asarray(stats["rms"])).any():
            fail(f"explicit mesh, {name}: the instrumented step measured nothing")
    # select of a sharded value and a constant (JAX 0.11's relu derivative): the
    # constant, rescaled by a scale computed from sharded values, was typed replicated
    # on the mesh, and select refused the two layouts
    x = jax.device_put(np.linspace(-1, 1, N * 32, dtype=np.float32).reshape(N * 8, 4),
                       NamedSharding(mesh, P("data", None)))  # fmt: skip

    def relu_like(x):
        return lax.select_n(x > 0, lax.broadcast_in_dim(np.float32(0), x.shape, ()), x * 3.0)

    got = jax.jit(ss.scalify(relu_like))(ss.as_scaled_array(x, "rms"))
    close("explicit mesh, select of a constant", unscaled(got), jax.jit(relu_like)(x), 1e-6)
    with tempfile.TemporaryDirectory() as tmp:
        with ss.Run(tmp, every=1) as run:
            loss = run.track(plain_step)(*scaled)[-1]
        close("explicit mesh, tracked loss", unscaled(loss), jax.jit(plain_step)(*args)[-1], 1e-5)
        if not len(ss.open_run(tmp).steps):
            fail("explicit mesh: the tracked step recorded no step")
    print("a mesh of explicit axes: scalified, instrumented and tracked steps match plain")


CHECKS = {
    "collectives": functools.partial(check_collectives, True),
    "collectives-novma": functools.partial(check_collectives, False),
    "data-parallel": check_data_parallel,
    "tensor-parallel": check_tensor_parallel,
    "probe-semantics": functools.partial(check_probe_semantics, True),
    "probe-semantics-novma": functools.partial(check_probe_semantics, False),
    "probe": check_probe,
    "shardings": check_shardings,
    "explicit-mesh": check_explicit_mesh,
}


def main(names: list[str]) -> None:
    if jax.device_count() != N:
        fail(f"needs {N} devices, got {jax.devices()}")
    for name in names or CHECKS:
        try:
            CHECKS[name]()
        except SystemExit:
            raise
        except Exception:
            traceback.print_exc()
            fail(f"check '{name}' raised")
    print("all collective checks passed")


if __name__ == "__main__":
    main(sys.argv[1:])
