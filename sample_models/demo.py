"""``scalescope demo``: the sample char GPT trained in naive FP8 and in scalified FP8,
each recorded into a run, side by side under one folder, with the dashboard on both.

The two runs share the seed, the batches and the FP8 casts (E4M3 matmul inputs forward,
E5M2 gradients backward); only scale propagation differs. The dashboard starts as soon as
the first run has its first recorded step, so the runs fill in live while they train.
Ctrl-C stops cleanly: each run closes (its buffered steps are flushed), and what was
recorded stays readable.
"""

from __future__ import annotations

import datetime as _dt
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from .train import TrainConfig, train

#: (run folder name, precision recipe), in training order.
DEMO_RUNS = (("fp8-naive", "fp8-naive"), ("fp8", "fp8"))
#: A GPT small enough to train both runs in a few minutes on 2 CPU cores; layers under
#: `lax.scan` (one op table row per layer, and a cheaper compile).
DEMO_GPT = {"seq_len": 64, "d_model": 64, "n_heads": 4, "n_layers": 2, "scan_layers": True}
#: What the demo audits: the FP8/FP16/BF16 formats and two block-scaled recipes (what
#: MXFP8 on Blackwell and NVFP4 would do to every value).
DEMO_FORMATS = ("e4m3", "e5m2", "fp16", "bf16", "mxfp8_e4m3", "nvfp4")
#: The recipe whose failing ops the summary names.
DEMO_RECIPE = "nvfp4"


class DemoError(Exception):
    """The demo cannot start (bad option, output folder, port taken); says why."""


@dataclass
class DemoOptions:
    steps: int = 200
    every: int = 10
    batch: int = 16
    seed: int = 0
    out: str | None = None  # default: runs/demo/<timestamp>
    data: str = "auto"
    serve: bool = True
    port: int = 5006
    address: str = "127.0.0.1"

    def check(self) -> None:
        for name in ("steps", "every", "batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DemoError(f"--{name} must be a positive integer, got {value!r}")
        if not 0 < self.port < 65536:
            raise DemoError(f"--port must be in 1..65535, got {self.port}")


def demo_folder(out: str | None, now: _dt.datetime | None = None) -> Path:
    """Where the demo's runs go: ``out`` (which must not hold runs already: nothing is
    overwritten), or a new ``runs/demo/<timestamp>`` folder."""
    if out is None:
        stamp = (now or _dt.datetime.now()).strftime("%Y%m%d-%H%M%S")
        root = Path("runs") / "demo" / stamp
        k = 1
        while root.exists():  # two demos started in the same second
            k += 1
            root = Path("runs") / "demo" / f"{stamp}-{k}"
        return root
    root = Path(out)
    if root.exists() and not root.is_dir():
        raise DemoError(f"--out {root} is a file, not a folder")
    taken = [name for name, _ in DEMO_RUNS if (root / name).exists()]
    if taken:
        raise DemoError(
            f"--out {root} already holds {', '.join(taken)}: the demo never overwrites a run; "
            "give another folder (or leave --out out: runs/demo/<timestamp>)"
        )
    return root


def check_port(address: str, port: int) -> None:
    """Fail before any training when the dashboard could not listen on ``address:port``."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((address, port))
    except OSError as err:
        raise DemoError(
            f"cannot serve the dashboard on {address}:{port} ({err.strerror or err}); "
            "pass --port with a free port, or --no-serve"
        ) from None


class _LateServer:
    """Starts the dashboard on ``root`` in a background thread as soon as a run exists
    under it (the dashboard refuses a folder without runs), then keeps it running."""

    def __init__(self, root: Path, port: int, address: str, serve: Callable[..., Any]) -> None:
        self.root, self.port, self.address, self._serve = root, port, address, serve
        self.server: Any = None
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._wait_and_serve, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}/"

    def _wait_and_serve(self) -> None:
        from scalescope.store import list_runs

        while not self._stop.is_set():
            if self.root.is_dir() and list_runs(self.root):
                break
            self._stop.wait(0.5)
        if self._stop.is_set():
            return
        try:
            self.server = self._serve(
                self.root, port=self.port, address=self.address, threaded=True
            )
        except BaseException as err:  # reported by the main thread, never swallowed
            self.error = err

    def wait_started(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.server is None and self.error is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.error is not None:
            raise DemoError(f"the dashboard did not start: {self.error}")

    def stop(self) -> None:
        self._stop.set()
        if self.server is not None:
            self.server.stop()


def train_demo_runs(
    opts: DemoOptions,
    root: Path,
    *,
    progress: bool = True,
    on_run: Callable[[str, dict[str, Any]], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Train the demo's runs in order into ``root/<name>``; returns their summaries
    (`sample_models.train.train`'s) by name."""
    summaries: dict[str, dict[str, Any]] = {}
    for name, precision in DEMO_RUNS:
        cfg = TrainConfig(
            model="gpt",
            precision=precision,
            steps=opts.steps,
            seed=opts.seed,
            batch=opts.batch,
            data=opts.data,
            gpt=dict(DEMO_GPT),
        )
        # A naive FP8 run that goes NaN keeps training: the dashboard shows what follows.
        summaries[name] = train(
            cfg,
            str(root / name),
            every=opts.every,
            formats=DEMO_FORMATS,
            stop_on_nan=False,
            progress=progress,
        )
        if on_run is not None:
            on_run(name, summaries[name])
    return summaries


def _loss_line(name: str, summary: dict[str, Any]) -> str:
    line = f"  {name:10s} train loss {summary['train_loss']:8.4f}"
    if "val_loss" in summary:
        line += f"   validation loss {summary['val_loss']:8.4f}"
    if summary.get("nan_step") is not None:
        line += f"   (non-finite from step {summary['nan_step']})"
    return line


def _verdicts(root: Path, stream: TextIO) -> None:
    """Each run's verdict first (the run that needs attention most on top), then the
    causes behind the worst one, each with its op, source line and fix."""
    import scalescope as ss
    from scalescope.analysis import worst_first

    names = [name for name, _ in DEMO_RUNS]
    verdicts = [ss.open_run(root / name).verdict() for name in names]
    print("\nverdicts:", file=stream)
    order = worst_first(verdicts)
    for i in order:
        print(f"  {names[i]:10s} {verdicts[i].headline.removeprefix('verdict: ')}", file=stream)
    worst = verdicts[order[0]]
    if worst.reasons:
        print(f"\nwhy {names[order[0]]} is {worst.status}:", file=stream)
        for r in worst.reasons:
            print(f"  {r.line()}", file=stream)
            print(f"      fix: {r.fix}", file=stream)


def recipe_failures(reader: Any, recipe: str = DEMO_RECIPE) -> Any:
    """Ops of ``reader`` that ``recipe`` would not keep safe at some recorded step, worst
    first: a DataFrame (label, source, underflow, clipped, flushed blocks, snr) of each
    op's worst step, per the what-if's criteria (`scalescope.analysis.format_whatif_run`)."""
    from scalescope import analysis

    whatif = analysis.format_whatif_run(reader)
    if recipe not in whatif.columns.get_level_values(0):
        return None
    unsafe = whatif.index[~whatif[(recipe, "safe")].astype(bool).to_numpy()]
    wide = reader.stats(
        [f"{s}_{recipe}" for s in ("underflow", "overflow", "block_flush", "snr")],
        ops=list(unsafe),
        wide=True,
    )
    ops = reader.ops
    worst = wide.groupby("op").agg(
        underflow=(f"underflow_{recipe}", "max"),
        clipped=(f"overflow_{recipe}", "max"),
        flushed=(f"block_flush_{recipe}", "max"),
        snr=(f"snr_{recipe}", "min"),
    )
    worst["label"] = analysis.op_labels(ops).reindex(worst.index)
    worst["source"] = ops["source"].reindex(worst.index)
    worst.attrs["ops"] = len(whatif)  # ops with statistics: the what-if's whole table
    return worst.sort_values(["flushed", "underflow", "clipped"], ascending=False)


def _recipe_summary(root: Path, stream: TextIO, top: int = 3) -> None:
    """What NVFP4 would do to the scalified run's values, as a teaser for the dashboard's
    Formats & recipes view: the ops it would not keep safe, else its noisiest op."""
    import scalescope as ss
    from scalescope import analysis

    name = DEMO_RUNS[-1][0]
    reader = ss.open_run(root / name)
    failing = recipe_failures(reader)
    if failing is None:
        return
    n_ops = failing.attrs["ops"]
    if not len(failing):
        whatif = analysis.format_whatif_run(reader, [DEMO_RECIPE])
        snr = whatif[(DEMO_RECIPE, "snr")].astype(float)
        worst = int(snr.idxmin())
        label = analysis.op_labels(reader.ops)[worst]
        print(
            f"\n{DEMO_RECIPE} on {name}: safe for all {n_ops} ops (the noise it adds is what "
            f"training answers to); the noisiest, {snr[worst]:.1f} dB: {label} "
            f"({reader.ops.loc[worst, 'source']})",
            file=stream,
        )
        return
    print(
        f"\n{DEMO_RECIPE} on {name}: {len(failing)} of {n_ops} ops would not be safe",
        file=stream,
    )
    for _, row in failing.head(top).iterrows():
        print(
            f"  {row['label']} ({row['source']}): underflow {row['underflow']:.1%}, "
            f"clipped {row['clipped']:.2%}, flushed blocks {row['flushed']:.1%}, "
            f"SNR {row['snr']:.1f} dB",
            file=stream,
        )


def run_demo(
    opts: DemoOptions, stream: TextIO | None = None, serve: Callable[..., Any] | None = None
) -> int:
    """The whole demo; returns the exit status (0 done, 130 interrupted during training).

    ``serve``: the dashboard server (`app.serve`, passed in by the CLI, the one place
    that imports the dashboard), needed when ``opts.serve`` is set."""
    out = stream or sys.stdout
    opts.check()
    if opts.serve and serve is None:
        raise DemoError("run_demo: serving the dashboard needs serve= (app.serve)")
    root = demo_folder(opts.out)
    if opts.serve:
        check_port(opts.address, opts.port)
    root.mkdir(parents=True, exist_ok=True)
    names = " and ".join(name for name, _ in DEMO_RUNS)
    print(
        f"scalescope demo: the sample char GPT ({DEMO_GPT['n_layers']} layers, "
        f"d={DEMO_GPT['d_model']}) trained {opts.steps} steps in {names}, "
        f"recorded every {opts.every} steps into {root}/",
        file=out,
        flush=True,
    )
    server = _LateServer(root, opts.port, opts.address, serve) if opts.serve else None
    if server is not None:
        print(
            f"dashboard: {server.url} (live: it starts with the first recorded step)",
            file=out,
            flush=True,
        )
    try:
        summaries = train_demo_runs(opts, root)
    except KeyboardInterrupt:
        if server is not None:
            server.stop()
        print(
            f"\ninterrupted: the runs recorded so far are intact in {root}/ "
            f"(scalescope serve {root})",
            file=out,
            flush=True,
        )
        return 130
    _verdicts(root, out)
    print(
        "\nfinal losses (the same seed, batches and FP8 casts; scalify is the difference):",
        file=out,
    )
    for name, summary in summaries.items():
        print(_loss_line(name, summary), file=out)
    _recipe_summary(root, out)
    if server is None:
        print(f"\nruns in {root}/; see them with: scalescope serve {root}", file=out, flush=True)
        return 0
    try:
        server.wait_started()
        print(f"\ndashboard on both runs: {server.url} (Ctrl-C stops it)", file=out, flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("stopped", file=out)
    finally:
        server.stop()
    return 0
