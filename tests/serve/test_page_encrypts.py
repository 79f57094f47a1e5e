"""The page as a client, in headless Chromium against a real ``polyfhe serve``: keys made in the page and kept in
IndexedDB, an image dropped on the canvas, encrypted in the page, evaluated by the server, decrypted in the page;
the class shown is the plaintext program's. Every request the page makes is recorded whole (method, URL with query,
headers, body of any method) and checked: bodies hold public keys and ciphertexts only, and nothing anywhere holds the
secret key or the image in the clear (raw, hex, base64 or percent-encoded)."""

from __future__ import annotations

import io
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
from browserlib import SCREENSHOT_DIR_ENV, RecordingProxy, find_leaks, headless_page
from serve_testlib import TINY

from polyfhe.program.wire import ALLOWED_SECTIONS, KIND_CIPHERTEXT, KIND_CONTEXT, MAGIC

pytestmark = pytest.mark.browser

SECRET_DATA_OFFSET = 16 + 48 + 16 + 8  # SEAL header, plaintext members, DynArray header and count
READ_SECRET_KEYS = """async () => {
  const db = await new Promise((ok, no) => { const q = indexedDB.open("polyfhe-keys", 1);
                                             q.onsuccess = () => ok(q.result); q.onerror = () => no(q.error); });
  const all = await new Promise((ok) => { const q = db.transaction("keys").objectStore("keys").getAll();
                                          q.onsuccess = () => ok(q.result); });
  db.close();
  return all.map((r) => ({program_id: r.program_id, secret_key: Array.from(r.secret_key)}));
}"""


def _png(pixels: np.ndarray) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels, mode="L").save(buffer, format="PNG")
    return buffer.getvalue()


def _container(body: bytes) -> tuple[bytes, dict]:
    assert body.startswith(MAGIC), "a body that is not a polyfhe container"
    kind = body[len(MAGIC): len(MAGIC) + 1]
    (size,) = struct.unpack_from("<I", body, len(MAGIC) + 1)
    start = len(MAGIC) + 5
    return kind, json.loads(body[start: start + size])


def _js_number(v: float) -> str:
    """``v`` as JavaScript's String(number) writes it (shortest round-trip digits; no ".0" on whole numbers)."""
    v = float(v)
    return str(int(v)) if v.is_integer() else repr(v)


def _windows(data: bytes, width: int = 48, count: int = 64) -> list[bytes]:
    step = max(1, (len(data) - width) // count)
    return [data[i: i + width] for i in range(0, len(data) - width, step)][:count]


def test_page_classifies_an_encrypted_image_and_sends_no_secret(server, programs, tmp_path):
    shots = Path(os.environ.get(SCREENSHOT_DIR_ENV) or tmp_path)
    program = programs[TINY]
    pixels = (np.random.default_rng(5).random((8, 8)) * 255).astype(np.uint8)
    image = tmp_path / "digit.png"
    image.write_bytes(_png(pixels))
    with RecordingProxy(server.url) as proxy, headless_page(tmp_path, 1250, 1250) as (page, errors):
        proxy.watch(page)  # and playwright's view of every request, to any origin
        sent = proxy.requests  # every request that reached the server, whole, as the page sent it
        page.goto(proxy.url + "/")
        page.wait_for_selector("body[data-ready='1']", timeout=60_000)
        page.select_option("#page-model", TINY)
        page.wait_for_function(f"window.polyfhePage.spec && window.polyfhePage.spec.model === '{TINY}'")
        assert "public keys to upload" in page.locator("#upload-size").inner_text()
        page.screenshot(path=str(shots / "serve-page-before.png"), full_page=True)

        def classify() -> tuple[int, np.ndarray, np.ndarray]:
            before = page.locator("#result").get_attribute("data-done") or ""
            page.click("#classify")
            page.wait_for_function(f"(document.getElementById('result').dataset.done || '') !== {json.dumps(before)}"
                                   " || !document.getElementById('page-error').hidden", timeout=120_000)
            assert page.locator("#page-error").is_hidden(), page.locator("#page-error").inner_text()
            shown = int(page.locator("#result").get_attribute("data-class"))
            given = np.array(page.evaluate("Array.from(window.polyfhePage.lastInput)"))
            logits = np.array(page.evaluate("Array.from(window.polyfhePage.lastLogits)"))
            return shown, given, logits

        page.set_input_files("#file", str(image))
        shown, given, logits = classify()
        np.testing.assert_allclose(given.reshape(8, 8), pixels / 255.0, atol=2.5 / 255)  # the image went in
        plain = program.run_plain(given.reshape(1, 1, 8, 8))[0]
        assert shown == int(plain.argmax())
        np.testing.assert_allclose(logits, plain, atol=1e-2 * max(1.0, float(np.abs(plain).max())))
        top = page.locator("#top li").first.inner_text()
        assert f"class {shown}" in top and "%" in top
        assert "server" in page.locator("#timings").inner_text()
        page.screenshot(path=str(shots / "serve-page-after.png"), full_page=True)
        sessions = [r for r in sent if r.url.endswith(f"/v1/sessions?model={TINY}")]
        assert len(sessions) == 1

        page.reload()  # the keys live in IndexedDB: the next visit reuses them and the server's session
        page.wait_for_selector("body[data-ready='1']", timeout=60_000)
        page.select_option("#page-model", TINY)
        page.wait_for_selector("#key-status[data-keys='saved']", timeout=30_000)
        page.set_input_files("#file", str(image))
        again, _, logits_again = classify()
        assert again == shown
        np.testing.assert_allclose(logits_again, plain, atol=1e-2 * max(1.0, float(np.abs(plain).max())))
        assert len([r for r in sent if "/v1/sessions?model=" in r.url]) == 1  # no second key upload
        saved = page.evaluate(READ_SECRET_KEYS)
        assert [r["program_id"] for r in saved] == [program.program_id]
        secret = bytes(saved[0]["secret_key"])

        page.click("#delete-keys")
        page.wait_for_selector("#key-status[data-keys='none']", timeout=30_000)
        assert page.evaluate(READ_SECRET_KEYS) == []
        assert not errors, errors

    # every body the page sent: a public context or a ciphertext, and nothing of the secret key or the image
    # anywhere in any request (URL, query, headers, bodies of every method), as the proxy and playwright saw them
    assert sent and proxy.page_requests and any(r.method == "GET" for r in sent)
    assert proxy.elsewhere() == []  # no request went around the proxy (to another origin)
    posts = [(r.url, r.body) for r in sent if r.method == "POST"]
    assert len(posts) == 3  # one context, two queries (the DELETE of "Delete my keys" has no body)
    assert all(not r.body for r in sent if r.method != "POST")
    secret_windows = _windows(secret[SECRET_DATA_OFFSET:])
    clear = [image.read_bytes(), pixels.tobytes()]
    clear += [given.astype("<f8").tobytes()[i: i + 64] for i in range(0, len(given) * 8 - 64, 64)]
    clear += [given.astype("<f4").tobytes()[i: i + 32] for i in range(0, len(given) * 4 - 32, 32)]
    # the image as text, as JSON.stringify or a form would write it: inputs in [0, 1], pixel values
    text = [",".join(_js_number(v) for v in given[i: i + 4]).encode() for i in range(0, len(given) - 4, 4)]
    text += [",".join(str(int(p)) for p in pixels.ravel()[i: i + 8]).encode() for i in range(0, 56, 8)]
    assert find_leaks(proxy.everything, {"the secret key": secret_windows, "the image in the clear": clear,
                                         "the image as text": text}) == []
    for url, body in posts:
        kind, header = _container(body)
        names = [name for name, _ in header["sections"]]
        if url.endswith(f"?model={TINY}"):
            assert kind == KIND_CONTEXT and set(names) <= ALLOWED_SECTIONS[KIND_CONTEXT]
            assert "secret_key" not in names
        else:
            assert kind == KIND_CIPHERTEXT and names == ["ct0"] and header["role"] == "input"
        assert set(header) <= {"program_id", "params", "params_full", "galois_steps", "client", "role", "count",
                               "samples", "sections"}
