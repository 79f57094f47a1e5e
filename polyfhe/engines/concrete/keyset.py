"""Concrete's evaluation keys, walked before Concrete parses a byte of them.

``EvaluationKeys.serialize()`` (concrete-python 2.10) writes one Cap'n Proto message: concrete-protocol's
``ServerKeyset``, three lists (bootstrap, keyswitch and packing keyswitch keys), each key a struct of its info (ids,
parameters, compression) and its payload, a list of byte blobs that all hold Cap'n Proto's largest blob
(:data:`BLOB_BYTES`) but the last. A program's client specs (``client.zip``'s ``client.specs.json``, ``keyset``)
describe every key of its key set, so a server knows the shape of the only valid key set before it sees one.

:func:`check_evaluation_keys` walks the message: the segment table, every pointer the schema has (far pointers
included), each key's info and parameters word for word against the specs, and each payload blob's length, and then
that the objects it reached cover every word of the message exactly once (no slack, no shared or overlapping
objects). Anything else is refused with :class:`~polyfhe.program.wire.WireError` naming the first difference.
This matters beyond tidiness: Concrete copies each blob to ``blob index x largest blob`` in a buffer sized by the
blobs' sum, so short blobs would write past it, and it checks no payload against its key's parameters.

:func:`max_message_bytes` is the most bytes such a message can have (the payloads exactly, the pointers and far
pointers' landing pads at most); :func:`session_memory_bytes` what a server worker holding it takes at its peak.
"""

from __future__ import annotations

import itertools
import json
import math
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

from polyfhe.program.wire import WireError

__all__ = [
    "BLOB_BYTES",
    "SERVER_WORKER_BASE_BYTES",
    "KeySpec",
    "KeysetSpecError",
    "blob_lengths",
    "check_evaluation_keys",
    "keyset_from_client_zip",
    "keyset_from_specs",
    "max_message_bytes",
    "session_memory_bytes",
]

WORD = 8
MAX_TEXT_SIZE = (1 << 29) - 2  # capnp::MAX_TEXT_SIZE, the largest Data blob
BLOB_BYTES = MAX_TEXT_SIZE // WORD * WORD  # Concrete's payload blobs: this many bytes of uint64 each, but the last
# A Concrete ML server worker (interpreter, Concrete ML and its runtime, the program's server.zip) before any key:
# measured 783 MB resident (docs/concrete.md, "What a server session costs"), rounded up
SERVER_WORKER_BASE_BYTES = 800 << 20
# EvaluationKeys.deserialize holds the received bytes about five times at its peak (measured: 5.0x the upload for
# two programs of 341 and 348 MB of keys)
DESERIALIZE_COPIES = 5

_COMPRESSION = {"none": 0, "seed": 1, "paillier": 2}
_KEY_TYPE = {"binary": 0, "ternary": 1}
_MODULUS = {"native": 0, "powerOfTwo": 1, "integer": 2}
# the data sections concrete-protocol's schema gives each struct: (field, bit offset, bits); "variance" is a Float64
_INFO = (("id", 0, 32), ("inputId", 32, 32), ("outputId", 64, 32), ("compression", 96, 16))
_PARAMS = {
    "bootstrap": (5, (("levelCount", 0, 32), ("baseLog", 32, 32), ("glweDimension", 64, 32),
                      ("polynomialSize", 96, 32), ("variance", 128, 64), ("integerPrecision", 192, 32),
                      ("keyType", 224, 16), ("inputLweDimension", 256, 32))),
    "keyswitch": (4, (("levelCount", 0, 32), ("baseLog", 32, 32), ("variance", 64, 64),
                      ("integerPrecision", 128, 32), ("keyType", 160, 16), ("inputLweDimension", 192, 32),
                      ("outputLweDimension", 224, 32))),
    "packing keyswitch": (5, (("levelCount", 0, 32), ("baseLog", 32, 32), ("glweDimension", 64, 32),
                              ("polynomialSize", 96, 32), ("inputLweDimension", 128, 32),
                              ("innerLweDimension", 160, 32), ("variance", 192, 64), ("integerPrecision", 256, 32),
                              ("keyType", 288, 16))),
}
_LISTS = (("lweBootstrapKeys", "bootstrap"), ("lweKeyswitchKeys", "keyswitch"),
          ("packingKeyswitchKeys", "packing keyswitch"))


class KeysetSpecError(ValueError):
    """A program's client specs do not describe a key set this module knows how to check."""


@dataclass(frozen=True)
class KeySpec:
    """One evaluation key as the specs describe it: the words its info and parameters must hold, its payload's
    size and what the key takes once a server worker has expanded it."""

    kind: str  # "bootstrap", "keyswitch" or "packing keyswitch"
    index: int
    info_words: tuple[int, ...]
    params_words: tuple[int, ...]  # the variance word as 0: compared as a float (:attr:`variance`)
    variance_word: int  # which of params_words holds the variance
    variance: float
    modulus: tuple[int, int | None]  # (union member, its UInt32 or None for native)
    payload_words: int
    expanded_bytes: int  # the key decompressed (standard domain), as the server holds it

    @property
    def name(self) -> str:
        return f"{self.kind} key {self.index}"


def _words(fields, values: dict, count: int) -> tuple[list[int], int]:
    words, variance_word = [0] * count, -1
    for name, offset, bits in fields:
        if name == "variance":
            variance_word = offset // 64
            continue
        value = values[name]
        if not 0 <= value < (1 << bits):
            raise KeysetSpecError(f"{name}={value} does not fit {bits} bits")
        words[offset // 64] |= value << (offset % 64)
    return words, variance_word


def _payload(kind: str, p: dict, compression: int) -> tuple[int, int]:
    """(payload words as Concrete's client writes them, expanded bytes a server holds), from concrete-cpu's sizes."""
    level = p["levelCount"]
    if kind == "bootstrap":
        n_in, k, n = p["inputLweDimension"], p["glweDimension"], p["polynomialSize"]
        full = n_in * level * (k + 1) ** 2 * n
        seeded = n_in * level * (k + 1) * n + 2  # the bodies, and a 128-bit seed for the masks
    elif kind == "keyswitch":
        n_in, n_out = p["inputLweDimension"], p["outputLweDimension"]
        full = n_in * level * (n_out + 1)
        seeded = n_in * level + 2
    else:  # packing keyswitch keys have no seeded form
        k, n = p["glweDimension"], p["polynomialSize"]
        full = seeded = (p["inputLweDimension"] + 1) * level * (k + 1) * n * (k + 1)
        if compression != _COMPRESSION["none"]:
            raise KeysetSpecError("a packing keyswitch key with compression; Concrete writes them uncompressed")
    if compression not in (_COMPRESSION["none"], _COMPRESSION["seed"]):
        raise KeysetSpecError(f"compression {compression} for a {kind} key; accepted: none, seed")
    return (full if compression == _COMPRESSION["none"] else seeded), full * WORD


def _key_spec(kind: str, index: int, raw: dict) -> KeySpec:
    try:
        params = dict(raw["params"])
        compression = _COMPRESSION[raw.get("compression", "none")]
        info = {"id": int(raw.get("id", 0)), "inputId": int(raw.get("inputId", 0)),
                "outputId": int(raw.get("outputId", 0)), "compression": compression}
        count, fields = _PARAMS[kind]
        values = {name: int(params.get(name, 0)) for name, _, _ in fields if name not in ("variance", "keyType")}
        values["keyType"] = _KEY_TYPE[params.get("keyType", "binary")]
        (member, body), = dict(params.get("modulus", {}).get("modulus", {"native": {}})).items()
        modulus = (_MODULUS[member], None if member == "native" else int(next(iter(body.values()), 0)))
        variance = float(params.get("variance", 0.0))
    except (KeyError, TypeError, ValueError, AttributeError, StopIteration) as exc:
        raise KeysetSpecError(f"{kind} key {index} of the client specs is malformed: {type(exc).__name__}: "
                              f"{exc}") from exc
    info_words, _ = _words(_INFO, info, 2)
    params_words, variance_word = _words(fields, values, count)
    payload, expanded = _payload(kind, values, compression)
    return KeySpec(kind, index, tuple(info_words), tuple(params_words), variance_word, variance, modulus, payload,
                   expanded)


def keyset_from_specs(specs: dict) -> tuple[KeySpec, ...]:
    """The evaluation keys a program's client specs (``client.specs.json``, parsed) describe, in the order the
    serialised key set lists them."""
    keyset = specs.get("keyset") if isinstance(specs, dict) else None
    if not isinstance(keyset, dict):
        raise KeysetSpecError("the client specs have no keyset")
    keys = []
    for field, kind in _LISTS:
        entries = keyset.get(field, [])
        if not isinstance(entries, list):
            raise KeysetSpecError(f"the client specs' {field} is not a list")
        keys.extend(_key_spec(kind, i, entry) for i, entry in enumerate(entries))
    return tuple(keys)


def keyset_from_client_zip(path: str | Path) -> tuple[KeySpec, ...]:
    """:func:`keyset_from_specs` of a program's ``client.zip`` (Concrete ML's client specs)."""
    try:
        with zipfile.ZipFile(path) as archive:
            info = archive.getinfo("client.specs.json")
            if info.file_size > 64 << 20:
                raise KeysetSpecError(f"client.specs.json is {info.file_size} bytes")
            specs = json.loads(archive.read(info))
    except (OSError, KeyError, zipfile.BadZipFile, ValueError) as exc:
        raise KeysetSpecError(f"{path} holds no readable client.specs.json: {type(exc).__name__}: {exc}") from exc
    return keyset_from_specs(specs)


def blob_lengths(payload_words: int) -> list[int]:
    """The blob lengths Concrete's ``vectorToProtoPayload`` writes for a payload of ``payload_words`` words."""
    per_blob = BLOB_BYTES // WORD
    count = payload_words // per_blob + (payload_words % per_blob > 0)
    return [BLOB_BYTES] * max(0, count - 1) + ([payload_words % per_blob * WORD] if count else [])


def _modulus_words(key: KeySpec) -> int:
    return 0 if key.modulus[1] is None else 1


def _pointer_count(keys: tuple[KeySpec, ...]) -> int:
    """Pointers in a valid message: the root, its three lists, and per key its info, params, modulus, the
    modulus' member, its payload, the payload's blob list and each blob."""
    return 4 + sum(6 + len(blob_lengths(k.payload_words)) for k in keys)


def max_message_bytes(keys: tuple[KeySpec, ...]) -> int:
    """The most bytes a valid serialised key set for ``keys`` can have: every object exactly, plus room for a
    far pointer's landing pad (two words) behind every pointer and a segment table of the most segments."""
    words = 4 + 3  # root pointer and struct, the three lists' tags
    for k in keys:
        blobs = blob_lengths(k.payload_words)
        words += 2 + 3 + len(k.params_words) + 1 + 2 + _modulus_words(k) + 1 + len(blobs)
        words += sum(-(-n // WORD) for n in blobs)
    pointers = _pointer_count(keys)
    segments = 1 + 2 * pointers
    table = 4 * (1 + segments)
    return WORD * (words + 2 * pointers) + table + (-table % WORD)


def session_memory_bytes(keys: tuple[KeySpec, ...], upload: int) -> int:
    """What a server worker holding these keys takes at its peak (docs/concrete.md): its base, plus the larger of
    deserialising (the received bytes about five times) and the first evaluation (the received keys, each key
    expanded, and the bootstrap keys once more while Concrete converts them to the Fourier domain)."""
    expanded = sum(k.expanded_bytes for k in keys)
    bootstrap = sum(k.expanded_bytes for k in keys if k.kind != "keyswitch")
    return SERVER_WORKER_BASE_BYTES + max(DESERIALIZE_COPIES * upload, upload + expanded + bootstrap)


class _Message:
    """A Cap'n Proto message (standard framing) read through bounds-checked pointers; records what it reads."""

    def __init__(self, data: memoryview, max_segments: int) -> None:
        self.data = data
        if len(data) < 8:
            raise self.refuse("the message is shorter than a segment table")
        count = struct.unpack_from("<I", data, 0)[0] + 1
        if count > max_segments:
            raise self.refuse(f"{count} segments, more than the {max_segments} a valid key set can have")
        table = 4 * (1 + count)
        table += -table % WORD
        if len(data) < table:
            raise self.refuse("the segment table is truncated")
        sizes = struct.unpack_from(f"<{count}I", data, 4)
        if sum(sizes) * WORD + table != len(data):
            raise self.refuse(f"the segment table says {sum(sizes) * WORD + table} bytes, the message has "
                              f"{len(data)}")
        if not all(sizes):
            raise self.refuse("an empty segment")
        self.segments, offset = [], table
        for size in sizes:
            self.segments.append((offset, size))
            offset += size * WORD
        self.spans: list[tuple[int, int, int]] = []

    @staticmethod
    def refuse(why: str) -> WireError:
        return WireError(f"the evaluation keys are not a key set for this program: {why} (a server takes only the "
                         "keys Concrete ML's client makes for this model's client specs)")

    def word(self, seg: int, index: int) -> int:
        offset, size = self.segments[seg]
        if not 0 <= index < size:
            raise self.refuse(f"a pointer leads outside segment {seg}")
        return struct.unpack_from("<Q", self.data, offset + WORD * index)[0]

    def claim(self, seg: int, start: int, words: int, what: str) -> None:
        if seg >= len(self.segments) or start < 0 or start + words > self.segments[seg][1]:
            raise self.refuse(f"{what} runs outside its segment")
        if words:
            self.spans.append((seg, start, start + words))

    def resolve(self, seg: int, index: int, what: str) -> tuple[int, int, int]:
        """(segment, first word, pointer describing it) of the object the pointer at (seg, index) leads to."""
        ptr = self.word(seg, index)
        kind = ptr & 3
        if ptr == 0:
            raise self.refuse(f"{what} is missing")
        if kind == 3:
            raise self.refuse(f"{what} is a capability pointer")
        if kind != 2:
            return seg, index + 1 + _signed30(ptr), ptr
        target, pad, double = ptr >> 32, (ptr >> 3) & ((1 << 29) - 1), (ptr >> 2) & 1
        if target >= len(self.segments):
            raise self.refuse(f"{what} leads to segment {target} of {len(self.segments)}")
        self.claim(target, pad, 1 + double, f"the landing pad of {what}")
        landing = self.word(target, pad)
        if not double:
            if landing & 3 not in (0, 1):
                raise self.refuse(f"the landing pad of {what} is not a struct or list pointer")
            return target, pad + 1 + _signed30(landing), landing
        tag = self.word(target, pad + 1)
        if landing & 3 != 2 or (landing >> 2) & 1 or tag & 3 not in (0, 1) or _signed30(tag):
            raise self.refuse(f"the double landing pad of {what} is malformed")
        content = landing >> 32
        if content >= len(self.segments):
            raise self.refuse(f"{what} leads to segment {content} of {len(self.segments)}")
        return content, (landing >> 3) & ((1 << 29) - 1), tag

    def struct(self, seg: int, index: int, data_words: int, pointers: int, what: str) -> tuple[int, int]:
        seg, start, tag = self.resolve(seg, index, what)
        if tag & 3 != 0 or (tag >> 32) & 0xFFFF != data_words or tag >> 48 != pointers:
            raise self.refuse(f"{what} is not a struct of {data_words} data words and {pointers} pointers")
        self.claim(seg, start, data_words + pointers, what)
        return seg, start

    def list(self, seg: int, index: int, size_code: int, count: int, what: str) -> tuple[int, int]:
        """A list of ``count`` elements of one of Cap'n Proto's plain sizes (2: bytes, 6: pointers)."""
        seg, start, tag = self.resolve(seg, index, what)
        if tag & 3 != 1 or (tag >> 32) & 7 != size_code or tag >> 35 != count:
            raise self.refuse(f"{what} is not a list of {count} {'bytes' if size_code == 2 else 'pointers'}")
        self.claim(seg, start, count if size_code == 6 else -(-count // WORD), what)
        return seg, start

    def structs(self, seg: int, index: int, count: int, data_words: int, pointers: int,
                what: str) -> list[tuple[int, int]]:
        """The elements of a list of ``count`` structs (Cap'n Proto's composite list)."""
        if count == 0 and self.word(seg, index) == 0:
            return []
        seg, start, tag = self.resolve(seg, index, what)
        size = data_words + pointers
        if tag & 3 != 1 or (tag >> 32) & 7 != 7 or tag >> 35 != count * size:
            raise self.refuse(f"{what} is not a list of {count} keys")
        self.claim(seg, start, 1 + count * size, what)
        element = self.word(seg, start)
        if element & 3 != 0 or (element >> 2) & ((1 << 30) - 1) != count or \
                (element >> 32) & 0xFFFF != data_words or element >> 48 != pointers:
            raise self.refuse(f"{what} does not hold {count} keys of this program's shape")
        return [(seg, start + 1 + i * size) for i in range(count)]

    def check_covered(self) -> None:
        spans = sorted(self.spans)
        for (seg_a, _, end_a), (seg_b, start_b, _) in itertools.pairwise(spans):
            if seg_a == seg_b and end_a > start_b:
                raise self.refuse("two of its objects overlap")
        claimed, total = sum(end - start for _, start, end in spans), sum(size for _, size in self.segments)
        if claimed != total:
            raise self.refuse(f"{total - claimed} of its {total} words belong to no key")


def _signed30(ptr: int) -> int:
    offset = (ptr >> 2) & ((1 << 30) - 1)
    return offset - (1 << 30) if offset >= 1 << 29 else offset


def _check_key(msg: _Message, seg: int, start: int, key: KeySpec) -> None:
    name = key.name
    iseg, istart = msg.struct(seg, start, 2, 1, f"the info of {name}")
    got = tuple(msg.word(iseg, istart + i) for i in range(2))
    if got != key.info_words:
        raise msg.refuse(f"the ids or the compression of {name} differ from the client specs")
    pseg, pstart = msg.struct(iseg, istart + 2, len(key.params_words), 1, f"the parameters of {name}")
    for i, want in enumerate(key.params_words):
        word = msg.word(pseg, pstart + i)
        if i == key.variance_word:
            variance = struct.unpack("<d", struct.pack("<Q", word))[0]
            if not math.isclose(variance, key.variance, rel_tol=1e-12, abs_tol=0.0):
                raise msg.refuse(f"the noise variance of {name} differs from the client specs")
        elif word != want:
            raise msg.refuse(f"the parameters of {name} (levels, base log, dimensions) differ from the client specs")
    mseg, mstart = msg.struct(pseg, pstart + len(key.params_words), 1, 1, f"the modulus of {name}")
    member, value = key.modulus
    if msg.word(mseg, mstart) != member:
        raise msg.refuse(f"the modulus of {name} differs from the client specs")
    bseg, bstart = msg.struct(mseg, mstart + 1, _modulus_words(key), 0, f"the modulus of {name}")
    if value is not None and msg.word(bseg, bstart) != value:
        raise msg.refuse(f"the modulus of {name} differs from the client specs")
    yseg, ystart = msg.struct(seg, start + 1, 0, 1, f"the payload of {name}")
    blobs = blob_lengths(key.payload_words)
    lseg, lstart = msg.list(yseg, ystart, 6, len(blobs), f"the payload of {name} ({len(blobs)} blobs)")
    for i, length in enumerate(blobs):
        msg.list(lseg, lstart + i, 2, length, f"blob {i} of {name}'s payload ({length} bytes)")


def check_evaluation_keys(data: bytes | memoryview, keys: tuple[KeySpec, ...]) -> None:
    """Refuse (:class:`~polyfhe.program.wire.WireError`) serialised evaluation keys that are not exactly a key set
    for ``keys``: see the module docstring. Reads only pointers and parameters, never a payload's bytes."""
    view = memoryview(data).cast("B")
    bound = max_message_bytes(keys)
    if len(view) > bound:
        raise _Message.refuse(f"{len(view)} bytes, over the {bound} a key set for this program can have")
    msg = _Message(view, 1 + 2 * _pointer_count(keys))
    msg.claim(0, 0, 1, "the root pointer")
    rseg, rstart = msg.struct(0, 0, 0, 3, "the key set")
    for slot, (field, kind) in enumerate(_LISTS):
        wanted = [k for k in keys if k.kind == kind]
        elements = msg.structs(rseg, rstart + slot, len(wanted), 0, 2, f"the {kind} key list")
        for (seg, start), key in zip(elements, wanted):
            _check_key(msg, seg, start, key)
    msg.check_covered()
