"""Bounded decoding of SEAL objects from untrusted bytes, before SEAL's own parser sees them.

SEAL compresses what it saves (zstd): an all-zero ciphertext of 2.6 MB saves to a few hundred bytes, and a
Galois key set is a table of such ciphertexts, so a context of a few KB could make SEAL allocate gigabytes. Here
the 16-byte SEAL header is read, the payload is inflated *by us* into an anonymous in-memory file with an output
cap equal to the exact size the object has at the program's parameters, its structure is walked (levels, sizes,
the Galois key set equal to the expected one, a finite scale) with a few small reads, and only then does SEAL
load it, uncompressed. Formats (SEAL 4.x, ``serializable.h``, ``ciphertext.cpp``, ``kswitchkeys.cpp``):

- header ``<HBBBBHQ``: magic 0xA15E, header size 16, version major/minor, compression (0 none, 1 zlib, 2 zstd),
  reserved, total bytes including the header;
- ciphertext (a public key is one at the key level): parms_id (4 x u64), is_ntt (u8), size, N, primes (u64 each),
  scale (f64), correction factor (u64), then a DynArray: its own uncompressed header, a u64 count and the data;
- key-switching keys: parms_id, u64 rows, per row a u64 count and that many public keys, each with a header;
  a Galois key set has N rows, row ``galois_element >> 1``;
- secret key: a plaintext: parms_id, coefficient count (u64), scale (f64), DynArray.

Values are checked too, in one linear pass over the inflated bytes (:func:`scan_polynomial`, numpy, a bounded
buffer): every key-switching key and the public key must hold each residue below its prime (the key level's
primes, in order) and no degenerate polynomial (per prime, neither component all-zero, constant nor mostly zero,
:data:`polyfhe.program.rns_scan.MAX_ZEROS`: a real key's components are uniformly random, and a key of zeros makes
the first rotation a transparent ciphertext); a ciphertext's residues are below the primes of its level and its
second component (uniformly random) is zero, or mostly zero, modulo no prime.
"""

from __future__ import annotations

import math
import os
import struct
import zlib
from dataclasses import dataclass, field

import numpy as np

from polyfhe.program.rns_scan import scan_buffer
from polyfhe.program.rns_scan import scan_polynomial as rns_scan_polynomial
from polyfhe.program.sizes import ciphertext_bytes, poly_bytes
from polyfhe.program.wire import WireError

__all__ = ["NestedHeaders", "SealLayout", "SerializationError", "decoded_context_bytes", "expected_bytes",
           "inflate_into", "parse_header", "read_header", "scan_polynomial", "seal_layout"]

HEADER = struct.Struct("<HBBBBHQ")
MAGIC = 0xA15E
COMPR_NONE, COMPR_ZLIB, COMPR_ZSTD = 0, 1, 2
CT_MEMBERS = 32 + 1 + 8 * 3 + 8 + 8  # parms_id, is_ntt, size, N, primes, scale, correction factor
DYNARRAY_PREFIX = HEADER.size + 8  # the DynArray's own header and its element count
# a seeded ciphertext's random second half travels as the PRNG's info: SEAL header, PRNG type (u8), 512-bit seed
SEED_INFO_BYTES = HEADER.size + 1 + 64
PRNG_TYPES = {1: "blake2xb", 2: "shake256"}  # SEAL's prng_type (0 is "unknown")
KSWITCH_PREFIX = 32 + 8  # parms_id, row count
PLAINTEXT_MEMBERS = 32 + 8 + 8  # parms_id, coefficient count, scale
MAX_WINDOW = 1 << 25  # zstd window a decoder may allocate (SEAL's frames use 2 MiB)
CHUNK = 1 << 22
# SEAL's primes are at most 60 bits (CoeffModulus::Create): the bound a layout without its primes checks against
MAX_MODULUS = 1 << 60


class SerializationError(WireError):
    """Bytes that are not a valid SEAL object for these parameters (a :class:`WireError`: the boundary refuses
    both alike)."""


@dataclass(frozen=True)
class Header:
    version: tuple[int, int]
    compression: int
    size: int


def parse_header(data) -> Header:
    """The SEAL header of ``data``, checked against its length; :class:`SerializationError` when it is not one."""
    if len(data) < HEADER.size:
        raise SerializationError(f"{len(data)} bytes cannot hold a SEAL header ({HEADER.size} bytes)")
    magic, header_size, major, minor, compression, reserved, size = HEADER.unpack_from(data, 0)
    if magic != MAGIC or header_size != HEADER.size or reserved != 0:
        raise SerializationError("not a SEAL object (bad magic or header)")
    if major != 4:
        raise SerializationError(f"SEAL format version {major}.{minor}; this server reads version 4")
    if compression not in (COMPR_NONE, COMPR_ZLIB, COMPR_ZSTD):
        raise SerializationError(f"unknown SEAL compression mode {compression} (0 none, 1 zlib, 2 zstd)")
    if size != len(data):
        raise SerializationError(f"SEAL header says {size} bytes, {len(data)} arrived (truncated or padded)")
    return Header((major, minor), compression, size)


@dataclass
class NestedHeaders:
    """The format version every nested header of one object must carry (its outer header's), and the offsets of
    those headers as the walk meets them: an object of a compatible foreign version has them all rewritten to
    ours before SEAL loads it (:mod:`polyfhe.engines.seal.dialect`), and SEAL would refuse a mix anyway."""

    version: tuple[int, int]
    offsets: list[int] = field(default_factory=list)

    def visit(self, header: Header, offset: int) -> None:
        if header.version != self.version:
            raise SerializationError(
                f"inner SEAL object at byte {offset} says SEAL format {header.version[0]}.{header.version[1]}, its "
                f"outer header {self.version[0]}.{self.version[1]}: one object's headers must share one version")
        self.offsets.append(offset)


def read_header(fd: int, offset: int, nested: NestedHeaders | None = None) -> Header:
    """The uncompressed SEAL header of an inner object at ``offset`` of ``fd`` (its size is not checked here);
    with ``nested``, its version must be ``nested.version`` and its offset is recorded there."""
    raw = os.pread(fd, HEADER.size, offset)
    if len(raw) != HEADER.size:
        raise SerializationError("truncated SEAL object")
    magic, header_size, major, minor, compression, reserved, size = HEADER.unpack(raw)
    if magic != MAGIC or header_size != HEADER.size or major != 4 or compression != COMPR_NONE or reserved:
        raise SerializationError(f"inner SEAL object at byte {offset} has a bad header")
    header = Header((major, minor), compression, size)
    if nested is not None:
        nested.visit(header, offset)
    return header


def inflate_into(fd: int, data, cap: int, what: str = "SEAL object") -> int:
    """Write ``data``'s SEAL object uncompressed into ``fd`` (header rewritten: compression none), refusing a
    payload over ``cap`` bytes before inflating past it. Returns the payload's size."""
    view = memoryview(data).cast("B")
    header = parse_header(view)
    body = view[HEADER.size: header.size]
    written = 0

    def write(chunk) -> None:
        nonlocal written
        if written + len(chunk) > cap:
            raise SerializationError(f"{what} inflate(s) past {cap} bytes, the most this program's can hold at "
                                     "its parameters (extra keys, a decompression bomb or another program's object)")
        offset = HEADER.size + written
        chunk = memoryview(chunk)
        while len(chunk):
            n = os.pwrite(fd, chunk, offset)
            chunk, offset, written = chunk[n:], offset + n, written + n

    if header.compression == COMPR_NONE:
        write(body)
    elif header.compression == COMPR_ZSTD:
        _inflate_zstd(body, cap, write)
    else:
        _inflate_zlib(body, cap, write)
    os.pwrite(fd, HEADER.pack(MAGIC, HEADER.size, *header.version, COMPR_NONE, 0, HEADER.size + written), 0)
    return written


def _inflate_zstd(body, cap: int, write) -> None:
    try:
        import zstandard
    except ImportError as exc:  # pragma: no cover - a core dependency
        raise ImportError("decoding SEAL objects needs zstandard: pip install zstandard") from exc
    try:
        reader = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW).stream_reader(body, read_across_frames=False)
        with reader:
            while True:
                chunk = reader.read(CHUNK)
                if not chunk:
                    break
                write(chunk)
    except zstandard.ZstdError as exc:
        raise SerializationError(f"the SEAL object's zstd payload is corrupt: {exc}") from exc


def _inflate_zlib(body, cap: int, write) -> None:
    inflater = zlib.decompressobj()
    pending = bytes(body)
    try:
        while pending:
            write(inflater.decompress(pending, CHUNK))
            pending = inflater.unconsumed_tail
        write(inflater.flush(CHUNK))
    except zlib.error as exc:
        raise SerializationError(f"the SEAL object's zlib payload is corrupt: {exc}") from exc
    if not inflater.eof:
        raise SerializationError("the SEAL object's zlib payload is truncated")


# ------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SealLayout:
    """What a program's SEAL objects must look like: the ring, each level's parms_id and prime count (top level
    first), the key level's, and (for the residue scan) the primes themselves: ``level_moduli[i]`` the primes of
    level ``i`` in order, ``key_moduli`` the key level's. Without them (a layout built from counts only) residues
    are checked against :data:`MAX_MODULUS`, SEAL's largest prime bound; :func:`seal_layout` fills them in."""

    n: int
    level_ids: tuple[bytes, ...]
    level_primes: tuple[int, ...]
    key_id: bytes
    key_primes: int
    level_moduli: tuple[tuple[int, ...], ...] = ()
    key_moduli: tuple[int, ...] = ()

    def moduli_at(self, level: int, primes: int) -> np.ndarray:
        """The primes of ``level`` (-1: the key level) as uint64, or ``primes`` copies of MAX_MODULUS when the
        layout was built without them."""
        known = self.key_moduli if level < 0 else (self.level_moduli[level] if self.level_moduli else ())
        if len(known) == primes:
            return np.array(known, dtype=np.uint64)
        return np.full(primes, MAX_MODULUS, dtype=np.uint64)

    def ciphertext_bytes(self, primes: int, seeded: bool = False) -> int:
        """Payload bytes of a ciphertext over ``primes`` primes; ``seeded``: its second polynomial sent as the
        seed it is generated from (SEAL's serializable keys and symmetric encryptions; the web page's keys)."""
        if seeded:
            return ciphertext_bytes(self.n, primes, polys=1, framing=CT_MEMBERS + DYNARRAY_PREFIX + SEED_INFO_BYTES)
        return ciphertext_bytes(self.n, primes, framing=CT_MEMBERS + DYNARRAY_PREFIX)

    @property
    def public_key_bytes(self) -> int:
        return self.ciphertext_bytes(self.key_primes)

    @property
    def decomposition(self) -> int:
        return self.key_primes - 1  # one key per ciphertext prime; the special prime is the last

    def kswitch_bytes(self, rows: int, filled: int, seeded: bool = False) -> int:
        one = self.decomposition * (HEADER.size + self.ciphertext_bytes(self.key_primes, seeded))
        return KSWITCH_PREFIX + 8 * rows + filled * one

    def galois_bytes(self, elements: int) -> int:
        return self.kswitch_bytes(self.n, elements)

    @property
    def relin_bytes(self) -> int:
        return self.kswitch_bytes(1, 1)

    @property
    def secret_key_bytes(self) -> int:
        return PLAINTEXT_MEMBERS + DYNARRAY_PREFIX + poly_bytes(self.n, self.key_primes)


def expected_bytes(layout: SealLayout, kind: str, galois_elements: int = 0) -> int:
    """Exact uncompressed payload bytes of a SEAL object of ``kind`` (a top-level ciphertext for "ciphertext")."""
    return {"ciphertext": layout.ciphertext_bytes(layout.level_primes[0]), "public_key": layout.public_key_bytes,
            "relin_keys": layout.relin_bytes, "galois_keys": layout.galois_bytes(galois_elements),
            "secret_key": layout.secret_key_bytes}[kind]


def _u64(fd: int, offset: int, what: str) -> int:
    raw = os.pread(fd, 8, offset)
    if len(raw) != 8:
        raise SerializationError(f"truncated SEAL object: no {what} at byte {offset}")
    return struct.unpack("<Q", raw)[0]


@dataclass(frozen=True)
class CiphertextFields:
    level: int  # index into SealLayout.level_ids (0 = top); -1 for the key level
    size: int
    scale: float


def check_ciphertext(fd: int, offset: int, length: int, layout: SealLayout, *, key_level: bool = False,
                     what: str = "ciphertext", buffer: np.ndarray | None = None,
                     nested: NestedHeaders | None = None) -> CiphertextFields:
    """Walk one ciphertext's members at ``offset`` (``length`` payload bytes): a known level, two components,
    this ring, the exact data length, a finite positive scale; then scan its values: every residue below its
    prime (the primes of its level, in order) and, for a ciphertext, the second component zero or mostly zero
    modulo no prime (not transparent); for a key (``key_level``: a public key or one part of a key-switching key)
    neither component all-zero, constant or mostly zero modulo any prime. ``nested``: see :func:`read_header`."""
    raw = os.pread(fd, CT_MEMBERS, offset)
    if len(raw) != CT_MEMBERS:
        raise SerializationError(f"truncated {what}")
    parms_id = raw[:32]
    is_ntt, size, n, primes, scale, correction = struct.unpack_from("<BQQQdQ", raw, 32)
    if key_level:
        level, want_primes = (-1, layout.key_primes) if parms_id == layout.key_id else (None, 0)
    elif parms_id in layout.level_ids:
        level = layout.level_ids.index(parms_id)
        want_primes = layout.level_primes[level]
    else:
        level, want_primes = None, 0
    if level is None:
        raise SerializationError(f"{what} belongs to another parameter set or level (unknown parms_id)")
    if n != layout.n or primes != want_primes or size != 2 or is_ntt != 1 or correction != 1:
        raise SerializationError(f"{what} has N={n}, {primes} primes, {size} components (ntt={is_ntt}); this "
                                 f"program's are N={layout.n}, {want_primes} primes, 2 components in NTT form")
    if not math.isfinite(scale) or scale <= 0:
        raise SerializationError(f"{what} has scale {scale!r}; a scale must be finite and positive")
    seeded = length == layout.ciphertext_bytes(primes, seeded=True)
    if length != layout.ciphertext_bytes(primes) and not seeded:
        raise SerializationError(f"{what} holds {length} bytes, {layout.ciphertext_bytes(primes)} expected "
                                 f"({layout.ciphertext_bytes(primes, seeded=True)} with its random half seeded)")
    read_header(fd, offset + CT_MEMBERS, nested)
    count = _u64(fd, offset + CT_MEMBERS + HEADER.size, "coefficient count")
    polys = 1 if seeded else 2
    if count != polys * n * primes:
        raise SerializationError(f"{what} declares {count} coefficients, {polys * n * primes} expected"
                                 + (" (seeded: its first component only)" if seeded else ""))
    moduli = layout.moduli_at(level, primes)
    start = offset + CT_MEMBERS + DYNARRAY_PREFIX
    second = start + n * primes * 8
    if key_level:
        scan_polynomial(fd, start, n, moduli, f"{what}, first component", buffer=buffer)
        if not seeded:
            scan_polynomial(fd, second, n, moduli, f"{what}, second component (the random part)", buffer=buffer)
    else:
        scan_polynomial(fd, start, n, moduli, f"{what}, first component", degenerate=None, buffer=buffer)
        if not seeded:
            scan_polynomial(fd, second, n, moduli, f"{what}, second component", degenerate="zero", buffer=buffer)
    if seeded:  # SEAL makes the second component from this seed: uniform, never zero or constant
        check_seed_info(fd, second, what, nested)
    return CiphertextFields(level, size, scale)


def check_seed_info(fd: int, offset: int, what: str, nested: NestedHeaders | None = None) -> None:
    """A seeded ciphertext's PRNG info at ``offset``: its own header, of exactly its size, and a PRNG SEAL has."""
    header = read_header(fd, offset, nested)
    if header.size != SEED_INFO_BYTES:
        raise SerializationError(f"{what}: seed information of {header.size} bytes, {SEED_INFO_BYTES} expected")
    prng = os.pread(fd, 1, offset + HEADER.size)
    if len(prng) != 1 or prng[0] not in PRNG_TYPES:
        raise SerializationError(f"{what}: PRNG type {prng[0] if prng else None} of its seeded half is not one of "
                                 f"SEAL's ({PRNG_TYPES})")


def check_kswitch(fd: int, length: int, layout: SealLayout, rows: set[int] | None, what: str,
                  nested: NestedHeaders | None = None) -> None:
    """Walk a key-switching key set: the key level, and exactly ``rows`` filled (``None``: one row, relin).
    ``nested``: see :func:`read_header`."""
    raw = os.pread(fd, 32, HEADER.size)
    if raw != layout.key_id:
        raise SerializationError(f"{what} belong to another parameter set (unknown parms_id)")
    want_rows = 1 if rows is None else layout.n
    filled = 1 if rows is None else len(rows)
    seeded = length == layout.kswitch_bytes(want_rows, filled, seeded=True)  # every key seeded, or none
    if length != layout.kswitch_bytes(want_rows, filled) and not seeded:
        per_key = layout.decomposition * (HEADER.size + layout.public_key_bytes)
        held = (length - layout.kswitch_bytes(want_rows, 0)) / per_key
        raise SerializationError(f"{what} hold {length} bytes (about {held:.4g} key(s)); this program needs exactly "
                                 f"{filled} key(s), {layout.kswitch_bytes(want_rows, filled)} bytes "
                                 f"({layout.kswitch_bytes(want_rows, filled, seeded=True)} seeded)")
    offset = HEADER.size + 32
    if _u64(fd, offset, "row count") != want_rows:
        raise SerializationError(f"{what} have another row count than {want_rows}")
    offset += 8
    part_bytes = layout.ciphertext_bytes(layout.key_primes, seeded)
    key_size = HEADER.size + part_bytes
    buffer = scan_buffer(layout.n, layout.key_primes)
    for row in range(want_rows):
        count = _u64(fd, offset, "row length")
        offset += 8
        wanted = rows is None or row in rows
        if count not in (0, layout.decomposition) or (count > 0) != wanted:
            extra = "" if rows is None else f" (Galois element {2 * row + 1})"
            raise SerializationError(f"{what}: row {row}{extra} holds {count} keys; the program needs "
                                     f"{layout.decomposition if wanted else 0} there (the key set must be exactly "
                                     "the program's)")
        for part in range(count):
            header = read_header(fd, offset, nested)
            if header.size != key_size:
                raise SerializationError(f"{what}: a key of {header.size} bytes, {key_size} expected")
            name = (f"{what}: key {part} of {count}" if rows is None else
                    f"{what}: the key of Galois element {2 * row + 1}, part {part} of {count}")
            check_ciphertext(fd, offset + HEADER.size, part_bytes, layout, key_level=True, what=name,
                             buffer=buffer, nested=nested)
            offset += key_size
    if offset != HEADER.size + length:
        raise SerializationError(f"{what} have {HEADER.size + length - offset} trailing bytes")


def scan_polynomial(source, offset: int, n: int, moduli: np.ndarray, what: str, **kwargs) -> None:
    """:func:`polyfhe.program.rns_scan.scan_polynomial` raising :class:`SerializationError` by default."""
    kwargs["error"] = kwargs.get("error") or SerializationError
    rns_scan_polynomial(source, offset, n, moduli, what, **kwargs)


def check_secret_key(fd: int, length: int, layout: SealLayout, nested: NestedHeaders | None = None) -> None:
    """Walk a secret key (a plaintext): the key level, its coefficient count, its DynArray's header."""
    raw = os.pread(fd, PLAINTEXT_MEMBERS, HEADER.size)
    if len(raw) != PLAINTEXT_MEMBERS or raw[:32] != layout.key_id:
        raise SerializationError("secret key belongs to another parameter set")
    (count,) = struct.unpack_from("<Q", raw, 32)
    if count != layout.n * layout.key_primes or length != layout.secret_key_bytes:
        raise SerializationError(f"secret key of {count} coefficients ({length} bytes); "
                                 f"{layout.n * layout.key_primes} expected")
    read_header(fd, HEADER.size + PLAINTEXT_MEMBERS, nested)


def seal_layout(context, n: int) -> SealLayout:
    """The :class:`SealLayout` of a SEAL context (``tenseal.sealapi.SEALContext``): each level's parms_id, prime
    count and primes (top first), the key level's, as the bytes SEAL writes them."""
    ids, counts, moduli = [], [], []
    data = context.first_context_data()
    while data is not None:
        ids.append(struct.pack("<4Q", *data.parms_id()))
        primes = tuple(int(q.value()) for q in data.parms().coeff_modulus())
        counts.append(len(primes))
        moduli.append(primes)
        data = data.next_context_data()
    key = context.key_context_data()
    key_moduli = tuple(int(q.value()) for q in key.parms().coeff_modulus())
    return SealLayout(n, tuple(ids), tuple(counts), struct.pack("<4Q", *key.parms_id()), len(key_moduli),
                      tuple(moduli), key_moduli)


def decoded_context_bytes(n: int, key_primes: int, galois_elements: int) -> int:
    """Bytes of a valid public context's SEAL objects once inflated (public key, relinearisation keys and
    ``galois_elements`` Galois keys), headers included: what a server's key budget must count. Sizes depend
    on the ring and the key level's prime count only."""
    layout = SealLayout(n, (), (), b"", key_primes)
    galois = HEADER.size + layout.galois_bytes(galois_elements) if galois_elements else 0
    return 2 * HEADER.size + layout.public_key_bytes + layout.relin_bytes + galois
