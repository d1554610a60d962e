"""Screenshots of every dashboard view, for the README (docs/img/dashboard-*.png).

    python docs/make_screenshots.py RUNS_DIR [--run NAME] [--out docs/img]

Serves RUNS_DIR with `scalescope serve` on a free port, opens it in Debian's chromium
(headless, every request outside 127.0.0.1 aborted) and saves one PNG per view.
"""

from __future__ import annotations

import argparse
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from playwright.sync_api import sync_playwright

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
VIEWS = ("Overview", "Heatmap", "Op detail", "Advisor", "Formats", "Compare")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs")
    parser.add_argument("--run", help="run to show (default: the first)")
    parser.add_argument("--metric", default="log2_rms", help="heatmap metric")
    parser.add_argument("--out", default=str(Path(__file__).parent / "img"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "scalescope.cli", "serve", args.runs, "--port", str(port)]
    server = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}/"
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(url, timeout=5)
                break
            except OSError:
                time.sleep(0.5)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.route(
                "**/*",
                lambda r: (
                    r.continue_()
                    if r.request.url.startswith(("http://127.0.0.1", "ws://127.0.0.1", "data:"))
                    else r.abort()
                ),
            )
            page.goto(url)
            idle = "() => window.Bokeh && Bokeh.documents.length && Bokeh.documents[0].is_idle"
            page.wait_for_function(idle, timeout=60_000)
            if args.run:
                page.get_by_label("Run", exact=True).first.select_option(label=args.run)
                time.sleep(2)
            for view in VIEWS:
                page.locator(".bk-tab").filter(has_text=re.compile(f"^{view}$")).first.click()
                time.sleep(2)
                if view == "Heatmap" and args.metric != "log2_rms":
                    page.get_by_label("Metric", exact=True).first.select_option(label=args.metric)
                    time.sleep(2)
                page.wait_for_function(idle, timeout=60_000)
                path = out / f"dashboard-{view.lower().replace(' ', '-')}.png"
                page.screenshot(path=str(path), full_page=False)
                print(f"wrote {path}")
            browser.close()
    finally:
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    main()
