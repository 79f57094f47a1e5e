"""The HTTP API of the demo server, shared by every way of holding sessions (``polyfhe serve`` and ``--ray``).

:func:`build_app` makes the FastAPI application: the page, the static files, the model cards, health and metrics,
the error handlers (every refusal is JSON ``{"error": code, "detail": sentence, "status": n}``) and the four
session routes. Where a session's keys live is the job of a :class:`SessionBackend`: this process's session store
and worker processes (:mod:`polyfhe.serve.app`), or a key store and Ray Serve replicas
(:mod:`polyfhe.serve.ray_sessions`). Bodies are bounded (:mod:`polyfhe.serve.bodies`) and their headers checked
(:mod:`polyfhe.serve.uploads`) here, before any backend sees them. Nothing here logs a body.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from polyfhe.program.engines import decoded_context_bytes, kind_of
from polyfhe.program.wire import KIND_CIPHERTEXT, KIND_CONTEXT
from polyfhe.serve.auth import TokenAuth
from polyfhe.serve.bodies import Pace, declared_length, read_body
from polyfhe.serve.clientspec import browser_support, client_spec
from polyfhe.serve.config import ServeConfig
from polyfhe.serve.errors import ApiError
from polyfhe.serve.metrics import Metrics, rss_bytes
from polyfhe.serve.page import index_html, static_asset
from polyfhe.serve.quotas import UploadGate, client_key
from polyfhe.serve.registry import Model, Registry
from polyfhe.serve.uploads import check_upload

__all__ = ["Admission", "Evaluated", "Opened", "SessionBackend", "SessionRef", "build_app"]

log = logging.getLogger(__name__)

OCTETS = "application/octet-stream"


@dataclass
class SessionRef:
    """A live session as the routes see it while they use it: its id, model and program (for identity checks)."""

    id: str
    model: str
    program: Any
    handle: Any = None  # the backend's own record

    def short_id(self) -> str:
        return self.id[:8]  # enough to follow a session in the logs without printing the bearer token


@dataclass(frozen=True)
class Opened:
    session_id: str
    load_seconds: float


@dataclass(frozen=True)
class Evaluated:
    result: bytes
    seconds: float
    headers: dict[str, str] = field(default_factory=dict)


class Admission(Protocol):
    """Key bytes held while one public context uploads and loads, charged as they arrive (507 past the budget);
    the backend's ``open`` claims the session slot."""

    def grow(self, nbytes: int) -> None: ...


class SessionBackend(Protocol):
    """Where sessions' keys live and their evaluations run; every method raises :class:`ApiError` for what a
    client did wrong (404/410 for a session it no longer holds, 503/507 when full)."""

    # refuses at once what cannot succeed (503 server full, 429 client quota); reserves no slot or byte yet
    def admit(self, client: str) -> contextlib.AbstractContextManager[Admission]: ...
    async def open(self, admission: Admission, model: Model, body: bytearray, key_bytes: int, owner: str | None,
                   deadline: float) -> Opened: ...
    async def acquire(self, session_id: str, owner: str | None) -> SessionRef: ...
    async def run(self, session: SessionRef, body: bytearray, deadline: float) -> Evaluated: ...
    async def done(self, session: SessionRef) -> None: ...
    async def info(self, session_id: str, owner: str | None) -> dict: ...
    async def delete(self, session_id: str, owner: str | None) -> dict: ...
    def stats(self) -> dict: ...  # {"sessions": ..., "workers": ..., "host": ...} for /v1/stats and /metrics
    async def sweep(self) -> None: ...  # expire idle sessions
    def shutdown(self) -> None: ...


class _CountRequests:
    """ASGI middleware: one counter per (route template, status); never looks at bodies."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 500}
        t0 = time.perf_counter()

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")  # the template: no session id
            self.metrics.request(route, status["code"])
            log.info("%s %s -> %d in %.3f s", scope.get("method"), route, status["code"], time.perf_counter() - t0)


def _with_browser(model: Model) -> dict:
    """The model card with whether the web page can be its client, and the bytes its keys then upload (seeded)."""
    supported, why = browser_support(model)
    card = {**model.describe(), "browser": supported, "browser_client": why}
    if supported:
        card["key_sizes"]["page_public_context_bytes"] = client_spec(model)["upload"]["public_context_bytes"]
    return card


def _error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        codes = {404: "not_found", 405: "method_not_allowed"}
        return _error_response(ApiError(exc.status_code, codes.get(exc.status_code, "http_error"), str(exc.detail)))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}" for e in exc.errors())
        return _error_response(ApiError(400, "bad_request", problems))

    @app.exception_handler(Exception)
    async def _internal_error(_request: Request, exc: Exception) -> JSONResponse:
        log.error("internal error: %s", type(exc).__name__)  # the type only: messages may quote input
        return _error_response(ApiError(500, "internal_error", f"the server failed on this request "
                                        f"({type(exc).__name__}); nothing was kept"))


@dataclass
class Served:
    """What the routes share: limits, programs, sessions, counters and the optional bearer tokens."""

    config: ServeConfig
    registry: Registry
    backend: SessionBackend
    metrics: Metrics
    auth: TokenAuth | None = None
    uploads: UploadGate = field(init=False)  # per-client uploads at once, from the config
    pace: Pace = field(init=False)  # the slowest an upload may arrive

    def __post_init__(self) -> None:
        self.uploads = UploadGate(self.config.max_uploads_per_client)
        self.pace = Pace(self.config.min_upload_bytes_per_s, self.config.upload_grace_s)

    def stats(self) -> dict:
        current, peak = rss_bytes()
        return {**self.metrics.snapshot(), **self.backend.stats(), "models": self.registry.names(),
                "uploads": self.uploads.stats(), "rss_bytes": current, "peak_rss_bytes": peak,
                "limits": self.config.limits()}

    def client(self, request: Request, owner: str | None) -> str:
        """Who the request counts against for the per-client limits."""
        return client_key(owner, request.client.host if request.client else None)

    def owner(self, request: Request) -> str | None:
        """The request's token fingerprint (401 without a valid one), or None when the server has no tokens."""
        return None if self.auth is None else self.auth.owner(request.headers.get("authorization"))

    def model_or_404(self, name: str | None) -> Model:
        names = self.registry.names()
        if not name:
            raise ApiError(400, "missing_model", "name the model with ?model=NAME", extra={"models": names})
        model = self.registry.get(name)
        if model is None:
            raise ApiError(404, "unknown_model", f"no model named {name!r}; this server has {names}",
                           extra={"models": names})
        return model


def build_app(served: Served, on_stop: Callable[[], None] | None = None, what: str = "") -> FastAPI:
    """The application over ``served.backend``; ``on_stop`` runs when it shuts down, after the backend's."""
    config, registry, backend = served.config, served.registry, served.backend

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        async def sweeper() -> None:
            while True:  # frees the keys of idle sessions even when no request comes to trigger it
                await asyncio.sleep(min(30.0, max(0.5, config.session_ttl_s / 4)))
                try:
                    await backend.sweep()
                except Exception as exc:  # noqa: BLE001 - a failed sweep (the key store unreachable) is retried
                    log.warning("session sweep failed: %s", type(exc).__name__)

        task = asyncio.create_task(sweeper())
        log.info("serving %d models from %s: %s (%s)", len(registry.models), config.programs_dir,
                 registry.names(), what)
        try:
            yield
        finally:
            task.cancel()
            backend.shutdown()
            if on_stop is not None:
                on_stop()

    app = FastAPI(title="polyfhe encrypted inference", version="1", lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url="/v1/openapi.json")
    app.state.polyfhe = served
    app.add_middleware(_CountRequests, metrics=served.metrics)
    _add_error_handlers(app)
    _add_public_routes(app, served)
    _add_session_routes(app, served)
    return app


def _add_public_routes(app: FastAPI, served: Served) -> None:
    config, registry = served.config, served.registry

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index() -> HTMLResponse:
        return HTMLResponse(index_html())

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> Response:
        """No icon (the page declares an empty one): 204, so a browser's own request is not logged as a 404."""
        return Response(status_code=204)

    @app.get("/static/{name:path}", include_in_schema=False)
    async def static(name: str) -> Response:
        """The page's scripts and node-seal's WebAssembly: only files shipped in the package."""
        asset = static_asset(name)
        if asset is None:
            raise ApiError(404, "not_found", "no such static file")
        data, media_type = asset
        return Response(data, media_type=media_type, headers={"Cache-Control": "no-cache",
                                                              "X-Content-Type-Options": "nosniff"})

    @app.get("/healthz")
    async def healthz() -> dict:
        """Liveness for load balancers (no token asked): the model names and a session count, nothing more."""
        return {"status": "ok", "models": registry.names(), "sessions": served.backend.stats()["sessions"]["active"]}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics(request: Request) -> PlainTextResponse:
        """Prometheus text; with tokens on, only for a request with a valid token (a scraper gets one)."""
        served.owner(request)
        s = served.backend.stats()
        text = served.metrics.prometheus(s["sessions"], s["workers"], len(registry.models), s["host"])
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/stats")
    async def stats(request: Request) -> dict:
        served.owner(request)  # 401 without a valid token when the server has tokens
        return served.stats()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"models": [_with_browser(registry.models[n]) for n in registry.names()], "limits": config.limits()}

    @app.get("/v1/models/{name}/manifest")
    async def manifest(name: str) -> dict:
        """What a client needs to make keys and pack inputs (parameters, slots, rotations); no weights."""
        return served.model_or_404(name).program.manifest.to_dict()

    @app.get("/v1/models/{name}/client-spec")
    async def spec(name: str) -> dict:
        """What the web page needs to make keys and encode images for this program (public; no weights)."""
        return client_spec(served.model_or_404(name))

    @app.get("/v1/models/{name}/client.zip")
    async def client_zip(name: str) -> Response:
        """A Concrete ML model's client specs and quantisers (public): what a client makes its keys from."""
        entry = served.model_or_404(name)
        if "client.zip" not in kind_of(entry.program).client_files:
            raise ApiError(404, "not_concrete", f"{name} is a CKKS model: its client needs only the manifest")
        return Response((entry.program.directory / "client.zip").read_bytes(), media_type="application/zip")


def _add_session_routes(app: FastAPI, served: Served) -> None:
    config, backend = served.config, served.backend

    def deadline() -> float:
        return asyncio.get_running_loop().time() + config.request_timeout_s

    @app.post("/v1/sessions", status_code=201)
    async def create_session(request: Request, model: str | None = None) -> JSONResponse:
        until = deadline()
        owner = served.owner(request)
        entry = served.model_or_404(model)
        limit = entry.context_limit(config.max_context_bytes)
        why = f" (the most a public context for model {entry.name} can have)" if limit < config.max_context_bytes \
            else ""
        declared_length(request, "public context", limit, why)  # refused before anything is held for it
        client = served.client(request, owner)
        with served.uploads.hold(client), backend.admit(client) as admission:
            body = await read_body(request, "public context", limit, until, admission.grow, served.pace, why)
            check_upload(body, KIND_CONTEXT, entry.program)
            upload_bytes = len(body)
            key_bytes = decoded_context_bytes(entry.program, len(body))
            admission.grow(key_bytes)  # the budget counts keys as they sit in memory
            opened = await backend.open(admission, entry, body, key_bytes, owner, until)
            del body  # the backend holds the keys now
        entry.observed_context_bytes = upload_bytes
        served.metrics.transfer(upload_bytes, 0)
        return JSONResponse({"session_id": opened.session_id, "model": entry.name,
                             "program_id": entry.program.program_id, "ttl_s": config.session_ttl_s,
                             "context_bytes": entry.observed_context_bytes, "load_seconds": opened.load_seconds,
                             "max_ciphertext_bytes": config.max_ciphertext_bytes}, status_code=201)

    @app.post("/v1/sessions/{session_id}/infer")
    async def infer(session_id: str, request: Request) -> Response:
        until = deadline()
        session = await backend.acquire(session_id, served.owner(request))
        try:
            body = await read_body(request, "ciphertext", config.max_ciphertext_bytes, until, pace=served.pace)
            check_upload(body, KIND_CIPHERTEXT, session.program)
            done = await backend.run(session, body, until)
        finally:
            await backend.done(session)
        served.metrics.inference(done.seconds)
        served.metrics.transfer(len(body), len(done.result))
        log.info("session %s: inference in %.3f s (%d bytes in, %d out)", session.short_id(), done.seconds,
                 len(body), len(done.result))
        return Response(done.result, media_type=OCTETS,
                        headers={"X-Polyfhe-Server-Seconds": f"{done.seconds:.6f}", **done.headers})

    @app.get("/v1/sessions/{session_id}")
    async def session_info(session_id: str, request: Request) -> dict:
        """Whether the server still holds a session (404/410 if not), so a client with saved keys can resume it
        without sending a ciphertext first; restarts its idle clock."""
        return await backend.info(session_id, served.owner(request))

    @app.delete("/v1/sessions/{session_id}")
    async def delete_session(session_id: str, request: Request) -> dict:
        return await backend.delete(session_id, served.owner(request))
