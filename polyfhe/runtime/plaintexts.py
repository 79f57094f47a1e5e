"""Encoded plaintexts kept per program within a memory budget: encode each one at most once while it fits.

A program's plaintext diagonals and biases depend on its parameters only (never on keys), so every server of one
program shares one :class:`PlaintextStore`. The store is thread-safe (the executor runs giant steps on a thread
pool): a key being encoded by one thread is waited for by the others (an in-flight map), never encoded twice.

When the budget is full the store evicts by **re-encode cost** (the plaintext's ``coeff_count``: ring degree x
primes at its level; a plaintext low in the modulus chain is cheaper to encode again), cheapest first, ties by
least recent use; plaintexts leased by a running product are never evicted. A new plaintext displaces only
strictly cheaper ones: one program's runs ask for the same plaintexts in the same order every time, and under
such a cyclic pattern evicting an equally expensive incumbent would only evict each plaintext just before its
next use (LRU thrash); keeping incumbents makes the hit rate the share that fits. Evicting drops the store's
reference only; a caller still holding the plaintext keeps it alive (Python refcounting).

The budget is a ceiling, not a promise: the store also stops growing while the machine's available memory
(``MemAvailable``) would fall below :data:`MEMORY_RESERVE_FRACTION` of its physical memory, so a process that
already holds gigabytes of keys (``polyfhe run`` keeps the client's and the server's) re-encodes what does not
fit instead of being killed for memory. New plaintexts then displace only strictly cheaper ones, as at the budget.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any

from polyfhe.procinfo import available_memory
from polyfhe.program.machine import machine_memory_budget

__all__ = ["DEFAULT_PLAINTEXT_BYTES", "PlaintextKey", "PlaintextStore", "StoreStats", "plaintext_cost", "store_with_budget"]

log = logging.getLogger(__name__)

_MEMORY = machine_memory_budget(1.0) or 6 << 30  # physical memory (6 GiB assumed where the platform does not say)
# A program's plaintexts are encoded once while they fit, so the default is large enough to hold whole programs:
# half of the machine's memory (12.3 GB on a 24 GB machine: the 28x28 FHE recipes need 4.6 GB and 12.1 GB).
# Smaller budgets trade memory for time: what does not fit is encoded again on every run (about 2.5 ms per
# plaintext at N=16384 with 12 primes, 0.6 ms with 2).
DEFAULT_PLAINTEXT_BYTES = _MEMORY // 2
MEMORY_RESERVE_FRACTION = 0.1  # the store does not grow while less than this share of memory stays available


WORD_BYTES = 8  # SEAL keeps each coefficient modulo each prime in a 64-bit word


def plaintext_cost(pt: Any) -> tuple[int, int]:
    """(bytes held, re-encode cost) of a SEAL plaintext: ``coeff_count`` = N x primes at its level."""
    count = int(pt.coeff_count())
    return count * WORD_BYTES, count


@dataclass(frozen=True)
class PlaintextKey:
    """Which plaintext: diagonal ``row`` of term ``term`` of the linear map writing ``register``, or (``row`` None)
    that map's bias; ``parms_id`` and ``scale`` say where in the modulus chain it was encoded."""

    register: int
    term: int = 0
    row: int | None = None
    parms_id: tuple[int, ...] = ()
    scale: int = 0

    @classmethod
    def diagonal(cls, register: int, term: int, row: int) -> PlaintextKey:
        return cls(register, term, row)

    @classmethod
    def bias(cls, register: int) -> PlaintextKey:
        return cls(register)

    def encoded_at(self, parms_id, scale: float) -> PlaintextKey:
        return replace(self, parms_id=tuple(parms_id), scale=round(scale))


@dataclass(frozen=True)
class StoreStats:
    encodes: int  # plaintexts encoded through the store (misses)
    hits: int  # requests answered without encoding (held, or shared from another thread's encode)
    evictions: int  # plaintexts dropped to make room for more expensive ones (or a smaller budget)
    rejected: int  # encoded plaintexts not kept: too large, or cheaper than everything evictable
    bytes: int  # held now
    peak_bytes: int  # most ever held at once
    entries: int
    max_bytes: int

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Entry:
    value: Any
    nbytes: int
    cost: int


class _Pending:
    """One key being encoded: later requests wait for it instead of encoding it again."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.ok = False


class PlaintextStore:
    """Thread-safe plaintexts by key within ``max_bytes``; ``lease(key, encode)`` is the way to use one."""

    def __init__(self, max_bytes: int = DEFAULT_PLAINTEXT_BYTES,
                 measure: Callable[[Any], tuple[int, int]] = plaintext_cost,
                 available: Callable[[], int | None] = available_memory, reserve: int | None = None) -> None:
        """``available()``: bytes the machine can still give (None: unknown, the budget alone bounds the store);
        the store does not grow while that would leave less than ``reserve`` (default a tenth of memory)."""
        if max_bytes < 0:
            raise ValueError(f"max_bytes must not be negative, got {max_bytes}")
        self._max_bytes = int(max_bytes)
        self._measure = measure
        self._available = available
        self._reserve = int(MEMORY_RESERVE_FRACTION * _MEMORY) if reserve is None else int(reserve)
        self._memory_capped = False  # warned once that memory, not the budget, stopped the store
        self._lock = threading.Lock()
        self._entries: dict[Hashable, _Entry] = {}
        self._by_cost: dict[int, OrderedDict] = {}  # cost -> keys, least recently used first
        self._pending: dict[Hashable, _Pending] = {}
        self._pins: dict[Hashable, int] = {}
        self._bytes = self._peak = 0
        self._encodes = self._hits = self._evictions = self._rejected = 0

    # ------------------------------------------------------------------------------------------------ use
    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    def set_max_bytes(self, max_bytes: int) -> None:
        """Change the budget; a smaller one evicts (cheapest first) until what is held fits."""
        if max_bytes < 0:
            raise ValueError(f"max_bytes must not be negative, got {max_bytes}")
        with self._lock:
            self._max_bytes = int(max_bytes)
            victims = self._victims(self._bytes - self._max_bytes, below_cost=None)
            for key in victims or []:
                self._drop(key)
            if victims:
                log.info("plaintext store: budget %d bytes, evicted %d plaintexts", max_bytes, len(victims))

    @contextlib.contextmanager
    def lease(self, key: Hashable, encode: Callable[[], Any]) -> Iterator[Any]:
        """The plaintext for ``key`` (``encode()`` on a miss), pinned against eviction inside the block."""
        value = self._acquire(key, encode)
        try:
            yield value
        finally:
            with self._lock:
                self._unpin_locked(key)

    def get(self, key: Hashable, encode: Callable[[], Any]) -> Any:
        """The plaintext for ``key``, unpinned (it may be evicted from the store while the caller uses it)."""
        with self.lease(key, encode) as value:
            return value

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(self._encodes, self._hits, self._evictions, self._rejected, self._bytes, self._peak,
                              len(self._entries), self._max_bytes)

    def clear(self) -> None:
        """Drop every plaintext not leased right now."""
        with self._lock:
            for key in [k for k in self._entries if not self._pins.get(k)]:
                self._drop(key)

    # ------------------------------------------------------------------------------------------------ internals
    def _acquire(self, key: Hashable, encode: Callable[[], Any]) -> Any:
        while True:
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None:
                    self._hits += 1
                    self._by_cost[entry.cost].move_to_end(key)
                    self._pins[key] = self._pins.get(key, 0) + 1
                    return entry.value
                pending = self._pending.get(key)
                owner = pending is None
                if owner:
                    pending = self._pending[key] = _Pending()
                    self._pins[key] = self._pins.get(key, 0) + 1  # our own encode is in use from the start
            if owner:
                return self._encode(key, encode, pending)
            pending.done.wait()
            if pending.ok:  # another thread encoded it: share that object (held by the store or not)
                with self._lock:
                    self._hits += 1
                    self._pins[key] = self._pins.get(key, 0) + 1
                return pending.value
            # the other thread's encode failed: try again (and raise its error from our own attempt)

    def _encode(self, key: Hashable, encode: Callable[[], Any], pending: _Pending) -> Any:
        try:
            value = encode()
            nbytes, cost = self._measure(value)
        except BaseException:
            with self._lock:
                del self._pending[key]
                self._unpin_locked(key)
            pending.done.set()
            raise
        with self._lock:
            self._encodes += 1
            self._admit(key, value, nbytes, cost)
            del self._pending[key]
            pending.value, pending.ok = value, True
        pending.done.set()
        return value

    def _unpin_locked(self, key: Hashable) -> None:
        left = self._pins[key] - 1
        if left:
            self._pins[key] = left
        else:
            del self._pins[key]

    def _room(self, nbytes: int) -> int:
        """Bytes the store may hold after admitting ``nbytes`` more: its budget, or less when the machine's
        available memory would fall below the reserve."""
        available = self._available()
        if available is None or available - nbytes >= self._reserve:
            return self._max_bytes
        if not self._memory_capped:
            self._memory_capped = True
            log.warning("plaintext store: stops growing at %.2f GB (budget %.2f GB): the machine has %.2f GB "
                        "available and keeps %.2f GB in reserve; plaintexts that do not fit are encoded again on "
                        "every run", self._bytes / 1e9, self._max_bytes / 1e9, available / 1e9, self._reserve / 1e9)
        return min(self._max_bytes, self._bytes)

    def _admit(self, key: Hashable, value: Any, nbytes: int, cost: int) -> None:
        victims = self._victims(self._bytes + nbytes - self._room(nbytes), below_cost=cost)
        if nbytes > self._max_bytes or victims is None:
            self._rejected += 1
            return
        for victim in victims:
            self._drop(victim)
        self._entries[key] = _Entry(value, nbytes, cost)
        self._by_cost.setdefault(cost, OrderedDict())[key] = None
        self._bytes += nbytes
        self._peak = max(self._peak, self._bytes)

    def _victims(self, need: int, below_cost: int | None) -> list | None:
        """Keys to evict to free ``need`` bytes: cheapest first, least recently used first among equals, never a
        leased one, only below ``below_cost`` when given; ``None`` when that cannot free enough."""
        if need <= 0:
            return []
        victims, freed = [], 0
        for cost in sorted(self._by_cost):
            if below_cost is not None and cost >= below_cost:
                break
            for key in self._by_cost[cost]:
                if self._pins.get(key):
                    continue
                victims.append(key)
                freed += self._entries[key].nbytes
                if freed >= need:
                    return victims
        return None if below_cost is not None else victims

    def _drop(self, key: Hashable) -> None:
        entry = self._entries.pop(key)
        bucket = self._by_cost[entry.cost]
        del bucket[key]
        if not bucket:
            del self._by_cost[entry.cost]
        self._bytes -= entry.nbytes
        self._evictions += 1


def store_with_budget(store: PlaintextStore | None, max_bytes: int | None = None) -> PlaintextStore:
    """``store`` (a new private one when ``None``) with its budget set to ``max_bytes``; ``None`` keeps the
    store's own (``DEFAULT_PLAINTEXT_BYTES`` for a new one)."""
    store = PlaintextStore() if store is None else store
    if max_bytes is not None and max_bytes != store.max_bytes:
        store.set_max_bytes(max_bytes)
    return store
