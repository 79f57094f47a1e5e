"""Sessions' public contexts in a store that every replica reads (``polyfhe serve --ray``).

A session is two objects under the store's root: ``ID.ctx``, the uploaded public context exactly as it arrived,
and ``ID.json``, its record (:class:`StoredSession`: model, program, owner's token fingerprint, sizes, the
context's SHA-256, and when it was last used). The context is written first and the record second, so a record
always names a complete context; an expired session keeps a small record (``state: "expired"``, no context) for a
while, so that it answers 410 rather than 404. The store holds public keys only: the server never has a secret key.

The root is a local folder (created private, ``0700``, files ``0600``, written to a temporary name and renamed) or
any fsspec URL (``s3://bucket/prefix``, ``gs://...``; needs ``fsspec`` and the backend's package). A session id is
checked against :data:`SESSION_ID` before it becomes part of a path, so no request can name another file. A record
or context that is unreadable, truncated or altered raises :class:`CorruptSession`: the caller treats the session
as lost, never as a crash.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol

__all__ = ["SESSION_ID", "CorruptSession", "KeyStore", "StoredSession", "valid_session_id"]

log = logging.getLogger(__name__)

SESSION_ID = re.compile(r"[A-Za-z0-9_-]{32}")  # secrets.token_urlsafe(24): 192 random bits; whole strings only
FORMAT = 1
MAX_RECORD_BYTES = 64 << 10


class CorruptSession(ValueError):
    """A session's record or context in the store is unreadable, truncated or does not match its record."""


def valid_session_id(session_id: str) -> bool:
    return isinstance(session_id, str) and SESSION_ID.fullmatch(session_id) is not None


@dataclass(frozen=True)
class StoredSession:
    """A session's record in the store (the JSON beside its context)."""

    session_id: str
    model: str
    program_id: str
    key_bytes: int  # the keys' size once loaded (what a replica's key budget counts)
    context_bytes: int  # the stored context's length
    sha256: str  # of the stored context
    created: float  # Unix seconds: replicas on other machines share no monotonic clock
    last_used: float
    owner: str | None = None  # fingerprint of the bearer token that opened it
    state: str = "live"  # "live" or "expired"

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_dict(cls, raw: Any) -> StoredSession:
        """Strict: every field of the right type, or :class:`CorruptSession`."""
        types = {"session_id": str, "model": str, "program_id": str, "key_bytes": int, "context_bytes": int,
                 "sha256": str, "created": (int, float), "last_used": (int, float), "owner": (str, type(None)),
                 "state": str}
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise CorruptSession("not a session record of this format")
        for name, kind in types.items():
            if not isinstance(raw.get(name), kind) or isinstance(raw.get(name), bool):
                raise CorruptSession(f"the session record's {name} is missing or of the wrong type")
        if raw["state"] not in ("live", "expired") or not valid_session_id(raw["session_id"]):
            raise CorruptSession("the session record's state or id is not valid")
        return cls(**{name: raw[name] for name in types})

    def expired(self, ttl_s: float, now: float) -> bool:
        return self.state == "expired" or now - self.last_used > ttl_s


class _Files(Protocol):
    """The few operations the store needs from a file system: whole objects, written at once."""

    def read(self, name: str, limit: int | None = None) -> bytes | None: ...
    def write(self, name: str, data: bytes | bytearray | memoryview) -> None: ...
    def remove(self, name: str) -> None: ...
    def names(self) -> list[str]: ...


class _LocalFiles:
    """A private local folder: ``0700``, files ``0600``, each written under a temporary name then renamed."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        mode = root.stat().st_mode
        if mode & (stat.S_IWGRP | stat.S_IWOTH | stat.S_IROTH):
            log.warning("the key store %s is readable or writable by other users; chmod 700 it", root)

    def read(self, name: str, limit: int | None = None) -> bytes | None:
        try:
            with open(self.root / name, "rb") as fh:
                return fh.read() if limit is None else fh.read(limit + 1)
        except FileNotFoundError:
            return None

    def write(self, name: str, data: bytes | bytearray | memoryview) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-")  # mkstemp makes it 0600
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, self.root / name)
        except BaseException:
            with_missing_ok(os.unlink, tmp)
            raise

    def remove(self, name: str) -> None:
        with_missing_ok(os.unlink, self.root / name)

    def names(self) -> list[str]:
        return [p.name for p in self.root.iterdir() if not p.name.startswith(".tmp-")]


class _FsspecFiles:
    """Any fsspec file system (object stores write an object at once, so no temporary name is needed)."""

    def __init__(self, url: str) -> None:
        try:
            import fsspec
        except ImportError as exc:
            raise ValueError(f"a key store at {url} needs fsspec (pip install 'polyfhe[ray]') and the package of "
                             f"its file system ({exc})") from None
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.fs.makedirs(self.root, exist_ok=True)

    def _path(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    def read(self, name: str, limit: int | None = None) -> bytes | None:
        try:
            if limit is None:
                return self.fs.cat_file(self._path(name))
            return self.fs.cat_file(self._path(name), start=0, end=limit + 1)
        except FileNotFoundError:
            return None

    def write(self, name: str, data: bytes | bytearray | memoryview) -> None:
        self.fs.pipe_file(self._path(name), bytes(data))

    def remove(self, name: str) -> None:
        try:
            self.fs.rm_file(self._path(name))
        except FileNotFoundError:
            pass

    def names(self) -> list[str]:
        return [str(p).rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)]


def with_missing_ok(fn, *args: Any) -> None:
    try:
        fn(*args)
    except FileNotFoundError:
        pass


class KeyStore:
    """Where sessions' contexts and records live; ``url`` a local folder (default) or an fsspec URL."""

    def __init__(self, url: str | Path) -> None:
        text = str(url)
        self.url = text
        if "://" in text and not text.startswith("file://"):
            self._files: _Files = _FsspecFiles(text)
        else:
            self._files = _LocalFiles(Path(text.removeprefix("file://")))

    @staticmethod
    def _names(session_id: str) -> tuple[str, str]:
        if not valid_session_id(session_id):  # never a path built from unchecked input
            raise ValueError("not a session id")
        return f"{session_id}.json", f"{session_id}.ctx"

    def put(self, record: StoredSession, context: bytes | bytearray) -> StoredSession:
        """Store a new session: its context first, then its record (with the context's length and SHA-256)."""
        record_name, context_name = self._names(record.session_id)
        record = replace(record, context_bytes=len(context), sha256=hashlib.sha256(context).hexdigest())
        self._files.write(context_name, context)
        self._files.write(record_name, json.dumps(record.to_dict()).encode())
        return record

    def record(self, session_id: str) -> StoredSession | None:
        """The session's record, ``None`` if it has none; :class:`CorruptSession` if it cannot be read."""
        if not valid_session_id(session_id):
            return None
        raw = self._files.read(self._names(session_id)[0], MAX_RECORD_BYTES)
        if raw is None:
            return None
        if len(raw) > MAX_RECORD_BYTES:
            raise CorruptSession("the session record is too large")
        try:
            return StoredSession.from_dict(json.loads(raw))
        except (ValueError, RecursionError) as exc:
            raise CorruptSession(f"the session record is not valid JSON ({type(exc).__name__})") from None

    def context(self, record: StoredSession) -> bytes:
        """The session's context, checked against its record's length and SHA-256 (:class:`CorruptSession`)."""
        data = self._files.read(self._names(record.session_id)[1], record.context_bytes)
        if data is None:
            raise CorruptSession("the session's context is missing from the key store")
        if len(data) != record.context_bytes:
            raise CorruptSession(f"the session's context has {len(data)} bytes, its record says "
                                 f"{record.context_bytes}")
        if hashlib.sha256(data).hexdigest() != record.sha256:
            raise CorruptSession("the session's context does not match its record's SHA-256")
        return data

    def touch(self, record: StoredSession, now: float | None = None) -> StoredSession:
        """The record with ``last_used`` now, written back (its idle clock restarts for every replica)."""
        record = replace(record, last_used=time.time() if now is None else now)
        self._files.write(self._names(record.session_id)[0], json.dumps(record.to_dict()).encode())
        return record

    def expire(self, record: StoredSession) -> None:
        """Drop the context, keep a small record that says the session expired (410, not 404)."""
        record_name, context_name = self._names(record.session_id)
        self._files.remove(context_name)
        self._files.write(record_name, json.dumps(replace(record, state="expired").to_dict()).encode())

    def delete(self, session_id: str) -> None:
        record_name, context_name = self._names(session_id)
        self._files.remove(record_name)
        self._files.remove(context_name)

    def session_ids(self) -> list[str]:
        """Ids with a record (live or expired)."""
        return [n[:-5] for n in self._files.names() if n.endswith(".json") and valid_session_id(n[:-5])]

    def live_ids(self) -> set[str]:
        """Ids of sessions whose context is stored (expired ones keep none)."""
        return {n[:-4] for n in self._files.names() if n.endswith(".ctx") and valid_session_id(n[:-4])}

    def live_count(self) -> int:
        return len(self.live_ids())

    def sweep(self, ttl_s: float, forget_s: float, now: float | None = None) -> int:
        """Expire live sessions idle past ``ttl_s``; forget records of sessions expired ``forget_s`` ago, and
        of corrupt ones. Returns the sessions expired."""
        now = time.time() if now is None else now
        expired = 0
        for session_id in self.session_ids():
            try:
                record = self.record(session_id)
            except CorruptSession:
                log.warning("key store: dropping the unreadable record of session %s", session_id[:8])
                self.delete(session_id)
                continue
            if record is None:
                continue
            if record.state == "live" and record.expired(ttl_s, now):
                self.expire(record)
                expired += 1
                log.info("session %s expired after %.0f s idle", session_id[:8], now - record.last_used)
            elif record.state == "expired" and now - record.last_used > ttl_s + forget_s:
                self.delete(session_id)
        return expired
