"""``polyfhe serve --ray``: the same HTTP API and page, served by Ray Serve deployments (extra ``polyfhe[ray]``).

Two deployments, one Serve application:

- ``Front`` (the ingress): the FastAPI application of :func:`polyfhe.serve.routes.build_app` over
  :class:`~polyfhe.serve.ray_sessions.RaySessions`. It bounds and checks bodies, keeps session records in the key
  store, and holds no keys.
- ``KeyHolder``: replicas that hold sessions' public keys and evaluate. Calls to it carry the session id as Ray
  Serve's ``multiplexed_model_id``, so a session's queries go to a replica that already holds its keys; any other
  replica loads them from the key store (:class:`~polyfhe.serve.replica.SessionCache`, an LRU within the key
  budget). Its replica count follows load between ``min_replicas`` and ``max_replicas`` (Serve autoscaling).

A replica that dies costs its requests in flight a 503 ``worker_lost`` (clients retry); its sessions are served
again from the store by the next replica asked. This is the only module that imports Ray.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polyfhe.serve.config import ServeConfig
from polyfhe.serve.replica import Reply

__all__ = ["APP_NAME", "RayOptions", "RayServer", "application", "require_ray", "start", "wait_for_signal"]

log = logging.getLogger(__name__)

APP_NAME = "polyfhe"
HOLDER = "KeyHolder"
INSTALL_HINT = "pip install 'polyfhe[ray]'"


@dataclass(frozen=True)
class RayOptions:
    """How the deployments are laid out on a Ray cluster."""

    min_replicas: int = 1
    max_replicas: int = 1
    key_store: str = "polyfhe-keys"  # a local folder or an fsspec URL (s3://bucket/prefix) every replica reads
    threads_per_replica: int = 1  # POLYFHE_THREADS of each replica, and the CPUs Ray reserves for it
    address: str | None = None  # an existing cluster ("auto", "HOST:PORT"); None: start a local one
    num_cpus: int | None = None  # CPUs of a local cluster (None: the machine's)
    object_store_bytes: int = 256 << 20  # the local cluster's object store
    target_ongoing_requests: float = 2.0  # autoscaling: requests per replica (evaluating or waiting) it aims at
    max_ongoing_requests: int = 2  # evaluations one replica runs at once; more requests wait in the replica
    plaintext_cache_bytes: int | None = None  # per model, per replica

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"replicas must satisfy 1 <= MIN <= MAX, got {self.min_replicas}:{self.max_replicas}")
        if self.threads_per_replica < 1 or self.max_ongoing_requests < 1:
            raise ValueError("threads per replica and requests per replica must be at least 1")

    def scaling(self) -> dict:
        """Serve's replica settings: a fixed count, or autoscaling between the bounds."""
        if self.min_replicas == self.max_replicas:
            return {"num_replicas": self.min_replicas}
        return {"autoscaling_config": {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                                       "target_ongoing_requests": self.target_ongoing_requests,
                                       "upscale_delay_s": 5.0, "downscale_delay_s": 60.0}}


def require_ray() -> Any:
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise ImportError(f"polyfhe serve --ray needs Ray Serve: {INSTALL_HINT} ({exc})") from None
    return ray, serve


def _registry(config: ServeConfig, plaintext_cache_bytes: int | None) -> Any:
    from polyfhe.serve.registry import Registry

    return Registry(config.programs_dir, plaintext_cache_bytes=plaintext_cache_bytes)


def _replica_name() -> str:
    from ray import serve

    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside a replica (unit tests): the process id is as good
        return str(os.getpid())


class _ServeHolder:
    """The ``KeyHolder`` deployment reached through its handle, keyed by session id; a replica that ended or a
    full queue become 503 replies, never Ray's exception types."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def _call(self, method: str, session_id: str, timeout_s: float, *args: Any) -> Reply:
        import ray.exceptions
        from ray.serve.exceptions import BackPressureError

        routed = getattr(self.handle.options(multiplexed_model_id=session_id), method)
        try:
            return await asyncio.wait_for(routed.remote(session_id, *args), timeout_s)
        except BackPressureError:
            return Reply(503, "server_busy", "every replica is busy and their queues are full; retry after the "
                         "time in Retry-After", retry_after=2)
        except ray.exceptions.RayTaskError as exc:  # the replica is alive; the method failed (a bug)
            log.error("a replica failed on a request (%s)", type(exc).__name__)
            return Reply(500, "internal_error", "the server failed on this request; nothing was kept")
        except (ray.exceptions.RayError, ConnectionError) as exc:
            log.warning("a replica ended during a request (%s)", type(exc).__name__)
            return Reply(503, "worker_lost", "the replica evaluating this request ended before it answered; "
                         "retry: another replica serves the session from the key store", retry_after=1)

    async def open(self, session_id: str, timeout_s: float) -> Reply:
        return await self._call("open", session_id, timeout_s)

    async def run(self, session_id: str, body: bytes, timeout_s: float) -> Reply:
        return await self._call("run", session_id, timeout_s, body)

    async def drop(self, session_id: str) -> None:
        try:
            await asyncio.wait_for(self._call("drop", session_id, 10.0), 10.0)
        except TimeoutError:
            pass


def _deployments(config: ServeConfig, options: RayOptions, level: int) -> Any:
    """The bound application: ``Front`` over a ``KeyHolder`` handle."""
    _ray, serve = require_ray()
    env = {"POLYFHE_THREADS": str(options.threads_per_replica)}

    # A replica accepts many more requests than it evaluates at once: Serve's router sends a session's query to
    # another replica (which must load the keys) when the one holding them is at its limit, so the queue belongs
    # inside the replica, where the query waits for the keys it needs.
    @serve.deployment(name=HOLDER, max_ongoing_requests=max(16, 8 * options.max_ongoing_requests),
                      ray_actor_options={"num_cpus": options.threads_per_replica,
                                         "runtime_env": {"env_vars": env}},
                      **options.scaling())
    class KeyHolder:
        def __init__(self) -> None:
            from polyfhe.serve.keystore import KeyStore
            from polyfhe.serve.replica import SessionCache

            logging.basicConfig(level=level)
            self.cache = SessionCache(_registry(config, options.plaintext_cache_bytes), KeyStore(options.key_store),
                                      config.key_budget_bytes, config.max_context_bytes,
                                      config.max_ciphertext_bytes, config.session_ttl_s, _replica_name(),
                                      config.eval_delay_s, on_evict=self._forget,
                                      concurrency=options.max_ongoing_requests)
            self._dropped: list[str] = []  # sessions the cache dropped, to take out of Serve's table on the loop
            self._sweeper: asyncio.Task | None = None

        def _forget(self, session_id: str) -> None:
            self._dropped.append(session_id)  # may run on a loading thread: the loop applies it (_sync)

        def _sync(self) -> None:
            """Tell Serve's router which sessions this replica dropped (its multiplexing table, on the loop), and
            start the idle sweep on the first request (the constructor may run outside the event loop)."""
            table = getattr(self, "__serve_multiplex_wrapper", None)
            while self._dropped:
                session_id = self._dropped.pop()
                if table is not None:
                    table.models.pop(session_id, None)
            if self._sweeper is None:
                self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

        async def _sweep(self) -> None:
            while True:
                await asyncio.sleep(min(30.0, max(0.5, config.session_ttl_s / 4)))
                self.cache.sweep()
                self._sync()

        @serve.multiplexed(max_num_models_per_replica=-1)  # the cache's byte budget bounds it
        async def _load(self, session_id: str) -> Any:
            try:
                return await asyncio.to_thread(self.cache.load, session_id)
            finally:
                self._sync()

        async def open(self, session_id: str) -> Reply:
            self._sync()
            return await self.cache.open(session_id, self._load)

        async def run(self, session_id: str, body: bytes) -> Reply:
            self._sync()
            return await self.cache.run(session_id, body, self._load)

        async def drop(self, session_id: str) -> Reply:
            self.cache.drop(session_id)
            self._sync()
            return Reply()

        def stats(self) -> dict:
            return {**self.cache.stats(), "pid": os.getpid()}

    @serve.deployment(name="Front", max_ongoing_requests=max(16, config.max_queue + config.max_concurrency),
                      ray_actor_options={"num_cpus": 0})
    @serve.ingress()
    class Front:
        """The HTTP API: built in the replica (it needs the handle of ``KeyHolder``)."""

        def __init__(self, holder: Any) -> None:
            logging.basicConfig(level=level)
            self.holder = holder

        def __serve_build_asgi_app__(self) -> Any:
            return _front_app(config, options, _ServeHolder(self.holder))

    return KeyHolder, Front


def _front_app(config: ServeConfig, options: RayOptions, holder: Any) -> Any:
    from polyfhe.serve.auth import TokenAuth
    from polyfhe.serve.keystore import KeyStore
    from polyfhe.serve.metrics import Metrics
    from polyfhe.serve.ray_sessions import RaySessions
    from polyfhe.serve.routes import Served, build_app

    registry = _registry(config, 0)  # the front checks uploads against manifests; it never encodes plaintexts
    backend = RaySessions(config, registry, KeyStore(options.key_store), holder)
    auth = TokenAuth.from_file(config.auth_token_file) if config.auth_token_file is not None else None
    return build_app(Served(config, registry, backend, Metrics(), auth),
                     what=f"sessions in Ray Serve replicas ({options.min_replicas}:{options.max_replicas}), keys "
                          "in the key store")


_ARG_TYPES = {"programs": str, "key_store": str, "replicas": str, "threads_per_replica": int,
              "requests_per_replica": int, "max_context_mb": float, "max_ciphertext_mb": float,
              "key_budget_mb": float, "session_ttl": float, "max_sessions": int, "request_timeout": float,
              "auth_token_file": str, "plaintext_cache_mb": float, "max_sessions_per_client": int,
              "max_uploads_per_client": int, "min_upload_rate_kb": float, "upload_grace": float}


def application(args: dict) -> Any:
    """A Ray Serve application builder (``import_path: polyfhe.serve.ray_app:application``, for ``serve run`` and
    KubeRay's RayService): ``args`` holds ``programs`` and ``key_store`` and optionally ``replicas`` ("MIN:MAX"),
    ``threads_per_replica``, ``requests_per_replica`` and the limits of ``polyfhe serve`` (``max_context_mb``,
    ``key_budget_mb``, ``session_ttl``, ...). Unknown keys are refused, so a typo does not pass unnoticed."""
    unknown = sorted(set(args) - set(_ARG_TYPES))
    if unknown or "programs" not in args or "key_store" not in args:
        raise ValueError(f"polyfhe's Ray application takes programs and key_store, and optionally "
                         f"{sorted(set(_ARG_TYPES) - {'programs', 'key_store'})}; got unknown {unknown}")
    a = {k: _ARG_TYPES[k](v) for k, v in args.items()}
    mib = 1 << 20
    low, _, high = a.get("replicas", "1:1").partition(":")
    limits = {"max_context_bytes": "max_context_mb", "max_ciphertext_bytes": "max_ciphertext_mb",
              "key_budget_bytes": "key_budget_mb"}
    config = ServeConfig(Path(a["programs"]), **{k: int(a[v] * mib) for k, v in limits.items() if v in a},
                         **{k: a[v] for k, v in (("session_ttl_s", "session_ttl"), ("max_sessions", "max_sessions"),
                                                 ("request_timeout_s", "request_timeout"),
                                                 ("max_sessions_per_client", "max_sessions_per_client"),
                                                 ("max_uploads_per_client", "max_uploads_per_client"),
                                                 ("upload_grace_s", "upload_grace")) if v in a},
                         **({"min_upload_bytes_per_s": int(a["min_upload_rate_kb"] * 1024)}
                            if "min_upload_rate_kb" in a else {}),
                         auth_token_file=Path(a["auth_token_file"]) if "auth_token_file" in a else None)
    cache = int(a["plaintext_cache_mb"] * mib) if "plaintext_cache_mb" in a else None
    options = RayOptions(int(low), int(high or low), key_store=a["key_store"],
                         threads_per_replica=a.get("threads_per_replica", 1),
                         max_ongoing_requests=a.get("requests_per_replica", 2), plaintext_cache_bytes=cache)
    if "://" not in options.key_store:  # a shared folder (NFS and the like), the same path on every node
        options = _absolute_store(options, Path(options.key_store))
    holder, front = _deployments(config, options, logging.INFO)
    return front.bind(holder.bind())


@dataclass
class RayServer:
    """A running Serve application; :meth:`stop` ends it, and the local cluster when :func:`start` made one."""

    url: str
    started_cluster: bool

    def holder_replicas(self) -> list[str]:
        """The Ray actor names of the ``KeyHolder`` replicas (namespace ``serve``)."""
        ray, _serve = require_ray()
        names = ray.util.list_named_actors(all_namespaces=True)
        return sorted(a["name"] for a in names if a["namespace"] == "serve"
                      and a["name"].startswith(f"SERVE_REPLICA::{APP_NAME}#{HOLDER}#"))

    def kill_replica(self, replica: str) -> None:
        """Kill the ``KeyHolder`` replica whose id (``X-Polyfhe-Replica``) or actor name is ``replica`` (Serve
        starts another in its place)."""
        ray, _serve = require_ray()
        name = replica if replica.startswith("SERVE_REPLICA::") else f"SERVE_REPLICA::{APP_NAME}#{HOLDER}#{replica}"
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)

    def stop(self) -> None:
        ray, serve = require_ray()
        try:
            serve.delete(APP_NAME)
            serve.shutdown()
        finally:
            if self.started_cluster:
                ray.shutdown()


def start(config: ServeConfig, options: RayOptions, host: str = "127.0.0.1", port: int = 8000) -> RayServer:
    """Deploy the application on Ray Serve and return once it answers; starts a local cluster (no dashboard, no
    usage statistics, the HTTP proxy on ``host``) unless ``options.address`` names one."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray, serve = require_ray()
    store = Path(options.key_store)
    if "://" not in options.key_store:
        options = _absolute_store(options, store)
    started = False
    if not ray.is_initialized():
        if options.address is not None:
            ray.init(address=options.address, log_to_driver=False)
        else:
            # Serve's HTTP proxy listens on ``host`` only; Ray's own gRPC ports listen on the node's address
            # (Ray replaces a loopback address by a reachable one) and are guarded by Ray's token authentication
            ray.init(address="local", num_cpus=options.num_cpus, object_store_memory=options.object_store_bytes,
                     include_dashboard=False, log_to_driver=False, configure_logging=False)
            started = True
    try:
        serve.start(http_options={"host": host, "port": port})
        holder, front = _deployments(config, options, logging.getLogger().getEffectiveLevel())
        serve.run(front.bind(holder.bind()), name=APP_NAME, route_prefix="/", blocking=False)
    except BaseException:
        if started:
            ray.shutdown()
        raise
    return RayServer(f"http://{host}:{port}", started)


def _absolute_store(options: RayOptions, store: Path) -> RayOptions:
    """A local key store as an absolute path (replicas run in other working directories), created private."""
    from dataclasses import replace

    from polyfhe.serve.keystore import KeyStore

    KeyStore(store)  # creates it 0700, warns when others can read it
    return replace(options, key_store=str(store.resolve()))


def wait_for_signal() -> None:
    """Block until SIGINT or SIGTERM (the CLI's foreground)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
