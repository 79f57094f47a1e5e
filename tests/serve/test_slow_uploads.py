"""Uploads that cannot lock others out (issue 55): a declared length is not a reservation.

Attackers on other loopback addresses open session uploads that declare 4 GiB, or the most a context for the
model can have, and then trickle a byte a second. While they hang, an honest client opens a session and gets a
correct answer, on ``polyfhe serve`` (a real server process) and on the ``--ray`` front (its routes and session
backend, served by uvicorn over replicas simulated in this process as :mod:`raylib` does). Then the minimum
upload rate cuts a trickle, and the per-client limits answer 429.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from serve_testlib import TINY, free_port, start_server

from polyfhe.program.engines import max_context_bytes
from polyfhe.serve.http_client import ServeClient, ServeError


def _bench_trickle():
    """The load bench's slow-upload client (``bench/slow_uploads.py``: standard library only), loaded by path so
    that bench/ never joins ``sys.path``."""
    path = Path(__file__).resolve().parents[2] / "bench" / "slow_uploads.py"
    spec = importlib.util.spec_from_file_location("bench_slow_uploads_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Trickle


Trickle = _bench_trickle()

pytestmark = pytest.mark.fhe

GIB4 = 4 << 30


@contextmanager
def attack(host: str, port: int, bound: int):
    """Two uploads declaring 4 GiB from 127.0.0.2 and two declaring the model's bound from 127.0.0.3."""
    path = f"/v1/sessions?model={TINY}"
    trickles = [Trickle(host, port, path, GIB4, "127.0.0.2") for _ in range(2)] + \
        [Trickle(host, port, path, bound, "127.0.0.3") for _ in range(2)]
    try:
        yield trickles
    finally:
        for t in trickles:
            t.close()


def _honest_while_attacked(url: str, programs, samples) -> None:
    x, plain = samples
    host, port = url.removeprefix("http://").split(":")
    bound = max_context_bytes(programs[TINY])
    with attack(host, int(port), bound) as trickles:
        assert [t.status(wait_s=10) for t in trickles[:2]] == [413, 413]  # refused before a byte is read
        assert b"the most a public context for model tiny can have" in trickles[0].answer
        time.sleep(2)  # the bound-sized ones are being read, a byte a second
        with ServeClient(url) as api, api.open_session(TINY) as session:
            got = session.infer(x[0]).logits
        np.testing.assert_allclose(got, plain[0], atol=1e-3)
        assert [t.status() for t in trickles[2:]] == [None, None]  # still hanging: the honest client got in anyway


@pytest.fixture(scope="module")
def attacked_server(programs, tmp_path_factory):
    """The default context limit and key budget (4 GiB each) and a long grace, so the trickles hang throughout."""
    server = start_server(programs["root"], tmp_path_factory.mktemp("log") / "server.log", "--upload-grace", "120",
                          "--worker-processes", "1")
    yield server
    server.stop()


def test_slow_uploads_do_not_lock_out_an_honest_client(attacked_server, programs, samples) -> None:
    _honest_while_attacked(attacked_server.url, programs, samples)


def test_slow_uploads_do_not_lock_out_an_honest_client_on_the_ray_front(programs, samples, tmp_path) -> None:
    import uvicorn
    from raylib import ray_front

    app, _, _ = ray_front(programs["root"], tmp_path / "keys", upload_grace_s=120.0)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.started
        _honest_while_attacked(f"http://127.0.0.1:{port}", programs, samples)
    finally:
        server.should_exit = True
        thread.join(timeout=15)


@pytest.fixture(scope="module")
def strict_server(programs, tmp_path_factory):
    """A 64 KiB/s floor after 1 s, one upload and one session per client."""
    server = start_server(programs["root"], tmp_path_factory.mktemp("log") / "server.log", "--upload-grace", "1",
                          "--min-upload-rate", "64", "--max-uploads-per-client", "1", "--max-sessions-per-client",
                          "1", "--worker-processes", "1")
    yield server
    server.stop()


def test_a_trickle_is_cut_at_the_minimum_rate(strict_server, programs) -> None:
    host, port = strict_server.url.removeprefix("http://").split(":")
    t0 = time.monotonic()
    trickle = Trickle(host, int(port), f"/v1/sessions?model={TINY}", max_context_bytes(programs[TINY]),
                      "127.0.0.4")
    try:
        assert trickle.status(wait_s=20) == 408
        assert b"upload_too_slow" in trickle.answer and time.monotonic() - t0 < 10
    finally:
        trickle.close()


def test_per_client_uploads_and_sessions_answer_429(strict_server, programs, samples) -> None:
    host, port = strict_server.url.removeprefix("http://").split(":")
    x, plain = samples
    with ServeClient(strict_server.url) as api, api.open_session(TINY) as session:
        # a second session of the same client: over its quota of one
        with pytest.raises(ServeError) as refused:
            api.request("POST", f"/v1/sessions?model={TINY}", content=session.keys.public_context(),
                        headers={"Content-Type": "application/octet-stream"})
        assert (refused.value.status, refused.value.code) == (429, "session_quota")
        assert refused.value.retry_after is not None
        np.testing.assert_allclose(session.infer(x[1]).logits, plain[1], atol=1e-3)  # the first still works
    path = f"/v1/sessions?model={TINY}"
    first = Trickle(host, int(port), path, 1000, "127.0.0.5")
    try:
        time.sleep(0.5)
        second = Trickle(host, int(port), path, 1000, "127.0.0.5")  # one upload at once per client
        try:
            assert second.status(wait_s=10) == 429 and b"too_many_uploads" in second.answer
            assert first.status() is None
        finally:
            second.close()
    finally:
        first.close()
