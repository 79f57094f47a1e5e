"""What one replica of ``polyfhe serve --ray`` does: hold some sessions' keys, loaded from the key store.

:class:`SessionCache` loads a session's public context from the :class:`~polyfhe.serve.keystore.KeyStore` the
first time the replica is asked for it (the context is checked against its record, then in full by the engine, as
an upload is), keeps the keys of recent sessions within a byte budget (least recently used dropped first) and
evaluates ciphertexts with them. Everything it answers is a :class:`Reply`, never an exception: a reply crosses a
process boundary (Ray), and an engine's exception types stay here.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from polyfhe.serve.errors import ApiError
from polyfhe.serve.hosts import engine_call, open_server
from polyfhe.serve.keystore import CorruptSession, KeyStore
from polyfhe.serve.registry import Registry

__all__ = ["HeldSession", "Reply", "SessionCache", "lost"]

log = logging.getLogger(__name__)

LOAD_WAIT_S = 120.0  # how long a load waits for others under way to free the room it needs


@dataclass(frozen=True)
class Reply:
    """A replica's answer: ``status`` 200 with ``result`` (evaluations) or a refusal as :class:`ApiError` has."""

    status: int = 200
    code: str = ""
    detail: str = ""
    retry_after: int | None = None
    extra: dict = field(default_factory=dict)
    result: bytes | None = None
    seconds: float = 0.0
    replica: str = ""

    @classmethod
    def refusal(cls, exc: ApiError, replica: str = "") -> Reply:
        return cls(exc.status, exc.code, exc.detail, exc.retry_after, dict(exc.extra), replica=replica)

    def check(self) -> Reply:
        """This reply, or its refusal raised as :class:`ApiError`."""
        if self.status != 200:
            raise ApiError(self.status, self.code, self.detail, self.retry_after, dict(self.extra))
        return self


def lost(why: str) -> ApiError:
    return ApiError(410, "session_lost", f"the server cannot read this session's keys back ({why}); open a new "
                    "session with the same public context (POST /v1/sessions?model=NAME)")


@dataclass
class HeldSession:
    session_id: str
    model: str
    server: Any  # the engine's evaluator holding the session's public keys
    key_bytes: int
    last_used: float


class SessionCache:
    """Sessions held by this replica, at most ``budget_bytes`` of keys; ``on_evict(session_id)`` is told of every
    session dropped (so the router stops sending its queries here first)."""

    def __init__(self, registry: Registry, store: KeyStore, budget_bytes: int, max_context_bytes: int,
                 max_ciphertext_bytes: int, ttl_s: float, name: str = "", eval_delay_s: float = 0.0,
                 on_evict: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 concurrency: int = 2) -> None:
        self.registry, self.store, self.budget_bytes = registry, store, budget_bytes
        self.max_context_bytes, self.max_ciphertext_bytes = max_context_bytes, max_ciphertext_bytes
        self.ttl_s, self.name, self.eval_delay_s = ttl_s, name, eval_delay_s
        self.on_evict = on_evict
        self._clock = clock
        self._evaluating = asyncio.Semaphore(concurrency)  # evaluations at once; other requests wait here
        self._lock = threading.Lock()  # loads run on a thread while the event loop sweeps and reports
        self._held: collections.OrderedDict[str, HeldSession] = collections.OrderedDict()
        self._loading: dict[str, int] = {}  # key bytes reserved by loads under way, per session
        self._loaded: dict[str, threading.Event] = {}  # set when that load ends (others of the session wait)
        self._changed = threading.Condition(self._lock)  # notified when a load ends (its room is known again)
        self.loads_total = 0
        self.evictions_total = 0

    @property
    def held_bytes(self) -> int:
        """Key bytes held and reserved by loads under way."""
        with self._lock:
            return sum(s.key_bytes for s in self._held.values()) + sum(self._loading.values())

    def held(self) -> list[str]:
        """Held session ids, least recently used first."""
        with self._lock:
            return list(self._held)

    def stats(self) -> dict:
        return {"replica": self.name, "sessions": len(self.held()), "key_bytes": self.held_bytes,
                "key_budget_bytes": self.budget_bytes, "loads_total": self.loads_total,
                "evictions_total": self.evictions_total}

    # ------------------------------------------------------------------------------ loading
    def _drop(self, session_id: str) -> None:
        with self._lock:
            held = self._held.pop(session_id, None)
        if held is not None:
            self._release(session_id, held)

    def _make_room(self, session_id: str, key_bytes: int) -> bool:
        """Reserve ``key_bytes`` for ``session_id``'s load, dropping least recently used sessions for room; under
        the lock with the check, so concurrent loads of different sessions cannot both pass it. False: another
        load of the same session is under way (wait for it)."""
        if key_bytes > self.budget_bytes:
            raise ApiError(507, "key_budget_exceeded", f"this session's keys ({key_bytes} bytes) exceed a "
                           f"replica's key budget of {self.budget_bytes} bytes", extra={
                               "key_budget_bytes": self.budget_bytes})
        dropped = []
        give_up = time.monotonic() + LOAD_WAIT_S
        with self._lock:
            if session_id in self._loading:
                return False
            while True:
                used = sum(s.key_bytes for s in self._held.values()) + sum(self._loading.values())
                if used + key_bytes <= self.budget_bytes:
                    break
                if self._held:
                    victim, held = self._held.popitem(last=False)
                    dropped.append((victim, held))
                    continue
                left = give_up - time.monotonic()  # only loads under way hold the room: wait for one to end
                if left <= 0:
                    raise ApiError(507, "key_budget_exceeded", f"loads in progress on this replica hold {used} "
                                   f"bytes of its {self.budget_bytes}-byte key budget; {key_bytes} more do not "
                                   "fit; retry shortly", retry_after=5, extra={"key_budget_bytes": self.budget_bytes})
                self._changed.wait(left)
            self._loading[session_id] = key_bytes
            self._loaded[session_id] = threading.Event()
        for victim, held in dropped:
            self._release(victim, held)
            self.evictions_total += 1
            log.info("replica %s: dropped session %s's keys to make room", self.name, victim[:8])
        return True

    def _release(self, session_id: str, held: HeldSession) -> None:
        close = getattr(held.server, "close", None)
        if close is not None:
            close()
        if self.on_evict is not None:
            self.on_evict(session_id)

    def _cached(self, session_id: str) -> HeldSession | None:
        with self._lock:
            held = self._held.get(session_id)
            if held is not None:
                self._held.move_to_end(session_id)
                held.last_used = self._clock()
            return held

    def load(self, session_id: str) -> HeldSession:
        """The session's keys, from the store if this replica does not hold them (blocking: run it off the event
        loop); :class:`ApiError` 404/410 when the store has no readable live copy, 400 when the engine refuses.
        Loads of one session share one; loads of others reserve their bytes before they start."""
        held = self._cached(session_id)
        if held is not None:
            return held
        t0 = time.perf_counter()
        record, model = self._live_record(session_id)
        while not self._make_room(session_id, record.key_bytes):
            with self._lock:
                loading = self._loaded.get(session_id)
            if loading is not None:
                loading.wait(timeout=self.ttl_s)
            held = self._cached(session_id)
            if held is not None:
                return held
        held = None
        try:
            context = self.store.context(record)
            server = engine_call(open_server, "context", model.program, context, self.max_context_bytes,
                                 self.max_ciphertext_bytes)
            del context
            held = HeldSession(session_id, record.model, server, record.key_bytes, self._clock())
        except CorruptSession as exc:
            raise self._unreadable(session_id, exc) from None
        finally:  # the reservation becomes the held session (or is freed); loads of it waiting see which
            with self._lock:
                self._loading.pop(session_id, None)
                if held is not None:
                    self._held[session_id] = held
                done = self._loaded.pop(session_id, None)
                self._changed.notify_all()
            if done is not None:
                done.set()
        self.loads_total += 1
        log.info("replica %s: loaded session %s (%d bytes of keys) in %.2f s", self.name, session_id[:8],
                 record.key_bytes, time.perf_counter() - t0)
        return held

    def _unreadable(self, session_id: str, exc: CorruptSession) -> ApiError:
        log.warning("replica %s: session %s is unreadable in the key store: %s", self.name, session_id[:8], exc)
        return lost(str(exc))

    def _live_record(self, session_id: str):
        """The session's live record and model from the store (404/410 otherwise)."""
        try:
            record = self.store.record(session_id)
        except CorruptSession as exc:
            raise self._unreadable(session_id, exc) from None
        if record is None:
            raise ApiError(404, "unknown_session", "no such session (never created, deleted, or forgotten); "
                           "open one with POST /v1/sessions?model=NAME")
        if record.state != "live":
            raise ApiError(410, "session_expired", "this session expired; open a new one with "
                           "POST /v1/sessions?model=NAME")
        model = self.registry.get(record.model)
        if model is None or model.program.program_id != record.program_id:
            raise lost(f"this server no longer runs program {record.program_id}")
        return record, model

    # ------------------------------------------------------------------------------ requests
    async def open(self, session_id: str, load: Callable[[str], Any]) -> Reply:
        """Load a session just stored (``load``: the router's loader, which calls :meth:`load` off the loop)."""
        t0 = time.perf_counter()
        try:
            await load(session_id)
        except ApiError as exc:
            return Reply.refusal(exc, self.name)
        except Exception as exc:  # noqa: BLE001 - a bug or the store unreachable: this request only
            return self._failed(exc)
        return Reply(seconds=time.perf_counter() - t0, replica=self.name)

    def _failed(self, exc: Exception) -> Reply:
        log.error("replica %s: internal error: %s", self.name, type(exc).__name__)  # the type only
        return Reply(500, "internal_error", f"the server failed on this request ({type(exc).__name__}); nothing "
                     "was kept", replica=self.name)

    async def run(self, session_id: str, body: bytes, load: Callable[[str], Any]) -> Reply:
        try:
            held = await load(session_id)
            held.last_used = self._clock()
            async with self._evaluating:
                t0 = time.perf_counter()
                if self.eval_delay_s:
                    await asyncio.sleep(self.eval_delay_s)
                out = await asyncio.to_thread(engine_call, held.server.run, "ciphertext", body)
        except ApiError as exc:
            return Reply.refusal(exc, self.name)
        except Exception as exc:  # noqa: BLE001 - a bug or the store unreachable: this request only
            return self._failed(exc)
        return Reply(result=out, seconds=time.perf_counter() - t0, replica=self.name)

    def drop(self, session_id: str) -> None:
        self._drop(session_id)

    def sweep(self) -> int:
        """Drop the keys of sessions idle here past the TTL (the store decides whether they expired)."""
        now = self._clock()
        with self._lock:
            idle = [sid for sid, s in self._held.items() if now - s.last_used > self.ttl_s]
        for session_id in idle:
            self._drop(session_id)
        return len(idle)
