"""Bytes of a public context as this engine's client serialises it: SEAL's zstd-compressed keys.

An uncompressed residue takes a 64-bit word whatever its prime, but zstd squeezes the high zero bits of small
primes' residues away, so the bytes that travel depend on the primes' sizes: a 40-bit prime's residue costs about
6 bytes, a 60-bit one 8. Rather than model zstd, each prime size is measured once per process by compressing a
sample of uniform residues the way SEAL does (zstd, its default level), which keeps the estimate within a few
per cent of the real upload (tests/engines/seal/test_seal_wiresize.py).
"""

from __future__ import annotations

import functools

import numpy as np

from polyfhe.program.boundary import galois_element
from polyfhe.program.params import CKKSParams

__all__ = ["public_context_bytes", "residue_bytes"]

SAMPLE_WORDS = 8192  # residues compressed per prime size: enough for zstd's statistics to settle
ZSTD_LEVEL = 3  # zstd's default, SEAL's choice
OBJECT_FRAMING = 16 + 32 + 16  # SEAL header, parms_id and sizes per serialised ciphertext (upper bound)


@functools.lru_cache(maxsize=64)
def residue_bytes(bits: int) -> float:
    """Average bytes of one residue modulo a ``bits``-bit prime after SEAL's zstd compression."""
    import zstandard

    # SEAL's primes lie just below 2^bits, so a residue is about uniform on [0, 2^bits)
    sample = np.random.default_rng(bits).integers(0, 1 << bits, SAMPLE_WORDS, dtype=np.uint64)
    return len(zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(sample.tobytes())) / SAMPLE_WORDS


def public_context_bytes(params: CKKSParams, galois_steps) -> int:
    """Estimated bytes of the public key, relinearisation key and the Galois keys for ``galois_steps`` as the
    client uploads them: every key ciphertext spans all primes (special one included); a key-switching key holds
    one per data prime."""
    n = params.poly_modulus_degree
    per_ciphertext = 2 * n * sum(residue_bytes(bits) for bits in params.coeff_mod_bits) + OBJECT_FRAMING
    digits = len(params.coeff_mod_bits) - 1
    elements = len({galois_element(step, n) for step in galois_steps})
    return int(per_ciphertext * (1 + digits * (1 + elements)))
