"""Keys checked in full, not sampled: the residue scan over every SEAL key and ciphertext (polyfhe.engines.seal.sealbytes),
Lattigo's keys (polyfhe.engines.lattigo.keybytes), the bootstrapping-key child's pipes and the Concrete
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
from ckks_testlib import digits_program

from polyfhe.engines.seal.context import SealContext
from polyfhe.engines.seal.sealbytes import MAX_MODULUS, SerializationError, scan_polynomial
from polyfhe.program.boundary import galois_element
from polyfhe.program.wire import KIND_CIPHERTEXT, KIND_CONTEXT, WireError, pack, unpack

pytestmark = pytest.mark.fhe


@pytest.fixture(scope="module")
def setup():
    program, x = digits_program()
    client = program.client()
    seal = SealContext(program.params)  # its layout carries each level's primes (the scan's exact bound)
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
    _, _, seal, _, _ = setup
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
    from polyfhe.program import rns_scan

    monkeypatch.setattr(rns_scan, "SCAN_BYTES", 16 * 8)  # one row at a time: the chunked path
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


# ------------------------------------------------------------------------------------------------------------
# Lattigo keys (synthetic bytes in the wheel's layout, see lattigo_bytes' docstring; real keys where the wheel is)
# ------------------------------------------------------------------------------------------------------------
def _lattigo_poly(rng, n: int, moduli) -> bytes:
    rows = [rng.integers(1, int(q), n, dtype=np.uint64).astype("<u8") for q in moduli]
    return struct.pack("<Q", len(rows)) + b"".join(struct.pack("<Q", n) + r.tobytes() for r in rows)


def _lattigo_key(rng, n: int, q_moduli, p_moduli) -> bytes:
    rows = -(-len(q_moduli) // len(p_moduli))
    out = struct.pack("<QQ", 0, rows)
    for _ in range(rows):
        out += struct.pack("<QQ", 1, 2)
        for _ in range(2):
            out += _lattigo_poly(rng, n, q_moduli) + _lattigo_poly(rng, n, p_moduli)
    return out


LQ, LP = (1_152_921_504_606_830_593, 1_099_511_480_321, 1_099_511_799_809), (1_152_921_504_606_904_321,)


def _key_set(rng, n: int, elements) -> bytes:
    from polyfhe.engines.lattigo.format import evaluation_key_set

    galois = {e: struct.pack("<QQ", e, 2 * n) + _lattigo_key(rng, n, LQ, LP) for e in elements}
    return b"".join(evaluation_key_set(_lattigo_key(rng, n, LQ, LP), galois))


def _poke(data: bytes, offset: int, values: bytes) -> bytes:
    out = bytearray(data)
    out[offset: offset + len(values)] = values
    return bytes(out)


def test_lattigo_evaluation_keys_are_scanned():
    from polyfhe.engines.lattigo.keybytes import KeyShape, check_evaluation_keys

    rng = np.random.default_rng(3)
    n, elements = 16, {5, 25}
    shape = KeyShape(n, len(LQ), len(LP), 2 * n, LQ, LP)
    data = _key_set(rng, n, elements)
    check_evaluation_keys(data, shape, elements, True)
    check_evaluation_keys(data, KeyShape(n, len(LQ), len(LP), 2 * n), elements, True)  # without the primes
    relin_first_row = 1 + 16 + 16 + 8 + 8  # flag, decomposition + rows, columns + pair, Q count, degree
    cases = (
        (relin_first_row, bytes(8 * n), ("the relinearisation key, row 0 column 0 component 0, Q part: every "
                                         "residue modulo prime 0 .* is 0, a zero polynomial")),
        (relin_first_row, struct.pack("<Q", 9) * n, r"is 9, a constant \(9\) polynomial"),
        (relin_first_row + 8 * (n + 1), struct.pack("<Q", LQ[1]), (rf"residue 0 modulo prime 1 \(q={LQ[1]}\) is "
                                                                   rf"{LQ[1]}, not below its prime")),
    )
    for offset, values, reason in cases:
        with pytest.raises(WireError, match=f"evaluation keys: .*{reason}"):
            check_evaluation_keys(_poke(data, offset, values), shape, elements, True)
    # a Galois key's random part zeroed past its first 64 bytes (the last key's second component)
    key = len(data) - (8 + 8 * n) * (len(LQ) + len(LP)) - 16  # the last component's start, past its counts
    zeroed = _poke(data, key + 8 + 8 + 64, bytes(8 * n - 64))
    for row in (1, 2):
        zeroed = _poke(zeroed, key + 8 + row * (8 + 8 * n) + 8, bytes(8 * n))
    with pytest.raises(WireError, match="the Galois key of element 25, row 2 column 0 component 1, Q part: every "
                                        "residue modulo prime 1"):
        check_evaluation_keys(zeroed, shape, elements, True)


def _boot_keys(rng, n: int, galois_elements) -> bytes:
    out = b"".join(b"\x00" for _ in range(4))  # no ring switching, no real/complex switching
    out += b"\x01" + _lattigo_key(rng, n, LQ[:1], LP)  # dense->sparse: one prime each
    out += b"\x01" + _lattigo_key(rng, n, LQ, LP)  # sparse->dense
    out += b"\x01\x01" + _lattigo_key(rng, n, LQ, LP)  # the key set: relinearisation
    out += b"\x01" + struct.pack("<I", len(galois_elements))
    for e in galois_elements:
        out += struct.pack("<QQQ", e, e, 2 * n) + _lattigo_key(rng, n, LQ, LP)
    return out


def test_lattigo_bootstrapping_keys_are_walked_against_their_shape():
    from polyfhe.engines.lattigo.keybytes import BootKeyShape, check_bootstrap_keys

    rng = np.random.default_rng(4)
    n, elements = 16, (5, 25, 31)
    full = (len(LQ), len(LP))
    shape = BootKeyShape(n, (None, None, None, None, (1, 1), full), full, full, 3, elements, LQ, LP)
    data = _boot_keys(rng, n, elements)
    found = check_bootstrap_keys(data, shape)
    assert [name for name, _ in found] == ["dense->sparse", "sparse->dense", "relinearisation", "galois 5",
                                           "galois 25", "galois 31"]
    check_bootstrap_keys(data)  # without a shape: walked and scanned all the same
    wrong = (
        (BootKeyShape(n, (None,) * 4 + (full, full), full, full, 3), "the dense->sparse key is on N=16 with 1\\+1"),
        (BootKeyShape(n, (None,) * 6, full, full, 3), "the dense->sparse key is present"),
        (BootKeyShape(2 * n, (None,) * 4 + ((1, 1), full), full, full, 3), "imply N=32"),
        (BootKeyShape(n, (None,) * 4 + ((1, 1), full), full, full, 4), "hold 3 Galois keys; .* imply 4"),
        (BootKeyShape(n, (None,) * 4 + ((1, 1), full), None, full, 3), "relinearisation key is present"),
        (BootKeyShape(n, (None,) * 4 + ((1, 1), full), full, full, 3, (5, 25, 29)), "element 31; .* imply 29"),
    )
    for bad_shape, reason in wrong:
        with pytest.raises(WireError, match=reason):
            check_bootstrap_keys(data, bad_shape)
    last_row = len(data) - 8 * n  # the last Galois key's last P row: its residues
    for values, reason in ((bytes(8 * n), "every residue modulo prime 0 .* is 0, a zero polynomial"),
                           (struct.pack("<Q", 1 << 61), ".*not below the engine's prime bound 2\\^61")):
        with pytest.raises(WireError, match=f"the Galois key of element 31, row 2 column 0 component 1, P part: "
                                            f"{reason}"):
            check_bootstrap_keys(_poke(data, last_row, values))
    unsorted = _boot_keys(rng, n, (25, 5))
    with pytest.raises(WireError, match="sorted"):
        check_bootstrap_keys(unsorted)


def test_lattigo_ciphertexts_are_scanned():
    from polyfhe.engines.lattigo.keybytes import METADATA_BYTES, check_ciphertext

    rng = np.random.default_rng(5)
    n = 16
    body = b"\x01" + bytes(METADATA_BYTES) + struct.pack("<Q", 2)
    comps = [_lattigo_poly(rng, n, LQ[:2]) for _ in range(2)]
    check_ciphertext(body + comps[0] + comps[1], n, {2}, moduli=LQ)
    transparent = comps[1][:8] + struct.pack("<Q", n) + bytes(8 * n) + comps[1][16 + 8 * n:]
    with pytest.raises(WireError, match="second component: every residue modulo prime 0 .* transparent"):
        check_ciphertext(body + comps[0] + transparent, n, {2})
    over = _poke(comps[0], 16, struct.pack("<Q", LQ[0]))
    with pytest.raises(WireError, match="first component: residue 0 modulo prime 0 .* not below its prime"):
        check_ciphertext(body + over + comps[1], n, {2}, moduli=LQ)


# ------------------------------------------------------------------------------------------------------------
# the bootstrapping-key child: stderr drained while stdout is read
# ------------------------------------------------------------------------------------------------------------
_NOISY_CHILD = textwrap.dedent("""
    import struct, sys
    def part():
        (n,) = struct.unpack("<Q", sys.stdin.buffer.read(8))
        return sys.stdin.buffer.read(n)
    part(); part()
    sys.stderr.buffer.write(b"go: noisy line\\n" * 200_000)  # 3 MB: far past a pipe's buffer
    sys.stderr.flush()
    if len(sys.argv) > 1:
        sys.exit(3)
    keys = b"K" * 1000
    sys.stdout.buffer.write(struct.pack("<Q", len(keys)) + keys)
""")


def _in_thread(fn, timeout: float = 60.0):
    import threading

    box = {}

    def run():
        try:
            box["value"] = fn()
        except Exception as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "the parent blocked: the child's stderr was not drained while stdout was read"
    return box


def test_a_child_that_floods_stderr_before_its_keys_does_not_deadlock():
    from polyfhe.engines.lattigo.bootkeys import generate_in_child

    box = _in_thread(lambda: generate_in_child({}, {}, b"secret", 1, 1 << 20,
                                               command=[sys.executable, "-c", _NOISY_CHILD]))
    assert bytes(box["value"]) == b"K" * 1000


def test_a_failing_child_reports_its_last_words():
    from polyfhe.engines.lattigo.bootkeys import generate_in_child

    box = _in_thread(lambda: generate_in_child({}, {}, b"secret", 1, 1 << 20,
                                               command=[sys.executable, "-c", _NOISY_CHILD, "fail"]))
    message = str(box["error"])
    assert "exit status 3" in message and "go: noisy line" in message


# ------------------------------------------------------------------------------------------------------------
# Concrete workers: a fixed address-space limit and size checks before anything is sent (no Concrete needed:
# the worker script runs under this interpreter and answers `limits` without importing Concrete ML)
# ------------------------------------------------------------------------------------------------------------
class _ThisPython:
    python = sys.executable


def test_a_worker_runs_under_its_address_space_limit():
    from polyfhe.engines.concrete.worker import DEFAULT_ADDRESS_SPACE_BYTES, Worker

    worker = Worker("server", env=_ThisPython(), address_space_bytes=3 << 30)
    try:
        reply, _ = worker.call("limits")
        assert reply["address_space"] == [3 << 30, 3 << 30]
    finally:
        worker.close()
    assert Worker("server", env=_ThisPython()).address_space_bytes == DEFAULT_ADDRESS_SPACE_BYTES
    with pytest.raises(ValueError, match="positive"):
        Worker("server", env=_ThisPython(), address_space_bytes=0)


def test_the_limit_stops_an_allocation_past_it():
    import subprocess

    from polyfhe.engines.concrete.worker import WORKER_SCRIPT

    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(WORKER_SCRIPT.parent)!r})
        import worker_main
        assert worker_main.address_space_argument(["--address-space", "1073741824"]) == 1 << 30
        assert worker_main.address_space_argument([]) is None
        worker_main.limit_address_space(1 << 30)
        try:
            bytearray(2 << 30)
        except MemoryError:
            print("refused")
    """)
    out = subprocess.run([sys.executable, "-I", "-c", script], check=False, capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "refused", out.stderr


def test_blobs_over_their_limit_are_refused_before_they_are_sent():
    from polyfhe.engines.concrete.worker import PARSE_LIMITS, ConcreteInputTooLarge, Worker, check_blob_sizes

    keys_limit = PARSE_LIMITS["server_keys"][0][0]
    check_blob_sizes("server_keys", [b"k" * 1000])

    class Huge(bytes):  # a length without the bytes
        def __len__(self):
            return keys_limit + 1

    with pytest.raises(ConcreteInputTooLarge, match=rf"evaluation keys sent to the .* is {keys_limit + 1} bytes, "
                                                    rf"over the limit of {keys_limit} bytes"):
        check_blob_sizes("server_keys", [Huge()])
    worker = Worker("server", env=_ThisPython(), parse_limits={"server_run": {0: (100, "ciphertext")}})
    with pytest.raises(ConcreteInputTooLarge, match="the ciphertext sent to the Concrete ML server worker for "
                                                    "'server_run' is 101 bytes, over the limit of 100 bytes"):
        worker.call("server_run", {}, [b"c" * 101])
    assert worker._proc is None  # nothing started, nothing sent
