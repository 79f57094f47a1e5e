"""Fault injection against a real ``polyfhe serve``: no request, and no death of a worker, takes the server down.

- the crafted-key attack (Galois keys whose random part is zero past the bytes an earlier check sampled, then a
  ciphertext with a single non-zero residue): refused, with the server and an honest session unharmed, in both
  isolation modes (on the main before this test, the second request ended the server with SIGABRT);
- a container header nested 100,000 levels deep: 400, not a ``RecursionError``'s 500;
- a worker process killed with SIGKILL in the middle of a query: that query answers 503 ``worker_lost``, the
  session 410 ``session_lost``, the other worker's session carries on, a new worker starts, and ``ServeClient``
  re-opens a lost session by itself;
- a worker whose address space is capped below what a context needs: 507, and the worker stays up;
- one attacker looping crafted inputs while honest clients query: zero honest errors, right answers.
"""

from __future__ import annotations

import os
import signal
import struct
import threading
import time

import httpx
import numpy as np
import pytest
import seal_bombs as sb  # tests/testlib, on pytest's pythonpath
from serve_testlib import TINY, start_server

from polyfhe.program.wire import KIND_CIPHERTEXT, KIND_CONTEXT, MAGIC, pack, unpack
from polyfhe.serve.http_client import ServeClient

pytestmark = pytest.mark.fhe

OCTETS = {"Content-Type": "application/octet-stream"}


# ------------------------------------------------------------------------------------------------------------
# crafted bytes
# ------------------------------------------------------------------------------------------------------------
def crafted_context(client) -> bytes:
    """The client's public context with every Galois key's random part zeroed past its first 64 bytes."""
    box = unpack(client.public_context(), KIND_CONTEXT)
    bad = sb.bad_key(bytes(box.sections["galois_keys"]), "galois_keys", "zero_after", key=None, after=64)
    return pack(KIND_CONTEXT, box.header, {**box.sections, "galois_keys": bad})


def single_residue_ciphertext(client, x) -> bytes:
    """An input whose every residue is zero but one, in its second component."""
    data = client.encrypt(x)
    ct = unpack(data, KIND_CIPHERTEXT).sections["ct0"]
    body = bytearray(sb.inflate(ct))
    start = sb.CIPHER_DATA
    body[start:] = bytes(len(body) - start)
    meta = sb.CipherMeta.parse(bytes(body))
    struct.pack_into("<Q", body, start + meta.k * meta.n * 8 + 8, 12345)
    box = unpack(data, KIND_CIPHERTEXT)
    return pack(KIND_CIPHERTEXT, box.header, {"ct0": sb.compress(bytes(body))})


def nested_header(kind: bytes, depth: int = 100_000) -> bytes:
    raw = b"[" * depth + b"]" * depth
    return MAGIC + kind + struct.pack("<I", len(raw)) + raw


def post(url: str, path: str, body: bytes, **params) -> httpx.Response:
    return httpx.post(f"{url}{path}", content=body, headers=OCTETS, params=params, timeout=120)


def stats(url: str) -> dict:
    return httpx.get(f"{url}/v1/stats", timeout=10).json()


def alive(server) -> bool:
    return server.proc.poll() is None and httpx.get(f"{server.url}/healthz", timeout=10).status_code == 200


# ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["process", "thread"])
def attacked(request, programs, tmp_path_factory):
    server = start_server(programs["root"], tmp_path_factory.mktemp("attack") / "server.log",
                          "--isolation", request.param, "--max-context-mb", "64", "--max-ciphertext-mb", "4")
    yield server
    server.stop()


def test_the_crafted_key_attack_is_refused_and_the_server_keeps_serving(attacked, programs, samples):
    x, plain = samples
    attacker = programs[TINY].client()
    with ServeClient(attacked.url) as api, api.open_session(TINY) as honest:
        refused = post(attacked.url, "/v1/sessions", crafted_context(attacker), model=TINY)
        assert refused.status_code == 400 and refused.json()["error"] == "bad_context", refused.text
        assert "zero polynomial" in refused.json()["detail"]
        # the attacker's own valid session, then the ciphertext that made SEAL throw through ctypes
        sid = post(attacked.url, "/v1/sessions", attacker.public_context(), model=TINY).json()["session_id"]
        answer = post(attacked.url, f"/v1/sessions/{sid}/infer", single_residue_ciphertext(attacker, x[:1]))
        assert answer.status_code in (400, 422), answer.text
        assert answer.json()["error"] in ("bad_ciphertext", "evaluation_refused")
        assert alive(attacked)
        np.testing.assert_allclose(honest.infer(x[0]).logits, plain[0], atol=1e-3)
    assert "Traceback" not in attacked.log_text()


def test_a_deeply_nested_header_is_a_bad_request(attacked, programs):
    for path, kind, params in (("/v1/sessions", KIND_CONTEXT, {"model": TINY}),):
        response = post(attacked.url, path, nested_header(kind), **params)
        assert response.status_code == 400, response.text
        assert "nested deeper" in response.json()["detail"]
    client = programs[TINY].client()
    sid = post(attacked.url, "/v1/sessions", client.public_context(), model=TINY).json()["session_id"]
    response = post(attacked.url, f"/v1/sessions/{sid}/infer", nested_header(KIND_CIPHERTEXT))
    assert response.status_code == 400 and "nested deeper" in response.json()["detail"], response.text
    assert alive(attacked)


# ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_workers(programs, tmp_path_factory):
    """Two worker processes; every evaluation takes 3 s (time to kill a worker in the middle of one)."""
    server = start_server(programs["root"], tmp_path_factory.mktemp("kill") / "server.log",
                          "--worker-processes", "2", "--test-eval-delay", "3", "--max-context-mb", "64")
    yield server
    server.stop()


def _worker_pids(url: str) -> list[int]:
    return [w["pid"] for w in stats(url)["host"]["processes"]]


def _wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError("condition not reached in time")


def test_a_worker_killed_mid_query_costs_only_its_own_sessions(two_workers, programs, samples):
    x, plain = samples
    url = two_workers.url
    first, second = programs[TINY].client(), programs[TINY].client()
    sid_a = post(url, "/v1/sessions", first.public_context(), model=TINY).json()["session_id"]  # worker 0
    sid_b = post(url, "/v1/sessions", second.public_context(), model=TINY).json()["session_id"]  # worker 1
    pids = _worker_pids(url)
    assert [w["sessions"] for w in stats(url)["host"]["processes"]] == [1, 1]

    results: dict[str, httpx.Response] = {}
    in_flight = threading.Thread(target=lambda: results.update(
        a=post(url, f"/v1/sessions/{sid_a}/infer", first.encrypt(x[:1]))))
    other = threading.Thread(target=lambda: results.update(
        b=post(url, f"/v1/sessions/{sid_b}/infer", second.encrypt(x[1:2]))))
    in_flight.start(), other.start()
    time.sleep(1.5)  # both are inside their 3 s evaluations now
    os.kill(pids[0], signal.SIGKILL)
    in_flight.join(60), other.join(60)

    assert results["a"].status_code == 503 and results["a"].json()["error"] == "worker_lost", results["a"].text
    assert results["b"].status_code == 200, results["b"].text
    np.testing.assert_allclose(second.decrypt(results["b"].content)[0], plain[1], atol=1e-3)
    lost = post(url, f"/v1/sessions/{sid_a}/infer", first.encrypt(x[:1]))
    assert lost.status_code == 410 and lost.json()["error"] == "session_lost", lost.text
    assert alive(two_workers)

    _wait_for(lambda: all(w["alive"] for w in stats(url)["host"]["processes"]))
    after = stats(url)
    assert after["host"]["restarts_total"] == 1 and _worker_pids(url)[0] != pids[0]
    assert after["sessions"]["lost_total"] == 1
    metrics = httpx.get(f"{url}/metrics").text
    assert "polyfhe_worker_restarts_total 1\n" in metrics and "polyfhe_sessions_lost_total 1\n" in metrics
    assert "polyfhe_worker_processes_alive 2\n" in metrics
    # the same keys open a new session; ServeClient does it by itself when its session is lost
    with ServeClient(url) as api, api.open_session(TINY, keys=first) as session:
        holder = [w["pid"] for w in stats(url)["host"]["processes"] if w["sessions"]]
        victim = holder[0] if len(holder) == 1 else _worker_pids(url)[0]
        os.kill(victim, signal.SIGKILL)
        _wait_for(lambda: all(w["alive"] for w in stats(url)["host"]["processes"])
                  and victim not in _worker_pids(url))
        np.testing.assert_allclose(session.infer(x[2]).logits, plain[2], atol=1e-3)
        assert session.uploads == 2
    assert alive(two_workers)


def test_a_worker_out_of_memory_refuses_the_request_and_stays_up(programs, tmp_path):
    server = start_server(programs["root"], tmp_path / "server.log", "--worker-processes", "1", "--worker-memory-mb", "4",
                          "--max-context-mb", "64")
    try:
        pid = _worker_pids(server.url)[0]
        client = programs[TINY].client()
        for _ in range(2):
            response = post(server.url, "/v1/sessions", client.public_context(), model=TINY)
            assert response.status_code == 507 and response.json()["error"] == "out_of_memory", response.text
        assert alive(server) and _worker_pids(server.url) == [pid]  # the same worker: it never died
        assert stats(server.url)["host"]["processes"][0]["address_space_limit"] > 0
    finally:
        server.stop()


# ------------------------------------------------------------------------------------------------------------
def test_an_attacker_looping_crafted_inputs_beside_honest_clients(attacked, programs, samples):
    """Four honest clients query while one attacker sends every crafted input in turn: the honest ones see no
    error and right answers; the attacker sees only 4xx."""
    x, plain = samples
    stop = threading.Event()
    attacker_codes: list[int] = []
    honest_errors: list[str] = []
    attacker = programs[TINY].client()
    sid = post(attacked.url, "/v1/sessions", attacker.public_context(), model=TINY).json()["session_id"]
    bad_inputs = [("/v1/sessions", crafted_context(attacker), {"model": TINY}),
                  ("/v1/sessions", nested_header(KIND_CONTEXT), {"model": TINY}),
                  (f"/v1/sessions/{sid}/infer", single_residue_ciphertext(attacker, x[:1]), {}),
                  (f"/v1/sessions/{sid}/infer", nested_header(KIND_CIPHERTEXT), {}),
                  (f"/v1/sessions/{sid}/infer", os.urandom(4096), {})]

    def attack() -> None:
        i = 0
        while not stop.is_set():
            path, body, params = bad_inputs[i % len(bad_inputs)]
            attacker_codes.append(post(attacked.url, path, body, **params).status_code)
            i += 1

    def honest(k: int) -> None:
        try:
            with ServeClient(attacked.url) as api, api.open_session(TINY) as session:
                for j in range(3):
                    i = (k + j) % len(x)
                    got = session.infer(x[i]).logits
                    if not np.allclose(got, plain[i], atol=1e-3):
                        honest_errors.append(f"client {k}: wrong logits for sample {i}")
        except Exception as exc:  # noqa: BLE001 - every honest failure is collected and reported
            honest_errors.append(f"client {k}: {exc}")

    thread = threading.Thread(target=attack)
    thread.start()
    clients = [threading.Thread(target=honest, args=(k,)) for k in range(4)]
    for c in clients:
        c.start()
    for c in clients:
        c.join(600)
    stop.set()
    thread.join(120)
    assert honest_errors == []
    assert attacker_codes and all(400 <= c < 500 for c in attacker_codes), sorted(set(attacker_codes))
    assert alive(attacked)
