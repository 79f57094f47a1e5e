"""SEAL's linear-map kernels called without the GIL, so the executor's threads use every core.

TenSEAL's ``sealapi`` bindings hold Python's GIL for the whole of every SEAL call: the executor's thread pool
ran one SEAL operation at a time however many cores the machine has (measured at N=16384: a rotation took 31 ms
on one thread and 31 ms each on two). The same shared library exports SEAL's C++ entry points, and a function
called through :mod:`ctypes` runs with the GIL released. :class:`NativeSeal` calls the seven that carry a linear
map's and a product's work that way: ciphertext copy, plaintext product (``multiply_plain_ntt``), addition,
rotation (``rotate_internal``), ciphertext product (``multiply_inplace``), relinearisation
(``relinearize_internal``) and rescaling (``rescale_to_next``). Everything else (encoding, level switches,
plaintext additions) stays on the bindings.

A giant step's inner sum, ``sum_t ct_t * pt_t``, has a kernel of polyfhe's own (``polyfhe/engines/seal/_kernels.c``,
built with the package): SEAL reduces every product and writes every partial sum back to memory, while the
kernel accumulates each coefficient's products in 128 bits and reduces once, reading each plaintext once for both
polynomials of the ciphertext (3-5x faster per diagonal at N=16384, identical bytes). It reads the residues
through the objects' data pointers (:data:`CT_DATA_OFFSET`, :data:`PT_DATA_OFFSET`), whose sizes it checks on
every call; where the package was built without a C compiler it is absent and products stay on SEAL's.

What this relies on, and how it is kept safe:

* **Object addresses.** A pybind11 instance keeps a pointer to its C++ object in its first value slot, right
  after the Python object header (:func:`cpp_address`).
* **A memory pool passed by value.** ``rotate_internal``, ``multiply_inplace``, ``relinearize_internal`` and
  ``rescale_to_next`` take a ``seal::MemoryPoolHandle`` by value. Under the Itanium C++ ABI such an argument is
  a caller-owned temporary passed by address, which the callee may move from and the caller destroys afterwards.
  A fresh empty ``seal::Ciphertext`` holds a handle to SEAL's global pool as the first member of its data array
  (:data:`POOL_HANDLE_OFFSET`); that member serves as the temporary and dropping the ciphertext destroys it, so
  the pool's reference count stays balanced (the self-test checks it for each of the four).
* **No C++ exception may cross ctypes** (it would reach ``std::terminate`` and abort the process, a server with
  every client's session). SEAL is never called directly: every call goes through a wrapper of polyfhe's own
  (``polyfhe/engines/seal/_seal_shim.cpp``, C++ built with the package and linked against the same shared libstdc++ as
  SEAL) that takes the SEAL function's address and its arguments, calls it inside ``try``/``catch`` and returns
  a status with SEAL's message; :class:`NativeSeal` raises :class:`SealCallError` (``std::bad_alloc``:
  ``MemoryError``) and logs it. Values an attacker controls can make SEAL refuse an operation that passed every
  check Python can make cheaply (Galois keys whose random component is zero make every rotation's result
  "transparent"), so catching is the guarantee; the self-test makes SEAL refuse a call through the shim and
  requires the refusal back as a caught ``std::exception`` before the native path is enabled. Without the shim
  (a build without a C++ compiler) SEAL's functions are not called natively at all. :class:`SealOps
  <polyfhe.engines.seal.ops.SealOps>` raises :class:`SealCallError` for the bindings' refusals too, so both
  paths fail alike. The shim adds about 1.7 us to a call (a SEAL call that returns at once: 2.0 us against
  0.3 us called directly through ctypes); a rotation at N=16384 with 9 primes took 22.3 ms either way (fastest
  of 60, shared 2-core machine).
* **Checks before the call.** Every call first checks in Python what SEAL would check (parameters, NTT form,
  sizes, scales, a Galois key of the step's own, relinearisation keys at the key level, a next level to rescale
  to) and returns ``None`` (``False`` for the in-place calls) when anything is off; the caller then takes the
  bindings' path, which raises as before. What SEAL checks on a result (a transparent ciphertext: an all-zero
  second polynomial) is left to SEAL and the shim. Two refusals of SEAL's public ``multiply_plain`` are not
  made for a native product (``multiply_plain_ntt`` makes neither; scanning would cost a tenth of the
  product): an all-zero plaintext and a transparent result, so such a product (or a dot kernel's sum) succeeds
  natively where the bindings refuse it. Compiled programs hold no all-zero diagonal and no zero weight (the
  planner keeps non-zero entries only), so only a client's forged ciphertext gets there.
* **Only the TenSEAL build these layouts were read from** (:data:`TESTED_TENSEAL`), and only after a self-test
  on a throwaway ring has matched every kernel byte for byte against the bindings. Any other case, or
  ``POLYFHE_SEAL_NATIVE=0``, keeps the bindings, and the log says why.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import sys
import threading

import numpy as np

from polyfhe.engines.seal.errors import SealCallError, refused

__all__ = ["NATIVE_ENV", "TESTED_TENSEAL", "NativeSeal", "SealCallError", "cpp_address", "dot_available",
           "native_available", "native_kernels", "refused"]

log = logging.getLogger(__name__)

NATIVE_ENV = "POLYFHE_SEAL_NATIVE"  # "0" keeps every SEAL call on TenSEAL's bindings
TESTED_TENSEAL = "0.3.18"  # the build whose object layouts and exported symbols this module was written against

# Itanium-mangled names of the SEAL functions called (exported by TenSEAL's _sealapi_cpp extension)
SYMBOLS = {
    "assign": "_ZN4seal10CiphertextaSERKS0_",  # Ciphertext& Ciphertext::operator=(const Ciphertext&)
    "multiply_plain_ntt": "_ZNK4seal9Evaluator18multiply_plain_nttERNS_10CiphertextERKNS_9PlaintextE",
    "add_inplace": "_ZNK4seal9Evaluator11add_inplaceERNS_10CiphertextERKS1_",
    "rotate_internal": "_ZNK4seal9Evaluator15rotate_internalERNS_10CiphertextEiRKNS_10GaloisKeysENS_16MemoryPoolHandleE",
    # void Evaluator::multiply_inplace(Ciphertext&, const Ciphertext&, MemoryPoolHandle) const
    "multiply_inplace": "_ZNK4seal9Evaluator16multiply_inplaceERNS_10CiphertextERKS1_NS_16MemoryPoolHandleE",
    # void Evaluator::relinearize_internal(Ciphertext&, const RelinKeys&, size_t, MemoryPoolHandle) const
    "relinearize_internal":
        "_ZNK4seal9Evaluator20relinearize_internalERNS_10CiphertextERKNS_9RelinKeysEmNS_16MemoryPoolHandleE",
    # void Evaluator::rescale_to_next(const Ciphertext&, Ciphertext&, MemoryPoolHandle) const
    "rescale_to_next": "_ZNK4seal9Evaluator15rescale_to_nextERKNS_10CiphertextERS1_NS_16MemoryPoolHandleE",
}
VALUE_SLOT_OFFSET = 16  # pybind11 instance: PyObject header (refcount, type), then the value pointer
POOL_HANDLE_OFFSET = 80  # seal::Ciphertext: parms_id (32), is_ntt_form + padding (8), size, N, primes, scale,
# correction factor (5 x 8), then its DynArray, whose first member is the MemoryPoolHandle (a shared_ptr)
SHARED_PTR_USE_COUNT = 8  # std::shared_ptr's control block: vtable pointer, then the use count (int)
# seal::DynArray: pool handle (16), capacity, size, then its Pointer, whose first member is the data address
DYNARRAY_SIZE, DYNARRAY_DATA = 24, 32
CT_DATA_OFFSET = POOL_HANDLE_OFFSET  # seal::Ciphertext's DynArray (above)
PT_DATA_OFFSET = 48  # seal::Plaintext: parms_id (32), coeff_count (8), scale (8), then its DynArray

_VOID = ctypes.c_void_p
MESSAGE_BYTES = 512  # the shim's buffer for SEAL's message (truncated there, never overrun)
# the shim's wrapper of each SEAL function (polyfhe/engines/seal/_seal_shim.cpp), its arguments after the function's address
SHIM = {
    "assign": ("polyfhe_seal_assign", [_VOID, _VOID]),
    "multiply_plain_ntt": ("polyfhe_seal_multiply_plain_ntt", [_VOID, _VOID, _VOID]),
    "add_inplace": ("polyfhe_seal_add_inplace", [_VOID, _VOID, _VOID]),
    "rotate_internal": ("polyfhe_seal_rotate_internal", [_VOID, _VOID, ctypes.c_int, _VOID, _VOID]),
    "multiply_inplace": ("polyfhe_seal_multiply_inplace", [_VOID, _VOID, _VOID, _VOID]),
    "relinearize_internal": ("polyfhe_seal_relinearize_internal", [_VOID, _VOID, _VOID, ctypes.c_size_t, _VOID]),
    "rescale_to_next": ("polyfhe_seal_rescale_to_next", [_VOID, _VOID, _VOID, _VOID]),
}
_CAUGHT, _FOREIGN, _BAD_ALLOC = 1, 2, 3  # the shim's statuses after a C++ exception (0: done)


def cpp_address(obj) -> int:
    """Address of the C++ object a pybind11 instance wraps."""
    return ctypes.c_void_p.from_address(id(obj) + VALUE_SLOT_OFFSET).value


def _same_scale(a: float, b: float) -> bool:
    """SEAL's ``util::are_close`` for two scales (what ``add_inplace`` requires)."""
    return abs(a - b) <= sys.float_info.epsilon * max(abs(a), abs(b), 1.0)


def _data(obj, offset: int, expected: int) -> int | None:
    """Address of a SEAL object's residues, when its array holds exactly ``expected`` of them."""
    base = cpp_address(obj) + offset
    if ctypes.c_size_t.from_address(base + DYNARRAY_SIZE).value != expected:
        return None
    return ctypes.c_void_p.from_address(base + DYNARRAY_DATA).value


class NativeSeal:
    """The kernels for one :class:`~polyfhe.engines.seal.context.SealContext`; each returns ``None`` (nothing done)
    when its preconditions do not hold, and the caller uses the bindings instead; where SEAL refuses a call all
    the same it raises :class:`SealCallError`. ``library``: TenSEAL's extension (SEAL's functions);
    ``kernels``: polyfhe's own library (``_kernels.c``), or ``None`` where it is absent (``dot`` then always
    declines); ``shim``: the exception-safe wrappers (``_seal_shim.cpp``), opened here when not given (without
    them the constructor raises ImportError: SEAL is never called natively without them)."""

    def __init__(self, library: ctypes.CDLL, seal, kernels: ctypes.CDLL | None = None,
                 shim: ctypes.CDLL | None = None) -> None:
        self.seal = seal
        self.sa = seal.sa
        shim = _open_shim() if shim is None else shim
        self._evaluator = cpp_address(seal.evaluator)
        self._assign = _Guarded(library, shim, "assign")
        self._multiply = _Guarded(library, shim, "multiply_plain_ntt")
        self._add = _Guarded(library, shim, "add_inplace")
        self._rotate = _Guarded(library, shim, "rotate_internal")
        self._product = _Guarded(library, shim, "multiply_inplace")
        self._relinearize = _Guarded(library, shim, "relinearize_internal")
        self._rescale = _Guarded(library, shim, "rescale_to_next")
        self._key_parms = tuple(seal.context.key_parms_id())
        self._bits: dict[tuple, int] = {}  # parms_id -> bits of the modulus at that level (SEAL's scale bound)
        self._moduli: dict[tuple, tuple] = {}  # parms_id -> (primes, their values, floor(2^128 / q) words)
        self._drops: dict[tuple, tuple[int, int]] = {}  # parms_id -> (its last prime, bits of the next level)
        data = seal.context.first_context_data()
        while data is not None:
            self._bits[tuple(data.parms_id())] = data.total_coeff_modulus_bit_count()
            self._moduli[tuple(data.parms_id())] = _moduli(data.parms().coeff_modulus())
            below = data.next_context_data()
            if below is not None:
                self._drops[tuple(data.parms_id())] = (data.parms().coeff_modulus()[-1].value(),
                                                       below.total_coeff_modulus_bit_count())
            data = below
        self._n = seal.params.poly_modulus_degree
        self._dot, self.dot_terms = None, 0
        if kernels is not None:
            self._dot = kernels.polyfhe_dot
            self._dot.argtypes = [ctypes.c_size_t, _VOID, _VOID, _VOID, ctypes.c_size_t, ctypes.c_size_t, _VOID, _VOID]
            self._dot.restype = ctypes.c_int
            self.dot_terms = int(kernels.polyfhe_dot_max_terms())

    def copy(self, ct):
        out = self.sa.Ciphertext()
        self._assign("ciphertext copy", cpp_address(out), cpp_address(ct))
        return out

    def multiply_plain(self, ct, pt):
        """``ct * pt`` into a new ciphertext (not rescaled), or ``None``."""
        parms = tuple(ct.parms_id())
        bits = self._bits.get(parms)
        scale = ct.scale * pt.scale
        if (bits is None or not ct.is_ntt_form() or not pt.is_ntt_form() or tuple(pt.parms_id()) != parms
                or not 0.0 < scale or int(math.log2(scale)) >= bits):
            return None
        out = self.copy(ct)
        self._multiply("plaintext product", self._evaluator, cpp_address(out), cpp_address(pt))
        return out

    def dot(self, cts: list, pts: list):
        """``sum_t cts[t] * pts[t]`` into a new ciphertext (not rescaled), or ``None``: every product must be one
        ``multiply_plain`` would take and every sum one ``add_inplace`` would (one level, NTT form, two
        polynomials, products at one scale). At most :attr:`dot_terms` terms."""
        if self._dot is None or not 0 < len(cts) == len(pts) <= self.dot_terms:
            return None
        parms = tuple(cts[0].parms_id())
        bits, moduli = self._bits.get(parms), self._moduli.get(parms)
        scale = cts[0].scale * pts[0].scale
        if bits is None or not 0.0 < scale or int(math.log2(scale)) >= bits:
            return None
        primes = moduli[0]
        size = primes * self._n
        ct_data, pt_data = [], []
        for ct, pt in zip(cts, pts, strict=True):
            if (tuple(ct.parms_id()) != parms or tuple(pt.parms_id()) != parms or ct.size() != 2
                    or not ct.is_ntt_form() or not pt.is_ntt_form()
                    or not _same_scale(ct.scale * pt.scale, scale)):
                return None
            ct_data.append(_data(ct, CT_DATA_OFFSET, 2 * size))
            pt_data.append(_data(pt, PT_DATA_OFFSET, size))
        out = self.copy(cts[0])
        target = _data(out, CT_DATA_OFFSET, 2 * size)
        if target is None or None in ct_data or None in pt_data:
            return None
        terms = len(cts)
        status = self._dot(terms, (_VOID * terms)(*ct_data), (_VOID * terms)(*pt_data), target, primes, self._n,
                           moduli[1], moduli[2])
        if status != 0:
            return None
        out.scale = scale
        return out

    def add_inplace(self, a, b) -> bool:
        """``a += b``; False (nothing done) when SEAL would refuse the pair. Where SEAL refuses the sum itself (a
        transparent result) :class:`SealCallError` is raised and ``a`` may hold the sum, as with the bindings."""
        if (tuple(a.parms_id()) != tuple(b.parms_id()) or tuple(a.parms_id()) not in self._bits
                or a.is_ntt_form() != b.is_ntt_form() or not _same_scale(a.scale, b.scale)):
            return False
        self._add("addition", self._evaluator, cpp_address(a), cpp_address(b))
        return True

    def rotate(self, ct, step: int, galois_keys, has_key: bool):
        """``ct`` rotated by ``step`` with the step's own Galois key (``has_key``: the caller checked it), or
        ``None``. A step without a key is left to the bindings (SEAL would compose it, or throw)."""
        if not has_key or ct.size() != 2 or tuple(ct.parms_id()) not in self._bits or not ct.is_ntt_form():
            return None
        out = self.copy(ct)
        self._pooled(f"rotation by {int(step)}", self._rotate, cpp_address(out), int(step), cpp_address(galois_keys))
        return out

    def multiply(self, a, b):
        """``a * b`` into a new ciphertext of three polynomials (not relinearised, not rescaled), or ``None``:
        both of two polynomials, at one level, in NTT form, their product's scale within the modulus."""
        parms = tuple(a.parms_id())
        bits = self._bits.get(parms)
        scale = a.scale * b.scale
        if (bits is None or tuple(b.parms_id()) != parms or a.size() != 2 or b.size() != 2 or not a.is_ntt_form()
                or not b.is_ntt_form() or not 0.0 < scale or int(math.log2(scale)) >= bits):
            return None
        out = self.copy(a)
        self._pooled("product", self._product, cpp_address(out), cpp_address(b))
        return out

    def relinearize_inplace(self, ct, relin_keys) -> bool:
        """``ct`` (three polynomials) relinearised to two in place, as the bindings' ``relinearize_inplace``;
        False (nothing done) when SEAL would refuse it. Where SEAL refuses the result (transparent)
        :class:`SealCallError` is raised and ``ct`` may hold it, as with the bindings."""
        if (not isinstance(relin_keys, self.sa.RelinKeys) or ct.size() != 3 or tuple(ct.parms_id()) not in self._bits
                or not ct.is_ntt_form() or tuple(relin_keys.parms_id()) != self._key_parms or relin_keys.size() < 1):
            return False
        self._pooled("relinearisation", self._relinearize, cpp_address(ct), cpp_address(relin_keys), 2)
        return True

    def rescale_inplace(self, ct) -> bool:
        """``ct`` rescaled to the next level in place, as the bindings' ``rescale_to_next_inplace``; False
        (nothing done) when SEAL would refuse it: two polynomials in NTT form, not at the last level, its scale
        within this level's modulus and the rescaled one within the next's."""
        parms = tuple(ct.parms_id())
        drop = self._drops.get(parms)  # None at the last level, or not a level of this context
        if drop is None or ct.size() != 2 or not ct.is_ntt_form():
            return False
        scale = ct.scale / drop[0]  # positive exactly when ct.scale is
        if not 0.0 < scale or int(math.log2(ct.scale)) >= self._bits[parms] or int(math.log2(scale)) >= drop[1]:
            return False
        address = cpp_address(ct)
        self._pooled("rescale", self._rescale, address, address)  # SEAL's own in-place rescale does the same
        return True

    def _pooled(self, operation: str, call: _Guarded, *arguments) -> None:
        """``call`` with the evaluator, ``arguments`` and a donor's memory pool handle as its by-value last
        argument (module docstring)."""
        donor = self.sa.Ciphertext()
        try:
            call(operation, self._evaluator, *arguments, cpp_address(donor) + POOL_HANDLE_OFFSET)
        finally:
            del donor  # the callee does not destroy a by-value argument, thrown or not: the donor does


class _Guarded:
    """One SEAL function called through its shim wrapper: ``(operation, *arguments)``; a caught C++ exception
    becomes :class:`SealCallError` (``std::bad_alloc``: MemoryError)."""

    def __init__(self, library: ctypes.CDLL, shim: ctypes.CDLL, name: str) -> None:
        wrapper, argtypes = SHIM[name]
        self.address = ctypes.cast(getattr(library, SYMBOLS[name]), _VOID).value
        self.call = getattr(shim, wrapper)
        self.call.argtypes = [_VOID, *argtypes, ctypes.c_char_p, ctypes.c_size_t]
        self.call.restype = ctypes.c_int

    def status(self, *arguments) -> tuple[int, str]:
        """The shim's status (0: done) and SEAL's message."""
        message = ctypes.create_string_buffer(MESSAGE_BYTES)
        status = self.call(self.address, *arguments, message, MESSAGE_BYTES)
        return status, (message.value.decode("utf-8", "replace") if status else "")

    def __call__(self, operation: str, *arguments) -> None:
        status, reason = self.status(*arguments)
        if status == 0:
            return
        if status == _BAD_ALLOC:
            raise MemoryError(f"SEAL ran out of memory in {operation}: {reason}")
        if status not in (_CAUGHT, _FOREIGN):
            reason = f"unknown status {status} from the shim"
        raise refused(operation, reason)


def _moduli(coeff_modulus) -> tuple:
    """(primes, their values, floor(2^128 / q) as (low, high) words per prime) as the dot kernel takes them."""
    values = [m.value() for m in coeff_modulus]
    ratios = []
    for q in values:
        ratio = (1 << 128) // q
        ratios += [ratio & (2**64 - 1), ratio >> 64]
    return len(values), (ctypes.c_uint64 * len(values))(*values), (ctypes.c_uint64 * len(ratios))(*ratios)


_STATE: dict[str, object] = {}
_STATE_LOCK = threading.Lock()


def _open_shim() -> ctypes.CDLL:
    """The shim's library (``_seal_shim.cpp``) opened for ctypes; ImportError where the package was built
    without it (no C++ compiler)."""
    try:
        from polyfhe.engines.seal import _seal_shim as module
    except ImportError as exc:
        raise ImportError(f"{exc} (the package was built without polyfhe/engines/seal/_seal_shim.cpp, which every native "
                          "SEAL call needs: reinstall it where a C++ compiler is present, pip install -e .)") from exc
    return ctypes.CDLL(module.__file__)


def _library() -> ctypes.CDLL | None:
    """TenSEAL's extension opened for ctypes, once per process after the self-test; None when off (logged).
    Any failure of the checks or the self-test turns the native path off for the process (it is not retried)."""
    with _STATE_LOCK:
        if "library" in _STATE:
            return _STATE["library"]  # type: ignore[return-value]
        library, reason = None, None
        try:
            import tenseal

            if os.environ.get(NATIVE_ENV, "1") == "0":
                reason = f"{NATIVE_ENV}=0"
            elif getattr(tenseal, "__version__", None) != TESTED_TENSEAL:
                reason = f"TenSEAL {getattr(tenseal, '__version__', '?')} is not the tested {TESTED_TENSEAL}"
            elif not sys.platform.startswith("linux"):
                reason = f"tested on Linux only, not {sys.platform}"
            else:
                import _sealapi_cpp

                shim = _open_shim()  # before anything of SEAL's is called natively
                library = ctypes.CDLL(_sealapi_cpp.__file__)
                mismatch = self_test(library, shim)
                if mismatch:
                    library, reason = None, f"self-test failed: {mismatch}"
                else:
                    _STATE["shim"] = shim
        except Exception as exc:  # noqa: BLE001 - whatever fails, the bindings remain: remember it and go on
            library, reason = None, f"{type(exc).__name__}: {exc}"
        if library is None:
            log.info("SEAL kernels stay on TenSEAL's bindings (one core per evaluation): %s", reason)
        else:
            log.debug("SEAL's linear-map kernels run without the GIL (ctypes)")
        _STATE["library"] = library
        return library


def _kernels() -> ctypes.CDLL | None:
    """polyfhe's own kernel library (``_kernels.c``) once per process after its self-test; None when the
    package was built without it, the SEAL path is off, or the self-test failed (logged)."""
    library = _library()
    with _STATE_LOCK:
        if "kernels" in _STATE:
            return _STATE["kernels"]  # type: ignore[return-value]
        kernels, reason = None, None
        if library is None:
            reason = "SEAL's functions are not called natively"
        else:
            try:
                from polyfhe.engines.seal import _kernels as module

                kernels = ctypes.CDLL(module.__file__)
                mismatch = dot_self_test(library, kernels, _STATE.get("shim"))
                if mismatch:
                    kernels, reason = None, f"self-test failed: {mismatch}"
            except ImportError as exc:
                kernels, reason = None, (f"{type(exc).__name__}: {exc} (the package was built without its C "
                                         "kernels: reinstall it where a C compiler is present, pip install -e .)")
            except Exception as exc:  # noqa: BLE001 - whatever fails, products stay on SEAL's: remember it
                kernels, reason = None, f"{type(exc).__name__}: {exc}"
        if kernels is None:
            log.info("plaintext products stay on SEAL's multiply_plain and add: %s", reason)
        _STATE["kernels"] = kernels
        return kernels


def native_available() -> bool:
    """Whether SEAL's kernels run without the GIL in this process (the self-test runs on the first call)."""
    return _library() is not None


def dot_available() -> bool:
    """Whether giant steps' inner sums run on polyfhe's dot kernel in this process (after its self-test)."""
    return _kernels() is not None


def native_kernels(seal) -> NativeSeal | None:
    """:class:`NativeSeal` for ``seal`` (a SealContext), or None where the native path is off."""
    library = _library()
    return None if library is None else NativeSeal(library, seal, _kernels(), _STATE["shim"])


def residues(obj, offset: int, count: int) -> np.ndarray:
    """A writable view of a SEAL object's ``count`` residues (``offset``: :data:`CT_DATA_OFFSET` or
    :data:`PT_DATA_OFFSET`); for self-tests, which set them to extreme values."""
    address = _data(obj, offset, count)
    if address is None:
        raise ValueError(f"the object does not hold {count} residues")
    return np.ctypeslib.as_array((ctypes.c_uint64 * count).from_address(address))


def _largest_residues(seal, ct, pt) -> None:
    """Every residue of ``ct`` and ``pt`` set to q - 1 for its prime q: the largest products the kernel sums."""
    moduli = [m.value() for m in seal.context.get_context_data(ct.parms_id()).parms().coeff_modulus()]
    n = seal.params.poly_modulus_degree
    column = np.repeat(np.array(moduli, dtype=np.uint64) - np.uint64(1), n)
    residues(ct, CT_DATA_OFFSET, 2 * len(column))[:] = np.tile(column, 2)
    residues(pt, PT_DATA_OFFSET, len(column))[:] = column


def _throwaway_ring(params):
    """(SealContext, key generator, public key) of an insecure ring for a self-test."""
    from polyfhe.engines.seal.context import SealContext

    seal = SealContext(params)
    keygen = seal.sa.KeyGenerator(seal.context)
    public = seal.sa.PublicKey()
    keygen.create_public_key(public)
    return seal, keygen, public


def bound_dot(seal, cts: list, pts: list):
    """``sum_t cts[t] * pts[t]`` through the bindings' ``multiply_plain`` and ``add_inplace``: what the dot
    kernel must equal byte for byte."""
    sa, ev = seal.sa, seal.evaluator
    total = sa.Ciphertext()
    ev.multiply_plain(cts[0], pts[0], total)
    for ct, pt in zip(cts[1:], pts[1:], strict=True):
        product = sa.Ciphertext()
        ev.multiply_plain(ct, pt, product)
        ev.add_inplace(total, product)
    return total


def self_test(library: ctypes.CDLL, shim: ctypes.CDLL | None = None) -> str | None:
    """Run every kernel on a throwaway insecure ring against the bindings, and make SEAL refuse a call through
    the shim (it must come back as a caught ``std::exception`` with SEAL's message); the first difference, or
    None. Every call that takes a memory pool by value must leave the pool's reference count as the bindings'
    call does."""
    from polyfhe.program.params import CKKSParams

    seal, keygen, public = _throwaway_ring(
        CKKSParams(poly_modulus_degree=4096, coeff_mod_bits=(40, 30, 40), scale_bits=30, security="none"))
    sa, ev = seal.sa, seal.evaluator
    tool = seal.context.key_context_data().galois_tool()
    steps = (1, 3, -2)
    galois = sa.GaloisKeys()
    keygen.create_galois_keys([tool.get_elt_from_step(s) for s in steps], galois)
    rng = np.random.default_rng(0)
    ct = sa.Ciphertext()
    sa.Encryptor(seal.context, public).encrypt(seal.encode(rng.uniform(-1, 1, seal.slots), seal.parms_id_at(0),
                                                           2.0**30), ct)
    pt = seal.encode(rng.uniform(-1, 1, seal.slots), ct.parms_id(), 2.0**30)
    native = NativeSeal(library, seal, shim=shim)
    refusal = _refusal(native, seal, ct)
    if refusal:
        return refusal

    def same(a, b) -> bool:
        return seal.dump(a) == seal.dump(b) and a.scale == b.scale

    if not same(native.copy(ct), ct):
        return "ciphertext copy"
    want = sa.Ciphertext()
    ev.multiply_plain(ct, pt, want)
    got = native.multiply_plain(ct, pt)
    if got is None or not same(got, want):
        return "plaintext product"
    want = sa.Ciphertext()
    ev.add(ct, ct, want)
    got = native.copy(ct)
    if not native.add_inplace(got, ct) or not same(got, want):
        return "addition"
    pool = sa.Ciphertext()
    pool_ctrl = ctypes.c_void_p.from_address(cpp_address(pool) + POOL_HANDLE_OFFSET + 8).value
    if not pool_ctrl:
        return "memory pool handle"
    uses = ctypes.c_int.from_address(pool_ctrl + SHARED_PTR_USE_COUNT)

    def pooled(name: str, bound, call) -> str | None:
        """``bound()`` and ``call()`` (the native kernel) equal, and leaving as many pool references behind: each
        result holds one, the by-value handle none."""
        before = uses.value
        want = bound()
        middle = uses.value
        got = call()
        after = uses.value
        if got is None or not same(got, want):
            return name
        if after - middle != middle - before:
            return f"memory pool references: +{after - middle} for a native {name}, +{middle - before} bound"
        return None

    def rotated(step: int):
        out = sa.Ciphertext()
        ev.rotate_vector(ct, step, galois, out)
        return out

    for step in steps:
        mismatch = pooled(f"rotation by {step}", functools.partial(rotated, step),
                          functools.partial(native.rotate, ct, step, galois, has_key=True))
        if mismatch:
            return mismatch
    return _product_self_test(native, seal, keygen, public, ct, pooled)


def _product_self_test(native: NativeSeal, seal, keygen, public, ct, pooled) -> str | None:
    """A ciphertext product, its relinearisation and its rescale against the bindings (``pooled``: the
    comparison of :func:`self_test`); the first difference, or None."""
    sa, ev = seal.sa, seal.evaluator
    relin = sa.RelinKeys()
    keygen.create_relin_keys(relin)
    other = sa.Ciphertext()
    sa.Encryptor(seal.context, public).encrypt(seal.encode(0.5, ct.parms_id(), 2.0**30), other)

    def multiplied():
        out = sa.Ciphertext()
        ev.multiply(ct, other, out)
        return out

    def in_place(method, source, *arguments):
        """A copy of ``source`` after ``method(copy, *arguments)``; None where the native kernel declined."""
        out = native.copy(source)
        return None if method(out, *arguments) is False else out

    product = multiplied()
    relinearised = in_place(ev.relinearize_inplace, product, relin)
    return (pooled("ciphertext product", multiplied, functools.partial(native.multiply, ct, other))
            or pooled("relinearisation", functools.partial(in_place, ev.relinearize_inplace, product, relin),
                      functools.partial(in_place, native.relinearize_inplace, product, relin))
            or pooled("rescale", functools.partial(in_place, ev.rescale_to_next_inplace, relinearised),
                      functools.partial(in_place, native.rescale_inplace, relinearised)))



def _refusal(native: NativeSeal, seal, ct) -> str | None:
    """A product with a plaintext of another level, past the Python checks: SEAL's ``multiply_plain_ntt``
    throws ``invalid_argument`` before touching anything, and the shim must report it as a caught
    ``std::exception`` (status 1, not its catch-all) with SEAL's message. Logs nothing: this refusal is expected."""
    other = seal.encode(1.0, seal.parms_id_at(1), 2.0**30)
    out = native.copy(ct)
    status, reason = native._multiply.status(native._evaluator, cpp_address(out), cpp_address(other))
    if status != _CAUGHT or "mismatch" not in reason:
        return (f"a call SEAL refuses came back as status {status} ({reason!r}), not as a caught std::exception "
                "with SEAL's message")
    return None


def dot_self_test(library: ctypes.CDLL, kernels: ctypes.CDLL, shim: ctypes.CDLL | None = None) -> str | None:
    """The dot kernel against ``multiply_plain`` and ``add_inplace`` of the bindings, byte for byte, on a
    throwaway ring at two levels with a 60-bit prime (the largest products) and the most terms a call takes."""
    from polyfhe.program.params import CKKSParams

    seal, _, public = _throwaway_ring(
        CKKSParams(poly_modulus_degree=2048, coeff_mod_bits=(60, 30, 60), scale_bits=30, security="none"))
    sa = seal.sa
    encryptor = sa.Encryptor(seal.context, public)
    native = NativeSeal(library, seal, kernels, shim)
    rng = np.random.default_rng(1)
    for level, terms in ((0, native.dot_terms), (1, 3)):
        parms_id = seal.parms_id_at(level)
        cts = []
        for _ in range(terms):
            ct = sa.Ciphertext()
            encryptor.encrypt(seal.encode(rng.uniform(-1, 1, seal.slots), parms_id, 2.0**30), ct)
            cts.append(ct)
        pts = [seal.encode(rng.uniform(-1, 1, seal.slots), parms_id, 2.0**29) for _ in range(terms)]
        want = bound_dot(seal, cts, pts)
        got = native.dot(cts, pts)
        if got is None or seal.dump(got) != seal.dump(want) or got.scale != want.scale:
            return f"dot of {terms} terms at level {level}"
    _largest_residues(seal, cts[0], pts[0])  # (q - 1)^2 summed dot_terms times: within 2^8 of 128 bits
    worst = [cts[0]] * native.dot_terms, [pts[0]] * native.dot_terms
    got = native.dot(*worst)
    if got is None or seal.dump(got) != seal.dump(bound_dot(seal, *worst)):
        return f"dot of {native.dot_terms} terms of the largest residues"
    odd_scale = seal.encode(rng.uniform(-1, 1, seal.slots), cts[0].parms_id(), 2.0**28)
    if native.dot(cts, pts[:-1]) is not None or native.dot(cts[:2], [pts[0], odd_scale]) is not None:
        return "a malformed call (unequal lengths, products at two scales) was not declined"
    return None
