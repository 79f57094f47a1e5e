"""SEAL kernels through ctypes (no GIL), and polyfhe's own dot kernel: byte-identical to TenSEAL's bindings,
refused preconditions fall back, and a server computes the same bytes either way."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

import polyfhe
from polyfhe.fhe.params import CKKSParams
from polyfhe.fhe.plaintexts import PlaintextKey
from polyfhe.fhe.program import CKKSProgram
from polyfhe.fhe.seal_backend import SealContext, SealOps
from polyfhe.fhe.seal_native import (
    CT_DATA_OFFSET,
    NATIVE_ENV,
    _kernels,
    _largest_residues,
    _library,
    bound_dot,
    dot_available,
    dot_self_test,
    native_kernels,
    residues,
    self_test,
)

pytestmark = pytest.mark.fhe


@pytest.fixture(scope="module")
def ring():
    """(seal, native kernels, Galois keys for steps 1, 5, -7, a fresh ciphertext, its values)."""
    seal = SealContext(CKKSParams(8192, (50, 30, 30, 30, 50), 30, security="none"))
    sa = seal.sa
    keygen = sa.KeyGenerator(seal.context)
    public = sa.PublicKey()
    keygen.create_public_key(public)
    tool = seal.context.key_context_data().galois_tool()
    galois = sa.GaloisKeys()
    keygen.create_galois_keys([tool.get_elt_from_step(s) for s in (1, 5, -7)], galois)
    values = np.random.default_rng(1).uniform(-1, 1, seal.slots)
    ct = sa.Ciphertext()
    sa.Encryptor(seal.context, public).encrypt(seal.encode(values, seal.parms_id_at(0), seal.params.scale), ct)
    native = native_kernels(seal)
    assert native is not None, "the native SEAL kernels are off on the pinned TenSEAL build"
    return seal, native, galois, ct


def _same(seal, a, b) -> bool:
    return seal.dump(a) == seal.dump(b) and a.scale == b.scale


def test_the_self_test_passes_on_the_pinned_tenseal():
    library = _library()
    assert library is not None
    assert self_test(library) is None


@pytest.mark.parametrize("level", [0, 1, 2])
def test_every_kernel_matches_the_bindings_byte_for_byte(ring, level):
    seal, native, galois, fresh = ring
    sa, ev = seal.sa, seal.evaluator
    ct = sa.Ciphertext()
    if level:
        ev.mod_switch_to(fresh, seal.parms_id_at(level), ct)
    else:
        ev.add(fresh, fresh, ct)
    pt = seal.encode(np.linspace(-1, 1, seal.slots), ct.parms_id(), seal.params.scale)

    assert _same(seal, native.copy(ct), ct)
    want = sa.Ciphertext()
    ev.multiply_plain(ct, pt, want)
    assert _same(seal, native.multiply_plain(ct, pt), want)
    want = sa.Ciphertext()
    ev.add(ct, ct, want)
    got = native.copy(ct)
    assert native.add_inplace(got, ct) and _same(seal, got, want)
    for step in (1, 5, -7):
        want = sa.Ciphertext()
        ev.rotate_vector(ct, step, galois, want)
        assert _same(seal, native.rotate(ct, step, galois, has_key=True), want)
    assert _same(seal, ct, ct)  # inputs untouched: every kernel writes a copy


def test_what_seal_would_refuse_is_left_to_the_bindings(ring):
    seal, native, galois, ct = ring
    sa, ev = seal.sa, seal.evaluator
    low = sa.Ciphertext()
    ev.mod_switch_to(ct, seal.parms_id_at(1), low)
    other_level = seal.encode(np.ones(4), seal.parms_id_at(1), seal.params.scale)
    assert native.multiply_plain(ct, other_level) is None  # parameters differ
    huge = seal.encode(np.ones(4), ct.parms_id(), 2.0**115)  # 30 + 115 bits: over the 140-bit modulus
    assert native.multiply_plain(ct, huge) is None  # the product's scale would exceed the modulus
    assert not native.add_inplace(native.copy(ct), low)  # levels differ
    rescaled = native.multiply_plain(ct, seal.encode(np.ones(4), ct.parms_id(), seal.params.scale))
    assert not native.add_inplace(rescaled, ct)  # scales differ
    assert native.rotate(ct, 3, galois, has_key=False) is None  # no key of its own: SEAL would compose or throw
    three = sa.Ciphertext()
    ev.multiply(ct, ct, three)
    assert native.rotate(three, 1, galois, has_key=True) is None  # size 3: not relinearised


def test_the_dot_kernel_is_built_and_passes_its_self_test():
    """The install builds ``_kernels.c`` (scripts/setup.sh); a build without it would silently lose the kernel."""
    assert dot_available(), "polyfhe/fhe/_kernels.c was not built: pip install -e . where a C compiler is present"
    assert dot_self_test(_library(), _kernels()) is None


def _encrypted(seal, ring_public, level: int, rng):
    sa = seal.sa
    ct = sa.Ciphertext()
    sa.Encryptor(seal.context, ring_public).encrypt(
        seal.encode(rng.uniform(-1, 1, seal.slots), seal.parms_id_at(level), seal.params.scale), ct)
    return ct


@pytest.fixture(scope="module")
def public_key(ring):
    seal = ring[0]
    # a second key pair on the same ring: the kernels never look at keys, only at residues
    keygen = seal.sa.KeyGenerator(seal.context)
    public = seal.sa.PublicKey()
    keygen.create_public_key(public)
    return public


@pytest.mark.parametrize("level, terms", [(0, 1), (0, 7), (1, 64), (2, 3)])
def test_the_dot_kernel_matches_products_and_sums_byte_for_byte(ring, public_key, level, terms):
    seal, native, _, _ = ring
    rng = np.random.default_rng(level * 100 + terms)
    cts = [_encrypted(seal, public_key, level, rng) for _ in range(terms)]
    pts = [seal.encode(rng.uniform(-2, 2, seal.slots), cts[0].parms_id(), 2.0**29) for _ in range(terms)]
    want = bound_dot(seal, cts, pts)
    before = [seal.dump(ct) for ct in cts]
    got = native.dot(cts, pts)
    assert got is not None and _same(seal, got, want)
    assert [seal.dump(ct) for ct in cts] == before  # inputs untouched


def test_the_dot_kernel_is_exact_at_the_largest_sums_it_accepts():
    """The most terms a pass takes, 60-bit primes and every residue q - 1: each product is (q - 1)^2 and the 128-bit
    sum comes within 2^8 of overflowing; its reduction must still equal SEAL's, residue for residue."""
    seal = SealContext(CKKSParams(2048, (60, 60, 60), 30, security="none"))
    native = native_kernels(seal)
    keygen = seal.sa.KeyGenerator(seal.context)
    public = seal.sa.PublicKey()
    keygen.create_public_key(public)
    ct = _encrypted(seal, public, 0, np.random.default_rng(5))
    pt = seal.encode(np.ones(4), ct.parms_id(), 2.0**30)
    moduli = [m.value() for m in seal.context.get_context_data(ct.parms_id()).parms().coeff_modulus()]
    assert len(moduli) == 2 and min(moduli) > 2**59
    _largest_residues(seal, ct, pt)
    terms = native.dot_terms
    got = native.dot([ct] * terms, [pt] * terms)
    assert got is not None and _same(seal, got, bound_dot(seal, [ct] * terms, [pt] * terms))
    # (q - 1)^2 = 1 mod q: every residue of the sum is the number of terms
    assert (residues(got, CT_DATA_OFFSET, 2 * len(moduli) * 2048) == terms).all()


def test_the_dot_kernel_declines_what_seal_would_refuse(ring, public_key):
    seal, native, _, ct = ring
    sa, ev = seal.sa, seal.evaluator
    rng = np.random.default_rng(3)
    other = _encrypted(seal, public_key, 0, rng)
    pt = seal.encode(np.ones(4), ct.parms_id(), seal.params.scale)
    low = sa.Ciphertext()
    ev.mod_switch_to(ct, seal.parms_id_at(1), low)
    assert native.dot([], []) is None
    assert native.dot([ct, other], [pt]) is None  # lengths differ
    assert native.dot([ct] * (native.dot_terms + 1), [pt] * (native.dot_terms + 1)) is None  # too many terms
    assert native.dot([ct, low], [pt, pt]) is None  # levels differ
    assert native.dot([ct, other], [pt, seal.encode(np.ones(4), ct.parms_id(), 2.0**20)]) is None  # two scales
    assert native.dot([ct], [seal.encode(np.ones(4), ct.parms_id(), 2.0**115)]) is None  # over the modulus
    three = sa.Ciphertext()
    ev.multiply(ct, ct, three)
    assert native.dot([three], [pt]) is None  # size 3: not relinearised


def test_sealops_dot_chunks_long_sums_and_counts_every_product(ring, public_key):
    seal, _, galois, _ = ring
    rng = np.random.default_rng(4)
    cts = [_encrypted(seal, public_key, 0, rng) for _ in range(10)]
    vecs = [rng.uniform(-1, 1, 16) for _ in cts]
    terms = [(ct, vec, PlaintextKey.diagonal(7, 0, i)) for i, (ct, vec) in enumerate(zip(cts, vecs, strict=True))]
    ops = SealOps(seal, None, galois)
    loose = SealOps(seal, None, galois)
    loose.native = None  # product by product through the bindings
    ops.native.dot_terms = 4  # three passes: 4 + 4 + 2 terms
    got, want = ops.dot(terms), loose.dot(terms)
    assert _same(seal, got, want)
    assert ops.counts["plain_products"] == loose.counts["plain_products"] == 10
    assert ops.counts["encodes"] == 10


class _Square(nn.Module):
    def forward(self, x):
        return x * x


def test_a_server_computes_the_same_bytes_with_and_without_native_kernels():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), _Square(), nn.Linear(16, 4)).eval()
    x = np.random.default_rng(0).random((8, 1, 8, 8))
    program = polyfhe.export(model, target="ckks", calibration=x, input_shape=(1, 8, 8))
    client = program.client()
    context, query = client.public_context(), client.encrypt(x[:4])
    answers = []
    for native in (True, False):
        fresh = CKKSProgram.create(dataclasses.replace(program.manifest), program.arrays)  # its own plaintexts
        server = fresh.server(context)
        if native:
            assert server._ops.native is not None
        else:
            server._ops.native = None
        answers.append(server.run(query))
        assert server.last_run.counts["rotations"] > 0 and server.last_run.counts["plain_products"] > 0
    assert answers[0] == answers[1]
    assert np.abs(client.decrypt(answers[0]) - program.run_plain(x[:4])).max() < 1e-3


def test_the_environment_switch_turns_the_native_path_off():
    code = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout);"
            "from polyfhe.fhe.seal_native import _library; print('library', _library())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, NATIVE_ENV: "0"}).stdout
    assert "library None" in out and f"{NATIVE_ENV}=0" in out
