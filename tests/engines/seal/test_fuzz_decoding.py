"""Fuzzing what a server decodes from a client: wire containers, public contexts, ciphertexts (hypothesis).

The property, for mutated valid inputs and for crafted bombs alike: the input either works, or it is refused
with :class:`~polyfhe.program.wire.WireError` or :class:`~polyfhe.engines.seal.context.SerializationError` (both
``ValueError``) and a message. Never another exception, never a crash, and never a peak RSS more than
``RSS_BOUND`` above what the process held before (SEAL allocates natively, so RSS rather than tracemalloc: the
high-water mark is reset through ``/proc/self/clear_refs`` before each input and read from
``/proc/self/status`` after it). An input that works and is an equivalent encoding of the valid one (the same
header, the same inflated SEAL payloads, by a strict reference decoder here) must give the right answer; one
that works otherwise (flipped coefficients: no check can see those) must still give a well-formed result.

The crafted bombs inflate to ``BOMB`` bytes (1 GiB): a decoder that inflates one, or lets SEAL parse it,
passes the bound. They are built from RLE blocks in microseconds (:mod:`seal_bombs`).

Budget: a few hundred examples, about 30 s on two cores. The default run is deterministic (the same examples
every time); ``POLYFHE_FUZZ_RANDOM=1`` draws new ones and ``POLYFHE_FUZZ_EXAMPLES`` scales their number (e.g.
``POLYFHE_FUZZ_RANDOM=1 POLYFHE_FUZZ_EXAMPLES=20`` for a long search).
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import numpy as np
import pytest
import seal_bombs as sb
import zstandard
from ckks_testlib import export_square_mlp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polyfhe.engines.seal.context import SerializationError
from polyfhe.program.boundary import galois_element
from polyfhe.program.wire import (
    ALLOWED_SECTIONS,
    KIND_CIPHERTEXT,
    KIND_CONTEXT,
    MAGIC,
    Container,
    WireError,
    pack,
    unpack,
)
from polyfhe.serve.errors import ApiError
from polyfhe.serve.uploads import check_upload

pytestmark = pytest.mark.fhe

MIB = 1 << 20
RSS_BOUND = 256 * MIB  # peak growth allowed while decoding one input (a valid context takes about 30 MB)
BOMB = 1 << 30  # what the crafted bombs inflate to
SCALE = float(os.environ.get("POLYFHE_FUZZ_EXAMPLES", "1"))
RANDOM = os.environ.get("POLYFHE_FUZZ_RANDOM", "") not in ("", "0")
REFUSED = (WireError, SerializationError)
PROC_STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


def examples(n: int) -> int:
    return max(1, round(n * SCALE))


FUZZ = settings(deadline=None, database=None, print_blob=True, derandomize=not RANDOM,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ------------------------------------------------------------------------------------------------------------
# memory: peak RSS growth over a block
# ------------------------------------------------------------------------------------------------------------
def _status_bytes(key: str) -> int:
    for line in PROC_STATUS.read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


class PeakRss:
    """``growth``: the peak RSS during the block minus the RSS before it (Linux: the high-water mark is reset
    first; elsewhere nothing is measured and ``growth`` stays 0)."""

    def __init__(self) -> None:
        self.growth = 0
        self.exact = False

    def __enter__(self) -> Self:
        try:
            CLEAR_REFS.write_text("5")  # 5: reset the peak RSS to the current RSS
            self.before = _status_bytes("VmRSS")
            self.exact = True
        except (OSError, KeyError):
            self.exact = False
        return self

    def __exit__(self, *exc: object) -> None:
        if self.exact:
            self.growth = _status_bytes("VmHWM") - self.before


# ------------------------------------------------------------------------------------------------------------
# the program, its keys and valid inputs, once per module
# ------------------------------------------------------------------------------------------------------------
@dataclass(repr=False)
class Setup:
    program: object
    client: object
    server: object
    context: bytes
    ciphertext: bytes
    x: np.ndarray
    plain: np.ndarray
    context_box: Container
    ciphertext_box: Container
    payloads: dict[str, bytes]  # inflated SEAL payload of every section of the valid context and ciphertext
    key_meta: sb.CipherMeta  # a public key's metadata (the key level)
    data_meta: sb.CipherMeta  # the input ciphertext's
    galois_rows: set[int]  # rows of the program's Galois elements

    def __repr__(self) -> str:  # hypothesis prints the strategies' arguments
        return f"Setup(program {self.program.program_id})"

    def payload_fields(self, name: str) -> list[tuple[str, int, str]]:
        if name in ("ct0", "public_key"):
            return sb.cipher_fields()
        return sb.kswitch_fields(self.payloads[name])


@pytest.fixture(scope="module")
def setup() -> Setup:
    """The serve tests' ``tiny`` program (64 -> 12 -> x^2 -> 4, N=8192, 8 rotations), keys and inputs."""
    program = export_square_mlp(12, 4)
    client = program.client()
    context = client.public_context()
    x = np.random.default_rng(1).random((1, 1, 8, 8))
    ciphertext = client.encrypt(x)
    context_box, ciphertext_box = unpack(context, KIND_CONTEXT), unpack(ciphertext, KIND_CIPHERTEXT)
    payloads = {name: sb.inflate(section) for box in (context_box, ciphertext_box)
                for name, section in box.sections.items()}
    n = program.params.poly_modulus_degree
    return Setup(program, client, program.server(context), context, ciphertext, x, program.run_plain(x),
                 context_box, ciphertext_box, payloads, sb.CipherMeta.parse(payloads["public_key"]),
                 sb.CipherMeta.parse(payloads["ct0"]),
                 {galois_element(s, n) >> 1 for s in program.manifest.galois_steps})


# ------------------------------------------------------------------------------------------------------------
# a strict reference decoder: is a mutated input an equivalent encoding of the valid one?
# ------------------------------------------------------------------------------------------------------------
def reference_payload(obj, limit: int) -> bytes | None:
    """The payload of a SEAL object by the book (exact header, one whole frame, no trailing bytes), or None;
    never inflates past ``limit`` bytes."""
    obj = bytes(obj)
    if len(obj) < sb.SEAL_HEADER.size:
        return None
    magic, header_size, major, _minor, mode, reserved, total = sb.parse_header(obj)
    if magic != sb.SEAL_MAGIC or header_size != 16 or major != 4 or reserved or total != len(obj):
        return None
    body = obj[sb.SEAL_HEADER.size:]
    try:
        if mode == sb.COMPR_NONE:
            return body
        if mode == sb.COMPR_ZLIB:
            inflater = zlib.decompressobj()
            out = inflater.decompress(body, limit + 1)
            ok = (inflater.eof and not inflater.unused_data and not inflater.unconsumed_tail
                  and len(out) <= limit)
            return out if ok else None
        if mode == sb.COMPR_ZSTD:
            declared = zstandard.get_frame_parameters(body).content_size
            if declared != zstandard.CONTENTSIZE_UNKNOWN and declared > limit:
                return None
            return zstandard.ZstdDecompressor().decompress(body, max_output_size=limit,
                                                           allow_extra_data=False)
    except (zstandard.ZstdError, zlib.error):
        return None
    return None


def equivalent(data: bytes, kind: bytes, box: Container, payloads: dict[str, bytes]) -> bool:
    """``data`` is the container ``box`` again: the same header and sections whose payloads are the same."""
    try:
        other = unpack(data, kind)
    except WireError:
        return False
    if other.header != box.header or list(other.sections) != list(box.sections):
        return False
    return all(reference_payload(section, len(payloads[name])) == payloads[name]
               for name, section in other.sections.items())


# ------------------------------------------------------------------------------------------------------------
# mutations
# ------------------------------------------------------------------------------------------------------------
U64_VALUES = (0, 1, 2, 3, 4, 5, 15, 16, 17, 64, 65, 4096, 8191, 8192, 8193, 1 << 31, 1 << 32, 1 << 40,
              1 << 62, 1 << 63, (1 << 64) - 1)
F64_VALUES = (math.nan, math.inf, -math.inf, 0.0, -0.0, 5e-324, 1.0, 2.0 ** 40, 2.0 ** 40 * (1 + 1e-5),
              2.0 ** 40 * (1 + 1e-9), math.nextafter(2.0 ** 40, math.inf), -(2.0 ** 40), 2.0 ** 80, 1e308)
JSON_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70),
                        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                        st.lists(st.integers(-5, 5), max_size=3), st.dictionaries(st.text(max_size=4),
                                                                                   st.integers(), max_size=2))
LENGTH_TEXTS = ("0", "-1", "1.5", "1e400", "-1e400", "NaN", "Infinity", "null", "true", '"12"', "[1]", "{}",
                "9" * 40, "1e3")


@st.composite
def byte_ops(draw, hot: tuple[int, ...]) -> list[tuple]:
    """1 to 3 edits of a byte string: bit flips, byte sets, truncation, insertion, deletion; positions near
    ``hot`` offsets (headers, frame starts) or anywhere."""
    ops = []
    for _ in range(draw(st.integers(1, 3))):
        if hot and draw(st.booleans()):
            pos = ("at", draw(st.sampled_from(hot)) + draw(st.integers(-4, 24)))
        else:
            pos = ("frac", draw(st.floats(0.0, 1.0)))
        kind = draw(st.sampled_from(("flip", "flip", "byte", "truncate", "insert", "delete")))
        arg = {"flip": st.integers(0, 7), "byte": st.integers(0, 255), "truncate": st.just(None),
               "insert": st.binary(min_size=1, max_size=16), "delete": st.integers(1, 64)}[kind]
        ops.append((kind, pos, draw(arg)))
    return ops


def apply_ops(data: bytes, ops: list[tuple]) -> bytes:
    buf = bytearray(data)
    for kind, (how, where), arg in ops:
        if not buf:
            break
        p = min(max(where, 0), len(buf) - 1) if how == "at" else min(int(where * len(buf)), len(buf) - 1)
        if kind == "flip":
            buf[p] ^= 1 << arg
        elif kind == "byte":
            buf[p] = arg
        elif kind == "truncate":
            del buf[p:]
        elif kind == "insert":
            buf[p:p] = arg
        else:
            del buf[p: p + arg]
    return bytes(buf)


def container_hot(box: Container, data: bytes) -> tuple[int, ...]:
    """Offsets of a container's own header and of each section's SEAL header and zstd frame."""
    hot = [0, len(MAGIC), len(MAGIC) + 1, len(MAGIC) + 5, len(data) - 1]
    pos = len(data) - sum(len(s) for s in box.sections.values())
    for section in box.sections.values():
        hot += [pos, pos + 8, pos + 16, pos + 20, pos + len(section) - 1]
        pos += len(section)
    return tuple(hot)


def raw_container(kind: bytes, header: dict | str, sections: list[tuple[str, bytes]],
                  lengths: list | None = None, size_field: int | None = None) -> bytes:
    """A container written by hand: ``header`` as JSON text or a dict (``sections`` then lists ``lengths``,
    default the real ones), and a header-length field that may lie."""
    if isinstance(header, dict):
        head = dict(header)
        head["sections"] = [[n, len(s) if lengths is None else lengths[i]]
                            for i, (n, s) in enumerate(sections)]
        text = json.dumps(head, sort_keys=True)
    else:
        text = header
    raw = text.encode("utf-8", "surrogatepass")
    size = len(raw) if size_field is None else size_field
    return b"".join([MAGIC, kind, struct.pack("<I", size & 0xFFFFFFFF), raw, *(s for _, s in sections)])


@st.composite
def header_mutation(draw, box: Container, kind: bytes) -> Mutant:
    """The container ``box`` with its JSON header changed: a value, a section entry, or the text itself."""
    sections = [(n, bytes(s)) for n, s in box.sections.items()]
    header = dict(box.header)
    real = [[n, len(s)] for n, s in sections]
    how = draw(st.sampled_from(("value", "new key", "drop key", "length", "length text", "rename", "order",
                                "duplicate", "header text", "size field", "not an object")))
    if how in ("value", "new key"):
        key = draw(st.sampled_from(sorted(header)) if how == "value" else st.text(max_size=8))
        header[key] = value = draw(JSON_VALUES)
        return Mutant(f"header {key!r} = {value!r}", raw_container(kind, header, sections))
    if how == "drop key":
        key = draw(st.sampled_from(sorted(header)))
        header.pop(key)
        return Mutant(f"header without {key!r}", raw_container(kind, header, sections))
    if how in ("length", "length text"):
        i = draw(st.integers(0, len(sections) - 1))
        lengths: list = [len(s) for _, s in sections]
        if how == "length":
            lengths[i] = draw(st.one_of(st.sampled_from((0, -1, lengths[i] - 1, lengths[i] + 1, 1 << 62)),
                                        st.integers(-(1 << 64), 1 << 64), JSON_VALUES))
            return Mutant(f"section {i} length {lengths[i]!r}",
                          raw_container(kind, header, sections, lengths))
        marker, text = 987654321987, draw(st.sampled_from(LENGTH_TEXTS))
        head = {**header,
                "sections": [[n, marker if j == i else len(s)] for j, (n, s) in enumerate(sections)]}
        raw = json.dumps(head, sort_keys=True).replace(str(marker), text)
        return Mutant(f"section {i} length written {text}", raw_container(kind, raw, sections))
    if how == "rename":
        i = draw(st.integers(0, len(sections) - 1))
        new = draw(st.one_of(st.sampled_from(("secret_key", "ct1", "ct0", "public_key", "galois_keys", "")),
                             st.text(max_size=10)))
        sections[i] = (new, sections[i][1])
        return Mutant(f"section {i} named {new!r}", raw_container(kind, header, sections))
    if how == "order":
        return Mutant("sections reversed", raw_container(kind, header, sections[::-1]))
    if how == "duplicate":
        i = draw(st.integers(0, len(sections) - 1))
        return Mutant(f"section {i} twice", raw_container(kind, header, [*sections, sections[i]]))
    text = json.dumps({**header, "sections": real}, sort_keys=True)
    if how == "header text":
        ops = draw(byte_ops(()))
        edited = apply_ops(text.encode(), ops).decode("utf-8", "replace")
        return Mutant(f"header text edited {ops}", raw_container(kind, edited, sections))
    if how == "size field":
        size = draw(st.sampled_from((0, 1, len(text) - 1, len(text) + 1, 1 << 20, (1 << 20) + 1,
                                     (1 << 32) - 1)))
        return Mutant(f"header length field {size}", raw_container(kind, text, sections, size_field=size))
    value = draw(st.one_of(st.lists(st.integers(), max_size=3), st.text(max_size=8), st.integers(),
                           st.floats(), st.none(), st.booleans()))
    return Mutant(f"header is {value!r}", raw_container(kind, json.dumps(value), sections))


@st.composite
def payload_mutation(draw, s: Setup, kind: bytes) -> Mutant:
    """A field of one section's inflated payload set to an interesting value (or its bytes edited), stored
    again as zstd, zlib or uncompressed."""
    box = s.context_box if kind == KIND_CONTEXT else s.ciphertext_box
    name = draw(st.sampled_from(list(box.sections)))
    payload = bytearray(s.payloads[name])
    fields = s.payload_fields(name)
    if draw(st.booleans()):
        field, offset, fmt = draw(st.sampled_from(fields))
        if fmt == "<d":
            value = draw(st.sampled_from(F64_VALUES))
        elif fmt == "<Q":
            value = draw(st.sampled_from(U64_VALUES))
        else:
            value = draw(st.integers(0, (1 << (8 * struct.calcsize(fmt))) - 1))
        struct.pack_into(fmt, payload, offset, value)
        how = f"{name} {field} at {offset} = {value!r}"
    else:
        ops = draw(byte_ops(tuple(off for _, off, _ in fields)))
        payload = bytearray(apply_ops(bytes(payload), ops))
        how = f"{name} payload edited {ops}"
    mode = draw(st.sampled_from((sb.COMPR_ZSTD, sb.COMPR_ZSTD, sb.COMPR_ZLIB, sb.COMPR_NONE)))
    obj = sb.compress(bytes(payload), mode)
    return Mutant(f"{how}, compression {mode}", with_section(box, kind, name, obj))


class Mutant:
    """Bytes that hypothesis reports by how they were made (a context is 19 MB)."""

    def __init__(self, how: str, data: bytes) -> None:
        self.how, self.data = how, data

    def __repr__(self) -> str:
        return f"<{len(self.data)} bytes: {self.how}>"


def with_section(box: Container, kind: bytes, name: str, obj: bytes) -> bytes:
    return pack(kind, box.header, {**box.sections, name: obj})


@st.composite
def mutated(draw, s: Setup, kind: bytes, bombs) -> Mutant:
    """A mutation of the valid container of ``kind``: of its bytes, of one SEAL object's bytes, of one SEAL
    payload's fields, its JSON header, an equivalent re-encoding, or a crafted bomb."""
    box, data = (s.context_box, s.context) if kind == KIND_CONTEXT else (s.ciphertext_box, s.ciphertext)
    layer = draw(st.sampled_from(("container", "object", "payload", "payload", "header", "reencode", "bomb")))
    if layer == "container":
        ops = draw(byte_ops(container_hot(box, data)))
        return Mutant(f"container edited {ops}", apply_ops(data, ops))
    if layer == "object":
        name = draw(st.sampled_from(list(box.sections)))
        ops = draw(byte_ops((0, 6, 8, 15, 16, 20, 22, 25)))
        obj = apply_ops(bytes(box.sections[name]), ops)
        return Mutant(f"{name} edited {ops}", with_section(box, kind, name, obj))
    if layer == "payload":
        return draw(payload_mutation(s, kind))
    if layer == "header":
        return draw(header_mutation(box, kind))
    if layer == "reencode":  # equivalent: the same payload stored otherwise
        name = draw(st.sampled_from(list(box.sections)))
        mode = draw(st.sampled_from((sb.COMPR_NONE, sb.COMPR_ZLIB, sb.COMPR_ZSTD)))
        level = draw(st.integers(1, 3))
        return Mutant(f"{name} stored with compression {mode} level {level}",
                      with_section(box, kind, name, sb.compress(s.payloads[name], mode, level=level)))
    return draw(bombs(s))


# ------------------------------------------------------------------------------------------------------------
# crafted bombs and malformed objects
# ------------------------------------------------------------------------------------------------------------
def galois_parms(s: Setup) -> bytes:
    return s.payloads["galois_keys"][:32]


def real_rows(s: Setup) -> list[list[bytes]]:
    return sb.kswitch_rows(s.context_box.sections["galois_keys"])[1]


def context_with(s: Setup, **objects: bytes) -> bytes:
    return pack(KIND_CONTEXT, s.context_box.header, {**s.context_box.sections, **objects})


def galois_extra_rows(s: Setup, inflated: int = BOMB, keys: int = 4, key_size: int = 2) -> bytes:
    """The program's real Galois keys plus rows of all-zero keys (``keys`` per row, ``key_size`` components)
    until the set inflates to about ``inflated`` bytes: SEAL parses each as a valid key."""
    meta = s.key_meta.with_(size=key_size)
    per_row = keys * (meta.coefficients * 8 + 128)
    extra = max(1, inflated // per_row)
    rows: list = real_rows(s)
    spare = [r for r in range(len(rows)) if r not in s.galois_rows]
    for r in spare[:extra]:
        rows[r] = keys
    return sb.kswitch_object(galois_parms(s), rows, key_meta=meta)


def galois_program_rows(s: Setup, keys: int, key_size: int = 2, meta: sb.CipherMeta | None = None) -> bytes:
    """Exactly the program's rows, each with ``keys`` all-zero keys of ``key_size`` components."""
    meta = (meta or s.key_meta).with_(size=key_size)
    rows: list = [keys if r in s.galois_rows else [] for r in range(s.program.params.poly_modulus_degree)]
    return sb.kswitch_object(galois_parms(s), rows, key_meta=meta)


def _relin_parms(s: Setup) -> bytes:
    return s.payloads["relin_keys"][:32]


def _with_header(obj, **header) -> bytes:
    """A SEAL object with its header rewritten (the payload as it was)."""
    total = header.pop("total", len(obj))
    return sb.seal_header(total, header.pop("compr_mode", sb.COMPR_ZSTD), **header) + bytes(obj)[16:]


def _zlib_zeros(size: int) -> bytes:
    deflater, chunk = zlib.compressobj(1), bytes(16 * MIB)
    return b"".join([*(deflater.compress(chunk) for _ in range(size // len(chunk))), deflater.flush()])


def _pk(s: Setup) -> memoryview:
    return s.context_box.sections["public_key"]


def _galois(s: Setup, rows_edit) -> bytes:
    rows = real_rows(s)
    first = min(s.galois_rows)
    return context_with(s, galois_keys=sb.kswitch_object(galois_parms(s), rows_edit(rows, first)))


# Public contexts that must be refused, each within the memory bound. None inflates past BOMB if parsed: a
# run against a decoder without a cap stays safe (and fails).
CONTEXT_CASES = {
    "galois: program rows plus rows of zero keys, 1 GiB": lambda s: context_with(
        s, galois_keys=galois_extra_rows(s)),
    "galois: program rows of 24 zero keys of 16 components, 1 GiB": lambda s: context_with(
        s, galois_keys=galois_program_rows(s, 24, 16)),
    "galois: zero bomb, 1 GiB": lambda s: context_with(s, galois_keys=sb.zero_bomb(BOMB, galois_parms(s))),
    "galois: frame declares the exact size, inflates to 1 GiB": lambda s: context_with(
        s, galois_keys=sb.seal_object(sb.zstd_frame(s.payloads["galois_keys"], (BOMB, 0),
                                                    content_size=len(s.payloads["galois_keys"])))),
    "galois: frame declares 2^62 bytes": lambda s: context_with(
        s, galois_keys=sb.seal_object(sb.zstd_frame(s.payloads["galois_keys"], content_size=1 << 62))),
    "galois: frame with a 2 GiB window": lambda s: context_with(
        s, galois_keys=sb.seal_object(sb.zstd_frame(s.payloads["galois_keys"][:1000], (BOMB, 0),
                                                    window_log=31))),
    "galois: 2^63 rows declared": lambda s: context_with(
        s, galois_keys=sb.kswitch_object(galois_parms(s), [], rows_declared=1 << 63)),
    "galois: a row of 2^63 keys": lambda s: context_with(s, galois_keys=sb.seal_object(sb.zstd_frame(
        galois_parms(s) + sb.U64.pack(s.program.params.poly_modulus_degree) + sb.U64.pack(1 << 63)))),
    "galois: a program row missing": lambda s: _galois(
        s, lambda rows, first: [[] if r == first else row for r, row in enumerate(rows)]),
    "galois: one extra real-looking row": lambda s: _galois(
        s, lambda rows, first: [rows[first] if r == first + 1 else row for r, row in enumerate(rows)]),
    "galois: a row of 3 keys": lambda s: _galois(
        s, lambda rows, first: [row[:3] if r == first else row for r, row in enumerate(rows)]),
    "galois: 8193 rows": lambda s: _galois(s, lambda rows, first: [*rows, []]),
    "galois: 1 row": lambda s: _galois(s, lambda rows, first: [rows[first]]),
    "galois: keys at the data level": lambda s: context_with(
        s, galois_keys=galois_program_rows(s, 4, meta=s.data_meta.with_(scale=1.0))),
    "galois: keys with a NaN scale": lambda s: context_with(
        s, galois_keys=galois_program_rows(s, 4, meta=s.key_meta.with_(scale=math.nan))),
    "galois: a relinearisation key set": lambda s: context_with(
        s, galois_keys=s.context_box.sections["relin_keys"]),
    "galois: an empty section": lambda s: context_with(s, galois_keys=b""),
    "relin: 64 zero keys": lambda s: context_with(
        s, relin_keys=sb.kswitch_object(_relin_parms(s), [64], key_meta=s.key_meta)),
    "relin: 24 zero keys of 16 components": lambda s: context_with(
        s, relin_keys=sb.kswitch_object(_relin_parms(s), [24], key_meta=s.key_meta.with_(size=16))),
    "relin: two rows": lambda s: context_with(
        s, relin_keys=sb.kswitch_object(_relin_parms(s), [4, 4], key_meta=s.key_meta)),
    "relin: zero bomb, 1 GiB": lambda s: context_with(s, relin_keys=sb.zero_bomb(BOMB, _relin_parms(s))),
    "relin: a Galois key set": lambda s: context_with(s, relin_keys=s.context_box.sections["galois_keys"]),
    "public key: 16 components": lambda s: context_with(
        s, public_key=sb.cipher_object(s.key_meta.with_(size=16))),
    "public key: 2^40 components, 1 GiB of zeros": lambda s: context_with(
        s, public_key=sb.cipher_object(s.key_meta.with_(size=1 << 40), zeros=BOMB)),
    "public key: at the data level": lambda s: context_with(s, public_key=s.ciphertext_box.sections["ct0"]),
    "public key: NaN scale": lambda s: context_with(s, public_key=sb.cipher_object(
        s.key_meta.with_(scale=math.nan), sb.split_cipher(_pk(s))[1])),
    "public key: zero bomb, 1 GiB": lambda s: context_with(s, public_key=sb.zero_bomb(BOMB)),
    "public key: zlib bomb, 1 GiB": lambda s: context_with(
        s, public_key=sb.seal_object(_zlib_zeros(BOMB), sb.COMPR_ZLIB)),
    "public key: uncompressed, 64 MiB of zeros": lambda s: context_with(
        s, public_key=sb.seal_header(16 + 64 * MIB, sb.COMPR_NONE) + bytes(64 * MIB)),
    "public key: a Galois key set": lambda s: context_with(
        s, public_key=s.context_box.sections["galois_keys"]),
    "public key: SEAL header says 2^63 bytes": lambda s: context_with(s, public_key=_with_header(
        _pk(s), total=1 << 63)),
    "public key: SEAL header says one byte more": lambda s: context_with(s, public_key=_with_header(
        _pk(s), total=len(_pk(s)) + 1)),
    "public key: SEAL version 3.6": lambda s: context_with(
        s, public_key=_with_header(_pk(s), version=(3, 6))),
    "public key: compression mode 7": lambda s: context_with(
        s, public_key=_with_header(_pk(s), compr_mode=7)),
    "public key: bad magic": lambda s: context_with(s, public_key=_with_header(_pk(s), magic=0xA15F)),
    "public key: header size 17": lambda s: context_with(s, public_key=_with_header(_pk(s), header_size=17)),
    "public key: a secret key": lambda s: context_with(
        s, public_key=unpack(s.client.secret_context(), b"S").sections["secret_key"]),
}


def _one(s: Setup, obj) -> bytes:
    return with_section(s.ciphertext_box, KIND_CIPHERTEXT, "ct0", obj)


def _ct_data(s: Setup) -> bytes:
    return s.payloads["ct0"][sb.META.size + sb.SEAL_HEADER.size + 8:]


def _ct(s: Setup) -> memoryview:
    return s.ciphertext_box.sections["ct0"]


def _evaluated(s: Setup, how: str) -> bytes:
    """The input ciphertext multiplied by itself (three components) or switched one level down."""
    seal = s.client.seal
    ct, out = seal.load("ciphertext", _ct(s)), seal.sa.Ciphertext()
    if how == "square":
        seal.evaluator.multiply(ct, ct, out)
    else:
        seal.evaluator.mod_switch_to_next(ct, out)
    return seal.dump(out)


# Input ciphertexts that must be refused, each within the memory bound.
def _scaled(scale: float):
    return lambda s: _one(s, sb.cipher_object(s.data_meta.with_(scale=scale), _ct_data(s)))


CIPHERTEXT_CASES = {
    **{f"scale {v!r}": _scaled(v) for v in (math.nan, math.inf, -math.inf, 0.0, -(2.0 ** 40), 5e-324,
                                            2.0 ** 40 * (1 + 1e-3))},
    "transparent (second component zero)": lambda s: _one(s, sb.transparent(_ct(s))),
    "all zero": lambda s: _one(s, sb.cipher_object(s.data_meta)),
    "not in NTT form": lambda s: _one(s, sb.cipher_object(s.data_meta.with_(is_ntt=0), _ct_data(s))),
    "three components (a product, not relinearised)": lambda s: _one(s, _evaluated(s, "square")),
    "16 components of zeros": lambda s: _one(s, sb.cipher_object(s.data_meta.with_(size=16))),
    "2^20 components, 1 GiB of zeros": lambda s: _one(
        s, sb.cipher_object(s.data_meta.with_(size=1 << 20), zeros=BOMB)),
    "one level down": lambda s: _one(s, _evaluated(s, "down")),
    "at the key level": lambda s: _one(s, sb.cipher_object(s.key_meta.with_(scale=2.0 ** 40))),
    "unknown parms_id": lambda s: _one(
        s, sb.cipher_object(s.data_meta.with_(parms_id=bytes(32)), _ct_data(s))),
    "N = 4096": lambda s: _one(
        s, sb.cipher_object(s.data_meta.with_(n=4096), _ct_data(s)[: len(_ct_data(s)) // 2])),
    "correction factor 2": lambda s: _one(s, sb.cipher_object(s.data_meta.with_(correction=2), _ct_data(s))),
    "coefficient count + 1": lambda s: _one(s, sb.cipher_object(
        s.data_meta, _ct_data(s) + bytes(8), count=s.data_meta.coefficients + 1)),
    "coefficient count 2^61, 1 GiB of zeros": lambda s: _one(s, sb.cipher_object(
        s.data_meta, count=1 << 61, zeros=BOMB)),
    "zero bomb, 1 GiB": lambda s: _one(s, sb.zero_bomb(BOMB)),
    "frame declares the exact size, inflates to 1 GiB": lambda s: _one(s, sb.seal_object(sb.zstd_frame(
        s.payloads["ct0"], (BOMB, 0), content_size=len(s.payloads["ct0"])))),
    "a trailing second frame of 1 GiB": lambda s: _one(s, sb.seal_object(
        zstandard.ZstdCompressor().compress(s.payloads["ct0"]) + sb.zstd_frame((BOMB, 0)))),
    "a public key": lambda s: _one(s, _pk(s)),
    "a Galois key set": lambda s: _one(s, s.context_box.sections["galois_keys"]),
    "SEAL header says 2^63 bytes": lambda s: _one(s, _with_header(_ct(s), total=1 << 63)),
    "SEAL header says one byte less": lambda s: _one(s, _with_header(_ct(s), total=len(_ct(s)) - 1)),
    "an empty section": lambda s: _one(s, b""),
}


# Input ciphertexts a server may refuse or serve, but not fail on: scales within a hair of the program's (a
# client encrypts at exactly 2^scale_bits). 1099511631856.0242 = 2^40 (1 + 3.7e-9) was found by
# bench/fuzz_atheris.py: SEAL refused an addition midway ("scale mismatch").
NEAR_SCALES = (math.nextafter(2.0 ** 40, 0.0), 2.0 ** 40 + 0.25, 2.0 ** 40 * (1 + 1e-9), 1099511631856.0242,
               2.0 ** 40 * (1 + 1e-7), 2.0 ** 40 * (1 - 9e-7))


@st.composite
def context_bombs(draw, s: Setup) -> Mutant:
    """A Galois or relinearisation key set of zero keys, with the shape drawn."""
    which = draw(st.sampled_from(("extra rows", "program rows", "relin")))
    keys = draw(st.sampled_from((1, 3, 4, 5, 16, 64)))
    key_size = draw(st.sampled_from((2, 2, 3, 16)))
    if which == "extra rows":
        inflated = draw(st.sampled_from((BOMB // 4, BOMB)))
        keys = min(keys, 16)
        return Mutant(f"Galois keys plus rows of {keys} zero keys of {key_size} components, {inflated} bytes",
                      context_with(s, galois_keys=galois_extra_rows(s, inflated, keys, key_size)))
    if (keys, key_size) == (4, 2):  # the exact structure: test_zero_keys_are_refused_or_harmless
        keys = 5 if which == "program rows" else 64
    if which == "program rows":
        keys = min(keys, 24) if key_size == 16 else keys  # at most BOMB when parsed
        return Mutant(f"Galois rows of {keys} zero keys of {key_size} components",
                      context_with(s, galois_keys=galois_program_rows(s, keys, key_size)))
    return Mutant(f"relin row of {keys} zero keys of {key_size} components", context_with(
        s, relin_keys=sb.kswitch_object(_relin_parms(s), [keys], key_meta=s.key_meta.with_(size=key_size))))


@st.composite
def ciphertext_bombs(draw, s: Setup) -> Mutant:
    """A ciphertext with drawn metadata: size, scale, level, counts, zeros behind it."""
    meta = s.data_meta.with_(
        size=draw(st.sampled_from((0, 1, 2, 3, 16, 17, 1 << 20, 1 << 40))),
        scale=draw(st.sampled_from(F64_VALUES)),
        parms_id=draw(st.sampled_from((s.data_meta.parms_id, s.key_meta.parms_id, bytes(32)))),
        is_ntt=draw(st.sampled_from((0, 1, 2))))
    count = draw(st.sampled_from((None, 0, meta.coefficients + 1, 1 << 61)))
    zeros = draw(st.sampled_from((None, 0, BOMB)))
    if zeros is None and (meta.coefficients if count is None else count) * 8 > 64 * MIB:
        zeros = BOMB
    obj = sb.cipher_object(meta, count=count, zeros=zeros)
    how = (f"ciphertext size {meta.size}, scale {meta.scale!r}, parms_id {meta.parms_id[:4].hex()}, ntt "
           f"{meta.is_ntt}, count {count}, zeros {zeros}")
    return Mutant(how, with_section(s.ciphertext_box, KIND_CIPHERTEXT, "ct0", obj))


# ------------------------------------------------------------------------------------------------------------
# checks
# ------------------------------------------------------------------------------------------------------------
def refused_or_none(action) -> tuple[object, Exception | None]:
    """(result, None) or (None, the refusal); any other exception propagates (and fails the test)."""
    try:
        return action(), None
    except REFUSED as exc:
        assert str(exc).strip(), f"{type(exc).__name__} without a message"
        return None, exc


def check_result(s: Setup, out: bytes, must_be_right: bool) -> None:
    logits = s.client.decrypt(out)
    assert logits.shape == s.plain.shape
    if must_be_right:
        np.testing.assert_allclose(logits, s.plain, atol=1e-3)


def check_bound(peak: PeakRss) -> None:
    assert peak.growth < RSS_BOUND, (f"decoding took {peak.growth / MIB:.0f} MiB of RSS (bound "
                                     f"{RSS_BOUND / MIB:.0f} MiB)")


def _check_served(s: Setup, data: bytes, kind: bytes, serve, equivalent_hint: bool | None) -> Exception | None:
    """``serve()`` -> (output, refusal) within the memory bound; an input equivalent to the valid one (same
    header, same inflated payloads) must be served, and any output must be right."""
    with PeakRss() as peak:
        out, refusal = serve()
    check_bound(peak)
    what, box = ("context", s.context_box) if kind == KIND_CONTEXT else ("ciphertext", s.ciphertext_box)
    same = equivalent(data, kind, box, s.payloads) if equivalent_hint is None else equivalent_hint
    if same:
        assert refusal is None, f"an equivalent {what} was refused: {refusal}"
    if out is not None:
        check_result(s, out, same)
    return refusal


def check_context(s: Setup, data: bytes, equivalent_hint: bool | None = None) -> Exception | None:
    """Decode a public context (and, if accepted, serve the valid ciphertext with it) within the bound."""
    def serve():
        server, refusal = refused_or_none(lambda: s.program.server(data))
        if server is None:
            return None, refusal
        return refused_or_none(lambda: server.run(s.ciphertext))

    return _check_served(s, data, KIND_CONTEXT, serve, equivalent_hint)


def check_ciphertext(s: Setup, data: bytes, equivalent_hint: bool | None = None) -> Exception | None:
    """Serve an input ciphertext with the valid context's server, within the bound."""
    return _check_served(s, data, KIND_CIPHERTEXT, lambda: refused_or_none(lambda: s.server.run(data)),
                         equivalent_hint)


# ------------------------------------------------------------------------------------------------------------
# (a) containers
# ------------------------------------------------------------------------------------------------------------
def container_mutants(box: Container, kind: bytes, data: bytes):
    edits = byte_ops(container_hot(box, data)).map(lambda ops: Mutant(f"edited {ops}", apply_ops(data, ops)))
    return st.one_of(edits, header_mutation(box, kind))


@pytest.mark.parametrize("kind", [KIND_CIPHERTEXT, KIND_CONTEXT], ids=["ciphertext", "context"])
def test_unpack_and_the_upload_check_refuse_or_parse_mutated_containers(setup, kind):
    box, data = (setup.context_box, setup.context) if kind == KIND_CONTEXT else (setup.ciphertext_box,
                                                                                 setup.ciphertext)
    limit = len(data) + 4096

    @settings(FUZZ, max_examples=examples(150))
    @given(container_mutants(box, kind, data))
    def run(mutant: Mutant) -> None:
        parsed, _ = refused_or_none(lambda: unpack(mutant.data, kind, max_bytes=limit))
        if parsed is not None:
            allowed = ALLOWED_SECTIONS[kind]
            assert allowed is None or set(parsed.sections) <= allowed
            assert sum(len(v) for v in parsed.sections.values()) <= len(mutant.data)
            assert isinstance(parsed.header, dict)
        try:
            assert isinstance(check_upload(mutant.data, kind, setup.program), dict)
        except ApiError as exc:
            assert exc.status in (400, 422) and exc.detail

    run()


# ------------------------------------------------------------------------------------------------------------
# (b) public contexts
# ------------------------------------------------------------------------------------------------------------
def test_the_valid_context_and_its_reencodings_work(setup):
    assert check_context(setup, setup.context) is None
    for mode in (sb.COMPR_NONE, sb.COMPR_ZLIB, sb.COMPR_ZSTD):
        objects = {name: sb.compress(setup.payloads[name], mode) for name in setup.context_box.sections}
        assert check_context(setup, context_with(setup, **objects)) is None, mode


@pytest.mark.parametrize("case", list(CONTEXT_CASES))
def test_crafted_contexts_are_refused_within_the_memory_bound(setup, case):
    data = CONTEXT_CASES[case](setup)
    assert check_context(setup, data, equivalent_hint=False) is not None, "accepted"


def test_zero_keys_are_refused_or_harmless(setup):
    """A Galois key set of exactly the program's rows, every key all zero (the right structure, no content):
    refused, or accepted and then every request answered (garbage for the sender) or refused, never a 500."""
    zero = context_with(setup, galois_keys=galois_program_rows(setup, 4))
    check_context(setup, zero, equivalent_hint=False)
    relin = sb.kswitch_object(setup.payloads["relin_keys"][:32], [4], key_meta=setup.key_meta)
    check_context(setup, context_with(setup, relin_keys=relin), equivalent_hint=False)


def test_mutated_contexts_are_refused_or_work(setup):
    @settings(FUZZ, max_examples=examples(40))
    @given(mutated(setup, KIND_CONTEXT, context_bombs))
    def run(mutant: Mutant) -> None:
        check_context(setup, mutant.data)

    run()


# ------------------------------------------------------------------------------------------------------------
# (c) ciphertexts
# ------------------------------------------------------------------------------------------------------------
def test_the_valid_ciphertext_and_its_reencodings_work(setup):
    for mode in (None, sb.COMPR_NONE, sb.COMPR_ZLIB, sb.COMPR_ZSTD):
        data = setup.ciphertext if mode is None else with_section(
            setup.ciphertext_box, KIND_CIPHERTEXT, "ct0", sb.compress(setup.payloads["ct0"], mode))
        assert check_ciphertext(setup, data) is None, mode


@pytest.mark.parametrize("case", list(CIPHERTEXT_CASES))
def test_crafted_ciphertexts_are_refused_within_the_memory_bound(setup, case):
    data = CIPHERTEXT_CASES[case](setup)
    assert check_ciphertext(setup, data, equivalent_hint=False) is not None, "accepted"


@pytest.mark.parametrize("scale", NEAR_SCALES, ids=repr)
def test_ciphertexts_at_nearly_the_program_scale_are_refused_or_served(setup, scale):
    check_ciphertext(setup, _scaled(scale)(setup), equivalent_hint=False)


def test_mutated_ciphertexts_are_refused_or_work(setup):
    @settings(FUZZ, max_examples=examples(80))
    @given(mutated(setup, KIND_CIPHERTEXT, ciphertext_bombs))
    def run(mutant: Mutant) -> None:
        check_ciphertext(setup, mutant.data)

    run()
