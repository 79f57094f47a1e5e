"""Check RNS polynomials in untrusted key and ciphertext bytes: every residue below its prime, no degenerate row.

Engine-neutral (SEAL's and Lattigo's byte walkers both call it): one linear pass over the bytes, in bounded
buffers when reading a file descriptor, so memory stays flat whatever the object's size. Degenerate rows, where a
uniformly random polynomial is expected: all zero, constant, or holding far more zero residues than a random row
(a key whose random part has one non-zero residue per prime is not a key).
"""

from __future__ import annotations

import os

import numpy as np

from polyfhe.program.wire import WireError

__all__ = ["MAX_ZEROS", "SCAN_BYTES", "scan_buffer", "scan_polynomial"]

SCAN_BYTES = 1 << 22  # the residue scan reads at most this much at once (whole primes' rows, at least one)
# Zero residues a row of a uniformly random polynomial may hold; more are refused. A random residue modulo q is zero
# with probability 1/q, so a row of n holds Binomial(n, 1/q) zeros, mean n/q. The engines' primes are NTT primes
# of their ring (q = 1 mod 2n, so q > 2n: a 20-bit SEAL prime at N=2^15 included) and the mean is below 1/2; by
# the union bound over the k-subsets of a row, P(at least k zeros) <= C(n, k) q^-k <= (n/q)^k / k! < 2^-k / k!,
# at k = 24 below 2^-103 per row, whatever the ring and prime size: a server scanning a billion rows a second for a
# century (2^62 rows) refuses an honest key with probability below 2^-41. Rows on a prime q <= 2n (no engine's)
# are not counted: the bound does not hold there.
MAX_ZEROS = 23


def scan_buffer(n: int, primes: int) -> np.ndarray:
    rows = max(1, min(primes, SCAN_BYTES // (8 * n)))
    return np.empty((rows, n), dtype="<u8")


def scan_polynomial(source, offset: int, n: int, moduli: np.ndarray, what: str, *,
                    degenerate: str | None = "constant", error: type[Exception] | None = None,
                    buffer: np.ndarray | None = None, row_stride: int | None = None) -> None:
    """Check one RNS polynomial of ``len(moduli)`` rows of ``n`` little-endian u64 residues at ``offset``.

    ``source``: a file descriptor (read with ``preadv`` into ``buffer``, a few MiB reused: memory stays bounded
    whatever the object's size) or a bytes-like object (read in place, no copy). ``row_stride``: bytes from one
    row's start to the next (default ``8 n``; Lattigo puts a u64 length before each row). Every residue of row
    ``i`` must be below ``moduli[i]``; ``degenerate`` (for polynomials that must be uniformly random):
    ``"constant"`` (keys) refuses a row whose residues are all equal (all zero included), ``"zero"`` (a
    ciphertext's second component) only an all-zero row, and both a row with more than :data:`MAX_ZEROS` zero
    residues; ``None`` (a ciphertext's first component, which carries the message) none of these. One max and one
    min reduction per row (vectorised); zeros are counted only in rows whose minimum is zero (a random row on a
    prime of 30 bits or more almost never has one, so honest keys cost no extra pass), and the first offence is
    located only to name it. Raises ``error`` (default :class:`~polyfhe.program.wire.WireError`) naming ``what``,
    the prime and the value."""
    error = WireError if error is None else error
    moduli = np.asarray(moduli, dtype=np.uint64)
    primes, stride = len(moduli), 8 * n if row_stride is None else row_stride
    in_memory = not isinstance(source, int)
    if in_memory:
        view = memoryview(source).cast("B")
        if offset + (primes - 1) * stride + 8 * n > len(view):
            raise error(f"{what} is truncated")
        rows_at_once = primes
    else:
        if buffer is None or buffer.shape[1] != n:
            buffer = scan_buffer(n, primes)
        rows_at_once = buffer.shape[0]
    for first in range(0, primes, rows_at_once):
        count = min(rows_at_once, primes - first)
        if in_memory:
            block = np.ndarray((count, n), dtype="<u8", buffer=view, offset=offset + first * stride,
                               strides=(stride, 8))
        else:
            block = buffer[:count]
            if stride == 8 * n:
                _pread_exact(source, block, offset + first * stride, what, error)
            else:
                for r in range(count):
                    _pread_exact(source, block[r], offset + (first + r) * stride, what, error)
        _check_rows(block, moduli[first:first + count], first, what, degenerate, error)


def _pread_exact(fd: int, out: np.ndarray, offset: int, what: str, error) -> None:
    view, got = memoryview(out).cast("B"), 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            raise error(f"{what} is truncated")
        got += n


def _check_rows(block: np.ndarray, moduli: np.ndarray, first: int, what: str, degenerate: str | None,
                error) -> None:
    high = block.max(axis=1)
    over = np.flatnonzero(high >= moduli)
    if over.size:
        i = int(over[0])
        j = int(np.argmax(block[i] >= moduli[i]))
        q = int(moduli[i])
        bound = f"the engine's prime bound 2^{q.bit_length() - 1}" if q & (q - 1) == 0 else "its prime"
        raise error(f"{what}: residue {j} modulo prime {first + i} (q={int(moduli[i])}) is {int(block[i, j])}, "
                    f"not below {bound}: not a reduced polynomial")
    if degenerate is None:
        return
    low = block.min(axis=1)
    flat = np.flatnonzero(high == low) if degenerate == "constant" else np.flatnonzero(high == 0)
    if flat.size:
        i = int(flat[0])
        value = int(high[i])
        kind = "zero" if value == 0 else f"constant ({value})"
        raise error(f"{what}: every residue modulo prime {first + i} (q={int(moduli[i])}) is {value}, a {kind} "
                    f"polynomial{_why(degenerate)}")
    _check_zero_counts(block, low, moduli, first, what, degenerate, error)


def _why(degenerate: str) -> str:
    return "; a transparent ciphertext (it encrypts nothing)" if degenerate == "zero" else \
        ": a real key's polynomials are uniformly random, this is not a key"


def _check_zero_counts(block: np.ndarray, low: np.ndarray, moduli: np.ndarray, first: int, what: str,
                       degenerate: str, error) -> None:
    """Refuse a row with more than :data:`MAX_ZEROS` zero residues; only rows holding a zero are counted."""
    n = block.shape[1]
    for i in np.flatnonzero((low == 0) & (moduli > 2 * n)):
        zeros = n - int(np.count_nonzero(block[i]))
        if zeros > MAX_ZEROS:
            q = int(moduli[i])
            what_it_is = ("a ciphertext's second component is uniformly random; this one is nearly transparent"
                          if degenerate == "zero" else "a real key's polynomials are uniformly random, this is "
                          "not a key")
            raise error(f"{what}: {zeros} of the {n} residues modulo prime {first + int(i)} (q={q}) are 0; a "
                        f"uniformly random polynomial has {n / q:.2g} on average, and more than {MAX_ZEROS} with "
                        f"probability below 2^-100: {what_it_is}")
