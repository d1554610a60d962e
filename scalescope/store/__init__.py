"""The run store: `Run` records a training run into a directory of Parquet parts;
`open_run` and `list_runs` read it back (see docs/store.md)."""

from .flight import NonFiniteStep, Triggers
from .layout import NotARunError, RunError, RunMismatchError, RunWriteError
from .reader import RunReader, RunWarning, list_runs, open_run
from .writer import Run, Tracked

__all__ = [
    "NonFiniteStep",
    "NotARunError",
    "Run",
    "RunError",
    "RunMismatchError",
    "RunWriteError",
    "RunReader",
    "RunWarning",
    "Tracked",
    "Triggers",
    "list_runs",
    "open_run",
]
