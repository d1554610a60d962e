"""The probe: statistics against a NumPy + ml_dtypes reference, the op table, loops."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from probe_reference import FORMATS, reference

import scalescope as ss
from scalescope.probe import HIST_COLUMNS


def _near(x: float, direction: float) -> float:
    return float(np.nextafter(np.float32(x), np.float32(direction)))


def _format_edges() -> list[float]:
    """Values at and next to every format's subnormal, normal and max boundaries."""
    vals = []
    tiny32 = float(np.finfo(np.float32).tiny)
    for dtype, fmax in FORMATS.values():
        info = ml_dtypes.finfo(dtype)
        sub, normal = float(info.smallest_subnormal), float(info.smallest_normal)
        for v in (
            sub,
            sub / 2,
            _near(sub / 2, 1),
            _near(sub / 2, 0),
            1.5 * sub,
            3 * sub,
            normal,
            _near(normal, 0),
            _near(normal, 1),
            normal - sub / 2,
            fmax,
            _near(fmax, 0),
            _near(fmax, np.inf),
            fmax * 1.01,
            fmax * 0.99,
        ):
            if tiny32 <= v <= float(np.finfo(np.float32).max):
                vals += [v, -v]
    return vals


def _crafted() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    edges = np.array(_format_edges(), np.float32)
    special = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1.0, -3.0], np.float32)
    return {
        "edges": edges,
        "edges_special": np.concatenate([edges, special, rng.normal(size=50).astype(np.float32)]),
        "normal": rng.normal(size=(33, 17)).astype(np.float32),
        "all_zero": np.zeros((5, 7), np.float32),
        "neg_zero": np.full((9,), -0.0, np.float32),
        "all_nan": np.full((4,), np.nan, np.float32),
        "inf_and_values": np.array([np.inf, 2.0, -4.0, np.nan, 0.5], np.float32),
        "tiny": (rng.normal(size=300) * 1e-6).astype(np.float32),
        "big": (rng.normal(size=300) * 3e4).astype(np.float32),
        "mean_offset": (1000.0 + rng.normal(size=2000)).astype(np.float32),
        "scalar": np.array(2.5, np.float32),
        "long": rng.normal(size=5000).astype(np.float32),
    }


CRAFTED = _crafted()


def _input_stats(arrays: dict, **kw):
    """Statistics of the function inputs (the identity records every input)."""
    inst = ss.instrument(lambda xs: xs, scalify=False, **kw)
    _, stats = jax.jit(inst)(arrays)
    table = inst.op_table(arrays)
    rows = {
        op.name.removeprefix("input/xs/"): table.rows(op) for op in table if op.primitive == "input"
    }
    return {k: {s: np.asarray(v)[r] for s, v in stats.items()} for k, r in rows.items()}


def _check(got: dict, ref: dict, label: str, formats=tuple(FORMATS)) -> None:
    def close(name, rtol=1e-5, atol=0.0):
        g, r = float(np.squeeze(got[name])), float(ref[name])
        if np.isnan(r):
            assert np.isnan(g), f"{label}: {name} {g} != NaN"
        else:
            assert np.isclose(g, r, rtol=rtol, atol=atol), f"{label}: {name} {g} != {r}"

    assert int(np.squeeze(got["count"])) == ref["count"], label
    for name in ("rms", "absmax"):
        close(name, atol=1e-30)
    # float32 sums: the mean is exact to a few ulps of the abs-max, not of itself.
    close("mean", atol=2e-6 * float(np.nan_to_num(ref["absmax"])))
    if not np.isnan(ref["std"]):
        # float32 sums of squares about 0 or about the mid-range, whichever is smaller:
        # the variance is exact to a few dozen ulps of that, however far off 0 the mean
        ms = float(ref["rms"]) ** 2
        half_range = (float(ref["max"]) - float(ref["min"])) / 2
        var = float(np.squeeze(got["std"])) ** 2
        tol = 4e-6 * min(ms, half_range**2) + 1e-30
        assert abs(var - ref["std"] ** 2) <= tol, f"{label}: std {var**0.5} vs {ref['std']}"
    for name in ("frac_zero", "frac_nonfinite"):
        close(name, atol=1e-7)
    for name in ("min", "max", "absmin"):  # float32 elements: exact
        close(name, rtol=0.0)
    close("dynamic_range", rtol=1e-6, atol=1e-5)
    for f in formats:
        for s in ("underflow", "subnormal", "overflow"):
            close(f"{s}_{f}", atol=1e-7)
        g, r = float(np.squeeze(got[f"snr_{f}"])), float(ref[f"snr_{f}"])
        if np.isinf(r) or r > 250:
            assert g > 250, f"{label}: snr_{f} {g} vs {r}"
        elif np.isnan(r):
            assert np.isnan(g), f"{label}: snr_{f}"
        else:
            assert abs(g - r) < 1e-3, f"{label}: snr_{f} {g} vs {r}"
    np.testing.assert_array_equal(np.squeeze(got["hist"]), ref["hist"], err_msg=label)


def test_statistics_match_reference_on_crafted_tensors():
    got = _input_stats(CRAFTED)
    assert set(got) == set(CRAFTED)
    for name, data in CRAFTED.items():
        _check(got[name], reference(data), name)


def test_edge_values_hit_every_format_statistic():
    """The crafted edges really exercise under/sub/overflow of every format."""
    ref = reference(CRAFTED["edges_special"])
    for f in FORMATS:
        for s in ("underflow", "subnormal", "overflow"):
            if f == "bf16" and s != "overflow":
                continue  # bf16 subnormals are float32 subnormals, flushed on CPU
            assert ref[f"{s}_{f}"] > 0, (s, f)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_statistics_of_narrow_dtypes(dtype):
    rng = np.random.default_rng(1)
    data = (rng.normal(size=(64, 9)) * 4).astype(np.float32)
    x = jnp.asarray(np.clip(data, -400, 400)).astype(dtype)
    got = _input_stats({"x": x})["x"]
    _check(got, reference(np.asarray(x).astype(np.float32)), str(dtype))


@pytest.mark.parametrize("scale", [2.0**-100, 2.0**-30, 1.0, 2.0**30, 2.0**100])
def test_scaled_values_measure_their_data_and_report_the_scale(scale):
    rng = np.random.default_rng(2)
    data = rng.normal(size=(40, 3)).astype(np.float32)
    x = ss.ScaledArray(jnp.asarray(data), jnp.float32(scale))
    inst = ss.instrument(lambda x: x * 2.0)
    (out, stats) = jax.jit(inst)(x)
    table = inst.op_table(x)
    (mul,) = [op for op in table if op.primitive == "mul"]
    assert mul.scaled
    got = {k: np.asarray(v)[table.rows(mul)] for k, v in stats.items()}
    ref_data = np.asarray(out.data)
    _check(got, reference(ref_data), f"scale {scale}")
    assert float(got["scale"][0]) == float(out.scale)


def test_padding_and_many_values_in_one_scope():
    """Values of many sizes share one buffer: zero counts must not see the padding."""
    rng = np.random.default_rng(3)
    arrays = {f"v{n}": rng.normal(size=n).astype(np.float32) for n in (1, 3, 511, 512, 513, 1500)}
    got = _input_stats(arrays, block=512)
    for k, data in arrays.items():
        _check(got[k], reference(data), k)


def test_sampling_caps_the_elements_measured():
    data = np.random.default_rng(4).normal(size=10_000).astype(np.float32)
    got = _input_stats({"x": data, "small": data[:50]}, sample=1000)
    assert int(got["x"]["count"][0]) <= 1000
    assert int(got["small"]["count"][0]) == 50
    assert abs(float(got["x"]["rms"][0]) - 1.0) < 0.1


# -- the op table ---------------------------------------------------------------------


def _mlp_step():
    def loss(w, x):
        h = jnp.tanh(x @ w["a"])
        return jnp.mean((h @ w["b"]) ** 2)

    def step(w, x):
        value, g = jax.value_and_grad(loss)(w, x)
        with jax.named_scope("opt"):
            w = jax.tree.map(lambda p, d: p - 0.1 * d, w, g)
        return w, value

    rng = np.random.default_rng(5)
    w = {
        "a": jnp.asarray(rng.normal(size=(8, 16)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(16, 4)), jnp.float32),
    }
    x = jnp.asarray(rng.normal(size=(32, 8)), jnp.float32)
    return step, w, x


def test_a_value_made_inside_a_call_that_a_matmul_reads_is_a_gemm_operand():
    """relu's max (inside a custom_jvp) and jnp.where's select_n (inside a jit) are
    recorded inside their calls; what a matmul reads of them is a GEMM operand, which a
    recommended policy rounds (it missed both)."""

    def f(x, w, m):
        a = jax.nn.relu(x @ w) @ w.T
        b = jnp.sum(jnp.tanh(a))  # read by no matmul
        return jnp.sum(jnp.where(m, a, 0.0) @ w) + b

    x, w, m = jnp.ones((4, 8)), jnp.ones((8, 8)), jnp.ones((4, 8), bool)
    ops = ss.instrument(f, scalify=False).op_table(x, w, m).ops
    gemm = {o.primitive: o.gemm for o in ops if o.pass_ == "fwd" and o.primitive != "dot_general"}
    assert gemm["max"] and gemm["select_n"] and gemm["transpose"]
    assert not gemm["tanh"] and not gemm["reduce_sum"]


def test_op_table_passes_inputs_outputs_and_sources():
    step, w, x = _mlp_step()
    inst = ss.instrument(step, scalify=False)
    table = inst.op_table(w, x)
    passes = {op.pass_ for op in table}
    assert {"input", "fwd", "bwd", "opt"} <= passes
    names = {op.name for op in table}
    assert {"input/w/a", "input/w/b", "input/x"} <= names
    assert {"output/0/a", "output/0/b", "output/1"} <= names
    dots = [op for op in table if op.primitive == "dot_general"]
    assert {op.pass_ for op in dots} == {"fwd", "bwd"}
    assert all(op.source.endswith(".py:" + op.source.rsplit(":", 1)[1]) for op in dots)
    assert all("test_probe.py" in op.source for op in dots)
    # Outputs point at the op that computed them; the updated weights come from `opt`.
    out_a = next(op for op in table if op.name == "output/0/a")
    assert table[out_a.stats_op].pass_ == "opt"
    # Ids are 0..n-1 in order and rows are sorted by op.
    assert [op.id for op in table] == list(range(len(table)))
    assert np.all(np.diff(table.row_op) >= 0)
    frame = table.to_frame()
    assert len(frame) == len(table) and "pass" in frame.columns


@pytest.mark.parametrize("scalify, scope", [(False, ""), (True, ""), (True, "opt")])
def test_optimizer_ops_are_named_after_their_parameter(scalify, scope):
    """optax adds no name scopes; each of AdamW's per-leaf ops reaches only its own
    parameter's outputs (new value, mu, nu), so it is named ``params/<path>/<prim>``
    (``opt/params/<path>/<prim>`` under the ``opt`` pass scope). Ops on the step count
    and the forward pass (reaching every output) keep their names."""
    import contextlib

    optax = pytest.importorskip("optax")
    shapes = {"enc": {"kernel": (6, 5), "bias": (5,)}, "dec": {"kernel": (5, 3)}}
    params = {"params": jax.tree.map(lambda s: jnp.full(s, 0.1), shapes, is_leaf=_is_shape)}
    opt = optax.adamw(1e-2)

    def step(params, state, x):
        def loss(p):
            h = jnp.tanh(x @ p["params"]["enc"]["kernel"] + p["params"]["enc"]["bias"])
            return jnp.mean((h @ p["params"]["dec"]["kernel"]) ** 2)

        grads = jax.grad(loss)(params)
        with jax.named_scope(scope) if scope else contextlib.nullcontext():
            updates, state = opt.update(grads, state, params)
            return optax.apply_updates(params, updates), state

    state = opt.init(params)
    x = jnp.ones((4, 6))
    if scalify:
        params, state = ss.as_scaled_array(params), ss.as_scaled_array(state)
    table = ss.instrument(step, scalify=scalify).op_table(params, state, x)
    by_shape = {tuple(s): f"params/{m}/{k}" for m, d in shapes.items() for k, s in d.items()}
    opt_ops = [op for op in table if op.pass_ == "opt" and op.primitive != "output"]
    named = [op for op in opt_ops if op.name.count("/") > bool(scope)]
    assert len(named) >= 3 * 8  # several per parameter: moments, bias correction, update
    head = f"{scope}/" if scope else ""
    for op in named:
        assert op.name == f"{head}{by_shape[op.shape]}/{op.primitive}", op.name
    # the step count (a scalar) and its bias corrections belong to no one parameter
    assert all(op.shape == () for op in opt_ops if "/" not in op.name.removeprefix(head))
    assert any(op.name == f"{head}add" and op.shape == () for op in opt_ops)
    # forward ops reach every output: unchanged
    fwd = [op for op in table if op.pass_ == "fwd" and op.primitive == "tanh"]
    assert [op.name for op in fwd] == ["tanh"]


def _is_shape(x):
    return isinstance(x, tuple) and all(isinstance(i, int) for i in x)


def test_parameter_of_takes_the_common_suffix_that_is_an_input_leaf():
    from scalescope.probe.provenance import parameter_of

    outs = ["0/params/a/w", "0/params/b/w", "1/0/mu/params/a/w", "1/0/nu/params/a/w", "2"]
    leaves = {("params", "a", "w"), ("params", "b", "w")}
    assert parameter_of(0b00001, outs, leaves) == "params/a/w"
    assert parameter_of(0b01101, outs, leaves) == "params/a/w"  # new value, mu and nu
    assert parameter_of(0b00011, outs, leaves) == ""  # both parameters: only "w" shared
    assert parameter_of(0b10001, outs, leaves) == ""  # with the loss
    assert parameter_of(0b00101, outs, {("w",)}) == "w"  # a flat {"w": ...} argument


def test_parameter_leaves_leave_out_the_optimizers_copies():
    from scalescope.probe.provenance import parameter_leaves

    t = lambda *paths: {tuple(p.split("/")) for p in paths}
    params = ("l1/kernel/value", "l1/bias/value", "bias/value", "norm/bias/value")
    state = [f"opt_state/0/{m}/{p}" for m in ("mu", "nu") for p in params]
    # Adam's moments mirror the tree: left out; a submodule's norm/bias beside a
    # top-level bias is a parameter of its own
    assert parameter_leaves(t(*params, *state, "step/value")) == t(*params, "step/value")
    assert parameter_leaves(t("w", "b", "mu/w", "mu/b")) == t("w", "b")
    assert parameter_leaves(t("w", "mu/w")) == t("w", "mu/w")  # one leaf: no mirror seen
    assert parameter_leaves(t("a/w", "w") | {()}) == t("a/w", "w")


def test_data_movement_aliases_and_constants_are_not_recorded():
    def f(x):
        y = x.reshape(4, 6).T  # data movement: alias of x
        c = jnp.ones((6, 4)) * 3.0  # constants only
        return jnp.sin(y) + c

    x = jnp.arange(24.0)
    inst = ss.instrument(f, scalify=False)
    table = inst.op_table(x)
    by_prim = {op.primitive: op for op in table}
    assert by_prim["reshape"].note == "alias" and by_prim["transpose"].note == "alias"
    assert table[by_prim["transpose"].stats_op].name == "input/x"
    assert by_prim["sin"].recorded and by_prim["add"].recorded
    consts = [op for op in table if op.note == "const"]
    assert consts, "the constant broadcast/mul should be skipped"
    _, stats = jax.jit(inst)(x)
    rows = table.rows(by_prim["transpose"])
    np.testing.assert_allclose(
        np.asarray(stats["rms"])[rows], np.sqrt(np.mean(np.arange(24.0) ** 2)), rtol=1e-6
    )


def test_what_a_host_callback_returns_is_recorded():
    """`jax.pure_callback` runs on the host on the unscaled value; its result is a value
    of the step like any other: recorded, with the statistics of what it returned."""

    def host(v):
        return (np.asarray(v) ** 3).astype(np.float32)

    def f(x):
        y = jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x * 8.0)
        return jnp.sum(y)

    x = jnp.asarray(CRAFTED["long"][:512])
    inst = ss.instrument(f)
    table = inst.op_table(ss.as_scaled_array(x))
    (op,) = [op for op in table if op.primitive == "pure_callback"]
    assert op.recorded and not op.scaled and op.pass_ == "fwd", op
    _, stats = jax.jit(inst)(ss.as_scaled_array(x))
    got = {k: np.asarray(v)[table.rows(op)] for k, v in stats.items()}
    _check(got, reference(host(np.asarray(x) * 8.0)), "pure_callback")


def test_select_and_cost_controls():
    step, w, x = _mlp_step()
    only_bwd = ss.instrument(step, scalify=False, select="^bwd/")
    table = only_bwd.op_table(w, x)
    recorded = [op for op in table if op.recorded]
    assert recorded and all(op.pass_ == "bwd" for op in recorded)
    assert any(op.note == "unselected" for op in table)

    dots = ss.instrument(step, scalify=False, select=lambda op: op.primitive == "dot_general")
    assert {op.primitive for op in dots.op_table(w, x) if op.recorded} == {"dot_general"}

    lean = ss.instrument(step, scalify=False, formats=("e4m3",), histograms=False)
    _, stats = jax.jit(lean)(w, x)
    assert "hist" not in stats and "snr_e4m3" in stats and "snr_fp16" not in stats
    assert lean.op_table(w, x).hist_columns is None


def test_formats_given_as_one_comma_separated_string(tmp_path):
    """``formats="e4m3, nvfp4"`` (how the CLI's --formats reads) means both names, for
    instrument and Run alike; an unknown one in it is named on its own."""
    f = lambda x: x * 2.0
    assert ss.instrument(f, formats="e4m3, nvfp4").formats == ("e4m3",)
    assert ss.instrument(f, formats="e4m3, nvfp4").recipes == ("nvfp4",)
    assert ss.instrument(f, formats="e5m2").formats == ("e5m2",)
    with pytest.raises(KeyError, match=r"unknown format or recipe 'e9m9'; formats: "):
        ss.instrument(f, formats="e4m3,e9m9")
    with pytest.raises(ValueError, match=r"twice: \['e4m3', 'e4m3'\]"):
        ss.instrument(f, formats="e4m3,e4m3")
    with pytest.raises(ValueError, match=r"no format or recipe named in ' , '"):
        ss.instrument(f, formats=" , ")
    with ss.Run(tmp_path / "r", formats="e4m3,e5m2, mxfp8_e4m3") as run:
        assert run.formats == ("e4m3", "e5m2") and run.recipes == ("mxfp8_e4m3",)
    with pytest.raises(ValueError, match=r"Run: formats lists a format twice: \['e4m3', 'e4m3'\]"):
        ss.Run(tmp_path / "t", formats=("e4m3", "float8_e4m3fn"))
    assert not (tmp_path / "t").exists()  # refused before anything is written
    with pytest.raises(KeyError, match=r"Run: formats: unknown format or recipe 'e4m4'"):
        ss.Run(tmp_path / "s", formats="e4m3,e4m4")


def test_bad_arguments_raise_clear_errors():
    f = lambda x: x
    with pytest.raises(ValueError, match="select"):
        ss.instrument(f, select="(")
    with pytest.raises(TypeError, match="select"):
        ss.instrument(f, select=3)
    with pytest.raises(KeyError, match="e9m9"):
        ss.instrument(f, formats=("e9m9",))
    with pytest.raises(ValueError, match="twice"):
        ss.instrument(f, formats=("e4m3", "float8_e4m3fn"))
    with pytest.raises(ValueError, match="sample"):
        ss.instrument(f, sample=0)
    with pytest.raises(TypeError, match="scalify=False"):
        ss.instrument(f, scalify=False)(ss.as_scaled_array(jnp.ones(3)))
    inst = ss.instrument(lambda x: x * 2.0)
    x = ss.as_scaled_array(jnp.ones(3))
    table, (_, stats) = inst.op_table(x), inst(x)
    assert len(ss.stats_frame(table, stats)) == table.n_rows
    with pytest.raises(TypeError, match=r"the arguments are \(table, stats\)"):
        ss.stats_frame(stats, table)
    # an instrumented function composes with jax.eval_shape like any other
    shapes = jax.eval_shape(inst, x)
    assert shapes[0].data.shape == (3,) and shapes[1]["rms"].shape == (table.n_rows,)


def test_isolated_outputs_are_bit_identical_to_uninstrumented():
    step, w, x = _mlp_step()
    plain = jax.jit(step)(w, x)
    out, _ = jax.jit(ss.instrument(step, scalify=False, isolate=True))(w, x)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(out)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    sw, sx = ss.as_scaled_array(w, "rms"), ss.as_scaled_array(x, "rms")
    scal = jax.jit(ss.scalify(step))(sw, sx)
    out, _ = jax.jit(ss.instrument(step, isolate=True))(sw, sx)
    for a, b in zip(jax.tree.leaves(scal), jax.tree.leaves(out)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_instrument_of_a_scalified_step_records_the_step_not_its_scale_arithmetic():
    """Handed ``scalify(step)``, the probe (and `emulate`) record ``step``'s own ops: not
    the scale arithmetic scalify adds around each of them."""
    step, w, x = _mlp_step()
    sw, sx = ss.as_scaled_array(w, "rms"), ss.as_scaled_array(x, "rms")
    want = [(op.name, op.primitive) for op in ss.instrument(step).op_table(sw, sx)]
    wrapped = ss.instrument(ss.scalify(step))
    got = [(op.name, op.primitive) for op in wrapped.op_table(sw, sx)]
    assert got == want and not any(p == "bitcast_convert_type" for _, p in got)
    out, stats = jax.jit(wrapped)(sw, sx)
    ref = jax.jit(ss.scalify(step))(sw, sx)
    for a, b in zip(jax.tree.leaves(ss.asarray(out)), jax.tree.leaves(ss.asarray(ref))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    assert stats["count"].shape[0] == len(wrapped.op_table(sw, sx).row_op)
    # the fallback given to scalify carries over
    assert ss.scalify(step, fallback="unscale").scalify_of[1] == "unscale"
    emulated = ss.emulate(ss.scalify(step), {"^fwd/.*dot_general": "e4m3"}, scalify=True)
    assert [(op.name, op.primitive) for op in emulated.op_table(sw, sx)] == want


def test_default_outputs_equal_uninstrumented_up_to_float32_rounding():
    """Without isolation XLA fuses the step around the measured values: outputs stay
    those of the uninstrumented step within float32 rounding, and the statistics are
    those of the same values as with isolation."""
    step, w, x = _mlp_step()
    sw, sx = ss.as_scaled_array(w, "rms"), ss.as_scaled_array(x, "rms")
    for scalify, args in ((False, (w, x)), (True, (sw, sx))):
        expected = jax.jit(ss.scalify(step) if scalify else step)(*args)
        out, stats = jax.jit(ss.instrument(step, scalify=scalify))(*args)
        _, isolated = jax.jit(ss.instrument(step, scalify=scalify, isolate=True))(*args)
        for a, b in zip(jax.tree.leaves(ss.asarray(expected)), jax.tree.leaves(ss.asarray(out))):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            assert np.max(np.abs(a - b)) <= 1e-6 * np.max(np.abs(a)), np.max(np.abs(a - b))
        assert set(stats) == set(isolated)
        for name in stats:
            np.testing.assert_allclose(stats[name], isolated[name], rtol=1e-6, err_msg=name)


# -- loops and branches -----------------------------------------------------------------


def test_scan_records_one_row_per_iteration():
    def f(x):
        def body(c, k):
            with jax.named_scope("layer"):
                y = jnp.sin(c) * k
            return y, y

        return jax.lax.scan(body, x, jnp.asarray([1.0, 2.0, 4.0, 8.0]))

    x = jnp.linspace(-1.0, 1.0, 50)
    inst = ss.instrument(f, scalify=False)
    (carry, ys), stats = jax.jit(inst)(x)
    table = inst.op_table(x)
    (mul,) = [op for op in table if op.primitive == "mul"]
    assert mul.name == "layer/mul" and mul.loop == (4,) and mul.n_rows == 4
    rows = table.rows(mul)
    np.testing.assert_array_equal(table.row_iter[rows], np.arange(4))
    ref = [reference(np.asarray(ys[i]))["rms"] for i in range(4)]
    np.testing.assert_allclose(np.asarray(stats["rms"])[rows], ref, rtol=1e-5)


def test_nested_and_reversed_scans_order_rows_by_iteration():
    def f(x):
        def inner(c, k):
            y = c * k
            return y, y

        def outer(c, k):
            c, ys = jax.lax.scan(inner, c, jnp.asarray([1.0, 2.0, 3.0]) * k)
            return c, ys

        return jax.lax.scan(outer, x, jnp.asarray([1.0, 10.0]), reverse=True)

    x = jnp.ones((5,))
    inst = ss.instrument(f, scalify=False)
    (_, ys), stats = jax.jit(inst)(x)
    table = inst.op_table(x)
    (mul,) = [op for op in table if op.primitive == "mul" and len(op.loop) == 2]
    assert mul.loop == (2, 3)
    got = np.asarray(stats["absmax"])[table.rows(mul)]
    ref = np.abs(np.asarray(ys)).reshape(2, 3, -1).max(-1).ravel()
    np.testing.assert_allclose(got, ref, rtol=1e-6)


def test_while_aggregates_iterations():
    def f(x):
        return jax.lax.while_loop(lambda c: c[1] < 3, lambda c: (c[0] * 2.0, c[1] + 1), (x, 0))

    x = jnp.asarray([1.0, -0.5, 0.0])
    inst = ss.instrument(f, scalify=False)
    _, stats = jax.jit(inst)(x)
    table = inst.op_table(x)
    (mul,) = [op for op in table if op.primitive == "mul"]
    assert mul.in_while and mul.n_rows == 1
    row = table.rows(mul).start
    all_iters = np.concatenate([np.asarray(x) * 2.0**k for k in (1, 2, 3)])
    assert int(stats["count"][row]) == all_iters.size
    np.testing.assert_allclose(float(stats["absmax"][row]), 8.0)
    np.testing.assert_allclose(float(stats["frac_zero"][row]), 1 / 3, rtol=1e-6)
    np.testing.assert_allclose(float(stats["rms"][row]), reference(all_iters)["rms"], rtol=1e-6)


@pytest.mark.parametrize("start", [2.0**-10, 2.0**12])
def test_while_keeps_negative_maxima_of_every_iteration(start):
    """A while loop folds its iterations into one row by maximum, starting from an empty
    accumulator. A recipe's block-scale exponents can be negative (small values) or their
    negations can be (large values): the empty start must not count as a 0 among them
    (scale_log2_max came out 0 for values around 2^-11, the maximum with the start)."""
    from recipe_reference import recipe_stats

    def f(x):
        return jax.lax.while_loop(lambda c: c[1] < 3, lambda c: (c[0] * 0.5, c[1] + 1), (x, 0))

    x = jnp.full((64,), start, jnp.float32).at[::3].multiply(3.0)
    inst = ss.instrument(f, scalify=False, formats=("e4m3", "mxfp8_e4m3"))
    _, stats = jax.jit(inst)(x)
    table = inst.op_table(x)
    (mul,) = [op for op in table if op.primitive == "mul"]
    row = table.rows(mul).start
    iters = [np.asarray(x) * 0.5**k for k in (1, 2, 3)]
    ref = [recipe_stats(v, "mxfp8_e4m3") for v in iters]
    got_lo = float(stats["scale_log2_min_mxfp8_e4m3"][row])
    got_hi = float(stats["scale_log2_max_mxfp8_e4m3"][row])
    assert got_lo == min(r["scale_log2_min"] for r in ref)
    assert got_hi == max(r["scale_log2_max"] for r in ref)
    assert float(stats["absmax"][row]) == np.abs(np.concatenate(iters)).max()


@pytest.mark.parametrize("which", [0, 1])
def test_cond_records_the_branch_taken(which):
    def f(i, x):
        return jax.lax.switch(i, [lambda x: jnp.sin(x), lambda x: jnp.exp(x)], x)

    x = jnp.linspace(0.0, 1.0, 7)
    inst = ss.instrument(f, scalify=False)
    out, stats = jax.jit(inst)(jnp.int32(which), x)
    table = inst.op_table(jnp.int32(which), x)
    sin = next(op for op in table if op.primitive == "sin")
    exp = next(op for op in table if op.primitive == "exp")
    taken, other = (sin, exp) if which == 0 else (exp, sin)
    assert taken.in_cond and other.in_cond
    r_taken, r_other = table.rows(taken).start, table.rows(other).start
    assert int(stats["count"][r_taken]) == 7 and int(stats["count"][r_other]) == 0
    assert np.isnan(float(stats["rms"][r_other]))
    np.testing.assert_allclose(float(stats["rms"][r_taken]), reference(out)["rms"], rtol=1e-6)


def test_scalified_scan_with_scaled_carry():
    """A scaled carry makes scalify retrace the body; the table keeps one copy."""

    def f(x):
        def body(c, _):
            return c * 3.0 + 1.0, None

        return jax.lax.scan(body, x, None, length=3)[0]

    x = ss.as_scaled_array(jnp.linspace(1.0, 2.0, 10), "rms")
    inst = ss.instrument(f)
    out, stats = jax.jit(inst)(x)
    table = inst.op_table(x)
    assert sum(op.primitive == "mul" for op in table) == 1
    mul = next(op for op in table if op.primitive == "mul")
    assert mul.n_rows == 3 and mul.scaled
    np.testing.assert_allclose(
        np.asarray(out.to_array()), np.asarray(ss.scalify(f)(x).to_array()), rtol=0
    )


def test_nonfinite_values_do_not_hide_other_statistics():
    x = jnp.asarray([np.nan, np.inf, 1.0, -2.0, 0.0])
    got = _input_stats({"x": x})["x"]
    assert float(got["frac_nonfinite"][0]) == pytest.approx(0.4)
    assert float(got["absmax"][0]) == 2.0
    assert float(got["rms"][0]) == pytest.approx(np.sqrt(5 / 3), rel=1e-6)
    assert got["hist"][0][0] == 1 and got["hist"][0][-1] == 2
    assert len(got["hist"][0]) == len(HIST_COLUMNS)


def test_unscalified_instrument_keeps_scale_ops_as_identities():
    """scalify=False records the plain function: `dynamic_rescale` and friends stay
    identities and nothing comes out as a ScaledArray."""

    def f(x):
        return ss.ops.dynamic_rescale_l2(x * 3.0) + 1.0

    x = jnp.linspace(-1.0, 1.0, 16)
    out, stats = jax.jit(ss.instrument(f, scalify=False))(x)
    assert not isinstance(out, ss.ScaledArray)
    # x * 3 is measured, so XLA no longer contracts x * 3 + 1 into one multiply-add:
    # float32 rounding apart (an absolute 3e-8 near 0), the plain values
    np.testing.assert_allclose(out, jax.jit(f)(x), rtol=1e-6, atol=1e-6)
    assert np.all(np.asarray(stats["scale"])[np.asarray(stats["count"]) > 0] == 1.0)


def test_op_table_names_the_format_a_value_is_cast_to():
    def loss(w, x):
        y = ss.ops.cast_on_forward(x, jnp.float8_e4m3fn) @ ss.ops.cast_on_forward(
            w, jnp.float8_e4m3fn
        )
        y = ss.ops.cast_on_backward(jnp.tanh(y), jnp.float8_e5m2)
        return jnp.sum(y.astype(jnp.float16) ** 2)

    x, w = jnp.linspace(-1, 1, 32).reshape(4, 8), jnp.linspace(-1, 1, 24).reshape(8, 3)
    table = ss.instrument(jax.grad(loss), scalify=False).op_table(w, x)
    cast = {(op.pass_, op.name): op.cast_to for op in table if op.cast_to}
    assert cast[("input", "input/w")] == "e4m3" and cast[("input", "input/x")] == "e4m3"
    assert ("fwd", "tanh") in cast and cast[("fwd", "tanh")] == "fp16"
    assert "e5m2" in {c for (p, _), c in cast.items() if p == "bwd"}
    widened = [op for op in table if op.primitive == "convert_element_type" and op.note == "alias"]
    assert widened and all(op.cast_to == "" for op in widened)


def test_a_nan_is_followed_along_the_data_flow_to_the_outputs():
    """`reach.dropped`: a NaN/Inf that every path drops (a select keeps the other
    branch) against one that reaches an output, one read by a value not known (no
    statistics, or not recorded at that step), and one nothing recorded reads."""
    from scalescope.probe import reach

    # 0 -> 1 -> 2 (finite: a select dropped it); 3 -> 4 -> 5 (the output);
    # 6 -> an unrecorded float op; 7 -> a comparison (bool: drops it); 8 -> nothing
    flow = reach.flow_of(
        [
            (0, (), "float32", False),
            (1, (0,), "float32", False),
            (2, (1,), "float32", False),
            (3, (), "float32", False),
            (4, (3,), "float32", False),
            (5, (4,), "float32", False),
            (5, (), "float32", True),  # the output record: op 5's statistics
            (-1, (6,), "float32", False),
            (-1, (7,), "bool", False),
            (8, (), "bfloat16", False),
            (1, (1,), "float32", False),  # an alias of 1 (a reshape): no edge to itself
        ]
    )
    assert flow.sinks == {5} and flow.consumers[6] == {reach.UNKNOWN}
    assert flow.consumers[7] == {reach.FINITE} and flow.consumers[1] == {2}
    nonfinite = {0, 1, 3, 4, 5, 6, 7, 8}
    assert reach.dropped(nonfinite, flow) == {0, 1, 7}
    # once 2 holds a NaN too (the select kept it), nothing upstream of it is dropped
    assert reach.dropped(nonfinite | {2}, flow) == {7}
    # a reader not recorded at this step may carry it on
    assert reach.dropped(nonfinite, flow, known={0, 1, 3, 4, 5}) == {7}
    assert reach.dropped(nonfinite, flow, known={0, 1, 2, 3, 4, 5}) == {0, 1, 7}
