"""The closed loop: a recorded run's what-if becomes a policy (`recommend_policy`), the
policy's prediction (`predict_policy`), and `ss.verify` / ``scalescope verify`` train it
beside the plain step and keep the measured gap, which the report shows."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd
import pytest

import scalescope as ss
from scalescope import analysis as A
from scalescope.analysis.whatif import CHEAPEST
from scalescope.cli import main

TINY_GPT = ["--layers", "2", "--d-model", "16", "--seq-len", "8", "--batch", "4"]
RECIPES = "e4m3,e5m2,fp16,bf16,mxfp8_e4m3_rceil,nvfp4"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("verify") / "gpt"
    argv = ["train", "gpt", "--steps", "6", "--every", "2", "--run", str(run), "--quiet"]
    argv += ["--data", "vendored", "--formats", RECIPES, *TINY_GPT]
    assert main(argv) == 0
    return run


# -- recommend and predict on frames -------------------------------------------------------


def _frames(cheapest: dict[str, str], bf16_safe: dict[str, bool], extra=()):
    """An op frame (labels as names, every op a matmul operand unless in ``extra``) and
    a what-if frame with a cheapest recipe and a BF16 verdict per op."""
    names = list(cheapest) + list(extra)
    ops = pd.DataFrame(
        {
            "pass": [n.split("/")[0] for n in names],
            "name": ["/".join(n.split("/")[1:]) for n in names],
            "note": "",
            "stats_op": range(len(names)),
            "gemm": [n in cheapest for n in names],
        },
        index=pd.Index(range(len(names)), name="op"),
    )
    whatif = pd.DataFrame(
        {
            ("bf16", "safe"): [bf16_safe.get(n, True) for n in names],
            ("bf16", "reason"): "ok",
            ("nvfp4", "safe"): [cheapest.get(n) == "nvfp4" for n in names],
            ("nvfp4", "reason"): "ok",
            ("nvfp4", "block_flush"): 0.0,
            (CHEAPEST, ""): [cheapest.get(n, "") for n in names],
        },
        index=ops.index,
    )
    return ops, whatif


def test_recommend_merges_layers_only_where_every_layer_agrees():
    cheapest = {
        "fwd/block_0/mlp/x": "nvfp4",
        "fwd/block_1/mlp/x": "nvfp4",
        "fwd/block_0/attn/q": "nvfp4",
        "fwd/block_1/attn/q": "",  # no recipe is safe: BF16 is
        "bwd/block_0/mlp/g": "",  # not even BF16: no rule
    }
    ops, whatif = _frames(cheapest, {"bwd/block_0/mlp/g": False}, extra=["fwd/block_0/mlp/y"])
    policy = A.recommend_policy(whatif, ops)
    rules = {r.pattern: r.spec for r in policy}
    assert rules == {
        "fwd/block_*/mlp/x": "nvfp4@matmul",
        "fwd/block_0/attn/q": "nvfp4@matmul",
        "fwd/block_1/attn/q": "bf16@matmul",
    }
    # every value gets exactly what it was picked, nothing else is reached
    got = dict(zip(A.op_label_series(ops), [policy.target(lab) for lab in A.op_label_series(ops)]))
    assert got["fwd/block_1/mlp/x"] == "nvfp4" and got["fwd/block_0/mlp/y"] is None
    assert got["bwd/block_0/mlp/g"] is None
    prediction = A.predict_policy(policy, whatif, ops)
    assert list(prediction["safe"]) == [True] * 4 and A.predicted_verdict(prediction) == "safe"
    unsafe = ss.Policy({"fwd/block_1/attn/q": "nvfp4"})
    assert A.predicted_verdict(A.predict_policy(unsafe, whatif, ops)) == "unsafe"
    with pytest.raises(ss.PolicyError, match="reaches no op"):
        A.predict_policy(ss.Policy({"fwd/nowhere": "bf16"}), whatif, ops)
    with pytest.raises(ValueError, match="records no block-scaled recipe"):
        A.recommend_policy(whatif.drop(columns=[(CHEAPEST, "")]), ops)


def test_recommend_refuses_values_the_step_already_rounds():
    """A naive FP8 run's matmul reads ``x.astype(float8).astype(float32)``: its statistics
    are the float8 value's (an alias). A recipe there would round on top of the cast
    (helper-31: NVFP4 stacked on a naive run's casts trained 44 % worse than the naive run
    and was predicted safe), so the recommendation refuses and says where to take it."""
    cheapest = {"fwd/mlp/w": "nvfp4", "fwd/mlp/x": "nvfp4"}
    ops, whatif = _frames(cheapest, {})
    ops["dtype"] = "float32"
    assert len(A.recommend_policy(whatif, ops)) == 2  # an fp32 run: recommended
    ops.loc[1, "stats_op"] = 2  # x is the widened float8 cast of a value of its own
    narrow = pd.DataFrame(
        {"pass": ["fwd"], "name": ["mlp/convert_element_type"], "note": [""], "stats_op": [2]},
        index=pd.Index([2], name="op"),
    ).assign(gemm=False, dtype="float8_e4m3fn")
    ops = pd.concat([ops, narrow])
    whatif = pd.concat([whatif, whatif.iloc[[1]].set_axis([2])])
    with pytest.raises(
        ValueError,
        match=r"1 matmul operand.*fwd/mlp/x \(widened from "
        r"float8_e4m3fn\).*without its casts",
    ):
        A.recommend_policy(whatif, ops)
    ops.loc[2, "dtype"] = "bfloat16"
    ops["dtype"] = ops["dtype"].where(ops.index != 1, "bfloat16")  # a bf16 model: as computed
    assert len(A.recommend_policy(whatif, ops)) >= 1


# -- matmul reads ----------------------------------------------------------------------------


def test_matmul_reads_round_what_the_matmul_reads_and_nothing_else():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)

    def loss(w):
        return jnp.sum(jnp.tanh(x @ w))

    def step(w):
        value, g = jax.value_and_grad(loss)(w)
        return w - 0.1 * g, value

    wq = ss.emulate(lambda w: w * 1.0, {"input/w": "e4m3"})(w)
    new, value = jax.jit(ss.emulate(step, {"input/w": "e4m3@matmul"}))(w)
    # the matmul read the rounded weight; the update applies to the weight as passed
    np.testing.assert_allclose(float(value), float(loss(wq)), rtol=1e-6)
    want = w - 0.1 * jax.grad(loss)(wq)
    np.testing.assert_allclose(np.asarray(new), np.asarray(want), rtol=1e-6, atol=1e-7)
    # held in place instead, the update applies to the rounded weight
    held, _ = jax.jit(ss.emulate(step, {"input/w": "e4m3"}))(w)
    np.testing.assert_allclose(np.asarray(held), np.asarray(wq - 0.1 * jax.grad(loss)(wq)),
                               rtol=1e-6, atol=1e-7)  # fmt: skip
    assert not np.allclose(np.asarray(held), np.asarray(new))
    assert ss.Policy.from_json(ss.Policy({"input/w": "e4m3@matmul"}).to_json()).rules[0].reads == (
        "matmul"
    )
    with pytest.raises(ss.PolicyError, match="'@gemm' is not a reader"):
        ss.Policy({"input/w": "e4m3@gemm"})


# -- ss.verify ---------------------------------------------------------------------------------


def _sgd_problem():
    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.standard_normal((8, 4)) * 0.3, jnp.float32)
    batches = [
        (jnp.asarray(rng.standard_normal((16, 8)), jnp.float32),
         jnp.asarray(rng.standard_normal((16, 4)), jnp.float32))
        for _ in range(12)
    ]  # fmt: skip

    def step(w, batch):
        x, y = batch

        def loss(w):
            with jax.named_scope("lin"):
                return jnp.mean((x @ w - y) ** 2)

        value, g = jax.value_and_grad(loss)(w)
        return w - 0.1 * g, value

    return step, (w,), batches


def test_verify_measures_a_harmless_and_a_harmful_policy():
    step, init, batches = _sgd_problem()
    same = ss.verify(step, init, batches, {"fwd/**": "fp32"}, steps=10)
    assert same.gap == 0.0 and same.verdict == "safe"
    assert same.loss_plain == same.loss_policy and len(same.loss_plain) == 10
    # the weight held in MXFP4 itself: most updates round away, training stalls
    bad = ss.verify(step, init, iter(batches), {"input/w": "mxfp4"}, steps=10)
    assert bad.gap > 0.005 and bad.verdict == "unsafe"
    # the control (the weight in BF16) moves the loss far less: the noise floor
    assert abs(bad.noise) < bad.gap / 4 and bad.threshold >= 2 * abs(bad.noise)
    assert len(bad.loss_control) == 10 and same.noise == 0.0
    assert bad.policy == [["input/w", "mxfp4"]]
    assert "unsafe" in bad.summary()
    with pytest.raises(ss.PolicyError, match="reaches no op"):
        ss.verify(step, init, batches, {"fwd/nowhere": "bf16"}, steps=2)
    with pytest.raises(ValueError, match="20 steps need 20 batches, got 12"):
        ss.verify(step, init, batches, {}, steps=20)
    with pytest.raises(TypeError, match=r"\(\*state, loss\)"):
        ss.verify(lambda w, b: w, init, batches, {}, steps=2)


def test_verify_counts_the_tails_own_spread_as_noise():
    """One BF16 control is one sample of the noise, and an FP8 trajectory wanders further
    from plain than a BF16 one (helper-31: a ViT's MXFP8 gap read -0.91 % "unsafe beyond
    ±0.50 %" while windows of its tail moved by ±2 %). The threshold is at least twice the
    gap's standard error from the tail's paired steps (NumPy here, the same batches)."""
    step, init, batches = _sgd_problem()
    res = ss.verify(step, init, batches * 2, {"input/w": "e4m3"}, steps=20, control=False)
    a = np.asarray(res.loss_plain[-res.tail :])
    b = np.asarray(res.loss_policy[-res.tail :])
    diff = (b - a) / abs(a.mean())
    want = np.std(diff, ddof=1) / np.sqrt(len(diff))
    assert res.tail == 2 and want > 0
    np.testing.assert_allclose(res.spread, want, rtol=1e-12)
    assert res.threshold >= 2 * want and res.threshold >= 0.005
    assert res.verdict == ("safe" if abs(res.gap) <= res.threshold else "unsafe")
    assert f"{res.spread:.2%} (paired steps" in res.summary()
    # a gap below plain beyond the noise: no cause is claimed that the policy may not have
    low = dataclasses.replace(res, gap=-0.5, threshold=0.01, verdict="unsafe")
    assert "rounds the loss's own computation" not in low.summary()
    assert "a rounding does not train better" in low.summary()
    # a prediction of many values is one value at a time: said so, not a policy's "safe"
    rows = [{"op": 1, "safe": True}, {"op": 2, "safe": True}]
    many = dataclasses.replace(res, predicted="safe", prediction=rows)
    assert "value by value: each of the 2 values passes alone" in many.summary()
    one = dataclasses.replace(res, predicted="safe", prediction=rows[:1])
    assert "value by value" not in one.summary()


def test_verify_judges_the_training_not_the_returned_number():
    """A rule reaching the returned loss itself rounds what is printed, not what trains:
    the gap is 0 (it read +0.56 % on an MLP). A loss far below plain is the policy
    rounding the loss's own sums (E4M3 saturates at 448): unsafe, not "safe" at -86 %.
    A plain loss that is NaN leaves nothing to compare: unknown, not "unsafe". A rule
    held for a matmul no matmul reads changes nothing: refused, not "safe (agrees)"."""
    step, init, batches = _sgd_problem()
    loss_only = ss.verify(step, init, batches, {"fwd/lin/div": "e4m3"}, steps=6, control=False)
    assert loss_only.loss_policy == loss_only.loss_plain and loss_only.gap == 0.0
    assert loss_only.verdict == "safe"

    def summed(w, batch):  # the squared errors summed, ~100 each: the sum is > 448
        x, y = batch
        value, g = jax.value_and_grad(lambda w: jnp.sum((x @ w - 10 * y) ** 2) / 64)(w)
        return w - 0.01 * g, value

    low = ss.verify(summed, init, batches, {"fwd/reduce_sum": "e4m3"}, steps=6, control=False)
    plain_tail = np.mean(low.loss_plain[-1:])
    assert plain_tail > 448 / 64 * 4 and low.loss_policy[-1] <= 448 / 64  # saturated
    assert low.gap < -0.5 and low.verdict == "unsafe"
    assert "below the plain one" in low.summary()

    def nan_step(w, batch):
        w, value = step(w, batch)
        return w, value * jnp.nan

    unknown = ss.verify(nan_step, init, batches, {"fwd/lin/dot_general": "bf16"}, steps=3)
    assert unknown.verdict == "unknown" and unknown.agrees is None
    assert "unknown" in unknown.summary() and "not a finite" in unknown.summary()
    assert A.agreement({"verdict": "unknown", "predicted": "safe"}) == "-"
    with pytest.raises(ss.PolicyError, match="read by no matmul.*changes nothing"):
        ss.verify(step, init, batches, {"fwd/lin/sub": "mxfp8_e4m3@matmul"}, steps=2)
    for bad in (-1, 0, float("nan"), "x", True):
        with pytest.raises(ValueError, match="threshold must be a positive"):
            ss.verify(step, init, batches, {}, steps=2, threshold=bad)


# -- on a recorded sample-model run ------------------------------------------------------------


def test_run_track_under_a_policy_records_the_emulated_step(tmp_path):
    step, init, batches = _sgd_problem()
    policy = {"fwd/lin/dot_general": "e4m3"}
    emulated = jax.jit(ss.emulate(step, policy))
    with ss.Run(tmp_path / "r", every=2) as run:
        tracked = run.track(step, scalify=False, policy=policy)
        w, v = init[0], init[0]
        for b in batches[:4]:
            w, loss = tracked(w, b)
            v, want = emulated(v, b)
            assert float(loss) == float(want)
    reader = ss.open_run(tmp_path / "r")
    assert reader.meta["policy"] == [["fwd/lin/dot_general", "e4m3"]]
    assert list(reader.steps) == [0, 2]


def test_the_matmul_table_finds_each_layer_and_its_gradients(tiny_run):
    reader = ss.open_run(tiny_run)
    table = A.matmul_table(reader.ops)
    linear = table[table["params"]]
    assert set(linear["layer"]) >= {"fwd/block_*/mlp/dot_general#1", "fwd/head/dot_general"}
    assert (linear["bwd_gradients"].map(len) > 0).all()
    labels = A.op_label_series(reader.ops)
    for ops_ in linear["bwd_gradients"]:
        assert all(labels[x].startswith("bwd/") for x in ops_)
    policy = A.matmul_policy(reader.ops, "fwd/head/dot_general", "nvfp4")
    assert [r.reads for r in policy] == ["matmul", "matmul"]
    with pytest.raises(ValueError, match=r"no matmul layer \['fwd/nope'\]; layers: fwd/"):
        A.matmul_policy(reader.ops, "fwd/nope", "nvfp4")  # names the layers it has


def test_scalescope_verify_keeps_the_outcome_and_the_report_shows_it(tiny_run, tmp_path, capsys):
    policy_file = tmp_path / "policy.json"
    code = main(["verify", str(tiny_run), "--policy", "recommend", "--steps", "4",
                 "--write-policy", str(policy_file)])  # fmt: skip
    out = capsys.readouterr().out
    assert code in (0, 1) and "measured over 4 steps" in out and "predicted by the what-if" in out
    policy = ss.Policy.from_json(policy_file)
    assert len(policy) > 0 and all(r.reads == "matmul" for r in policy)
    (record,) = ss.open_run(tiny_run).verifications()
    assert record["steps"] == 4 and record["verdict"] == ("safe" if code == 0 else "unsafe")
    assert record["policy"] == [[r.pattern, r.spec] for r in policy]
    assert record["predicted"] in ("safe", "unsafe", "unknown")
    report = tmp_path / "report.json"
    html = tmp_path / "r.html"
    assert main(["report", str(tiny_run), "-o", str(html), "--json", str(report)]) in (0, 1)
    doc = json.loads(report.read_text())
    assert doc["verified"][0]["gap"] == pytest.approx(record["gap"])
    assert "Precision policies" in html.read_text()
    from scalescope.app.dashboard import verified_html  # the dashboard's line below the verdict

    line = verified_html(ss.open_run(tiny_run))
    assert f"{100 * record['gap']:+.2f} % over 4 steps ({record['verdict']})" in line
    # a bad policy is exit 2, naming the rule and the nearest op labels
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"fwd/block_0/mlp/dot_generl": "nvfp4"}))
    assert main(["verify", str(tiny_run), "--policy", str(bad), "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "fwd/block_0/mlp/dot_generl" in err and "fwd/block_0/mlp/dot_general" in err


def test_train_under_a_policy_file(tmp_path, capsys):
    policy = tmp_path / "p.json"
    ss.Policy({"fwd/**/mlp/dot_general#1": "mxfp8_e4m3_rceil"}).to_json(policy)
    run = tmp_path / "run"
    argv = ["train", "gpt", "--steps", "2", "--every", "1", "--run", str(run), "--quiet"]
    # one layer, one format, no histograms: the run's metadata is what is checked here,
    # and its recording program (the policy's emulation inside) is its own compile
    argv += ["--data", "vendored", "--policy", str(policy), *TINY_GPT, "--layers", "1"]
    argv += ["--formats", "e4m3", "--no-histograms"]
    assert main(argv) == 0
    assert ss.open_run(run).meta["policy"] == [["fwd/**/mlp/dot_general#1",
                                                "mxfp8_e4m3_rceil"]]  # fmt: skip
    assert ss.open_run(run).formats == ("e4m3",)  # --formats restricts the formats
    policy.write_text('{"fwd/nowhere": "nvfp4"}')
    argv[argv.index(str(run))] = str(tmp_path / "run2")
    assert main(argv) == 2
    assert "fwd/nowhere" in capsys.readouterr().err
    assert not (tmp_path / "run2").exists()  # refused before the run was created
