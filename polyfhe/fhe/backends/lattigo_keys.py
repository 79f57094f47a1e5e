"""Check an uploaded Lattigo evaluation key set byte for byte before Go unmarshals it.

Go's unmarshalling trusts the length fields it reads (a corrupted count could make it allocate far more than the
upload), so every length field is walked here against what the program's parameters imply, with no copy of the
key bytes: the relinearisation key present exactly when the program multiplies ciphertexts, and the Galois keys
exactly the manifest's elements. Layout (Lattigo v6, measured against ``MemEvaluationKeySet.marshal_binary``):

- key set: u8 has-relin | relin key | u8 has-galois | u32 count | (u64 element | Galois key) sorted by element;
- Galois key: u64 element | u64 nth root | evaluation key;
- evaluation key (gadget ciphertext): u64 base-two decomposition (0) | u64 rows (ceil(Q/P)) | per row: u64 columns (1)
  | u64 pair (2) | two ring-QP polynomials, each u64 Q-count | Q x (u64 N | N x u64) | u64 P-count | P x (...).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from polyfhe.fhe.wire import WireError

__all__ = ["KeyShape", "check_evaluation_keys"]

_U64 = struct.Struct("<Q")


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
        root = 1 << int(params["log_nth_root"]) if params.get("log_nth_root") else 2 * n
        return cls(n, len(params["logq"]), len(params["logp"]), root)

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


def _evaluation_key(cur: _Cursor, shape: KeyShape) -> None:
    start = cur.at
    cur.expect(_U64, 0, "the base-two decomposition")
    cur.expect(_U64, shape.rows, "the decomposition rows")
    for _ in range(shape.rows):
        cur.expect(_U64, 1, "the columns")
        cur.expect(_U64, 2, "the ciphertext components")
        for _ in range(2):
            for primes, part in ((shape.q, "Q"), (shape.p, "P")):
                cur.expect(_U64, primes, f"the {part} prime count")
                for _ in range(primes):
                    cur.expect(_U64, shape.n, "a polynomial's degree")
                    cur.skip(8 * shape.n)
    assert cur.at - start == shape.key_bytes


def check_evaluation_keys(data, shape: KeyShape, galois_elements: set[int], needs_relin: bool) -> None:
    """Raise :class:`WireError` unless ``data`` is exactly the program's key set at ``shape``."""
    cur = _Cursor(data, "evaluation keys")
    expected = (1 + needs_relin * shape.key_bytes + 5 + len(galois_elements) * (8 + shape.galois_key_bytes))
    if len(cur.view) != expected:
        raise WireError(f"evaluation keys of {len(cur.view)} bytes; this program's "
                        f"{len(galois_elements)} Galois key(s){' and relinearisation key' if needs_relin else ''} "
                        f"take {expected} at N={shape.n} with {shape.q}+{shape.p} primes")
    cur.expect(struct.Struct("<B"), int(needs_relin), "the relinearisation-key flag")
    if needs_relin:
        _evaluation_key(cur, shape)
    cur.expect(struct.Struct("<B"), 1, "the Galois-key flag")
    cur.expect(struct.Struct("<I"), len(galois_elements), "the Galois key count")
    for element in sorted(galois_elements):
        cur.expect(_U64, element, "a Galois element (the key set must be exactly the program's)")
        cur.expect(_U64, element, "a Galois key's own element")
        cur.expect(_U64, shape.nth_root, "a Galois key's nth root")
        _evaluation_key(cur, shape)
