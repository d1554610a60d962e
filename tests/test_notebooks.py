"""The shipped notebooks (notebooks/*.ipynb) run top to bottom offline with nbclient in a
kernel of this interpreter: no cell errors, BokehJS loaded once and inline, the
expected rich outputs (inline Bokeh figures, the advisor's coloured table), and no CDN
URL in any output. The executed quickstart also renders in headless chromium with
every network request blocked.

The notebooks are stored with their outputs cleared; their first code cell reads
``SCALESCOPE_NB_STEPS`` (the GPT notebook runs a few steps here). Compiled XLA
programs are cached in pytest's cache directory (conftest), so re-runs compile much less."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from conftest import watch_offline
from test_notebook import build_once

from scalescope import notebook as nb

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
KERNEL = "scalescope-nbtest"
TEST_STEPS = "12"
LOCAL = ("file:", "data:", "blob:", "about:")
LOAD_MIME = "application/vnd.bokehjs_load.v0+json"


def _read(name: str):
    import nbformat

    return nbformat.read(NOTEBOOKS / name, as_version=4)


def _kernelspec(root: Path) -> Path:
    """A kernelspec named `KERNEL` that starts this interpreter (found via JUPYTER_PATH)."""
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    kernel = {"argv": argv, "display_name": "scalescope tests", "language": "python"}
    (spec / "kernel.json").write_text(json.dumps(kernel))
    return root


def _execute(name: str, tmp: Path, cache: Path) -> object:
    """Run a notebook top to bottom (a cell error raises) and return it with outputs."""
    pytest.importorskip("ipykernel")
    nbclient = pytest.importorskip("nbclient")
    book = _read(name)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_PATH", str(_kernelspec(tmp / "jupyter")))
        mp.setenv("SCALESCOPE_NB_STEPS", TEST_STEPS)
        mp.setenv("SCALESCOPE_NB_RUNS", str(tmp / "runs"))
        mp.setenv("JAX_COMPILATION_CACHE_DIR", str(cache))
        mp.delenv("BOKEH_RESOURCES", raising=False)
        client = nbclient.NotebookClient(
            book,
            timeout=600,
            kernel_name=KERNEL,
            resources={"metadata": {"path": str(tmp)}},
        )
        client.execute()
    return book


def _jax_cache() -> Path:
    """The session's JAX compilation cache (conftest), shared with the other tests."""
    return Path(os.environ["JAX_COMPILATION_CACHE_DIR"])


def _outputs(book) -> list[dict]:
    return [out for cell in book.cells if cell.cell_type == "code" for out in cell.outputs]


def _strings(out: dict) -> list[str]:
    values = list(out.get("data", {}).values()) + [out.get("text", "")]
    return [v if isinstance(v, str) else json.dumps(v) for v in values]


def _check_outputs(book, min_figures: int) -> None:
    outputs = _outputs(book)
    assert not [o for o in outputs if o["output_type"] == "error"]
    loads = [o for o in outputs if LOAD_MIME in o.get("data", {})]
    assert len(loads) == 1, "BokehJS must be loaded exactly once per notebook"
    assert len(loads[0]["data"]["application/javascript"]) > 1_000_000  # inline BokehJS
    htmls = [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})]
    figures = sum(h.count('class="scalescope-figure"') for h in htmls)
    assert figures >= min_figures
    assert any('class="scalescope-advice"' in h for h in htmls)  # coloured advisor table
    for out in outputs:
        for text in _strings(out):
            assert nb.cdn_urls(text) == [], nb.cdn_urls(text)[:3]
            for lazy in nb.BOKEHJS_LAZY_URLS:  # inside BokehJS, fetched only for TeX/icons
                text = text.replace(lazy, "")
            assert 'src="http' not in text and 'href="http' not in text


def test_notebooks_are_stored_without_outputs():
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        book = _read(path.name)
        for cell in book.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, path.name
    assert {p.name for p in NOTEBOOKS.glob("*.ipynb")} >= {"quickstart.ipynb", "fp8_gpt.ipynb"}
    first = next(c for c in _read("fp8_gpt.ipynb").cells if c.cell_type == "code")
    assert "SCALESCOPE_NB_STEPS" in first.source


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    """The executed quickstart, run once per session (shared by the xdist workers)."""
    import nbformat

    cache = _jax_cache()

    def build(root: Path) -> None:
        nbformat.write(_execute("quickstart.ipynb", root, cache), root / "executed.ipynb")

    root = build_once(tmp_path_factory, "quickstart-executed", build)
    return nbformat.read(root / "executed.ipynb", as_version=4)


@pytest.mark.slow
def test_quickstart_runs_offline_with_inline_figures(quickstart):
    _check_outputs(quickstart, min_figures=6)
    htmls = [o["data"].get("text/html", "") for o in _outputs(quickstart) if "data" in o]
    # ss.show on instrument stats, reader.hist / heatmap / compare: each a viz figure
    for name in ("histogram", "snr-", "heatmap", "compare-heatmap", "loss"):
        assert any(f'"name":"{name}' in h for h in htmls), name


@pytest.mark.slow
@pytest.mark.browser
def test_quickstart_outputs_render_offline_in_chromium(quickstart, browser, tmp_path):
    """The outputs, in order, as a page (text/html as is, application/javascript in a
    script tag, as a notebook frontend does): every figure renders, nothing is fetched."""
    parts = []
    for out in _outputs(quickstart):
        data = out.get("data", {})
        if "text/html" in data:
            parts.append(data["text/html"])
        elif "application/javascript" in data:
            parts.append(f"<script>{data['application/javascript']}</script>")
    page_file = tmp_path / "quickstart.html"
    page_file.write_text("<!DOCTYPE html><html><body>" + "\n".join(parts) + "</body></html>")
    n_figures = sum(p.count('class="scalescope-figure"') for p in parts)
    page = browser.new_page()
    try:
        blocked, errors, _ = watch_offline(page, LOCAL)
        page.goto(page_file.as_uri())
        page.wait_for_function(
            f"window.Bokeh !== undefined && Bokeh.documents.length == {n_figures}"
            " && Bokeh.documents.every(d => d.is_idle)",
            timeout=60_000,
        )
        names = page.evaluate("Bokeh.documents.flatMap(d => d.roots().map(r => r.name || ''))")
    finally:
        page.close()
    assert blocked == [] and errors == []
    assert "histogram" in names and "heatmap" in names


@pytest.mark.slow
def test_fp8_gpt_notebook_runs_offline(tmp_path):
    book = _execute("fp8_gpt.ipynb", tmp_path, _jax_cache())
    _check_outputs(book, min_figures=7)
    streams = "".join(o.get("text", "") for o in _outputs(book) if o["output_type"] == "stream")
    for precision in ("fp8-naive", "fp8-static", "fp8"):
        assert f"{precision}: {TEST_STEPS} steps in" in streams
    assert "dynamic_rescale_l2" in streams  # the advisor's fix, printed for the focus op
    runs = sorted(p.name for p in (tmp_path / "runs" / "fp8_gpt").iterdir())
    assert runs == ["fp8", "fp8-naive", "fp8-static"]
