"""Headless Chromium for the page tests: Debian's ``chromium`` driven by playwright (no browser is downloaded).

When either is missing the test fails and says how to install it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Self

import pytest

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREENSHOT_DIR_ENV = "POLYFHE_SCREENSHOT_DIR"  # set it to keep the screenshot beyond the test's tmp folder


def chromium_path() -> str:
    path = os.environ.get("POLYFHE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).is_file():
        pytest.fail("headless Chromium is needed for the web-page test and was not found: install Debian's "
                    "chromium (`sudo apt-get install chromium`, or run scripts/setup.sh as root) or point "
                    "POLYFHE_CHROMIUM at a Chromium binary", pytrace=False)
    return path


def playwright_api():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the web-page test needs playwright: pip install -e '.[dev,serve]' (the browser itself "
                    "comes from Debian's chromium package, not from playwright)", pytrace=False)
    return sync_playwright


@contextlib.contextmanager
def headless_page(home: Path, width: int, height: int):
    """(page, page errors) in a fresh headless Chromium whose HOME is ``home``; closed on exit."""
    executable, sync_playwright = chromium_path(), playwright_api()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_FLAGS[1:],
                                    env={**os.environ, "HOME": str(home)})
        try:
            page = browser.new_context(viewport={"width": width, "height": height}).new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            yield page, errors
        finally:
            browser.close()


class RecordingProxy:
    """A loopback HTTP proxy in front of a server that keeps every request body it forwards: what the page really
    sent, whatever the browser does with large bodies (it streams Blobs, which playwright's request events omit)."""

    def __init__(self, target: str) -> None:
        self.target = target.rstrip("/")
        self.bodies: list[tuple[str, str, bytes]] = []  # (method, path, body)

    def __enter__(self) -> Self:
        import http.server
        import threading

        import httpx

        proxy = self
        client = httpx.Client(timeout=600)

        class Handler(http.server.BaseHTTPRequestHandler):
            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.command != "GET":
                    proxy.bodies.append((self.command, self.path, body))
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "authorization")}
                answer = client.request(self.command, proxy.target + self.path, content=body, headers=headers)
                self.send_response(answer.status_code)
                for key in ("content-type", "x-polyfhe-server-seconds", "retry-after"):
                    if key in answer.headers:
                        self.send_header(key, answer.headers[key])
                self.send_header("Content-Length", str(len(answer.content)))
                self.end_headers()
                self.wfile.write(answer.content)

            do_GET = do_POST = do_DELETE = _forward

            def log_message(self, *args) -> None:  # quiet
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._client = client
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._client.close()
