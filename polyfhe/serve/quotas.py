"""Per-client limits of the demo server: uploads running at once and live sessions held.

A client is its bearer token when the server has tokens (its fingerprint), else its network address: behind a
reverse proxy every client shares the proxy's address, so such a server should ask for tokens. The key is a
hash, so neither tokens nor addresses are kept here.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Iterator

from polyfhe.serve.errors import ApiError

__all__ = ["UploadGate", "client_key", "quota_error"]


def client_key(owner: str | None, address: str | None) -> str:
    """Who a request counts against: ``token:`` and the token's fingerprint, or ``addr:`` and a hash of the
    peer address (``addr:unknown`` where the transport gives none)."""
    if owner is not None:
        return "token:" + owner[:32]
    if not address:
        return "addr:unknown"
    return "addr:" + hashlib.sha256(address.encode()).hexdigest()[:32]


def quota_error(held: int, quota: int, ttl_s: float) -> ApiError:
    return ApiError(429, "session_quota", f"this client already holds {held} sessions, the most this server lets "
                    f"one client (bearer token, or address without tokens) hold is {quota}; delete finished ones "
                    f"(DELETE /v1/sessions/ID) or wait until idle ones expire ({ttl_s:g} s after their last use)",
                    retry_after=max(1, int(min(ttl_s, 60))), extra={"max_sessions_per_client": quota})


class UploadGate:
    """At most ``per_client`` uploads of one client run at once; one more is refused with 429 before a byte of
    it is read."""

    def __init__(self, per_client: int) -> None:
        self.per_client = per_client
        self._running: dict[str, int] = {}
        self._lock = threading.Lock()
        self.refused_total = 0

    @contextlib.contextmanager
    def hold(self, client: str) -> Iterator[None]:
        with self._lock:
            running = self._running.get(client, 0)
            if running >= self.per_client:
                self.refused_total += 1
                raise ApiError(429, "too_many_uploads", f"this client already has {running} public-context "
                               f"uploads in progress, the most this server runs at once for one client; wait for "
                               "them to finish", retry_after=2, extra={"max_uploads_per_client": self.per_client})
            self._running[client] = running + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._running[client] - 1
                if left:
                    self._running[client] = left
                else:
                    del self._running[client]

    def stats(self) -> dict:
        with self._lock:
            return {"uploading_clients": len(self._running), "uploads_refused_total": self.refused_total}
