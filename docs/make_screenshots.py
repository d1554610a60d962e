"""Screenshots of every dashboard view and of a report, for the README (docs/img/*.png).

    python docs/make_screenshots.py RUNS_DIR [--run NAME] [--out docs/img]
    python docs/make_screenshots.py --report RUN [--out docs/img]

Serves RUNS_DIR with `scalescope serve` on a free port, opens it in Debian's chromium
(headless, every request outside 127.0.0.1 aborted) and saves one PNG per view. With
``--report``, writes `scalescope report RUN` to a temporary file and saves the top of
the page (every request but ``file:`` and ``data:`` aborted) as report.png.
"""

from __future__ import annotations

import argparse
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from playwright.sync_api import sync_playwright

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
VIEWS = ("Overview", "Heatmap", "Op detail", "Advisor", "Formats", "Compare")


def report_screenshot(run: str, out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        html = Path(tmp) / "audit.html"
        cmd = [sys.executable, "-m", "scalescope.cli", "report", run, "-o", str(html)]
        subprocess.run(cmd, check=True)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1400})
            page.route(
                "**/*",
                lambda r: (
                    r.continue_() if r.request.url.startswith(("file:", "data:")) else r.abort()
                ),
            )
            page.goto(html.as_uri())
            idle = "() => window.Bokeh && Bokeh.documents.length && Bokeh.documents[0].is_idle"
            page.wait_for_function(idle, timeout=120_000)
            time.sleep(1)
            page.screenshot(path=str(out / "report.png"), full_page=False)
            browser.close()
    print(f"wrote {out / 'report.png'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="?")
    parser.add_argument("--report", metavar="RUN", help="screenshot a report of RUN instead")
    parser.add_argument("--run", help="run to show (default: the first)")
    parser.add_argument("--metric", default="log2_rms", help="heatmap metric")
    parser.add_argument("--out", default=str(Path(__file__).parent / "img"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report:
        report_screenshot(args.report, out)
        return
    if not args.runs:
        parser.error("give RUNS_DIR (or --report RUN)")
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
