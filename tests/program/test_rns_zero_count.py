"""The residue scan counts zero residues: a row of a polynomial that must be uniformly random (a key's, a
ciphertext's second component) with more than ``MAX_ZEROS`` zeros is refused, so a key whose random part holds one
non-zero residue per prime is not taken for a key; honest rows, on primes as small as the engines use, pass.

The scan itself on synthetic rows (bytes and file descriptors, the chunked path), then SEAL's keys and ciphertexts
through the engine's own loader and server (Lattigo's: tests/engines/lattigo/test_lattigo_key_walk.py).
"""

from __future__ import annotations

import math
import os
import struct

import numpy as np
import pytest

from polyfhe.program import rns_scan
from polyfhe.program.rns_scan import scan_polynomial
from polyfhe.program.wire import KIND_CIPHERTEXT, KIND_CONTEXT, WireError, pack, unpack

pytestmark = pytest.mark.fhe
MAX_ZEROS = 23  # rns_scan.MAX_ZEROS, pinned (docs/engines.md states it)


def _rows(rng, n: int, moduli) -> np.ndarray:
    return np.stack([rng.integers(0, int(q), n, dtype=np.uint64) for q in moduli]).astype("<u8")


def _scan(rows: np.ndarray, moduli, mode: str, source: str = "bytes") -> None:
    n = rows.shape[1]
    if source == "bytes":
        scan_polynomial(rows.tobytes(), 0, n, np.asarray(moduli, dtype=np.uint64), "poly", degenerate=mode)
        return
    fd = os.memfd_create("zero-count-test")
    try:
        os.pwrite(fd, rows.tobytes(), 0)
        scan_polynomial(fd, 0, n, np.asarray(moduli, dtype=np.uint64), "poly", degenerate=mode)
    finally:
        os.close(fd)


def test_the_threshold_is_safe_for_every_ntt_prime():
    """P(at least k zeros) <= (n/q)^k / k! and an NTT prime has q > 2n: below 2^-100 at MAX_ZEROS + 1."""
    assert rns_scan.MAX_ZEROS == MAX_ZEROS
    k = MAX_ZEROS + 1
    assert k * math.log2(2) + math.log2(math.factorial(k)) > 100


@pytest.mark.parametrize("log_n, q", [(15, (1 << 20) - 63), (12, 8209), (4, 97)])
def test_honest_rows_on_small_primes_pass(log_n, q):
    """20-bit primes at N=2^15 (a zero in one row out of 32), a prime just above 2N (half a zero per row on
    average, the worst an NTT prime allows) and the tiny test rings: thousands of random rows, none refused."""
    rng = np.random.default_rng(log_n)
    n = 1 << log_n
    rows = rng.integers(0, q, ((1 << 22) // n, n), dtype=np.uint64).astype("<u8")  # 32 MB
    assert (rows == 0).any(axis=1).sum() > len(rows) * n / q / 2  # many rows do hold a zero
    for mode in ("constant", "zero"):
        _scan(rows, [q] * len(rows), mode)


@pytest.mark.parametrize("source", ["bytes", "fd"])
@pytest.mark.parametrize("mode", ["constant", "zero"])
def test_a_row_with_one_non_zero_residue_is_refused(source, mode, monkeypatch):
    monkeypatch.setattr(rns_scan, "SCAN_BYTES", 2 * 8 * 1024)  # two rows at a time: the chunked path
    rng = np.random.default_rng(1)
    moduli = [(1 << 40) - 87, (1 << 40) - 195, (1 << 30) - 35]
    rows = _rows(rng, 1024, moduli)
    rows[2, 1:] = 0
    rows[2, 0] = 12345
    tail = ("a real key.s polynomials are uniformly random, this is not a key" if mode == "constant" else "a ciphertext's second component is uniformly random; "
            "this one is nearly transparent")
    with pytest.raises(WireError, match=rf"^poly: 1023 of the 1024 residues modulo prime 2 \(q={moduli[2]}\) are 0; a "
                                        rf"uniformly random polynomial has 9.5e-07 on average, and more than "
                                        rf"{MAX_ZEROS} with probability below 2\^-100: {tail}"):
        _scan(rows, moduli, mode, source)
    _scan(rows, moduli, None, source)  # a ciphertext's first component carries the message: not counted


def test_the_limit_is_exact():
    rng = np.random.default_rng(2)
    moduli = [(1 << 40) - 87] * 2
    rows = _rows(rng, 256, moduli)
    rows[1, :MAX_ZEROS] = 0
    _scan(rows, moduli, "constant")
    rows[1, MAX_ZEROS] = 0
    with pytest.raises(WireError, match=f"{MAX_ZEROS + 1} of the 256 residues modulo prime 1"):
        _scan(rows, moduli, "constant")


def test_rows_on_a_prime_below_twice_the_ring_are_not_counted():
    """The bound needs q > 2n (every NTT prime): on a smaller modulus (no engine's) a random row may hold many
    zeros, and only the all-zero and constant checks apply."""
    rows = np.zeros((1, 256), dtype="<u8")
    rows[0, ::2] = 1
    _scan(rows, [3], "constant")
    with pytest.raises(WireError, match="128 of the 256"):
        _scan(rows, [1 << 20], "constant")


# ------------------------------------------------------------------------------------------------------------
# SEAL's keys and ciphertexts, through the engine
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def seal_setup():
    from ckks_testlib import digits_program

    from polyfhe.engines.seal.context import SealContext
    from polyfhe.program.boundary import galois_element

    program, x = digits_program()
    client = program.client()
    n = program.params.poly_modulus_degree
    elements = {galois_element(s, n) for s in program.manifest.galois_steps}
    return program, client, SealContext(program.params), elements, x


def _sparse_seal_key(obj: bytes, kind: str, key: int = 0) -> bytes:
    """The SEAL key object ``obj`` with key ``key``'s second component (its random part) holding one non-zero
    residue per prime."""
    import seal_bombs as sb

    body = bytearray(sb.inflate(obj))
    start, meta = sb.key_data_offsets(bytes(body), kind)[key]
    row = 8 * meta.n
    second = start + meta.k * row
    for prime in range(meta.k):
        at = second + prime * row
        body[at + 8: at + row] = bytes(row - 8)
    return sb.compress(bytes(body))


@pytest.mark.parametrize("kind", ["public_key", "relin_keys", "galois_keys"])
def test_a_seal_key_with_one_non_zero_residue_per_row_is_refused(seal_setup, kind):
    from polyfhe.engines.seal.sealbytes import SerializationError

    program, client, seal, elements, _ = seal_setup
    context = client.public_context()
    box = unpack(context, KIND_CONTEXT)
    honest = bytes(box.sections[kind])
    seal.load(kind, honest, elements if kind == "galois_keys" else None)
    n = program.params.poly_modulus_degree
    bad = _sparse_seal_key(honest, kind)
    with pytest.raises(SerializationError, match=rf"second component \(the random part\): {n - 1} of the {n} "
                                                 r"residues modulo prime 0 .* this is not a key"):
        seal.load(kind, bad, elements if kind == "galois_keys" else None)
    with pytest.raises(SerializationError, match=f"{n - 1} of the {n} residues"):
        program.server(pack(KIND_CONTEXT, box.header, {**box.sections, kind: bad}))


def test_a_seal_ciphertext_whose_random_part_is_mostly_zero_is_refused(seal_setup):
    import seal_bombs as sb

    from polyfhe.engines.seal.sealbytes import SerializationError

    program, client, _, _, x = seal_setup
    data = client.encrypt(x[:1])
    box = unpack(data, KIND_CIPHERTEXT)
    body = bytearray(sb.inflate(box.sections["ct0"]))
    meta = sb.CipherMeta.parse(bytes(body))
    row = 8 * meta.n
    at = sb.CIPHER_DATA + meta.k * row + row  # the second component, its second prime
    body[at: at + row] = struct.pack("<Q", 7) + bytes(row - 8)
    bad = pack(KIND_CIPHERTEXT, box.header, {**box.sections, "ct0": sb.compress(bytes(body))})
    server = program.server(client.public_context())
    server.run(data)  # the honest one runs
    with pytest.raises(SerializationError, match=rf"second component: {meta.n - 1} of the {meta.n} residues modulo "
                                                 "prime 1 .* nearly transparent"):
        server.run(bad)
