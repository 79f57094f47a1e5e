"""Limits through CLI flags: key budget (507), session count (503), TTL (410), busy pool (503), timeout (504)."""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import pytest
from serve_testlib import TINY

pytestmark = pytest.mark.fhe

OCTETS = {"Content-Type": "application/octet-stream"}


@pytest.fixture(scope="module")
def tiny_keys(programs):
    keys = programs[TINY].client()
    return keys, keys.public_context()


def _open(http: httpx.Client, context) -> httpx.Response:
    return http.post("/v1/sessions", params={"model": TINY}, content=context, headers=OCTETS)


def _error(response: httpx.Response) -> tuple[int, str]:
    return response.status_code, response.json()["error"]


def test_key_budget_gives_507_and_frees_on_delete(budget_server, programs, tiny_keys, samples):
    """The budget counts keys as they sit in memory (inflated), not the compressed upload."""
    from polyfhe.program.engines import decoded_context_bytes

    keys, ctx = tiny_keys
    x, plain = samples
    held = decoded_context_bytes(programs[TINY], len(ctx))
    assert held > len(ctx)
    with httpx.Client(base_url=budget_server.url, timeout=120) as http:
        first = _open(http, ctx)
        assert first.status_code == 201
        refused = _open(http, ctx)
        assert _error(refused) == (507, "key_budget_exceeded") and "budget" in refused.json()["detail"]
        chunks = (ctx[i: i + (1 << 20)] for i in range(0, len(ctx), 1 << 20))  # no Content-Length
        assert _error(_open(http, chunks)) == (507, "key_budget_exceeded")
        stats = http.get("/v1/stats").json()["sessions"]
        assert stats["active"] == 1 and stats["uploading"] == 0 and stats["key_bytes"] == held
        # the first session is unharmed
        sid = first.json()["session_id"]
        answer = http.post(f"/v1/sessions/{sid}/infer", content=keys.encrypt(x[0]), headers=OCTETS)
        np.testing.assert_allclose(keys.decrypt(answer.content)[0], plain[0], atol=1e-3)
        info = http.get(f"/v1/sessions/{sid}").json()  # a saved-keys client checks before it resumes
        assert (info["program_id"], info["key_bytes"], info["requests"]) == (programs[TINY].program_id, held, 1)
        assert http.delete(f"/v1/sessions/{sid}").json()["freed_key_bytes"] == held
        assert _error(http.get(f"/v1/sessions/{sid}")) == (404, "unknown_session")
        second = _open(http, ctx)
        assert second.status_code == 201
        assert 'polyfhe_key_bytes ' in http.get("/metrics").text


def test_session_limit_503_then_expiry_410(ttl_server, tiny_keys, samples):
    keys, ctx = tiny_keys
    x, plain = samples
    with httpx.Client(base_url=ttl_server.url, timeout=120) as http:
        first = _open(http, ctx)
        assert first.status_code == 201 and first.json()["ttl_s"] == 3
        sid = first.json()["session_id"]
        full = _open(http, ctx)
        assert _error(full) == (503, "too_many_sessions")
        assert 1 <= int(full.headers["Retry-After"]) <= 3
        time.sleep(3.6)
        expired = http.post(f"/v1/sessions/{sid}/infer", content=keys.encrypt(x[0]), headers=OCTETS)
        assert _error(expired) == (410, "session_expired") and "POST /v1/sessions" in expired.json()["detail"]
        assert _error(http.get(f"/v1/sessions/{sid}")) == (410, "session_expired")
        # the expired session freed its slot
        again = _open(http, ctx)
        assert again.status_code == 201
        sid = again.json()["session_id"]
        answer = http.post(f"/v1/sessions/{sid}/infer", content=keys.encrypt(x[1]), headers=OCTETS)
        np.testing.assert_allclose(keys.decrypt(answer.content)[0], plain[1], atol=1e-3)


def test_busy_pool_503_with_retry_after_and_timeout_504(slow_server, tiny_keys, samples):
    keys, ctx = tiny_keys
    x, _ = samples
    query = keys.encrypt(x[0])
    with httpx.Client(base_url=slow_server.url, timeout=120) as http:
        sid = _open(http, ctx).json()["session_id"]
        slow: dict = {}

        def first() -> None:
            with httpx.Client(base_url=slow_server.url, timeout=120) as own:
                slow["response"] = own.post(f"/v1/sessions/{sid}/infer", content=query, headers=OCTETS)

        thread = threading.Thread(target=first)
        thread.start()
        deadline = time.monotonic() + 60
        while http.get("/v1/stats").json()["workers"]["running"] < 1:
            assert time.monotonic() < deadline, "the first request never started"
            time.sleep(0.05)
        busy = http.post(f"/v1/sessions/{sid}/infer", content=query, headers=OCTETS)
        assert _error(busy) == (503, "server_busy") and int(busy.headers["Retry-After"]) >= 1
        thread.join(60)
        assert _error(slow["response"]) == (504, "request_timeout")
        stats = http.get("/v1/stats").json()["workers"]
        assert stats["rejected_total"] >= 1 and stats["timed_out_total"] >= 1
        assert http.get("/healthz").status_code == 200
