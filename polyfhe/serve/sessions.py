"""Live sessions: one client's public context loaded for one model, with an idle TTL and a byte budget.

An upload reserves nothing before its bytes arrive: :meth:`SessionStore.reserve` only refuses at once what cannot
succeed (the server or this client already at its session limit), the key budget is charged as the bytes stream
in (:meth:`SessionStore.grow`, through a :class:`Reservation`), and a session slot is claimed only once the body
is complete and its header checked (:meth:`SessionStore.claim`); so a slow or stalled upload holds no slot and
only the bytes it really sent, while two uploads racing for the last slot or the last bytes cannot both win.
Memory is counted as the keys decoded (SEAL's compressed keys inflate), Concrete's as its worker costs.
"""

from __future__ import annotations

import collections
import hmac
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from polyfhe.serve.errors import ApiError
from polyfhe.serve.quotas import quota_error

__all__ = ["Reservation", "Session", "SessionStore"]

log = logging.getLogger(__name__)


@dataclass
class Session:
    id: str
    model: str
    handle: Any  # polyfhe.serve.hosts.SessionHandle: its program, and where its keys live
    key_bytes: int
    created: float
    last_used: float
    requests: int = 0
    busy: int = 0  # requests in flight; a busy session is not expired under them
    owner: str | None = None  # fingerprint of the bearer token that opened it (None: the server has no tokens)
    client: str | None = None  # who it counts against (polyfhe.serve.quotas.client_key)

    def short_id(self) -> str:
        return self.id[:8]  # enough to follow a session in the logs without printing the bearer token


@dataclass
class Reservation:
    """``nbytes`` of key budget held while a context uploads and loads, and, once ``claimed``, a session slot."""

    nbytes: int = 0
    open: bool = True
    client: str | None = None
    claimed: bool = False


class SessionStore:
    def __init__(self, ttl_s: float, max_sessions: int, budget_bytes: int, expired_memory: int = 4096,
                 clock=time.monotonic, on_drop: Callable[[Session], None] | None = None,
                 client_quota: int | None = None) -> None:
        """``on_drop(session)``: called (under the store's lock: it must not block) for every session that
        expires, is deleted or is lost, so its host frees the keys. ``client_quota``: live sessions one client
        may hold (None: any number up to ``max_sessions``)."""
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.client_quota = client_quota
        self.budget_bytes = budget_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._pending: list[Reservation] = []
        self._expired: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._expired_memory = expired_memory
        self._lost: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._on_drop = on_drop
        self.created_total = 0
        self.expired_total = 0
        self.deleted_total = 0
        self.lost_total = 0

    # ---------------------------------------------------------------------------------------- accounting
    @property
    def used_bytes(self) -> int:
        return sum(s.key_bytes for s in self._sessions.values()) + sum(r.nbytes for r in self._pending)

    def __len__(self) -> int:
        return len(self._sessions)

    def stats(self) -> dict:
        with self._lock:
            self._sweep_locked()
            return {"active": len(self._sessions), "uploading": len(self._pending),
                    "clients": len({s.client for s in self._sessions.values()}),
                    "key_bytes": self.used_bytes, "key_budget_bytes": self.budget_bytes,
                    "max_sessions": self.max_sessions, "ttl_s": self.ttl_s, "created_total": self.created_total,
                    "expired_total": self.expired_total, "deleted_total": self.deleted_total,
                    "lost_total": self.lost_total}

    def _retry_after(self) -> int:
        now = self._clock()
        idle = [s.last_used + self.ttl_s - now for s in self._sessions.values() if not s.busy]
        return max(1, math.ceil(min(idle))) if idle else max(1, math.ceil(self.ttl_s))

    def _check_budget(self, extra: int) -> None:
        used = self.used_bytes
        if extra > self.budget_bytes:
            raise ApiError(507, "key_budget_exceeded",
                           f"this public context ({extra} bytes) alone exceeds the server's key memory budget "
                           f"of {self.budget_bytes} bytes; use a smaller program or ask for a larger budget",
                           extra={"key_budget_bytes": self.budget_bytes})
        if used + extra > self.budget_bytes:
            raise ApiError(507, "key_budget_exceeded",
                           f"the server's key memory budget is {self.budget_bytes} bytes, {used} are held by "
                           f"{len(self._sessions)} sessions and uploads; {extra} more do not fit. Delete "
                           "finished sessions (DELETE /v1/sessions/ID) or retry when idle ones expire",
                           retry_after=self._retry_after(),
                           extra={"key_budget_bytes": self.budget_bytes, "key_bytes_in_use": used})

    # ---------------------------------------------------------------------------------------- admission
    def _check_slots(self, client: str | None) -> None:
        """503 when every session slot is held (sessions and claimed uploads), 429 when ``client`` holds its
        quota."""
        claimed = [r for r in self._pending if r.claimed]
        if len(self._sessions) + len(claimed) >= self.max_sessions:
            raise ApiError(503, "too_many_sessions",
                           f"the server holds its maximum of {self.max_sessions} sessions; delete finished "
                           "sessions (DELETE /v1/sessions/ID) or retry when idle ones expire "
                           f"(sessions expire {self.ttl_s:g} s after their last use)",
                           retry_after=self._retry_after(), extra={"max_sessions": self.max_sessions})
        if self.client_quota is not None and client is not None:
            held = sum(1 for s in self._sessions.values() if s.client == client) + \
                sum(1 for r in claimed if r.client == client)
            if held >= self.client_quota:
                raise quota_error(held, self.client_quota, self.ttl_s)

    def reserve(self, nbytes: int = 0, client: str | None = None) -> Reservation:
        """A reservation of ``nbytes`` (0: charged as the upload arrives) for one more session of ``client``;
        503, 429 or 507 at once when it could not succeed. It holds no session slot until :meth:`claim`."""
        with self._lock:
            self._sweep_locked()
            self._check_slots(client)
            self._check_budget(nbytes)
            reservation = Reservation(nbytes, client=client)
            self._pending.append(reservation)
            return reservation

    def claim(self, reservation: Reservation) -> None:
        """Take a session slot for a complete, checked upload (503/429 if none is left for it)."""
        with self._lock:
            if not reservation.claimed:
                self._sweep_locked()
                self._check_slots(reservation.client)
                reservation.claimed = True

    def grow(self, reservation: Reservation, nbytes: int) -> None:
        """Raise a reservation to ``nbytes`` as an upload streams in; 507 past the budget."""
        with self._lock:
            if nbytes > reservation.nbytes:
                self._check_budget(nbytes - reservation.nbytes)
                reservation.nbytes = nbytes

    def release(self, reservation: Reservation) -> None:
        with self._lock:
            self._drop_pending(reservation)

    def _drop_pending(self, reservation: Reservation) -> None:
        if reservation.open:
            reservation.open = False
            self._pending = [r for r in self._pending if r is not reservation]

    @staticmethod
    def new_id() -> str:
        """An unguessable session id (192 random bits): it is the session's capability when no tokens are set."""
        return secrets.token_urlsafe(24)

    def add(self, reservation: Reservation, model: str, handle: Any, key_bytes: int, session_id: str | None = None,
            owner: str | None = None) -> Session:
        now = self._clock()
        session = Session(session_id or self.new_id(), model, handle, key_bytes, now, now, owner=owner,
                          client=reservation.client)
        with self._lock:
            self._drop_pending(reservation)
            self._sessions[session.id] = session
            self.created_total += 1
        log.info("session %s opened for model %s (%d bytes of keys)", session.short_id(), model, key_bytes)
        return session

    # ---------------------------------------------------------------------------------------- use
    def _find_locked(self, session_id: str, owner: str | None) -> Session:
        """The live session of ``owner``: another token's session answers 404 exactly as an unknown id does."""
        self._sweep_locked()
        session = self._sessions.get(session_id)
        if session is None:
            raise self._missing(session_id)
        if session.owner is not None and not hmac.compare_digest(session.owner, owner or ""):
            raise self._missing("")
        return session

    def _live_locked(self, session_id: str, owner: str | None) -> Session:
        """The live session, its idle clock restarted; 410 if it expired or was lost, 404 if never known."""
        session = self._find_locked(session_id, owner)
        session.last_used = self._clock()
        return session

    def acquire(self, session_id: str, owner: str | None = None) -> Session:
        """The live session, marked busy until :meth:`done`; 410 if it expired, 404 if never known."""
        with self._lock:
            session = self._live_locked(session_id, owner)
            session.busy += 1
            session.requests += 1
            return session

    def touch(self, session_id: str, owner: str | None = None) -> Session:
        """The live session, its idle clock restarted (a client about to use it); 410/404 as :meth:`acquire`."""
        with self._lock:
            return self._live_locked(session_id, owner)

    def done(self, session: Session) -> None:
        with self._lock:
            session.busy -= 1
            session.last_used = self._clock()

    def delete(self, session_id: str, owner: str | None = None) -> Session:
        with self._lock:
            session = self._find_locked(session_id, owner)
            del self._sessions[session_id]
            self.deleted_total += 1
            self._drop(session)
        log.info("session %s deleted (%d requests)", session.short_id(), session.requests)
        return session

    def lose(self, session_ids: list[str]) -> None:
        """Forget sessions whose keys are gone (their worker process died): they answer 410 ``session_lost``."""
        with self._lock:
            for session_id in session_ids:
                if self._sessions.pop(session_id, None) is not None:
                    self._lost[session_id] = self._clock()
                    self.lost_total += 1
            while len(self._lost) > self._expired_memory:
                self._lost.popitem(last=False)

    def _drop(self, session: Session) -> None:
        if self._on_drop is not None:
            self._on_drop(session)

    def _missing(self, session_id: str) -> ApiError:
        if session_id in self._lost:
            return ApiError(410, "session_lost", "the worker process that held this session's keys stopped; open "
                            "a new session with the same public context (POST /v1/sessions?model=NAME)")
        if session_id in self._expired:
            return ApiError(410, "session_expired",
                            f"this session expired after {self.ttl_s:g} s without use and its keys were "
                            "dropped; open a new one with POST /v1/sessions?model=NAME")
        return ApiError(404, "unknown_session",
                        "no such session (never created, deleted, or forgotten); open one with "
                        "POST /v1/sessions?model=NAME")

    # ---------------------------------------------------------------------------------------- expiry
    def sweep(self) -> int:
        with self._lock:
            return self._sweep_locked()

    def _sweep_locked(self) -> int:
        now = self._clock()
        dead = [s for s in self._sessions.values() if not s.busy and now - s.last_used > self.ttl_s]
        for s in dead:
            del self._sessions[s.id]
            self._expired[s.id] = now
            self._drop(s)
            log.info("session %s expired after %.0f s idle", s.short_id(), now - s.last_used)
        while len(self._expired) > self._expired_memory:
            self._expired.popitem(last=False)
        self.expired_total += len(dead)
        return len(dead)
