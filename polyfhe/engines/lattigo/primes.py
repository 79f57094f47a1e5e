"""Lattigo's NTT-friendly primes, ported (v6.2.0: ``ring/primes.go`` and ``core/rlwe/params.go`` ``GenModuli``).

The bootstrapping security check and key sizes are decided on the primes Lattigo generates; these generate
them here exactly as Lattigo does, so the compiler can decide without the wheel. Pure arithmetic.
"""

from __future__ import annotations

import math

from polyfhe.program.params import ParameterError

__all__ = ["NTTPrimes", "is_prime", "lattigo_gen_moduli"]

_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # deterministic for every n < 3.3e24


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    for b in _MR_BASES:
        if n % b == 0:
            return n == b
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


class NTTPrimes:
    """Lattigo's ``NTTFriendlyPrimesGenerator``: primes 2^bits +/- k * nth_root + 1, alternating up and down."""

    def __init__(self, bits: int, nth_root: int) -> None:
        self.size, self.nth_root = float(bits), nth_root
        self.next = self.prev = (1 << bits) + 1
        self.check_next = self.next <= 0xFFFFFFFFFFFFFFFF - nth_root
        self.check_prev = self.prev >= nth_root
        self.prev -= nth_root

    def _up_done(self, x: int) -> bool:
        return math.log2(float(x)) - self.size >= 0.5 or x > 0xFFFFFFFFFFFFFFFF - self.nth_root

    def _down_done(self, x: int) -> bool:
        return self.size - math.log2(float(x)) >= 0.5 or x < self.nth_root

    def alternating(self) -> int:
        while self.check_next or self.check_prev:
            if self.check_next:
                if self._up_done(self.next):
                    self.check_next = False
                else:
                    x, self.next = self.next, self.next + self.nth_root
                    if is_prime(x):
                        return x
            if self.check_prev:
                if self._down_done(self.prev):
                    self.check_prev = False
                else:
                    x, self.prev = self.prev, self.prev - self.nth_root
                    if is_prime(x):
                        return x
        raise ParameterError(f"no more {int(self.size)}-bit NTT primes for 2N={self.nth_root}")

    def downstream(self) -> int:
        while self.check_prev and not self._down_done(self.prev):
            x, self.prev = self.prev, self.prev - self.nth_root
            if is_prime(x):
                return x
        raise ParameterError(f"no more {int(self.size)}-bit NTT primes for 2N={self.nth_root}")


def lattigo_gen_moduli(log_nth_root: int, logq: tuple[int, ...], logp: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """(Q, P) as Lattigo's ``rlwe.GenModuli`` makes them: per bit size, alternating primes (61 bits: downward),
    handed out in the order the sizes appear in Q, then P."""
    counts: dict[int, int] = {}
    for b in (*logq, *logp):
        counts[b] = counts.get(b, 0) + 1
    pools = {}
    for b, k in counts.items():
        g = NTTPrimes(b, 1 << log_nth_root)
        pools[b] = [g.downstream() if b == 61 else g.alternating() for _ in range(k)]
    return tuple(pools[b].pop(0) for b in logq), tuple(pools[b].pop(0) for b in logp)
