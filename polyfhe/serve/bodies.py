"""Request bodies read with their size limit enforced before and while they stream in, at a minimum pace.

A declared Content-Length over the limit is refused before a byte is read; a body without one (chunked) is
counted as it arrives and refused as soon as it passes the limit, so no upload can bypass it. A body that, once
its grace period is over, has arrived slower than the server's minimum rate is cut with 408 at the moment it
falls behind (the wait for each chunk is bounded by when it would), so a trickle cannot hold a connection, a
session slot or memory for the whole request timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from starlette.requests import ClientDisconnect, Request

from polyfhe.serve.errors import ApiError

__all__ = ["Pace", "declared_length", "read_body"]


@dataclass(frozen=True)
class Pace:
    """The slowest an upload may arrive: ``bytes_per_s`` on average once ``grace_s`` have passed (0: any)."""

    bytes_per_s: int = 0
    grace_s: float = 0.0

    def due(self, start: float, received: int) -> float | None:
        """When the next byte is due (loop time), given ``received`` bytes since ``start``; None: never."""
        if self.bytes_per_s <= 0:
            return None
        return start + self.grace_s + received / self.bytes_per_s


def _too_large(what: str, size: int | str, limit: int, why: str = "") -> ApiError:
    return ApiError(413, "body_too_large", f"{what} of {size} bytes exceeds this endpoint's limit of {limit} "
                    f"bytes{why}", extra={"max_bytes": limit})


def declared_length(request: Request, what: str, limit: int, why: str = "") -> int | None:
    """The Content-Length, checked against ``limit`` (413, with ``why`` the limit is what it is); None for a
    chunked body."""
    raw = request.headers.get("content-length")
    if raw is None:
        return None
    if not raw.strip().isdigit():
        raise ApiError(400, "bad_content_length", f"Content-Length {raw!r} is not a byte count")
    size = int(raw)
    if size > limit:
        raise _too_large(what, size, limit, why)
    return size


async def read_body(request: Request, what: str, limit: int, deadline: float,
                    on_progress: Callable[[int], None] | None = None, pace: Pace = Pace(), why: str = "") -> bytearray:
    """The whole body, at most ``limit`` bytes, arriving at ``pace`` at least; ``on_progress(total)`` may refuse
    it (e.g. 507) midway.

    One buffer, grown as the chunks arrive (large buffers grow in place by remapping, not copying): a gigabyte
    context is held once, never as chunks plus their join. Never sized from the declared length up front, which
    would let a header alone claim memory."""
    declared = declared_length(request, what, limit, why)
    body = bytearray()
    total = 0
    start = asyncio.get_running_loop().time()
    chunks = request.stream().__aiter__()
    try:
        while True:
            due = pace.due(start, total)
            cutoff = deadline if due is None else min(deadline, due)
            try:
                async with asyncio.timeout_at(cutoff):
                    chunk = await anext(chunks)
            except StopAsyncIteration:
                break
            except TimeoutError:
                if cutoff < deadline:
                    raise _too_slow(what, total, pace) from None
                raise
            end = total + len(chunk)
            if end > limit:
                raise _too_large(what, f"more than {limit}", limit, why)
            if declared is not None and end > declared:
                raise ApiError(400, "body_longer_than_declared", f"the {what} runs past its declared "
                               f"Content-Length of {declared} bytes")
            if on_progress is not None and chunk:
                on_progress(end)
            body += chunk
            total = end
    except TimeoutError:
        raise ApiError(408, "upload_timeout", f"the {what} did not arrive within the server's request "
                       "timeout") from None
    except ClientDisconnect:
        raise ApiError(400, "client_disconnected", f"the client went away during the {what} upload") from None
    if declared is not None and total != declared:
        raise ApiError(400, "truncated_body", f"the {what} ended after {total} of {declared} declared bytes")
    if total == 0:
        raise ApiError(400, "empty_body", f"the request has no body; send the {what} as raw bytes "
                       "(Content-Type: application/octet-stream)")
    return body


def _too_slow(what: str, received: int, pace: Pace) -> ApiError:
    return ApiError(408, "upload_too_slow", f"the {what} arrived slower than this server's minimum of "
                    f"{pace.bytes_per_s} bytes/s (after a {pace.grace_s:g} s grace period; {received} bytes "
                    "came); send it over a faster link, or ask the operator to lower --min-upload-rate",
                    extra={"min_upload_bytes_per_s": pace.bytes_per_s, "upload_grace_s": pace.grace_s})
