"""The worker process of ``polyfhe serve``: holds sessions (public keys) and evaluates ciphertexts for them.

It loads the programs folder itself, tells the parent it is ready, then answers requests from the parent's pipe on
a small thread pool. Requests are ``(request id, op, args, payload bytes)`` followed by the payload in chunks of at
most :data:`CHUNK` bytes (so a body this worker cannot hold is read and dropped, answered 507, and the worker goes
on); replies are ``(request id, status, meta, has_payload)``, status ``ok``, ``refused`` (an :class:`ApiError`'s
fields: the client's fault) or ``failed`` (a bug: the exception's type only, never its message, which may quote
input).

The worker asks the kernel's OOM killer to take it before the HTTP server (``oom_score_adj``) and, when the server
sets one, limits its own address space (``RLIMIT_AS``) to what it holds after loading plus a fixed headroom, so a
request that needs more memory fails with ``MemoryError`` in this process, not in the server's. Its ready message
carries its environment stamp (:func:`worker_stamp`), which the server checks: a worker restarted after polyfhe was
upgraded under the running server is refused. Framing and limits are :mod:`polyfhe.workers`'.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polyfhe.procinfo import proc_bytes
from polyfhe.serve.errors import ApiError
from polyfhe.serve.hosts import engine_call, open_server
from polyfhe.workers.framing import receive_chunks, send_chunks
from polyfhe.workers.limits import limit_address_space, yield_to_oom_killer
from polyfhe.workers.stamp import environment_stamp

__all__ = ["CHUNK", "PROTOCOL", "WorkerSpec", "receive_payload", "send_payload", "worker_main", "worker_stamp"]

log = logging.getLogger(__name__)

CHUNK = 16 << 20  # payload bytes per pipe message
SCRATCH = 1 << 16  # bytes of the buffer a body that does not fit is read into and dropped
PROTOCOL = "serve-worker-1"  # what a worker's stamp names: the messages of this module and process_host


@functools.cache
def worker_stamp() -> dict[str, str]:
    """This process's environment stamp, read once: the server's from its start, a worker's at its own."""
    return environment_stamp(PROTOCOL, packages=("polyfhe",))


def send_payload(conn: Any, payload: bytes | bytearray | memoryview) -> None:
    """The payload in :data:`CHUNK`-sized messages (the receiver knows the total from the request)."""
    send_chunks(conn, payload, CHUNK)


def receive_payload(conn: Any, size: int, scratch: memoryview) -> bytearray | None:
    """``size`` payload bytes of :func:`send_payload` in one buffer, or None when this process cannot hold them
    (read and dropped: the pipe stays in step either way); ``OSError`` when the peer is out of step."""
    return receive_chunks(conn, size, scratch, CHUNK)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs, sent once when it starts (picklable: the worker is spawned, not forked)."""

    index: int
    programs_dir: Path
    plaintext_cache_bytes: int | None
    max_context_bytes: int
    max_ciphertext_bytes: int
    threads: int  # requests this worker runs at once
    memory_headroom_bytes: int | None  # RLIMIT_AS above the loaded worker's size; None: no limit
    log_level: int = logging.WARNING
    warm: bool = False  # encode every SEAL program's plaintexts before answering (``polyfhe serve --warm``)
    eval_delay_s: float = 0.0  # testing aid: every evaluation sleeps this long first (a slow model)


def _limit_memory(headroom: int | None) -> int | None:
    """Cap the address space at its current size plus ``headroom``; the cap in bytes, or None."""
    if headroom is None:
        return None
    size = proc_bytes("/proc/self/status", "VmSize")
    if size is None:
        log.warning("cannot read this worker's size; its memory is not limited")
        return None
    return limit_address_space(size + headroom, within_hard=False)


class _Worker:
    def __init__(self, conn: Any, spec: WorkerSpec, registry: Any) -> None:
        self.conn, self.spec, self.registry = conn, spec, registry
        self.sessions: dict[str, Any] = {}
        self.send_lock = threading.Lock()
        self.scratch = memoryview(bytearray(SCRATCH))  # made before the address space is capped
        self.pool = ThreadPoolExecutor(max_workers=spec.threads, thread_name_prefix=f"worker{spec.index}")
        for future in [self.pool.submit(time.sleep, 0.01) for _ in range(spec.threads)]:
            future.result()  # every thread exists before the address space is capped

    def reply(self, rid: int, status: str, meta: dict, payload: bytes | None = None) -> None:
        with self.send_lock:
            self.conn.send((rid, status, meta, None if payload is None else len(payload)))
            if payload is not None:
                send_payload(self.conn, payload)

    def handle(self, rid: int, op: str, args: tuple, payload: bytes | None) -> None:
        try:
            meta, out = self._dispatch(op, args, payload)
            self.reply(rid, "ok", meta, out)
        except ApiError as exc:
            self.reply(rid, "refused", {"status": exc.status, "code": exc.code, "detail": exc.detail,
                                        "retry_after": exc.retry_after, "extra": exc.extra})
        except BaseException as exc:  # noqa: BLE001 - a bug, not the bytes: its type only (messages may quote input)
            log.error("worker %d: %s failed: %s", self.spec.index, op, type(exc).__name__)
            self.reply(rid, "failed", {"type": type(exc).__name__})

    def _dispatch(self, op: str, args: tuple, payload: bytes | None) -> tuple[dict, bytes | None]:
        if op == "open":
            session_id, model_name = args
            model = self.registry.get(model_name)
            if model is None:
                raise ApiError(404, "unknown_model", f"no model named {model_name!r} in this worker")
            t0 = time.perf_counter()
            server = engine_call(open_server, "context", model.program, payload, self.spec.max_context_bytes,
                                 self.spec.max_ciphertext_bytes)
            self.sessions[session_id] = server
            return {"seconds": time.perf_counter() - t0}, None
        if op == "run":
            server = self.sessions.get(args[0])
            if server is None:
                raise ApiError(410, "session_lost", "this worker no longer holds the session's keys; open a new "
                               "session with the same public context")
            if self.spec.eval_delay_s:
                time.sleep(self.spec.eval_delay_s)
            out = engine_call(server.run, "ciphertext", payload)
            return {}, out
        if op == "close":
            server = self.sessions.pop(args[0], None)
            if server is not None and hasattr(server, "close"):
                server.close()
            return {"closed": server is not None}, None
        raise ApiError(400, "bad_worker_request", f"unknown worker operation {op!r}")

    def serve(self) -> None:
        while True:
            try:
                rid, op, args, size = self.conn.recv()
                payload = None if size is None else receive_payload(self.conn, size, self.scratch)
            except (EOFError, OSError):
                return  # the parent went away (or closed us): nothing left to answer
            if size is not None and payload is None:
                log.warning("worker %d: a %d-byte body does not fit this worker's memory", self.spec.index, size)
                self.reply(rid, "refused", {"status": 507, "code": "out_of_memory", "retry_after": 30, "extra": {},
                                            "detail": f"the server's worker has no memory for a {size}-byte body "
                                                      "now; retry later or use a smaller program"})
                continue
            self.pool.submit(self.handle, rid, op, args, payload)


def _warm(registry: Any) -> list[dict]:
    """Each CKKS program's plaintexts encoded now: (name, encoded, seconds, bytes) per program."""
    from polyfhe.program.engines import warm_plaintexts

    out = []
    for name in registry.names():
        program = registry.models[name].program
        if program.scheme == "ckks":
            encoded, seconds, held = warm_plaintexts(program)
            out.append({"name": name, "encoded": encoded, "seconds": seconds, "bytes": held})
    return out


def worker_main(conn: Any, spec: WorkerSpec) -> None:
    """Entry point of a spawned worker; returns (the process exits) when the parent closes the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the server, which then stops its workers
    logging.basicConfig(level=spec.log_level, format=f"[worker {spec.index}] %(levelname)s %(name)s: %(message)s")
    yield_to_oom_killer()
    try:
        from polyfhe.serve.registry import Registry

        registry = Registry(spec.programs_dir, plaintext_cache_bytes=spec.plaintext_cache_bytes)
        warmed = _warm(registry) if spec.warm else []
        worker = _Worker(conn, spec, registry)
        limit = _limit_memory(spec.memory_headroom_bytes)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which refuses to start
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", {"pid": os.getpid(), "address_space_limit": limit, "models": registry.names(),
                         "warmed": warmed, "stamp": worker_stamp()}))
    worker.serve()
    os._exit(0)  # no interpreter teardown with engine threads and keys still around
