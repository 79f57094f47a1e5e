"""SEAL's calibration probes: each operation timed on its own (the fastest of a few calls) at several rings and
at several levels of one chain (a ciphertext switched down a level has one prime fewer, so one context gives several
prime counts), and the sizes of SEAL's keys, which fit :class:`~polyfhe.runtime.opcosts.KeyBytesModel`.

Calibration rings use insecure (short) chains on purpose: only timings and sizes are kept, never the keys.
"""

from __future__ import annotations

import logging

import numpy as np

from polyfhe.engines.seal.context import SealContext
from polyfhe.engines.seal.hoist import hoister_for
from polyfhe.engines.seal.native import native_kernels
from polyfhe.program.boundary import galois_element
from polyfhe.program.params import CKKSParams
from polyfhe.runtime.opcosts import KeyObservation, OpSite, Probe, best_seconds, key_observation

__all__ = ["SEAL_CHAINS", "seal_probes"]

log = logging.getLogger(__name__)

# (ring, chain) per calibration point: first prime, data primes, special prime; bit sizes vary so that the
# key-size fit sees several
SEAL_CHAINS = ((8192, (60, 40, 40, 40, 40, 60)), (16384, (50,) + (35,) * 8 + (50,)),
               (32768, (60,) + (30,) * 12 + (60,)), (65536, (60,) + (40,) * 5 + (60,)))
STREAM = 32  # distinct plaintexts (and product ciphertexts) a product or sum probe cycles through


def seal_probes(chains=SEAL_CHAINS, repeats: int = 5) -> tuple[list[Probe], list[KeyObservation]]:
    """Single-operation timings at every ring and a few levels, and the sizes of SEAL's keys."""
    probes, keys = [], []
    rng = np.random.default_rng(0)
    for ring, bits in chains:
        seal = SealContext(CKKSParams(ring, bits, bits[1], "none"))
        sa, ev = seal.sa, seal.evaluator
        keygen = sa.KeyGenerator(seal.context)
        public, relin, galois = sa.PublicKey(), sa.RelinKeys(), sa.GaloisKeys()
        keygen.create_public_key(public)
        keygen.create_relin_keys(relin)
        keygen.create_galois_keys([galois_element(1, ring)], galois)
        digits = len(bits) - 1
        keys += [key_observation(ring, bits, 1, 2, len(seal.dump(public))),
                 key_observation(ring, bits, digits, 2, len(seal.dump(relin))),
                 key_observation(ring, bits, digits, 2, len(seal.dump(galois)))]
        top = sa.Ciphertext()
        sa.Encryptor(seal.context, public).encrypt(
            seal.encode(rng.random(ring // 2), seal.context.first_parms_id(), seal.params.scale), top)
        for drop in sorted({0, digits // 2, digits - 2}):
            ct = sa.Ciphertext()
            ev.mod_switch_to(top, seal.parms_id_at(drop), ct)
            primes = digits - drop
            probes += _seal_level(seal, ct, ring, primes, relin, galois, rng, repeats)
        del public, relin, galois, keygen, top
        log.info("calibrated SEAL at N=%d", ring)
    return probes, keys


def _seal_level(seal, ct, ring: int, primes: int, relin, galois, rng, repeats: int) -> list[Probe]:
    sa, ev = seal.sa, seal.evaluator
    vec = rng.random(ring // 2)
    # products and sums stream over distinct plaintexts and ciphertexts, as a program's diagonals do: one hot
    # plaintext in cache measured 0.82x the product time inside a real program
    plains = [seal.encode(rng.random(ring // 2), ct.parms_id(), seal.params.scale) for _ in range(STREAM)]
    out, product = sa.Ciphertext(), sa.Ciphertext()
    ev.multiply_plain(ct, plains[0], product)
    outs = [sa.Ciphertext() for _ in range(STREAM)]
    for o in outs:
        ev.multiply_plain(ct, plains[0], o)

    native = native_kernels(seal)
    sources = [native.copy(ct) for _ in range(STREAM)] if native is not None and native.dot_terms else []

    def plain_products():
        if sources:  # what a giant step runs: the dot kernel over distinct rotations, their sum included
            native.dot(sources, plains)
            return
        for pt, o in zip(plains, outs, strict=True):
            ev.multiply_plain(ct, pt, o)

    def adds():
        for o in outs:
            ev.add_inplace(product, o)

    def ct_product():
        res = sa.Ciphertext()
        ev.multiply(ct, ct, res)
        ev.relinearize_inplace(res, relin)

    timed = {
        "rotation": (lambda: ev.rotate_vector(ct, 1, galois, out), primes, 1),
        "encode": (lambda: seal.encode(vec, ct.parms_id(), seal.params.scale), 0, 1),
        "plain_product": (plain_products, 0, STREAM),
        "ct_product": (ct_product, primes, 1),
        "rescale": (lambda: ev.rescale_to_next(product, out), 0, 1),
        "add": (adds, 0, STREAM),
    }
    hoister = hoister_for(seal, galois, native)
    if hoister is not None:  # what the executor runs for baby steps: a decomposition, then hoisted rotations
        shared = hoister.decompose(ct)
        timed["transform"] = (lambda: hoister.decompose(ct), primes, 1)
        timed["hoisted_rotation"] = (lambda: hoister.rotate(shared, 1), primes, 1)
    probes = []
    for op, (fn, digits, count) in timed.items():
        fn()  # warm
        probes.append(Probe(f"seal {op} N={ring} p={primes}", {OpSite(op, ring, primes, digits): float(count)},
                            best_seconds(fn, repeats)))
    return probes
