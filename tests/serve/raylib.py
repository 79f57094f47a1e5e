"""Helpers for the ``polyfhe serve --ray`` tests: the Ray front's routes over replicas simulated in this process.

:class:`LocalReplicas` routes each session to one :class:`~polyfhe.serve.replica.SessionCache` as Ray Serve's
multiplexing does (the replica that loaded it, else the least loaded live one) and can kill a replica: its
requests in flight then answer 503 ``worker_lost`` (as the Ray front answers a replica's death), and its sessions
go to the others, which load them from the key store. No Ray needed: the routes, key store and caches are the
real ones.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from polyfhe.serve.config import ServeConfig
from polyfhe.serve.keystore import KeyStore
from polyfhe.serve.metrics import Metrics
from polyfhe.serve.ray_sessions import RaySessions
from polyfhe.serve.registry import Registry
from polyfhe.serve.replica import Reply, SessionCache
from polyfhe.serve.routes import Served, build_app

OCTETS = {"Content-Type": "application/octet-stream"}


class LocalReplicas:
    def __init__(self, registry: Registry, store: KeyStore, config: ServeConfig, count: int = 2,
                 budget_bytes: int | None = None) -> None:
        budget = config.key_budget_bytes if budget_bytes is None else budget_bytes
        self.caches = [SessionCache(registry, store, budget, config.max_context_bytes, config.max_ciphertext_bytes,
                                    config.session_ttl_s, name=f"r{i}") for i in range(count)]
        self.alive = [True] * count
        self.where: dict[str, int] = {}
        self.lose_next: set[str] = set()  # sessions whose next request was routed to a replica that just died

    def route(self, session_id: str) -> int:
        i = self.where.get(session_id)
        if i is None or not self.alive[i]:
            live = [j for j in range(len(self.caches)) if self.alive[j]]
            i = min(live, key=lambda j: len(self.caches[j].held()))
            self.where[session_id] = i
        return i

    def kill(self, index: int) -> None:
        """The replica ends: its keys are gone; sessions routed to it lose their next request (503)."""
        self.alive[index] = False
        cache = self.caches[index]
        self.lose_next |= {sid for sid, j in self.where.items() if j == index}
        for session_id in cache.held():
            cache.drop(session_id)

    def _cache(self, session_id: str) -> tuple[SessionCache, object]:
        cache = self.caches[self.route(session_id)]
        return cache, lambda sid: asyncio.to_thread(cache.load, sid)

    async def open(self, session_id: str, timeout_s: float) -> Reply:
        cache, load = self._cache(session_id)
        return await cache.open(session_id, load)

    async def run(self, session_id: str, body: bytes, timeout_s: float) -> Reply:
        if session_id in self.lose_next:
            self.lose_next.discard(session_id)
            return Reply(503, "worker_lost", "the replica ended", retry_after=1)
        cache, load = self._cache(session_id)
        return await cache.run(session_id, body, load)

    async def drop(self, session_id: str) -> None:
        i = self.where.pop(session_id, None)
        if i is not None:
            self.caches[i].drop(session_id)


def ray_front(programs: Path, store_dir: Path, replicas: int = 2, budget_bytes: int | None = None,
              **limits) -> tuple:
    """(FastAPI app, LocalReplicas, KeyStore): the ``--ray`` front over simulated replicas."""
    config = ServeConfig(programs, **limits)
    registry = Registry(programs)
    store = KeyStore(store_dir)
    holder = LocalReplicas(registry, store, config, replicas, budget_bytes)
    app = build_app(Served(config, registry, RaySessions(config, registry, store, holder), Metrics()))
    return app, holder, store
