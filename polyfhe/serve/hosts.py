"""Where a session's keys live and its evaluations run: in the server's own process, or in worker processes.

A host opens a session from a public context, runs a ciphertext through it and closes it. Both hosts turn an
engine's refusal of hostile bytes into the same :class:`~polyfhe.serve.errors.ApiError` (:func:`refusal`), so the
HTTP layer never sees an engine's exception type.

- :class:`ThreadHost` evaluates in the server's process: cheapest, but a crash inside an engine's native code (or
  the kernel's OOM killer) ends the server with every session.
- :class:`~polyfhe.serve.process_host.ProcessHost` (the default) keeps sessions in worker processes; a worker
  that dies costs its own sessions only (their clients open them again with the keys they hold), and the server
  starts a new one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from polyfhe.program.engine_api import EngineRefusal
from polyfhe.program.wire import WireError
from polyfhe.serve.errors import ApiError

__all__ = ["Host", "SessionHandle", "ThreadHost", "refusal"]

log = logging.getLogger(__name__)


def refusal(exc: BaseException, stage: str) -> ApiError | None:
    """The HTTP refusal for an engine's exception while ``stage`` ("context" or "ciphertext") was handled, or
    ``None`` for an exception the client's bytes cannot explain (a server bug: 500). Never quotes input bytes."""
    if isinstance(exc, WireError):
        what = "public context" if stage == "context" else "ciphertext"
        return ApiError(400, f"bad_{stage}", f"the {what} was refused: {exc}")
    if isinstance(exc, EngineRefusal):
        return ApiError(422, "evaluation_refused", "the engine refused to evaluate this input with this "
                        f"session's keys ({exc}); keys made by polyfhe's client never do this: open a new session "
                        "with a public context from client.public_context()")
    if isinstance(exc, MemoryError):
        return ApiError(507, "out_of_memory", f"the server ran out of memory while handling this {stage}; retry "
                        "later or use a smaller program", retry_after=30)
    return None


def engine_call(fn, stage: str, *args: Any) -> Any:
    """``fn(*args)`` with an engine's refusals turned into :class:`ApiError`; anything else propagates."""
    try:
        return fn(*args)
    except ApiError:
        raise
    except Exception as exc:
        mapped = refusal(exc, stage)
        if mapped is None:
            raise
        log.warning("%s refused: %s", stage, type(exc).__name__)
        raise mapped from None


def open_server(program: Any, body: bytes, max_context_bytes: int, max_ciphertext_bytes: int) -> Any:
    """The engine's evaluator for one public context (both hosts build sessions this way)."""
    return program.server(body, max_context_bytes=max_context_bytes, max_ciphertext_bytes=max_ciphertext_bytes)


@dataclass
class SessionHandle:
    """What the session store keeps for a session: the program (for identity checks) and the host's own key."""

    program: Any
    key: Any  # ThreadHost: the engine's server object; ProcessHost: (worker index, session id)


class Host(Protocol):
    """Opens, runs and closes sessions; every method raises :class:`ApiError` for what a client did wrong."""

    name: str

    def start(self) -> None: ...
    def open(self, session_id: str, model: Any, body: bytes) -> SessionHandle: ...
    def run(self, handle: SessionHandle, body: bytes) -> bytes: ...
    def close(self, handle: SessionHandle) -> None: ...
    def stats(self) -> dict: ...
    def shutdown(self) -> None: ...


class ThreadHost:
    """Sessions in this process (``polyfhe serve --isolation thread``): no copy of the bytes, no isolation."""

    name = "thread"

    def __init__(self, max_context_bytes: int, max_ciphertext_bytes: int, eval_delay_s: float = 0.0) -> None:
        self.max_context_bytes = max_context_bytes
        self.max_ciphertext_bytes = max_ciphertext_bytes
        self.eval_delay_s = eval_delay_s  # testing aid: a slow model

    def start(self) -> None:
        return None

    def open(self, session_id: str, model: Any, body: bytes) -> SessionHandle:
        server = engine_call(open_server, "context", model.program, body, self.max_context_bytes,
                             self.max_ciphertext_bytes)
        return SessionHandle(model.program, server)

    def run(self, handle: SessionHandle, body: bytes) -> bytes:
        if self.eval_delay_s:
            time.sleep(self.eval_delay_s)
        return engine_call(handle.key.run, "ciphertext", body)

    def close(self, handle: SessionHandle) -> None:
        close = getattr(handle.key, "close", None)
        if close is not None:
            close()

    def stats(self) -> dict:
        return {"isolation": self.name}

    def shutdown(self) -> None:
        return None
