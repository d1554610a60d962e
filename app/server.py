"""Serving the dashboard: one Panel server, one `Dashboard` per browser session.

Bokeh and Panel's JavaScript and CSS come from this server (no CDN, no web font), and
the server binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import panel as pn

from .dashboard import POLL_MS, Dashboard
from .data import RunSet


def _page(runs: RunSet, poll_ms: int):
    def page() -> pn.viewable.Viewable:
        return Dashboard(runs, poll_ms=poll_ms).layout

    return page


def serve(
    path: str | os.PathLike,
    *,
    port: int = 5006,
    address: str = "127.0.0.1",
    show: bool = False,
    threaded: bool = False,
    poll_ms: int = POLL_MS,
    **kwargs: Any,
):
    """Serve the dashboard on the runs under ``path`` at ``http://address:port/``.

    Raises `ServeError` (before binding anything) when ``path`` is missing, a file or holds
    no run. ``threaded=True`` returns the running server thread (``.stop()`` ends it);
    otherwise this blocks until interrupted.
    """
    runs = RunSet(Path(path))
    runs.warm()  # the advisor of the run a page opens first starts reading now
    os.environ.pop("BOKEH_RESOURCES", None)  # "cdn" there would need the network
    pn.extension("tabulator", inline=False)
    origins = [f"{address}:{port}"]
    if address in ("127.0.0.1", "localhost"):
        origins += [f"localhost:{port}", f"127.0.0.1:{port}"]
    return pn.serve(
        {"/": _page(runs, poll_ms)},
        port=port,
        address=address,
        show=show,
        threaded=threaded,
        title="scalescope",
        websocket_origin=origins,
        **kwargs,
    )
