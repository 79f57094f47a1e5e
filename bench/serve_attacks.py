"""Crafted requests for the load bench's attacker (``bench/serve_load.py --attacker``): what took ``polyfhe serve``
down before the server-crash work, and what a fuzzer throws at it.

- ``crafted_context``: a client's public context whose Galois keys have a zero random part past their first 64
  bytes (what the earlier check sampled); on the previous main the server accepted it;
- ``single_residue_ciphertext``: an input whose residues are all zero but one in its second component; with the
  keys above, the previous main's first native rotation threw through ctypes (SIGABRT);
- ``nested_header``: a container whose JSON header nests 100,000 levels (a ``RecursionError``: 500 before);
- random bytes.
SEAL's format (``serializable.h``, ``kswitchkeys.cpp``): a 16-byte header, a zstd payload; a key-switching key set
is parms_id, a row count, and per row a count and that many public keys (ciphertexts of two components).
"""

from __future__ import annotations

import os
import struct

import zstandard

from polyfhe.program.wire import KIND_CIPHERTEXT, KIND_CONTEXT, MAGIC, pack, unpack

__all__ = ["attack_requests", "crafted_context", "nested_header", "single_residue_ciphertext"]

HEADER = struct.Struct("<HBBBBHQ")  # magic, header size, version, compression, reserved, total bytes
MEMBERS = 32 + 1 + 8 * 3 + 8 + 8  # parms_id, is_ntt, size, N, primes, scale, correction factor
DATA = MEMBERS + HEADER.size + 8  # a ciphertext payload's start to its coefficients


def _inflate(obj: bytes) -> bytearray:
    return bytearray(zstandard.ZstdDecompressor().decompress(bytes(obj)[HEADER.size:], max_output_size=1 << 31))


def _deflate(payload: bytes, like: bytes) -> bytes:
    """``payload`` zstd-compressed behind a SEAL header of the same version as the object ``like``."""
    _, _, major, minor, _, _, _ = HEADER.unpack_from(bytes(like[:HEADER.size]))
    body = zstandard.ZstdCompressor(level=1).compress(payload)
    return HEADER.pack(0xA15E, HEADER.size, major, minor, 2, 0, HEADER.size + len(body)) + body


def _dims(payload: bytes | bytearray, at: int) -> tuple[int, int]:
    """(N, primes) of the ciphertext whose members start at ``at``."""
    _, _, n, primes = struct.unpack_from("<BQQQ", payload, at + 32)
    return n, primes


def crafted_context(context: bytes) -> bytes:
    box = unpack(context, KIND_CONTEXT)
    keys = _inflate(box.sections["galois_keys"])
    (rows,) = struct.unpack_from("<Q", keys, 32)
    pos = 40
    for _ in range(rows):
        (count,) = struct.unpack_from("<Q", keys, pos)
        pos += 8
        for _ in range(count):
            total = HEADER.unpack_from(keys, pos)[-1]
            n, primes = _dims(keys, pos + HEADER.size)
            second = pos + HEADER.size + DATA + n * primes * 8  # the random component
            keys[second + 64: second + n * primes * 8] = bytes(n * primes * 8 - 64)
            pos += total
    galois = _deflate(bytes(keys), box.sections["galois_keys"])
    return pack(KIND_CONTEXT, box.header, {**box.sections, "galois_keys": galois})


def single_residue_ciphertext(query: bytes) -> bytes:
    box = unpack(query, KIND_CIPHERTEXT)
    ct = _inflate(box.sections["ct0"])
    n, primes = _dims(ct, 0)
    ct[DATA:] = bytes(len(ct) - DATA)
    struct.pack_into("<Q", ct, DATA + n * primes * 8 + 8, 12345)
    return pack(KIND_CIPHERTEXT, box.header, {"ct0": _deflate(bytes(ct), box.sections["ct0"])})


def nested_header(kind: bytes, depth: int = 100_000) -> bytes:
    raw = b"[" * depth + b"]" * depth
    return MAGIC + kind + struct.pack("<I", len(raw)) + raw


def attack_requests(client, sample, session_id: str, model: str) -> list[tuple[str, bytes, dict]]:
    """(path, body, query parameters) of every crafted request, for ``client``'s keys and ``session_id``."""
    query = client.encrypt(sample)
    return [("/v1/sessions", crafted_context(client.public_context()), {"model": model}),
            (f"/v1/sessions/{session_id}/infer", single_residue_ciphertext(query), {}),
            ("/v1/sessions", nested_header(KIND_CONTEXT), {"model": model}),
            (f"/v1/sessions/{session_id}/infer", nested_header(KIND_CIPHERTEXT), {}),
            (f"/v1/sessions/{session_id}/infer", os.urandom(4096), {})]
