"""The session backend of ``polyfhe serve --ray``'s HTTP front: records in a shared key store, keys in replicas.

The front (any number of ingress replicas) keeps no session in memory. Opening a session stores its public
context in the :class:`~polyfhe.serve.keystore.KeyStore`, then asks a replica to load it (which checks it in full:
a context the engine refuses is deleted again and refused as ``polyfhe serve`` refuses it). Every later request
reads the session's record first (unknown, deleted: 404; expired: 410; another token's: 404; unreadable: 410
``session_lost``), then goes to a replica through a :class:`Holder` keyed by the session id, so that Ray Serve's
multiplexing sends it where the keys already are. A replica that dies loses nothing: the store still holds the
context, and the next replica asked loads it. This module does not import Ray (:mod:`polyfhe.serve.ray_app` does).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import threading
import time
from collections.abc import Iterator
from typing import Protocol

from polyfhe.serve.config import ServeConfig
from polyfhe.serve.errors import ApiError
from polyfhe.serve.keystore import CorruptSession, KeyStore, StoredSession, valid_session_id
from polyfhe.serve.quotas import quota_error
from polyfhe.serve.registry import Model, Registry
from polyfhe.serve.replica import Reply, lost
from polyfhe.serve.routes import Evaluated, Opened, SessionRef

__all__ = ["Holder", "RaySessions"]

log = logging.getLogger(__name__)

FORGET_EXPIRED_S = 3600.0  # an expired session answers 410 for this long after its TTL, then 404


class Holder(Protocol):
    """The replicas, reached by session id (Ray Serve: a deployment handle with ``multiplexed_model_id``)."""

    async def open(self, session_id: str, timeout_s: float) -> Reply: ...
    async def run(self, session_id: str, body: bytes, timeout_s: float) -> Reply: ...
    async def drop(self, session_id: str) -> None: ...


def _unknown() -> ApiError:
    return ApiError(404, "unknown_session", "no such session (never created, deleted, or forgotten); open one "
                    "with POST /v1/sessions?model=NAME")


def _expired(ttl_s: float) -> ApiError:
    return ApiError(410, "session_expired", f"this session expired after {ttl_s:g} s without use and its keys "
                    "were dropped; open a new one with POST /v1/sessions?model=NAME")


class _Upload:
    """Key bytes held by one upload in this front (the budget bounds what uploads hold here at once), charged as
    they arrive; ``claimed`` once its body is complete and it holds a session slot."""

    def __init__(self, owner: RaySessions, client: str) -> None:
        self.owner, self.client, self.nbytes, self.claimed = owner, client, 0, False

    def grow(self, nbytes: int) -> None:
        self.owner._grow(self, nbytes)


class RaySessions:
    def __init__(self, config: ServeConfig, registry: Registry, store: KeyStore, holder: Holder) -> None:
        self.config, self.registry, self.store, self.holder = config, registry, store, holder
        self._lock = threading.Lock()
        self._uploads: list[_Upload] = []
        self._requests: dict[str, int] = {}  # per session, as seen by this front (bounded below)
        self._by_client: dict[str, set[str]] = {}  # sessions this front opened, per client (pruned when full)
        self.running = 0
        self.rejected_total = 0
        self.timed_out_total = 0
        self.created_total = 0
        self.expired_total = 0
        self.deleted_total = 0
        self.lost_total = 0
        self.replicas_lost_total = 0  # requests answered 503 because their replica ended

    # ------------------------------------------------------------------------------ admission
    @contextlib.contextmanager
    def admit(self, client: str) -> Iterator[_Upload]:
        """Refuses at once an upload that cannot succeed (503, 429); holds nothing until its bytes arrive."""
        upload = _Upload(self, client)
        self._check_slots(upload, self.store.live_count())
        with self._lock:
            self._uploads.append(upload)
        try:
            yield upload
        finally:
            with self._lock:
                self._uploads = [u for u in self._uploads if u is not upload]

    def _check_slots(self, upload: _Upload, live: int) -> None:
        """503 when the store's live sessions and this front's claimed uploads fill every slot; 429 when the
        upload's client holds its quota of the sessions this front opened (blocking: reads records when full)."""
        with self._lock:
            claimed = sum(1 for u in self._uploads if u.claimed and u is not upload)
            if live + claimed >= self.config.max_sessions:
                self.rejected_total += 1
                raise ApiError(503, "too_many_sessions", f"the server holds its limit of {self.config.max_sessions} "
                               "sessions; retry when one is deleted or expires",
                               retry_after=max(1, math.ceil(self.config.session_ttl_s / 4)),
                               extra={"max_sessions": self.config.max_sessions})
            quota = self.config.session_quota
            mine = set(self._by_client.get(upload.client, ()))
            opening = sum(1 for u in self._uploads if u.claimed and u.client == upload.client and u is not upload)
        if len(mine) + opening < quota:
            return
        live_ids = {sid for sid in mine if self._still_live(sid)}
        with self._lock:
            if live_ids:
                self._by_client[upload.client] = live_ids | (self._by_client.get(upload.client, set()) - mine)
            else:
                self._by_client.pop(upload.client, None)
        if len(live_ids) + opening >= quota:
            raise quota_error(len(live_ids) + opening, quota, self.config.session_ttl_s)

    def _still_live(self, session_id: str) -> bool:
        try:
            record = self.store.record(session_id)
        except CorruptSession:
            return False
        return record is not None and not record.expired(self.config.session_ttl_s, time.time())

    def _grow(self, upload: _Upload, nbytes: int) -> None:
        budget = self.config.key_budget_bytes
        with self._lock:
            if nbytes > budget:
                raise ApiError(507, "key_budget_exceeded", f"this public context ({nbytes} bytes) alone exceeds a "
                               f"replica's key memory budget of {budget} bytes; use a smaller program or ask for a "
                               "larger budget", extra={"key_budget_bytes": budget})
            used = sum(u.nbytes for u in self._uploads if u is not upload)
            if used + nbytes > budget:
                raise ApiError(507, "key_budget_exceeded", f"uploads in progress hold {used} bytes of the "
                               f"{budget}-byte key budget; {nbytes} more do not fit; retry shortly",
                               retry_after=5, extra={"key_budget_bytes": budget, "key_bytes_in_use": used})
            upload.nbytes = max(upload.nbytes, nbytes)

    # ------------------------------------------------------------------------------ records
    def _record(self, session_id: str, owner: str | None) -> StoredSession:
        """The live record of ``owner``'s session, its idle clock restarted when it is getting old (blocking)."""
        if not valid_session_id(session_id):
            raise _unknown()
        try:
            record = self.store.record(session_id)
        except CorruptSession as exc:
            log.warning("session %s: unreadable record in the key store (%s)", session_id[:8], exc)
            self.lost_total += 1
            raise lost(str(exc)) from None
        if record is None:
            raise _unknown()
        if record.owner is not None and not secrets.compare_digest(record.owner, owner or ""):
            raise _unknown()
        if record.state != "live":
            raise _expired(self.config.session_ttl_s)
        now = time.time()
        if record.expired(self.config.session_ttl_s, now):
            self.store.expire(record)
            self.expired_total += 1
            raise _expired(self.config.session_ttl_s)
        if now - record.last_used > min(30.0, self.config.session_ttl_s / 8):
            record = self.store.touch(record, now)
        return record

    def _model(self, record: StoredSession) -> Model:
        model = self.registry.get(record.model)
        if model is None or model.program.program_id != record.program_id:
            raise lost(f"this server no longer runs program {record.program_id}")
        return model

    def _count(self, session_id: str) -> int:
        with self._lock:
            n = self._requests.pop(session_id, 0) + 1
            self._requests[session_id] = n
            while len(self._requests) > self.config.expired_memory:
                self._requests.pop(next(iter(self._requests)))
            return n

    # ------------------------------------------------------------------------------ SessionBackend
    def _remaining(self, deadline: float) -> float:
        return max(0.0, deadline - asyncio.get_running_loop().time())

    async def _call(self, what: str, call) -> Reply:
        with self._lock:
            self.running += 1
        try:
            reply = await call
        except TimeoutError:
            with self._lock:
                self.timed_out_total += 1
            raise ApiError(504, "request_timeout", f"{what} did not finish within the server's request "
                           "timeout") from None
        finally:
            with self._lock:
                self.running -= 1
        if reply.code == "worker_lost":
            self.replicas_lost_total += 1
        return reply.check()

    async def open(self, admission: _Upload, model: Model, body: bytearray, key_bytes: int, owner: str | None,
                   deadline: float) -> Opened:
        live = await asyncio.to_thread(self.store.live_count)
        await asyncio.to_thread(self._check_slots, admission, live)  # the body is complete: take a slot now
        with self._lock:
            admission.claimed = True
        session_id = secrets.token_urlsafe(24)
        now = time.time()
        record = StoredSession(session_id, model.name, model.program.program_id, key_bytes, 0, "", now, now, owner)
        await asyncio.to_thread(self.store.put, record, body)
        try:
            reply = await self._call("loading the public context",
                                     self.holder.open(session_id, self._remaining(deadline)))
        except ApiError:
            await asyncio.to_thread(self.store.delete, session_id)  # a refused context leaves nothing behind
            raise
        self.created_total += 1
        with self._lock:
            self._by_client.setdefault(admission.client, set()).add(session_id)
        log.info("session %s opened for model %s (%d bytes of keys, stored)", session_id[:8], model.name, key_bytes)
        return Opened(session_id, reply.seconds)

    async def acquire(self, session_id: str, owner: str | None) -> SessionRef:
        record = await asyncio.to_thread(self._record, session_id, owner)
        self._count(session_id)
        return SessionRef(session_id, record.model, self._model(record).program, record)

    async def run(self, session: SessionRef, body: bytearray, deadline: float) -> Evaluated:
        reply = await self._call(f"inference in session {session.short_id()}",
                                 self.holder.run(session.id, bytes(body), self._remaining(deadline)))
        return Evaluated(reply.result or b"", reply.seconds, {"X-Polyfhe-Replica": reply.replica})

    async def done(self, session: SessionRef) -> None:
        return None

    async def info(self, session_id: str, owner: str | None) -> dict:
        record = await asyncio.to_thread(self._record, session_id, owner)
        with self._lock:
            requests = self._requests.get(session_id, 0)
        return {"session_id": session_id, "model": record.model, "program_id": record.program_id,
                "ttl_s": self.config.session_ttl_s, "requests": requests, "key_bytes": record.key_bytes}

    async def delete(self, session_id: str, owner: str | None) -> dict:
        record = await asyncio.to_thread(self._record, session_id, owner)
        await asyncio.to_thread(self.store.delete, session_id)
        with self._lock:
            requests = self._requests.pop(session_id, 0)
            for ids in self._by_client.values():
                ids.discard(session_id)
        self.deleted_total += 1
        await self.holder.drop(session_id)  # the replica that holds it frees the keys now; others when idle
        log.info("session %s deleted", session_id[:8])
        return {"deleted": True, "model": record.model, "freed_key_bytes": record.key_bytes, "requests": requests}

    def stats(self) -> dict:
        with self._lock:
            uploading = len(self._uploads)
            upload_bytes = sum(u.nbytes for u in self._uploads)
        sessions = {"active": self.store.live_count(), "uploading": uploading, "key_bytes": upload_bytes,
                    "key_budget_bytes": self.config.key_budget_bytes, "max_sessions": self.config.max_sessions,
                    "ttl_s": self.config.session_ttl_s, "created_total": self.created_total,
                    "expired_total": self.expired_total, "deleted_total": self.deleted_total,
                    "lost_total": self.lost_total}
        workers = {"workers": None, "capacity": None, "running": self.running, "queued": 0,
                   "rejected_total": self.rejected_total, "timed_out_total": self.timed_out_total}
        return {"sessions": sessions, "workers": workers,
                "host": {"isolation": "ray", "replica_failures_total": self.replicas_lost_total}}

    async def sweep(self) -> None:
        self.expired_total += await asyncio.to_thread(self.store.sweep, self.config.session_ttl_s,
                                                      FORGET_EXPIRED_S)
        live = await asyncio.to_thread(self.store.live_ids)
        with self._lock:  # the per-client counts forget sessions that are gone, and clients without any
            self._by_client = {c: ids & live for c, ids in self._by_client.items() if ids & live}

    def shutdown(self) -> None:
        return None
