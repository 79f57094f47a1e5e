"""SEAL's context: a thin, strict wrapper over TenSEAL's raw SEAL bindings (``tenseal.sealapi``).

Scales are managed exactly: a plaintext product is encoded at ``q_last * scale / ct.scale`` so that after
the rescale by ``q_last`` the ciphertext is back at exactly ``2^scale_bits``; ct x ct products drift by
``scale / q`` (about 1e-7), which the next linear map absorbs. Plaintexts are cached per program because
they depend only on the parameters, never on keys, so sessions of one program share them
(:mod:`polyfhe.runtime.plaintexts`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from polyfhe.engines.seal.dialect import Version, check_version, local_version, rewrite_headers
from polyfhe.engines.seal.errors import SealCallError, refused
from polyfhe.engines.seal.memfile import memory_file as _memory_file
from polyfhe.engines.seal.memfile import read_all as _read_all
from polyfhe.engines.seal.sealbytes import (
    HEADER,
    NestedHeaders,
    SerializationError,
    check_ciphertext,
    check_kswitch,
    check_secret_key,
    expected_bytes,
    inflate_into,
    seal_layout,
)
from polyfhe.program.params import CKKSParams

__all__ = ["SealCallError", "SealContext", "SerializationError", "require_tenseal"]

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

        Bounded before SEAL parses anything (:mod:`polyfhe.engines.seal.sealbytes`): inflated by us to at most the exact
        size the object has at these parameters, its structure walked (a Galois key set must hold exactly
        ``galois_elements``), then loaded uncompressed. Raises :class:`SerializationError` with the reason.
        """
        return self.load_with_version(kind, data, galois_elements)[0]

    def load_with_version(self, kind: str, data,
                          galois_elements: set[int] | frozenset[int] | None = None) -> tuple[object, Version]:
        """:meth:`load`, and the SEAL format version the object came in: ours, or a compatible foreign one
        (:mod:`polyfhe.engines.seal.dialect`) whose headers, all of that one version, are rewritten to ours before
        SEAL loads it. Any other version is refused before the payload is inflated."""
        version = check_version(data)
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
            nested = NestedHeaders(version)
            _STRUCTURE_CHECKS[kind](fd, length, layout, rows, what, nested)
            if version != local_version():
                log.debug("%s in SEAL format %d.%d: %d headers rewritten", what, *version, 1 + len(nested.offsets))
                rewrite_headers(fd, (0, *nested.offsets), local_version())
            try:
                obj.load(self.context, path)
            except Exception as exc:
                raise SerializationError(f"not a valid {what} for {self.params.describe()}: "
                                         f"{type(exc).__name__}: {exc}") from exc
        if not self.sa.is_valid_for(obj, self.context):
            raise SerializationError(f"{kind} does not match {self.params.describe()}")
        return obj, version


# kind -> walk of its inflated payload (fd, payload bytes, layout, Galois rows, what, nested headers): before SEAL
# parses it
_STRUCTURE_CHECKS = {
    "ciphertext": lambda fd, length, layout, rows, what, nested: check_ciphertext(fd, HEADER.size, length, layout,
                                                                                 nested=nested),
    "public_key": lambda fd, length, layout, rows, what, nested: check_ciphertext(
        fd, HEADER.size, length, layout, key_level=True, what=what, nested=nested),
    "secret_key": lambda fd, length, layout, rows, what, nested: check_secret_key(fd, length, layout, nested),
    "relin_keys": check_kswitch,  # rows None: the one relinearisation row
    "galois_keys": check_kswitch,
}
