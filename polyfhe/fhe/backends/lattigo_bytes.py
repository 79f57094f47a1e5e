"""Check uploaded Lattigo bytes (key sets, ciphertexts) field by field before Go unmarshals them.

Go's unmarshalling trusts the length fields it reads: a ciphertext whose polynomial count says 2^33 makes it
allocate until the process dies (measured: ``fatal error: runtime: out of memory``, which no ``recover`` catches,
so one request would take the whole server down). Every length field is therefore walked here, with no copy of
the bytes: against what the program's parameters imply where we know it (the evaluation keys, ciphertexts), and
against the bytes actually present where we do not (the bootstrapping keys: every count must fit in what is
left, so nothing Go allocates can exceed the upload). Layout (Lattigo v6, measured against its marshalling):

- key set: u8 has-relin | relin key | u8 has-galois | u32 count | (u64 element | Galois key) sorted by element;
- Galois key: u64 element | u64 nth root | evaluation key;
- evaluation key (gadget ciphertext): u64 base-two decomposition (0) | u64 rows (ceil(Q/P)) | per row: u64 columns (1)
  | u64 pair (2) | two ring-QP polynomials, each u64 Q-count | Q x (u64 N | N x u64) | u64 P-count | P x (...);
- ciphertext: u8 has-metadata (1) | metadata (277 bytes of JSON) | u64 components | per component u64 prime
  count | primes x (u64 N | N x u64);
- bootstrapping keys: six optional evaluation keys (u8 flag | key) then an optional key set (u8 flag | key set).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from polyfhe.fhe.wire import WireError

__all__ = ["KeyShape", "check_bootstrap_keys", "check_ciphertext", "check_evaluation_keys"]

_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_U8 = struct.Struct("<B")
METADATA_BYTES = 277  # rlwe.MetaData.BinarySize(): fixed-size JSON
MAX_PRIMES = 64  # per modulus part: Lattigo's own moduli stay far below
MAX_LOG_DEGREE = 17


@dataclass(frozen=True)
class KeyShape:
    """A key-switching key's dimensions: ring degree, ciphertext primes Q, special primes P, Galois nth root."""

    n: int
    q: int
    p: int
    nth_root: int

    @classmethod
    def from_lattigo_params(cls, params: dict) -> KeyShape:
        n = 1 << int(params["logn"])
        # the residual ring's own keys carry its 2N even when ring switching raises the parameters' nth root
        # (measured on the width-32 deep recipe: 32768 at N=16384 with log_nth_root 17)
        return cls(n, len(params["logq"]), len(params["logp"]), 2 * n)

    @property
    def rows(self) -> int:
        return math.ceil(self.q / self.p)

    @property
    def key_bytes(self) -> int:
        row = 16 + 2 * (16 + 8 * (self.q + self.p) + 8 * self.n * (self.q + self.p))
        return 16 + self.rows * row

    @property
    def galois_key_bytes(self) -> int:
        return 16 + self.key_bytes


class _Cursor:
    def __init__(self, data, what: str) -> None:
        self.view, self.at, self.what = memoryview(data).cast("B"), 0, what

    def take(self, fmt: struct.Struct) -> int:
        if self.at + fmt.size > len(self.view):
            raise WireError(f"{self.what} are truncated at byte {self.at}")
        (value,) = fmt.unpack_from(self.view, self.at)
        self.at += fmt.size
        return value

    def expect(self, fmt: struct.Struct, want: int, field: str) -> None:
        got = self.take(fmt)
        if got != want:
            raise WireError(f"{self.what}: {field} is {got} at byte {self.at - fmt.size}, these parameters "
                            f"need {want}")

    def skip(self, nbytes: int) -> None:
        if self.at + nbytes > len(self.view):
            raise WireError(f"{self.what} are truncated at byte {self.at}")
        self.at += nbytes


def _bounded(cur: _Cursor, fmt: struct.Struct, most: int, field: str) -> int:
    value = cur.take(fmt)
    if value > most:
        raise WireError(f"{cur.what}: {field} is {value} at byte {cur.at - fmt.size}, more than {most}")
    return value


def _field(cur: _Cursor, fmt: struct.Struct, want: int | None, most: int, field: str) -> int:
    """A length field: exactly ``want`` when the shape is known, else at most ``most``."""
    if want is None:
        return _bounded(cur, fmt, most, field)
    cur.expect(fmt, want, field)
    return want


def _evaluation_key(cur: _Cursor, shape: KeyShape | None) -> None:
    """One evaluation key: of exactly ``shape``, or (``None``: the bootstrapping keys, whose shapes belong to
    Lattigo's bootstrapping circuit) of any shape whose every count is bounded and whose data is present."""
    known = shape is not None
    _field(cur, _U64, 0 if known else None, MAX_PRIMES, "the base-two decomposition")
    for _ in range(_field(cur, _U64, shape.rows if known else None, MAX_PRIMES, "the decomposition rows")):
        for _ in range(_field(cur, _U64, 1 if known else None, MAX_PRIMES, "the columns")):
            cur.expect(_U64, 2, "the ciphertext components")
            for _ in range(2):
                for part in ("Q", "P"):
                    want = (shape.q if part == "Q" else shape.p) if known else None
                    for _ in range(_field(cur, _U64, want, MAX_PRIMES, f"the {part} prime count")):
                        degree = _field(cur, _U64, shape.n if known else None, 1 << MAX_LOG_DEGREE,
                                        "a polynomial's degree")
                        if degree & (degree - 1) or not degree:
                            raise WireError(f"{cur.what}: a polynomial of degree {degree}, not a power of two")
                        cur.skip(8 * degree)


def check_evaluation_keys(data, shape: KeyShape, galois_elements: set[int], needs_relin: bool) -> None:
    """Raise :class:`WireError` unless ``data`` is exactly the program's key set at ``shape``."""
    cur = _Cursor(data, "evaluation keys")
    expected = (1 + needs_relin * shape.key_bytes + 5 + len(galois_elements) * (8 + shape.galois_key_bytes))
    if len(cur.view) != expected:
        raise WireError(f"evaluation keys of {len(cur.view)} bytes; this program's "
                        f"{len(galois_elements)} Galois key(s){' and relinearisation key' if needs_relin else ''} "
                        f"take {expected} at N={shape.n} with {shape.q}+{shape.p} primes")
    cur.expect(_U8, int(needs_relin), "the relinearisation-key flag")
    if needs_relin:
        _evaluation_key(cur, shape)
    cur.expect(_U8, 1, "the Galois-key flag")
    cur.expect(_U32, len(galois_elements), "the Galois key count")
    for element in sorted(galois_elements):
        cur.expect(_U64, element, "a Galois element (the key set must be exactly the program's)")
        cur.expect(_U64, element, "a Galois key's own element")
        cur.expect(_U64, shape.nth_root, "a Galois key's nth root")
        _evaluation_key(cur, shape)


def check_ciphertext(data, n: int, primes: set[int], what: str = "ciphertext") -> int:
    """The prime count (level + 1) of a Lattigo ciphertext on ring ``n`` with two components and a prime count in
    ``primes``; :class:`WireError` for anything else, before Go reads a length field."""
    cur = _Cursor(data, what)
    cur.expect(_U8, 1, "the metadata flag")
    cur.skip(METADATA_BYTES)
    cur.expect(_U64, 2, "the component count")
    count = cur.take(_U64)
    if count not in primes:
        raise WireError(f"{what} has {count} primes (level {count - 1}); this program takes "
                        f"{sorted(p - 1 for p in primes)}")
    for component in range(2):
        if component:
            cur.expect(_U64, count, "the second component's prime count")
        for _ in range(count):
            cur.expect(_U64, n, "a polynomial's degree")
            cur.skip(8 * n)
    if cur.at != len(cur.view):
        raise WireError(f"{what} has {len(cur.view) - cur.at} trailing bytes")
    return count


def _flag(cur: _Cursor, field: str) -> bool:
    return bool(_bounded(cur, _U8, 1, field))


def check_bootstrap_keys(data) -> None:
    """Raise :class:`WireError` unless ``data`` walks as Lattigo's bootstrapping keys, every count within the
    bytes present (so Go can allocate no more than the upload) and nothing left over."""
    cur = _Cursor(data, "bootstrapping keys")
    for name in ("N1->N2", "N2->N1", "real->complex", "complex->real", "dense->sparse", "sparse->dense"):
        if _flag(cur, f"the {name} key flag"):
            _evaluation_key(cur, None)
    if _flag(cur, "the key-set flag"):
        if _flag(cur, "the relinearisation-key flag"):
            _evaluation_key(cur, None)
        if _flag(cur, "the Galois-key flag"):
            for _ in range(_bounded(cur, _U32, 1 << 16, "the Galois key count")):
                cur.skip(8 + 16)  # the map's element, the key's element and nth root
                _evaluation_key(cur, None)
    if cur.at != len(cur.view):
        raise WireError(f"bootstrapping keys have {len(cur.view) - cur.at} trailing bytes")
