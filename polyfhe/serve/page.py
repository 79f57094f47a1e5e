"""The web page at ``/``: a static HTML file that fetches ``/v1/models`` and polls ``/v1/stats``."""

from __future__ import annotations

import functools
from importlib import resources

__all__ = ["index_html"]


@functools.lru_cache(maxsize=1)
def index_html() -> str:
    return resources.files("polyfhe.serve").joinpath("static/index.html").read_text(encoding="utf-8")
