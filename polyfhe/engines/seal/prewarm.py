"""Encode a SEAL program's plaintexts before its first query: the first query then costs what later ones do.

SEAL's plaintext store encodes each diagonal and bias on first use, at the level and scale its product needs,
so the first query after a server starts pays every encode (cpolynext_fhe_bn at 28x28: 11,155 encodes, about
40 s of its 77 s). Those levels and scales depend on the program alone, never on keys or inputs: the executor
run over :class:`ScaleOps`, whose "ciphertexts" are only (level, scale) pairs that follow SEAL's scale
arithmetic exactly (IEEE doubles, the same operations in the same order), asks the store for exactly the keys a
real query will ask for, and encodes them. No key, no ciphertext and no rotation is involved.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from polyfhe.engines.seal.context import SealContext
from polyfhe.program.ckks_program import CKKSProgram
from polyfhe.runtime.execute import execute
from polyfhe.runtime.plaintexts import PlaintextKey, PlaintextStore

__all__ = ["ScaleOps", "WarmStats", "warm_plaintexts"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Shape:
    """What SEAL's scale bookkeeping sees of a ciphertext: its level (primes consumed) and its scale."""

    level: int
    scale: float


@dataclass(frozen=True)
class WarmStats:
    encoded: int  # plaintexts encoded now
    held: int  # plaintexts the store holds afterwards
    bytes: int  # bytes the store holds afterwards
    seconds: float


class ScaleOps:
    """The executor's slot operations on (level, scale) only; plaintext products and additions go through the
    program's store with the keys :class:`~polyfhe.engines.seal.ops.SealOps` uses, encoding what is missing."""

    parallel_products = False  # scale arithmetic in Python: nothing to run at once

    def __init__(self, seal: SealContext, store: PlaintextStore) -> None:
        self.seal, self.store = seal, store
        self.slots = seal.slots
        self.scale = seal.params.scale
        self._primes = [m.value() for m in seal.context.first_context_data().parms().coeff_modulus()]

    def _last_prime(self, ct: _Shape) -> int:
        return self._primes[len(self._primes) - 1 - ct.level]

    def _target_scale(self, ct: _Shape) -> float:
        """The scale a product's plaintext is encoded at (``SealOps._target_scale``): back to the program's scale
        after the rescale."""
        return self._last_prime(ct) * self.scale / ct.scale

    def _encode(self, key: PlaintextKey, vec, level: int, scale: float) -> None:
        parms_id = self.seal.parms_id_at(level)
        self.store.get(key.encoded_at(parms_id, scale), lambda: self.seal.encode(vec, parms_id, scale))

    def level(self, ct: _Shape) -> int:
        return ct.level

    def drop_to(self, ct: _Shape, level: int) -> _Shape:
        return ct if ct.level >= level else _Shape(level, ct.scale)

    def rotate(self, ct: _Shape, step: int) -> _Shape:
        return ct

    def mul_vector(self, ct: _Shape, vec: np.ndarray, key: PlaintextKey) -> _Shape:
        target = self._target_scale(ct)
        self._encode(key, vec, ct.level, target)
        return _Shape(ct.level, ct.scale * target)

    def mul_scalar(self, ct: _Shape, value: float) -> _Shape:
        return _Shape(ct.level, ct.scale * self._target_scale(ct))

    def add(self, a: _Shape | None, b: _Shape) -> _Shape:
        return b if a is None else a

    def add_vector(self, ct: _Shape, vec: np.ndarray, key: PlaintextKey) -> _Shape:
        self._encode(key, vec, ct.level, ct.scale)
        return ct

    def add_scalar(self, ct: _Shape, value: float) -> _Shape:
        return ct

    def rescale(self, ct: _Shape) -> _Shape:
        return _Shape(ct.level + 1, ct.scale / float(self._last_prime(ct)))

    def multiply(self, a: _Shape, b: _Shape) -> _Shape:
        return _Shape(a.level, a.scale * b.scale)

    def relin_rescale(self, ct: _Shape) -> _Shape:
        return self.rescale(ct)


def warm_plaintexts(program: CKKSProgram, store: PlaintextStore | None = None) -> WarmStats:
    """Encode every plaintext a query of ``program`` (SEAL, single layout) multiplies or adds by into ``store``
    (default: the program's own, shared by its servers), within the store's budget; other programs: nothing."""
    store = program.shared.plaintexts if store is None else store
    before, start = store.stats(), time.perf_counter()
    m = program.manifest
    if m.backend != "seal" or m.layout != "single":
        return WarmStats(0, before.entries, before.bytes, 0.0)  # Lattigo encodes at load; batch: scalars only
    ops = ScaleOps(SealContext(m.params), store)
    execute(m, program.arrays, ops, _Shape(0, m.params.scale), threads=1)
    after = store.stats()
    stats = WarmStats(after.encodes - before.encodes, after.entries, after.bytes, time.perf_counter() - start)
    log.info("program %s: %d plaintexts encoded ahead of its first query in %.1f s (the store holds %d, %.2f GB)",
             m.program_id, stats.encoded, stats.seconds, stats.held, stats.bytes / 1e9)
    return stats
