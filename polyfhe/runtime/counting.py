"""Operation counts from the executor's own schedule: :class:`CountingOps` runs a program without arithmetic.

The planned counters a manifest records (``info.planned``) and SEAL's compiled workload are what
:func:`~polyfhe.runtime.execute.execute` does, so they are counted by running it on symbolic ciphertexts that
carry only their level (rescales consumed): every rotation, plaintext product, encode, rescale and ct x ct
product the executor asks for is counted where it happens, at the primes of its level. There is no second copy
of the schedule to keep in step with the executor.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from polyfhe.program.params import CKKSParams
from polyfhe.program.steps import BootstrapAttrs
from polyfhe.runtime.execute import Schedule, execute
from polyfhe.runtime.opcosts import OpSite, Tally
from polyfhe.runtime.plaintexts import PlaintextKey
from polyfhe.runtime.rotations import KeyChain
from polyfhe.runtime.workload_types import data_primes

__all__ = ["Counted", "CountingOps", "OpCounts", "count_operations"]

WORD_BYTES = 8  # a coefficient modulo one prime, as SEAL and the plaintext byte counts hold it


@dataclass(frozen=True)
class Counted:
    """A symbolic ciphertext: only its level."""

    level: int


@dataclass(frozen=True)
class _Decomposed:
    ct: Counted


@dataclass
class OpCounts:
    """What one evaluation did: the manifest's counters, and the operation sites (``OpSite`` -> count) the cost
    model prices. Adds follow the cost model's convention: one per rotation, plus one per plaintext product
    (one per fused dot where the engine fuses them)."""

    rotations: int = 0
    key_switches: int = 0
    plain_products: int = 0
    encodes_cold: int = 0
    plaintext_bytes: int = 0
    bootstraps: int = 0
    products: int = 0  # ct x ct
    rescales: int = 0
    tally: Tally = field(default_factory=dict)

    def site(self, op: str, n: int, primes: int, key_primes: int | None = None, count: float = 1.0) -> None:
        if count:
            site = OpSite(op, n, primes) if key_primes is None else OpSite(op, n, primes, key_primes)
            self.tally[site] = self.tally.get(site, 0.0) + count

    def planned(self) -> dict:
        """The manifest's ``info.planned``: the counters, and ``bootstraps`` where the program has any."""
        return {"rotations": self.rotations, "key_switches": self.key_switches, "plain_products": self.plain_products,
                "encodes_cold": self.encodes_cold, "plaintext_bytes": self.plaintext_bytes,
                **({"bootstraps": self.bootstraps} if self.bootstraps else {})}


class CountingOps:
    """:class:`~polyfhe.runtime.execute.SlotOps` that count and compute nothing.

    Rotations cost the key switches of the shortest chain of the program's Galois keys
    (:class:`~polyfhe.runtime.rotations.KeyChain`, in the plan's virtual slots: ``lanes`` samples per ciphertext);
    one per relinearisation. A plaintext is encoded once per key (the store's cold run) and its bytes are held at
    the level it is encoded at. ``hoisting`` and ``fused_dot`` add the optional operations an engine has
    (:class:`~polyfhe.runtime.execute.OptionalSlotOps`), so the counts follow the path that engine's run takes.
    """

    parallel_products = False  # ready products run one after another: the counts do not depend on the order

    def __init__(self, params: CKKSParams, galois_steps: Iterable[int], lanes: int = 1, hoisting: bool = False,
                 fused_dot: bool = False) -> None:
        self.params, self.lanes = params, int(lanes)
        self.slots = params.slots
        self.n = params.poly_modulus_degree
        self.chain = KeyChain([int(g) // self.lanes for g in galois_steps], params.slots // self.lanes)
        self.counts = OpCounts()
        self._encoded: set[PlaintextKey] = set()
        if hoisting:
            self.decompose, self.rotate_decomposed = self._decompose, self._rotate_decomposed
        if fused_dot:
            self.dot = self._dot

    def _primes(self, ct: Counted) -> int:
        return data_primes(self.params, ct.level)

    def _switches(self, step: int) -> int:
        return self.chain.switches(int(step) // self.lanes)  # real steps: the interleaved lanes' multiples

    def _encode(self, key: PlaintextKey, ct: Counted) -> None:
        if key not in self._encoded:
            self._encoded.add(key)
            primes = self._primes(ct)
            self.counts.encodes_cold += 1
            self.counts.plaintext_bytes += self.n * primes * WORD_BYTES
            self.counts.site("encode", self.n, primes)

    def level(self, ct: Counted) -> int:
        return ct.level

    def drop_to(self, ct: Counted, level: int) -> Counted:
        return ct if ct.level >= level else Counted(level)

    def rotate(self, ct: Counted, step: int) -> Counted:
        c, p, switches = self.counts, self._primes(ct), self._switches(step)
        c.rotations += 1
        c.key_switches += switches
        c.site("rotation", self.n, p, p, switches)
        c.site("add", self.n, p)
        return ct

    def _decompose(self, ct: Counted) -> _Decomposed:
        p = self._primes(ct)
        self.counts.site("transform", self.n, p, p)
        return _Decomposed(ct)

    def _rotate_decomposed(self, decomposition: _Decomposed, step: int) -> Counted:
        if self._switches(step) != 1:  # no key of its own: a chain of rotations, as SEAL's ops fall back to
            return self.rotate(decomposition.ct, step)
        c, p = self.counts, self._primes(decomposition.ct)
        c.rotations += 1
        c.key_switches += 1
        c.site("hoisted_rotation", self.n, p, p)
        c.site("add", self.n, p)
        return decomposition.ct

    def _product(self, ct: Counted, key: PlaintextKey | None) -> Counted:
        c, p = self.counts, self._primes(ct)
        c.plain_products += 1
        c.site("plain_product", self.n, p)
        if key is not None:
            self._encode(key, ct)
        return ct

    def mul_vector(self, ct: Counted, vec: np.ndarray, key: PlaintextKey) -> Counted:
        if not hasattr(self, "dot"):
            self.counts.site("add", self.n, self._primes(ct))  # summed product by product
        return self._product(ct, key)

    def _dot(self, terms: list[tuple[Any, np.ndarray, PlaintextKey]]) -> Counted:
        acc = None
        for ct, _, key in terms:
            acc = self.add(acc, self._product(ct, key))
        self.counts.site("add", self.n, self._primes(acc))  # one pass: its sum is one addition of its own
        return acc

    def zero_row(self, ct: Counted) -> Counted:
        """An all-zero row: no weight of the program, left out of the planned counts as it always was."""
        return ct

    def mul_scalar(self, ct: Counted, value: float) -> Counted:
        c, p = self.counts, self._primes(ct)
        c.encodes_cold += 1  # a scalar is encoded for every product
        c.site("encode", self.n, p)
        c.site("add", self.n, p)
        return self._product(ct, None)

    def add(self, a: Counted | None, b: Counted) -> Counted:
        return b if a is None else Counted(max(a.level, b.level))

    def add_vector(self, ct: Counted, vec: np.ndarray, key: PlaintextKey) -> Counted:
        self._encode(key, ct)
        return ct

    def add_scalar(self, ct: Counted, value: float) -> Counted:
        return ct

    def rescale(self, ct: Counted) -> Counted:
        self.counts.rescales += 1
        self.counts.site("rescale", self.n, self._primes(ct))
        return Counted(ct.level + 1)

    def multiply(self, a: Counted, b: Counted) -> Counted:
        p = self._primes(a)
        self.counts.products += 1
        self.counts.site("ct_product", self.n, p, p)
        return Counted(max(a.level, b.level))

    def relin_rescale(self, ct: Counted) -> Counted:
        self.counts.key_switches += 1
        return self.rescale(ct)

    def bootstrap(self, ct: Counted, attrs: BootstrapAttrs) -> Counted:
        """The engine's own circuit: counted apart (``bootstraps``), not in the operations above."""
        self.counts.bootstraps += 1
        return Counted(0)


def count_operations(schedule: Schedule, arrays: dict[str, np.ndarray], params: CKKSParams,
                     galois_steps: Iterable[int], input_size: int, **engine: bool) -> OpCounts:
    """Run ``schedule`` through the executor on :class:`CountingOps` (``engine``: its ``hoisting`` and
    ``fused_dot``) from a fresh input at level 0: one ciphertext (single layout) or one per input element."""
    lanes = schedule.samples_per_ciphertext if schedule.layout == "single" else 1
    ops = CountingOps(params, galois_steps, lanes=lanes, **engine)
    start: Any = Counted(0) if schedule.layout == "single" else [Counted(0)] * input_size
    execute(schedule, arrays, ops, start, threads=1)
    return ops.counts
