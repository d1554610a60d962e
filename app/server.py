"""Serving the dashboard: one Panel server, one `Dashboard` per browser session.

Bokeh and Panel's JavaScript and CSS come from this server (no CDN, no web font), and
the server binds 127.0.0.1 unless told otherwise. Every request must name this server
in its ``Host`` header (`allowed_hosts`): a page from elsewhere whose name was rebound to
this machine's address (DNS rebinding) gets 403, not the runs. The web server alone
would let such a page's WebSocket in, since its Origin equals its Host.
"""

from __future__ import annotations

import errno
import os
import socket
import uuid
from pathlib import Path
from typing import Any

import panel as pn
from panel.io.server import get_server
from panel.io.threads import StoppableThread
from tornado.ioloop import IOLoop
from tornado.web import RequestHandler

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


_LOOPBACK = ("127.0.0.1", "localhost", "[::1]")
_WILDCARD = ("0.0.0.0", "::", "")


def allowed_hosts(address: str, port: int) -> set[str]:
    """The ``Host`` header values (``name:port``, lower case) a request to this server may
    carry: the address it binds and, for a loopback address, the loopback names; for a
    wildcard address (every interface, asked for explicitly), this machine's name, full
    name and addresses too."""
    names = {address.lower()}
    if address in _LOOPBACK or address == "::1":
        names |= set(_LOOPBACK)
    if address in _WILDCARD:
        names = set(_LOOPBACK)
        host = socket.gethostname()
        names |= {host.lower(), socket.getfqdn().lower()}
        try:
            infos = socket.getaddrinfo(host, None)
        except OSError:
            infos = []
        for info in infos:
            ip = str(info[4][0])
            names.add(f"[{ip}]" if ":" in ip else ip)
    return {f"{n}:{port}" for n in names if n}


class _WrongHost(RequestHandler):
    """403 for a request whose Host header names another server."""

    def initialize(self, hosts: set[str]) -> None:
        self.hosts = hosts

    def prepare(self) -> None:
        self.set_status(403)
        self.finish(
            f"scalescope: Host {self.request.host!r} is not this server's "
            f"({', '.join(sorted(self.hosts))}); refused\n"
        )


def guard_hosts(app: Any, hosts: set[str]) -> None:
    """Route every request to tornado application ``app`` whose Host header is not one
    of ``hosts`` to a 403 (checked before any handler, the WebSocket's included)."""
    find = app.find_handler

    def find_handler(request: Any, **kwargs: Any) -> Any:
        if (request.host or "").lower() in hosts:
            return find(request, **kwargs)
        return app.get_handler_delegate(request, _WrongHost, {"hosts": hosts})

    app.find_handler = find_handler


def _run_guarded(panels: dict, address: str, **kwargs: Any) -> Any:
    """Build the Panel server, guard its Host header, start it and run its loop."""
    server = get_server(panels, address=address, start=False, **kwargs)
    guard_hosts(server._tornado, allowed_hosts(address, server.port))  # Bokeh's tornado app
    server.start()
    try:
        server.io_loop.start()
    except RuntimeError:  # the loop already runs (a notebook): it serves from there
        pass
    return server


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
    options = dict(port=port, show=show, title="scalescope", websocket_origin=origins, **kwargs)
    panels = {"/": _page(runs, poll_ms)}
    if not threaded:
        return _run_guarded(panels, address, **options)
    loop = IOLoop(make_current=False)
    options |= {"loop": loop, "server_id": uuid.uuid4().hex}
    thread = StoppableThread(
        target=_run_guarded,
        io_loop=loop,
        args=(panels, address),
        kwargs=options,
        owns_loop=True,
        name="scalescope-serve",
        daemon=True,
    )
    thread.start()
    return thread
