"""The run directory: file names, metadata, atomic writes and the op-table schema.

A run is a directory::

    run.json                 metadata (format, versions, device, config, formats, bins, graph)
    ops.parquet              the op table, one row per op
    stats/part-NNNNNN.parquet    statistics, one row per (step, op row); process k > 0
                                 writes part-NNNNNN-pK.parquet (global statistics, the
                                 same in every process, are written by process 0 only)
    scalars/part-NNNNNN.parquet  logged scalars: step, name, value, process
    scale_graph/step-NNNNNNNNN.parquet  `Run.scale_graph`: each op's value and gradient
                                 log2 RMS at that step (`scalescope.scale_graph`)

Every file is written under a hidden temporary name in its final directory and renamed
into place, so a reader never sees half a file and a killed writer leaves at most a
stray temporary file (ignored by readers).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import socket
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

try:  # advisory locks (`Run`'s writer lock); absent on Windows
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None

FORMAT_NAME = "scalescope-run"
FORMAT_VERSION = 1
RUN_FILE = "run.json"
OPS_FILE = "ops.parquet"
STATS_DIR = "stats"
SCALARS_DIR = "scalars"
SCALE_GRAPH_DIR = "scale_graph"
SCALE_GRAPH_RE = re.compile(r"^step-(\d{9,})\.parquet$")
#: Outcomes of `scalescope verify` (one JSON file per policy and step count).
VERIFIED_DIR = "verified"
PART_RE = re.compile(r"^part-(\d{6,})(?:-p(\d+))?\.parquet$")

#: Leading columns of a stats part; then one column per statistic, then hist_00 ...
KEY_COLUMNS = ("step", "op", "iteration", "process")
SCALAR_COLUMNS = ("step", "name", "value", "process")
#: Scalars a run writes itself beside the logged ones: what a held format kept of each
#: update (`scalescope.store.updates`), named ``<prefix><op id>/<field>``; `Run.log`
#: refuses the prefix and `RunReader.scalars` leaves them out.
FIGURE_PREFIX = "scalescope.held_update/"
FIGURE_FIELDS = ("moved", "lost", "d2", "e2")


#: The flight recorder's health of every step (`flight.HEALTH_KEYS`: nonfinite, loss,
#: norm), written as scalars under this prefix: the step's own loss is the run's loss
#: curve where none is logged (`RunReader.scalar_rows`).
HEALTH_PREFIX = "scalescope.health/"


def is_figure(name: str) -> bool:
    """Whether a scalar name is one of the run's own figures: held updates
    (`FIGURE_PREFIX`) or a step's health (`HEALTH_PREFIX`); `Run.log` refuses them."""
    return str(name).startswith((FIGURE_PREFIX, HEALTH_PREFIX))


class RunError(Exception):
    """A run directory cannot be read or written as asked."""


class NotARunError(RunError):
    """The path exists but is not a scalescope run."""


class RunMismatchError(RunError):
    """Recording into an existing run whose graph or statistics differ."""


class RunWriteError(RunError, OSError):
    """A file of the run could not be written (disk full, file size limit, read-only
    folder, no permission): the message names the file and the system's reason. An
    `OSError` too, so ``except OSError`` still catches it."""

    def __init__(self, message: str, path: Path | None = None) -> None:
        super().__init__(message)
        self.path = path

    def __str__(self) -> str:
        return str(self.args[0])


def write_error(path: Path, err: OSError, doing: str = "writing") -> RunWriteError:
    """`RunWriteError` for an `OSError` met while ``doing`` ``path``."""
    reason = err.strerror or str(err) or type(err).__name__
    where = f" ({err.filename})" if err.filename and str(err.filename) != str(path) else ""
    return RunWriteError(f"{doing} {path} failed: {reason}{where}", path)


def part_name(seq: int, process: int) -> str:
    """File name of part ``seq`` written by JAX process ``process``."""
    return f"part-{seq:06d}.parquet" if process == 0 else f"part-{seq:06d}-p{process}.parquet"


def parse_part_name(name: str) -> tuple[int, int] | None:
    """``(seq, process)`` of a part file name, or None for anything else."""
    m = PART_RE.match(name)
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2) or 0)


#: Columns of `RunReader.incidents`.
INCIDENT_COLUMNS = (
    "step",
    "trigger",
    "op",
    "name",
    "source",
    "detail",
    "value",
    "formats",
    "devices",
    "process",
)


def incidents_name(process: int) -> str:
    """File of the flight recorder's incidents of JAX process ``process`` (a JSON list,
    rewritten whole at each incident)."""
    return "incidents.json" if process == 0 else f"incidents-p{int(process)}.json"


def read_incidents_file(path: Path) -> list[dict[str, Any]]:
    """The incidents in ``path``; `RunError` naming the file when it is not a JSON
    list of objects."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise RunError(f"{path}: unreadable incidents file ({err})") from err
    if not isinstance(data, list) or not all(isinstance(x, dict) for x in data):
        raise RunError(f"{path}: not a list of incidents")
    return data


def closed_marker_name(process: int) -> str:
    """File a writer of a multi-process run other than process 0 writes when it has
    closed (everything it recorded is on disk); process 0 marks ``run.json`` itself."""
    return f".closed-p{int(process)}"


def scale_graph_name(step: int) -> str:
    return f"step-{step:09d}.parquet"


def list_scale_graphs(run: Path) -> dict[int, Path]:
    """The recorded scale graphs of run ``run``: step -> file."""
    directory = run / SCALE_GRAPH_DIR
    if not directory.is_dir():
        return {}
    found = {}
    for entry in os.scandir(directory):
        m = SCALE_GRAPH_RE.match(entry.name)
        if m is not None:
            found[int(m.group(1))] = Path(entry.path)
    return dict(sorted(found.items()))


def verification_name(rules: list[list[str]], steps: int) -> str:
    """The file of a verification: one per (policy, steps), a rerun replaces it."""
    digest = hashlib.sha256(json.dumps([rules, steps]).encode()).hexdigest()[:12]
    return f"policy-{digest}-{steps}.json"


def write_verification(run: Path, record: dict[str, Any]) -> Path:
    """Keep a verification's outcome in run ``run`` (written whole or not at all)."""
    path = run / VERIFIED_DIR / verification_name(record["policy"], int(record["steps"]))
    path.parent.mkdir(exist_ok=True)
    write_json_atomic(path, _finite(record))
    return path


#: A verification's numbers that may be undefined (NaN in memory, null on disk).
_VERIFICATION_FLOATS = ("gap", "noise", "spread", "step_ratio", "threshold")


def _finite(obj: Any) -> Any:
    """``obj`` with every non-finite float made None: strict JSON, which other tools
    (jq, a browser's JSON.parse) read, where Python's NaN literal is not."""
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    if isinstance(obj, float | np.floating) and not math.isfinite(float(obj)):
        return None
    return obj


def read_verifications(run: Path) -> list[dict[str, Any]]:
    """The verifications kept in run ``run``, oldest first; unreadable files skipped
    with a warning naming them."""
    directory = run / VERIFIED_DIR
    if not directory.is_dir():
        return []
    out = []
    for path in sorted(directory.glob("policy-*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            warnings.warn(f"{path}: unreadable verification skipped ({err})", stacklevel=2)
            continue
        for key in _VERIFICATION_FLOATS:  # undefined: null on disk, NaN in memory
            if key in record and record[key] is None:
                record[key] = math.nan
        out.append(record)
    return sorted(out, key=lambda r: str(r.get("meta", {}).get("time", "")))


def list_parts(directory: Path) -> list[Path]:
    """Part files of a stats/ or scalars/ directory, in (seq, process) order."""
    if not directory.is_dir():
        return []
    found = []
    for entry in os.scandir(directory):
        key = parse_part_name(entry.name)
        if key is not None:
            found.append((key, Path(entry.path)))
    return [p for _, p in sorted(found)]


def hist_column_names(n: int) -> list[str]:
    return [f"hist_{i:02d}" for i in range(n)]


# ---------------------------------------------------------------------------------------
# Atomic writes


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_FILE_MODE = 0o666 & ~_umask()  # what open() would give; mkstemp makes files 0600


def _atomic(path: Path, write) -> None:
    """Write ``path`` through a temporary file in its folder, renamed over it once whole:
    a reader sees the old file or the new one, never half of one. An `OSError` on the way
    becomes a `RunWriteError` naming ``path``."""
    tmp = _staged(path, write)
    _replace(tmp, path)


def _staged(path: Path, write) -> str:
    """A temporary file beside ``path`` holding what ``write`` wrote, flushed to disk
    (removed again if anything fails); its name."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except RunWriteError:
        raise
    except OSError as err:
        raise write_error(path, err) from err
    try:
        os.fchmod(fd, _FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as err:
        _unlink_quietly(tmp)
        if isinstance(err, OSError) and not isinstance(err, RunWriteError):
            raise write_error(path, err) from err
        raise
    return tmp


def _replace(tmp: str, path: Path) -> None:
    try:
        os.replace(tmp, path)
    except OSError as err:
        _unlink_quietly(tmp)
        raise write_error(path, err) from err


def _unlink_quietly(tmp: str) -> None:
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """``data`` into ``path``, whole or not at all (a temporary file renamed over it)."""
    _atomic(path, lambda f: f.write(data))


def write_files_atomic(files: Sequence[tuple[Path, bytes]]) -> None:
    """Each ``(path, data)`` whole, and all of them or none: every file is written to a
    temporary name first, and renamed only once all are on disk (a full disk while
    writing the second leaves neither, not one without the other)."""
    staged: list[tuple[str, Path]] = []
    try:
        for path, data in files:
            staged.append((_staged(Path(path), lambda f, d=data: f.write(d)), Path(path)))
    except BaseException:
        for tmp, _ in staged:
            _unlink_quietly(tmp)
        raise
    for i, (tmp, path) in enumerate(staged):
        try:
            _replace(tmp, path)
        except BaseException:
            for rest, _ in staged[i + 1 :]:
                _unlink_quietly(rest)
            raise


def write_json_atomic(path: Path, obj: Any) -> None:
    data = (json.dumps(obj, indent=2, sort_keys=True, default=_json_default) + "\n").encode()
    _atomic(path, lambda f: f.write(data))


def write_parquet_atomic(path: Path, table: pa.Table) -> None:
    _atomic(path, lambda f: pq.write_table(table, f, compression="zstd"))


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    return repr(obj)


# ---------------------------------------------------------------------------------------
# The writer's lock


def lock_name(process: int) -> str:
    """The lock file a `Run` holds while process ``process`` records (its text: ``pid N
    on HOST``)."""
    return f".writer-p{process}.lock"


def abandoned_writer(path: Path, process: int = 0) -> str | None:
    """Who last recorded run ``path`` as process ``process`` and is gone without closing
    it (killed, out of memory): its lock's text. None when a writer holds the lock, when
    none left one, or when it ran on another host (its lock may not be visible here, as
    on a file system mounted with local locks), so a live run is never called abandoned.
    The lock is taken shared for an instant only; `Run` retries its own lock briefly."""
    if fcntl is None:  # pragma: no cover
        return None
    try:
        fd = os.open(Path(path) / lock_name(process), os.O_RDONLY)
    except OSError:
        return None
    try:
        holder = os.read(fd, 256).decode(errors="replace").strip()
        if not holder.endswith(f" on {socket.gethostname()}"):
            return None
        if holder.startswith(f"pid {os.getpid()} "):
            # this process: alive. (Where flock is emulated by process-wide POSIX locks,
            # as on NFS, taking it here would succeed and unlocking would free the writer's.)
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return None  # held: the writer is alive
        fcntl.flock(fd, fcntl.LOCK_UN)
        return holder
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------
# Metadata


def read_metadata(path: Path) -> dict[str, Any]:
    """The parsed ``run.json`` of run ``path``, with clear errors for anything else."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no run at {path}: the path does not exist")
    if not path.is_dir():
        raise NotARunError(f"{path} is a file, not a run directory")
    meta_path = path / RUN_FILE
    if not meta_path.is_file():
        children = [p.name for p in path.iterdir() if (p / RUN_FILE).is_file()][:5]
        hint = (
            f"; it holds runs ({', '.join(sorted(children))}...): open one of them, or use "
            "scalescope.list_runs()"
            if children
            else ""
        )
        raise NotARunError(f"{path} is not a scalescope run (no {RUN_FILE}){hint}")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as err:
        raise RunError(f"{meta_path}: unreadable run metadata ({err})") from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise NotARunError(f"{meta_path} is not scalescope run metadata (no format marker)")
    if int(meta.get("version", 0)) > FORMAT_VERSION:
        raise RunError(
            f"{meta_path}: run format version {meta['version']} is newer than this "
            f"scalescope reads ({FORMAT_VERSION}); upgrade scalescope"
        )
    return meta


def is_run(path: Path, *, unreadable: bool = False) -> bool:
    """Whether ``path`` holds a run's metadata; ``unreadable``: also when its
    ``run.json`` is scalescope's but cannot be read (truncated, too new), so that a
    view can list the run with the reason rather than pass over it."""
    try:
        read_metadata(path)
    except NotARunError:
        return False
    except RunError:
        return unreadable and (path / RUN_FILE).is_file()
    except OSError:
        return False
    return True


# ---------------------------------------------------------------------------------------
# Op table <-> Parquet


_OP_FIELDS = (
    "name",
    "pass",
    "primitive",
    "shape",
    "dtype",
    "scaled",
    "note",
    "stats_op",
    "row_start",
    "n_rows",
    "loop",
    "in_while",
    "in_cond",
)


def ops_frame(records: list[dict[str, Any]]) -> pd.DataFrame:
    """The op table as a DataFrame indexed by op id (shape and loop as lists)."""
    frame = pd.DataFrame.from_records(records)
    if frame.empty:
        frame = pd.DataFrame(columns=["op", *_OP_FIELDS, "source"])
    return frame.set_index("op")


#: The op table's columns of integer lists.
LIST_COLUMNS = ("shape", "loop", "operands", "inputs")


def ops_table(frame: pd.DataFrame) -> pa.Table:
    """The op table as Arrow, ``shape`` and ``loop`` as lists of int64 even when every
    list is empty (an untyped empty list would be Parquet's null type, which some
    engines reading ``ops.parquet`` directly, Spark among them, refuse)."""
    table = pa.Table.from_pandas(frame.reset_index(), preserve_index=False)
    for col in LIST_COLUMNS:
        if col in table.column_names and pa.types.is_list(table.schema.field(col).type):
            i = table.column_names.index(col)
            table = table.set_column(i, col, table.column(col).cast(pa.list_(pa.int64())))
    return table


def graph_fingerprint(records: list[dict[str, Any]], stat_names, hist_columns) -> str:
    """Identity of what a run records: ops (without source lines) and statistic columns.

    Two tracked functions with equal fingerprints produce stats parts that mean the same
    thing row for row, so one may append to the other's run.
    """
    body = [[rec[k] for k in _OP_FIELDS] for rec in records]
    blob = json.dumps([body, list(stat_names), list(hist_columns or [])], default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def first_difference(old: pd.DataFrame, new: pd.DataFrame) -> str:
    """A one-line description of the first op where two op tables differ."""
    if len(old) != len(new):
        head = f"{len(old)} ops recorded before, {len(new)} now"
    else:
        head = "same number of ops"
    for op in range(min(len(old), len(new))):
        a = [_norm(old.iloc[op][k]) for k in _OP_FIELDS]
        b = [_norm(new.iloc[op][k]) for k in _OP_FIELDS]
        if a != b:
            fields = ", ".join(
                f"{k} {x!r} -> {y!r}" for k, x, y in zip(_OP_FIELDS, a, b, strict=True) if x != y
            )
            return (
                f"{head}; op {op} was {_describe(old.iloc[op])}, now "
                f"{_describe(new.iloc[op])} ({fields})"
            )
    return head


def _norm(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    return v


def _describe(row: pd.Series) -> str:
    shape = "x".join(str(int(s)) for s in _norm(row["shape"])) or "scalar"
    name = str(row["name"])  # an input's name carries its pass already (input/x)
    label = name if name.startswith(f"{row['pass']}/") else f"{row['pass']}/{name}"
    return f"{label} [{shape} {row['dtype']}]"
