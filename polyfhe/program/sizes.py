"""Bytes of CKKS objects from their shape: the one formula every engine's size estimate frames its own way.

An RNS polynomial holds ``n`` coefficients per prime, one machine word each; a ciphertext (or a public key) holds
``polys`` of them; a key-switching key holds one such ciphertext per digit of its decomposition, over the key
level's primes (special primes included). An engine adds its own framing: bytes per object and per digit.
"""

from __future__ import annotations

__all__ = ["WORD_BYTES", "ciphertext_bytes", "key_switching_key_bytes", "poly_bytes"]

WORD_BYTES = 8  # one coefficient residue, as every engine here stores it


def poly_bytes(n: int, primes: int, word: int = WORD_BYTES) -> int:
    """One polynomial of ``n`` coefficients over ``primes`` primes."""
    return n * primes * word


def ciphertext_bytes(n: int, primes: int, polys: int = 2, framing: int = 0) -> int:
    """A ciphertext of ``polys`` polynomials over ``primes`` primes, plus ``framing`` bytes."""
    return framing + polys * poly_bytes(n, primes)


def key_switching_key_bytes(n: int, digits: int, primes: int, digit_framing: int = 0, framing: int = 0,
                            polys: int = 2) -> int:
    """A key-switching key (relinearisation or Galois): a ciphertext of ``polys`` polynomials (one where the
    random half travels as a seed) over ``primes`` primes per digit (each with ``digit_framing`` bytes), plus
    ``framing`` bytes."""
    return framing + digits * ciphertext_bytes(n, primes, polys=polys, framing=digit_framing)
