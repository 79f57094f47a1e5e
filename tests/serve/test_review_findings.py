"""The review's smaller findings (issue 55, item 6), each with the test that would have caught it."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from polyfhe.serve.errors import ApiError
from polyfhe.serve.keystore import valid_session_id
from polyfhe.serve.worker_count import MAX_AUTO_WORKERS, WORKER_BASE_BYTES, auto_worker_processes


def test_session_ids_are_matched_whole() -> None:
    good = "A" * 31 + "b"
    assert valid_session_id(good)
    for bad in (good + "\n", good + "x", "\n" + good, good[:-1], good[:-1] + "/", 42):
        assert not valid_session_id(bad), repr(bad)


# ---------------------------------------------------------------------------------------------- replica budget
@dataclass
class _Record:
    session_id: str
    key_bytes: int
    model: str = "m"
    program_id: str = "p"
    state: str = "live"


class _Store:
    def __init__(self, records: dict[str, _Record]) -> None:
        self.records = records

    def record(self, session_id: str) -> _Record | None:
        return self.records.get(session_id)

    def context(self, record: _Record) -> bytes:
        return b"ctx"


def test_concurrent_replica_loads_stay_within_the_key_budget(monkeypatch) -> None:
    """Two sessions of 60 bytes each on a replica with 100: loaded at once, they must never be held together."""
    from polyfhe.serve import replica

    peak, lock = [0], threading.Lock()

    def slow_server(*_args):
        time.sleep(0.5)  # both loads are under way at once
        with lock:
            peak[0] = max(peak[0], cache_bytes())
        return SimpleNamespace(close=lambda: None)

    monkeypatch.setattr(replica, "open_server", slow_server)
    registry = SimpleNamespace(get=lambda name: SimpleNamespace(program=SimpleNamespace(program_id="p")))
    store = _Store({"a" * 32: _Record("a" * 32, 60), "b" * 32: _Record("b" * 32, 60)})
    cache = replica.SessionCache(registry, store, 100, 1 << 20, 1 << 20, ttl_s=60)

    def cache_bytes() -> int:
        with cache._lock:
            return sum(s.key_bytes for s in cache._held.values())

    errors: list[BaseException] = []

    def load(sid: str) -> None:
        try:
            cache.load(sid)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=load, args=(sid,)) for sid in store.records]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    assert cache.held_bytes <= 100 and len(cache.held()) == 1 and cache.evictions_total == 1
    assert peak[0] <= 100
    with pytest.raises(ApiError) as too_big:
        store.records["c" * 32] = _Record("c" * 32, 101)
        cache.load("c" * 32)
    assert too_big.value.status == 507


# ---------------------------------------------------------------------------------------------- worker process
class _Proc:
    def __init__(self) -> None:
        self.killed = False
        self.exitcode = None

    def is_alive(self) -> bool:
        return not self.killed

    def kill(self) -> None:
        self.killed = True

    def join(self, timeout=None) -> None:
        return None


class _DesyncedPipe:
    def recv(self):
        raise OSError("a payload frame of 9999999 bytes where at most 12 remain")


def test_a_worker_out_of_step_is_killed_before_it_is_replaced() -> None:
    from polyfhe.serve.process_host import _WorkerProcess

    worker = _WorkerProcess.__new__(_WorkerProcess)
    exited = []
    worker.spec, worker.pid, worker.conn, worker.proc = SimpleNamespace(index=0), 123, _DesyncedPipe(), _Proc()
    worker._lock, worker._pending, worker._on_exit = threading.Lock(), {}, exited.append
    worker._scratch, worker.alive = memoryview(bytearray(16)), True
    worker._read()
    assert worker.proc.killed and exited == [worker] and not worker.alive


# ---------------------------------------------------------------------------------------------- defaults
def test_more_than_one_worker_by_default_where_memory_allows(tmp_path: Path) -> None:
    program = tmp_path / "p"
    program.mkdir()
    (program / "arrays.npz").write_bytes(b"0" * (1 << 20))
    roomy = auto_worker_processes([program], plaintext_bytes=1 << 30, cores=2, available=16 << 30)
    assert roomy.processes == 2 and "2 cores" in roomy.reason
    assert auto_worker_processes([program], 0, cores=64, available=1 << 40).processes == MAX_AUTO_WORKERS
    tight = auto_worker_processes([program], 0, cores=8, available=3 * WORKER_BASE_BYTES)
    assert tight.processes == 1
    (program / "big.npz").write_bytes(b"")
    assert auto_worker_processes([program], 0, cores=4, available=None).processes == 4


def test_bearer_tokens_over_plain_http_on_a_public_address_are_warned(tmp_path, caplog) -> None:
    from polyfhe.commands.serve import warn_plain_tokens
    from polyfhe.serve.config import ServeConfig

    with_tokens = ServeConfig(tmp_path, auth_token_file=tmp_path / "tokens")
    with caplog.at_level(logging.WARNING, logger="polyfhe.commands.serve"):
        for host, tls in (("127.0.0.1", False), ("localhost", False), ("::1", False), ("0.0.0.0", True)):
            warn_plain_tokens(with_tokens, host, tls)
        warn_plain_tokens(ServeConfig(tmp_path), "0.0.0.0", False)  # no tokens: nothing to leak
        assert not caplog.records
        warn_plain_tokens(with_tokens, "0.0.0.0", False)
    assert len(caplog.records) == 1 and "plain HTTP" in caplog.records[0].getMessage()
