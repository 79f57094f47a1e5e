"""Bad uploads get the right 4xx with a reason, never crash the server, and other clients keep being served."""

from __future__ import annotations

import os
import re
import threading

import httpx
import numpy as np
import pytest
from serve_testlib import OTHER, TINY

from polyfhe.program.params import fingerprint_params
from polyfhe.program.wire import KIND_CIPHERTEXT, KIND_CONTEXT, pack, unpack
from polyfhe.serve.http_client import ServeClient

pytestmark = pytest.mark.fhe

OCTETS = {"Content-Type": "application/octet-stream"}


@pytest.fixture(scope="module")
def keys(programs):
    return {TINY: programs[TINY].client(), OTHER: programs[OTHER].client()}


@pytest.fixture(scope="module")
def contexts(keys):
    return {name: k.public_context() for name, k in keys.items()}


@pytest.fixture
def background(server, samples):
    """A well-behaved client that keeps inferring during the test; every answer it got must be right."""
    x, plain = samples
    stop, got, failures = threading.Event(), [], []
    ready = threading.Event()

    def loop() -> None:
        try:
            with ServeClient(server.url) as api, api.open_session(TINY) as session:
                i = 0
                while not stop.is_set() or i < 2:
                    got.append((i % len(x), session.infer(x[i % len(x)]).logits))
                    ready.set()
                    i += 1
        except Exception as exc:  # noqa: BLE001 - reported below, with the test's failure
            failures.append(repr(exc))
            ready.set()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    assert ready.wait(120), "the background client got no answer"
    yield got
    stop.set()
    thread.join(120)
    assert not failures, failures
    assert len(got) >= 2
    for i, logits in got:
        np.testing.assert_allclose(logits, plain[i], atol=1e-3)


def _repack(data: bytes, kind: bytes, header_changes: dict | None = None, drop: str | None = None) -> bytes:
    box = unpack(data, kind)
    header = {**box.header, **(header_changes or {})}
    sections = {k: v for k, v in box.sections.items() if k != drop}
    return pack(kind, header, sections)


def _corrupt(data: bytes, kind: bytes, section: str) -> bytes:
    box = unpack(data, kind)
    raw = bytearray(box.sections[section])
    mid = len(raw) // 2
    raw[mid: mid + 64] = os.urandom(64)
    return pack(kind, box.header, {**box.sections, section: bytes(raw)})


def _refused(response: httpx.Response, status: int, code: str) -> dict:
    body = response.json()
    assert (response.status_code, body["error"]) == (status, code), body
    assert body["detail"] and body["status"] == status
    return body


def test_bad_contexts_are_refused(server, programs, keys, contexts, background):
    ctx = contexts[TINY]
    other_params = fingerprint_params(programs[OTHER].params)
    cases = {
        "garbage": (os.urandom(4096), 400, "not_polyfhe_bytes"),
        "empty": (b"", 400, "empty_body"),
        "truncated": (ctx[: len(ctx) // 2], 400, "bad_context"),
        "header only": (ctx[:64], 400, "bad_context"),
        "corrupt keys": (_corrupt(ctx, KIND_CONTEXT, "relin_keys"), 400, "bad_context"),
        "no Galois keys": (_repack(ctx, KIND_CONTEXT, drop="galois_keys"), 400, "bad_context"),
        "secret key": (keys[TINY].secret_context(), 400, "secret_key_refused"),
        "other program": (contexts[OTHER], 422, "wrong_program"),
        "wrong parameters": (_repack(ctx, KIND_CONTEXT, {"params": other_params}), 422, "wrong_parameters"),
        "a ciphertext": (keys[TINY].encrypt(np.zeros(64)), 400, "wrong_kind"),
    }
    with httpx.Client(base_url=server.url, timeout=120) as http:
        for name, (body, status, code) in cases.items():
            response = http.post("/v1/sessions", params={"model": TINY}, content=body, headers=OCTETS)
            detail = _refused(response, status, code)["detail"]
            assert detail, name
        assert "secret key" in http.post("/v1/sessions", params={"model": TINY}, content=keys[TINY].secret_context(),
                                         headers=OCTETS).json()["detail"]
        body = _refused(http.post("/v1/sessions", params={"model": "nope"}, content=ctx), 404, "unknown_model")
        assert body["models"] == [OTHER, TINY]
        _refused(http.post("/v1/sessions", content=ctx), 400, "missing_model")
        # oversized: refused by Content-Length before reading, and while streaming a chunked body
        big = b"\0" * (41 << 20)
        _refused(http.post("/v1/sessions", params={"model": TINY}, content=big), 413, "body_too_large")
        chunks = (big[i: i + (1 << 20)] for i in range(0, len(big), 1 << 20))
        _refused(http.post("/v1/sessions", params={"model": TINY}, content=chunks), 413, "body_too_large")
        assert http.get("/healthz").json()["status"] == "ok"
        # nothing was kept: the good context still opens a session
        good = http.post("/v1/sessions", params={"model": TINY}, content=ctx, headers=OCTETS)
        assert good.status_code == 201
        assert http.delete(f"/v1/sessions/{good.json()['session_id']}").status_code == 200


def test_bad_ciphertexts_are_refused_and_the_session_survives(server, keys, contexts, samples, background):
    x, plain = samples
    tiny, other = keys[TINY], keys[OTHER]
    ct = tiny.encrypt(x[0])
    cases = {
        "garbage": (os.urandom(2048), 400, "not_polyfhe_bytes"),
        "empty": (b"", 400, "empty_body"),
        "truncated": (ct[: len(ct) - 1000], 400, "bad_ciphertext"),
        "corrupt": (_corrupt(ct, KIND_CIPHERTEXT, "ct0"), 400, "bad_ciphertext"),
        "two ciphertexts": (_repack(ct, KIND_CIPHERTEXT, {"count": 2}), 400, "bad_ciphertext"),
        "other program": (other.encrypt(np.zeros(64)), 422, "wrong_program"),
        "wrong parameters": (_repack(ct, KIND_CIPHERTEXT, {"params": "0" * 16}), 422, "wrong_parameters"),
        "a context": (contexts[TINY], 413, "body_too_large"),  # 19 MB: over the 1 MiB ciphertext limit
        "a small context-kind container": (pack(KIND_CONTEXT, {}, {}), 400, "wrong_kind"),
        "oversized": (b"\0" * (2 << 20), 413, "body_too_large"),
    }
    with httpx.Client(base_url=server.url, timeout=120) as http:
        created = http.post("/v1/sessions", params={"model": TINY}, content=contexts[TINY], headers=OCTETS)
        sid = created.json()["session_id"]
        for body, status, code in cases.values():
            _refused(http.post(f"/v1/sessions/{sid}/infer", content=body, headers=OCTETS), status, code)
        chunks = (b"\0" * (1 << 19) for _ in range(5))  # 2.5 MiB without Content-Length
        _refused(http.post(f"/v1/sessions/{sid}/infer", content=chunks), 413, "body_too_large")
        # the session lost nothing: a good ciphertext still gets the right answer
        answer = http.post(f"/v1/sessions/{sid}/infer", content=ct, headers=OCTETS)
        assert answer.status_code == 200
        np.testing.assert_allclose(tiny.decrypt(answer.content)[0], plain[0], atol=1e-3)
        # unknown and deleted sessions
        _refused(http.post("/v1/sessions/not-a-session/infer", content=ct), 404, "unknown_session")
        assert http.delete(f"/v1/sessions/{sid}").json()["deleted"] is True
        _refused(http.post(f"/v1/sessions/{sid}/infer", content=ct), 404, "unknown_session")
        _refused(http.delete(f"/v1/sessions/{sid}"), 404, "unknown_session")
        _refused(http.get("/v1/nothing"), 404, "not_found")
        _refused(http.put("/v1/sessions"), 405, "method_not_allowed")


def test_logs_hold_no_keys_ciphertexts_or_bytes(server, contexts):
    # runs after the tests above (file order): the server has seen contexts, ciphertexts and garbage at -v
    log = server.log_text()
    assert "POST /v1/sessions" in log  # the log is really being written at INFO
    assert "PFHE01" not in log
    assert not re.search(r"\\x[0-9a-f]{2}", log), "a byte string was logged"
    sid_pattern = re.compile(r"[A-Za-z0-9_-]{32}")
    assert not sid_pattern.search(log), "a full session id (bearer token) was logged"
