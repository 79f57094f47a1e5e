"""Units of the server that need no process: session store (TTL, budget, slots), work pool, upload checks."""

from __future__ import annotations

import asyncio
import threading

import pytest

from polyfhe.program.wire import KIND_CIPHERTEXT, KIND_CONTEXT, KIND_SECRET, pack
from polyfhe.serve.config import ServeConfig
from polyfhe.serve.errors import ApiError
from polyfhe.serve.sessions import SessionStore
from polyfhe.serve.workers import WorkPool


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_session_store_ttl_budget_and_slots():
    clock = Clock()
    store = SessionStore(ttl_s=10, max_sessions=2, budget_bytes=100, clock=clock)
    a = store.add(store.reserve(40), "m", object(), 40)
    r = store.reserve(0)  # a chunked upload: grows as it streams
    store.grow(r, 50)
    with pytest.raises(ApiError) as exc:
        store.grow(r, 61)  # 40 + 61 > 100
    assert exc.value.status == 507
    waiting = store.reserve(0)  # an upload still arriving holds no slot, only the bytes it sent
    store.claim(r)  # r's body is complete: it takes the second slot
    with pytest.raises(ApiError) as exc:
        store.claim(waiting)  # one session and one claimed upload hold both slots
    assert (exc.value.status, exc.value.code) == (503, "too_many_sessions") and exc.value.retry_after == 10
    with pytest.raises(ApiError) as exc:
        store.reserve(0)
    assert exc.value.code == "too_many_sessions"
    store.release(waiting)
    store.release(r)
    assert store.used_bytes == 40
    with pytest.raises(ApiError) as exc:
        store.reserve(101)
    assert exc.value.status == 507 and "alone exceeds" in exc.value.detail
    clock.now = 5
    store.done(store.acquire(a.id))  # use refreshes the TTL
    clock.now = 14
    assert store.acquire(a.id) is a  # busy from here on: not expired under a running request
    clock.now = 40
    assert store.sweep() == 0
    store.done(a)
    clock.now = 51
    assert store.sweep() == 1 and store.used_bytes == 0
    with pytest.raises(ApiError) as exc:
        store.acquire(a.id)
    assert (exc.value.status, exc.value.code) == (410, "session_expired")
    with pytest.raises(ApiError) as exc:
        store.delete("never")
    assert (exc.value.status, exc.value.code) == (404, "unknown_session")


def test_work_pool_bounds_and_timeout():
    async def scenario() -> None:
        pool = WorkPool(workers=1, queue=1)
        gate = threading.Event()
        loop = asyncio.get_running_loop()
        far = loop.time() + 30
        first = asyncio.create_task(pool.run(gate.wait, 10, deadline=far, what="a"))
        second = asyncio.create_task(pool.run(lambda: 7, deadline=far, what="b"))
        await asyncio.sleep(0.05)
        with pytest.raises(ApiError) as exc:
            await pool.run(lambda: 0, deadline=far, what="c")
        assert exc.value.status == 503 and exc.value.retry_after >= 1
        gate.set()
        assert await first is True and await second == 7
        with pytest.raises(ApiError) as exc:
            await pool.run(threading.Event().wait, 0.5, deadline=loop.time() + 0.1, what="slow")
        assert exc.value.status == 504
        await asyncio.sleep(0.6)
        assert pool.pending == 0 and pool.stats()["timed_out_total"] == 1
        pool.shutdown()

    asyncio.run(scenario())


def test_config_refuses_nonsense_limits(tmp_path):
    with pytest.raises(ValueError, match="max_sessions"):
        ServeConfig(tmp_path, max_sessions=0)
    with pytest.raises(ValueError, match="session_ttl_s"):
        ServeConfig(tmp_path, session_ttl_s=0)


def test_upload_check_names_the_problem(programs):
    from serve_testlib import TINY

    from polyfhe.serve.uploads import check_upload

    prog = programs[TINY]

    def code(data: bytes, kind: bytes) -> tuple[int, str]:
        with pytest.raises(ApiError) as exc:
            check_upload(data, kind, prog)
        return exc.value.status, exc.value.code

    assert code(b"hello", KIND_CONTEXT) == (400, "not_polyfhe_bytes")
    assert code(pack(KIND_SECRET, {}, {}), KIND_CONTEXT) == (400, "secret_key_refused")
    assert code(pack(KIND_CIPHERTEXT, {}, {}), KIND_CONTEXT) == (400, "wrong_kind")
    assert code(pack(KIND_CONTEXT, {"program_id": "x"}, {}), KIND_CONTEXT) == (422, "wrong_program")
    assert code(pack(KIND_CONTEXT, {"program_id": prog.program_id, "params": "y"}, {}),
                KIND_CONTEXT) == (422, "wrong_parameters")
