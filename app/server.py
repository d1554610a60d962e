"""Serving the dashboard: one Panel server, one `Dashboard` per browser session.

Bokeh and Panel's JavaScript and CSS come from this server (no CDN, no web font), and
the server binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path
from typing import Any

import panel as pn

from .dashboard import POLL_MS, Dashboard
from .data import RunSet, ServeError


def check_listen(address: str, port: int) -> None:
    """Raise `ServeError` when this process cannot listen on ``address:port`` (the port
    taken by another server, or an address that is not this machine's): the server
    itself binds in its own thread, where such an error would only print a traceback
    while the command announced a URL that belongs to someone else."""
    if port == 0:
        return  # any free port: nothing to check
    try:
        infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise ServeError(f"cannot listen on {address}:{port}: unknown address ({err})") from None
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server does
        try:
            sock.bind(sockaddr)
        except OSError as err:
            why = {
                errno.EADDRINUSE: "the port is in use (another server listens there)",
                errno.EADDRNOTAVAIL: "the address is not one of this machine's",
                errno.EACCES: "permission denied (ports below 1024 need privileges)",
            }.get(err.errno, err.strerror or str(err))
            raise ServeError(f"cannot listen on {address}:{port}: {why}") from None


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
    no run, and when ``address:port`` cannot be listened on (`check_listen`).
    ``threaded=True`` returns the running server thread (``.stop()`` ends it); otherwise
    this blocks until interrupted.
    """
    runs = RunSet(Path(path))
    check_listen(address, port)
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
