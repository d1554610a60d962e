"""The run store: `Run` records a training run into a directory of Parquet parts;
`open_run` and `list_runs` read it back (see docs/store.md)."""

from .layout import NotARunError, RunError, RunMismatchError
from .reader import RunReader, RunWarning, list_runs, open_run
from .writer import Run, Tracked

__all__ = [
    "NotARunError",
    "Run",
    "RunError",
    "RunMismatchError",
    "RunReader",
    "RunWarning",
    "Tracked",
    "list_runs",
    "open_run",
]
