"""``create_app(config)``: the demo server with sessions held by this machine (``polyfhe serve``).

The routes are :func:`polyfhe.serve.routes.build_app`'s; here they get :class:`LocalSessions`: the session store
(TTL, session limit, key budget), a bounded thread pool for CPU-bound work, and a host that holds the keys (worker
processes, or this process). ``polyfhe serve --ray`` gives the same routes another backend
(:mod:`polyfhe.serve.ray_sessions`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

from fastapi import FastAPI

from polyfhe.runtime.plaintexts import DEFAULT_PLAINTEXT_BYTES
from polyfhe.serve.auth import TokenAuth
from polyfhe.serve.config import ServeConfig
from polyfhe.serve.hosts import Host, ThreadHost
from polyfhe.serve.metrics import Metrics
from polyfhe.serve.registry import Model, Registry
from polyfhe.serve.routes import Evaluated, Opened, Served, SessionRef, build_app
from polyfhe.serve.sessions import Reservation, Session, SessionStore
from polyfhe.serve.workers import WorkPool

__all__ = ["LocalSessions", "create_app", "make_host"]

log = logging.getLogger(__name__)


def make_host(config: ServeConfig, registry: Registry, on_lost, warm: bool = False) -> Host:
    """The host of ``config.isolation``: worker processes (each with its share of the plaintext budget) or this
    process."""
    if config.isolation == "thread":
        return ThreadHost(config.max_context_bytes, config.max_ciphertext_bytes, config.eval_delay_s)
    from polyfhe.serve.process_host import ProcessHost
    from polyfhe.serve.worker_main import WorkerSpec

    ckks = sum(1 for m in registry.models.values() if m.program.scheme == "ckks")
    per_model = registry.plaintext_cache_bytes if registry.plaintext_cache_bytes is not None else \
        DEFAULT_PLAINTEXT_BYTES // max(1, ckks)
    processes = worker_processes(config, registry, per_model * ckks)
    spec = WorkerSpec(0, registry.root, per_model // processes, config.max_context_bytes,
                      config.max_ciphertext_bytes, config.max_concurrency, config.worker_memory_headroom_bytes,
                      logging.getLogger().getEffectiveLevel(), warm, config.eval_delay_s)
    return ProcessHost(spec, processes, on_lost)


def worker_processes(config: ServeConfig, registry: Registry, plaintext_bytes: int) -> int:
    """``config.worker_processes``, or the count cores and memory allow (logged with why)."""
    if config.worker_processes is not None:
        return config.worker_processes
    from polyfhe.serve.worker_count import auto_worker_processes

    choice = auto_worker_processes([m.folder for m in registry.models.values() if m.folder], plaintext_bytes)
    log.info("worker processes: %s", choice.reason)
    return choice.processes


class _Reserved:
    """A :class:`Reservation` in the store, grown as the upload arrives (507 past the key budget)."""

    def __init__(self, sessions: SessionStore, reservation: Reservation) -> None:
        self.sessions, self.reservation = sessions, reservation

    def grow(self, nbytes: int) -> None:
        self.sessions.grow(self.reservation, nbytes)


class LocalSessions:
    """Sessions in this server: the store decides admission and expiry, the host holds the keys, the pool runs
    context loads and evaluations off the event loop."""

    def __init__(self, config: ServeConfig, registry: Registry, warm: bool = False) -> None:
        def drop(session: Session) -> None:  # keys freed off the caller's thread (it holds the store's lock)
            threading.Thread(target=self.host.close, args=(session.handle,), daemon=True).start()

        self.sessions = SessionStore(config.session_ttl_s, config.max_sessions, config.key_budget_bytes,
                                     config.expired_memory, on_drop=drop, client_quota=config.session_quota)
        self.host = make_host(config, registry, self.sessions.lose, warm)  # drop() finds it here
        self.pool = WorkPool(config.max_concurrency, config.max_queue)
        self.config = config

    # ------------------------------------------------------------------------------ work on the pool's threads
    def _open(self, reservation: Reservation, model: Model, body: bytearray, key_bytes: int,
              owner: str | None) -> tuple[Session, float]:
        """Load the keys on the host and register the session here, on the worker thread: a session whose request
        timed out meanwhile is still registered (and expires), never left on a host unknown to the store."""
        t0 = time.perf_counter()
        session_id = self.sessions.new_id()
        handle = self.host.open(session_id, model, body)
        session = self.sessions.add(reservation, model.name, handle, key_bytes, session_id, owner)
        return session, time.perf_counter() - t0

    def _evaluate(self, session: Session, body: bytearray) -> tuple[bytes, float]:
        t0 = time.perf_counter()
        out = self.host.run(session.handle, body)
        return out, time.perf_counter() - t0

    # ------------------------------------------------------------------------------ SessionBackend
    @contextlib.contextmanager
    def admit(self, client: str) -> Iterator[_Reserved]:
        reservation = self.sessions.reserve(0, client)
        try:
            yield _Reserved(self.sessions, reservation)
        finally:
            self.sessions.release(reservation)

    async def open(self, admission: _Reserved, model: Model, body: bytearray, key_bytes: int, owner: str | None,
                   deadline: float) -> Opened:
        self.sessions.claim(admission.reservation)  # the body is complete and checked: now it takes a slot
        session, load_s = await self.pool.run(self._open, admission.reservation, model, body, key_bytes, owner,
                                              deadline=deadline, what="loading the public context")
        return Opened(session.id, load_s)

    async def acquire(self, session_id: str, owner: str | None) -> SessionRef:
        session = self.sessions.acquire(session_id, owner)
        return SessionRef(session.id, session.model, session.handle.program, session)

    async def run(self, session: SessionRef, body: bytearray, deadline: float) -> Evaluated:
        out, seconds = await self.pool.run(self._evaluate, session.handle, body, deadline=deadline,
                                           what=f"inference in session {session.short_id()}")
        return Evaluated(out, seconds)

    async def done(self, session: SessionRef) -> None:
        self.sessions.done(session.handle)

    async def info(self, session_id: str, owner: str | None) -> dict:
        session = self.sessions.touch(session_id, owner)
        return {"session_id": session.id, "model": session.model, "program_id": session.handle.program.program_id,
                "ttl_s": self.config.session_ttl_s, "requests": session.requests, "key_bytes": session.key_bytes}

    async def delete(self, session_id: str, owner: str | None) -> dict:
        session = self.sessions.delete(session_id, owner)
        return {"deleted": True, "model": session.model, "freed_key_bytes": session.key_bytes,
                "requests": session.requests}

    def stats(self) -> dict:
        return {"sessions": self.sessions.stats(), "workers": self.pool.stats(), "host": self.host.stats()}

    async def sweep(self) -> None:
        self.sessions.sweep()

    def shutdown(self) -> None:
        self.pool.shutdown()
        self.host.shutdown()


def create_app(config: ServeConfig, registry: Registry | None = None, warm: bool = False) -> FastAPI:
    """The application, its session host started (worker processes loaded and ready) before it returns;
    ``warm``: the workers encode their programs' plaintexts first (``--warm``)."""
    registry = registry if registry is not None else Registry(config.programs_dir)
    backend = LocalSessions(config, registry, warm)
    auth = TokenAuth.from_file(config.auth_token_file) if config.auth_token_file is not None else None
    served = Served(config, registry, backend, Metrics(), auth)
    app = build_app(served, what="sessions in worker processes" if config.isolation == "process"
                    else "sessions in this process")
    backend.host.start()
    return app
