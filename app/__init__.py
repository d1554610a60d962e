"""The scalescope dashboard (Panel): `serve` a run or a folder of runs."""

from .dashboard import Dashboard
from .data import RunData, RunSet, ServeError
from .server import serve

__all__ = ["Dashboard", "RunData", "RunSet", "ServeError", "serve"]
