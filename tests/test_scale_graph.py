"""`ss.scale_graph`: every op's value and gradient RMS, against a NumPy forward/backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd
import pytest

import scalescope as ss
from scalescope.viz.scale_graph import scale_graph_figure

RNG = np.random.default_rng(0)
X = RNG.standard_normal((32, 24)).astype(np.float32)
W1 = (RNG.standard_normal((24, 48)) * 0.3).astype(np.float32)
W2 = (RNG.standard_normal((48, 8)) * 0.05).astype(np.float32)


def _loss(p, x):
    with jax.named_scope("mlp"):
        h = jax.nn.relu(x @ p["w1"])  # a custom_jvp call: one op
        y = h @ p["w2"]
    return jnp.mean(y * y)


def _log2_rms(a):
    return np.log2(np.sqrt(np.mean(np.asarray(a, np.float64) ** 2)))


def test_scale_graph_matches_a_numpy_backward_pass():
    frame = ss.scale_graph(_loss, {"w1": W1, "w2": W2}, X)
    assert list(frame["primitive"]) == ["dot_general", "custom_jvp_call", "dot_general", "mul"]
    assert all(name.startswith("mlp/") for name in frame["name"][:3])
    x, w1, w2 = (a.astype(np.float64) for a in (X, W1, W2))
    pre = x @ w1
    h = np.maximum(pre, 0)
    y = h @ w2
    z = y * y
    n = z.size
    g_z = np.full_like(z, 1.0 / n)
    g_y = 2 * y / n
    g_h = g_y @ w2.T
    g_pre = g_h * (pre > 0)
    fwd = [_log2_rms(v) for v in (pre, h, y, z)]
    grad = [_log2_rms(g) for g in (g_pre, g_h, g_y, g_z)]
    np.testing.assert_allclose(frame["fwd_log2_rms"], fwd, atol=1e-4)
    np.testing.assert_allclose(frame["grad_log2_rms"], grad, atol=1e-4)
    # the gradients are far below the values here: what the plot is for
    assert (frame["grad_log2_rms"] < frame["fwd_log2_rms"] - 3).all()


def test_scale_graph_enters_jit_calls_and_rejects_bad_losses():
    inner = jax.jit(lambda a: jnp.tanh(a) * 2.0)
    frame = ss.scale_graph(lambda a: jnp.sum(inner(a) ** 2), X)
    assert list(frame["primitive"]) == ["tanh", "mul", "integer_pow"]
    with pytest.raises(ValueError, match="one floating scalar"):
        ss.scale_graph(lambda a: a * 2.0, X)
    with pytest.raises(TypeError, match="callable"):
        ss.scale_graph(3, X)


def test_scale_graph_figure_draws_every_op_and_the_format_ranges():
    frame = ss.scale_graph(_loss, {"w1": W1, "w2": W2}, X)
    fig = scale_graph_figure(frame, formats=("e4m3", "fp16"))
    assert fig.name == "scale-graph"
    assert (
        list(fig.y_range.factors) == [f"{i} {n}" for i, n in zip(frame.index, frame["name"])][::-1]
    )
    sources = [r.data_source.data for r in fig.renderers if "fwd" in r.data_source.data]
    assert sources and np.allclose(sources[0]["grad"], frame["grad_log2_rms"])
    boxes = [a for a in fig.center if type(a).__name__ == "BoxAnnotation"]
    assert sorted(round(b.right) for b in boxes) == [9, 16]  # log2 of 448 and 65504
    with pytest.raises(ValueError, match="lacks columns"):
        scale_graph_figure(frame.drop(columns=["grad_log2_rms"]))


def test_run_records_scale_graphs_that_the_reader_returns(tmp_path):
    """`run.scale_graph(step, loss_fn, *args)` writes the frame atomically; the reader
    lists the steps and gives the frame back as computed."""
    params = {"w1": W1, "w2": W2}
    with ss.Run(tmp_path / "r") as run:
        first = run.scale_graph(0, _loss, params, X)
        later = run.scale_graph(7, _loss, {"w1": W1 * 4.0, "w2": W2}, X)
    reader = ss.open_run(tmp_path / "r")
    assert reader.scale_graph_steps == [0, 7]
    back = reader.scale_graph(0)
    np.testing.assert_allclose(back["grad_log2_rms"], first["grad_log2_rms"])
    assert list(back["name"]) == list(first["name"]) and back["shape"][0] == (32, 48)
    latest = reader.scale_graph()
    pd.testing.assert_frame_equal(reader.scale_graph(-1), latest)  # as hist(step=-1)
    np.testing.assert_allclose(latest["fwd_log2_rms"], later["fwd_log2_rms"])
    # W1 four times larger: the first matmul's value is exactly 2 octaves up
    assert latest["fwd_log2_rms"][0] == pytest.approx(back["fwd_log2_rms"][0] + 2.0, abs=1e-5)
    assert not list((tmp_path / "r" / "scale_graph").glob(".*"))  # no stray temporaries
    with pytest.raises(KeyError, match="recorded at steps"):
        reader.scale_graph(3)
    with ss.Run(tmp_path / "empty") as run:
        pass
    with pytest.raises(ss.RunError, match="no scale graph"):
        ss.open_run(tmp_path / "empty").scale_graph()


def test_reader_scale_graph_draws_inline_and_stays_a_frame(tmp_path):
    with ss.Run(tmp_path / "r", formats=("e4m3", "bf16")) as run:
        run.scale_graph(2, _loss, {"w1": W1, "w2": W2}, X)
    graph = ss.open_run(tmp_path / "r").scale_graph(2)
    bundle = graph._repr_mimebundle_()
    assert "text/html" in bundle and "scale graph, step 2" in bundle["text/html"]
    assert "cdn.bokeh.org" not in bundle["text/html"]
    boxes = [a for a in graph.figure.center if type(a).__name__ == "BoxAnnotation"]
    assert len(boxes) == 2  # the run's formats
    assert type(graph.head(2)).__name__ == "DataFrame"  # selections are plain frames
