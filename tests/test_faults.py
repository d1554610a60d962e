"""Faults that used to hide (issue 38, item 6), each as a careful user meets it: a write
that fails half-way (a file size limit, as a full disk), a part emptied under the CI
gate, a deleted or corrupt op table, a folder that cannot be written, an append of
another graph, a step that returns a string, a page whose Host header names another
server (DNS rebinding), a link under the served folder to a run outside it."""

from __future__ import annotations

import dataclasses
import functools
import http.client
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd
import pytest
from conftest import cli_process, served_dashboard

import scalescope as ss
from scalescope.cli import main
from scalescope.store import layout as L

HERE = Path(__file__).parent
WRITER = HERE / "fault_writer.py"


def _write(run: Path, *extra: str) -> list[str]:
    """Record the fault writer's run; its output lines."""
    cmd = [sys.executable, str(WRITER), str(run), "--steps", "20", "--flush-steps", "5", *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.splitlines()


@pytest.fixture(scope="module")
def intact(tmp_path_factory) -> Path:
    """An intact run of 20 steps in 4 parts."""
    run = tmp_path_factory.mktemp("intact") / "run"
    assert _write(run)[-1] == "closed"
    return run


@pytest.fixture
def copy(intact, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(intact, out)
    return out


def _report(run: Path, *args: str) -> tuple[int, str, str]:
    done = cli_process("report", str(run), *args)
    return done.returncode, done.stdout, done.stderr


@pytest.fixture(scope="module")
def damaged(tmp_path_factory) -> tuple[Path, list[str]]:
    """A run whose writes fail from step 10 on (parts ~13 kB over a 4 kB file size
    limit; run.json, ~3 kB, still fits), and the writer's output lines."""
    run = tmp_path_factory.mktemp("damaged") / "run"
    return run, _write(run, "--fsize", "4000", "--after", "10")


def test_a_failed_write_marks_the_run_damaged_and_the_gate_fails_closed(damaged, tmp_path):
    run, out = damaged
    errors = [line for line in out if line.startswith(("error:", "close error:"))]
    found = re.search(r"writing (\S+) failed: File too large", errors[0] if errors else "")
    assert found, out
    part = Path(found.group(1))  # the first part after step 10: the error names it
    assert part.parent == run / L.STATS_DIR and not part.exists()  # nothing half-written
    assert all(f"{part} failed: File too large" in e for e in errors), errors
    # the loop and close() both get the documented RunWriteError, an OSError too
    assert all(e.split(": ")[1] == "RunWriteError+OSError" for e in errors), errors
    meta = json.loads((run / L.RUN_FILE).read_text())
    assert meta["status"] == "damaged", meta["status"]
    (note,) = meta["damage"]
    assert str(part) in note and "lost the statistics of" in note and "(10.." in note, note
    reader = ss.open_run(run)
    assert reader.status == "damaged" and reader.damage == [note]
    assert list(reader.steps) == list(range(10))  # what was written reads as before
    # the gate: a damaged run fails it, whatever the rules say, unless allowed
    code, _, err = _report(run, "--fail-on", "findings>1000", "--json", str(tmp_path / "j"))
    assert code == 1 and "damaged" in err and "--allow-damaged" in err, err
    doc = json.loads((tmp_path / "j").read_text())
    assert doc["run"]["status"] == "damaged" and doc["run"]["damage"] == [note]
    intact = [r for r in doc["fail_on"] if r["rule"] == "intact run"]
    assert intact and intact[0]["tripped"]
    code, _, _ = _report(run, "--fail-on", "findings>1000", "--allow-damaged")
    assert code == 0


def test_an_emptied_part_fails_the_gate_unless_damage_is_allowed(copy, tmp_path):
    parts = L.list_parts(copy / L.STATS_DIR)
    assert len(parts) == 4
    parts[2].write_bytes(b"")  # emptied: a copy cut short, a disk that lost it
    code, _, err = _report(copy, "--fail-on", "findings>1000", "--json", str(tmp_path / "j"))
    assert code == 1 and parts[2].name in err, err
    doc = json.loads((tmp_path / "j").read_text())
    skipped = doc["run"]["skipped_parts"]
    assert [Path(s["path"]).name for s in skipped] == [parts[2].name]
    assert any(r["rule"] == "intact run" and r["tripped"] for r in doc["fail_on"])
    assert _report(copy, "--fail-on", "findings>1000", "--allow-damaged")[0] == 0
    # without a gate the report is written, and says what it could not read
    code, _, _ = _report(copy, "-o", str(tmp_path / "r.html"))
    html = (tmp_path / "r.html").read_text()
    assert code == 0 and "This run is damaged" in html and parts[2].name in html


@pytest.mark.parametrize("fault", ["deleted", "corrupt"])
def test_a_missing_or_corrupt_op_table_is_one_clear_error(copy, fault, capsys):
    ops = copy / L.OPS_FILE
    if fault == "deleted":
        ops.unlink()
    else:
        ops.write_bytes(b"PAR1 not really parquet")
    with pytest.raises(ss.RunError, match=str(ops)):
        ss.open_run(copy)
    assert main(["report", str(copy), "--json", str(copy / "j.json")]) == 2
    err = capsys.readouterr().err
    assert str(ops) in err and "cannot be read" in err and "Traceback" not in err
    assert not (copy / "j.json").exists()
    from scalescope.app.data import RunSet

    runs = RunSet(copy.parent)  # the dashboard lists it as unreadable, naming the file
    assert runs.names == [] and str(ops) in runs.broken["run"]


def test_a_folder_that_cannot_be_written_is_a_clear_error(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() == 0:  # root writes anywhere: refuse as a read-only mount would
        real_open = open

        def refuse(path, *args, **kwargs):
            if str(path).startswith(str(folder)):
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr("builtins.open", refuse)
        real_mkdir = Path.mkdir

        def refuse_mkdir(self, *args, **kwargs):
            if str(self).startswith(str(folder)):
                raise PermissionError(13, "Permission denied", str(self))
            return real_mkdir(self, *args, **kwargs)

        monkeypatch.setattr(Path, "mkdir", refuse_mkdir)
    else:
        folder.chmod(0o555)
    with pytest.raises(ss.RunWriteError, match=f"cannot record into {folder}.*Permission denied"):
        ss.Run(folder)
    with pytest.raises(OSError):  # still an OSError for code that catches those
        ss.Run(folder / "inner")
    argv = ["train", "mlp", "--steps", "1", "--run", str(folder / "r"), "--quiet"]
    assert main([*argv, "--hidden", "16", "--batch", "8"]) == 2
    err = capsys.readouterr().err
    assert "cannot record into" in err and "Permission denied" in err and "Traceback" not in err


def test_the_dashboard_says_what_a_damaged_run_lost(damaged):
    from scalescope.app.dashboard import Dashboard
    from scalescope.app.data import RunSet

    run, _ = damaged
    dash = Dashboard(RunSet(run), poll_ms=0)
    status = dash.status.object
    assert "ss-run-status'>damaged<" in status
    assert "this run is damaged" in status and "File too large" in status


def _bad_step(w):
    return "done"


@pytest.mark.parametrize("how", ["scalify", "instrument", "track"])
def test_a_step_returning_a_str_names_the_users_function(how, tmp_path):
    where = rf"_bad_step \({__file__}:\d+\) returned a str"
    with pytest.raises(TypeError, match=where):
        if how == "scalify":
            ss.scalify(_bad_step)(jnp.ones(3))
        elif how == "instrument":
            ss.instrument(_bad_step)(jnp.ones(3))
        else:
            with ss.Run(tmp_path / "r", every=1) as run:
                run.track(_bad_step)(jnp.ones(3))


def _sgd_with_function_leaf(model, x):
    """An Equinox-style step: the model holds its activation function as a leaf and the
    step returns the updated model, function and all (``eqx.apply_updates``)."""

    def loss(params):
        return jnp.sum(model["act"](x @ params) ** 2)

    g = jax.grad(loss)(model["w"])
    return {"act": model["act"], "w": model["w"] - 0.1 * g}, loss(model["w"])


@pytest.mark.parametrize("how", ["scalify", "instrument", "track", "emulate"])
def test_a_step_may_return_the_function_leaves_of_its_arguments(how, tmp_path):
    """Non-array leaves of the arguments are static; returned as they are (an Equinox
    model's activation function, in the model a step returns) they come back as they
    are, as under ``eqx.filter_jit``, instead of a TypeError. A str the step made is
    still one (above)."""
    model = {"act": jnp.tanh, "w": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)}
    x = jnp.linspace(0.5, 2.0, 8).reshape(2, 4)
    want, want_loss = _sgd_with_function_leaf(model, x)
    if how == "scalify":
        got, loss = ss.scalify(_sgd_with_function_leaf)(ss.as_scaled_array(model), x)
        got, loss = ss.asarray(got), ss.asarray(loss)
    elif how == "instrument":
        (got, loss), stats = ss.instrument(_sgd_with_function_leaf, scalify=False)(model, x)
        assert stats  # the step's values were recorded
    elif how == "emulate":
        policy = ss.Policy.from_dict({"fwd/**": "bf16"})
        got, loss = ss.emulate(_sgd_with_function_leaf, policy)(model, x)
    else:
        with ss.Run(tmp_path / "r", every=1) as run:
            step = run.track(_sgd_with_function_leaf, scalify=False)
            for _ in range(2):  # a recorded call, then the plain program's
                got, loss = step(model, x)
        assert len(ss.open_run(tmp_path / "r").stats()) > 0
    assert got["act"] is jnp.tanh
    tol = 1e-2 if how == "emulate" else 1e-6
    np.testing.assert_allclose(np.asarray(got["w"]), np.asarray(want["w"]), rtol=tol)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=tol)


def test_serve_skips_a_link_to_a_run_outside_its_folder(intact, tmp_path, capsys):
    from scalescope.app.data import RunSet

    served = tmp_path / "served"
    shutil.copytree(intact, served / "mine")
    (served / "elsewhere").symlink_to(intact.parent, target_is_directory=True)
    runs = RunSet(served)  # used to fail at start (relative_to) with a ValueError
    assert runs.names == ["mine"]
    assert err_once(capsys, f"not serving {served / 'elsewhere' / 'run'}")
    runs.rescan()  # known: not warned again
    assert "not serving" not in capsys.readouterr().err
    (served / "later").symlink_to(intact, target_is_directory=True)  # appears while serving
    assert runs.rescan() is False and runs.names == ["mine"]
    assert err_once(capsys, f"not serving {served / 'later'}")


def err_once(capsys, text: str) -> bool:
    return capsys.readouterr().err.count(text) == 1


def _request(port: int, host: str, path: str = "/", **headers: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest("GET", path, skip_host=True)
        conn.putheader("Host", host)
        for key, value in headers.items():
            conn.putheader(key.replace("_", "-"), value)
        conn.endheaders()
        return conn.getresponse().status
    finally:
        conn.close()


def test_serve_refuses_a_page_that_names_another_host(intact, tmp_path):
    """A DNS-rebinding page at evil.example (rebound to 127.0.0.1) sends Host and Origin
    evil.example: the page and the WebSocket are refused; this server's names pass."""
    with served_dashboard(intact) as (url, _):
        port = int(url.rsplit(":", 1)[1].strip("/"))
        status = _request(port, f"127.0.0.1:{port}")
        assert status == 200
        assert _request(port, f"localhost:{port}") == 200
        evil = f"evil.example:{port}"
        upgrade = {
            "Connection": "Upgrade",
            "Upgrade": "websocket",
            "Sec-WebSocket-Version": "13",
            "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
        }
        assert _request(port, evil) == 403
        assert _request(port, evil, "/ws", Origin=f"http://{evil}", **upgrade) == 403
        same = {"Sec-Fetch-Site": "same-origin"}  # what a browser sends for that page
        assert _request(port, evil, "/ws", Origin=f"http://{evil}", **same, **upgrade) == 403
        mine = f"127.0.0.1:{port}"
        assert _request(port, mine, "/ws", Origin=f"http://{mine}", **upgrade) == 101


# -- found by a careful-user sweep (2026-11-30) -------------------------------------------


def test_a_part_deleted_from_a_closed_run_is_damage_the_gate_sees(copy, tmp_path):
    """run.json keeps how many parts the run wrote: one deleted later is named as lost
    (it used to read as an intact run that began at step 5)."""
    parts = L.list_parts(copy / L.STATS_DIR)
    assert len(parts) == 4
    parts[0].unlink()
    reader = ss.open_run(copy)
    assert reader.status == "damaged"
    (note,) = reader.damage
    assert "1 of the 4 stats/ parts" in note and "lost" in note, note
    code, _, err = _report(copy, "--fail-on", "findings>1000")
    assert code == 1 and "1 of the 4 stats/ parts" in err, err
    assert _report(copy, "--fail-on", "findings>1000", "--allow-damaged")[0] == 0


def _refuse(constant: str) -> None:
    raise AssertionError(f"{constant} in a JSON file: not strict JSON")


def test_a_verification_with_undefined_numbers_is_strict_json_and_reported(copy, tmp_path):
    """A verification of two steps has no step-time ratio and, without a control, no
    noise floor: null on disk, NaN in memory, null in the report's JSON (the report
    used to crash on it, after writing its HTML)."""
    from scalescope.verification import Verification

    record = Verification(
        policy=[["fwd/**", "bf16"]], steps=2, tail=1, loss_plain=[1.0, 0.9],
        loss_policy=[1.0, 0.9], gap=0.0, threshold=0.005, verdict="safe", step_ratio=math.nan,
    ).to_dict()  # fmt: skip
    path = L.write_verification(copy, record)
    on_disk = json.loads(path.read_text(), parse_constant=_refuse)
    assert on_disk["noise"] is None and on_disk["step_ratio"] is None
    (back,) = ss.open_run(copy).verifications()
    assert math.isnan(back["noise"]) and math.isnan(back["step_ratio"]) and back["gap"] == 0.0
    code, _, err = _report(copy, "-o", str(tmp_path / "r.html"), "--json", str(tmp_path / "j"))
    assert code == 0, err
    doc = json.loads((tmp_path / "j").read_text(), parse_constant=_refuse)
    (shown,) = doc["verified"]
    assert shown["noise"] is None and shown["step_ratio"] is None and shown["gap"] == 0.0


def test_verify_refuses_bad_input_with_exit_2_and_no_traceback(copy, tmp_path, capsys):
    policy = tmp_path / "p.json"
    policy.write_text(json.dumps({"fwd/**": "bf16"}))
    assert main(["verify", str(tmp_path / "missing"), "--policy", str(policy)]) == 2
    (tmp_path / "afile").write_text("")
    under_a_file = str(tmp_path / "afile" / "p.json")
    assert main(["verify", str(copy), "--policy", str(policy), "--write-policy", under_a_file]) == 2
    err = capsys.readouterr().err
    assert "no run at" in err and "Not a directory" in err and "Traceback" not in err
    for threshold in ("nan", "-1", "0", "inf"):
        with pytest.raises(SystemExit) as exit_:
            main(["verify", str(copy), "--policy", str(policy), "--threshold", threshold])
        assert exit_.value.code == 2
        assert "--threshold must be a positive relative loss gap" in capsys.readouterr().err


def test_the_report_blames_audit_only_for_what_audit_asked(copy, tmp_path, capsys):
    out = str(tmp_path / "j.json")
    assert main(["report", str(copy), "--json", out, "--audit", "bogus"]) == 2
    err = capsys.readouterr().err
    assert "--audit: format 'bogus' is not audited" in err and "audit: audit" not in err
    part = L.list_parts(copy / L.STATS_DIR)[1]
    frame = pd.read_parquet(part)
    frame.loc[frame.index[:3], "op"] = 99999  # statistics of an op the table lacks
    frame.to_parquet(part)
    assert main(["report", str(copy), "--json", out]) == 2
    err = capsys.readouterr().err
    assert "cannot be analysed" in err and "99999" in err and "--audit" not in err, err


def test_the_report_names_a_folder_that_is_a_file_and_leaves_nothing_half_written(
    copy, tmp_path, capsys
):
    (tmp_path / "afile").write_text("")
    html = tmp_path / "afile" / "r.html"
    assert main(["report", str(copy), "-o", str(html)]) == 2
    assert f"{tmp_path / 'afile'} is a file, not a folder" in capsys.readouterr().err
    out = tmp_path / "out"
    assert main(["report", str(copy), "-o", str(out / "r.html"), "--json", str(out / "j")]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["j", "r.html"]  # no temporary left


def test_serve_lists_a_run_with_unreadable_metadata_with_the_reason(copy):
    from scalescope.app.data import RunSet

    meta = copy / L.RUN_FILE
    meta.write_text(meta.read_text()[:40])  # cut short
    runs = RunSet(copy.parent)  # it used to say "no runs under" the folder
    assert runs.names == [] and "unreadable run metadata" in runs.broken["run"]


def test_a_step_branching_on_a_traced_argument_is_told_which_and_what_to_do(tmp_path):
    """Flax's lm1b/wmt train_step branches on ``config.decode`` (a flax.struct dataclass
    of Python values, static under their ``jax.jit(static_argnums=...)``). scalescope
    traces Python numbers as jax.jit does: the error names the user's argument and the
    way out, not the interpreter's ``flat_fn``/``dyn_vals[N]``."""
    from flax import struct

    @struct.dataclass
    class Config:
        decode: bool = False
        scale: float = 2.0

    def step(params, batch, config):
        if config.decode:
            return params
        return jax.tree.map(lambda p: p - 0.1 * jnp.mean(batch) * config.scale, params)

    params, batch = {"w": jnp.ones((4,))}, jnp.ones((2, 4))
    said = r"step \(.*test_faults.py:\d+\): its trace depends on the value of args\[2\]\.decode"
    with ss.Run(tmp_path / "r") as run:
        for scalify in (False, True):
            with pytest.raises(TypeError, match=said) as info:
                run.track(step, scalify=scalify)(params, batch, Config())
            assert "functools.partial(step, config=config)" in str(info.value)
            assert "flat_fn" not in str(info.value)
            assert "static_argnums" in str(info.value)
    # bound, as the message says, it tracks; or named static, by position or keyword
    with ss.Run(tmp_path / "bound") as run:
        out = run.track(functools.partial(step, config=Config()), scalify=False)(params, batch)
    np.testing.assert_allclose(out["w"], 0.8, rtol=1e-6)
    with ss.Run(tmp_path / "static", every=1) as run:
        tracked = run.track(step, scalify=False, static_argnums=2)
        out = tracked(params, batch, Config())
        out = tracked(out, batch, config=Config())
    np.testing.assert_allclose(out["w"], 0.6, rtol=1e-6)
    assert list(ss.open_run(tmp_path / "static").steps) == [0, 1]


def test_static_argnums_as_jax_jit_takes_them(tmp_path):
    """``run.track(step, static_argnums=2)``: a Python int the step loops over (traced,
    it cannot be), and a step already jitted with that static argument (JAX's error was
    about hashing a tracer): each new value traces again, and the outputs are those of
    ``jax.jit(step, static_argnums=2)``. Bad positions and unhashable values are told."""

    def step(w, x, n_micro):
        for _ in range(n_micro):
            w = w - 0.1 * jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)
        return w, jnp.mean(w)

    jitted = jax.jit(step, static_argnums=2)
    x = jnp.ones((2, 4)) * 0.5
    with ss.Run(tmp_path / "bad") as run:
        with pytest.raises(TypeError, match=r"a jax.jit inside it takes an argument as static"):
            run.track(jitted, scalify=False)(jnp.ones((4, 4)), x, 2)
        with pytest.raises(ValueError, match=r"step takes 3 argument.*no argument 3"):
            run.track(step, static_argnums=3)
        with pytest.raises(ValueError, match=r"in both donate_argnums and static_argnums"):
            run.track(step, static_argnums=(0, 2), donate_argnums=0)
        with pytest.raises(TypeError, match=r"args\[2\] is a list, which is not hashable"):
            run.track(step, scalify=False, static_argnums=2)(jnp.ones((4, 4)), x, [2])

        @dataclasses.dataclass(frozen=True)
        class Config:
            n: list

        with pytest.raises(TypeError, match=r"is a Config, which is not hashable \(unhashable"):
            run.track(step, scalify=False, static_argnums=2)(jnp.ones((4, 4)), x, Config([2]))
    for i, fn in enumerate((step, jitted)):
        w = want = jnp.ones((4, 4))
        with ss.Run(tmp_path / f"r{i}", every=1) as run:
            tracked = run.track(fn, scalify=False, static_argnums=2)
            for n in (2, 2, 1):
                w, m = tracked(w, x, n)
                want, m_want = jitted(want, x, n)
                np.testing.assert_array_equal(m, m_want)
        assert list(ss.open_run(tmp_path / f"r{i}").steps) == [0, 1]  # n=1: another graph

    # by name, or counted from the last positional parameter, as jax.jit takes them
    def step_kw(w, x, *, n_micro):
        return step(w, x, n_micro)

    for name, fn, kw in (
        ("names", step, {"static_argnames": "n_micro"}),
        ("kwonly", step_kw, {"static_argnames": ("n_micro",)}),
        ("negative", step, {"static_argnums": -1}),
    ):
        w = want = jnp.ones((4, 4))
        with ss.Run(tmp_path / name, every=1) as run:
            tracked = run.track(fn, scalify=False, **kw)
            for n in (2, 2):
                w, m = tracked(w, x, n_micro=n)
                want, m_want = jitted(want, x, n)
                np.testing.assert_array_equal(m, m_want)
        assert list(ss.open_run(tmp_path / name).steps) == [0, 1], name
    with ss.Run(tmp_path / "bad2") as run:
        with pytest.raises(ValueError, match=r"static_argnames names 'steps', which step has no"):
            run.track(step, static_argnames="steps")
        with pytest.raises(ValueError, match=r"takes 3 argument.*no argument -4"):
            run.track(step, static_argnums=-4)
