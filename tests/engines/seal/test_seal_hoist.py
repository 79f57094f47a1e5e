"""Hoisted rotations: SEAL's NTT and Galois permutation rebuilt, SEAL's bytes in SEAL's order, the same values
in the hoisted order, refusals, and whole programs that decrypt alike with and without hoisting."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from torch import nn

import polyfhe
from polyfhe.engines.seal import hoist
from polyfhe.engines.seal.errors import SealCallError
from polyfhe.engines.seal.native import CT_DATA_OFFSET, _throwaway_ring, native_kernels, residues
from polyfhe.engines.seal.ops import SealOps
from polyfhe.program.params import CKKSParams
from polyfhe.runtime import execute as ex

pytestmark = pytest.mark.fhe

needs_kernel = pytest.mark.skipif(not hoist.hoisting_available(),
                                  reason="hoisting is off here (built without polyfhe/engines/seal/_hoist.c)")


def _ring(bits=(60, 40, 40, 60), n=4096, steps=(1, 7, -5, 300)):
    seal, keygen, public = _throwaway_ring(CKKSParams(n, bits, 40, "none"))
    tool = seal.context.key_context_data().galois_tool()
    galois = seal.sa.GaloisKeys()
    keygen.create_galois_keys([tool.get_elt_from_step(s) for s in steps], galois)
    return seal, keygen, public, galois, steps


def _encrypt(seal, public, values, level):
    ct = seal.sa.Ciphertext()
    seal.sa.Encryptor(seal.context, public).encrypt(seal.encode(values, seal.parms_id_at(level), 2.0**40), ct)
    return ct


def _decrypt(seal, keygen, ct):
    plain = seal.sa.Plaintext()
    seal.sa.Decryptor(seal.context, keygen.secret_key()).decrypt(ct, plain)
    return np.asarray(seal.encoder.decode_double(plain))


def test_ntt_tables_are_seals():
    """SEAL's NTT form of a ciphertext's residues is their negacyclic evaluation at psi^(2 bitrev(i) + 1), psi
    the rebuilt tables' root: checked by direct evaluation on a small ring."""
    seal, _, public, _, _ = _ring(bits=(40, 30, 40), n=1024, steps=(1,))
    q = seal.context.first_context_data().parms().coeff_modulus()[0].value()
    forward, inverse = hoist.seal_ntt_tables(1024, q)
    psi = int(forward[0, 512])  # the table holds psi^bitrev(i): bitrev(512) = 1
    assert pow(psi, 1024, q) == q - 1 and min(pow(psi, 2 * k + 1, q) for k in range(1024)) == psi
    assert int(forward[0, 5]) * int(inverse[0, 5]) % q == 1
    assert int(forward[1, 5]) == (int(forward[0, 5]) << 64) // q  # Shoup quotients
    ct = _encrypt(seal, public, np.linspace(-1, 1, seal.slots), 0)
    ntt_form = residues(ct, CT_DATA_OFFSET, 2 * 2 * 1024)[:1024].astype(object)
    coeffs = seal.sa.Ciphertext()
    seal.evaluator.transform_from_ntt(ct, coeffs)
    plain = residues(coeffs, CT_DATA_OFFSET, 2 * 2 * 1024)[:1024].astype(object)
    order = hoist._bit_reverse(10, np.arange(1024))
    points = np.array([pow(psi, 2 * int(order[i]) + 1, q) for i in range(1024)], dtype=object)
    value = np.zeros(1024, dtype=object)
    for c in plain[::-1]:  # Horner
        value = (value * points + c) % q
    assert np.array_equal(value, ntt_form)


def test_galois_permutation_matches_seals_rotation_of_a_plaintext_slot_vector():
    seal, keygen, public, galois, _steps = _ring()
    values = np.random.default_rng(0).uniform(-1, 1, seal.slots)
    ct = _encrypt(seal, public, values, 0)
    rotated = seal.sa.Ciphertext()
    seal.evaluator.rotate_vector(ct, 7, galois, rotated)
    elt = seal.context.key_context_data().galois_tool().get_elt_from_step(7)
    perm = hoist.galois_permutation(4096, elt)
    assert sorted(perm.tolist()) == list(range(4096))
    assert np.allclose(_decrypt(seal, keygen, rotated), np.roll(values, -7), atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("level", [0, 1, 2])
def test_seals_order_gives_seals_bytes_and_hoisting_its_values(level):
    seal, keygen, public, galois, steps = _ring(bits=(60, 40, 40, 40, 60))
    hoister = hoist.hoister_for(seal, galois, native_kernels(seal))
    values = np.random.default_rng(level).uniform(-1, 1, seal.slots)
    ct = _encrypt(seal, public, values, level)
    shared = hoister.decompose(ct)
    for step in steps:
        want = seal.sa.Ciphertext()
        seal.evaluator.rotate_vector(ct, step, galois, want)
        exact = hoister.rotate(hoister.decompose(ct, permute_step=step), step, permuted=True)
        assert seal.dump(exact) == seal.dump(want)
        hoisted = hoister.rotate(shared, step)
        assert hoisted.scale == want.scale and tuple(hoisted.parms_id()) == tuple(want.parms_id())
        assert np.abs(_decrypt(seal, keygen, hoisted) - np.roll(values, -step)).max() < 1e-5


@needs_kernel
def test_declines_and_refusals():
    seal, _keygen, public, galois, steps = _ring()
    hoister = hoist.hoister_for(seal, galois, native_kernels(seal))
    ct = _encrypt(seal, public, np.ones(seal.slots), 0)
    shared = hoister.decompose(ct)
    assert hoister.rotate(shared, 2) is None  # no key of the step's own: the caller rotates with SEAL
    product = seal.sa.Ciphertext()
    seal.evaluator.multiply(ct, ct, product)
    assert hoister.decompose(product) is None  # three polynomials
    tool = seal.context.key_context_data().galois_tool()
    forged = seal.load("galois_keys", seal.dump(galois), {tool.get_elt_from_step(s) for s in steps})
    zero = hoist.Hoister(hoister.library, seal, forged, native_kernels(seal))
    pointers, _ = zero._key(1)
    size = 2 * zero.k * zero.n
    for address in pointers:  # every digit's random component zeroed: each result would be transparent
        view = np.ctypeslib.as_array((ctypes.c_uint64 * size).from_address(address))
        view[zero.k * zero.n:] = 0
    with pytest.raises(SealCallError, match="transparent"):
        zero.rotate(zero.decompose(ct), 1)


class _Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 32), nn.Linear(64, 32)
        self.c = nn.Linear(32, 10)

    def forward(self, x):
        x = x.flatten(1)
        return self.c(self.a(x) * self.b(x))


@needs_kernel
def test_programs_decrypt_alike_with_and_without_hoisting(monkeypatch):
    torch.manual_seed(0)
    x = np.random.default_rng(0).random((8, 1, 8, 8))
    program = polyfhe.export(_Mixer().eval(), target="ckks", calibration=x, input_shape=(1, 8, 8))
    client = program.client()
    context = client.public_context()
    out = {}
    for hoisting in (True, False):
        if not hoisting:
            monkeypatch.setattr(SealOps, "decompose", lambda self, ct: None)
        server = program.server(context)
        y = client.decrypt(server.run(client.encrypt(x[:1])))
        out[hoisting] = (y, dict(server.last_run.counts))
    want = program.run_plain(x[:1])
    for y, _ in out.values():
        assert np.abs(y - want).max() < 1e-3
    assert out[True][1]["hoisted_rotations"] > 0 and out[False][1]["hoisted_rotations"] == 0
    assert out[True][1]["rotations"] == out[False][1]["rotations"]


class _Work:
    """A linear map's baby-rotation side as ``_baby_rotations`` uses it, on numpy slot vectors."""

    def __init__(self, value, calls=None):
        self.value, self.calls = value, calls if calls is not None else []

    def base(self, key):
        return self.value

    def rotate_baby(self, key):
        self.calls.append(key)
        return np.roll(self.value, -key[1])


def test_baby_rotations_without_hoisting_ops_rotate_one_by_one():
    """NumpyOps has no ``decompose``: every rotation goes through ``rotate`` as before."""
    calls = []
    work = _Work(np.arange(8.0), calls)
    needed = {(3, 1, 0): work, (3, 2, 0): work, (4, 1, 0): work}
    out = ex._baby_rotations(needed, ex.NumpyOps(8), ex.RunContext(1))
    assert sorted(calls) == sorted(needed) and np.array_equal(out[(3, 2, 0)], np.roll(np.arange(8.0), -2))


def test_baby_rotations_share_a_decomposition_per_base():
    made, rotated = [], []

    class Ops:
        slots = 8

        def decompose(self, ct):
            made.append(ct)
            return ("parts", ct)

        def rotate_decomposed(self, parts, step):
            rotated.append(step)
            return np.roll(parts[1], -step)

    a, b = _Work(np.arange(8.0)), _Work(np.arange(8.0) * 2)
    needed = {(3, 1, 0): a, (3, 2, 0): a, (3, 0, 0): a, (4, 1, 0): b}
    out = ex._baby_rotations(needed, Ops(), ex.RunContext(2))
    assert len(made) == 1 and sorted(rotated) == [1, 2]  # register 4 has one rotation: nothing to share
    for key, work in needed.items():
        assert np.array_equal(out[key], np.roll(work.value, -key[1]))
    many = {(r, s, 0): _Work(np.arange(8.0) + r) for r in range(ex.HOIST_BATCH + 2) for s in (1, 2)}
    made.clear()
    out = ex._baby_rotations(many, Ops(), ex.RunContext(2))  # more bases than one batch holds
    assert len(made) == ex.HOIST_BATCH + 2
    assert all(np.array_equal(out[key], np.roll(work.value, -key[1])) for key, work in many.items())
    wrapped = ex.InterleavedOps(Ops(), 2)
    assert np.array_equal(wrapped.rotate_decomposed(("parts", np.arange(8.0)), 1), np.roll(np.arange(8.0), -2))


@needs_kernel
def test_the_cost_model_prices_hoisted_baby_steps(monkeypatch):
    """Where hoisting is on, the SEAL tally prices a ciphertext's shared baby steps as a decomposition and
    hoisted rotations, and the probes time both; the rotation count stays the executor's."""
    from polyfhe.cost.workload import program_workload
    from polyfhe.engines.seal import probes, tally

    torch.manual_seed(0)
    x = np.random.default_rng(0).random((8, 1, 8, 8))
    program = polyfhe.export(_Mixer().eval(), target="ckks", calibration=x, input_shape=(1, 8, 8))
    work = program_workload(program)
    ops = {site.op for site in work.tally}
    assert {"transform", "hoisted_rotation"} <= ops
    monkeypatch.setattr(tally, "hoisting_available", lambda: False)
    flat = program_workload(program)
    assert not {"transform", "hoisted_rotation"} & {site.op for site in flat.tally}
    assert flat.counters["rotations"] == work.counters["rotations"]
    timed, _ = probes.seal_probes(chains=((4096, (40, 30, 30, 40)),), repeats=1)
    assert {"transform", "hoisted_rotation"} <= {site.op for p in timed for site in p.tally}
