"""Standalone HTML export: every byte of BokehJS inline, no CDN, no network request."""

from __future__ import annotations

from bokeh.embed import file_html
from bokeh.model import Model
from bokeh.resources import INLINE


def standalone_html(model: Model, title: str) -> str:
    """A complete HTML page showing ``model`` that opens offline.

    Uses ``bokeh.embed.file_html`` with ``INLINE`` resources (BokehJS embedded, about
    1-2 MB), so the page makes no network request. Plain Bokeh only: Panel's own export
    still references a CDN, which is why the report goes through here.
    """
    return file_html(model, resources=INLINE, title=title)
