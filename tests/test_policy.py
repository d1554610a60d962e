"""`ss.Policy`: ordered (pattern, target) rules over the probe's op labels, first match
wins; JSON round trip; `describe` says which ops each rule reaches, and every bad input
(a malformed file, an unknown target, a rule that reaches nothing) is a `PolicyError`
naming the rule."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import optax
import pytest

import scalescope as ss
from scalescope.core import policy as P

LABELS = [
    "input/params/w1",
    "fwd/blocks/0/mlp/dot_general",
    "fwd/blocks/1/mlp/dot_general",
    "fwd/blocks/mlp/dot_general",
    "fwd/blocks/0/attn/dot_general#2",
    "bwd/blocks/0/mlp/add_any#3",
    "bwd/loss/add_any",
    "opt/mul#3",
    "opt/adam.mu+1",
    "fwd/dot_general",  # a step without scopes
]


def reached(pattern: str) -> list[str]:
    rule = P.Rule(pattern, "bf16")
    return [label for label in LABELS if rule.matches(label)]


@pytest.mark.parametrize(
    ("pattern", "want"),
    [
        ("fwd/*/mlp/*", ["fwd/blocks/mlp/dot_general"]),  # * stays within one part
        ("fwd/blocks/*/mlp/*", LABELS[1:3]),
        ("fwd/**/mlp/*", LABELS[1:4]),  # ** crosses parts
        ("bwd/**", LABELS[5:7]),
        ("fwd/blocks/?/mlp/dot_general", LABELS[1:3]),
        ("fwd/blocks/[!1]/*/*", ["fwd/blocks/0/mlp/dot_general", LABELS[4]]),
        ("fwd/blocks/[1]/mlp/*", ["fwd/blocks/1/mlp/dot_general"]),
        ("opt/mul#3", ["opt/mul#3"]),  # '#' '.' '+' are literal
        ("opt/adam.mu+1", ["opt/adam.mu+1"]),
        ("opt/adam?mu+1", ["opt/adam.mu+1"]),
        ("mlp", []),  # a glob matches the whole label
        ("re:mlp", LABELS[1:4] + ["bwd/blocks/0/mlp/add_any#3"]),  # a regex is searched
        ("re:^fwd/.*dot_general#\\d+$", [LABELS[4]]),
        ("input/params/*", ["input/params/w1"]),
        # ** as a whole part spans any number of parts, none included
        ("fwd/**/dot_general", [*LABELS[1:4], "fwd/dot_general"]),
        ("**/add_any", ["bwd/loss/add_any"]),
        ("fwd/blocks/**/mlp/**", LABELS[1:4]),
    ],
)
def test_globs_and_regexes_reach_the_labels_they_say(pattern, want):
    assert reached(pattern) == want


def test_the_first_matching_rule_wins():
    policy = ss.Policy.from_dict(
        {"bwd/loss/*": "fp32", "bwd/**": "e5m2", "fwd/**/dot_general*": "mxfp8_e4m3"}
    )
    assert policy.target("bwd/loss/add_any") == "fp32"
    assert policy.target("bwd/blocks/0/mlp/add_any#3") == "e5m2"
    assert policy.target("fwd/blocks/0/attn/dot_general#2") == "mxfp8_e4m3"
    assert policy.target("opt/mul#3") is None
    assert policy.rule_for("opt/mul#3") is None
    assert [r.pattern for r in policy] == ["bwd/loss/*", "bwd/**", "fwd/**/dot_general*"]
    assert len(policy) == 3 and "mxfp8_e4m3" in repr(policy)


def test_json_round_trips_in_text_and_files(tmp_path):
    policy = ss.Policy([("fwd/**", "nvfp4"), ("re:^bwd/", "bf16"), ("fwd/**", "e4m3")])
    text = policy.to_json()
    assert json.loads(text) == {
        "version": 1,
        "rules": [["fwd/**", "nvfp4"], ["re:^bwd/", "bf16"], ["fwd/**", "e4m3"]],
    }
    assert ss.Policy.from_json(text) == policy
    path = tmp_path / "policy.json"
    assert policy.to_json(path) == text and ss.Policy.from_json(path) == policy
    assert ss.Policy.from_json(str(path)) == policy
    assert not list(tmp_path.glob(".*.tmp"))  # written whole, then renamed
    # a plain {pattern: target} object, in its order
    plain = ss.Policy.from_json('{"bwd/**": "e5m2", "fwd/**": "e4m3"}')
    assert plain == ss.Policy.from_dict({"bwd/**": "e5m2", "fwd/**": "e4m3"})
    assert plain.to_dict() == {"bwd/**": "e5m2", "fwd/**": "e4m3"}
    assert policy.to_dict() == {"fwd/**": "nvfp4", "re:^bwd/": "bf16"}  # the live rules


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ss.Policy.from_dict({"fwd/**": "e4m4"}), "unknown format or recipe 'e4m4'"),
        (lambda: ss.Policy.from_dict({"fwd/**": "e4m4"}), "did you mean e4m3"),
        (lambda: ss.Policy.from_dict({"re:(": "bf16"}), "rule 're:(': not a valid regex"),
        (lambda: ss.Policy.from_dict({"": "bf16"}), "non-empty string"),
        (lambda: ss.Policy.from_dict({"fwd/[ab": "bf16"}), "no closing ']'"),
        (lambda: ss.Policy.from_dict({"fwd/**": 8}), "got int"),
        (lambda: ss.Policy.from_dict([("fwd/**", "bf16")]), "expected a mapping"),
        (lambda: ss.Policy([("fwd/**", "bf16", "x")]), "rule 0: expected a (pattern, target)"),
        (lambda: ss.Policy(["fwd/**"]), "rule 0: expected a (pattern, target)"),
        (lambda: ss.Policy.from_json('{"rules": [["fwd/**"]]}'), "rule 0: expected"),
        (lambda: ss.Policy.from_json('{"rules": {"a": "b"}}'), "'rules' must be a list"),
        (lambda: ss.Policy.from_json('{"version": 2, "rules": []}'), "policy version 2"),
        (lambda: ss.Policy.from_json('["fwd/**", "bf16"]'), "expected an object"),
        (lambda: ss.Policy.from_json('{"fwd/**": "bf16",}'), "not valid JSON (line 1"),
    ],
)
def test_bad_policies_name_the_rule_and_the_fault(make, message):
    with pytest.raises(ss.PolicyError) as err:
        make()
    assert message in str(err.value)


def test_a_missing_or_malformed_file_is_named(tmp_path):
    with pytest.raises(ss.PolicyError, match="cannot read the policy file"):
        ss.Policy.from_json(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "fwd/**": "bf16"\n  "bwd/**": "e5m2"\n}\n')
    with pytest.raises(ss.PolicyError) as err:
        ss.Policy.from_json(bad)
    assert str(bad) in str(err.value) and "line 3" in str(err.value)


def _step():
    """A 2-layer MLP training step with its optimizer under the probe's `opt` scope."""
    tx = optax.adam(1e-3)

    def loss_fn(params, x):
        h = jax.nn.relu(x @ params["w1"])
        return jnp.mean((h @ params["w2"]) ** 2)

    def step(params, state, x):
        loss, grads = jax.value_and_grad(loss_fn)(params, x)
        with jax.named_scope("opt"):
            updates, state = tx.update(grads, state, params)
            params = optax.apply_updates(params, updates)
        return params, state, loss

    params = {"w1": jnp.ones((8, 16)) / 8, "w2": jnp.ones((16, 4)) / 16}
    return step, (params, tx.init(params), jnp.ones((2, 8)))


def test_describe_lists_the_ops_each_rule_reaches(tmp_path):
    step, args = _step()
    table = ss.instrument(step, scalify=False).op_table(*args)
    policy = ss.Policy.from_dict(
        {"fwd/dot_general*": "mxfp8_e4m3", "bwd/**": "e5m2", "opt/**": "bf16", "**": "fp32"}
    )
    rows = policy.describe(table)
    assert [(r["pattern"], r["target"]) for r in rows] == list(policy.to_dict().items())
    by = {r["pattern"]: r["ops"] for r in rows}
    assert by["fwd/dot_general*"] and all(
        lab.startswith("fwd/dot_general") for lab in by["fwd/dot_general*"]
    )
    assert by["bwd/**"] and all(lab.startswith("bwd/") for lab in by["bwd/**"])
    assert by["opt/**"] and all(lab.startswith("opt/") for lab in by["opt/**"])
    # each reachable op once, under the first rule that matches it; inputs by their name
    every = [lab for r in rows for lab in r["ops"]]
    assert len(every) == len(set(every)) == len(P.op_labels(table))
    assert "input/params/w1" in by["**"]
    # outputs (the same values as their producers) and integer values are not reachable
    assert not [lab for lab in every if "/output" in lab or lab.startswith("output")]
    ints = [op for op in table.ops if op.note == "not float"]
    assert ints and not {P.label_of(op.pass_, op.name) for op in ints} & set(every)
    # a run's op frame gives the same labels
    with ss.Run(tmp_path / "run", every=1) as run:
        run.track(step, scalify=False)(*args)
    frame = ss.open_run(tmp_path / "run").ops
    assert sorted(P.op_labels(frame)) == sorted(P.op_labels(table))
    assert policy.describe(frame) == rows
    # the labels rules match are those the dashboard and the report show, less the shape
    from scalescope import analysis as A

    shown = {label.split(" [")[0] for label in A.op_labels(frame)}
    assert set(P.op_labels(frame)) <= shown


def test_a_rule_that_reaches_nothing_names_the_nearest_ops():
    step, args = _step()
    table = ss.instrument(step, scalify=False).op_table(*args)
    policy = ss.Policy.from_dict({"fwd/dot_generl": "e4m3", "bwd/**": "e5m2"})
    with pytest.raises(ss.PolicyError) as err:
        policy.describe(table)
    text = str(err.value)
    assert "rule 'fwd/dot_generl' -> 'e4m3' reaches no op" in text
    assert "nearest op names: fwd/dot_general" in text
    loose = policy.describe(table, strict=False)
    assert loose[0]["ops"] == [] and loose[1]["ops"]
    # a rule shadowed by an earlier one reaches nothing either
    with pytest.raises(ss.PolicyError, match="rule 'bwd/mul' -> 'bf16' reaches no op") as err:
        ss.Policy([("bwd/**", "e5m2"), ("bwd/mul", "bf16")]).describe(table)
    # ... and says which rule takes its ops, not "nearest op names" that it matches
    assert "taken by the earlier rule 'bwd/**'" in str(err.value), err.value
    # a label copied with its shape, as the report and the dashboard show it: said so
    with pytest.raises(ss.PolicyError, match=r"ends in a shape.*alone: 'fwd/dot_general#1'"):
        ss.Policy({"fwd/dot_general#1 [4x8]": "e4m3"}).describe(table)
    assert "nearest" not in str(err.value)
    with pytest.raises(TypeError, match="target: an op label"):
        policy.target(3)
    # a rule on Adam's integer step count: nothing to round, said so (not "nearest ops")
    with pytest.raises(ss.PolicyError, match=r"input/state/0/count.*holds no float elements"):
        ss.Policy.from_dict({"**/count": "e4m3"}).describe(table)
    with pytest.raises(ss.PolicyError, match="got a str"):
        policy.describe("fwd/x")
