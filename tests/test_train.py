"""`scalescope train`: a few steps of each precision on real data write a readable run."""

from __future__ import annotations

import numpy as np
import pytest

import scalescope as ss
from scalescope.cli import main

TINY_GPT = ["--layers", "1", "--d-model", "16", "--seq-len", "8", "--batch", "2"]
TINY_MLP = ["--hidden", "32", "--batch", "16"]


def test_the_cli_offers_every_precision_the_trainer_knows():
    # the parser spells them out (it does not import the training code): held equal here
    from scalescope.cli import PRECISION_CHOICES
    from scalescope.sample_models.train import PRECISION_NAMES

    assert PRECISION_CHOICES == PRECISION_NAMES


def _train(tmp_path, model, precision, extra, steps=3, every=2):
    run = tmp_path / f"{model}-{precision}"
    argv = ["train", model, "--precision", precision, "--steps", str(steps)]
    argv += ["--every", str(every), "--run", str(run), "--quiet", *extra]
    assert main(argv) == 0
    return run


def _check_run(run, precision, steps, every):
    reader = ss.open_run(run)
    assert reader.status == "closed"
    assert list(reader.steps) == list(range(0, steps, every))
    assert reader.config["precision"] == precision
    assert reader.config["scalify"] == (precision in ("fp16", "fp8"))
    sc = reader.scalars
    assert list(sc.index) == list(range(steps))
    assert {"loss", "lr", "val_loss"} <= set(sc.columns)
    passes = set(reader.ops["pass"])
    assert {"fwd", "bwd", "opt"} <= passes
    dots = reader.stats("rms", ops=r"^fwd/.*dot_general", steps=0)
    assert len(dots) > 0 and np.isfinite(dots["value"]).all()
    return reader


@pytest.mark.data
@pytest.mark.parametrize("precision", ["fp32", "fp16", "fp8", "fp8-naive"])
def test_train_mlp_on_fashion_mnist_writes_a_readable_run(tmp_path, precision, capsys):
    run = _train(tmp_path, "mlp", precision, TINY_MLP, steps=2, every=1)
    out = capsys.readouterr().out
    assert f"mlp {precision}: 2 steps" in out and "validation accuracy" in out
    reader = _check_run(run, precision, 2, 1)
    assert reader.config["dataset"] == "fashion-mnist"
    if precision in ("fp8", "fp8-naive"):
        # the matmul inputs are cast: FP8 values appear in the forward pass
        casts = reader.ops[reader.ops["dtype"].str.startswith("float8")]
        assert len(casts) > 0


def test_train_gpt_layers_under_scan_with_chosen_heads(tmp_path):
    """--scan traces one layer (rows per iteration), --heads sets the attention heads."""
    extra = ["--layers", "3", "--d-model", "16", "--heads", "2", "--seq-len", "8"]
    extra += ["--batch", "2", "--data", "vendored", "--scan"]
    run = _train(tmp_path, "gpt", "fp32", extra, steps=1, every=1)
    reader = ss.open_run(run)
    assert reader.config["n_heads"] == 2 and reader.config["scan_layers"] is True
    ops = reader.ops
    dots = ops[ops["name"].str.match(r"blocks/.*dot_general") & (ops["pass"] == "fwd")]
    assert len(dots) > 0 and all(tuple(loop) == (3,) for loop in dots["loop"])
    rows = reader.stats("rms", ops=r"^fwd/blocks/attn/dot_general$", steps=0)
    assert sorted(set(rows["iteration"])) == [0, 1, 2]


def test_train_appends_to_its_own_run_and_refuses_another_model(tmp_path, capsys):
    run = _train(tmp_path, "mlp", "fp32", TINY_MLP, steps=2, every=1)
    again = ["train", "mlp", "--precision", "fp32", "--steps", "2", "--every", "1"]
    assert main([*again, "--run", str(run), "--quiet", *TINY_MLP]) == 0
    assert list(ss.open_run(run).steps) == [0, 1, 2, 3]
    # another model, at a step that would not even record: refused before writing
    other = ["train", "mlp", "--precision", "fp32", "--steps", "1", "--run", str(run)]
    assert main([*other, "--every", "10", "--quiet", "--hidden", "48", "--batch", "16"]) == 2
    assert "different graph" in capsys.readouterr().err
    reader = ss.open_run(run)
    assert list(reader.steps) == [0, 1, 2, 3] and list(reader.scalars.index) == [0, 1, 2, 3]


def test_train_reports_missing_fashion_mnist_with_the_install_command(tmp_path, capsys):
    argv = ["train", "mlp", "--steps", "1", "--run", str(tmp_path / "r")]
    assert main([*argv, "--data-dir", str(tmp_path / "nowhere"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "apt-get install dataset-fashion-mnist" in err and "nowhere" in err
    assert not (tmp_path / "r").exists()  # nothing half-created


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "mlp", "--steps", "0", "--run", "x"], "steps must be positive"),
        (["train", "mlp", "--every", "0", "--run", "x"], "--every must be >= 1"),
        (["train", "cnn", "--run", "x"], "invalid choice: 'cnn'"),
        (["train", "mlp", "--precision", "fp4", "--run", "x"], "invalid choice: 'fp4'"),
        (["train", "mlp", "--formats", "e4m3,mxfp9", "--run", "x"], "unknown format or recipe"),
        (["train", "mlp", "--formats", " , ", "--run", "x"], "--formats: no format given"),
        (["train", "mlp", "--formats", "e4m3,e4m3", "--run", "x"], "lists a format twice"),
        (["train", "gpt", "--heads", "5", "--run", "x"], "--heads 5 must be >= 1 and divide"),
    ],
)
def test_train_rejects_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_progress_prints_rate_loss_and_eta():
    import io

    from scalescope.sample_models.train import Progress

    out = io.StringIO()
    bar = Progress(200, "gpt fp8", out)
    bar.update(50, loss=2.5, val_loss=None)
    bar.update(200, loss=1.75, val_loss=1.9)
    bar.close()
    lines = out.getvalue().splitlines()  # not a terminal: one line per update
    assert len(lines) == 2
    assert lines[0].startswith("gpt fp8 [######") and "50/200" in lines[0]
    assert "steps/s" in lines[0] and "loss 2.5000" in lines[0] and "val_loss" not in lines[0]
    assert "200/200" in lines[1] and "val_loss 1.9000" in lines[1] and "eta" in lines[1]
    # the first update's steps include the compile: no eta until later steps are timed
    assert lines[0].endswith("eta    -") and lines[1].endswith("eta    0s")
    early = io.StringIO()
    bar = Progress(200, "gpt fp8", early)
    for done in (1, 2, 3, 4):
        bar.update(done, loss=2.0)
    etas = [line.rsplit("eta", 1)[1].strip() for line in early.getvalue().splitlines()]
    assert etas[:3] == ["-", "-", "-"] and etas[3].endswith("s")


def test_train_config_opt_state_dtype_defaults_to_the_params_and_is_checked():
    import jax

    from scalescope.sample_models.train import TrainConfig, make_adamw

    params = {"w": np.ones(4, np.float16)}
    TrainConfig().check()
    state = make_adamw(TrainConfig(precision="fp8")).init(params)
    assert {x.dtype for x in jax.tree.leaves(state) if x.ndim} == {np.dtype("float16")}
    cfg = TrainConfig(precision="fp8", opt_state_dtype="float32")
    cfg.check()
    state = make_adamw(cfg).init(params)
    assert {x.dtype for x in jax.tree.leaves(state) if x.ndim} == {np.dtype("float32")}
    with pytest.raises(ValueError, match="opt_state_dtype"):
        TrainConfig(opt_state_dtype="fp8").check()


@pytest.mark.slow
def test_train_gpt_unit_fp8_is_the_unit_scaled_model_and_learns(tmp_path):
    """`--precision unit-fp8`: the plain GPT transformed by `ss.unit_scale` (no scalify),
    unit-std weights, FP8 casts, the recipe's own learning rate; it trains."""
    run = _train(tmp_path, "gpt", "unit-fp8", [*TINY_GPT, "--data", "vendored"], steps=40, every=39)
    reader = _check_run(run, "unit-fp8", 40, 39)
    cfg = reader.config
    assert cfg["unit_scaled"] is True and cfg["scalify"] is False
    assert cfg["learning_rate"] == 0.1  # the recipe's default, recorded
    assert (reader.ops["dtype"].str.startswith("float8")).any()  # the casts are there
    weights = reader.stats("rms", ops=r"input/params/(?:wte|blocks/0/attn/qkv/w)$", steps=0)
    assert len(weights) == 2, reader.ops["name"].head(12).tolist()
    assert np.allclose(weights["value"], 1.0, atol=0.1)  # unit-std initial weights
    loss = reader.scalars["loss"].to_numpy(np.float64)
    assert np.isfinite(loss).all() and loss[-5:].mean() < loss[:5].mean() - 0.3


def test_unit_init_redraws_weights_only():
    import jax

    from scalescope.sample_models.gpt import GPTConfig, init_gpt
    from scalescope.sample_models.precision import unit_init

    params = init_gpt(jax.random.key(0), GPTConfig(d_model=32, n_layers=1, scan_layers=True))
    new = unit_init(params, jax.random.key(1))
    assert 0.9 < float(np.std(np.asarray(new["wte"]))) < 1.1
    assert 0.9 < float(np.std(np.asarray(new["blocks"]["mlp"]["fc"]["w"]))) < 1.1
    np.testing.assert_array_equal(new["ln_f"]["scale"], params["ln_f"]["scale"])
    np.testing.assert_array_equal(new["blocks"]["ln_1"]["scale"], params["blocks"]["ln_1"]["scale"])
    np.testing.assert_array_equal(
        new["blocks"]["attn"]["qkv"]["b"], params["blocks"]["attn"]["qkv"]["b"]
    )


@pytest.mark.parametrize(
    ("flag", "value", "words"),
    [
        ("--batch", "0", "batch must be positive, got 0"),
        ("--seq-len", "0", "gpt seq_len must be >= 1, got 0"),
        ("--d-model", "0", "gpt d_model must be >= 1, got 0"),
        ("--layers", "0", "gpt n_layers must be >= 1, got 0"),
        ("--sample", "0", "--sample must be >= 1"),
        ("--hidden", "0", "mlp_hidden widths must be >= 1, got [0]"),
        ("--lr", "nan", "learning_rate must be finite and > 0, got nan"),
        ("--lr", "-1", "learning_rate must be finite and > 0, got -1.0"),
    ],
)
def test_train_refuses_bad_sizes_before_creating_the_run(tmp_path, capsys, flag, value, words):
    """`--batch 0` used to become 32, `--lr nan` trained a NaN step and exited 0, zero
    sizes gave tracebacks and left an empty run folder."""
    from scalescope.cli import main

    run = tmp_path / "run"
    with pytest.raises(SystemExit) as info:
        main(["train", "gpt", "--steps", "2", "--run", str(run), "--quiet", flag, value])
    assert info.value.code == 2
    assert words in capsys.readouterr().err
    assert not run.exists()


def test_train_config_refuses_bad_sizes_and_rates():
    from scalescope.sample_models.train import TrainConfig

    for kwargs, words in (
        ({"learning_rate": float("nan")}, "learning_rate must be finite"),
        ({"gpt": {"d_model": 0}}, "gpt d_model must be >= 1"),
        ({"model": "mlp", "mlp_hidden": (64, 0)}, "mlp_hidden widths must be >= 1"),
    ):
        with pytest.raises(ValueError, match=words):
            TrainConfig(**kwargs).check()
