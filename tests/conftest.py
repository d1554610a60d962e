"""Shared test fixtures: one headless Debian chromium per test process (Playwright allows
one `sync_playwright()` per process), and a free local port."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

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


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def browser():
    """Debian's chromium, headless, driven by Playwright (never `playwright install`)."""
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} missing: apt-get install -y chromium (.ci/run does)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROME_ARGS)
        yield b
        b.close()


def watch_offline(page, allowed: tuple[str, ...]) -> tuple[list[str], list[str], list[str]]:
    """Abort every request of ``page`` whose URL does not start with one of ``allowed``
    and collect console and page errors. Returns ``(blocked, errors, requests)`` lists
    that fill in as the page runs: "works offline" means both of the first two stay empty."""
    blocked: list[str] = []
    errors: list[str] = []
    requests: list[str] = []

    def route(r) -> None:
        requests.append(r.request.url)
        if r.request.url.startswith(allowed):
            r.continue_()
        else:
            blocked.append(r.request.url)
            r.abort()

    page.route("**/*", route)
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    return blocked, errors, requests
