"""polyfhe.workers.framing: every read is bounded before it allocates, a truncated frame is an end, and a frame
that breaks the format is refused (its peer is out of step)."""

from __future__ import annotations

import io
import json
import multiprocessing
import struct

import pytest

from polyfhe.workers.framing import (
    FrameError,
    FrameFormat,
    read_exact,
    read_part,
    receive_chunks,
    send_chunks,
    write_part,
)

FRAMES = FrameFormat(b"TEST", max_header=256, max_body=1000)


def _frame(header: dict, blobs=()) -> bytes:
    out = io.BytesIO()
    FRAMES.write(out, header, blobs)
    return out.getvalue()


class _Stingy(io.BytesIO):
    """A stream that hands out one byte per read (as a pipe may)."""

    def read(self, n=-1):
        return super().read(min(n, 1) if n and n > 0 else n)


def test_a_frame_round_trips_through_a_stream_that_returns_short_reads() -> None:
    header, blobs = FRAMES.read(_Stingy(_frame({"command": "x"}, [b"abc", b"", b"d" * 100])))
    assert header == {"command": "x", "blobs": [3, 0, 100]} and blobs == [b"abc", b"", b"d" * 100]


def test_an_oversized_frame_is_refused_before_its_bytes_are_read() -> None:
    raw = json.dumps({"blobs": [600, 600]}).encode()
    stream = io.BytesIO(b"TEST" + struct.pack("<I", len(raw)) + raw)  # announces 1200 bytes, sends none
    with pytest.raises(FrameError, match="a request of 1200 bytes, over the worker's limit of 1000"):
        FRAMES.read(stream)
    with pytest.raises(FrameError, match="header too large"):
        FRAMES.read(io.BytesIO(b"TEST" + struct.pack("<I", 257) + b"{" * 257))
    negative = json.dumps({"blobs": [-5]}).encode()
    with pytest.raises(FrameError):
        FRAMES.read(io.BytesIO(b"TEST" + struct.pack("<I", len(negative)) + negative))


def test_a_malformed_frame_is_refused() -> None:
    with pytest.raises(FrameError, match="bad frame magic"):
        FRAMES.read(io.BytesIO(b"NOPE" + struct.pack("<I", 2) + b"{}"))
    with pytest.raises(FrameError, match="bad frame header"):
        FRAMES.read(io.BytesIO(b"TEST" + struct.pack("<I", 3) + b"{{{"))
    with pytest.raises(FrameError, match="bad frame header"):
        FRAMES.read(io.BytesIO(b"TEST" + struct.pack("<I", 2) + b"[]"))


def test_a_truncated_frame_is_an_end_of_stream() -> None:
    whole = _frame({"command": "x"}, [b"k" * 50])
    for cut in (0, 3, 7, 12, len(whole) - 1):
        with pytest.raises(EOFError):
            FRAMES.read(io.BytesIO(whole[:cut]))
    with pytest.raises(EOFError):
        read_exact(io.BytesIO(b"abc"), 4)


def test_parts_are_bounded_and_name_their_peer() -> None:
    out = io.BytesIO()
    write_part(out, b"k" * 100)
    assert bytes(read_part(io.BytesIO(out.getvalue()), 100)) == b"k" * 100
    with pytest.raises(FrameError, match="the key child announced 100 bytes, over the 99-byte limit"):
        read_part(io.BytesIO(out.getvalue()), 99, peer="the key child")
    with pytest.raises(EOFError, match="the key child sent 40 of 100 bytes"):
        read_part(io.BytesIO(out.getvalue()[:48]), 100, peer="the key child")
    with pytest.raises(EOFError, match="the key child ended before sending its keys"):
        read_part(io.BytesIO(b"\x01\x02"), 100, peer="the key child", what="its keys")


def test_connection_chunks_round_trip_and_an_overlong_message_is_out_of_step() -> None:
    ours, theirs = multiprocessing.Pipe(duplex=True)
    try:
        scratch = memoryview(bytearray(16))
        payload = bytes(range(256)) * 10
        send_chunks(theirs, payload, chunk=1000)
        assert bytes(receive_chunks(ours, len(payload), scratch, chunk=1000)) == payload
        theirs.send_bytes(b"x" * 50)  # one message longer than the 20 bytes announced
        with pytest.raises(OSError, match="a payload frame of 50 bytes where at most 20 remain"):
            receive_chunks(ours, 20, scratch, chunk=1000)
    finally:
        ours.close()
        theirs.close()
