"""Sessions held by worker processes (``polyfhe serve --isolation process``, the default).

Each worker (:mod:`polyfhe.serve.worker_main`) loads the programs itself and holds the sessions opened on it. A
session stays on its worker; new sessions go to the worker holding the fewest. When a worker dies (a native crash,
SIGKILL, the OOM killer), its requests in flight answer 503 ``worker_lost`` (clients retry), its sessions answer 410
``session_lost`` from then on (clients open them again with the keys they hold: ``ServeClient`` does so by itself),
and a new worker starts in its place; the HTTP server and the other workers' sessions carry on. So a crash costs
the sessions of one worker: with the default count (:mod:`polyfhe.serve.worker_count`, up to one per core) about
``1/n`` of them, with ``--worker-processes 1`` all of them. A worker that answers out of step is killed before
it is replaced, so no keys stay in a process nobody talks to. A worker whose ready message carries another
environment stamp than the server's (polyfhe upgraded under a running server) is stopped and not used.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from polyfhe.serve.errors import ApiError
from polyfhe.serve.hosts import SessionHandle
from polyfhe.serve.worker_main import WorkerSpec, receive_payload, send_payload, worker_main, worker_stamp
from polyfhe.workers.stamp import StampMismatch, check_stamp

__all__ = ["ProcessHost", "WorkerLost"]

log = logging.getLogger(__name__)

STARTUP_S = 300.0  # a worker loads every program before it answers (large programs take a while)
RESTART_BACKOFF_S = (0.5, 30.0)  # first and longest wait before starting a worker again after it died


class WorkerLost(RuntimeError):
    """The worker process ended before it answered."""


class _WorkerProcess:
    """One spawned worker: its pipe, the requests waiting for an answer, and the sessions it holds."""

    def __init__(self, spec: WorkerSpec, generation: int, on_exit: Callable[[_WorkerProcess], None]) -> None:
        self.spec, self.generation, self._on_exit = spec, generation, on_exit
        self.sessions: set[str] = set()
        self.alive = False
        self._ids = itertools.count()
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._scratch = memoryview(bytearray(1 << 16))
        ctx = multiprocessing.get_context("spawn")  # no fork of a process with an event loop and engine threads
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=worker_main, args=(child, spec), name=f"polyfhe-worker-{spec.index}",
                                daemon=True)
        self.proc.start()
        child.close()
        self.pid = self.proc.pid
        self.info = self._await_ready()
        self.alive = True
        threading.Thread(target=self._read, name=f"polyfhe-worker-{spec.index}-reader", daemon=True).start()

    def _await_ready(self) -> dict:
        if not self.conn.poll(STARTUP_S):
            self.proc.kill()
            raise WorkerLost(f"worker {self.spec.index} did not start within {STARTUP_S:g} s")
        try:
            status, info = self.conn.recv()
        except (EOFError, OSError) as exc:
            raise WorkerLost(f"worker {self.spec.index} exited while starting (code {self.proc.exitcode})") from exc
        if status != "ready":
            raise WorkerLost(f"worker {self.spec.index} could not start: {info}")
        try:
            check_stamp(worker_stamp(), info.get("stamp"), f"worker {self.spec.index}")
        except StampMismatch as exc:
            self.proc.kill()  # it holds no session yet: nothing is lost with it
            raise WorkerLost(f"worker {self.spec.index} could not start: {exc}") from None
        return info

    def call(self, op: str, args: tuple, payload: bytes | bytearray | None) -> tuple[dict, bytes | None]:
        """Send one request and wait for its answer; :class:`ApiError` for a refusal, :class:`WorkerLost` when the
        worker ends first."""
        future: Future = Future()
        with self._lock:
            if not self.alive:
                raise WorkerLost(f"worker {self.spec.index} is not running")
            rid = next(self._ids)
            self._pending[rid] = future
        try:
            with self._send_lock:
                self.conn.send((rid, op, args, None if payload is None else len(payload)))
                if payload is not None:
                    send_payload(self.conn, payload)
        except (OSError, ValueError) as exc:
            with self._lock:
                self._pending.pop(rid, None)
            raise WorkerLost(f"worker {self.spec.index} is gone ({type(exc).__name__})") from None
        status, meta, out = future.result()
        if status == "ok":
            return meta, None if out is None else bytes(out)
        if status == "refused":
            raise ApiError(meta["status"], meta["code"], meta["detail"], meta.get("retry_after"),
                           meta.get("extra") or {})
        raise ApiError(500, "internal_error", f"the server failed on this request ({meta.get('type')}); nothing "
                       "was kept")

    def _read(self) -> None:
        while True:
            try:
                rid, status, meta, size = self.conn.recv()
                out = None if size is None else receive_payload(self.conn, size, self._scratch)
            except EOFError:
                break
            except (OSError, ValueError, TypeError) as exc:  # out of step: nothing it says can be trusted now
                log.error("worker process %d (pid %s) answered out of step (%s); stopping it", self.spec.index,
                          self.pid, type(exc).__name__)
                self.proc.kill()  # its keys go with it, never left in a process nobody talks to
                break
            if size is not None and out is None:
                status, meta = "refused", {"status": 507, "code": "out_of_memory", "retry_after": 30,
                                           "detail": "the server has no memory for this result now; retry later"}
            with self._lock:
                future = self._pending.pop(rid, None)
            if future is not None:
                future.set_result((status, meta, out))
        with self._lock:
            self.alive = False
            pending, self._pending = list(self._pending.values()), {}
        self.proc.join(timeout=5)
        if self.proc.is_alive():  # the pipe closed but the process lives on: end it before another replaces it
            self.proc.kill()
            self.proc.join(timeout=5)
        for future in pending:
            future.set_exception(WorkerLost(f"worker {self.spec.index} ended (exit code {self.proc.exitcode})"))
        self._on_exit(self)

    def stop(self) -> None:
        with self._lock:
            self.alive = False
        self.conn.close()
        # closing our end does not end the worker: this process's reader thread still holds the pipe, so the
        # worker would wait out the join's timeout (5 s a worker at every shutdown). It keeps nothing to save.
        self.proc.terminate()
        self.proc.join(timeout=5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)


class ProcessHost:
    """``processes`` workers built from ``spec`` (its ``index`` is set per worker). ``on_lost(session_ids)`` is
    called when a worker dies, with the sessions it held."""

    name = "process"

    def __init__(self, spec: WorkerSpec, processes: int, on_lost: Callable[[list[str]], None]) -> None:
        if processes < 1:
            raise ValueError(f"a process host needs at least one worker process, got {processes}")
        self.spec, self.processes, self._on_lost = spec, processes, on_lost
        self._workers: list[_WorkerProcess | None] = [None] * processes
        self._generations = [0] * processes
        self._deaths: list[list[float]] = [[] for _ in range(processes)]
        self._lock = threading.Lock()
        self._closing = False
        self.restarts_total = 0
        worker_stamp()  # this server's environment stamp, read now: every worker started later is held to it

    # ------------------------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start every worker at once and wait until each has loaded the programs."""
        errors: list[BaseException] = []

        def start_one(index: int) -> None:
            try:
                self._spawn(index)
            except BaseException as exc:  # noqa: BLE001 - re-raised below, after the other workers started
                errors.append(exc)

        threads = [threading.Thread(target=start_one, args=(i,)) for i in range(self.processes)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            self.shutdown()
            raise errors[0]
        log.info("%d worker process(es) ready: pids %s", self.processes, [w.pid for w in self._workers if w])

    def _spawn(self, index: int) -> None:
        with self._lock:
            self._generations[index] += 1
            generation = self._generations[index]
        worker = _WorkerProcess(replace(self.spec, index=index), generation, self._exited)
        with self._lock:
            if self._closing:
                worker.stop()
                return
            self._workers[index] = worker

    def _exited(self, worker: _WorkerProcess) -> None:
        """A worker's pipe closed: its sessions are lost; start another unless the server is stopping."""
        index = worker.spec.index
        with self._lock:
            if self._workers[index] is worker:
                self._workers[index] = None
            closing = self._closing
            lost = sorted(worker.sessions)
            now = time.monotonic()
            deaths = [t for t in self._deaths[index] if now - t < 300] + [now]
            self._deaths[index] = deaths
        if closing:
            return
        log.error("worker process %d (pid %s) ended with exit code %s; %d session(s) lost, starting another",
                  index, worker.pid, worker.proc.exitcode, len(lost))
        if lost:
            self._on_lost(lost)
        wait = min(RESTART_BACKOFF_S[1], RESTART_BACKOFF_S[0] * 2 ** (len(deaths) - 1))
        threading.Thread(target=self._restart, args=(index, wait), daemon=True).start()

    def _restart(self, index: int, wait: float) -> None:
        time.sleep(wait)
        try:
            self._spawn(index)
            with self._lock:
                self.restarts_total += 1
        except BaseException as exc:  # noqa: BLE001 - a restart that fails is tried again later
            log.error("worker process %d could not be started again: %s", index, exc)
            if not self._closing:
                threading.Thread(target=self._restart, args=(index, RESTART_BACKOFF_S[1]), daemon=True).start()

    def shutdown(self) -> None:
        with self._lock:
            self._closing = True
            workers = [w for w in self._workers if w is not None]
        for worker in workers:
            worker.stop()

    # ------------------------------------------------------------------------------------------ sessions
    def _pick(self) -> _WorkerProcess:
        with self._lock:
            alive = [w for w in self._workers if w is not None and w.alive]
        if not alive:
            raise ApiError(503, "workers_restarting", "no worker process is running right now (one is being "
                           "started again); retry shortly", retry_after=2)
        return min(alive, key=lambda w: len(w.sessions))

    def _worker_of(self, handle: SessionHandle) -> _WorkerProcess:
        index, generation, _ = handle.key
        worker = self._workers[index]
        if worker is None or worker.generation != generation or not worker.alive:
            raise ApiError(410, "session_lost", "the worker process that held this session's keys stopped; open a "
                           "new session with the same public context (your keys are still good)")
        return worker

    def _call(self, worker: _WorkerProcess, op: str, args: tuple, payload: Any) -> tuple[dict, bytes | None]:
        try:
            return worker.call(op, args, payload)
        except WorkerLost:
            raise ApiError(503, "worker_lost", "the worker process handling this request stopped before it "
                           "answered; retry (a session it held answers 410 session_lost: open it again)",
                           retry_after=1) from None

    def open(self, session_id: str, model: Any, body: bytes) -> SessionHandle:
        worker = self._pick()
        with self._lock:
            worker.sessions.add(session_id)  # counted while it loads, so parallel opens spread out
        try:
            self._call(worker, "open", (session_id, model.name), body)
        except BaseException:
            with self._lock:
                worker.sessions.discard(session_id)
            raise
        return SessionHandle(model.program, (worker.spec.index, worker.generation, session_id))

    def run(self, handle: SessionHandle, body: bytes) -> bytes:
        worker = self._worker_of(handle)
        _, out = self._call(worker, "run", (handle.key[2],), body)
        return out

    def close(self, handle: SessionHandle) -> None:
        try:
            worker = self._worker_of(handle)
        except ApiError:
            return  # its worker is gone, and the keys with it
        with self._lock:
            worker.sessions.discard(handle.key[2])
        try:
            self._call(worker, "close", (handle.key[2],), None)
        except ApiError as exc:
            log.warning("closing a session on worker %d: %s", worker.spec.index, exc.code)

    def warmed(self) -> list[dict]:
        """What the first worker encoded at start (``WorkerSpec.warm``): one dict per program."""
        worker = self._workers[0]
        return list(worker.info.get("warmed", [])) if worker is not None else []

    def stats(self) -> dict:
        with self._lock:
            workers = [{"index": i, "pid": w.pid if w else None, "alive": bool(w and w.alive),
                        "sessions": len(w.sessions) if w else 0, "generation": self._generations[i],
                        "address_space_limit": (w.info.get("address_space_limit") if w else None)}
                       for i, w in enumerate(self._workers)]
            return {"isolation": self.name, "processes": workers, "restarts_total": self.restarts_total}
