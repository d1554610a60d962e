"""Time to first paint of the dashboard's heatmap, a metric switch, a group expand and the
live lag, in a real browser.

Writes a synthetic run with the store's own layout (default 20 000 ops x 1000 recorded
steps, the size of a 12-100 layer model: ``--layers`` blocks named ``layers/<k>/attn/q/
dot_general`` ...; every statistic column the probe records for e4m3, e5m2, fp16 and
bf16, exponent histograms, a logged loss; parts of 50 steps), serves it with
``scalescope serve`` in a subprocess and drives Debian's chromium (Playwright, as in
tests/test_dashboard.py):

* page load: ``goto`` to the Overview drawn (document idle, loss figure painted; goal
  <= 5 s), and to the advisor's summary shown in it (the advisor runs in the background
  over 20 M rows and the Overview fills in when it is done; the heatmap is timed after
  that, on a quiet server);
* heatmap first paint: click on the Heatmap tab to the heatmap figure painted with its
  image, plus one animation frame (goal <= 3 s);
* metric switch: a new Metric in the heatmap's select to the figure painted with that
  title and image, plus one animation frame; median over ``--switches`` metrics never
  shown before (goal <= 1 s). Also: a switch back to a metric already computed (server
  cache hit: transfer and drawing only), and the first paint again in a second page;
* group expand: a click on a collapsed group row (the heatmap opens with its groups
  collapsed at this size) to the figure painted with that group's rows (goal <= 0.5 s);
* live lag: a writer subprocess appends ``--live`` parts of one new recorded step each
  (the store's layout, written to a temporary name and renamed) while the page shows the
  heatmap; from the rename to the first heatmap paint after the page's status shows that
  step, median and max (goal <= 2 s; the page polls every second).

Times are taken in the browser (``performance.now()``): the start is the document event
of the click or selection; "image" is the first paint of the heatmap showing it, "total"
the animation frame after that paint once the figure's view reports finished. "1st reply"
and "reply" are when the server's first and last changes were applied to the document
(server work + transfer + decoding, and the browser's work on the changes before them);
"draw" is total - reply. Then the server-side steps are timed in this process
(reading the parts, the wide statistics frame, the advisor, the matrix, building and
serialising the figure) to show where the time goes. Nothing is asserted: the table puts
the measured times next to the goals; the machine's load average is printed with them.

    python benchmarks/bench_dashboard.py [--ops 20000] [--steps 1000] [--layers 48]
        [--run DIR] [--switches 4] [--live 5] [--no-profile]
"""

from __future__ import annotations

import argparse
import contextlib
import html
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's scalescope and app, not an installed one

from scalescope.core import formats as _formats  # noqa: E402
from scalescope.probe.kernel import HIST_COLUMNS, HIST_HI, HIST_LO, StatSpec  # noqa: E402
from scalescope.store import layout as L  # noqa: E402

FORMATS = ("e4m3", "e5m2", "fp16", "bf16")
GOALS = {
    "page 1: load to Overview drawn": 5.0,
    "heatmap first paint": 3.0,
    "metric switch (median)": 1.0,
    "group expand (median)": 0.5,
    "live lag (median)": 2.0,
}
CHROMIUM = "/usr/bin/chromium"
CHROME_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
POLL_S = 1.0  # app.dashboard.POLL_MS / 1000
LOCAL = ("http://127.0.0.1", "ws://127.0.0.1", "file:", "data:", "blob:", "about:")
#: Metrics the switches go through, in order (the heatmap opens on log2_rms).
SWITCH_METRICS = ("frac_zero", "snr_e4m3", "underflow_e5m2", "log2_absmax", "overflow_e4m3")
PART_STEPS = 50

# ---------------------------------------------------------------------------------------
# the synthetic run

# One "block" of a transformer-like step: (scope, primitive, pass, cast_to).
_BLOCK = [
    ("attn/q", "dot_general", "fwd", "e4m3"),
    ("attn/k", "dot_general", "fwd", "e4m3"),
    ("attn/v", "dot_general", "fwd", "e4m3"),
    ("attn", "dot_general", "fwd", ""),
    ("attn", "reduce_max", "fwd", ""),
    ("attn", "exp", "fwd", ""),
    ("attn", "div", "fwd", ""),
    ("attn/o", "dot_general", "fwd", "e4m3"),
    ("ln", "rsqrt", "fwd", ""),
    ("ln", "mul", "fwd", ""),
    ("mlp", "dot_general", "fwd", "e4m3"),
    ("mlp", "gelu", "fwd", ""),
    ("mlp", "convert_element_type", "fwd", ""),
    ("mlp", "add", "fwd", ""),
    ("mlp", "dot_general", "bwd", "e5m2"),
    ("mlp", "mul", "bwd", ""),
    ("mlp", "add_any", "bwd", ""),
    ("attn/o", "dot_general", "bwd", "e5m2"),
    ("attn", "mul", "bwd", ""),
    ("attn", "sub", "bwd", ""),
    ("attn/q", "dot_general", "bwd", "e5m2"),
    ("ln", "mul", "bwd", ""),
    ("opt", "mul", "opt", ""),
    ("opt", "sqrt", "opt", ""),
    ("opt", "sub", "opt", ""),
]


def _op_records(n_ops: int, rng: np.random.Generator, layers: int = 48) -> list[dict]:
    """``layers`` transformer layers (``layers/<k>/...``), each ``n_ops / layers`` ops
    cycling through `_BLOCK`."""
    records = []
    per_layer = max(1, -(-n_ops // max(layers, 1)))
    for op in range(n_ops):
        scope, prim, pas, cast = _BLOCK[(op % per_layer) % len(_BLOCK)]
        block = op // per_layer
        d = int(rng.choice([256, 512, 1024]))
        shape = [16, 128, d] if pas != "opt" else [d, 4 * d]
        dtype = "float8_e4m3fn" if prim == "convert_element_type" else "bfloat16"
        records.append(
            {
                "op": op,
                "name": f"layers/{block}/{scope}/{prim}",
                "pass": pas,
                "primitive": prim,
                "shape": shape,
                "dtype": dtype,
                "scaled": bool(prim != "rsqrt"),
                "source": f"model.py:{40 + 3 * (op % len(_BLOCK))}",
                "note": "",
                "stats_op": op,
                "row_start": op,
                "n_rows": 1,
                "loop": [],
                "in_while": False,
                "in_cond": False,
                "cast_to": cast,
            }
        )
    return records


def _metadata(path: Path, records: list[dict], stat_names, every: int) -> dict:
    from scalescope.store.writer import _format_info, _now, _versions

    hist = list(HIST_COLUMNS)
    return {
        "format": L.FORMAT_NAME,
        "version": L.FORMAT_VERSION,
        "name": path.resolve().name,
        "created": _now(),
        "closed": _now(),
        "status": "closed",
        "versions": _versions(),
        "device": {
            "platform": "synthetic",
            "device_kind": "bench_dashboard",
            "device_count": 1,
            "process_count": 1,
            "host": socket.gethostname(),
        },
        "config": {"synthetic": True, "ops": len(records)},
        "every": every,
        "formats": list(FORMATS),
        "format_info": _format_info(FORMATS),
        "histograms": True,
        "hist_columns": hist,
        "hist_exponents": [HIST_LO, HIST_HI],
        "stat_names": list(stat_names),
        "select": None,
        "sample": None,
        "isolate": True,
        "graph": {
            "fingerprint": L.graph_fingerprint(records, stat_names, hist),
            "n_ops": len(records),
            "n_rows": len(records),
            "scalify": True,
        },
        "sessions": [{"started": _now(), "pid": os.getpid(), "host": socket.gethostname()}],
    }


def write_run(
    path: Path, n_ops: int, n_steps: int, every: int = 10, seed: int = 0, layers: int = 48
) -> dict:
    """Write a synthetic run at ``path``; returns sizes."""
    rng = np.random.default_rng(seed)
    stat_names = StatSpec(tuple(_formats.get(f) for f in FORMATS), True).stat_names()
    records = _op_records(n_ops, rng, layers)
    path.mkdir(parents=True, exist_ok=True)
    L.write_parquet_atomic(path / L.OPS_FILE, L.ops_table(L.ops_frame(records)))

    # Per-op character, then a random walk of log2(rms) over the recorded steps.
    base = rng.normal(0.0, 1.5, n_ops)
    trend = rng.normal(0.0, 0.5, n_ops) * (rng.random(n_ops) < 0.1) * 8  # 10 % drift far
    walk = np.cumsum(rng.normal(0.0, 0.02, (n_steps, n_ops)), axis=0)
    log2_rms = (base + trend * np.linspace(0, 1, n_steps)[:, None] + walk).astype(np.float32)
    scale_exp = np.round(base).astype(np.float32)  # scales follow the op's level
    count = np.array([min(int(np.prod(r["shape"])), 2**31 - 1) for r in records], np.int32)
    zero_ops = rng.random(n_ops) < 0.2
    under_base = rng.uniform(0.0, 0.03, n_ops)
    fmt_under = {"e4m3": 1.0, "e5m2": 0.3, "fp16": 0.05, "bf16": 0.0}
    fmt_snr = {"e4m3": 31.0, "e5m2": 25.0, "fp16": 73.0, "bf16": 55.0}
    fmt_max = {f: np.log2(float(_formats.get(f).max)) for f in FORMATS}
    profile = np.array([1, 3, 10, 30, 80, 160, 250, 300, 120, 40, 6], np.float64)
    profile /= profile.sum()
    n_hist = len(HIST_COLUMNS)

    steps = np.arange(n_steps, dtype=np.int64) * every
    n_parts = 0
    for seq, lo in enumerate(range(0, n_steps, PART_STEPS)):
        hi = min(n_steps, lo + PART_STEPS)
        k = hi - lo
        n = k * n_ops
        shape2 = (k, n_ops)
        lr = log2_rms[lo:hi] + rng.normal(0.0, 0.05, shape2).astype(np.float32)
        rms = np.exp2(lr)
        absmax = rms * np.exp2(rng.uniform(1.5, 3.5, shape2)).astype(np.float32)
        mean = rms * rng.normal(0.0, 0.1, shape2).astype(np.float32)
        frac_zero = np.where(zero_ops, rng.uniform(0.0, 0.05, shape2), 0.0)
        cols: dict[str, np.ndarray] = {
            "step": np.repeat(steps[lo:hi], n_ops),
            "op": np.tile(np.arange(n_ops, dtype=np.int32), k),
            "iteration": np.zeros(n, np.int32),
            "process": np.zeros(n, np.int32),
            "count": np.tile(count, k),
            "scale": np.exp2(np.broadcast_to(scale_exp, shape2)),
            "rms": rms,
            "absmax": absmax,
            "mean": mean,
            "std": np.sqrt(np.maximum(rms**2 - mean**2, 0.0)),
            "frac_zero": frac_zero,
            "frac_nonfinite": np.zeros(shape2),
            "min": -absmax * rng.uniform(0.5, 1.0, shape2).astype(np.float32),
            "max": absmax,
        }
        # The smallest non-zero magnitude: some 10 to 20 octaves below the abs-max.
        cols["absmin"] = absmax * np.exp2(-rng.uniform(10.0, 20.0, shape2)).astype(np.float32)
        cols["dynamic_range"] = np.log2(absmax) - np.log2(cols["absmin"])
        log2_absmax = np.log2(absmax)
        for f in FORMATS:
            low = np.clip(-lr - 3.0, 0.0, None)  # small values underflow more
            noisy = under_base * (1 + rng.normal(0, 0.2, shape2)) + 0.01 * low
            under = np.clip(fmt_under[f] * noisy, 0.0, 0.05)
            cols[f"underflow_{f}"] = under
            cols[f"subnormal_{f}"] = np.clip(2 * under + rng.uniform(0, 0.002, shape2), 0, 0.05)
            cols[f"overflow_{f}"] = np.clip((log2_absmax - fmt_max[f]) * 0.01, 0.0, 0.05)
            snr = fmt_snr[f] + rng.normal(0.0, 1.0, shape2) - 200.0 * under
            cols[f"snr_{f}"] = np.clip(snr, 10.0, 80.0)
        # Exponent histogram: a bump around log2(rms), zeros in the "zero" bin.
        flat_count = cols["count"].astype(np.float64)
        hist = np.zeros((n, n_hist), np.int32)
        centre = np.clip(np.floor(lr.ravel()).astype(np.int64) - HIST_LO + 2, 9, n_hist - 5)
        rows = np.arange(n)
        nonzero = flat_count * (1.0 - frac_zero.ravel())
        for j, w in enumerate(profile):
            hist[rows, centre + j - 7] += (nonzero * w).astype(np.int32)
        hist[:, 0] = (flat_count * frac_zero.ravel()).astype(np.int32)
        arrays = {
            name: pa.array(np.ascontiguousarray(v).ravel().astype(_dtype(name)))
            for name, v in cols.items()
        }
        assert list(arrays) == [*L.KEY_COLUMNS, *stat_names], list(arrays)
        for j, name in enumerate(L.hist_column_names(n_hist)):
            arrays[name] = pa.array(hist[:, j])
        L.write_parquet_atomic(path / L.STATS_DIR / L.part_name(seq, 0), pa.table(arrays))
        n_parts += 1

    # The loss, logged at every step (recorded or not).
    all_steps = np.arange(n_steps * every, dtype=np.int64)
    loss = (
        4.0 * np.exp(-all_steps / (n_steps * every / 3)) + 1.5 + rng.normal(0, 0.05, len(all_steps))
    )
    scalars = pa.table(
        {
            "step": all_steps,
            "name": pa.array(["loss"] * len(all_steps), pa.string()),
            "value": loss.astype(np.float64),
            "process": np.zeros(len(all_steps), np.int32),
        }
    )
    L.write_parquet_atomic(path / L.SCALARS_DIR / L.part_name(0, 0), scalars)
    L.write_json_atomic(path / L.RUN_FILE, _metadata(path, records, stat_names, every))
    return {"ops": n_ops, "steps": n_steps, "rows": n_ops * n_steps, "parts": n_parts}


def _dtype(name: str) -> type:
    if name == "step":
        return np.int64
    if name in ("op", "iteration", "process", "count"):
        return np.int32
    return np.float32


def append_steps(path: Path, count: int, interval: float, stamps: Path) -> None:
    """Append ``count`` parts of one new recorded step each to the run at ``path``, one
    every ``interval`` seconds, as the store's writer does (a temporary name, then a
    rename); after each rename, append ``step epoch_seconds`` to ``stamps``. The rows
    are the last recorded step's, with a little noise."""
    parts = L.list_parts(path / L.STATS_DIR)
    last = pq.read_table(parts[-1])
    steps = last.column("step").to_numpy()
    rows = last.filter(pa.compute.equal(last.column("step"), int(steps.max())))
    gap = int(np.diff(np.unique(steps))[-1]) if len(np.unique(steps)) > 1 else 10
    rng = np.random.default_rng(len(parts))
    step = int(steps.max())
    for i in range(count):
        time.sleep(interval)
        step += gap
        cols = {name: rows.column(name).to_numpy() for name in rows.column_names}
        cols["step"] = np.full(rows.num_rows, step, np.int64)
        rms = cols["rms"] * np.exp2(rng.normal(0, 0.05, rows.num_rows)).astype(np.float32)
        cols["rms"] = rms.astype(np.float32)
        table = pa.table({k: pa.array(v) for k, v in cols.items()}, schema=rows.schema)
        L.write_parquet_atomic(path / L.STATS_DIR / L.part_name(len(parts) + i, 0), table)
        with open(stamps, "a") as f:
            f.write(f"{step} {time.time():.6f}\n")


def _disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


# ---------------------------------------------------------------------------------------
# the server and the browser

# Installed once per page: every document change (with its time) and every paint of the
# heatmap figure (wrapping PlotView.prototype.paint, found from the Overview's loss plot).
_JS_INSTALL = """() => {
  if (window.__ss) return true;
  const ss = window.__ss = {events: [], paints: []};
  const doc = Bokeh.documents[0];
  doc.on_change((ev) => {
    const v = ev.value;
    ss.events.push({
      t: performance.now(), kind: ev.kind ?? ev.constructor.name, attr: ev.attr ?? null,
      type: ev.model?.type ?? null,
      value: (typeof v === 'string' || typeof v === 'number') ? v : null,
    });
  });
  const loss = doc.get_model_by_name('loss');
  const view = loss == null ? null : Bokeh.index.find_one(loss);
  if (view == null) return false;
  let proto = Object.getPrototypeOf(view);
  while (proto != null && !Object.prototype.hasOwnProperty.call(proto, 'paint'))
    proto = Object.getPrototypeOf(proto);
  const ids = new WeakMap();
  let next = 0;
  const idOf = (o) => {
    if (o == null || typeof o !== 'object') return -1;
    if (!ids.has(o)) ids.set(o, next++);
    return ids.get(o);
  };
  const val = (x) => (x != null && typeof x === 'object') ? x.value : x;
  const paint = proto.paint;
  proto.paint = function () {
    paint.call(this);
    const m = this.model;
    if (m.name !== 'heatmap') return;
    const img = m.renderers.find((r) => r.name === 'heatmap-image');
    ss.paints.push({
      t: performance.now(), title: m.title?.text ?? null, finished: this.has_finished(),
      displayed: this.is_displayed, image: img != null,
      rows: img == null ? null : val(img.glyph.dh),
      data: img == null ? -1 : idOf(img.data_source.data.image?.[0]),
    });
  };
  return true;
}"""

# Resolves at the animation frame after the first heatmap paint since ``since`` that shows
# the image (with ``metric`` as its title, when given; with a number of rows other than
# ``rows_not``, when given) once the figure's view reports finished, or null after
# ``timeout`` ms.
_JS_WAIT = """async ({since, metric, rows_not, timeout}) => {
  const ss = window.__ss;
  const deadline = performance.now() + timeout;
  const frame = () => new Promise((r) => requestAnimationFrame(r));
  for (;;) {
    const hit = ss.paints.find((p) => p.t >= since && p.image && p.displayed
                                      && (metric == null || p.title === metric)
                                      && (rows_not == null || p.rows !== rows_not));
    const model = Bokeh.documents[0].get_model_by_name('heatmap');
    const view = model == null ? null : Bokeh.index.find_one(model);
    if (hit && view != null && view.has_finished()) {
      const finished = performance.now();
      await frame();
      return {paint: hit.t, finished, frame: performance.now()};
    }
    if (performance.now() > deadline) return null;
    await frame();
  }
}"""

# Page coordinates of the centre of heatmap row ``row`` (a few columns in), and the rows.
_JS_ROW_XY = """(row) => {
  const m = Bokeh.documents[0].get_model_by_name('heatmap');
  const v = Bokeh.index.find_one(m);
  const el = (v.canvas_view ?? v).el;
  let box = el.getBoundingClientRect();
  const y0 = box.top + v.frame.y_scale.compute(row);
  if (y0 < 40 || y0 > window.innerHeight - 40) {  // scroll the row into the middle
    window.scrollBy(0, y0 - window.innerHeight / 2);
    box = el.getBoundingClientRect();
  }
  const img = m.renderers.find((r) => r.name === 'heatmap-image');
  const dh = img.glyph.dh, rows = (dh != null && typeof dh === 'object') ? dh.value : dh;
  return {x: box.left + v.frame.x_scale.compute(3), y: box.top + v.frame.y_scale.compute(row),
          rows};
}"""

# True once the Overview's advisor summary holds the advisor's findings (or "no findings")
_JS_ADVICE = """() => {
  for (const m of Bokeh.documents[0].all_models) {
    const css = m.css_classes;
    if (css == null || !Array.from(css).includes('ss-advisor-summary')) continue;
    const d = m.source == null ? null : m.source.data;
    if (d == null) return false;
    const get = (k) => (d instanceof Map ? d.get(k) : d[k]);
    if (get('rule') != null) return true;
    const a = get('advisor');
    return a != null && a.length > 0 && !String(a[0]).startsWith('reading');
  }
  return false;
}"""
_JS_IDLE = "() => window.Bokeh && Bokeh.documents.length > 0 && Bokeh.documents[0].is_idle"
_JS_FRAME = "() => new Promise((r) => requestAnimationFrame(() => r(performance.now())))"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def _server(path: Path, log_path: Path):
    """``scalescope serve PATH`` in a subprocess; yields (url, seconds to listening).

    Readiness is the CLI's "dashboard on" line and an open port: a GET of the page would
    build a session and warm the server's caches before the browser comes."""
    port = _free_port()
    log = open(log_path, "w")  # noqa: SIM115 - closed below
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "scalescope.cli", "serve", str(path), "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.time() + 180
        while not _listening(port) or "dashboard on" not in log_path.read_text():
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited {proc.returncode}: {log_path.read_text()}")
            if time.time() > deadline:
                raise RuntimeError(f"serve did not start in 180 s: {log_path.read_text()}")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/", time.perf_counter() - t0
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _reply_time(events: list[dict], start: float, end: float) -> float | None:
    """Time of the last document change the server sent before the paint at ``end``."""
    late = [e["t"] for e in events if start < e["t"] <= end]
    return max(late) if late else None


class Page:
    """One browser page on the dashboard, with the timing hooks installed."""

    def __init__(self, browser, url: str, timeout_s: float, advice: bool = True) -> None:
        self.timeout_ms = timeout_s * 1000
        self.page = browser.new_page(viewport={"width": 1400, "height": 1000})
        self.errors: list[str] = []
        self.remote: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else 0)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on(
            "request", lambda r: None if r.url.startswith(LOCAL) else self.remote.append(r.url)
        )
        self.page.set_default_timeout(self.timeout_ms)
        self.page.goto(url, timeout=self.timeout_ms)
        self.page.wait_for_function(_JS_IDLE, timeout=self.timeout_ms)
        # performance.now() counts from the navigation start
        self.load_s = self.page.evaluate(_JS_FRAME) / 1000
        if not self.page.evaluate(_JS_INSTALL):
            raise RuntimeError("no loss figure on the Overview: cannot hook the plot paint")
        self.advice_s = None
        if advice:  # the advisor's summary filled in (the server computes it meanwhile)
            self.page.wait_for_function(_JS_ADVICE, timeout=self.timeout_ms, polling=100)
            self.advice_s = self.page.evaluate(_JS_FRAME) / 1000

    def close(self) -> None:
        self.page.close()

    def _measure(self, act, start_event, metric: str | None, rows_not: int | None = None) -> dict:
        mark = self.page.evaluate("() => performance.now()")
        t0 = time.perf_counter()
        act()
        hit = self.page.evaluate(
            _JS_WAIT,
            {"since": mark, "metric": metric, "rows_not": rows_not, "timeout": self.timeout_ms},
        )
        wall = time.perf_counter() - t0
        if hit is None:
            raise RuntimeError(f"no heatmap paint within {self.timeout_ms / 1000:.0f} s")
        events = self.page.evaluate(f"() => window.__ss.events.filter((e) => e.t >= {mark})")
        starts = [e["t"] for e in events if start_event(e)]
        start = starts[0] if starts else mark
        reply = _reply_time(events, start, hit["paint"])
        first = min((e["t"] for e in events if start < e["t"] <= hit["paint"]), default=None)
        return {
            "total": (hit["frame"] - start) / 1000,
            "paint": (hit["paint"] - start) / 1000,
            "first": None if first is None else (first - start) / 1000,
            "reply": None if reply is None else (reply - start) / 1000,
            "draw": None if reply is None else (hit["frame"] - reply) / 1000,
            "wall": wall,
        }

    def open_heatmap(self) -> dict:
        tab = self.page.locator(".bk-tab").filter(has_text=re.compile("^Heatmap$")).first
        return self._measure(tab.click, lambda e: e["attr"] == "active", None)

    def switch(self, metric: str) -> dict:
        select = self.page.get_by_label("Metric", exact=True).first  # the heatmap's
        return self._measure(
            lambda: select.select_option(label=metric),
            lambda e: e["attr"] == "value" and e["value"] == metric,
            metric,
        )

    def expand(self) -> dict:
        """Click the first collapsed group row (tags: op -1) to the figure painted with
        that group's rows."""
        ops = self.page.evaluate(
            "() => Bokeh.documents[0].get_model_by_name('heatmap').tags[0]"
            "['scalescope.heatmap'].ops"
        )
        row = next((i for i, op in enumerate(ops) if op < 0), None)
        if row is None:
            raise RuntimeError("the heatmap has no collapsed group to expand")
        where = self.page.evaluate(_JS_ROW_XY, row)
        self.page.mouse.move(where["x"], where["y"])
        time.sleep(0.6)  # not timed: two clicks within BokehJS's double-tap time are a double tap
        return self._measure(
            lambda: self.page.mouse.click(where["x"], where["y"]),
            lambda e: False,
            None,
            rows_not=where["rows"],
        )

    def live(self, run: Path, count: int, interval: float, timeout_s: float) -> list[dict]:
        """Append ``count`` steps with a writer subprocess; per step, the lag from its
        rename to the page's status showing it and to the next heatmap paint."""
        stamps = run.parent / f"{run.name}.stamps"
        stamps.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--append", str(run), "--live", str(count)]
        proc = subprocess.run(
            [*cmd, "--interval", str(interval), "--stamps", str(stamps)],
            capture_output=True,
            text=True,
            timeout=timeout_s + count * interval,
        )
        if proc.returncode:
            raise RuntimeError(f"the writer failed: {proc.stderr[-2000:]}")
        time.sleep(3 * POLL_S)
        log = self.page.evaluate(
            "() => ({origin: performance.timeOrigin, events: window.__ss.events"
            ".filter((e) => typeof e.value === 'string' && e.value.includes('ss-last-step')),"
            " paints: window.__ss.paints})"
        )
        out = []
        for line in stamps.read_text().split("\n"):
            if not line.strip():
                continue
            step, written = int(line.split()[0]), float(line.split()[1])
            shown = re.compile(rf"ss-last-step'>{step}<")  # Panel sends the HTML escaped
            status = next(
                (e["t"] for e in log["events"] if shown.search(html.unescape(e["value"]))), None
            )
            before = [p for p in log["paints"] if status is not None and p["t"] < status]
            old = before[-1]["data"] if before else None
            paint = next(
                (
                    p["t"]
                    for p in log["paints"]
                    if status is not None and p["t"] >= status and p["image"] and p["data"] != old
                ),
                None,
            )

            def lag(t: float | None, at: float = written) -> float | None:
                return None if t is None else (log["origin"] + t) / 1000 - at

            out.append({"step": step, "status": lag(status), "total": lag(paint)})
        return out

    def image_shape(self) -> list[int]:
        return self.page.evaluate(
            """() => { const m = Bokeh.documents[0].get_model_by_name('heatmap-image');
                       const a = m.data_source.data.image[0];
                       const v = (x) => (x != null && typeof x === 'object') ? x.value : x;
                       return [a.length, v(m.glyph.dh), v(m.glyph.dw)]; }"""
        )


def browser_run(
    path: Path, log_path: Path, switches: int, timeout_s: float, live: int, expands: int
) -> dict:
    from playwright.sync_api import sync_playwright

    out: dict = {"switches": [], "expands": [], "live": []}
    with _server(path, log_path) as (url, ready_s), sync_playwright() as pw:
        out["server_ready"] = ready_s
        print(f"  server listening after {ready_s:.1f} s at {url}", flush=True)
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROME_ARGS)
        pages: list[Page] = []
        try:
            print("  page 1: loading the Overview (server builds the session)...", flush=True)
            page = Page(browser, url, timeout_s)
            pages.append(page)
            out["load"] = page.load_s
            out["advice"] = page.advice_s
            print(
                f"  page 1: Overview drawn after {page.load_s:.2f} s, the advisor's summary "
                f"after {page.advice_s:.2f} s",
                flush=True,
            )
            out["first"] = page.open_heatmap()
            out["image"] = page.image_shape()
            print(f"  page 1: heatmap painted after {out['first']['total']:.2f} s", flush=True)
            for metric in SWITCH_METRICS[:switches]:
                res = page.switch(metric)
                out["switches"].append((metric, res))
                print(f"  page 1: switch to {metric}: {res['total']:.2f} s", flush=True)
            out["cached"] = page.switch("log2_rms")
            print(
                f"  page 1: back to log2_rms (cached): {out['cached']['total']:.2f} s", flush=True
            )
            for _ in range(expands):
                res = page.expand()
                out["expands"].append(res)
                print(f"  page 1: expand a group: {res['total']:.2f} s", flush=True)
            if live:
                out["live"] = page.live(path, live, 2.5, timeout_s)
                for r in out["live"]:
                    print(
                        f"  page 1: live step {r['step']}: status {_opt(r['status'])} s, "
                        f"heatmap {_opt(r['total'])} s after the part was written",
                        flush=True,
                    )
            page2 = Page(browser, url, timeout_s)
            pages.append(page2)
            out["load2"] = page2.load_s
            out["advice2"] = page2.advice_s
            out["first2"] = page2.open_heatmap()
            print(
                f"  page 2: Overview {page2.load_s:.2f} s (advisor summary "
                f"{page2.advice_s:.2f} s), heatmap "
                f"{out['first2']['total']:.2f} s (server caches warm)",
                flush=True,
            )
            out["errors"] = [e for p in pages for e in p.errors]
            out["remote"] = [u for p in pages for u in p.remote]
        finally:
            for p in pages:
                with contextlib.suppress(Exception):
                    p.close()
            browser.close()
    return out


# ---------------------------------------------------------------------------------------
# server-side steps, in this process


def profile_server(path: Path, metrics: list[str]) -> tuple[list[tuple[str, float]], dict]:
    import warnings

    from bokeh.embed import json_item

    from scalescope import viz
    from scalescope.app.data import RunData

    rows: list[tuple[str, float]] = []
    sizes: dict = {}

    def timed(label: str, fn):
        t0 = time.perf_counter()
        result = fn()
        rows.append((label, time.perf_counter() - t0))
        print(f"  {label:44s} {rows[-1][1]:7.2f} s", flush=True)
        return result

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the synthetic run must read without warnings
        data = timed("open_run: read ops + stats parts", lambda: RunData(path))
    stats = timed("RunData.stats: wide frame of process 0", lambda: data.stats)
    sizes["stats frame"] = _mib(stats.memory_usage(deep=True).sum())
    timed("RunData.findings: advisor (Overview, background)", data.findings)
    timed("RunData.worst_ops(log2_rms): grid (Overview)", lambda: data.worst_ops("log2_rms"))
    timed("RunData.summary: op summary (loops only)", data.summary)

    def prepare():
        data.labels, data.metrics(), data.group_keys(1)
        return data.filtered_ops((), (), "")

    ops = timed("labels + metrics + groups + filtered_ops", prepare)
    groups = data.group_keys(1)
    mat = timed(f"RunData.matrix({metrics[0]}) (first paint)", lambda: data.matrix(metrics[0], ops))
    measured = timed("RunData.measured_matrix", lambda: data.measured_matrix(ops))
    sizes["matrix"] = f"{mat.shape[0]} x {mat.shape[1]} float32 = {_mib(mat.to_numpy().nbytes)}"
    kwargs = {"labels": data.labels, "measured": measured, "groups": groups}
    fig = timed(
        "viz.heatmap: build the grouped figure",
        lambda: viz.heatmap(mat, metric=metrics[0], **kwargs),
    )
    blob = timed("serialise the figure (bokeh json_item)", lambda: json.dumps(json_item(fig)))
    sizes["figure json"] = _mib(len(blob))
    for metric in metrics[1:]:
        m2 = timed(f"RunData.matrix({metric}) (switch)", lambda m=metric: data.matrix(m, ops))
        timed(
            "viz.update_heatmap",
            lambda m=metric, x=m2: viz.update_heatmap(fig, x, metric=m, **kwargs),
        )
    first = str(groups.iloc[0])
    timed(
        f"viz.update_heatmap: expand {first}",
        lambda: viz.update_heatmap(fig, m2, metric=metrics[-1], expanded={first}, **kwargs),
    )
    return rows, sizes


# ---------------------------------------------------------------------------------------


def _load() -> str:
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return "load average unknown"
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} CPUs"


def _median(rows: list[dict]) -> dict:
    """Per key, the median of the rows' numbers (None when no row has one)."""
    keys = dict.fromkeys(k for r in rows for k in r)
    out = {}
    for k in keys:
        got = [r[k] for r in rows if isinstance(r.get(k), int | float)]
        out[k] = statistics.median(got) if got else None
    return out


def _worst(rows: list[dict]) -> dict:
    keys = dict.fromkeys(k for r in rows for k in r)
    return {k: max((r[k] for r in rows if isinstance(r.get(k), float)), default=None) for k in keys}


def _opt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=20000)
    parser.add_argument("--steps", type=int, default=1000, help="recorded steps")
    parser.add_argument("--layers", type=int, default=48, help="layers the ops are named in")
    parser.add_argument("--every", type=int, default=10, help="training steps per record")
    parser.add_argument(
        "--run",
        type=Path,
        help="write the run here and keep it (reused when it already holds a run)",
    )
    parser.add_argument("--switches", type=int, default=4, help=f"1..{len(SWITCH_METRICS)}")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per browser wait")
    parser.add_argument("--expands", type=int, default=3, help="group expands to time")
    parser.add_argument("--live", type=int, default=5, help="steps appended while the page is open")
    parser.add_argument("--no-profile", action="store_true", help="skip the in-process profile")
    parser.add_argument("--append", type=Path, help=argparse.SUPPRESS)  # the live writer
    parser.add_argument("--interval", type=float, default=2.5, help=argparse.SUPPRESS)
    parser.add_argument("--stamps", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.append is not None:
        append_steps(args.append, args.live, args.interval, args.stamps)
        return
    if not 1 <= args.switches <= len(SWITCH_METRICS):
        parser.error(f"--switches must be in 1..{len(SWITCH_METRICS)}")
    if not Path(CHROMIUM).exists():
        sys.exit(f"{CHROMIUM} missing: apt-get install -y chromium")

    print(
        f"# bench_dashboard  {platform.processor() or platform.machine()}  "
        f"python {platform.python_version()}  {_load()}",
        flush=True,
    )
    tmp = Path(tempfile.mkdtemp(prefix="bench_dashboard_"))
    try:
        path = args.run if args.run is not None else tmp / "synthetic"
        if L.is_run(path):
            print(f"reusing the run at {path}", flush=True)
        else:
            print(f"writing {args.ops} ops x {args.steps} recorded steps to {path}...", flush=True)
            t0 = time.perf_counter()
            write_run(path, args.ops, args.steps, every=args.every, layers=args.layers)
            print(f"  written in {time.perf_counter() - t0:.1f} s", flush=True)
        meta = L.read_metadata(path)
        parts = L.list_parts(path / L.STATS_DIR)
        n_ops, n_parts = meta["graph"]["n_ops"], len(parts)
        n_rows = sum(pq.ParquetFile(p).metadata.num_rows for p in parts)
        disk = _mib(_disk_bytes(path))
        print("browser (chromium, headless):", flush=True)
        res = browser_run(
            path, tmp / "serve.log", args.switches, args.timeout, args.live, args.expands
        )
        load_during = _load()
        rows, sizes = [], {}
        if not args.no_profile:
            print("server-side steps, in this process:", flush=True)
            metrics = ["log2_rms", *SWITCH_METRICS[: args.switches]]
            rows, sizes = profile_server(path, metrics)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print()
    print(f"# {_load()} (after the browser part: {load_during})")
    print(
        f"data: {n_ops} ops, {n_rows} stats rows in {n_parts} parts ({disk} on disk); "
        + "".join(f"{k} {v}; " for k, v in sizes.items())
        + f"heatmap image {res['image'][0]} values ({res['image'][1]} rows x "
        f"{res['image'][2]} columns)"
    )
    switches = [r for _, r in res["switches"]]
    median = _median(switches)
    table: list[tuple[str, dict | float, float | None]] = [
        ("server start (import + read parts)", res["server_ready"], None),
        ("page 1: load to Overview drawn", res["load"], GOALS["page 1: load to Overview drawn"]),
        ("page 1: load to advisor summary shown", res["advice"], None),
        ("heatmap first paint", res["first"], GOALS["heatmap first paint"]),
        ("metric switch (median)", median, GOALS["metric switch (median)"]),
        *((f"  switch to {m}", r, None) for m, r in res["switches"]),
        ("switch back to a cached metric", res["cached"], None),
        *(
            [("group expand (median)", _median(res["expands"]), GOALS["group expand (median)"])]
            if res["expands"]
            else []
        ),
        *((f"  expand {i + 1}", r, None) for i, r in enumerate(res["expands"])),
        *(
            [
                ("live lag (median)", _median(res["live"]), GOALS["live lag (median)"]),
                ("live lag (max)", _worst(res["live"]), None),
            ]
            if res["live"]
            else []
        ),
        ("page 2: load to Overview drawn", res["load2"], None),
        ("page 2: load to advisor summary shown", res["advice2"], None),
        ("page 2: heatmap first paint (warm)", res["first2"], None),
    ]
    cols = ("total", "paint", "first", "reply", "draw", "status")
    heads = ("total s", "image s", "1st reply", "reply s", "draw s", "status s", "goal s")
    print(f"{'measure':38s} " + " ".join(f"{h:>9s}" for h in heads) + "  met")
    for name, r, goal in table:
        r = r if isinstance(r, dict) else {"total": r}
        ok = "" if goal is None or r["total"] is None else ("yes" if r["total"] <= goal else "NO")
        cells = [_opt(r.get(c)) for c in cols] + [_opt(goal)]
        print(f"{name:38s} " + " ".join(f"{c:>9s}" for c in cells) + f"  {ok}")
    print(
        "total: from the browser event (click, selection) to the frame after the heatmap is "
        "painted showing it and its view finished; image: that first paint; 1st reply / reply: "
        "first / last change from the server applied in the browser (server work, transfer, "
        "decoding, and the browser's work on earlier changes); draw: total - reply; live lag: "
        "from the part's rename to the status showing its step (status) and to the first "
        "heatmap paint of new data after that (total)"
    )
    if rows:
        print(f"{'server-side step (in-process)':52s} {'s':>7s}")
        for name, secs in rows:
            print(f"{name:52s} {secs:7.2f}")
    if res["errors"] or res["remote"]:
        print(f"browser console errors: {res['errors'][:5]}; remote requests: {res['remote'][:5]}")


if __name__ == "__main__":
    main()
