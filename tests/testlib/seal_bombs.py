"""Hand-made SEAL objects for the decoding tests: decompression bombs and structurally wrong objects.

SEAL 4's serialisation (as TenSEAL 0.3.18 writes it): a 16-byte header ``<HBBBBHQ`` (magic 0xA15E, header size
16, version 4.3, compression mode 0 none / 1 zlib / 2 zstd, reserved 0, total size with the header), then the
payload, zstd-compressed. A ciphertext's payload: parms_id (32 B), is_ntt (1 B), size, N, coeff_modulus_size
(u64 each), scale (f64), correction factor (u64), then a DynArray: its own uncompressed SEAL header, a u64
count and ``count`` u64 coefficients. Relinearisation and Galois keys: parms_id, a u64 row count, and per row
a u64 count of public keys, each a whole uncompressed SEAL object (a ciphertext at the key level).

Bombs are built as zstd frames by hand: raw blocks for the bytes that matter, RLE blocks (4 bytes for 128 KiB
of one byte value) for the rest, so a frame that inflates to gigabytes is made in microseconds and weighs
about 32 KiB per GiB. No content size is declared (a decoder cannot learn the size before inflating), unless
asked for.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, replace

import zstandard

SEAL_MAGIC = 0xA15E
SEAL_HEADER = struct.Struct("<HBBBBHQ")
SEAL_VERSION = (4, 3)
COMPR_NONE, COMPR_ZLIB, COMPR_ZSTD = 0, 1, 2
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
BLOCK_MAX = 128 << 10  # zstd's largest block
META = struct.Struct("<32sBQQQdQ")  # parms_id, is_ntt, size, N, coeff_modulus_size, scale, correction factor
U64 = struct.Struct("<Q")


# ------------------------------------------------------------------------------------------------------------
# SEAL headers and zstd frames
# ------------------------------------------------------------------------------------------------------------
def seal_header(total: int, compr_mode: int = COMPR_ZSTD, *, magic: int = SEAL_MAGIC, header_size: int = 16,
                version: tuple[int, int] = SEAL_VERSION, reserved: int = 0) -> bytes:
    return SEAL_HEADER.pack(magic, header_size, *version, compr_mode, reserved, total)


def parse_header(obj: bytes | memoryview) -> tuple[int, int, int, int, int, int, int]:
    """(magic, header size, major, minor, compression, reserved, total size) of a SEAL object."""
    return SEAL_HEADER.unpack(bytes(obj[:SEAL_HEADER.size]))


def seal_object(payload_or_frame: bytes, compr_mode: int = COMPR_ZSTD, **header) -> bytes:
    """A SEAL object around ``payload_or_frame`` (a zstd frame when ``compr_mode`` is zstd)."""
    return seal_header(SEAL_HEADER.size + len(payload_or_frame), compr_mode, **header) + payload_or_frame


def zstd_frame(*parts: bytes | tuple[int, int], content_size: int | None = None, checksum: bool = False,
               window_log: int = 17) -> bytes:
    """A zstd frame whose content is ``parts`` in order: ``bytes`` as raw blocks, ``(count, value)`` as
    ``count`` copies of the byte ``value`` in RLE blocks. ``content_size`` is declared in the frame header
    when given (it may lie); ``checksum`` sets the flag and appends four zero bytes (a wrong checksum);
    ``window_log``:
    the window a decoder must provide (17: 128 KiB, the least that takes full blocks)."""
    flags = 0x04 if checksum else 0x00
    if content_size is None:
        head = bytes([flags, (window_log - 10) << 3])  # window descriptor, no single-segment frame
    else:
        head = bytes([flags | 0xC0 | 0x20]) + U64.pack(content_size)  # single segment, 8-byte content size
    blocks: list[bytes] = []
    for part in parts:
        if isinstance(part, tuple):
            count, value = part
            while count > 0:
                n = min(count, BLOCK_MAX)
                blocks.append(_block_header(1, n) + bytes([value]))
                count -= n
        else:
            for i in range(0, len(part), BLOCK_MAX):
                chunk = part[i: i + BLOCK_MAX]
                blocks.append(_block_header(0, len(chunk)) + chunk)
    if not blocks:
        blocks.append(_block_header(0, 0))
    last = bytearray(blocks[-1])
    last[0] |= 1  # Last_Block flag
    blocks[-1] = bytes(last)
    return ZSTD_MAGIC + head + b"".join(blocks) + (b"\0" * 4 if checksum else b"")


def _block_header(kind: int, size: int) -> bytes:
    return (size << 3 | kind << 1).to_bytes(3, "little")


def inflate(obj: bytes | memoryview, limit: int = 1 << 30) -> bytes:
    """The payload of a zstd SEAL object, at most ``limit`` bytes (for tests: real objects are small)."""
    reader = zstandard.ZstdDecompressor().stream_reader(bytes(obj[SEAL_HEADER.size:]))
    out = reader.read(limit + 1)
    if len(out) > limit:
        raise ValueError(f"SEAL object inflates to more than {limit} bytes")
    return out


def compress(payload: bytes, compr_mode: int = COMPR_ZSTD, level: int = 1) -> bytes:
    """A SEAL object of ``payload``: zstd as SEAL writes it (frame with content size), zlib, or stored."""
    if compr_mode == COMPR_ZSTD:
        return seal_object(zstandard.ZstdCompressor(level=level).compress(payload))
    if compr_mode == COMPR_ZLIB:
        return seal_object(zlib.compress(payload, level), COMPR_ZLIB)
    return seal_object(payload, COMPR_NONE)


# ------------------------------------------------------------------------------------------------------------
# ciphertexts (and public keys, which are ciphertexts at the key level)
# ------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CipherMeta:
    parms_id: bytes
    is_ntt: int
    size: int
    n: int
    k: int
    scale: float
    correction: int

    @classmethod
    def parse(cls, payload: bytes) -> CipherMeta:
        return cls(*META.unpack(payload[:META.size]))

    def pack(self) -> bytes:
        return META.pack(self.parms_id, self.is_ntt, self.size, self.n, self.k, self.scale, self.correction)

    @property
    def coefficients(self) -> int:
        return self.size * self.n * self.k

    def with_(self, **changes) -> CipherMeta:
        return replace(self, **changes)


def dynarray_header(count: int) -> bytes:
    """The uncompressed SEAL header and count of a DynArray of ``count`` u64 values."""
    total = (SEAL_HEADER.size + 8 + 8 * count) % (1 << 64)  # wraps as SEAL's u64 would
    return seal_header(total, COMPR_NONE) + U64.pack(count % (1 << 64))


def cipher_payload_parts(meta: CipherMeta, data: bytes | None = None, *, count: int | None = None,
                         zeros: int | None = None) -> list[bytes | tuple[int, int]]:
    """Frame parts of a ciphertext payload: metadata, DynArray header declaring ``count`` coefficients
    (default: what the metadata implies), then ``data`` or ``zeros`` zero bytes (default: ``count`` zeros)."""
    count = meta.coefficients if count is None else count
    body: bytes | tuple[int, int] = data if data is not None else (8 * count if zeros is None else zeros, 0)
    return [meta.pack() + dynarray_header(count), body]


def cipher_object(meta: CipherMeta, data: bytes | None = None, **kwargs) -> bytes:
    """A zstd SEAL ciphertext object (see :func:`cipher_payload_parts`)."""
    return seal_object(zstd_frame(*cipher_payload_parts(meta, data, **kwargs)))


def split_cipher(obj: bytes | memoryview) -> tuple[CipherMeta, bytes]:
    """(metadata, coefficient bytes) of a real zstd SEAL ciphertext or public key."""
    payload = inflate(obj)
    meta = CipherMeta.parse(payload)
    start = META.size + SEAL_HEADER.size + 8
    return meta, payload[start:]


def transparent(obj: bytes | memoryview) -> bytes:
    """The ciphertext ``obj`` with its second component set to zero (a transparent ciphertext: it decrypts
    without the secret key)."""
    meta, data = split_cipher(obj)
    half = meta.n * meta.k * 8
    return cipher_object(meta, data[:half] + b"\0" * (len(data) - half))


# ------------------------------------------------------------------------------------------------------------
# key-switching keys (relinearisation and Galois keys)
# ------------------------------------------------------------------------------------------------------------
def kswitch_rows(obj: bytes | memoryview) -> tuple[bytes, list[list[bytes]]]:
    """(parms_id, rows) of a real zstd SEAL key-switching key set; each row lists whole uncompressed
    public-key objects."""
    payload = inflate(obj)
    parms_id, (rows,) = payload[:32], U64.unpack(payload[32:40])
    pos, out = 40, []
    for _ in range(rows):
        (count,) = U64.unpack(payload[pos: pos + 8])
        pos += 8
        keys = []
        for _ in range(count):
            total = parse_header(payload[pos:])[6]
            keys.append(payload[pos: pos + total])
            pos += total
        out.append(keys)
    return parms_id, out


def kswitch_object(parms_id: bytes, rows: list[list[bytes] | int], *, key_meta: CipherMeta | None = None,
                   rows_declared: int | None = None) -> bytes:
    """A zstd SEAL key-switching key set. A row is a list of whole public-key objects, or an int ``m``: ``m``
    all-zero public keys at ``key_meta`` (parsed by SEAL as valid keys; a few hundred bytes each here)."""
    parts: list[bytes | tuple[int, int]] = [parms_id + U64.pack(len(rows) if rows_declared is None
                                                                  else rows_declared)]
    for row in rows:
        if isinstance(row, int):
            if key_meta is None:
                raise ValueError("an all-zero row needs key_meta")
            count = key_meta.coefficients
            key_total = (SEAL_HEADER.size + META.size + SEAL_HEADER.size + 8 + 8 * count) % (1 << 64)
            parts.append(U64.pack(row))
            for _ in range(row):
                parts += [seal_header(key_total, COMPR_NONE) + key_meta.pack() + dynarray_header(count),
                          (8 * count, 0)]
        else:
            parts.append(U64.pack(len(row)) + b"".join(row))
    return seal_object(zstd_frame(*_merge(parts)))


def _merge(parts: list) -> list:
    """Adjacent raw parts joined (fewer, larger raw blocks)."""
    out: list = []
    for part in parts:
        if isinstance(part, bytes) and out and isinstance(out[-1], bytes):
            out[-1] += part
        else:
            out.append(part)
    return out


# ------------------------------------------------------------------------------------------------------------
# fields a fuzzer should hit: (offset, struct format) in an inflated payload
# ------------------------------------------------------------------------------------------------------------
CIPHER_FIELDS = (("parms_id", 0, "<Q"), ("parms_id[3]", 24, "<Q"), ("is_ntt", 32, "<B"), ("size", 33, "<Q"),
                 ("N", 41, "<Q"), ("primes", 49, "<Q"), ("scale", 57, "<d"), ("correction", 65, "<Q"),
                 ("data magic", 73, "<H"), ("data compression", 73 + 6, "<B"), ("data total", 73 + 8, "<Q"),
                 ("data count", 89, "<Q"))


def cipher_fields(base: int = 0) -> list[tuple[str, int, str]]:
    return [(name, base + offset, fmt) for name, offset, fmt in CIPHER_FIELDS]


def kswitch_fields(payload: bytes) -> list[tuple[str, int, str]]:
    """The fields of a key-switching key set: parms_id, row count, the first two filled rows' counts, and the
    header and members of the first key and of the last."""
    fields = [("parms_id", 0, "<Q"), ("rows", 32, "<Q")]
    (rows,) = U64.unpack(payload[32:40])
    pos, filled, first_key, last_key = 40, 0, None, None
    for r in range(rows):
        (count,) = U64.unpack(payload[pos: pos + 8])
        if count and filled < 2:
            fields.append((f"row {r} count", pos, "<Q"))
        if count:
            filled += 1
        if r == 0 and not count:
            fields.append(("row 0 count", pos, "<Q"))
        pos += 8
        for _ in range(count):
            first_key = pos if first_key is None else first_key
            last_key = pos
            pos += parse_header(payload[pos:])[6]
    for key in {first_key, last_key} - {None}:
        fields += [("key magic", key, "<H"), ("key compression", key + 6, "<B"), ("key total", key + 8, "<Q")]
        fields += cipher_fields(key + SEAL_HEADER.size)
    return fields


def zero_bomb(inflated: int, prefix: bytes = b"") -> bytes:
    """A zstd SEAL object that inflates to ``prefix`` and then zeros, ``inflated`` bytes in all."""
    return seal_object(zstd_frame(prefix, (inflated - len(prefix), 0)))


# ------------------------------------------------------------------------------------------------------------
# keys with bad values (the residue scan): a key's coefficients are two components, each primes x N residues
# ------------------------------------------------------------------------------------------------------------
KEY_DATA = SEAL_HEADER.size + META.size + SEAL_HEADER.size + 8  # a key object's start to its coefficients
CIPHER_DATA = META.size + SEAL_HEADER.size + 8  # a ciphertext payload's start to its coefficients


def key_data_offsets(payload: bytes, kind: str) -> list[tuple[int, CipherMeta]]:
    """(offset of the coefficients, metadata) of every key ciphertext in an inflated public key
    (``kind="public_key"``) or key-switching key set, in order."""
    if kind == "public_key":
        return [(CIPHER_DATA, CipherMeta.parse(payload))]
    (rows,) = U64.unpack(payload[32:40])
    pos, out = 40, []
    for _ in range(rows):
        (count,) = U64.unpack(payload[pos: pos + 8])
        pos += 8
        for _ in range(count):
            out.append((pos + KEY_DATA, CipherMeta.parse(payload[pos + SEAL_HEADER.size:])))
            pos += parse_header(payload[pos:])[6]
    return out


def bad_key(obj: bytes | memoryview, kind: str, how: str, *, key: int | None = 0, component: int = 1,
            prime: int = 0, value: int = 0, after: int = 64) -> bytes:
    """The zstd SEAL key object ``obj`` with bad values in ``key`` (its index among the object's key
    ciphertexts; ``None``: every key):

    - ``"zero_after"``: ``component`` zeroed past its first ``after`` bytes (the attack on a check that reads
      only the start of the random part);
    - ``"constant"``: row ``prime`` of ``component`` set to ``value`` everywhere;
    - ``"residue"``: the first coefficient of row ``prime`` of ``component`` set to ``value`` (e.g. the prime).
    """
    body = bytearray(inflate(obj))
    keys = key_data_offsets(bytes(body), kind)
    for index, (start, meta) in enumerate(keys):
        if key is not None and index != key:
            continue
        row = meta.n * 8
        comp = start + component * meta.k * row
        if how == "zero_after":
            body[comp + after: comp + meta.k * row] = bytes(meta.k * row - after)
        elif how == "constant":
            body[comp + prime * row: comp + (prime + 1) * row] = U64.pack(value) * meta.n
        elif how == "residue":
            U64.pack_into(body, comp + prime * row, value)
        else:
            raise ValueError(how)
    return compress(bytes(body))
