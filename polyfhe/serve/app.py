"""``create_app(config)``: the FastAPI application of the encrypted-inference demo server.

Routes: ``GET /`` (web page), ``GET /healthz``, ``GET /metrics``, ``GET /v1/models``,
``GET /v1/models/{name}/manifest``, ``GET /v1/models/{name}/client-spec`` (what the web page's client needs),
``GET /static/NAME`` (the page's scripts and node-seal's WebAssembly), ``GET /v1/models/{name}/client.zip`` (Concrete ML models), ``GET /v1/stats``, ``POST /v1/sessions?model=NAME`` (public context in),
``POST /v1/sessions/{id}/infer`` (ciphertext in, ciphertext out), ``DELETE /v1/sessions/{id}``.
Every refusal is JSON ``{"error": code, "detail": sentence, "status": n}``. Nothing here logs a body.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from polyfhe.program.engines import decoded_context_bytes
from polyfhe.program.wire import KIND_CIPHERTEXT, KIND_CONTEXT
from polyfhe.runtime.plaintexts import DEFAULT_PLAINTEXT_BYTES
from polyfhe.serve.auth import TokenAuth
from polyfhe.serve.bodies import declared_length, read_body
from polyfhe.serve.clientspec import browser_support, client_spec
from polyfhe.serve.config import ServeConfig
from polyfhe.serve.errors import ApiError
from polyfhe.serve.hosts import Host, ThreadHost
from polyfhe.serve.metrics import Metrics, rss_bytes
from polyfhe.serve.page import index_html, static_asset
from polyfhe.serve.registry import Model, Registry
from polyfhe.serve.sessions import Reservation, Session, SessionStore
from polyfhe.serve.uploads import check_upload
from polyfhe.serve.workers import WorkPool

__all__ = ["ServerState", "create_app"]

log = logging.getLogger(__name__)

OCTETS = "application/octet-stream"


@dataclass
class ServerState:
    config: ServeConfig
    registry: Registry
    sessions: SessionStore
    pool: WorkPool
    metrics: Metrics
    host: Host
    auth: TokenAuth | None = None

    def stats(self) -> dict:
        current, peak = rss_bytes()
        return {**self.metrics.snapshot(), "sessions": self.sessions.stats(), "workers": self.pool.stats(),
                "host": self.host.stats(), "models": self.registry.names(), "rss_bytes": current,
                "peak_rss_bytes": peak, "limits": self.config.limits()}

    def owner(self, request: Request) -> str | None:
        """The request's token fingerprint (401 without a valid one), or None when the server has no tokens."""
        return None if self.auth is None else self.auth.owner(request.headers.get("authorization"))


# ------------------------------------------------------------------------------------------------------------
# work done on the worker threads
# ------------------------------------------------------------------------------------------------------------
def _open_session(state: ServerState, reservation: Reservation, model: Model, body: bytes, key_bytes: int,
                  owner: str | None) -> tuple[Session, float]:
    """Load the keys on the host and register the session here, on the worker thread: a session whose request
    timed out meanwhile is still registered (and expires), never left on a host unknown to the store."""
    t0 = time.perf_counter()
    session_id = state.sessions.new_id()
    handle = state.host.open(session_id, model, body)
    session = state.sessions.add(reservation, model.name, handle, key_bytes, session_id, owner)
    return session, time.perf_counter() - t0


def _evaluate(state: ServerState, session: Session, body: bytes) -> tuple[bytes, float]:
    t0 = time.perf_counter()
    out = state.host.run(session.handle, body)
    return out, time.perf_counter() - t0


def make_host(config: ServeConfig, registry: Registry, on_lost, warm: bool = False) -> Host:
    """The host of ``config.isolation``: worker processes (each with its share of the plaintext budget) or this
    process."""
    if config.isolation == "thread":
        return ThreadHost(config.max_context_bytes, config.max_ciphertext_bytes, config.eval_delay_s)
    from polyfhe.serve.process_host import ProcessHost
    from polyfhe.serve.worker_main import WorkerSpec

    ckks = sum(1 for m in registry.models.values() if m.program.scheme == "ckks")
    per_model = registry.plaintext_cache_bytes if registry.plaintext_cache_bytes is not None else \
        DEFAULT_PLAINTEXT_BYTES // max(1, ckks)
    spec = WorkerSpec(0, registry.root, per_model // config.worker_processes, config.max_context_bytes,
                      config.max_ciphertext_bytes, config.max_concurrency, config.worker_memory_headroom_bytes,
                      logging.getLogger().getEffectiveLevel(), warm, config.eval_delay_s)
    return ProcessHost(spec, config.worker_processes, on_lost)


# ------------------------------------------------------------------------------------------------------------
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


def create_app(config: ServeConfig, registry: Registry | None = None, warm: bool = False) -> FastAPI:
    """The application, its session host started (worker processes loaded and ready) before it returns;
    ``warm``: the workers encode their programs' plaintexts first (``--warm``)."""
    registry = registry if registry is not None else Registry(config.programs_dir)

    def drop(session: Session) -> None:  # keys freed off the caller's thread (it holds the store's lock)
        threading.Thread(target=host.close, args=(session.handle,), daemon=True).start()

    sessions = SessionStore(config.session_ttl_s, config.max_sessions, config.key_budget_bytes,
                            config.expired_memory, on_drop=drop)
    host = make_host(config, registry, sessions.lose, warm)  # drop() finds it here when a session ends
    auth = TokenAuth.from_file(config.auth_token_file) if config.auth_token_file is not None else None
    state = ServerState(config, registry, sessions, WorkPool(config.max_concurrency, config.max_queue), Metrics(),
                        host, auth)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        async def sweeper() -> None:
            while True:  # frees the keys of idle sessions even when no request comes to trigger it
                await asyncio.sleep(min(30.0, max(0.5, config.session_ttl_s / 4)))
                state.sessions.sweep()

        task = asyncio.create_task(sweeper())
        log.info("serving %d models from %s: %s (sessions in %s)", len(registry.models), config.programs_dir,
                 registry.names(), "worker processes" if config.isolation == "process" else "this process")
        try:
            yield
        finally:
            task.cancel()
            state.pool.shutdown()
            state.host.shutdown()

    app = FastAPI(title="polyfhe encrypted inference", version="1", lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url="/v1/openapi.json")
    state.host.start()
    app.state.polyfhe = state
    app.add_middleware(_CountRequests, metrics=state.metrics)

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

    def deadline() -> float:
        return asyncio.get_running_loop().time() + config.request_timeout_s

    def model_or_404(name: str | None) -> Model:
        names = registry.names()
        if not name:
            raise ApiError(400, "missing_model", "name the model with ?model=NAME", extra={"models": names})
        model = registry.get(name)
        if model is None:
            raise ApiError(404, "unknown_model", f"no model named {name!r}; this server has {names}",
                           extra={"models": names})
        return model

    # -------------------------------------------------------------------------------------------------------
    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index() -> HTMLResponse:
        return HTMLResponse(index_html())

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
        return {"status": "ok", "models": registry.names(), "sessions": len(state.sessions)}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        text = state.metrics.prometheus(state.sessions.stats(), state.pool.stats(), len(registry.models),
                                        state.host.stats())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/stats")
    async def stats() -> dict:
        return state.stats()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"models": [_with_browser(registry.models[n]) for n in registry.names()], "limits": config.limits()}

    @app.get("/v1/models/{name}/manifest")
    async def manifest(name: str) -> dict:
        """What a client needs to make keys and pack inputs (parameters, slots, rotations); no weights."""
        return model_or_404(name).program.manifest.to_dict()

    @app.get("/v1/models/{name}/client-spec")
    async def spec(name: str) -> dict:
        """What the web page needs to make keys and encode images for this program (public; no weights)."""
        return client_spec(model_or_404(name))

    @app.get("/v1/models/{name}/client.zip")
    async def client_zip(name: str) -> Response:
        """A Concrete ML model's client specs and quantisers (public): what a client makes its keys from."""
        entry = model_or_404(name)
        if entry.program.scheme != "concrete":
            raise ApiError(404, "not_concrete", f"{name} is a CKKS model: its client needs only the manifest")
        return Response((entry.program.directory / "client.zip").read_bytes(), media_type="application/zip")

    @app.post("/v1/sessions", status_code=201)
    async def create_session(request: Request, model: str | None = None) -> JSONResponse:
        until = deadline()
        owner = state.owner(request)
        entry = model_or_404(model)
        declared = declared_length(request, "public context", config.max_context_bytes)
        reservation = state.sessions.reserve(declared or 0)
        try:
            grow = None if declared is not None else (lambda n: state.sessions.grow(reservation, n))
            body = await read_body(request, "public context", config.max_context_bytes, until, grow)
            check_upload(body, KIND_CONTEXT, entry.program)
            upload_bytes = len(body)
            key_bytes = decoded_context_bytes(entry.program, len(body))
            state.sessions.grow(reservation, key_bytes)  # the budget counts keys as they sit in memory
            session, load_s = await state.pool.run(_open_session, state, reservation, entry, body, key_bytes, owner,
                                                   deadline=until, what="loading the public context")
            del body  # the host holds the keys now
        finally:
            state.sessions.release(reservation)
        entry.observed_context_bytes = upload_bytes
        state.metrics.transfer(upload_bytes, 0)
        return JSONResponse({"session_id": session.id, "model": entry.name, "program_id": entry.program.program_id,
                             "ttl_s": config.session_ttl_s, "context_bytes": entry.observed_context_bytes,
                             "load_seconds": load_s,
                             "max_ciphertext_bytes": config.max_ciphertext_bytes}, status_code=201)

    @app.post("/v1/sessions/{session_id}/infer")
    async def infer(session_id: str, request: Request) -> Response:
        until = deadline()
        session = state.sessions.acquire(session_id, state.owner(request))
        try:
            body = await read_body(request, "ciphertext", config.max_ciphertext_bytes, until)
            check_upload(body, KIND_CIPHERTEXT, session.handle.program)
            out, seconds = await state.pool.run(_evaluate, state, session, body, deadline=until,
                                                what=f"inference in session {session.short_id()}")
        finally:
            state.sessions.done(session)
        state.metrics.inference(seconds)
        state.metrics.transfer(len(body), len(out))
        log.info("session %s: inference in %.3f s (%d bytes in, %d out)", session.short_id(), seconds,
                 len(body), len(out))
        return Response(out, media_type=OCTETS, headers={"X-Polyfhe-Server-Seconds": f"{seconds:.6f}"})

    @app.get("/v1/sessions/{session_id}")
    async def session_info(session_id: str, request: Request) -> dict:
        """Whether the server still holds a session (404/410 if not), so a client with saved keys can resume it
        without sending a ciphertext first; restarts its idle clock."""
        session = state.sessions.touch(session_id, state.owner(request))
        return {"session_id": session.id, "model": session.model, "program_id": session.handle.program.program_id,
                "ttl_s": config.session_ttl_s, "requests": session.requests, "key_bytes": session.key_bytes}

    @app.delete("/v1/sessions/{session_id}")
    async def delete_session(session_id: str, request: Request) -> dict:
        session = state.sessions.delete(session_id, state.owner(request))
        return {"deleted": True, "model": session.model, "freed_key_bytes": session.key_bytes,
                "requests": session.requests}

    return app
