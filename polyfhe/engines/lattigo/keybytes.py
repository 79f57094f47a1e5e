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
  these three counts are checked exactly for every key, the bootstrapping keys' too (the bridge makes every key
  with ``rlwe.KeyGenerator``'s defaults: no base-two decomposition, so one column per row), since Lattigo's gadget
  product indexes the first column of every row;
- ciphertext: u8 has-metadata (1) | metadata (277 bytes of JSON) | u64 components | per component u64 prime
  count | primes x (u64 N | N x u64);
- bootstrapping keys: six optional evaluation keys (u8 flag | key) then an optional key set (u8 flag | key set).

Values are checked too, in one linear pass (:func:`polyfhe.program.rns_scan.scan_polynomial`, numpy, in place):
every polynomial of every key has each residue below its prime (the program's primes where :class:`KeyShape`
carries them, else Lattigo's 61-bit prime bound) and, per prime, is neither all-zero, constant nor mostly zero
(:data:`polyfhe.program.rns_scan.MAX_ZEROS`; a real key's polynomials are uniformly random; a key of zeros makes
rotations produce transparent ciphertexts). Input ciphertexts: residues below the bound, second component zero
modulo no prime and not mostly zero. The bootstrapping keys are walked
against the exact shape their parameters imply when given one (:class:`BootKeyShape`, computed by
:mod:`polyfhe.engines.lattigo.bootshape`'s port of Lattigo's own logic): which keys are present, each key's
ring, rows and prime counts, the Galois key count and elements; a missing or extra Galois key is refused naming its
element.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

import numpy as np

from polyfhe.program.rns_scan import scan_polynomial
from polyfhe.program.sizes import key_switching_key_bytes
from polyfhe.program.wire import WireError

__all__ = ["BOOT_KEY_NAMES", "BootKeyShape", "KeyShape", "KeySummary", "bootstrap_keys_bytes", "check_bootstrap_keys",
           "check_ciphertext", "check_evaluation_keys", "evaluation_keys_bytes"]

_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_U8 = struct.Struct("<B")
METADATA_BYTES = 277  # rlwe.MetaData.BinarySize(): fixed-size JSON
MAX_PRIMES = 64  # per modulus part: Lattigo's own moduli stay far below
MAX_LOG_DEGREE = 17
MAX_MODULUS = 1 << 61  # Lattigo's primes are at most 61 bits: the bound where the primes themselves are not known
BOOT_KEY_NAMES = ("N1->N2", "N2->N1", "real->complex", "complex->real", "dense->sparse", "sparse->dense")


@dataclass(frozen=True)
class KeyShape:
    """A key-switching key's dimensions: ring degree, ciphertext primes Q, special primes P, Galois nth root."""

    n: int
    q: int
    p: int
    nth_root: int
    q_moduli: tuple[int, ...] = ()  # the primes, when known: residues are checked below them
    p_moduli: tuple[int, ...] = ()

    @classmethod
    def from_lattigo_params(cls, params: dict, moduli: tuple[tuple[int, ...], tuple[int, ...]] | None = None
                            ) -> KeyShape:
        """``moduli``: (Q primes, P primes) as ``lattigo_primes`` gives them, for the exact residue bound."""
        n = 1 << int(params["logn"])
        # the residual ring's own keys carry its 2N even when ring switching raises the parameters' nth root
        # (measured on the width-32 deep recipe: 32768 at N=16384 with log_nth_root 17)
        q, p = moduli if moduli is not None else ((), ())
        return cls(n, len(params["logq"]), len(params["logp"]), 2 * n, tuple(int(v) for v in q),
                   tuple(int(v) for v in p))

    def moduli(self, part: str, count: int) -> np.ndarray:
        known = self.q_moduli if part == "Q" else self.p_moduli
        return _moduli(known, count)

    @property
    def rows(self) -> int:
        return math.ceil(self.q / self.p)

    @property
    def key_bytes(self) -> int:
        primes = self.q + self.p  # each row: a two-polynomial ciphertext, every polynomial with its primes listed
        return key_switching_key_bytes(self.n, self.rows, primes, digit_framing=16 + 2 * (16 + 8 * primes),
                                       framing=16)

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


def _moduli(known, count: int) -> np.ndarray:
    if len(known) >= count:
        return np.array(known[:count], dtype=np.uint64)
    return np.full(count, MAX_MODULUS, dtype=np.uint64)


@dataclass(frozen=True)
class KeySummary:
    """What one walked evaluation key holds: ring degree, gadget rows, Q and P prime counts."""

    n: int
    rows: int
    q: int
    p: int


def _polynomial(cur: _Cursor, want: int | None, known: bool, shape, part: str, name: str,
                degree: int | None) -> tuple[int, int]:
    """Walk one ring polynomial part (Q or P): u64 prime count, then per prime u64 degree and the residues; scan
    its values. Returns (prime count, degree)."""
    count = _field(cur, _U64, want, MAX_PRIMES, f"the {part} prime count")
    start = cur.at
    for _ in range(count):
        got = _field(cur, _U64, shape.n if known else degree, 1 << MAX_LOG_DEGREE, "a polynomial's degree")
        if got & (got - 1) or not got:
            raise WireError(f"{cur.what}: a polynomial of degree {got}, not a power of two")
        degree = got
        cur.skip(8 * got)
    if count:
        moduli = shape.moduli(part, count) if isinstance(shape, (KeyShape, BootKeyShape)) else _moduli((), count)
        scan_polynomial(cur.view, start + 8, degree, moduli, f"{cur.what}: {name}, {part} part", error=WireError,
                        row_stride=8 * (degree + 1))
    return count, degree


def _evaluation_key(cur: _Cursor, shape: KeyShape | None, name: str = "a key",
                    moduli: BootKeyShape | None = None) -> KeySummary:
    """One evaluation key (a gadget ciphertext): of exactly ``shape``, or (``None``: the bootstrapping keys, whose
    prime counts belong to Lattigo's bootstrapping circuit and are compared with :class:`BootKeyShape` after the
    walk) of any ring and prime counts whose every count is bounded and whose data is present. Either way the
    gadget is exactly what ``rlwe.KeyGenerator``'s defaults make, as Lattigo's gadget product indexes it: base-two
    decomposition 0, ceil(Q/P) rows (at least one P prime), one column per row
    (``BaseTwoDecompositionVectorSize`` is 1 per row without a base-two decomposition), every polynomial on the
    same ring and primes; a row of no column would make Go index out of range. Every polynomial scanned (residues
    below the primes, none zero, constant or mostly zero modulo a prime). ``moduli``: where the primes come from
    when ``shape`` is None."""
    known = shape is not None
    cur.expect(_U64, 0, f"the base-two decomposition of {name}")
    degree, counts = None, None
    rows_at = cur.at
    rows = _field(cur, _U64, shape.rows if known else None, MAX_PRIMES, f"the gadget row count of {name}")
    if not rows:
        raise WireError(f"{cur.what}: the gadget row count of {name} is 0 at byte {rows_at}; a key has "
                        "ceil(Q/P) rows, at least one")
    for row in range(rows):
        cur.expect(_U64, 1, f"the column count of row {row} of {name}")
        cur.expect(_U64, 2, f"the ciphertext components of row {row} of {name}")
        for component in range(2):
            here = []
            for part in ("Q", "P"):
                want = (shape.q if part == "Q" else shape.p) if known else None
                if want is None and counts is not None:
                    want = counts[len(here)]  # every polynomial of a key on the same primes
                label = f"{name}, row {row} column 0 component {component}"
                count, degree = _polynomial(cur, want, known, shape if known else moduli, part, label, degree)
                here.append(count)
            counts = tuple(here)
    q, p = counts
    if not q or not p or rows != math.ceil(q / p):
        need = f"ceil({q}/{p}) = {math.ceil(q / p)} rows" if q and p else "at least one Q and one P prime"
        raise WireError(f"{cur.what}: {name} has {rows} gadget rows on {q}+{p} primes; Lattigo's keys have {need}")
    return KeySummary(degree, rows, q, p)


def evaluation_keys_bytes(shape: KeyShape, galois_keys: int, needs_relin: bool) -> int:
    """The exact size of a key set of ``galois_keys`` Galois keys (and the relinearisation key) at ``shape``: the
    only size :func:`check_evaluation_keys` accepts."""
    return 1 + needs_relin * shape.key_bytes + 5 + galois_keys * (8 + shape.galois_key_bytes)


def check_evaluation_keys(data, shape: KeyShape, galois_elements: set[int], needs_relin: bool) -> None:
    """Raise :class:`WireError` unless ``data`` is exactly the program's key set at ``shape``."""
    cur = _Cursor(data, "evaluation keys")
    expected = evaluation_keys_bytes(shape, len(galois_elements), needs_relin)
    if len(cur.view) != expected:
        raise WireError(f"evaluation keys of {len(cur.view)} bytes; this program's "
                        f"{len(galois_elements)} Galois key(s){' and relinearisation key' if needs_relin else ''} "
                        f"take {expected} at N={shape.n} with {shape.q}+{shape.p} primes")
    cur.expect(_U8, int(needs_relin), "the relinearisation-key flag")
    if needs_relin:
        _evaluation_key(cur, shape, "the relinearisation key")
    cur.expect(_U8, 1, "the Galois-key flag")
    cur.expect(_U32, len(galois_elements), "the Galois key count")
    for element in sorted(galois_elements):
        cur.expect(_U64, element, "a Galois element (the key set must be exactly the program's)")
        cur.expect(_U64, element, "a Galois key's own element")
        cur.expect(_U64, shape.nth_root, "a Galois key's nth root")
        _evaluation_key(cur, shape, f"the Galois key of element {element}")


def check_ciphertext(data, n: int, primes: set[int], what: str = "ciphertext",
                     moduli: tuple[int, ...] | None = None) -> int:
    """The prime count (level + 1) of a Lattigo ciphertext on ring ``n`` with two components and a prime count in
    ``primes``; :class:`WireError` for anything else, before Go reads a length field. Its residues are scanned:
    below ``moduli`` (the chain's primes, Q[0] first; else Lattigo's bound) and the second component zero modulo
    no prime (not transparent)."""
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
        start = cur.at
        for _ in range(count):
            cur.expect(_U64, n, "a polynomial's degree")
            cur.skip(8 * n)
        scan_polynomial(cur.view, start + 8, n, _moduli(moduli or (), count),
                        f"{what}, {('first', 'second')[component]} component", error=WireError,
                        degenerate="zero" if component else None, row_stride=8 * (n + 1))
    if cur.at != len(cur.view):
        raise WireError(f"{what} has {len(cur.view) - cur.at} trailing bytes")
    return count


def _flag(cur: _Cursor, field: str) -> bool:
    return bool(_bounded(cur, _U8, 1, field))


@dataclass(frozen=True)
class BootKeyShape:
    """The exact shape of a bootstrapping key set: the ring, which of the six switching keys are present
    (:data:`BOOT_KEY_NAMES` order) and each one's (Q, P) prime counts, the key set's relinearisation key and
    Galois keys (count, and elements when known) with their (Q, P) counts; ``q_moduli``/``p_moduli``: the
    bootstrapping parameters' primes when known (residues are checked below them, else below 2^61)."""

    n: int
    switching: tuple[tuple[int, int] | None, ...]
    relin: tuple[int, int] | None
    galois: tuple[int, int]
    galois_count: int
    galois_elements: tuple[int, ...] = ()
    q_moduli: tuple[int, ...] = ()
    p_moduli: tuple[int, ...] = field(default=())

    def moduli(self, part: str, count: int) -> np.ndarray:
        return _moduli(self.q_moduli if part == "Q" else self.p_moduli, count)

    @staticmethod
    def rows(q: int, p: int) -> int:
        return math.ceil(q / p)


def _expect_shape(what: str, got: KeySummary, n: int, want: tuple[int, int]) -> None:
    q, p = want
    if (got.n, got.q, got.p, got.rows) != (n, q, p, BootKeyShape.rows(q, p)):
        raise WireError(f"bootstrapping keys: {what} is on N={got.n} with {got.q}+{got.p} primes in {got.rows} "
                        f"rows; these parameters imply N={n} with {q}+{p} primes in {BootKeyShape.rows(q, p)} rows")


def _galois_difference(cur: _Cursor, count: int, shape: BootKeyShape) -> str:
    """For a refusal: which Galois elements the key set at ``cur`` (``count`` keys, not yet walked) lacks and
    which it adds, compared with ``shape``'s. The elements are read at the stride the shape implies (each key's
    own element and nth root must agree with it); empty where they cannot be read that way."""
    if not shape.galois_elements:
        return ""
    q, p = shape.galois
    stride = 8 + KeyShape(shape.n, q, p, 2 * shape.n).galois_key_bytes
    got = set()
    for index in range(count):
        at = cur.at + index * stride
        if at + 24 > len(cur.view):
            return ""
        element, own, nth_root = struct.unpack_from("<QQQ", cur.view, at)
        if element != own or nth_root != 2 * shape.n:
            return ""
        got.add(element)
    want = set(shape.galois_elements)
    missing, extra = sorted(want - got), sorted(got - want)
    parts = ([f"missing the Galois key(s) of element(s) {missing}"] if missing else []) + \
        ([f"extra Galois key(s) of element(s) {extra} these parameters do not use"] if extra else [])
    return ": " + "; ".join(parts) if parts else ""


def bootstrap_keys_bytes(shape: BootKeyShape) -> int:
    """The exact size of the bootstrapping keys ``shape`` describes, the only size :func:`check_bootstrap_keys`
    accepts with it: the six switching keys' flags and keys, the key set's flag, its relinearisation key (flag
    and key) and its Galois keys (flag, u32 count, per key u64 element, u64 own element, u64 nth root, key)."""
    def key(counts: tuple[int, int]) -> int:
        return KeyShape(shape.n, *counts, 2 * shape.n).key_bytes

    switching = sum(1 + (0 if counts is None else key(counts)) for counts in shape.switching)
    relin = 1 + (0 if shape.relin is None else key(shape.relin))
    return switching + 1 + relin + 1 + 4 + shape.galois_count * (24 + key(shape.galois))


def check_bootstrap_keys(data, shape: BootKeyShape | None = None) -> list[tuple[str, KeySummary]]:
    """Raise :class:`WireError` unless ``data`` walks as Lattigo's bootstrapping keys, every count within the
    bytes present (so Go can allocate no more than the upload), nothing left over, and every polynomial scanned
    (residues below the primes, none zero, constant or mostly zero modulo a prime), every key's gadget exact (base-two
    decomposition 0, ceil(Q/P) rows of one column); with ``shape``, exactly the keys and shapes it implies. A server
    always passes ``shape`` (:func:`polyfhe.engines.lattigo.bootshape.expected_bootstrap_keys`); without one the
    walk only reports what the keys hold (tests, tools). Returns what each key holds (name, :class:`KeySummary`)."""
    cur = _Cursor(data, "bootstrapping keys")
    found: list[tuple[str, KeySummary]] = []
    for index, name in enumerate(BOOT_KEY_NAMES):
        present = _flag(cur, f"the {name} key flag")
        if shape is not None and present != (shape.switching[index] is not None):
            raise WireError(f"bootstrapping keys: the {name} key is {'present' if present else 'missing'}; these "
                            f"parameters {'need none' if present else 'need one'}")
        if present:
            summary = _evaluation_key(cur, None, f"the {name} key", shape)
            if shape is not None:
                _expect_shape(f"the {name} key", summary, shape.n, shape.switching[index])
            found.append((name, summary))
    has_set = _flag(cur, "the key-set flag")
    if shape is not None and not has_set:
        raise WireError("bootstrapping keys hold no key set; these parameters need its Galois keys")
    if has_set:
        has_relin = _flag(cur, "the relinearisation-key flag")
        if shape is not None and has_relin != (shape.relin is not None):
            raise WireError(f"bootstrapping keys: the relinearisation key is {'present' if has_relin else 'missing'}"
                            f"; these parameters {'need none' if has_relin else 'need one'}")
        if has_relin:
            summary = _evaluation_key(cur, None, "the relinearisation key", shape)
            if shape is not None:
                _expect_shape("the relinearisation key", summary, shape.n, shape.relin)
            found.append(("relinearisation", summary))
        if _flag(cur, "the Galois-key flag"):
            count = _bounded(cur, _U32, 1 << 16, "the Galois key count")
            if shape is not None and count != shape.galois_count:
                raise WireError(f"bootstrapping keys hold {count} Galois keys; these parameters imply "
                                f"{shape.galois_count}{_galois_difference(cur, count, shape)}")
            first = cur.at
            previous = -1
            for index in range(count):
                element, own, nth_root = cur.take(_U64), cur.take(_U64), cur.take(_U64)
                if element != own or element <= previous or not element & 1 or element >= nth_root:
                    raise WireError(f"bootstrapping keys: Galois key {index} has element {element} (its own says "
                                    f"{own}, nth root {nth_root}): elements must be odd, below the nth root, "
                                    "sorted and each key's own")
                if shape is not None and shape.galois_elements and element != shape.galois_elements[index]:
                    cur.at = first
                    raise WireError(f"bootstrapping keys: Galois key {index} has element {element}; these "
                                    f"parameters imply {shape.galois_elements[index]}"
                                    f"{_galois_difference(cur, count, shape)}")
                previous = element
                summary = _evaluation_key(cur, None, f"the Galois key of element {element}", shape)
                if nth_root != 2 * summary.n:
                    raise WireError(f"bootstrapping keys: the Galois key of element {element} has nth root "
                                    f"{nth_root} on N={summary.n}")
                if shape is not None:
                    _expect_shape(f"the Galois key of element {element}", summary, shape.n, shape.galois)
                found.append((f"galois {element}", summary))
        elif shape is not None and shape.galois_count:
            raise WireError("bootstrapping keys hold no Galois keys; these parameters need "
                            f"{shape.galois_count}")
    if cur.at != len(cur.view):
        raise WireError(f"bootstrapping keys have {len(cur.view) - cur.at} trailing bytes")
    return found
