"""The web page at ``/`` and the files it loads from ``/static/``: the page's client (``fheclient.js``,
``app.js``) and node-seal 7.0.0 (SEAL in WebAssembly), vendored so that nothing is fetched at run time.

Only files that ship in the package's ``static`` folder are served, found once at start-up: a request names
one of them exactly or gets a 404 (no path is ever joined from the URL).
"""

from __future__ import annotations

import functools
from importlib import resources

__all__ = ["MEDIA_TYPES", "index_html", "static_asset", "static_names"]

MEDIA_TYPES = {".js": "text/javascript; charset=utf-8", ".mjs": "text/javascript; charset=utf-8",
               ".wasm": "application/wasm", ".css": "text/css; charset=utf-8", ".html": "text/html; charset=utf-8",
               ".txt": "text/plain; charset=utf-8", ".md": "text/plain; charset=utf-8"}
_LICENSES = ("LICENSE",)  # served as text


@functools.lru_cache(maxsize=1)
def index_html() -> str:
    return resources.files("polyfhe.serve").joinpath("static/index.html").read_text(encoding="utf-8")


def _walk(folder, prefix: str = ""):
    for entry in folder.iterdir():
        name = f"{prefix}{entry.name}"
        if entry.is_dir():
            yield from _walk(entry, f"{name}/")
        elif entry.is_file():
            yield name, entry


@functools.lru_cache(maxsize=1)
def static_names() -> dict:
    """Servable file name (relative to ``static/``) -> resource, for the file types the page uses."""
    root = resources.files("polyfhe.serve").joinpath("static")
    return {name: entry for name, entry in _walk(root)
            if name.rsplit("/", 1)[-1] in _LICENSES or any(name.endswith(ext) for ext in MEDIA_TYPES)}


@functools.lru_cache(maxsize=16)
def static_asset(name: str) -> tuple[bytes, str] | None:
    """(bytes, media type) of a shipped static file, or None when ``name`` is not one."""
    entry = static_names().get(name)
    if entry is None:
        return None
    suffix = "." + name.rsplit(".", 1)[-1] if "." in name.rsplit("/", 1)[-1] else ""
    return entry.read_bytes(), MEDIA_TYPES.get(suffix, "text/plain; charset=utf-8")
