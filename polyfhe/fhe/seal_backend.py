"""A thin, strict wrapper over TenSEAL's raw SEAL bindings (``tenseal.sealapi``).

Scales are managed exactly: a plaintext product is encoded at ``q_last * scale / ct.scale`` so that after
the rescale by ``q_last`` the ciphertext is back at exactly ``2^scale_bits``; ct x ct products drift by
``scale / q`` (about 1e-7), which the next linear map absorbs. Plaintexts are cached per program because
they depend only on the parameters, never on keys, so sessions of one program share them
(:mod:`polyfhe.fhe.plaintexts`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterable

import numpy as np

from polyfhe.fhe.execute import sum_of_products
from polyfhe.fhe.params import CKKSParams
from polyfhe.fhe.plaintexts import DEFAULT_PLAINTEXT_BYTES, PlaintextKey, PlaintextStore, store_with_budget
from polyfhe.fhe.rotations import KeyChain
from polyfhe.fhe.seal_native import SealCallError, native_kernels, refused
from polyfhe.fhe.sealbytes import (
    HEADER,
    SerializationError,
    check_ciphertext,
    check_kswitch,
    check_secret_key,
    expected_bytes,
    inflate_into,
    seal_layout,
)

__all__ = ["COUNTERS", "DEFAULT_CACHE_BYTES", "SealCallError", "SealContext", "SealOps", "SerializationError",
           "naf_terms", "require_tenseal", "rotation_key_switches"]

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
)

log = logging.getLogger(__name__)

# What TenSEAL's bindings raise where SEAL refuses an operation: pybind11's translations of SEAL's exceptions
# (logic_error and others: RuntimeError; invalid_argument: ValueError; out_of_range: IndexError; overflow_error:
# OverflowError). std::bad_alloc becomes MemoryError, which is not among them and passes through unchanged.
_BINDING_REFUSALS = (RuntimeError, ValueError, IndexError, OverflowError)


def _bound(operation: str, call: Callable, *arguments):
    """``call(*arguments)``, a binding of SEAL's, with a refusal raised as :class:`SealCallError` (as the native
    path raises it), so a caller tells SEAL's refusal of a client's values from a bug of its own the same way
    on both paths."""
    try:
        return call(*arguments)
    except SealCallError:
        raise
    except _BINDING_REFUSALS as exc:
        raise refused(operation, str(exc)) from exc


def require_tenseal():
    try:
        import tenseal.sealapi as sa
    except ImportError as exc:  # pragma: no cover - tenseal is a core dependency
        raise ImportError("CKKS needs TenSEAL: pip install 'tenseal==0.3.18'") from exc
    return sa


class SealContext:
    """SEAL context, encoder and evaluator for one parameter set, plus (de)serialisation of SEAL objects."""

    def __init__(self, params: CKKSParams) -> None:
        sa = require_tenseal()
        self.sa = sa
        self.params = params
        n = params.poly_modulus_degree
        parms = sa.EncryptionParameters(sa.SCHEME_TYPE.CKKS)
        parms.set_poly_modulus_degree(n)
        parms.set_coeff_modulus(sa.CoeffModulus.Create(n, list(params.coeff_mod_bits)))
        level = sa.SEC_LEVEL_TYPE.TC128 if params.security == "tc128" else sa.SEC_LEVEL_TYPE.NONE
        self.context = sa.SEALContext(parms, True, level)
        if not self.context.parameters_set():
            raise ValueError(f"SEAL rejected {params.describe()}: {self.context.parameters_error_message()}")
        self.encoder = sa.CKKSEncoder(self.context)
        self.evaluator = sa.Evaluator(self.context)
        self.slots = self.encoder.slot_count()
        self.top_level = self.context.first_context_data().chain_index()
        self.layout = seal_layout(self.context, n)  # each level's primes: residues checked exactly

    # ----------------------------------------------------------------------------------------------------
    def chain_index(self, ct) -> int:
        return self.context.get_context_data(ct.parms_id()).chain_index()

    def last_prime(self, ct) -> int:
        return self.context.get_context_data(ct.parms_id()).parms().coeff_modulus()[-1].value()

    def parms_id_at(self, consumed: int):
        data = self.context.first_context_data()
        for _ in range(consumed):
            data = data.next_context_data()
            if data is None:
                raise ValueError(f"no level {consumed}: the modulus chain has {self.top_level} levels")
        return data.parms_id()

    def encode(self, values: np.ndarray | float, parms_id, scale: float):
        pt = self.sa.Plaintext()
        if np.ndim(values) == 0:
            self.encoder.encode(float(values), parms_id, scale, pt)
        else:
            vec = np.zeros(self.slots)
            vec[: len(values)] = values
            self.encoder.encode(vec.tolist(), parms_id, scale, pt)
        return pt

    # ----------------------------------------------------------------------------------------------------
    def dump(self, obj) -> bytes:
        """Serialise a SEAL object (zstd-compressed SEAL format) through :func:`_memory_file`: in memory on Linux;
        elsewhere through a 0600 file in a private temporary directory, removed as soon as it is read back."""
        with _memory_file() as (fd, path):
            obj.save(path)
            return _read_all(fd)

    def load(self, kind: str, data, galois_elements: set[int] | frozenset[int] | None = None):
        """Deserialise untrusted bytes into a SEAL object of ``kind`` checked against this context.

        Bounded before SEAL parses anything (:mod:`polyfhe.fhe.sealbytes`): inflated by us to at most the exact
        size the object has at these parameters, its structure walked (a Galois key set must hold exactly
        ``galois_elements``), then loaded uncompressed. Raises :class:`SerializationError` with the reason.
        """
        factory = {"ciphertext": self.sa.Ciphertext, "public_key": self.sa.PublicKey,
                   "relin_keys": self.sa.RelinKeys, "galois_keys": self.sa.GaloisKeys,
                   "secret_key": self.sa.SecretKey}[kind]
        layout = self.layout
        rows = None
        if kind == "galois_keys":
            if galois_elements is None:
                raise ValueError("loading Galois keys needs the expected Galois elements")
            rows = {(e & (2 * layout.n - 1)) >> 1 for e in galois_elements}
        what = kind.replace("_", " ")
        obj = factory()
        with _memory_file() as (fd, path):
            length = inflate_into(fd, data, expected_bytes(layout, kind, len(rows or ())), what)
            _STRUCTURE_CHECKS[kind](fd, length, layout, rows, what)
            try:
                obj.load(self.context, path)
            except Exception as exc:
                raise SerializationError(f"not a valid {what} for {self.params.describe()}: "
                                         f"{type(exc).__name__}: {exc}") from exc
        if not self.sa.is_valid_for(obj, self.context):
            raise SerializationError(f"{kind} does not match {self.params.describe()}")
        return obj


# kind -> walk of its inflated payload (fd, payload bytes, layout, Galois rows, what): before SEAL parses it
_STRUCTURE_CHECKS = {
    "ciphertext": lambda fd, length, layout, rows, what: check_ciphertext(fd, HEADER.size, length, layout),
    "public_key": lambda fd, length, layout, rows, what: check_ciphertext(fd, HEADER.size, length, layout,
                                                                         key_level=True, what=what),
    "secret_key": lambda fd, length, layout, rows, what: check_secret_key(fd, length, layout),
    "relin_keys": check_kswitch,  # rows None: the one relinearisation row
    "galois_keys": check_kswitch,
}


@contextlib.contextmanager
def _memory_file():
    """(fd, path) of a file to (de)serialise through: ``tenseal.sealapi`` (de)serialises only through paths.

    Linux (``memfd_create`` and ``/proc/self/fd``): an anonymous in-memory file reached as ``/proc/self/fd/N``; no
    directory entry, nothing on disk. Elsewhere (macOS, Windows, a Linux without ``/proc``) there is no anonymous
    file SEAL can open by path, so the bytes, secret keys included, do pass through the temporary directory's file
    system: a file of mode 0600 inside a fresh directory of mode 0700 (``tempfile.mkdtemp``), unlinked together
    with its directory as soon as the caller's block ends. It can reach a disk only there and only while the
    block runs (or in swap/page cache, as any memory can).
    """
    if hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"):
        fd = os.memfd_create("polyfhe-seal", os.MFD_CLOEXEC)
        try:
            yield fd, f"/proc/self/fd/{fd}"
        finally:
            os.close(fd)
        return
    directory = tempfile.mkdtemp(prefix="polyfhe-")  # mode 0700: no other user can list or open what is inside
    path = os.path.join(directory, "object")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o600)
        try:
            yield fd, path
        finally:
            os.close(fd)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.rmdir(directory)


def _read_all(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    chunks, offset = [], 0
    while offset < size:
        chunk = os.pread(fd, size - offset, offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def naf_terms(value: int) -> list[int]:
    """Signed powers of two of the non-adjacent form of ``value``, as SEAL's ``util::naf`` lists them."""
    sign, value, out, i = value < 0, abs(int(value)), [], 0
    while value:
        digit = 2 - (value & 3) if value & 1 else 0
        value = (value - digit) >> 1
        if digit:
            out.append((-digit if sign else digit) << i)
        i += 1
    return out


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
    """:class:`~polyfhe.fhe.execute.SlotOps` on SEAL ciphertexts; ``level`` counts rescales consumed.

    Where SEAL refuses an evaluation on these values (a client's ciphertexts and keys: a transparent result,
    parameters or scales that do not match), every operation raises :class:`SealCallError` naming it, on the
    native path and the bindings' alike.

    Plaintext diagonals and biases come from a :class:`~polyfhe.fhe.plaintexts.PlaintextStore` (``plaintext_cache``:
    usually the program's, shared by its servers; a private one when ``None``; ``max_cache_bytes``: its budget,
    ``None`` for the store's own). ``counts`` are cumulative; see :data:`COUNTERS`.
    """

    def __init__(self, seal: SealContext, relin_keys, galois_keys=None,
                 plaintext_cache: PlaintextStore | None = None, max_cache_bytes: int | None = None,
                 key_steps: Iterable[int] | None = None):
        """``key_steps``: the steps ``galois_keys`` holds; a step without a key is then rotated by the shortest
        chain of them (:class:`~polyfhe.fhe.rotations.KeyChain`), else SEAL composes it from its NAF."""
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
        # products, additions and rotations without the GIL, so the executor's threads share the cores
        self.native = native_kernels(seal)

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
        from polyfhe.fhe.client import galois_element  # client imports this module

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

    def rescale(self, ct):
        _bound("rescale", self.ev.rescale_to_next_inplace, ct)
        self._count("rescales")
        return ct

    def multiply(self, a, b):
        out = self.seal.sa.Ciphertext()
        _bound("product", self.ev.multiply, a, b, out)
        self._count("products")
        return out

    def relin_rescale(self, ct):
        _bound("relinearisation", self.ev.relinearize_inplace, ct, self.relin_keys)
        self._count("key_switches")
        return self.rescale(ct)
