"""SEAL kernels through ctypes (no GIL): byte-identical to TenSEAL's bindings, refused preconditions fall back,
and a server computes the same bytes either way."""

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
from polyfhe.fhe.program import CKKSProgram
from polyfhe.fhe.seal_backend import SealContext
from polyfhe.fhe.seal_native import NATIVE_ENV, _library, native_kernels, self_test

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
