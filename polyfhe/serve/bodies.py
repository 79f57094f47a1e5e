"""Request bodies read with their size limit enforced before and while they stream in.

A declared Content-Length over the limit is refused before a byte is read; a body without one (chunked) is
counted as it arrives and refused as soon as it passes the limit, so no upload can bypass it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from starlette.requests import ClientDisconnect, Request

from polyfhe.serve.errors import ApiError

__all__ = ["declared_length", "read_body"]


def _too_large(what: str, size: int | str, limit: int) -> ApiError:
    return ApiError(413, "body_too_large", f"{what} of {size} bytes exceeds this endpoint's limit of {limit} "
                    "bytes", extra={"max_bytes": limit})


def declared_length(request: Request, what: str, limit: int) -> int | None:
    """The Content-Length, checked against ``limit`` (413); None for a chunked body."""
    raw = request.headers.get("content-length")
    if raw is None:
        return None
    if not raw.strip().isdigit():
        raise ApiError(400, "bad_content_length", f"Content-Length {raw!r} is not a byte count")
    size = int(raw)
    if size > limit:
        raise _too_large(what, size, limit)
    return size


async def read_body(request: Request, what: str, limit: int, deadline: float,
                    on_progress: Callable[[int], None] | None = None) -> bytearray:
    """The whole body, at most ``limit`` bytes; ``on_progress(total)`` may refuse it (e.g. 507) midway.

    One buffer, grown as the chunks arrive (large buffers grow in place by remapping, not copying): a gigabyte
    context is held once, never as chunks plus their join. Never sized from the declared length up front, which
    would let a header alone claim memory."""
    declared = declared_length(request, what, limit)
    body = bytearray()
    total = 0
    try:
        async with asyncio.timeout_at(deadline):
            async for chunk in request.stream():
                end = total + len(chunk)
                if end > limit:
                    raise _too_large(what, f"more than {limit}", limit)
                if declared is not None and end > declared:
                    raise ApiError(400, "body_longer_than_declared", f"the {what} runs past its declared "
                                   f"Content-Length of {declared} bytes")
                if on_progress is not None:
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
