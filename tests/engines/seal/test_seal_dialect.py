"""SEAL format versions at the boundary (polyfhe.engines.seal.dialect): a client in SEAL 4.1 (node-seal 7) is
served in 4.1, a mix of versions is refused, any other version is refused before inflating, and a client in our
own version gets exactly the bytes it got before.

The "4.1" objects are the Python client's own, inflated, with every SEAL header (found by walking each object's
layout, here, apart from the decoder's walk) set to 4.1: the wire format of these objects is the same in SEAL
4.1 and 4.3 (shared/specs/ckks.md, section 4), so they are what node-seal 7 sends.
"""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
import zstandard
from ckks_testlib import export_square_mlp

import polyfhe.engines.seal.context as seal_context
import polyfhe.engines.seal.server as seal_server
from polyfhe.engines.seal import dialect
from polyfhe.engines.seal.sealbytes import CT_MEMBERS, HEADER, MAGIC, PLAINTEXT_MEMBERS, SerializationError
from polyfhe.program.boundary import galois_element
from polyfhe.program.wire import KIND_CIPHERTEXT, KIND_CONTEXT, WireError, pack, unpack

pytestmark = pytest.mark.fhe

OURS, NODE_SEAL = (4, 3), (4, 1)
KEYS = ("public_key", "relin_keys", "galois_keys")
U64 = struct.Struct("<Q")
VERSION = 3  # a SEAL header: magic (u16), header size (u8), major (u8), minor (u8), ...


# ------------------------------------------------------------------------------------------------------------
# SEAL objects in another version, made by walking their layout
# ------------------------------------------------------------------------------------------------------------
def inflated(section) -> bytearray:
    """A SEAL object uncompressed (its header says compression none)."""
    data = bytes(section)
    magic, size, major, minor, compression, _, total = HEADER.unpack_from(data)
    assert magic == MAGIC and total == len(data) and compression in (0, 2)
    body = data[HEADER.size:] if compression == 0 else zstandard.ZstdDecompressor().stream_reader(
        data[HEADER.size:]).read()
    return bytearray(HEADER.pack(MAGIC, size, major, minor, 0, 0, HEADER.size + len(body)) + body)


def header_offsets(obj: bytes | bytearray, kind: str) -> list[int]:
    """Offsets of every SEAL header of an uncompressed object, the outer one first: a ciphertext or public key
    has its data's (a DynArray's) after its members, a secret key (a plaintext) likewise; a key-switching key set
    holds rows of public keys, each with its own header and its data's."""
    if kind in ("ciphertext", "public_key"):
        offsets = [0, HEADER.size + CT_MEMBERS]
    elif kind == "secret_key":
        offsets = [0, HEADER.size + PLAINTEXT_MEMBERS]
    else:
        offsets, pos = [0], HEADER.size + 32  # parms_id
        (rows,), pos = U64.unpack_from(obj, pos), pos + 8
        for _ in range(rows):
            (count,), pos = U64.unpack_from(obj, pos), pos + 8
            for _ in range(count):
                offsets += [pos, pos + HEADER.size + CT_MEMBERS]
                pos += HEADER.unpack_from(obj, pos)[6]  # the key's size, its header included
        assert pos == len(obj), "walked past or short of the object's end"
    for offset in offsets:
        assert HEADER.unpack_from(obj, offset)[:2] == (MAGIC, HEADER.size), f"no SEAL header at byte {offset}"
    return offsets


def versions(section, kind: str) -> list[tuple[int, int]]:
    obj = inflated(section)
    return [HEADER.unpack_from(obj, offset)[2:4] for offset in header_offsets(obj, kind)]


def in_version(section, kind: str, version=NODE_SEAL, *, compress: bool = False, keep: int | None = None) -> bytes:
    """``section`` with every header set to ``version`` except the ``keep``-th (outer header: 0); zstd-compressed
    again (as node-seal saves by default) when ``compress``."""
    obj = inflated(section)
    for i, offset in enumerate(header_offsets(obj, kind)):
        if i != keep:
            obj[offset + VERSION: offset + VERSION + 2] = bytes(version)
    if not compress:
        return bytes(obj)
    frame = zstandard.ZstdCompressor(level=1).compress(bytes(obj[HEADER.size:]))
    major, minor = HEADER.unpack_from(obj)[2:4]
    return HEADER.pack(MAGIC, HEADER.size, major, minor, 2, 0, HEADER.size + len(frame)) + frame


def with_header_version(section, version) -> bytes:
    data = bytearray(section)
    data[VERSION: VERSION + 2] = bytes(version)
    return bytes(data)


def context_in(context: bytes, version=NODE_SEAL, **versions_by_kind) -> bytes:
    box = unpack(context, KIND_CONTEXT)
    sections = {k: in_version(v, k, versions_by_kind.get(k, version), compress=True) for k, v in box.sections.items()}
    return pack(KIND_CONTEXT, box.header, sections)


def query_in(query: bytes, version=NODE_SEAL, **kwargs) -> bytes:
    box = unpack(query, KIND_CIPHERTEXT)
    sections = {k: in_version(v, "ciphertext", version, **kwargs) for k, v in box.sections.items()}
    return pack(KIND_CIPHERTEXT, box.header, sections)


def galois_elements(program) -> set[int]:
    n = program.params.poly_modulus_degree
    return {galois_element(step, n) for step in program.manifest.galois_steps}


def every_kind(client, context: bytes, query: bytes) -> dict:
    """One section of each kind the decoder loads, as the Python client made it (SEAL 4.3, zstd)."""
    return {**unpack(context, KIND_CONTEXT).sections, "ciphertext": unpack(query, KIND_CIPHERTEXT).sections["ct0"],
            "secret_key": unpack(client.secret_context(), b"S").sections["secret_key"]}


@pytest.fixture(scope="module")
def setup():
    program = export_square_mlp(12, 4)  # N=8192, single layout, Galois keys
    assert program.manifest.galois_steps
    client = program.client()
    x = np.random.default_rng(1).random((2, 1, 8, 8))
    context, query = client.public_context(), client.encrypt(x)
    return program, client, x, context, query


def test_our_seal_writes_4_3_and_reads_node_seal_7s_4_1():
    assert dialect.LOCAL_VERSION == dialect.local_version() == OURS  # TenSEAL 0.3.18
    assert dialect.accepted_versions() == (OURS, NODE_SEAL)


# ------------------------------------------------------------------------------------------------------------
# (a) a 4.1 client is served in 4.1
# ------------------------------------------------------------------------------------------------------------
def test_every_kind_loads_in_4_1_as_the_same_object(setup):
    program, client, _, context, query = setup
    seal = client.seal
    for kind, section in every_kind(client, context, query).items():
        galois = galois_elements(program) if kind == "galois_keys" else None
        ours, version = seal.load_with_version(kind, section, galois)
        assert version == OURS
        for compress in (False, True):
            theirs, version = seal.load_with_version(kind, in_version(section, kind, compress=compress), galois)
            assert version == NODE_SEAL, kind
            assert seal.dump(theirs) == seal.dump(ours), kind  # the same object, headers back at 4.3


def test_a_4_1_client_is_served_in_4_1(setup):
    program, client, x, context, query = setup
    server = program.server(context_in(context))
    assert server.client_version == NODE_SEAL
    answer = server.run(query_in(query))
    sections = unpack(answer, KIND_CIPHERTEXT).sections
    assert sections
    for section in sections.values():
        assert set(versions(section, "ciphertext")) == {NODE_SEAL}
        assert HEADER.unpack_from(bytes(section))[2:4] == NODE_SEAL
    np.testing.assert_allclose(client.decrypt(answer), program.run_plain(x), atol=1e-3)


# ------------------------------------------------------------------------------------------------------------
# (b) one client, one version
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("context_version", "query_version"), [(NODE_SEAL, OURS), (OURS, NODE_SEAL)])
def test_a_query_in_another_version_than_its_context_is_refused(setup, context_version, query_version):
    program, _, _, context, query = setup
    server = program.server(context_in(context, context_version))
    assert server.client_version == context_version
    theirs = query_in(query, query_version)
    want = (f"the query's SEAL format {dialect.describe_version(query_version)} differs from the public "
            f"context's {dialect.describe_version(context_version)}")
    with pytest.raises(WireError, match=want):
        server.run(theirs)


@pytest.mark.parametrize("kind", ["relin_keys", "galois_keys"])
def test_a_public_context_of_two_versions_is_refused(setup, kind):
    program, _, _, context, _ = setup
    mixed = context_in(context, NODE_SEAL, **{kind: OURS})
    with pytest.raises(WireError, match=f"{kind.replace('_', ' ')} are in SEAL format 4.3, its public key in 4.1"):
        program.server(mixed)


# ------------------------------------------------------------------------------------------------------------
# (c) other versions, refused on the header
# ------------------------------------------------------------------------------------------------------------
REFUSAL = r"this server reads 4\.3 and 4\.1 \(node-seal 7\); make keys with polyfhe's client or the web page"


@pytest.mark.parametrize("version", [(4, 2), (5, 0), (4, 4), (3, 6)])
def test_other_versions_are_refused_before_inflating(setup, monkeypatch, version):
    program, client, _, context, query = setup
    section = unpack(query, KIND_CIPHERTEXT).sections["ct0"]
    message = rf"SEAL format {version[0]}\.{version[1]}: {REFUSAL}"

    def no_inflating(*args, **kwargs):
        raise AssertionError("inflated an object of a version it refuses")

    monkeypatch.setattr(seal_context, "inflate_into", no_inflating)
    with pytest.raises(SerializationError, match=message):
        client.seal.load("ciphertext", with_header_version(section, version))
    with pytest.raises(SerializationError, match=message):  # the header alone decides
        dialect.check_version(with_header_version(section, version)[:HEADER.size] + b"\xff" * 64)
    monkeypatch.undo()
    box = unpack(context, KIND_CONTEXT)
    for kind in KEYS:  # the public key's version is the client's; each other section is refused alike
        sections = {**box.sections, kind: with_header_version(box.sections[kind], version)}
        with pytest.raises(SerializationError, match=message):
            program.server(pack(KIND_CONTEXT, box.header, sections))
    server = program.server(context)
    qbox = unpack(query, KIND_CIPHERTEXT)
    with pytest.raises(SerializationError, match=message):
        server.run(pack(KIND_CIPHERTEXT, qbox.header, {"ct0": with_header_version(section, version)}))


# ------------------------------------------------------------------------------------------------------------
# (d) one object, one version
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["ciphertext", "public_key", "relin_keys", "galois_keys", "secret_key"])
@pytest.mark.parametrize(("outer", "left"), [(NODE_SEAL, OURS), (OURS, NODE_SEAL)])
def test_an_object_whose_headers_mix_versions_is_refused(setup, kind, outer, left):
    program, client, _, context, query = setup
    section = every_kind(client, context, query)[kind]
    headers = len(header_offsets(inflated(section), kind))
    keep = headers // 2 if headers > 2 else 1  # a key in the middle of a key set, or the data's header
    mixed = in_version(in_version(section, kind, left), kind, outer, keep=keep)
    assert versions(mixed, kind).count(left) == 1 and versions(mixed, kind)[0] == outer
    galois = galois_elements(program) if kind == "galois_keys" else None
    want = (rf"inner SEAL object at byte \d+ says SEAL format {left[0]}\.{left[1]}, its outer header "
            rf"{outer[0]}\.{outer[1]}")
    with pytest.raises(SerializationError, match=want):
        client.seal.load(kind, mixed, galois)


def test_rewrite_headers_refuses_an_offset_without_a_header(setup):
    _, _, _, _, query = setup
    obj = inflated(unpack(query, KIND_CIPHERTEXT).sections["ct0"])
    fd = os.memfd_create("dialect-test")
    try:
        os.pwrite(fd, bytes(obj), 0)
        with pytest.raises(SerializationError, match="bad header"):
            dialect.rewrite_headers(fd, [HEADER.size], NODE_SEAL)
        dialect.rewrite_headers(fd, header_offsets(obj, "ciphertext"), NODE_SEAL)
        assert set(versions(os.pread(fd, len(obj), 0), "ciphertext")) == {NODE_SEAL}
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------------------------
# (e) our own clients: nothing changes
# ------------------------------------------------------------------------------------------------------------
def test_a_client_in_our_version_gets_the_bytes_it_got_before(setup, monkeypatch):
    program, client, x, context, query = setup
    server = program.server(context)
    assert server.client_version == OURS
    answer = server.run(query)
    for section in unpack(answer, KIND_CIPHERTEXT).sections.values():
        assert HEADER.unpack_from(bytes(section))[2:5] == (*OURS, 2)  # zstd, as SEAL saved it
        assert set(versions(section, "ciphertext")) == {OURS}
        assert dialect.to_version(section, OURS) is section
    monkeypatch.setattr(seal_server, "to_version", lambda data, version: data)  # the server without the dialect
    assert server.run(query) == answer
    np.testing.assert_allclose(client.decrypt(answer), program.run_plain(x), atol=1e-3)
