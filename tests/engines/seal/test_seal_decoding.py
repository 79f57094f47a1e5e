"""Bounded decoding of SEAL objects (polyfhe.engines.seal.sealbytes): exact sizes, bombs refused before they inflate,
the Galois key set exactly the program's, and ciphertexts with bad scales, levels or no randomness refused."""

from __future__ import annotations

import math
import os
import struct
import zlib

import numpy as np
import pytest
import zstandard
from ckks_testlib import digits_program

from polyfhe.engines.seal.sealbytes import (
    CT_MEMBERS,
    DYNARRAY_PREFIX,
    HEADER,
    MAGIC,
    SerializationError,
    expected_bytes,
    inflate_into,
)
from polyfhe.program.boundary import galois_element
from polyfhe.program.wire import KIND_CIPHERTEXT, KIND_CONTEXT, WireError, pack, unpack

pytestmark = pytest.mark.fhe


@pytest.fixture(scope="module")
def setup():
    program, x = digits_program()
    client = program.client()
    return program, client, x


def payload(section) -> bytes:
    """The uncompressed payload of a SEAL object's bytes."""
    return zstandard.ZstdDecompressor().stream_reader(bytes(section)[HEADER.size:]).read()


def seal_object(body: bytes, compression: int = 2, declared: int | None = None) -> bytes:
    data = {0: body, 1: zlib.compress(body), 2: zstandard.ZstdCompressor(level=1).compress(body)}[compression]
    size = HEADER.size + len(data) if declared is None else declared
    return HEADER.pack(MAGIC, HEADER.size, 4, 3, compression, 0, size) + data


def with_section(container: bytes, kind: bytes, name: str, data: bytes) -> bytes:
    box = unpack(container, kind)
    return pack(kind, box.header, {**box.sections, name: data})


def test_every_object_inflates_to_exactly_its_predicted_size(setup):
    program, client, _ = setup
    seal = client.seal
    elements = {galois_element(s, program.params.poly_modulus_degree) for s in program.manifest.galois_steps}
    box = unpack(client.public_context(), KIND_CONTEXT)
    for kind in ("public_key", "relin_keys", "galois_keys"):
        assert len(payload(box.sections[kind])) == expected_bytes(seal.layout, kind, len(elements)), kind
    secret = unpack(client.secret_context(), b"S").sections["secret_key"]
    assert len(payload(secret)) == expected_bytes(seal.layout, "secret_key")
    ct = unpack(client.encrypt(np.zeros(64)), KIND_CIPHERTEXT).sections["ct0"]
    assert len(payload(ct)) == expected_bytes(seal.layout, "ciphertext")


@pytest.mark.parametrize("compression", [0, 1, 2])
def test_uncompressed_zlib_and_zstd_objects_all_load(setup, compression):
    program, client, x = setup
    box = unpack(client.encrypt(x[:1]), KIND_CIPHERTEXT)
    data = with_section(client.encrypt(x[:1]), KIND_CIPHERTEXT, "ct0",
                        seal_object(payload(box.sections["ct0"]), compression))
    server = program.server(client.public_context())
    np.testing.assert_allclose(client.decrypt(server.run(data)), program.run_plain(x[:1]), atol=1e-3)


def test_a_bomb_is_refused_after_inflating_at_most_its_cap():
    bomb = seal_object(bytes(1 << 30), 2)  # 1 GiB of zeros: about 32 KB compressed
    assert len(bomb) < 100_000
    fd = os.memfd_create("bomb-test")
    try:
        with pytest.raises(SerializationError, match="inflate.s. past 1000000 bytes"):
            inflate_into(fd, bomb, 1_000_000)
        assert os.fstat(fd).st_size <= HEADER.size + 1_000_000
    finally:
        os.close(fd)


@pytest.mark.parametrize("declared", [10, 1 << 40])
def test_a_header_whose_size_lies_is_refused(declared):
    fd = os.memfd_create("lie-test")
    try:
        with pytest.raises(SerializationError, match="truncated or padded"):
            inflate_into(fd, seal_object(b"x" * 64, 0, declared=declared), 1 << 20)
    finally:
        os.close(fd)


def test_a_bomb_context_is_refused_by_the_server(setup):
    program, client, _ = setup
    context = client.public_context()
    n = program.params.poly_modulus_degree
    rows_body = payload(unpack(context, KIND_CONTEXT).sections["galois_keys"])
    # every one of the N rows filled with (zero) keys: gigabytes once inflated, a few MB compressed
    key = rows_body[32 + 8 + 8: 32 + 8 + 8 + 8]
    assert struct.unpack("<Q", key)[0] in (0, len(program.params.coeff_mod_bits) - 1)
    layout = client.seal.layout
    filled = struct.pack("<Q", layout.decomposition) + bytes(layout.decomposition * (HEADER.size +
                                                                                    layout.public_key_bytes))
    compressor = zstandard.ZstdCompressor(level=1)
    bomb_body = compressor.compress(rows_body[:40] + filled * 64)  # 64 full rows are already far past the cap
    bomb = HEADER.pack(MAGIC, HEADER.size, 4, 3, 2, 0, HEADER.size + len(bomb_body)) + bomb_body
    with pytest.raises(SerializationError, match="galois keys inflate.s. past"):
        program.server(with_section(context, KIND_CONTEXT, "galois_keys", bomb))
    assert n == layout.n


def test_the_galois_key_set_must_be_exactly_the_programs(setup):
    program, client, _ = setup
    seal, n = client.seal, program.params.poly_modulus_degree
    steps = list(program.manifest.galois_steps)
    assert len(steps) >= 2
    sa = seal.sa
    keygen = sa.KeyGenerator(seal.context, client._secret_key)
    extra = galois_element(3, n) if 3 not in steps else galois_element(5, n)
    cases = (([galois_element(s, n) for s in steps[:-1]], r"about 10 key\(s\)\); this program needs exactly 11"),
             ([galois_element(s, n) for s in steps] + [extra], r"galois keys inflate\(s\) past"))
    for elements, reason in cases:
        keys = sa.GaloisKeys()
        keygen.create_galois_keys(sorted(set(elements)), keys)
        context = with_section(client.public_context(), KIND_CONTEXT, "galois_keys", seal.dump(keys))
        with pytest.raises(SerializationError, match=reason):
            program.server(context)


def _patched_ciphertext(client, x, patch) -> bytes:
    data = client.encrypt(x)
    box = unpack(data, KIND_CIPHERTEXT)
    body = bytearray(payload(box.sections["ct0"]))
    patch(body)
    return with_section(data, KIND_CIPHERTEXT, "ct0", seal_object(bytes(body)))


@pytest.mark.parametrize("scale", [math.nan, math.inf, -1.0, 0.0])
def test_a_ciphertext_with_a_bad_scale_is_refused_before_seal_parses_it(setup, scale):
    program, client, x = setup
    data = _patched_ciphertext(client, x[:1], lambda b: struct.pack_into("<d", b, 32 + 1 + 24, scale))
    server = program.server(client.public_context())
    with pytest.raises(SerializationError, match="scale must be finite and positive"):
        server.run(data)


def test_a_transparent_ciphertext_is_refused_before_evaluation(setup):
    program, client, x = setup
    half = expected_bytes(client.seal.layout, "ciphertext") - CT_MEMBERS - DYNARRAY_PREFIX
    start = CT_MEMBERS + DYNARRAY_PREFIX + half // 2

    def zero_second_component(body):
        body[start:] = bytes(len(body) - start)

    data = _patched_ciphertext(client, x[:1], zero_second_component)
    server = program.server(client.public_context())
    with pytest.raises((WireError, SerializationError), match="transparent"):
        server.run(data)


def test_a_ciphertext_at_another_level_or_size_is_refused(setup):
    program, client, x = setup
    seal = client.seal
    data = client.encrypt(x[:1])
    ct = seal.load("ciphertext", unpack(data, KIND_CIPHERTEXT).sections["ct0"])
    seal.evaluator.mod_switch_to_next_inplace(ct)
    lower = with_section(data, KIND_CIPHERTEXT, "ct0", seal.dump(ct))
    server = program.server(client.public_context())
    with pytest.raises(WireError, match="fresh"):
        server.run(lower)
    three = _patched_ciphertext(client, x[:1], lambda b: struct.pack_into("<Q", b, 33, 3))
    with pytest.raises(SerializationError, match="3 components"):
        server.run(three)
