"""SEAL kernels through ctypes (no GIL), and polyfhe's own dot kernel: byte-identical to TenSEAL's bindings,
refused preconditions fall back, and a server computes the same bytes either way."""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch import nn

import polyfhe
from polyfhe.engines.seal import native as seal_native
from polyfhe.engines.seal.context import SealContext
from polyfhe.engines.seal.errors import SealCallError
from polyfhe.engines.seal.native import (
    CT_DATA_OFFSET,
    NATIVE_ENV,
    POOL_HANDLE_OFFSET,
    SHARED_PTR_USE_COUNT,
    _kernels,
    _largest_residues,
    _library,
    bound_dot,
    cpp_address,
    dot_available,
    dot_self_test,
    native_kernels,
    residues,
    self_test,
)
from polyfhe.engines.seal.ops import SealOps
from polyfhe.program.ckks_program import CKKSProgram
from polyfhe.program.params import CKKSParams
from polyfhe.runtime.plaintexts import PlaintextKey

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
    before = seal.dump(ct), ct.scale

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
    assert (seal.dump(ct), ct.scale) == before  # inputs untouched: every kernel writes a copy


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


@pytest.fixture(scope="module")
def relin_keys(ring):
    """Relinearisation keys on the ring (of another secret key: SEAL's bytes, not the values, are compared)."""
    seal = ring[0]
    keys = seal.sa.RelinKeys()
    seal.sa.KeyGenerator(seal.context).create_relin_keys(keys)
    return keys


@pytest.mark.parametrize("level", [0, 1, 2])
def test_products_relinearisations_and_rescales_match_the_bindings_byte_for_byte(ring, public_key, relin_keys,
                                                                                 level):
    seal, native, _, _ = ring
    sa, ev = seal.sa, seal.evaluator
    rng = np.random.default_rng(10 + level)
    a, b = _encrypted(seal, public_key, level, rng), _encrypted(seal, public_key, level, rng)
    before = [(seal.dump(ct), ct.scale) for ct in (a, b)]

    want = sa.Ciphertext()
    ev.multiply(a, b, want)
    got = native.multiply(a, b)
    assert got is not None and got.size() == 3 and _same(seal, got, want)
    square = sa.Ciphertext()
    ev.multiply(a, a, square)
    assert _same(seal, native.multiply(a, a), square)  # one ciphertext as both operands
    assert [(seal.dump(ct), ct.scale) for ct in (a, b)] == before  # inputs untouched: the product is a copy

    ev.relinearize_inplace(want, relin_keys)
    assert native.relinearize_inplace(got, relin_keys) and got.size() == 2 and _same(seal, got, want)
    ev.rescale_to_next_inplace(want)
    assert native.rescale_inplace(got) and _same(seal, got, want)
    assert seal.chain_index(got) == seal.chain_index(a) - 1 and got.scale < a.scale * b.scale


def test_sealops_products_match_the_bindings_and_count_alike(ring, public_key):
    seal, _, _, _ = ring
    keygen = seal.sa.KeyGenerator(seal.context)
    relin = seal.sa.RelinKeys()
    keygen.create_relin_keys(relin)
    rng = np.random.default_rng(20)
    a, b = _encrypted(seal, public_key, 1, rng), _encrypted(seal, public_key, 1, rng)
    native_ops, bound_ops = SealOps(seal, relin), SealOps(seal, relin)
    bound_ops.native = None
    assert native_ops.parallel_products and not bound_ops.parallel_products
    results = [ops.relin_rescale(ops.multiply(a, b)) for ops in (native_ops, bound_ops)]
    assert _same(seal, *results)
    assert _same(seal, native_ops.rescale(native_ops.add(None, native_ops.mul_scalar(a, 0.5))),
                 bound_ops.rescale(bound_ops.add(None, bound_ops.mul_scalar(a, 0.5))))
    assert native_ops.counts == bound_ops.counts
    assert native_ops.counts["products"] == 1 and native_ops.counts["rescales"] == 2
    assert native_ops.counts["key_switches"] == 1


def test_what_seal_would_refuse_of_a_product_is_left_to_the_bindings(ring, public_key, relin_keys):
    seal, native, galois, ct = ring
    sa, ev = seal.sa, seal.evaluator
    low = sa.Ciphertext()
    ev.mod_switch_to(ct, seal.parms_id_at(1), low)
    last = sa.Ciphertext()
    ev.mod_switch_to(ct, seal.context.last_parms_id(), last)
    three = native.multiply(ct, ct)
    assert native.multiply(ct, low) is None  # levels differ
    assert native.multiply(three, ct) is None and native.multiply(ct, three) is None  # size 3
    huge = native.copy(ct)
    huge.scale = 2.0**145  # over the 140-bit modulus at level 0, and so is its product
    assert native.multiply(ct, huge) is None
    assert not native.relinearize_inplace(native.copy(ct), relin_keys)  # already two polynomials
    assert not native.relinearize_inplace(native.multiply(ct, ct), None)  # no relinearisation keys
    assert not native.relinearize_inplace(native.multiply(ct, ct), galois)  # a key set without a relin key
    assert not native.rescale_inplace(last)  # the end of the chain
    assert not native.rescale_inplace(three)  # not relinearised
    before = seal.dump(huge)
    assert not native.rescale_inplace(huge)  # its scale is over the modulus already
    assert seal.dump(huge) == before  # declined: nothing done


def test_the_self_test_finds_a_product_kernel_that_differs(monkeypatch):
    def off_scale(self, ct) -> bool:  # the bindings' rescale, then a scale off by one part in 2^40
        self.seal.evaluator.rescale_to_next_inplace(ct)
        ct.scale *= 1 + 2.0**-40
        return True

    monkeypatch.setattr(seal_native.NativeSeal, "rescale_inplace", off_scale)
    assert self_test(_library(), seal_native._STATE.get("shim")) == "rescale"
    monkeypatch.setattr(seal_native.NativeSeal, "multiply", lambda self, a, b: None)
    assert self_test(_library(), seal_native._STATE.get("shim")) == "ciphertext product"


def test_the_dot_kernel_is_built_and_passes_its_self_test():
    """The install builds ``_kernels.c`` (scripts/setup.sh); a build without it would silently lose the kernel."""
    assert dot_available(), "polyfhe/engines/seal/_kernels.c was not built: pip install -e . where a C compiler is present"
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


def test_a_server_computes_the_same_bytes_with_and_without_native_kernels(monkeypatch):
    """Byte for byte without hoisting (hoisted rotations differ from SEAL's in key noise: test_seal_hoist.py)."""
    monkeypatch.setattr(SealOps, "decompose", lambda self, ct: None)
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
            "from polyfhe.engines.seal.native import _library; print('library', _library())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, NATIVE_ENV: "0"}).stdout
    assert "library None" in out and f"{NATIVE_ENV}=0" in out


# ---- SEAL's refusals: caught by the shim (polyfhe/engines/seal/_seal_shim.cpp), never an abort -------------------------------

SMALL = CKKSParams(4096, (40, 30, 40), 30, security="none")
CT_SIZE_OFFSET = 40  # seal::Ciphertext: parms_id (32), is_ntt_form + padding (8), then its size


def _zero_random_components(seal, galois) -> None:
    """Every Galois key's second polynomial (its uniformly random part) set to zero, in place: every key switch
    with these keys yields a transparent result, which SEAL refuses (as a client's forged keys would make it)."""
    primes = len(seal.context.key_context_data().parms().coeff_modulus())
    count = primes * seal.params.poly_modulus_degree
    for row in galois.data():  # references into the key set, not copies
        for key in row:
            residues(key.data(), CT_DATA_OFFSET, 2 * count)[count:] = 0


@pytest.fixture(scope="module")
def forged():
    """(seal, Galois keys for step 1 with zero random components, a ciphertext whose residues are all zero but
    one in its second polynomial, a genuine ciphertext) on a small insecure ring."""
    seal = SealContext(SMALL)
    sa = seal.sa
    keygen = sa.KeyGenerator(seal.context)
    public = sa.PublicKey()
    keygen.create_public_key(public)
    galois = sa.GaloisKeys()
    keygen.create_galois_keys([seal.context.key_context_data().galois_tool().get_elt_from_step(1)], galois)
    _zero_random_components(seal, galois)
    genuine = _encrypted(seal, public, 0, np.random.default_rng(7))
    ct = _encrypted(seal, public, 0, np.random.default_rng(8))
    n, primes = seal.params.poly_modulus_degree, len(seal.context.first_context_data().parms().coeff_modulus())
    data = residues(ct, CT_DATA_OFFSET, 2 * n * primes)
    data[:] = 0
    data[primes * n + 5] = 1
    return seal, galois, ct, genuine


def test_a_rotation_seal_refuses_raises_instead_of_aborting(forged, caplog):
    seal, galois, ct, genuine = forged
    native = native_kernels(seal)
    assert native is not None
    before = seal.dump(ct)
    for target in (ct, genuine):
        with caplog.at_level(logging.WARNING, logger="polyfhe.engines.seal.native"), \
                pytest.raises(SealCallError, match="rotation by 1: result ciphertext is transparent") as info:
            native.rotate(target, 1, galois, has_key=True)
        assert info.value.operation == "rotation by 1" and "transparent" in info.value.reason
    assert seal.dump(ct) == before  # the input is untouched: the refused rotation ran on a copy
    assert any(r.levelno == logging.WARNING and "rotation by 1" in r.getMessage() for r in caplog.records)


def test_both_paths_raise_the_same_error_where_seal_refuses_a_rotation(forged):
    seal, galois, ct, _ = forged
    for native in (True, False):
        ops = SealOps(seal, None, galois)
        assert ops.native is not None
        if not native:
            ops.native = None  # TenSEAL's bindings, which raise RuntimeError: SealOps makes it SealCallError
        with pytest.raises(SealCallError, match="rotation by 1.*transparent"):
            ops.rotate(ct, 1)


ATTACK = textwrap.dedent("""
    import numpy as np
    from polyfhe.program.params import CKKSParams
    from polyfhe.engines.seal.context import SealContext
    from polyfhe.engines.seal.ops import SealOps
    from polyfhe.engines.seal.native import CT_DATA_OFFSET, residues
    from polyfhe.engines.seal.errors import SealCallError

    seal = SealContext(CKKSParams(4096, (40, 30, 40), 30, security="none"))
    sa, n = seal.sa, 4096
    keygen = sa.KeyGenerator(seal.context)
    galois = sa.GaloisKeys()
    keygen.create_galois_keys([seal.context.key_context_data().galois_tool().get_elt_from_step(1)], galois)
    for row in galois.data():
        for key in row:
            residues(key.data(), CT_DATA_OFFSET, 2 * 3 * n)[3 * n:] = 0
    ct = sa.Ciphertext()
    public = sa.PublicKey()
    keygen.create_public_key(public)
    sa.Encryptor(seal.context, public).encrypt(seal.encode(np.ones(4), seal.parms_id_at(0), 2.0**30), ct)
    data = residues(ct, CT_DATA_OFFSET, 2 * 2 * n)
    data[:] = 0
    data[2 * n + 5] = 1
    ops = SealOps(seal, None, galois)
    assert ops.native is not None, "the native path is off"
    try:
        ops.rotate(ct, 1)
    except SealCallError as exc:
        print("refused:", exc)
    else:
        raise SystemExit("SEAL did not refuse the rotation")
""")


def test_the_attack_does_not_abort_the_process():
    """Run where an abort (SIGABRT from a C++ exception crossing ctypes) fails the test instead of pytest."""
    done = subprocess.run([sys.executable, "-c", ATTACK], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-2000:])
    assert "refused: SEAL refused rotation by 1: result ciphertext is transparent" in done.stdout


def test_the_shim_catches_what_each_seal_function_throws(forged):
    """Each of the four linear-map wrappers, past the Python checks, on values SEAL refuses: the refusal comes
    back with SEAL's own message (a caught std::exception, not the shim's catch-all) and the process goes on."""
    seal, galois, _, ct = forged
    sa, ev = seal.sa, seal.evaluator
    native = native_kernels(seal)
    # Ciphertext::operator= of a source whose size field says 1 (SEAL's minimum is 2)
    broken = native.copy(ct)
    size = ctypes.c_size_t.from_address(cpp_address(broken) + CT_SIZE_OFFSET)
    assert size.value == broken.size() == 2
    size.value = 1
    try:
        with pytest.raises(SealCallError, match="ciphertext copy: invalid size"):
            native.copy(broken)
    finally:
        size.value = 2
    # multiply_plain_ntt with a plaintext of another level (NativeSeal.multiply_plain would decline it)
    other = seal.encode(1.0, seal.parms_id_at(1), 2.0**30)
    out = native.copy(ct)
    with pytest.raises(SealCallError, match="plaintext product: .*mismatch"):
        native._multiply("plaintext product", native._evaluator, cpp_address(out), cpp_address(other))
    # add_inplace of a ciphertext and its negation: a transparent sum
    negated = sa.Ciphertext()
    ev.negate(ct, negated)
    with pytest.raises(SealCallError, match="addition: result ciphertext is transparent"):
        native.add_inplace(native.copy(ct), negated)
    # rotate_internal with keys whose random component is zero
    with pytest.raises(SealCallError, match="rotation by 1: result ciphertext is transparent"):
        native.rotate(ct, 1, galois, has_key=True)
    # and the kernels still work afterwards
    want = sa.Ciphertext()
    ev.add(ct, ct, want)
    got = native.copy(ct)
    assert native.add_inplace(got, ct) and _same(seal, got, want)


def _pool_uses(seal) -> ctypes.c_int:
    """The use count of SEAL's global memory pool (a fresh ciphertext holds a handle to it)."""
    empty = seal.sa.Ciphertext()
    control = ctypes.c_void_p.from_address(cpp_address(empty) + POOL_HANDLE_OFFSET + 8).value
    return ctypes.c_int.from_address(control + SHARED_PTR_USE_COUNT)


def test_the_shim_catches_what_the_product_functions_throw(forged):
    """multiply_inplace, relinearize_internal and rescale_to_next past the Python checks, on values SEAL refuses:
    SEAL's own message comes back as SealCallError, the memory pool's references stay balanced (the by-value
    handle is its donor's to destroy, thrown or not) and the process goes on."""
    seal, _, _, ct = forged
    sa, ev = seal.sa, seal.evaluator
    native = native_kernels(seal)
    relin = sa.RelinKeys()
    sa.KeyGenerator(seal.context).create_relin_keys(relin)
    last = sa.Ciphertext()
    ev.mod_switch_to(ct, seal.context.last_parms_id(), last)
    out, three = native.copy(ct), native.multiply(ct, ct)
    uses = _pool_uses(seal)
    before = uses.value
    with pytest.raises(SealCallError, match="product: .*mismatch"):  # operands at two levels
        native._pooled("product", native._product, cpp_address(out), cpp_address(last))
    with pytest.raises(SealCallError, match="relinearisation: destination_size"):  # to four polynomials of three
        native._pooled("relinearisation", native._relinearize, cpp_address(three), cpp_address(relin), 4)
    with pytest.raises(SealCallError, match="rescale: end of modulus switching chain"):
        native._pooled("rescale", native._rescale, cpp_address(last), cpp_address(last))
    assert uses.value == before
    want = sa.Ciphertext()
    ev.multiply(ct, ct, want)
    assert _same(seal, native.multiply(ct, ct), want)  # and the kernels still work afterwards


def test_both_paths_raise_the_same_error_where_seal_refuses_a_product(forged):
    """Transparent results (a client's forged ciphertexts: every polynomial but the first zero) of a product, a
    relinearisation and a rescale: SealCallError with SEAL's message, natively and through the bindings."""
    seal, _, _, genuine = forged
    sa = seal.sa
    relin = sa.RelinKeys()
    sa.KeyGenerator(seal.context).create_relin_keys(relin)
    count = len(seal.context.first_context_data().parms().coeff_modulus()) * seal.params.poly_modulus_degree
    native = native_kernels(seal)
    zero, three = native.copy(genuine), native.multiply(genuine, genuine)
    residues(zero, CT_DATA_OFFSET, 2 * count)[count:] = 0
    residues(three, CT_DATA_OFFSET, 3 * count)[count:] = 0
    for on in (True, False):
        ops = SealOps(seal, relin)
        if not on:
            ops.native = None
        assert ops.parallel_products is on
        with pytest.raises(SealCallError, match="product: result ciphertext is transparent"):
            ops.multiply(zero, zero)
        with pytest.raises(SealCallError, match="relinearisation: result ciphertext is transparent"):
            ops.relin_rescale(native.copy(three))
        with pytest.raises(SealCallError, match="rescale: result ciphertext is transparent"):
            ops.rescale(native.copy(zero))


def test_the_bindings_refusals_are_seal_call_errors_too(forged):
    seal, _, _, ct = forged
    negated = seal.sa.Ciphertext()
    seal.evaluator.negate(ct, negated)
    copy = seal.sa.Ciphertext()
    seal.evaluator.negate(negated, copy)
    ops = SealOps(seal, None)
    ops.native = None
    with pytest.raises(SealCallError, match="addition: result ciphertext is transparent") as info:
        ops.add(copy, negated)
    assert isinstance(info.value.__cause__, RuntimeError)  # TenSEAL's own error, kept as the cause
    with pytest.raises(SealCallError, match="addition: .*mismatch"):
        ops.add(negated, ops.drop_to(ct, 1))  # levels differ


def test_memory_errors_pass_through_unwrapped():
    from polyfhe.engines.seal.context import _bound

    def exhausted():
        raise MemoryError("std::bad_alloc")

    with pytest.raises(MemoryError):
        _bound("product", exhausted)


def test_the_shim_shares_seals_libstdcxx():
    """The catch of std::exception matches SEAL's throws only with one libstdc++: both link the shared one."""
    import _sealapi_cpp

    from polyfhe.engines.seal import _seal_shim

    if shutil.which("ldd") is None:
        pytest.skip("no ldd")

    def libstdcxx(path):
        lines = subprocess.run(["ldd", path], capture_output=True, text=True, check=True).stdout.splitlines()
        return [line.split("=>")[1].split("(")[0].strip() for line in lines if "libstdc++" in line]

    shim = libstdcxx(_seal_shim.__file__)
    assert shim and shim == libstdcxx(_sealapi_cpp.__file__)


def test_without_the_shim_seal_is_never_called_natively(monkeypatch, caplog):
    def absent():
        raise ImportError("No module named 'polyfhe.engines.seal._seal_shim'")

    monkeypatch.setattr(seal_native, "_STATE", {})
    monkeypatch.setattr(seal_native, "_open_shim", absent)
    monkeypatch.setenv(NATIVE_ENV, "1")
    with caplog.at_level(logging.INFO, logger="polyfhe.engines.seal.native"):
        assert _library() is None
        assert native_kernels(SealContext(SMALL)) is None
    assert any("_seal_shim" in r.getMessage() for r in caplog.records)


def test_a_self_test_that_fails_is_remembered_not_retried(monkeypatch, caplog):
    calls = []

    def broken(*args):
        calls.append(args)
        raise RuntimeError("something unexpected")

    monkeypatch.setattr(seal_native, "_STATE", {})
    monkeypatch.setattr(seal_native, "self_test", broken)
    monkeypatch.setenv(NATIVE_ENV, "1")
    seal = SealContext(SMALL)
    with caplog.at_level(logging.INFO, logger="polyfhe.engines.seal.native"):
        assert native_kernels(seal) is None
        assert SealOps(seal, None).native is None
        assert native_kernels(seal) is None and not seal_native.native_available()
    assert len(calls) == 1
    assert any("RuntimeError: something unexpected" in r.getMessage() for r in caplog.records)


def test_a_dot_self_test_that_fails_is_remembered_not_retried(monkeypatch, caplog):
    calls = []

    def broken(*args):
        calls.append(args)
        raise RuntimeError("something unexpected")

    library, shim = _library(), seal_native._STATE.get("shim")
    assert library is not None and shim is not None
    monkeypatch.setattr(seal_native, "_STATE", {"library": library, "shim": shim})
    monkeypatch.setattr(seal_native, "dot_self_test", broken)
    seal = SealContext(SMALL)
    with caplog.at_level(logging.INFO, logger="polyfhe.engines.seal.native"):
        first, second = native_kernels(seal), SealOps(seal, None).native
        assert not dot_available()
    assert len(calls) == 1
    for native in (first, second):  # SEAL's functions still native, products on SEAL's own
        assert native is not None and native._dot is None and native.dot_terms == 0
    assert any("RuntimeError: something unexpected" in r.getMessage() for r in caplog.records)
