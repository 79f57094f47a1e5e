"""SEAL's refusals, raised alike on the native path and on the bindings' path."""

from __future__ import annotations

import logging

from polyfhe.program.engine_api import EngineRefusal

__all__ = ["SealCallError", "refused"]

log = logging.getLogger(__name__)


class SealCallError(EngineRefusal):
    """SEAL refused an operation on these values (which may be a client's: keys, ciphertexts). Raised alike by
    the native path (SEAL's C++ exception, caught by the shim) and by :class:`~polyfhe.engines.seal.backend.SealOps`
    on the bindings' path. ``operation``: what was refused; ``reason``: SEAL's message."""

    def __init__(self, operation: str, reason: str) -> None:
        super().__init__(f"SEAL refused {operation}: {reason}", operation, reason)


def refused(operation: str, reason: str) -> SealCallError:
    """The :class:`SealCallError` for ``operation``, logged at WARNING (SEAL's message only, never any data)."""
    log.warning("SEAL refused %s: %s", operation, reason)
    return SealCallError(operation, reason)
