"""The web page's client (``static/fheclient.js`` on node-seal 7.0.0, SEAL 4.1.2 in WebAssembly) against polyfhe's
SEAL 4.3 engine, under Node 22: public contexts, Galois and relinearisation keys, secret and public keys and
ciphertexts cross in both directions, the page packs inputs exactly as the Python client does, and logits
decrypted by the page match the Python client's within CKKS noise."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from nodelib import run_page_client
from serve_testlib import TINY

from polyfhe.engines.seal.client import CKKSClient
from polyfhe.engines.seal.context import SealContext
from polyfhe.engines.seal.dialect import to_version
from polyfhe.engines.seal.server import CKKSServer
from polyfhe.program.boundary import pack_result
from polyfhe.program.slot_layout import pack_single
from polyfhe.program.wire import KIND_CIPHERTEXT, KIND_CONTEXT, unpack
from polyfhe.serve.clientspec import client_spec
from polyfhe.serve.registry import Model

NODE_SEAL = (4, 1)


def _version(seal_object) -> tuple[int, int]:
    magic, size, major, minor = struct.unpack_from("<HBBB", bytes(seal_object[:5]))
    assert magic == 0xA15E and size == 16
    return major, minor


@pytest.fixture(scope="module")
def page(programs, samples, tmp_path_factory):
    """A folder where the page's client made keys for ``tiny`` and encrypted the eight samples."""
    folder = tmp_path_factory.mktemp("page")
    program = programs[TINY]
    (folder / "spec.json").write_text(json.dumps(client_spec(Model(TINY, program))))
    x, _plain = samples
    (folder / "inputs.json").write_text(json.dumps(x.reshape(len(x), -1).tolist()))
    run_page_client("keys", folder)
    run_page_client("encrypt", folder)
    return folder


def test_page_context_loads_on_the_server_and_answers_decrypt_in_the_page(programs, samples, page):
    program = programs[TINY]
    x, plain = samples
    context = (page / "context.bin").read_bytes()
    box = unpack(context, KIND_CONTEXT)
    assert set(box.sections) == {"public_key", "relin_keys", "galois_keys"}
    assert {_version(s) for s in box.sections.values()} == {NODE_SEAL}  # node-seal's own format, not rewritten
    server = CKKSServer(program, context)
    for i in range(len(x)):
        query = (page / f"query_{i}.bin").read_bytes()
        assert _version(unpack(query, KIND_CIPHERTEXT).sections["ct0"]) == NODE_SEAL
        answer = server.run(query)
        assert {_version(s) for s in unpack(answer, KIND_CIPHERTEXT).sections.values()} == {NODE_SEAL}
        (page / f"answer_{i}.bin").write_bytes(answer)
    run_page_client("decrypt", page)
    page_logits = np.array(json.loads((page / "logits.json").read_text()))

    python = CKKSClient(program.manifest)  # the Python client on the same inputs, through its own session
    python_server = CKKSServer(program, python.public_context())
    python_logits = np.concatenate([python.decrypt(python_server.run(python.encrypt(x[i:i + 1])))
                                    for i in range(len(x))])
    noise = max(float(np.abs(python_logits - plain).max()), 1e-6)
    assert page_logits.shape == plain.shape
    assert np.abs(page_logits - plain).max() <= 20 * noise + 1e-4, (page_logits, plain)
    assert np.abs(page_logits - python_logits).max() <= 40 * noise + 1e-4
    assert (page_logits.argmax(1) == plain.argmax(1)).all()


def test_page_packs_inputs_exactly_as_the_python_client(programs, samples, page):
    x, _ = samples
    manifest = programs[TINY].manifest
    for i in range(len(x)):
        packed = np.fromfile(page / f"packed_{i}.bin", dtype="<f8")
        np.testing.assert_array_equal(packed, pack_single(manifest, x[i].reshape(1, -1)))


def test_keys_and_ciphertexts_cross_both_ways(programs, samples, page):
    """Python reads the page's secret key and ciphertexts; the page decrypts what Python encrypted with its public key."""
    program = programs[TINY]
    m = program.manifest
    seal = SealContext(program.params)
    secret = seal.load("secret_key", (page / "secret.bin").read_bytes())  # node-seal 4.1 bytes, read by SEAL 4.3
    public = seal.load("public_key", unpack((page / "context.bin").read_bytes(), KIND_CONTEXT).sections["public_key"])
    decryptor = seal.sa.Decryptor(seal.context, secret)
    x, _ = samples
    ct = seal.load("ciphertext", unpack((page / "query_0.bin").read_bytes(), KIND_CIPHERTEXT).sections["ct0"])
    pt = seal.sa.Plaintext()
    decryptor.decrypt(ct, pt)
    np.testing.assert_allclose(np.asarray(seal.encoder.decode_double(pt)), pack_single(m, x[0].reshape(1, -1)), atol=1e-4)

    rng = np.random.default_rng(7)
    values = rng.uniform(-2, 2, m.params.slots)
    encryptor = seal.sa.Encryptor(seal.context, public)
    out = seal.sa.Ciphertext()
    encryptor.encrypt(seal.encode(values, seal.context.first_parms_id(), m.params.scale), out)
    folder = page / "reverse"
    folder.mkdir()
    for name in ("spec.json", "secret.bin"):
        (folder / name).write_bytes((page / name).read_bytes())
    (folder / "answer_0.bin").write_bytes(pack_result(program, [to_version(seal.dump(out), NODE_SEAL)], 1))
    run_page_client("decrypt", folder)
    got = np.array(json.loads((folder / "logits.json").read_text()))[0]
    lanes = m.samples_per_ciphertext
    np.testing.assert_allclose(got, values[np.array(m.output_slots) * lanes], atol=1e-4)


@pytest.mark.parametrize("damage", ["prng type", "seed info size", "seed header version", "half dropped"])
def test_damaged_seeded_keys_are_refused_before_seal_reads_them(programs, page, damage):
    """The page's public key is seeded; its seed information is checked like every other byte of a key."""
    from polyfhe.engines.seal.sealbytes import CT_MEMBERS, DYNARRAY_PREFIX, HEADER, SerializationError

    program = programs[TINY]
    seal = SealContext(program.params)
    key = bytearray(unpack((page / "context.bin").read_bytes(), KIND_CONTEXT).sections["public_key"])
    seal.load("public_key", bytes(key))  # intact: loads
    primes = len(program.params.coeff_mod_bits)
    info = HEADER.size + CT_MEMBERS + DYNARRAY_PREFIX + program.params.poly_modulus_degree * primes * 8
    if damage == "prng type":
        key[info + HEADER.size] = 7
    elif damage == "seed info size":
        key[info + 8] += 1
    elif damage == "seed header version":
        key[info + 4] = 3  # 4.3 inside a 4.1 object
    else:
        key = key[:info - 8] + key[info:]
        key[8:16] = struct.pack("<Q", len(key))
    with pytest.raises(SerializationError):
        seal.load("public_key", bytes(key))
