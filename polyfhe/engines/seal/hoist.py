"""Hoisted rotations of SEAL ciphertexts: the baby steps of a BSGS map share one key-switch decomposition.

SEAL rotates one step at a time; each rotation decomposes its ciphertext's second polynomial again (an inverse
NTT per prime and an NTT per pair of primes: most of a rotation's time at many primes). Rotations of one
ciphertext by several steps can decompose it once and permute the decomposition per step (the Galois
automorphism is a permutation of NTT slots): ``polyfhe/engines/seal/_hoist.c`` does the arithmetic on SEAL's
residues, this module finds them and checks everything first.

What it relies on, beyond :mod:`polyfhe.engines.seal.native`'s object layouts (whose self-test must pass first):

* **Galois keys' layout.** ``seal::KSwitchKeys`` holds a memory pool handle (16 bytes) and its ``parms_id``
  (32), then ``std::vector<std::vector<PublicKey>>`` (:data:`KEYS_OFFSET`); a ``PublicKey`` starts with its
  ``Ciphertext``. The key of a Galois element ``g`` is entry ``(g - 1) / 2``, one ciphertext of 2 x K x N
  residues per decomposition digit. Every address and size is checked against what the bindings report before
  it is read; any mismatch declines (the caller rotates with SEAL).
* **SEAL's NTT** (the negacyclic transform with bit-reversed powers of the smallest primitive 2N-th root of
  each prime) and SEAL's Galois permutation of NTT slots, rebuilt here from their definitions.

The self-test runs on a throwaway ring before the first use: decomposing the *permuted* polynomial (SEAL's
order) must give SEAL's rotation byte for byte at two levels, and the hoisted order must decrypt to the same
values (it differs from SEAL's bytes by key noise times ``q_j / p``, far below the scale).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from dataclasses import dataclass

import numpy as np

from polyfhe.engines.seal.errors import refused
from polyfhe.engines.seal.native import (
    CT_DATA_OFFSET,
    DYNARRAY_DATA,
    DYNARRAY_SIZE,
    _data,
    _moduli,
    cpp_address,
)

__all__ = ["HOIST_ENV", "Decomposition", "Hoister", "hoister_for", "hoisting_available", "seal_ntt_tables"]

log = logging.getLogger(__name__)

HOIST_ENV = "POLYFHE_SEAL_HOIST"  # "0": every rotation is SEAL's own
KEYS_OFFSET = 48  # seal::KSwitchKeys: MemoryPoolHandle (16), parms_id (32), then the vector of key vectors
VECTOR_BYTES = 24  # std::vector: begin, end, capacity
_VOID = ctypes.c_void_p
_U64P = ctypes.POINTER(ctypes.c_uint64)


def _bit_reverse(count_bits: int, values: np.ndarray) -> np.ndarray:
    out = np.zeros_like(values)
    for b in range(count_bits):
        out |= ((values >> b) & 1) << (count_bits - 1 - b)
    return out


def _minimal_root(n: int, q: int) -> int:
    """The smallest primitive 2n-th root of unity modulo the prime q (SEAL's choice for its NTT)."""
    order = 2 * n
    for x in range(2, q):
        g = pow(x, (q - 1) // order, q)
        if pow(g, n, q) == q - 1:
            break
    else:  # pragma: no cover - every NTT prime has one
        raise ValueError(f"{q} has no primitive {order}-th root of unity")
    g2, best, power = g * g % q, g, g
    for _ in range(n - 1):
        power = power * g2 % q
        best = min(best, power)
    return best


def _shoup(values: np.ndarray, q: int) -> np.ndarray:
    return np.array([(int(v) << 64) // q for v in values], dtype=np.uint64)


def seal_ntt_tables(n: int, q: int) -> tuple[np.ndarray, np.ndarray]:
    """(forward, inverse) tables of SEAL's NTT modulo ``q``: each 2 x n (powers, Shoup quotients); the forward
    powers are ``psi^bitrev(i)``, the inverse ``psi^-bitrev(i)``, as the kernels index them."""
    psi = _minimal_root(n, q)
    powers = [1] * n
    for i in range(1, n):
        powers[i] = powers[i - 1] * psi % q
    inv_psi = pow(psi, q - 2, q)
    inv_powers = [1] * n
    for i in range(1, n):
        inv_powers[i] = inv_powers[i - 1] * inv_psi % q
    order = _bit_reverse(n.bit_length() - 1, np.arange(n, dtype=np.int64))
    forward = np.array([powers[int(j)] for j in order], dtype=np.uint64)
    inverse = np.array([inv_powers[int(j)] for j in order], dtype=np.uint64)
    return (np.stack([forward, _shoup(forward, q)]), np.stack([inverse, _shoup(inverse, q)]))


def galois_permutation(n: int, element: int) -> np.ndarray:
    """SEAL's permutation of NTT slots for the Galois element (``GaloisTool::generate_table_ntt``): slot i of
    the automorphism's image is slot ``table[i]`` of its input."""
    bits = n.bit_length() - 1
    reversed_ = _bit_reverse(bits + 1, np.arange(n, 2 * n, dtype=np.int64))
    index = ((element * reversed_) >> 1) & (n - 1)
    return _bit_reverse(bits, index).astype(np.uint32)


def _open() -> ctypes.CDLL | None:
    try:
        from polyfhe.engines.seal import _hoist as module
    except ImportError:
        return None
    library = ctypes.CDLL(module.__file__)
    library.polyfhe_ks_decompose.argtypes = [_VOID, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t,
                                             _VOID, _VOID, _VOID, _VOID, _VOID, _VOID]
    library.polyfhe_ks_decompose.restype = ctypes.c_int
    library.polyfhe_ks_rotate.argtypes = [_VOID, _VOID, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t,
                                          _VOID, _VOID, _VOID, _VOID, _VOID, _VOID, _VOID, _VOID, _VOID, _VOID]
    library.polyfhe_ks_rotate.restype = ctypes.c_int
    return library


@dataclass
class Decomposition:
    """A ciphertext's second polynomial decomposed for key switching (``L x (L + 1) x N`` residues), with the
    ciphertext it came from (its first polynomial is permuted per rotation)."""

    ct: object
    primes: int
    residues: np.ndarray


class Hoister:
    """Hoisted rotations for one :class:`~polyfhe.engines.seal.context.SealContext` and its Galois keys.

    ``native``: its :class:`~polyfhe.engines.seal.native.NativeSeal` (copies ciphertexts). Every method returns
    ``None`` where it declines (the caller rotates with SEAL)."""

    def __init__(self, library: ctypes.CDLL, seal, galois_keys, native) -> None:
        self.library, self.seal, self.keys, self.native = library, seal, galois_keys, native
        key_data = seal.context.key_context_data()
        moduli = [m.value() for m in key_data.parms().coeff_modulus()]
        self.n = n = seal.params.poly_modulus_degree
        self.k = len(moduli)
        self._key_parms = tuple(key_data.parms_id())
        _, self._moduli, self._ratios = _moduli(key_data.parms().coeff_modulus())  # as the dot kernel takes them
        tables = [_tables_cached(n, q) for q in moduli]
        self._roots = np.ascontiguousarray(np.stack([t[0] for t in tables]))
        self._iroots = np.ascontiguousarray(np.stack([t[1] for t in tables]))
        inv_n = [pow(n, q - 2, q) for q in moduli]
        self._inv_n = np.array([w for v, q in zip(inv_n, moduli, strict=True) for w in (v, (v << 64) // q)],
                               dtype=np.uint64)
        special = moduli[-1]
        inv_special = [pow(special % q, q - 2, q) for q in moduli[:-1]]
        self._inv_special = np.array([w for v, q in zip(inv_special, moduli[:-1], strict=True) for w in (v, (v << 64) // q)],
                                     dtype=np.uint64)
        self._primes_at = {}
        data = seal.context.first_context_data()
        while data is not None:
            self._primes_at[tuple(data.parms_id())] = len(data.parms().coeff_modulus())
            data = data.next_context_data()
        self._perms: dict[int, np.ndarray] = {}
        self._key_pointers: dict[int, tuple | None] = {}
        self._lock = threading.Lock()

    # -- tables --------------------------------------------------------------------------------------------
    def _args(self) -> tuple:
        return (self._moduli, self._ratios, self._roots.ctypes.data,
                self._iroots.ctypes.data, self._inv_n.ctypes.data)

    def _element(self, step: int) -> int:
        from polyfhe.program.boundary import galois_element

        return galois_element(step, self.n)

    def _perm(self, step: int) -> np.ndarray:
        with self._lock:
            perm = self._perms.get(step)
            if perm is None:
                perm = self._perms.setdefault(step, galois_permutation(self.n, self._element(step)))
        return perm

    def _key(self, step: int) -> tuple | None:
        """(pointer array, keepalive) of the step's key ciphertexts, one per digit; None when its layout does not
        check out (or there is no key of the step's own)."""
        with self._lock:
            if step not in self._key_pointers:
                self._key_pointers[step] = self._find_key(step)
            return self._key_pointers[step]

    def _find_key(self, step: int) -> tuple | None:
        element = self._element(step)
        if (not self.keys.has_key(element) or tuple(self.keys.parms_id()) != self._key_parms):
            return None
        base = cpp_address(self.keys) + KEYS_OFFSET
        begin, end = (ctypes.c_void_p.from_address(base + 8 * i).value or 0 for i in range(2))
        index = (element - 1) >> 1
        if end <= begin or (end - begin) % VECTOR_BYTES or index >= (end - begin) // VECTOR_BYTES:
            return None
        inner = begin + index * VECTOR_BYTES
        first, last = (ctypes.c_void_p.from_address(inner + 8 * i).value or 0 for i in range(2))
        digits = self.k - 1
        if last <= first or (last - first) % digits:
            return None
        stride = (last - first) // digits
        expected = 2 * self.k * self.n
        pointers = []
        for j in range(digits):
            ct = first + j * stride
            size = ctypes.c_size_t.from_address(ct + CT_DATA_OFFSET + DYNARRAY_SIZE).value
            if size != expected:
                return None
            pointers.append(ctypes.c_void_p.from_address(ct + CT_DATA_OFFSET + DYNARRAY_DATA).value)
        return (ctypes.c_void_p * digits)(*pointers), self.keys

    # -- operations ----------------------------------------------------------------------------------------
    def _residues(self, ct, count: int) -> np.ndarray | None:
        address = _data(ct, CT_DATA_OFFSET, count)
        return None if address is None else np.ctypeslib.as_array((ctypes.c_uint64 * count).from_address(address))

    def decompose(self, ct, permute_step: int | None = None) -> Decomposition | None:
        """``ct``'s second polynomial decomposed (``permute_step``: that step's automorphism applied first, as
        SEAL orders it: for the self-test), or None."""
        primes = self._primes_at.get(tuple(ct.parms_id()))
        if primes is None or primes >= self.k or ct.size() != 2 or not ct.is_ntt_form():
            return None
        data = self._residues(ct, 2 * primes * self.n)
        if data is None:
            return None
        c1 = np.ascontiguousarray(data[primes * self.n:].reshape(primes, self.n))
        if permute_step is not None:
            c1 = np.ascontiguousarray(c1[:, self._perm(permute_step)])
        out = np.empty((primes, primes + 1, self.n), dtype=np.uint64)
        status = self.library.polyfhe_ks_decompose(c1.ctypes.data, primes, self.k, self.n, *self._args(),
                                                   out.ctypes.data)
        return None if status else Decomposition(ct, primes, out)

    def rotate(self, decomposition: Decomposition, step: int, permuted: bool = False):
        """The ciphertext of ``decomposition`` rotated by ``step`` (its own Galois key), or None. ``permuted``:
        the decomposition was made with ``permute_step=step`` (SEAL's order)."""
        key = self._key(step)
        ct, primes = decomposition.ct, decomposition.primes
        if key is None or self._primes_at.get(tuple(ct.parms_id())) != primes:
            return None
        data = self._residues(ct, 2 * primes * self.n)
        out = self.native.copy(ct)
        target = self._residues(out, 2 * primes * self.n)
        if data is None or target is None:
            return None
        perm = self._perm(step)
        status = self.library.polyfhe_ks_rotate(
            decomposition.residues.ctypes.data, data.ctypes.data, primes, self.k, self.n, perm.ctypes.data,
            None if permuted else perm.ctypes.data, key[0], *self._args(), self._inv_special.ctypes.data,
            target.ctypes.data)
        if status:
            return None
        if not target[primes * self.n:].any():  # SEAL refuses a transparent result (forged keys): so do we
            raise refused(f"rotation by {int(step)}", "result ciphertext is transparent")
        return out


_TABLES: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
_TABLES_LOCK = threading.Lock()


def _tables_cached(n: int, q: int) -> tuple[np.ndarray, np.ndarray]:
    with _TABLES_LOCK:
        if (n, q) not in _TABLES:
            _TABLES[(n, q)] = seal_ntt_tables(n, q)
        return _TABLES[(n, q)]


_STATE: dict[str, object] = {}
_STATE_LOCK = threading.Lock()


def _library() -> ctypes.CDLL | None:
    """The kernel library after its self-test, once per process; None where absent or failed (logged)."""
    with _STATE_LOCK:
        if "library" in _STATE:
            return _STATE["library"]  # type: ignore[return-value]
        library, reason = None, None
        try:
            from polyfhe.engines.seal.native import native_available

            if os.environ.get(HOIST_ENV, "1") == "0":
                reason = f"{HOIST_ENV}=0"
            elif not native_available():
                reason = "SEAL's functions are not called natively"
            else:
                library = _open()
                if library is None:
                    reason = ("the package was built without polyfhe/engines/seal/_hoist.c (reinstall it where a C "
                              "compiler is present, pip install -e .)")
                else:
                    mismatch = self_test(library)
                    if mismatch:
                        library, reason = None, f"self-test failed: {mismatch}"
        except Exception as exc:  # noqa: BLE001 - whatever fails, rotations stay SEAL's: remember it
            library, reason = None, f"{type(exc).__name__}: {exc}"
        if library is None:
            log.info("rotations are not hoisted (each is SEAL's own): %s", reason)
        _STATE["library"] = library
        return library


def hoisting_available() -> bool:
    return _library() is not None


def hoister_for(seal, galois_keys, native) -> Hoister | None:
    """A :class:`Hoister` for these keys, or None where hoisting is off (or there is no native path)."""
    if native is None or galois_keys is None:
        return None
    library = _library()
    return None if library is None else Hoister(library, seal, galois_keys, native)


def self_test(library: ctypes.CDLL) -> str | None:
    """SEAL's order against SEAL's rotation byte for byte, and the hoisted order against it in value, at two
    levels of a throwaway ring; the first difference, or None."""
    from polyfhe.engines.seal.native import _throwaway_ring, native_kernels
    from polyfhe.program.params import CKKSParams

    seal, keygen, public = _throwaway_ring(
        CKKSParams(poly_modulus_degree=4096, coeff_mod_bits=(60, 40, 40, 60), scale_bits=40, security="none"))
    sa, ev = seal.sa, seal.evaluator
    tool = seal.context.key_context_data().galois_tool()
    steps = (1, 5, -3)
    galois = sa.GaloisKeys()
    keygen.create_galois_keys([tool.get_elt_from_step(s) for s in steps], galois)
    secret = keygen.secret_key()
    decryptor = sa.Decryptor(seal.context, secret)
    native = native_kernels(seal)
    if native is None:
        return "no native SEAL path"
    hoister = Hoister(library, seal, galois, native)
    rng = np.random.default_rng(2)
    values = rng.uniform(-1, 1, seal.slots)
    for level in (0, 1):
        ct = sa.Ciphertext()
        sa.Encryptor(seal.context, public).encrypt(seal.encode(values, seal.parms_id_at(level), 2.0**40), ct)
        shared = hoister.decompose(ct)
        if shared is None:
            return f"decomposition declined at level {level}"
        for step in steps:
            want = sa.Ciphertext()
            ev.rotate_vector(ct, step, galois, want)
            exact = hoister.decompose(ct, permute_step=step)
            got = None if exact is None else hoister.rotate(exact, step, permuted=True)
            if got is None or seal.dump(got) != seal.dump(want) or got.scale != want.scale:
                return f"rotation by {step} at level {level} (SEAL's order) differs from SEAL's"
            hoisted = hoister.rotate(shared, step)
            if hoisted is None:
                return f"hoisted rotation by {step} declined"
            plain_want, plain_got = sa.Plaintext(), sa.Plaintext()
            decryptor.decrypt(want, plain_want)
            decryptor.decrypt(hoisted, plain_got)
            a = np.asarray(seal.encoder.decode_double(plain_want))
            b = np.asarray(seal.encoder.decode_double(plain_got))
            expected = np.roll(values, -step)  # noise at this scale: about 1e-7
            if np.abs(a - expected).max() > 1e-5 or np.abs(b - expected).max() > 1e-5:
                return f"hoisted rotation by {step} at level {level} decrypts to other values"
    return None
