"""SEAL's slot operations for the executor: rotations through key chains, plaintext products from the shared store,
the native dot kernel, with every refusal raised as :class:`~polyfhe.engines.seal.errors.SealCallError`."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable

from polyfhe.engines.seal.context import SealContext, _bound
from polyfhe.engines.seal.native import native_kernels
from polyfhe.runtime.execute import sum_of_products
from polyfhe.runtime.plaintexts import (
    DEFAULT_PLAINTEXT_BYTES,
    PlaintextKey,
    PlaintextStore,
    store_with_budget,
)
from polyfhe.runtime.rotations import KeyChain, naf_terms

__all__ = ["COUNTERS", "DEFAULT_CACHE_BYTES", "SealOps", "naf_terms", "rotation_key_switches"]

log = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = DEFAULT_PLAINTEXT_BYTES  # the plaintext store's default budget per program

# What SealOps counts. The first four are the historical names (kept for callers).
COUNTERS = (
    "rotations",  # rotate_vector calls
    "plain_products",  # ciphertext x plaintext products (diagonals and scalars)
    "products",  # ciphertext x ciphertext products
    "rescales",
    "key_switches",  # 1 per rotation with its own Galois key, its NAF weight when SEAL composes it; 1 per relin
    "encodes",  # plaintexts encoded by this backend: store misses plus scalars
    "scalar_encodes",  # the scalars among them (batch layout weights and biases: never stored)
    "plaintext_hits",  # plaintext diagonals and biases the store already held (or another thread encoded)
    "hoisted_rotations",  # the rotations (and key switches) among the above that shared a decomposition
)

def rotation_key_switches(step: int, slots: int, has_key: Callable[[int], bool]) -> int:
    """Key switches SEAL's ``rotate_vector`` spends on ``step``: 1 with a Galois key of its own, else it rotates
    by each NAF term of the step (skipping a term of ``slots``, a full turn) as SEAL's ``rotate_internal`` does."""
    if step == 0:
        return 0
    if has_key(step):
        return 1
    terms = naf_terms(step)
    if len(terms) == 1:
        raise ValueError(f"no Galois key for rotation step {step} (SEAL cannot compose a power of two)")
    return sum(rotation_key_switches(t, slots, has_key) for t in terms if abs(t) != slots)


class SealOps:
    """:class:`~polyfhe.runtime.execute.SlotOps` on SEAL ciphertexts; ``level`` counts rescales consumed.

    Where SEAL refuses an evaluation on these values (a client's ciphertexts and keys: a transparent result,
    parameters or scales that do not match), every operation raises :class:`SealCallError` naming it, on the
    native path and the bindings' alike.

    Plaintext diagonals and biases come from a :class:`~polyfhe.runtime.plaintexts.PlaintextStore` (``plaintext_cache``:
    usually the program's, shared by its servers; a private one when ``None``; ``max_cache_bytes``: its budget,
    ``None`` for the store's own). ``counts`` are cumulative; see :data:`COUNTERS`.
    """

    def __init__(self, seal: SealContext, relin_keys, galois_keys=None,
                 plaintext_cache: PlaintextStore | None = None, max_cache_bytes: int | None = None,
                 key_steps: Iterable[int] | None = None):
        """``key_steps``: the steps ``galois_keys`` holds; a step without a key is then rotated by the shortest
        chain of them (:class:`~polyfhe.runtime.rotations.KeyChain`), else SEAL composes it from its NAF."""
        self.seal = seal
        self._chain = KeyChain(key_steps, seal.slots) if key_steps is not None else None
        self.ev = seal.evaluator
        self.relin_keys = relin_keys
        self.galois_keys = galois_keys
        self.slots = seal.slots
        self.scale = seal.params.scale
        self.store = store_with_budget(plaintext_cache, max_cache_bytes)
        self.counts = dict.fromkeys(COUNTERS, 0)
        self._rotation_costs: dict[int, int] = {}  # step -> key switches, from the Galois keys held
        self._keyed: dict[int, bool] = {}  # step -> whether the Galois keys hold its own key
        self._lock = threading.Lock()
        # products (plaintext and ciphertext), additions, rotations, relinearisations and rescales without the
        # GIL, so the executor's threads share the cores
        self.native = native_kernels(seal)
        self._hoister = False  # made on the first decomposition (its tables take a moment); None: not hoisting

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def stats(self) -> dict:
        """The cumulative counters plus what the plaintext store holds now (``plaintext_bytes``)."""
        with self._lock:
            counts = dict(self.counts)
        return {**counts, "plaintext_bytes": self.store.stats().bytes}

    def level(self, ct) -> int:
        return self.seal.top_level - self.seal.chain_index(ct)

    def drop_to(self, ct, level: int):
        if self.level(ct) >= level:
            return ct
        out = self.seal.sa.Ciphertext()
        _bound("level switch", self.ev.mod_switch_to, ct, self.seal.parms_id_at(level), out)
        return out

    def rotate(self, ct, step: int):
        if self.galois_keys is None:
            raise ValueError("this program needs rotations but the context holds no Galois keys")
        step = int(step)
        # with the keys' steps known, the shortest chain of them (a held step is a chain of one); else SEAL's own
        # rotation, which composes a step it has no key for from its NAF
        links = self._chain.chain(step) if self._chain is not None else [step]
        for link in links:
            ct = self._rotate_once(ct, link)
        switches = len(links) if self._chain is not None else self._naf_switches(step)
        with self._lock:
            self.counts["rotations"] += 1
            self.counts["key_switches"] += switches
        return ct

    def decompose(self, ct):
        """``ct`` decomposed for several hoisted rotations (:mod:`polyfhe.engines.seal.hoist`), or None where
        rotations are not hoisted (no native path, no kernel, or its self-test failed)."""
        if self.galois_keys is None or self.native is None:
            return None
        if self._hoister is False:
            with self._lock:
                if self._hoister is False:
                    from polyfhe.engines.seal.hoist import hoister_for

                    self._hoister = hoister_for(self.seal, self.galois_keys, self.native)
        return None if self._hoister is None else self._hoister.decompose(ct)

    def rotate_decomposed(self, decomposition, step: int):
        """The decomposed ciphertext rotated by ``step``: hoisted where the step has a key of its own, else as
        :meth:`rotate` (a chain of keys, or SEAL's composition)."""
        step = int(step)
        links = self._chain.chain(step) if self._chain is not None else [step] if self._keyed_step(step) else []
        out = self._hoister.rotate(decomposition, links[0]) if len(links) == 1 else None
        if out is None:
            return self.rotate(decomposition.ct, step)
        with self._lock:
            self.counts["rotations"] += 1
            self.counts["key_switches"] += 1
            self.counts["hoisted_rotations"] += 1
        return out

    def _rotate_once(self, ct, step: int):
        """One ``rotate_vector`` call: natively when the step has a key of its own (every link of a key chain
        has), else through the bindings (SEAL composes the step from its NAF)."""
        keyed = self._chain is not None or self._keyed_step(step)
        out = None if self.native is None else self.native.rotate(ct, step, self.galois_keys, keyed)
        if out is None:
            out = self.seal.sa.Ciphertext()
            _bound(f"rotation by {step}", self.ev.rotate_vector, ct, step, self.galois_keys, out)
        return out

    def _multiply_plain(self, ct, pt):
        """``ct * pt`` into a new ciphertext: natively, or through the bindings where the native kernel declines."""
        out = None if self.native is None else self.native.multiply_plain(ct, pt)
        if out is None:
            out = self.seal.sa.Ciphertext()
            _bound("plaintext product", self.ev.multiply_plain, ct, pt, out)
        return out

    def _naf_switches(self, step: int) -> int:
        switches = self._rotation_costs.get(step)
        if switches is None:  # once per step: the keys held do not change
            switches = self._rotation_costs.setdefault(step, rotation_key_switches(step, self.slots, self._has_key))
        return switches

    def _keyed_step(self, step: int) -> bool:
        keyed = self._keyed.get(step)
        if keyed is None:
            keyed = self._keyed.setdefault(step, self._has_key(step))
        return keyed

    def _has_key(self, step: int) -> bool:
        from polyfhe.program.boundary import galois_element  # client imports this module

        return bool(self.galois_keys.has_key(galois_element(step, self.seal.params.poly_modulus_degree)))

    def _target_scale(self, ct) -> float:
        return self.seal.last_prime(ct) * self.scale / ct.scale

    @contextlib.contextmanager
    def _plaintext(self, key: PlaintextKey, vec, parms_id, scale: float):
        """The store's plaintext for ``key`` (encoded here on a miss), leased for the block."""
        encoded = False

        def encode():
            nonlocal encoded
            encoded = True
            return _bound("plaintext encoding", self.seal.encode, vec, parms_id, scale)  # scale: from the ciphertext

        with self.store.lease(key.encoded_at(parms_id, scale), encode) as pt:
            yield pt
        self._count("encodes" if encoded else "plaintext_hits")

    def _encode_scalar(self, value: float, parms_id, scale: float):
        with self._lock:
            self.counts["encodes"] += 1
            self.counts["scalar_encodes"] += 1
        return _bound("plaintext encoding", self.seal.encode, float(value), parms_id, scale)

    def mul_vector(self, ct, vec, key):
        with self._plaintext(key, vec, ct.parms_id(), self._target_scale(ct)) as pt:
            out = self._multiply_plain(ct, pt)
        self._count("plain_products")
        return out

    def dot(self, terms: list[tuple]):
        """``sum ct * vec`` over ``terms`` of (ciphertext, slot vector, plaintext key), each plaintext encoded as
        :meth:`mul_vector` encodes it: one pass of the native dot kernel per :attr:`NativeSeal.dot_terms` terms
        where it is present, else products and additions one by one (the same bytes either way)."""
        chunk = self.native.dot_terms if self.native is not None else 0
        if chunk < 2 or len(terms) < 2:
            return sum_of_products(self, terms)
        acc = None
        for start in range(0, len(terms), chunk):
            part = terms[start:start + chunk]
            with contextlib.ExitStack() as leases:
                pts = [leases.enter_context(self._plaintext(key, vec, ct.parms_id(), self._target_scale(ct)))
                       for ct, vec, key in part]
                cts = [ct for ct, _, _ in part]
                out = self.native.dot(cts, pts)
                if out is None:  # declined (a precondition SEAL would check): the bindings raise what is wrong
                    for ct, pt in zip(cts, pts, strict=True):
                        out = self.add(out, self._multiply_plain(ct, pt))
            self._count("plain_products", len(part))
            acc = self.add(acc, out)
        return acc

    def mul_scalar(self, ct, value):
        out = self._multiply_plain(ct, self._encode_scalar(value, ct.parms_id(), self._target_scale(ct)))
        self._count("plain_products")
        return out

    def add(self, a, b):
        if a is None:
            return b
        if self.native is None or not self.native.add_inplace(a, b):
            _bound("addition", self.ev.add_inplace, a, b)
        return a

    def add_vector(self, ct, vec, key):
        with self._plaintext(key, vec, ct.parms_id(), ct.scale) as pt:
            _bound("plaintext addition", self.ev.add_plain_inplace, ct, pt)
        return ct

    def add_scalar(self, ct, value):
        _bound("plaintext addition", self.ev.add_plain_inplace, ct,
               self._encode_scalar(value, ct.parms_id(), ct.scale))
        return ct

    @property
    def parallel_products(self) -> bool:
        """Whether products, relinearisations and rescales run without the GIL (the native path), so that
        independent products gain from the executor's threads."""
        return self.native is not None

    def rescale(self, ct):
        """``ct`` rescaled in place: natively, or through the bindings where the native kernel declines."""
        if self.native is None or not self.native.rescale_inplace(ct):
            _bound("rescale", self.ev.rescale_to_next_inplace, ct)
        self._count("rescales")
        return ct

    def multiply(self, a, b):
        out = None if self.native is None else self.native.multiply(a, b)
        if out is None:
            out = self.seal.sa.Ciphertext()
            _bound("product", self.ev.multiply, a, b, out)
        self._count("products")
        return out

    def relin_rescale(self, ct):
        if self.native is None or not self.native.relinearize_inplace(ct, self.relin_keys):
            _bound("relinearisation", self.ev.relinearize_inplace, ct, self.relin_keys)
        self._count("key_switches")
        return self.rescale(ct)
