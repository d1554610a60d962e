"""The advisor on real recordings: `scalescope train` runs of the sample MLP on Fashion-MNIST.

Setting (``scalescope train mlp --input-scale 112 --lr 1e-3 --steps 60 --batch 128
--seed 1``, on a slice of the first 128 examples): unnormalised inputs, the pixels times
112 (the raw 0..255 bytes overflow E4M3 at the very first step; this starts the first
layer just under the limit). With one batch per epoch every step sees the same
examples, so the activations rise smoothly instead of jumping with the batch.

Naive FP8 (``fp8-naive``): the first layer's ReLU outputs, which the next matmul rounds to
E4M3, start near 380 and climb during the learning-rate warm-up. float8_e4m3fn rounds
to nearest even: values in (448, 464] become 448 and larger ones NaN. So the overflow
(``|x| > 448``) is recorded at step ~22, while the values are still rounded to 448, and the
loss turns NaN at step ~34, once they pass 464. A forward overflow beyond 464 turns the
loss NaN at the same step, so this saturation band is the only way it can be seen first.
Scalified FP8 (``fp8``) re-centres every cast input to unit RMS: the same setting never
overflows and trains.
"""

from __future__ import annotations

import gzip
import math
import struct

import numpy as np
import pytest

import scalescope as ss
from scalescope.analysis import advise_run
from scalescope.cli import main
from scalescope.sample_models.data import load_fashion_mnist
from scalescope.sample_models.train import TrainConfig

E4M3_MAX = 448.0
E4M3_NAN_FROM = 464.0  # the midpoint to the next binade: larger values round to NaN
SLICE = 128
SETTING = ["--input-scale", "112", "--lr", "1e-3", "--steps", "60", "--batch", str(SLICE)]
SETTING += ["--hidden", "256", "256", "--seed", "1", "--quiet", "--no-histograms"]


def _write_idx(path, arr: np.ndarray) -> None:
    header = struct.pack(f">BBBB{arr.ndim}I", 0, 0, 0x08, arr.ndim, *arr.shape)
    path.write_bytes(gzip.compress(header + arr.astype(np.uint8).tobytes(), compresslevel=1))


@pytest.fixture(scope="module")
def fashion_slice(tmp_path_factory):
    """The first SLICE training and test examples of the real Fashion-MNIST, as IDX files."""
    root = tmp_path_factory.mktemp("fashion-slice")
    for split, prefix in (("train", "train"), ("test", "t10k")):
        x, y = load_fashion_mnist(split)
        pixels = np.rint(x[:SLICE] * 255.0).reshape(SLICE, 28, 28)
        _write_idx(root / f"{prefix}-images-idx3-ubyte.gz", pixels)
        _write_idx(root / f"{prefix}-labels-idx1-ubyte.gz", y[:SLICE])
    return root


def _record(root, tmp_path_factory, precision: str, every: int):
    run = tmp_path_factory.mktemp("runs") / precision
    argv = ["train", "mlp", "--precision", precision, *SETTING]
    argv += ["--every", str(every), "--data-dir", str(root), "--run", str(run)]
    assert main(argv) == 0
    return ss.open_run(run)


@pytest.fixture(scope="module")
def naive_run(fashion_slice, tmp_path_factory):
    return _record(fashion_slice, tmp_path_factory, "fp8-naive", every=5)


@pytest.fixture(scope="module")
def scalified_run(fashion_slice, tmp_path_factory):
    return _record(fashion_slice, tmp_path_factory, "fp8", every=10)


def _first_nonfinite_step(reader) -> int | None:
    loss = reader.scalars["loss"]
    bad = loss.index[~np.isfinite(loss.to_numpy(np.float64))]
    return int(bad[0]) if len(bad) else None


@pytest.mark.data
@pytest.mark.slow
def test_naive_fp8_overflow_is_flagged_before_the_loss_turns_nan(naive_run):
    reader = naive_run
    assert reader.config["input_scale"] == 112 and reader.config["scalify"] is False
    nan_step = _first_nonfinite_step(reader)
    assert nan_step is not None, "the naive FP8 run was expected to go NaN"
    assert 10 <= nan_step <= 50

    findings = advise_run(reader)
    over = findings[(findings["rule"] == "overflow") & (findings["format"] == "e4m3")]
    assert len(over) >= 1
    first = over.sort_values("first_step", kind="stable").iloc[0]
    # flagged strictly before the loss turns NaN, at a step where the loss is still finite
    assert first["first_step"] < nan_step
    assert math.isfinite(float(reader.scalars["loss"].loc[first["first_step"]]))
    assert first["severity"] == "high" and first["value"] > 0
    assert f"first at step {first['first_step']}" in first["evidence"]

    # the op: the first dense layer's ReLU output (max(x, 0)) in the forward pass, the
    # value the next matmul rounds to E4M3
    op = reader.ops.loc[first["op"]]
    assert first["pass"] == op["pass"] == "fwd"
    assert op["cast_to"] == "e4m3"
    assert first["primitive"] == "max" and first["name"].startswith("dense_0/")
    assert "scalify=True" in first["fix"]  # the naive run's fix: scale-propagated casts

    # what the advisor saw: values past E4M3's 448 that still rounded to 448 (no NaN yet)
    absmax = reader.stats("absmax", ops=[int(first["op"])], steps=int(first["first_step"]))
    assert E4M3_MAX < absmax["value"].max() <= E4M3_NAN_FROM

    # the NaN the overflow led to: nothing non-finite is recorded before the loss turns NaN
    nonfinite = findings[findings["rule"] == "nonfinite"]
    assert len(nonfinite) >= 1 and nonfinite["first_step"].min() >= nan_step


@pytest.mark.data
@pytest.mark.slow
def test_scalified_fp8_run_of_the_same_model_raises_no_overflow(scalified_run):
    reader = scalified_run
    assert reader.config["input_scale"] == 112 and reader.config["scalify"] is True
    loss = reader.scalars["loss"].to_numpy(np.float64)
    assert len(loss) == 60 and np.isfinite(loss).all()
    assert loss[-5:].mean() < loss[0] / 10  # it trains
    findings = advise_run(reader)
    assert not (findings["rule"] == "overflow").any(), findings[findings["rule"] == "overflow"]
    assert not (findings["rule"] == "nonfinite").any()


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_input_scale_must_be_finite_and_positive(value, tmp_path, capsys):
    argv = ["train", "mlp", "--input-scale", value, "--steps", "1", "--run", str(tmp_path / "r")]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "input_scale must be finite and > 0" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_input_scale_is_for_the_mlp_only():
    TrainConfig(model="mlp", input_scale=255.0).check()
    with pytest.raises(ValueError, match="mlp only"):
        TrainConfig(model="gpt", input_scale=2.0).check()


@pytest.mark.data
def test_train_stops_one_step_after_the_loss_turns_nan(fashion_slice, tmp_path, capsys):
    """Raw 0..255 pixels cast to E4M3 without scaling overflow into NaN at once: training
    stops one step later (it read the losses 25 at a time and trained up to 24 more)."""
    run = tmp_path / "r"
    argv = ["train", "mlp", "--precision", "fp8-naive", "--input-scale", "255", "--steps", "30"]
    argv += ["--every", "1000", "--hidden", "16", "--batch", "32", "--no-histograms", "--quiet"]
    argv += ["--data-dir", str(fashion_slice), "--run", str(run)]
    main(argv)
    loss = ss.open_run(run).scalars["loss"].to_numpy(np.float64)
    bad = np.flatnonzero(~np.isfinite(loss))
    assert bad.size and len(loss) <= bad[0] + 2, loss
    assert f"non-finite at step {bad[0]}" in capsys.readouterr().out
