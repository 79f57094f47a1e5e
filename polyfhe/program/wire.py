"""Byte containers that cross the client/server boundary: public contexts and ciphertext bundles.

Layout: ``MAGIC`` (6 bytes) | kind (1 byte) | header length (uint32 LE) | JSON header | sections. The header
names every section with its length; parsing checks magic, kind, sizes, section names and that the lengths
add up, before any SEAL deserialiser sees a byte. A public context never has a ``secret_key`` section;
one that does is refused with a message that says what to send instead.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass

import numpy as np

__all__ = ["KIND_CIPHERTEXT", "KIND_CONTEXT", "KIND_SECRET", "MAX_HEADER_NESTING", "Container", "WireError",
           "header_nesting", "pack", "unpack"]

MAGIC = b"PFHE01"
KIND_CONTEXT = b"P"  # public context: public key, relinearisation keys, Galois keys
KIND_SECRET = b"S"  # the client's private backup (holds the secret key): never sent to a server
KIND_CIPHERTEXT = b"C"
MAX_HEADER = 1 << 20
MAX_HEADER_NESTING = 16  # polyfhe's own headers nest 3 levels (the sections list)
ALLOWED_SECTIONS = {
    KIND_CONTEXT: {"public_key", "relin_keys", "galois_keys", "evaluation_keys", "bootstrap_keys"},  # last two: Lattigo
    KIND_SECRET: {"secret_key", "public_key", "relin_keys", "galois_keys"},
    KIND_CIPHERTEXT: None,  # "ct0", "ct1", ... checked against the header's count
}
KIND_NAMES = {KIND_CONTEXT: "public context", KIND_SECRET: "secret (private) context", KIND_CIPHERTEXT: "ciphertext"}


def header_nesting(raw: bytes) -> int:
    """An upper bound on the nesting depth of a JSON text (brackets inside strings count too), without parsing:
    json's recursive decoder would overflow Python's stack on ``[[[[...`` before it could refuse it."""
    brackets = np.frombuffer(bytes(raw).translate(None, _NOT_BRACKETS), dtype=np.uint8)
    if not len(brackets):
        return 0
    steps = np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1)
    return int(np.cumsum(steps).max())


_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


class WireError(ValueError):
    """Malformed, truncated or mismatched bytes."""


@dataclass(frozen=True)
class Container:
    kind: bytes
    header: dict
    sections: dict[str, memoryview]  # read-only views into the received bytes: a key set is not copied again


def pack(kind: bytes, header: dict, sections: dict[str, bytes | list[bytes]]) -> bytes:
    """One container; a section may be given as a list of chunks, joined straight into the result (a key set of
    gigabytes is then never held twice)."""
    parts = {name: data if isinstance(data, list) else [data] for name, data in sections.items()}
    head = dict(header)
    head["sections"] = [[name, sum(len(c) for c in chunks)] for name, chunks in parts.items()]
    raw = json.dumps(head, sort_keys=True).encode()
    return b"".join([MAGIC, kind, struct.pack("<I", len(raw)), raw, *(c for chunks in parts.values() for c in chunks)])


def unpack(data: bytes | bytearray | memoryview, expect: bytes, max_bytes: int | None = None) -> Container:
    """Parse and validate a container of kind ``expect``; raises :class:`WireError` with the reason.

    Sections are views into ``data``, never copies (a context of gigabytes, perhaps a memory-mapped file, is
    held once); do not change ``data`` while they are in use."""
    what = KIND_NAMES[expect]
    if not isinstance(data, (bytes, bytearray, memoryview, mmap.mmap)):
        raise WireError(f"expected bytes for a {what}, got {type(data).__name__}")
    try:
        data = memoryview(data).cast("B")
    except TypeError as exc:
        raise WireError(f"a {what} must be a contiguous byte buffer: {exc}") from exc
    if max_bytes is not None and len(data) > max_bytes:
        raise WireError(f"{what} of {len(data)} bytes exceeds the limit of {max_bytes} bytes")
    if len(data) < len(MAGIC) + 5 or bytes(data[:len(MAGIC)]) != MAGIC:
        raise WireError(f"not a polyfhe {what}: bad magic (expected bytes made by polyfhe's CKKSClient)")
    kind = bytes(data[len(MAGIC): len(MAGIC) + 1])
    if kind != expect:
        if expect == KIND_CONTEXT and kind == KIND_SECRET:
            raise WireError("this context holds a secret key; a server accepts only client.public_context()")
        raise WireError(f"expected a {what}, got a {KIND_NAMES.get(kind, repr(kind))}")
    (size,) = struct.unpack("<I", data[len(MAGIC) + 1: len(MAGIC) + 5])
    start = len(MAGIC) + 5
    if size > MAX_HEADER or start + size > len(data):
        raise WireError(f"{what} header length {size} is invalid for {len(data)} bytes (truncated?)")
    raw = bytes(data[start: start + size])
    nesting = header_nesting(raw)
    if nesting > MAX_HEADER_NESTING:
        raise WireError(f"{what} header nests {nesting} levels deep; a polyfhe header nests at most "
                        f"{MAX_HEADER_NESTING}")
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise TypeError(f"a JSON {type(header).__name__}, not an object")
        sections_spec = [(str(n), int(k)) for n, k in header.pop("sections")]
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as exc:
        raise WireError(f"{what} header is not valid: {type(exc).__name__}: {str(exc)[:200]}") from None
    allowed = ALLOWED_SECTIONS[expect]
    sections: dict[str, memoryview] = {}
    view = data
    pos = start + size
    for name, length in sections_spec:
        if allowed is not None and name not in allowed:
            raise WireError(f"{what} has an unexpected section {name!r}; allowed: {sorted(allowed)}")
        if length < 0 or pos + length > len(data):
            raise WireError(f"{what} is truncated: section {name!r} needs {length} bytes, "
                            f"{max(0, len(data) - pos)} left")
        sections[name] = view[pos: pos + length]
        pos += length
    if pos != len(data):
        raise WireError(f"{what} has {len(data) - pos} trailing bytes after its sections")
    return Container(kind, header, sections)
