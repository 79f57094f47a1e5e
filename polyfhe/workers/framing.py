"""Length-prefixed messages between a parent and its child, every read bounded before anything is allocated.

Standard library only (a child in an environment of its own loads this by path). Three framings, one per kind of
child, each keeping the wire format its users speak:

- :class:`FrameFormat`: ``MAGIC`` | uint32 header length | JSON header | blobs, the header listing each blob's
  length (Concrete ML's workers). The header and the blobs together are bounded before a byte of them is read.
- :func:`write_part` / :func:`read_part`: an 8-byte little-endian length before each part, read into one
  preallocated buffer (Lattigo's key child).
- :func:`send_chunks` / :func:`receive_chunks`: a payload in ``multiprocessing.Connection`` messages of bounded
  size, read off the descriptor straight into one buffer (the server's workers).

A peer that breaks the framing is out of step: nothing it says next can be trusted, so the reader raises
(:class:`FrameError` or ``EOFError``) and the parent kills it (:meth:`polyfhe.workers.child.Child.desync`).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

__all__ = ["CHUNK", "FrameError", "FrameFormat", "fill_from_fd", "read_exact", "read_part", "receive_chunks",
           "send_chunks", "write_part"]

CHUNK = 1 << 24  # bytes per write or read of a large part
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class FrameError(ValueError):
    """The peer broke the framing (bad magic, a length over its bound): it is out of step."""


def read_exact(stream: BinaryIO, n: int) -> bytes:
    """Exactly ``n`` bytes of ``stream``; ``EOFError`` when it ends first."""
    chunks, left = [], n
    while left:
        chunk = stream.read(left)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


@dataclass(frozen=True)
class FrameFormat:
    """``magic`` | uint32 header length | JSON header | blobs. ``max_header`` bounds the header, ``max_body`` the
    blobs together; ``kind`` and ``owner`` name them in the refusal ("a request of N bytes, over the worker's
    limit of M")."""

    magic: bytes
    max_header: int
    max_body: int
    kind: str = "request"
    owner: str = "worker's"

    def write(self, stream: BinaryIO, header: dict, blobs: Any = ()) -> None:
        header = dict(header, blobs=[len(b) for b in blobs])
        raw = json.dumps(header).encode()
        stream.write(self.magic + _U32.pack(len(raw)) + raw)
        stream.writelines(blobs)
        stream.flush()

    def read(self, stream: BinaryIO) -> tuple[dict, list[bytes]]:
        """One frame; ``EOFError`` when the stream ends (inside a frame too), :class:`FrameError` when the frame is
        malformed or over its bounds (nothing past the bound is read)."""
        head = read_exact(stream, len(self.magic) + _U32.size)
        if head[:len(self.magic)] != self.magic:
            raise FrameError("bad frame magic")
        (size,) = _U32.unpack(head[len(self.magic):])
        if size > self.max_header:
            raise FrameError("frame header too large")
        try:
            header = json.loads(read_exact(stream, size))
            lengths = [int(n) for n in header.get("blobs", [])]
        except (ValueError, TypeError, AttributeError) as exc:
            raise FrameError(f"bad frame header ({type(exc).__name__})") from None
        if any(n < 0 for n in lengths) or sum(lengths) > self.max_body:
            raise FrameError(f"a {self.kind} of {sum(lengths)} bytes, over the {self.owner} limit of {self.max_body}")
        return header, [read_exact(stream, n) for n in lengths]


def write_part(stream: BinaryIO, data: bytes | bytearray | memoryview) -> None:
    """One part: its 8-byte little-endian length, then the bytes in :data:`CHUNK`-sized writes (no copy)."""
    stream.write(_U64.pack(len(data)))
    view = memoryview(data)
    stream.writelines(view[start:start + CHUNK] for start in range(0, len(view), CHUNK))


def read_part(stream: BinaryIO, limit: int, peer: str = "the child", what: str = "its answer") -> bytearray:
    """One part of at most ``limit`` bytes, read into one buffer. ``EOFError`` when the stream ends first,
    :class:`FrameError` when the announced length passes ``limit`` (nothing allocated); ``peer`` and ``what`` name
    them in the message."""
    head = stream.read(_U64.size)
    if len(head) != _U64.size:
        raise EOFError(f"{peer} ended before sending {what}")
    (n,) = _U64.unpack(head)
    if n > limit:
        raise FrameError(f"{peer} announced {n} bytes, over the {limit}-byte limit")
    out = bytearray(n)
    view, got = memoryview(out), 0
    while got < n:
        read = stream.readinto(view[got:got + CHUNK])
        if not read:
            raise EOFError(f"{peer} sent {got} of {n} bytes")
        got += read
    return out


def send_chunks(conn: Any, payload: bytes | bytearray | memoryview, chunk: int) -> None:
    """``payload`` in ``chunk``-sized ``Connection.send_bytes`` messages (the receiver knows the total)."""
    view = memoryview(payload).cast("B")
    for start in range(0, len(view), chunk):
        conn.send_bytes(view[start: start + chunk])


def fill_from_fd(fd: int, view: memoryview) -> None:
    """Fill ``view`` from ``fd`` (no allocation); ``EOFError`` when the pipe closes first."""
    while len(view):
        got = os.readv(fd, [view])
        if got == 0:
            raise EOFError("the pipe closed in the middle of a message")
        view = view[got:]


def _message_length(fd: int, header: memoryview) -> int:
    """The length of the next message ``Connection.send_bytes`` wrote (``!i``, or -1 then ``!Q`` past 2 GiB)."""
    fill_from_fd(fd, header[:4])
    (length,) = struct.unpack("!i", header[:4])
    if length == -1:
        fill_from_fd(fd, header[:8])
        (length,) = struct.unpack("!Q", header[:8])
    return length


def receive_chunks(conn: Any, size: int, scratch: memoryview, chunk: int) -> bytearray | None:
    """``size`` payload bytes of :func:`send_chunks` read straight into one buffer, or None (every byte read into
    ``scratch`` and dropped) when this process cannot hold them: the pipe stays in step either way. Reads the
    messages off the pipe's descriptor itself, since ``Connection`` copies every message; ``OSError`` for a
    message longer than announced (out of step)."""
    fd = conn.fileno()
    try:
        buffer: bytearray | None = bytearray(size)
    except MemoryError:
        buffer = None
    view = memoryview(buffer) if buffer is not None else None
    offset = 0
    header = scratch[:8]
    while offset < size:
        length = _message_length(fd, header)
        if length > min(chunk, size - offset):
            raise OSError(f"a payload frame of {length} bytes where at most {min(chunk, size - offset)} remain")
        if view is not None:
            fill_from_fd(fd, view[offset: offset + length])
        else:
            for start in range(0, length, len(scratch)):
                fill_from_fd(fd, scratch[: min(len(scratch), length - start)])
        offset += length
    return buffer
