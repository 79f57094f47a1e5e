"""The page tests' request recorder (``browserlib``) on its own, no browser: synthetic requests sent through
:class:`RecordingProxy` the way Chromium sends them (any method, query, headers, a chunked body), and synthetic
playwright request events fed to :meth:`RecordingProxy.watch`. A secret hidden in a GET URL, in a header or in a PUT
body is caught; the recorder before issue 55 (item 7) missed all three."""

from __future__ import annotations

import base64
import http.server
import threading
import urllib.parse
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest
from browserlib import RecordingProxy

SECRET = bytes(range(7, 7 + 3 * 64))[:150]  # stands for the secret key's bytes (not valid UTF-8 past 0x7f)
WINDOWS = [SECRET[i: i + 48] for i in range(0, len(SECRET) - 48, 16)]  # as the page test takes them


@pytest.fixture()
def target() -> Iterator[tuple[str, list[tuple[str, str, bytes]]]]:
    """A stand-in for the server: answers every method with 200 and keeps (method, path, body)."""
    seen: list[tuple[str, str, bytes]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            seen.append((self.command, self.path, self.rfile.read(int(self.headers.get("Content-Length") or 0))))
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", "2")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(b"ok")

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _answer

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def _old_recorder_finds(requests: list, windows: list[bytes]) -> list[str]:
    """What the recorder and checks before issue 55 (item 7) caught: the proxy forwarded GET, POST and DELETE only
    (any other method got 501 and was not recorded), read a body by its Content-Length only (a chunked body was
    empty), kept (method, path, body) of the requests that were not GETs, and the page test searched those bodies for
    the secret's raw bytes. Headers were not kept at all."""
    def body(r) -> bytes:  # r: a RecordedRequest
        return r.body if any(k.lower() == "content-length" for k, _ in r.headers) else b""

    bodies = [(r.method, r.url, body(r)) for r in requests if r.method in ("POST", "DELETE")]
    return [url for _, url, body in bodies if any(w in body for w in windows)]


def test_a_secret_in_a_url_a_header_or_a_put_body_is_caught(target) -> None:
    url, reached = target
    b64url = base64.urlsafe_b64encode(SECRET).decode()
    with RecordingProxy(url) as proxy, httpx.Client(base_url=proxy.url) as client:
        answers = [
            client.get("/v1/status", params={"k": SECRET.hex(), "model": "tiny"}),  # a GET's query
            client.get("/v1/ping", headers={"X-Session": base64.b64encode(b"pad" + SECRET).decode()}),  # a header
            client.put("/v1/keys", content=b"prefix" + SECRET),  # a PUT body, raw
            client.patch("/v1/keys", content=b"k=" + urllib.parse.quote_from_bytes(SECRET).encode()),  # a form
            client.post("/v1/stream", content=iter([b"chunk", SECRET, b"end"])),  # chunked, no Content-Length
            client.get(f"/v1/sessions/{b64url[5:]}"),  # in the path, base64url, cut at any offset
            client.post("/v1/infer", content=b"a ciphertext, nothing secret", headers={"Authorization": "Bearer t"}),
        ]
        assert [a.status_code for a in answers] == [200] * len(answers)  # PUT and PATCH forwarded, not 501
        assert client.head("/v1/status").status_code == 200
    sent = proxy.requests
    assert [r.method for r in sent] == ["GET", "GET", "PUT", "PATCH", "POST", "GET", "POST", "HEAD"]
    assert sent[0].url.startswith("/v1/status?k=") and dict(sent[1].headers)["X-Session"]
    assert sent[4].body == b"chunk" + SECRET + b"end" and reached[4][2] == sent[4].body  # forwarded whole
    assert dict(sent[6].headers)["Authorization"] == "Bearer t"

    from browserlib import RecordedRequest, find_leaks

    leaks = find_leaks(sent, {"the secret key": WINDOWS})
    assert leaks == [f"the secret key in the {field} of {sent[i].describe()}" for i, field in (
        (0, "url"), (1, "headers"), (2, "body"), (3, "body (percent-decoded)"), (4, "body"), (5, "url"))]
    assert sent[0].describe().startswith("GET /v1/status?k=0708090a") and sent[0].describe().endswith("(proxy)")
    # the recorder before saw none of them: not the GETs' URLs, the header, the PUT (not even forwarded), the form
    # body's percent-encoding or the chunked body
    assert _old_recorder_finds(sent, WINDOWS) == []
    raw_post = RecordedRequest("proxy", "POST", "/v1/infer", (("Content-Length", "150"),), SECRET)
    assert _old_recorder_finds([raw_post], WINDOWS) == ["/v1/infer"]  # only the raw bytes in a POST's body


def test_playwright_events_show_requests_that_bypass_the_proxy(target) -> None:
    """``watch`` records the page's own view, fed here as playwright would: a request to another origin, which the
    proxy never sees, is listed by ``elsewhere`` and searched like the rest; data: and blob: URLs stay local."""
    from browserlib import find_leaks

    url, _ = target
    handlers = {}
    page = SimpleNamespace(on=lambda event, handler: handlers.setdefault(event, handler))
    with RecordingProxy(url) as proxy:
        proxy.watch(page)
        events = [
            SimpleNamespace(method="GET", url=proxy.url + "/", headers={"accept": "text/html"}, post_data_buffer=None),
            SimpleNamespace(method="POST", url=proxy.url + "/v1/infer", headers={}, post_data_buffer=None),  # a Blob
            SimpleNamespace(method="GET", url="https://elsewhere.example/c?d=" + base64.b64encode(SECRET).decode(),
                            headers={}, post_data_buffer=None),
            SimpleNamespace(method="PUT", url="http://127.0.0.1:1/x", headers={"x-k": SECRET.hex().upper()},
                            post_data_buffer=b"{}"),
            SimpleNamespace(method="GET", url="data:image/png;base64,AAAA", headers={}, post_data_buffer=None),
        ]
        for event in events:
            handlers["request"](event)
    assert [r.source for r in proxy.page_requests] == ["page"] * 5 and proxy.everything == proxy.page_requests
    assert [r.url for r in proxy.elsewhere()] == [events[2].url, events[3].url]
    leaks = find_leaks(proxy.everything, {"the secret key": WINDOWS})
    assert [leak.split(" of ")[0] for leak in leaks] == ["the secret key in the url", "the secret key in the headers"]
    assert find_leaks(proxy.page_requests[:2], {"the secret key": WINDOWS}) == []


@pytest.mark.parametrize("offset", range(6))
def test_encodings_find_a_secret_at_any_offset(offset: int) -> None:
    from browserlib import RecordedRequest, encodings, find_leaks

    data = bytes(range(200, 200 + offset)) + WINDOWS[0] + b"tail"
    texts = [data, data.hex().encode(), data.hex().upper().encode(), base64.b64encode(data),
             base64.urlsafe_b64encode(data)]
    for text in texts:
        assert any(e in text for e in encodings(WINDOWS[0])), text
    clean = RecordedRequest("proxy", "POST", "/v1/x?model=tiny", (("Content-Type", "application/octet-stream"),),
                            bytes(4096))
    assert find_leaks([clean], {"the secret key": WINDOWS}) == []
