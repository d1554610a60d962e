"""Several JAX processes record one run: two processes on this machine
(`jax.distributed` with a coordinator on 127.0.0.1, CPU collectives) train a
data-parallel MLP over a global mesh and record every step into one directory; the run
reads back as one run whose statistics equal a single-process run on the same global
batch. Also the pure pieces: the processes' claims, merged scalars, clear errors."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pandas as pd
import pytest
from conftest import free_port
from conftest import xla_flags_with as _flags

import scalescope as ss
from scalescope.store import layout as L
from scalescope.store import processes as W
from scalescope.store.reader import one_value_per_step

HERE = Path(__file__).parent
SCRIPT = HERE / "multiprocess_script.py"
STEPS = 3
TIMEOUT_S = 240
#: Statistics that count elements: equal exactly; the others to float32 rounding (the
#: data-parallel gradient is summed over two devices in another order).
EXACT = ("count",)


#: CPU devices per process: the global mesh has 2 x 2 devices, two on each process.
DEVICES = 2


def _env() -> dict[str, str]:
    """The subprocesses' environment: CPU only, DEVICES devices each, this checkout's
    scalescope first on the path."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = _flags(f"--xla_force_host_platform_device_count={DEVICES}")
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    return env


def _run_all(
    commands: dict[str, list[str]], logs: Path, *, kill_on_failure: bool = True
) -> dict[str, tuple[int, str]]:
    """Run the commands at once and wait for all, at most TIMEOUT_S: ``name -> (exit
    status, output)``. Whatever is still running at the deadline is killed (status -9),
    and with ``kill_on_failure`` so is the rest as soon as one fails (a process left
    alone would wait for its peer in a collective)."""
    procs, files = {}, {}
    for name, argv in commands.items():
        files[name] = open(logs / f"{name}.log", "w+")  # noqa: SIM115 - closed below
        procs[name] = subprocess.Popen(
            [sys.executable, *argv], stdout=files[name], stderr=subprocess.STDOUT, env=_env()
        )
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            codes = {n: p.poll() for n, p in procs.items()}
            if all(c is not None for c in codes.values()):
                break
            if kill_on_failure and any(c not in (None, 0) for c in codes.values()):
                break
            time.sleep(0.2)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()
    out = {}
    for name, f in files.items():
        f.seek(0)
        out[name] = (procs[name].returncode, f.read())
        f.close()
    return out


def _report(results: dict[str, tuple[int, str]]) -> str:
    return "\n".join(f"--- {n} (exit {c}) ---\n{text[-3000:]}" for n, (c, text) in results.items())


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> tuple[Path, Path, float]:
    """A 2-process run and the single-process reference run of the same steps on the same
    global batch (recorded at once: 3 processes), and the wall time it took."""
    root = tmp_path_factory.mktemp("multiprocess")
    run, single, port = root / "runs" / "dp", root / "runs" / "single", free_port()
    commands = {
        f"p{k}": [str(SCRIPT), str(run), str(STEPS), str(k), "2", str(port)] for k in (0, 1)
    }
    commands["single"] = [str(SCRIPT), str(single), str(STEPS), "single"]
    t0 = time.monotonic()
    results = _run_all(commands, root)
    seconds = time.monotonic() - t0
    assert all(code == 0 for code, _ in results.values()), _report(results)
    assert "process 1 done" in results["p1"][1], _report(results)
    return run, single, seconds


def test_two_processes_record_one_run(recorded):
    run, _, seconds = recorded
    print(f"2 processes + reference, {STEPS} steps: {seconds:.1f} s")
    assert ss.list_runs(run.parent) == sorted([run, recorded[1]])
    reader = ss.open_run(run)
    assert reader.status == "closed"
    assert reader.meta["device"]["process_count"] == 2
    assert reader.meta["device"]["device_count"] == 2 * DEVICES
    assert reader.meta["sessions"][-1]["processes"] == 2
    assert reader.processes == [0, 1]
    assert reader.steps.tolist() == list(range(STEPS))
    # Statistics are global: process 0 writes them; every process writes its scalars.
    stats = {L.parse_part_name(p.name) for p in L.list_parts(run / L.STATS_DIR)}
    scalars = {L.parse_part_name(p.name) for p in L.list_parts(run / L.SCALARS_DIR)}
    assert stats and {proc for _, proc in stats} == {0}, stats
    assert {proc for _, proc in scalars} == {0, 1}, scalars
    assert (run / ".writer-p0.lock").is_file() and (run / ".writer-p1.lock").is_file()
    assert (run / L.closed_marker_name(1)).is_file() and not (run / ".closed-p0").exists()
    assert not [p for p in run.rglob(".*.tmp")]  # no half-written file left
    # One row per (step, op, iteration): nothing counted twice, whatever the process filter.
    everything = reader.stats(wide=True, process=None)
    assert len(everything) == len(reader.stats(wide=True)) > 0
    assert not everything.duplicated(["step", "op", "iteration"]).any()


def test_statistics_equal_a_single_process_run_of_the_global_batch(recorded):
    run, single, _ = recorded
    a, b = ss.open_run(run), ss.open_run(single)
    keys = ["name", "pass", "primitive", "shape", "dtype", "stats_op", "row_start", "n_rows"]
    pd.testing.assert_frame_equal(a.ops[keys], b.ops[keys])
    assert a.ops["shape"].map(len).max() == 2 and (8, 16) in set(a.ops["shape"])  # global shapes
    sa, sb = a.stats(wide=True), b.stats(wide=True)
    ident = ["step", "op", "iteration"]
    pd.testing.assert_frame_equal(sa[ident], sb[ident])
    assert set(a.stat_names) == set(b.stat_names)
    rms = sb["rms"].to_numpy(np.float64)
    for name in a.stat_names:
        x, y = sa[name].to_numpy(np.float64), sb[name].to_numpy(np.float64)
        if name in EXACT:
            np.testing.assert_array_equal(x, y, err_msg=name)
        elif name == "mean":  # cancels: float32 rounding relative to the value's RMS
            assert (np.abs(x - y) <= 1e-5 * rms).all(), name
        elif name in ("absmin", "dynamic_range"):
            # The smallest magnitude is often a gradient element that cancels: summed in
            # another order it moves by float32 rounding of its terms (the value's RMS),
            # not of itself, and the dynamic range (log2 absmax - log2 absmin) with it.
            amin = sb["absmin"].to_numpy(np.float64)
            with np.errstate(divide="ignore", invalid="ignore"):
                moved = 1e-5 * np.maximum(amin, rms)
                tol = moved if name == "absmin" else np.log2(1 + moved / amin) + 1e-5 * np.abs(y)
            same = (x == y) | (np.isnan(x) & np.isnan(y)) | (np.abs(x - y) <= tol)
            assert same.all(), (name, x[~same], y[~same])
        elif name.startswith("snr_"):
            # Gradients summed over the devices in another order differ in their last
            # bits, which moves their rounding error: ~1e-3 dB on 2 x 2 devices.
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=0.01, err_msg=name)
        else:
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=0, err_msg=name)
    # Exponent histograms straight from the parts (the Parquet layout is the interface):
    # same totals; an element may move one bin if the other summation order moves it
    # across a power of two.
    cols = L.hist_column_names(len(a.hist_columns))

    def hist(path: Path) -> np.ndarray:
        parts = L.list_parts(path / L.STATS_DIR)
        frame = pd.concat([pd.read_parquet(p) for p in parts]).sort_values(ident)
        return frame[cols].to_numpy(np.int64)

    ha, hb = hist(run), hist(single)
    np.testing.assert_array_equal(ha.sum(axis=1), hb.sum(axis=1))
    np.testing.assert_array_equal(ha.sum(axis=1), sa["count"].to_numpy())
    assert (np.abs(ha - hb).sum(axis=1) <= 2).all()


def test_an_incident_names_the_device_and_process_of_the_first_nonfinite_value(recorded):
    """Issue 38 item 5: both processes replay the overflowing step; each incident names
    the one device (of process 1) whose rows hold the first non-finite value."""
    run, _, _ = recorded
    frame = ss.open_run(run.parent.parent / "incident" / "dp").incidents()
    assert sorted(frame["process"]) == [0, 1], frame
    for _, row in frame.iterrows():
        assert row["trigger"] == "nonfinite" and row["step"] == 0, row
        assert [d["process"] for d in row["devices"]] == [1], row["devices"]
        assert row["devices"][0]["nonfinite"] >= 1
        assert f"(process 1) of {2 * DEVICES}" in row["detail"], row["detail"]


def test_loss_of_both_processes_reads_as_one_curve(recorded):
    run, single, _ = recorded
    a, b = ss.open_run(run), ss.open_run(single)
    assert list(a.scalars.columns) == ["loss"] and a.scalars.index.tolist() == list(range(STEPS))
    np.testing.assert_allclose(a.scalars["loss"], b.scalars["loss"], rtol=1e-5)
    rows = a.scalar_rows()
    assert sorted(rows.groupby("process").size().items()) == [(0, STEPS), (1, STEPS)]
    # Both processes logged the global (replicated) loss: the same numbers.
    by_process = rows.pivot(index="step", columns="process", values="value")
    np.testing.assert_array_equal(by_process[0], by_process[1])
    assert a.scalar_rows(process=1)["process"].eq(1).all()


def test_scale_graph_of_sharded_arrays_equals_the_single_process_one(recorded):
    """`Run.scale_graph` on arrays sharded over both processes: RMS are reduced on
    device, process 0 writes the one file, and it equals the single-process graph."""
    run, single, _ = recorded
    files = sorted((run / L.SCALE_GRAPH_DIR).iterdir())
    assert [f.name for f in files] == [L.scale_graph_name(STEPS)]
    a, b = ss.open_run(run).scale_graph(STEPS), ss.open_run(single).scale_graph(STEPS)
    assert len(a) > 0 and a["fwd_log2_rms"].notna().sum() > len(a) // 2
    pd.testing.assert_frame_equal(a[["name", "shape"]], b[["name", "shape"]])
    for col in ("fwd_log2_rms", "grad_log2_rms"):
        np.testing.assert_allclose(a[col], b[col], atol=1e-5, err_msg=col)


def test_a_run_reads_closed_only_once_every_process_closed(tmp_path):
    """Process 0 marks run.json closed when it closes; the run reads ``recording`` until
    the other processes' markers say their last parts are on disk too."""
    with ss.Run(tmp_path / "run", every=1) as run:
        run.log(0, loss=1.0)
    meta = L.read_metadata(tmp_path / "run")
    meta["sessions"][-1]["processes"] = 2  # as process 0 of a two-process run leaves it
    L.write_json_atomic(tmp_path / "run" / L.RUN_FILE, meta)
    assert ss.open_run(tmp_path / "run").status == "recording"
    L.write_json_atomic(tmp_path / "run" / L.closed_marker_name(1), {"process": 1})
    assert ss.open_run(tmp_path / "run").status == "closed"


def test_dashboard_data_shows_one_run(recorded):
    from scalescope.app.data import RunData

    run, _, _ = recorded
    data = RunData(run)
    reader = ss.open_run(run)
    assert len(data.stats) == len(reader.stats(wide=True, process=None))
    assert not data.stats.duplicated(["step", "op", "iteration"]).any()
    assert data.scalars.index.tolist() == list(range(STEPS))
    assert data.steps.tolist() == list(range(STEPS))


def test_a_wrong_process_claim_fails_in_every_process(tmp_path):
    """Process 1 claiming process 0's index: both processes stop with the same error
    (one collective checks the claims) before either writes anything."""
    run, port = tmp_path / "run", free_port()
    commands = {f"p{k}": [str(SCRIPT), str(run), "1", str(k), "2", str(port), "0"] for k in (0, 1)}
    results = _run_all(commands, tmp_path, kill_on_failure=False)
    for code, text in results.values():
        assert code not in (0, -9), _report(results)
        assert "must record as processes 0..1" in text, _report(results)
        assert "JAX process 1 as 0" in text, _report(results)
    assert not run.exists() or not any((run / L.STATS_DIR).glob("*.parquet"))


# ---------------------------------------------------------------------------------------
# In this process: the pure pieces, and several writers simulated with process_index=


def test_agreed_start_checks_claims_and_start_steps():
    rows = np.array([[0, 4, -1], [1, -1, -1]])
    assert W.agreed_start(rows) == 5  # one past the last step process 0 found
    assert W.agreed_start(np.array([[0, -1, -1], [1, -1, -1]])) == 0
    assert W.agreed_start(np.array([[0, 4, 7], [1, -1, 7]])) == 7
    with pytest.raises(ss.RunError, match=r"JAX process 1 as 0"):
        W.agreed_start(np.array([[0, -1, -1], [0, -1, -1]]))
    with pytest.raises(ss.RunError, match=r"processes 0\.\.1.*JAX process 1 as 2"):
        W.agreed_start(np.array([[0, -1, -1], [2, -1, -1]]))
    with pytest.raises(ss.RunError, match="different start_step"):
        W.agreed_start(np.array([[0, -1, 3], [1, -1, -1]]))


def test_scalars_of_several_processes_give_one_value_per_step():
    long = pd.DataFrame(
        {
            "step": [0, 0, 1, 1, 1, 2],
            "name": ["loss"] * 6,
            "value": [1.0, 1.5, 2.0, 9.0, np.nan, 3.0],
            "process": [1, 0, 0, 1, 0, 1],
        }
    )
    wide = one_value_per_step(long)
    assert wide.index.tolist() == [0, 1, 2]
    # Step 0: process 0's; step 1: process 0's last (NaN kept); step 2: only process 1.
    assert wide.loc[0, "loss"] == 1.5 and np.isnan(wide.loc[1, "loss"])
    assert wide.loc[2, "loss"] == 3.0
    assert one_value_per_step(long.iloc[:0]).empty


def _step(w, x):
    loss, g = jax.value_and_grad(lambda w: (x @ w).var())(w)
    return w - 0.1 * g, loss


def test_process_one_may_open_the_run_first(tmp_path):
    """Process 1 creating the directory before process 0 writes run.json."""
    path = tmp_path / "r"
    w, x = np.ones((4, 3), np.float32), np.arange(8, dtype=np.float32).reshape(2, 4)
    p1 = ss.Run(path, process_index=1, flush_steps=1)
    t1 = p1.track(_step, scalify=False)
    t1(w, x)
    p1.log(0, loss=2.0)
    p1.flush()
    with pytest.raises(ss.NotARunError):  # not a run until process 0 writes run.json
        ss.open_run(path)
    p0 = ss.Run(path, process_index=0, flush_steps=1, start_step=0)
    t0 = p0.track(_step, scalify=False)
    t0(w, x)
    p0.log(0, loss=1.0)
    p0.close()
    p1.close()
    reader = ss.open_run(path)
    assert reader.processes == [0, 1] and reader.status == "closed"
    assert reader.scalars["loss"].tolist() == [1.0]  # process 0's value
    # Local (fully addressable) statistics: each process writes its own rows.
    assert len(reader.stats("rms", process=1)) == len(reader.stats("rms")) > 0


def test_bad_process_index_and_budget_with_several_processes(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="process_index must be an integer >= 0"):
        ss.Run(tmp_path / "a", process_index=-1)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match="budget= needs one JAX process"):
        ss.Run(tmp_path / "b", budget=0.05)
    assert not (tmp_path / "b").exists()
