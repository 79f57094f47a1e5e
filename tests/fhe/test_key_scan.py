"""Keys checked in full, not sampled: the residue scan over every SEAL key and ciphertext (polyfhe.fhe.sealbytes),
Lattigo's keys (polyfhe.fhe.backends.lattigo_bytes), the bootstrapping-key child's pipes and the Concrete
workers' memory limit and size checks.

Attack bytes: a key set whose random parts are zero past their first 64 bytes (what the earlier check read),
a constant polynomial, a residue at or above its prime, in the public key, the relinearisation keys and the
Galois keys; each must be refused naming the key and what was wrong, and valid keys must still load.
"""

from __future__ import annotations

import os
import struct
import sys
import textwrap

import numpy as np
import pytest
import seal_bombs as sb
from ckks_testlib import digits, digits_mlp

from polyfhe.export.ckks import export_ckks
from polyfhe.fhe.client import galois_element
from polyfhe.fhe.seal_backend import SealContext
from polyfhe.fhe.sealbytes import MAX_MODULUS, SerializationError, scan_polynomial, seal_layout
from polyfhe.fhe.wire import KIND_CIPHERTEXT, KIND_CONTEXT, WireError, pack, unpack

pytestmark = pytest.mark.fhe


@pytest.fixture(scope="module")
def setup():
    _, _, x, _ = digits()
    program = export_ckks(digits_mlp(), calibration=x[:64], input_shape=(1, 8, 8))
    client = program.client()
    seal = SealContext(program.params)  # a context whose layout carries the primes (the scan's exact bound)
    seal.layout = seal_layout(seal.context, program.params.poly_modulus_degree)
    n = program.params.poly_modulus_degree
    elements = {galois_element(s, n) for s in program.manifest.galois_steps}
    return program, client, seal, elements, x


def with_section(container: bytes, kind: bytes, name: str, data: bytes) -> bytes:
    box = unpack(container, kind)
    return pack(kind, box.header, {**box.sections, name: data})


def section(client, name: str) -> bytes:
    return bytes(unpack(client.public_context(), KIND_CONTEXT).sections[name])


WHAT = {"public_key": "public key", "relin_keys": "relin keys", "galois_keys": "galois keys"}


def test_the_layout_carries_each_levels_primes(setup):
    program, _, seal, _, _ = setup
    layout = seal.layout
    key = [q.value() for q in seal.context.key_context_data().parms().coeff_modulus()]
    assert list(layout.key_moduli) == key and layout.key_primes == len(key)
    assert [len(m) for m in layout.level_moduli] == list(layout.level_primes)
    assert list(layout.level_moduli[0]) == key[:-1]  # the special prime is the key level's last
    assert all(q < MAX_MODULUS for q in key)


@pytest.mark.parametrize("kind", ["public_key", "relin_keys", "galois_keys"])
def test_valid_keys_still_load(setup, kind):
    _, client, seal, elements, _ = setup
    seal.load(kind, section(client, kind), elements if kind == "galois_keys" else None)


def _load(setup, kind: str, data: bytes):
    _, _, seal, elements, _ = setup
    return seal.load(kind, data, elements if kind == "galois_keys" else None)


@pytest.mark.parametrize("kind", ["public_key", "relin_keys", "galois_keys"])
def test_random_parts_zeroed_past_64_bytes_are_refused(setup, kind):
    program, client, _, _, _ = setup
    bad = sb.bad_key(section(client, kind), kind, "zero_after", key=None, after=64)
    with pytest.raises(SerializationError, match=rf"{WHAT[kind]}.*second component \(the random part\): every "
                                                 r"residue modulo prime 1 .* is 0, a zero polynomial"):
        _load(setup, kind, bad)
    # and through the server, whose layout may carry prime counts only: the degenerate check needs no primes
    with pytest.raises(SerializationError, match="a zero polynomial"):
        program.server(with_section(client.public_context(), KIND_CONTEXT, kind, bad))


def test_a_galois_key_names_its_element(setup):
    _, client, _, elements, _ = setup
    data = section(client, "galois_keys")
    last = len(sb.key_data_offsets(sb.inflate(data), "galois_keys")) - 1
    bad = sb.bad_key(data, "galois_keys", "constant", key=last, component=0, prime=2, value=12345)
    element = max(elements, key=lambda e: (e & (2 * setup[0].params.poly_modulus_degree - 1)) >> 1)
    with pytest.raises(SerializationError, match=rf"the key of Galois element {element}, part \d+ of \d+, first "
                                                 r"component: every residue modulo prime 2 .* is 12345, a constant"):
        _load(setup, "galois_keys", bad)


@pytest.mark.parametrize("kind", ["public_key", "relin_keys", "galois_keys"])
@pytest.mark.parametrize("component", [0, 1])
def test_a_constant_polynomial_is_refused(setup, kind, component):
    bad = sb.bad_key(section(setup[1], kind), kind, "constant", component=component, prime=1, value=7)
    with pytest.raises(SerializationError, match=r"every residue modulo prime 1 \(q=\d+\) is 7, a constant \(7\) "
                                                 "polynomial: a real key's polynomials are uniformly random"):
        _load(setup, kind, bad)


@pytest.mark.parametrize("kind", ["public_key", "relin_keys", "galois_keys"])
def test_a_residue_at_its_prime_is_refused(setup, kind):
    _, client, seal, _, _ = setup
    prime = seal.layout.key_primes - 1  # the special prime
    q = seal.layout.key_moduli[prime]
    bad = sb.bad_key(section(client, kind), kind, "residue", key=0, component=1, prime=prime, value=q)
    with pytest.raises(SerializationError, match=rf"{WHAT[kind]}.*residue 0 modulo prime {prime} \(q={q}\) is {q}, "
                                                 "not below its prime"):
        _load(setup, kind, bad)


def test_a_residue_past_every_seal_prime_is_refused_by_the_server(setup):
    program, client, _, _, _ = setup
    bad = sb.bad_key(section(client, "relin_keys"), "relin_keys", "residue", component=0, value=(1 << 64) - 1)
    with pytest.raises(SerializationError, match="relin keys: key 0 of .*not below"):
        program.server(with_section(client.public_context(), KIND_CONTEXT, "relin_keys", bad))


def _ciphertext(client, x, how: str, **kwargs) -> bytes:
    data = client.encrypt(x)
    ct = unpack(data, KIND_CIPHERTEXT).sections["ct0"]
    body = bytearray(sb.inflate(ct))
    meta = sb.CipherMeta.parse(bytes(body))
    row = meta.n * 8
    comp = sb.CIPHER_DATA + kwargs.get("component", 1) * meta.k * row
    prime = kwargs.get("prime", 0)
    if how == "zero_row":
        body[comp + prime * row: comp + (prime + 1) * row] = bytes(row)
    else:
        struct.pack_into("<Q", body, comp + prime * row + 5 * 8, kwargs["value"])
    return with_section(data, KIND_CIPHERTEXT, "ct0", sb.compress(bytes(body)))


def test_a_ciphertext_transparent_modulo_one_prime_is_refused(setup):
    program, client, _, _, x = setup
    data = _ciphertext(client, x[:1], "zero_row", prime=1)
    with pytest.raises(SerializationError, match=r"ciphertext, second component: every residue modulo prime 1 .* "
                                                 "is 0, a zero polynomial; a transparent ciphertext"):
        program.server(client.public_context()).run(data)


@pytest.mark.parametrize("component", [0, 1])
def test_a_ciphertext_residue_at_its_prime_is_refused(setup, component):
    _, client, seal, _, x = setup
    q = seal.layout.level_moduli[0][0]
    box = unpack(_ciphertext(client, x[:1], "residue", component=component, value=q), KIND_CIPHERTEXT)
    with pytest.raises(SerializationError, match=rf"residue 5 modulo prime 0 \(q={q}\) is {q}, not below its prime"):
        seal.load("ciphertext", box.sections["ct0"])
    seal.load("ciphertext", unpack(client.encrypt(x[:1]), KIND_CIPHERTEXT).sections["ct0"])  # a valid one loads


# ------------------------------------------------------------------------------------------------------------
# the scan itself
# ------------------------------------------------------------------------------------------------------------
MODULI = np.array([97, 193, 257], dtype=np.uint64)


def _poly(rng, n=16, moduli=MODULI) -> np.ndarray:
    return np.stack([rng.integers(0, int(q), n, dtype=np.uint64) for q in moduli]).astype("<u8")


def _fd_with(data: bytes, pad: int = 3) -> int:
    fd = os.memfd_create("scan-test")
    os.pwrite(fd, bytes(pad) + data, 0)
    return fd


@pytest.mark.parametrize("source", ["fd", "bytes"])
def test_the_scan_reads_files_and_buffers_in_chunks(source, monkeypatch):
    import polyfhe.fhe.sealbytes as sealbytes

    monkeypatch.setattr(sealbytes, "SCAN_BYTES", 16 * 8)  # one row at a time: the chunked path
    rng = np.random.default_rng(1)
    poly = _poly(rng)
    for row, col, value, reason in ((2, 15, 257, "residue 15 modulo prime 2 .q=257. is 257"),
                                    (1, 0, None, "every residue modulo prime 1 .q=193. is 0, a zero"),
                                    (0, 0, 5, "is 5, a constant")):
        bad = poly.copy()
        if value is None or reason.endswith("constant"):
            bad[row] = 0 if value is None else value
        else:
            bad[row, col] = value
        fd = _fd_with(bad.tobytes())
        try:
            src = fd if source == "fd" else bytes(3) + bad.tobytes()
            with pytest.raises(WireError, match=f"poly: .*{reason}"):
                scan_polynomial(src, 3, 16, MODULI, "poly", error=WireError)
        finally:
            os.close(fd)
    fd = _fd_with(poly.tobytes())
    try:
        scan_polynomial(fd if source == "fd" else bytes(3) + poly.tobytes(), 3, 16, MODULI, "poly")
    finally:
        os.close(fd)


def test_the_scan_steps_over_row_headers():
    rng = np.random.default_rng(2)
    poly = _poly(rng)
    rows = b"".join(struct.pack("<Q", 16) + r.tobytes() for r in poly)  # Lattigo: a u64 length before each row
    scan_polynomial(rows, 8, 16, MODULI, "poly", row_stride=8 * 17)
    fd = _fd_with(rows, pad=0)
    try:
        scan_polynomial(fd, 8, 16, MODULI, "poly", row_stride=8 * 17)
    finally:
        os.close(fd)
    with pytest.raises(SerializationError, match="truncated"):
        scan_polynomial(rows[:-8], 8, 16, MODULI, "poly", row_stride=8 * 17)


def test_the_degenerate_modes():
    zero = np.zeros((3, 16), dtype="<u8")
    scan_polynomial(zero.tobytes(), 0, 16, MODULI, "c0", degenerate=None)
    const = np.full((3, 16), 3, dtype="<u8")
    scan_polynomial(const.tobytes(), 0, 16, MODULI, "c1", degenerate="zero")
    with pytest.raises(SerializationError, match="transparent"):
        scan_polynomial(zero.tobytes(), 0, 16, MODULI, "c1", degenerate="zero")
