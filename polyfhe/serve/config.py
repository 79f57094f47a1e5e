"""Limits and defaults of the demo server, in one frozen dataclass that the CLI fills from flags."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ISOLATIONS", "MIB", "ServeConfig"]

MIB = 1 << 20
ISOLATIONS = ("process", "thread")


@dataclass(frozen=True)
class ServeConfig:
    """What the server accepts and how much it holds at once.

    Sizes are bytes, times seconds. A public context with all its Galois keys can be 2.5 GB for the larger
    programs, hence the 4 GiB context limit (each model's own bound, from its engine, is usually far lower); a
    ciphertext is a few MB at most. An upload is charged against the key budget as its bytes arrive, must keep up
    ``min_upload_bytes_per_s`` once ``upload_grace_s`` have passed, and each client (bearer token, or address
    without tokens) may run ``max_uploads_per_client`` at once and hold ``max_sessions_per_client`` sessions.
    """

    programs_dir: Path
    # body of POST /v1/sessions: what the library's CKKSServer accepts, so that every program the exporter makes by
    # default is served (cpolynext_fhe_bn 28x28 with a key for every step: 2.5 GB; Lattigo's monet_fhe_bn: 2.6 GB)
    max_context_bytes: int = 4 << 30
    max_ciphertext_bytes: int = 64 * MIB  # body of POST /v1/sessions/{id}/infer
    session_ttl_s: float = 15 * 60.0  # a session expires this long after its last use
    max_sessions: int = 16
    key_budget_bytes: int = 4 << 30  # uploaded public contexts held by all live sessions together
    request_timeout_s: float = 300.0  # upload + queue + evaluation of one request
    max_concurrency: int = os.cpu_count() or 1  # evaluations (and context loads) running at once
    max_queue: int = 16  # requests waiting for a worker; beyond it: 503 with Retry-After
    expired_memory: int = 4096  # ids of expired sessions remembered, to answer 410 instead of 404
    eval_delay_s: float = 0.0  # testing aid: sleep this long in every evaluation (simulates a slow model)
    isolation: str = "process"  # "process": sessions live in worker processes; "thread": in the server's own
    # with isolation "process": a dead worker costs only the sessions it held; None: as many as cores and memory
    # allow, up to 4 (polyfhe.serve.workers.auto_worker_processes)
    worker_processes: int | None = None
    worker_memory_headroom_bytes: int | None = None  # address space a worker may add after loading (RLIMIT_AS)
    auth_token_file: Path | None = None  # bearer tokens, one per line; None: no tokens asked for
    min_upload_bytes_per_s: int = 128 << 10  # an upload slower than this after its grace period: 408; 0: no floor
    upload_grace_s: float = 10.0  # seconds an upload may take before its rate is checked
    max_uploads_per_client: int = 4  # public-context uploads one client runs at once; past it: 429
    max_sessions_per_client: int | None = None  # None: half of max_sessions (at least 1); past it: 429

    def __post_init__(self) -> None:
        for name in ("max_context_bytes", "max_ciphertext_bytes", "max_sessions", "key_budget_bytes",
                     "max_concurrency", "max_uploads_per_client"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("session_ttl_s", "request_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_queue < 0 or self.eval_delay_s < 0 or self.min_upload_bytes_per_s < 0 or self.upload_grace_s < 0:
            raise ValueError("max_queue, eval_delay_s, min_upload_bytes_per_s and upload_grace_s must not be negative")
        if self.max_sessions_per_client is not None and self.max_sessions_per_client < 1:
            raise ValueError(f"max_sessions_per_client must be at least 1, got {self.max_sessions_per_client}")
        if self.isolation not in ISOLATIONS:
            raise ValueError(f"isolation must be one of {ISOLATIONS}, got {self.isolation!r}")
        if self.worker_processes is not None and self.worker_processes < 1:
            raise ValueError(f"worker_processes must be at least 1, got {self.worker_processes}")
        if self.worker_memory_headroom_bytes is not None and self.worker_memory_headroom_bytes < 1:
            raise ValueError("worker_memory_headroom_bytes must be positive (or None: no limit)")

    @property
    def session_quota(self) -> int:
        """Live sessions one client may hold."""
        if self.max_sessions_per_client is not None:
            return min(self.max_sessions_per_client, self.max_sessions)
        return max(1, self.max_sessions // 2)

    def limits(self) -> dict:
        """The limits as shown to clients (``/v1/models`` and the web page)."""
        return {"max_context_bytes": self.max_context_bytes, "max_ciphertext_bytes": self.max_ciphertext_bytes,
                "session_ttl_s": self.session_ttl_s, "max_sessions": self.max_sessions,
                "key_budget_bytes": self.key_budget_bytes, "request_timeout_s": self.request_timeout_s,
                "max_concurrency": self.max_concurrency, "max_queue": self.max_queue,
                "isolation": self.isolation, "auth": "bearer" if self.auth_token_file else None,
                "min_upload_bytes_per_s": self.min_upload_bytes_per_s, "upload_grace_s": self.upload_grace_s,
                "max_uploads_per_client": self.max_uploads_per_client,
                "max_sessions_per_client": self.session_quota}
