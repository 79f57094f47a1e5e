"""Headless Chromium for the page tests: Debian's ``chromium`` driven by playwright (no browser is downloaded).

When either is missing the test fails and says how to install it.
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
import shutil
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

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


@dataclass(frozen=True)
class RecordedRequest:
    """One request the page made, whole: ``url`` with its query, every header, the body of any method.

    ``source`` is ``"proxy"`` when it reached the server through :class:`RecordingProxy` (the body as sent, also a
    streamed Blob) or ``"page"`` when playwright's request event reported it (any origin, so a request that never
    reached the proxy is seen too; the body only when playwright holds it).
    """

    source: str
    method: str
    url: str
    headers: tuple[tuple[str, str], ...]
    body: bytes = b""

    @classmethod
    def from_playwright(cls, request: Any) -> RecordedRequest:
        """From playwright's ``page.on("request")`` event (``method``, ``url``, ``headers``, ``post_data_buffer``)."""
        return cls("page", request.method, request.url, tuple(request.headers.items()),
                   request.post_data_buffer or b"")

    def describe(self) -> str:
        return f"{self.method} {self.url[:120]} ({self.source})"

    def fields(self) -> dict[str, bytes]:
        """Where a secret can hide in this request, each also percent-decoded (a query, a form body)."""
        raw = {"method": self.method.encode("latin-1", "replace"), "url": self.url.encode("utf-8", "surrogateescape"),
               "headers": b"\n".join(f"{k}: {v}".encode("utf-8", "surrogateescape") for k, v in self.headers),
               "body": self.body}
        out = dict(raw)
        for name, data in raw.items():
            if len(data) <= DECODE_AT_MOST and (b"%" in data or b"+" in data):
                out[f"{name} (percent-decoded)"] = urllib.parse.unquote_to_bytes(data.replace(b"+", b" "))
        return out


DECODE_AT_MOST = 1 << 20  # bodies larger than this (ciphertexts, public keys) are binary: not percent-decoded


def encodings(needle: bytes) -> list[bytes]:
    """``needle`` as it would appear raw, in hex, or inside any base64 (standard or URL-safe) text of data that holds
    it: base64 encodes groups of 3 bytes, so whatever the needle's offset, one of its 3-aligned cores is encoded
    whole."""
    out = [needle, needle.hex().encode(), needle.hex().upper().encode()]
    for k in range(3):
        core = needle[k: k + (len(needle) - k) // 3 * 3]
        if len(core) >= 12:  # shorter cores (16 base64 characters) would match by chance
            encoded = base64.b64encode(core)
            out += [encoded, encoded.translate(bytes.maketrans(b"+/", b"-_"))]
    return list(dict.fromkeys(out))


def find_leaks(requests: Iterable[RecordedRequest], secrets: Mapping[str, Iterable[bytes]]) -> list[str]:
    """Every place a secret's byte strings appear (raw, hex, base64, percent-encoded) in a request's method, URL,
    headers or body: ``"<secret> in the <field> of <request>"``; empty when none does."""
    needles = {name: [bytes(n) for n in values if n] for name, values in secrets.items()}
    coded = {name: [e for n in values for e in encodings(n)[1:]] for name, values in needles.items()}
    leaks = []
    for request in requests:
        for name, raw_needles in needles.items():
            found: set[str] = set()
            for field_name, data in request.fields().items():  # the raw fields first, then their decoded forms
                if field_name.split(" (")[0] in found:
                    continue  # already reported raw
                # hex and base64 are text: in a large binary body only its runs of such characters can hold them
                text = data if len(data) <= DECODE_AT_MOST else b"\n".join(ENCODED_RUN.findall(data))
                if any(n in data for n in raw_needles) or any(e in text for e in coded[name]):
                    found.add(field_name)
                    leaks.append(f"{name} in the {field_name} of {request.describe()}")
    return leaks


ENCODED_RUN = re.compile(rb"[0-9A-Za-z+/=_-]{16,}")  # at least the shortest encoding ``encodings`` makes


class RecordingProxy:
    """A loopback HTTP proxy in front of a server that records every request it forwards, whole (method, path with
    query, headers, body; any method, a chunked body too): what the page really sent, whatever the browser does with
    large bodies (it streams Blobs, which playwright's request events omit). :meth:`watch` adds playwright's view
    of a page, which also lists requests to other origins (they never reach the proxy)."""

    def __init__(self, target: str) -> None:
        self.target = target.rstrip("/")
        self.requests: list[RecordedRequest] = []  # as they reached the proxy
        self.page_requests: list[RecordedRequest] = []  # as playwright reported them (watch)

    def watch(self, page: Any) -> None:
        page.on("request", lambda request: self.page_requests.append(RecordedRequest.from_playwright(request)))

    @property
    def everything(self) -> list[RecordedRequest]:
        return [*self.requests, *self.page_requests]

    def elsewhere(self) -> list[RecordedRequest]:
        """The page's network requests that did not go to the proxy (data: and blob: URLs stay in the browser)."""
        mine = urllib.parse.urlsplit(self.url)
        return [r for r in self.page_requests if urllib.parse.urlsplit(r.url).scheme not in ("data", "blob")
                and urllib.parse.urlsplit(r.url)[:2] != mine[:2]]

    def __enter__(self) -> Self:
        import http.server
        import threading

        import httpx

        proxy = self
        client = httpx.Client(timeout=600)

        class Handler(http.server.BaseHTTPRequestHandler):
            def _read_body(self) -> bytes:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    chunks = []
                    while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                    while self.rfile.readline().strip():  # trailers, then the blank line
                        pass
                    return b"".join(chunks)
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _forward(self) -> None:
                body = self._read_body()
                proxy.requests.append(RecordedRequest("proxy", self.command, self.path, tuple(self.headers.items()),
                                                      body))
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "authorization")}
                answer = client.request(self.command, proxy.target + self.path, content=body, headers=headers)
                self.send_response(answer.status_code)
                for key in ("content-type", "x-polyfhe-server-seconds", "retry-after"):
                    if key in answer.headers:
                        self.send_header(key, answer.headers[key])
                self.send_header("Content-Length", str(len(answer.content)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(answer.content)

            def __getattr__(self, name: str) -> Any:  # do_GET, do_PUT, do_PATCH, ...: every method is forwarded
                if name.startswith("do_"):
                    return self._forward
                raise AttributeError(name)

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
