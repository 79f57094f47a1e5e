"""A thin, strict wrapper over TenSEAL's raw SEAL bindings (``tenseal.sealapi``).

Scales are managed exactly: a plaintext product is encoded at ``q_last * scale / ct.scale`` so that after
the rescale by ``q_last`` the ciphertext is back at exactly ``2^scale_bits``; ct x ct products drift by
``scale / q`` (about 1e-7), which the next linear map absorbs. Plaintexts are cached per program because
they depend only on the parameters, never on keys, so sessions of one program share them.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from pathlib import Path

import numpy as np

from polyfhe.fhe.params import CKKSParams

__all__ = ["DEFAULT_CACHE_BYTES", "SealContext", "SealOps", "SerializationError", "require_tenseal"]

DEFAULT_CACHE_BYTES = 2 << 30  # encoded plaintext diagonals kept per program (about 1.3 MB each at N=16384)

log = logging.getLogger(__name__)


class SerializationError(ValueError):
    """Bytes that are not a valid SEAL object for these parameters."""


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
        """Serialise a SEAL object (zstd-compressed SEAL format)."""
        fd, path = tempfile.mkstemp(prefix="polyfhe-")
        os.close(fd)
        try:
            obj.save(path)
            return Path(path).read_bytes()
        finally:
            os.unlink(path)

    def load(self, kind: str, data: bytes):
        """Deserialise bytes into a SEAL object of ``kind`` checked against this context."""
        factory = {"ciphertext": self.sa.Ciphertext, "public_key": self.sa.PublicKey,
                   "relin_keys": self.sa.RelinKeys, "galois_keys": self.sa.GaloisKeys,
                   "secret_key": self.sa.SecretKey}[kind]
        obj = factory()
        fd, path = tempfile.mkstemp(prefix="polyfhe-")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            obj.load(self.context, path)
        except Exception as exc:
            raise SerializationError(f"not a valid {kind.replace('_', ' ')} for {self.params.describe()}: "
                                     f"{type(exc).__name__}: {exc}") from exc
        finally:
            os.unlink(path)
        if not self.sa.is_valid_for(obj, self.context):
            raise SerializationError(f"{kind} does not match {self.params.describe()}")
        return obj


class SealOps:
    """:class:`~polyfhe.fhe.execute.SlotOps` on SEAL ciphertexts; ``level`` counts rescales consumed."""

    def __init__(self, seal: SealContext, relin_keys, galois_keys=None, plaintext_cache: dict | None = None,
                 max_cache_bytes: int = DEFAULT_CACHE_BYTES):
        self.seal = seal
        self.ev = seal.evaluator
        self.relin_keys = relin_keys
        self.galois_keys = galois_keys
        self.slots = seal.slots
        self.scale = seal.params.scale
        self.cache = plaintext_cache if plaintext_cache is not None else {}
        self.max_cache_bytes = max_cache_bytes
        self.counts = {"rotations": 0, "plain_products": 0, "products": 0, "rescales": 0}
        self._lock = threading.Lock()

    def _count(self, name: str) -> None:
        with self._lock:
            self.counts[name] += 1

    def level(self, ct) -> int:
        return self.seal.top_level - self.seal.chain_index(ct)

    def drop_to(self, ct, level: int):
        if self.level(ct) >= level:
            return ct
        out = self.seal.sa.Ciphertext()
        self.ev.mod_switch_to(ct, self.seal.parms_id_at(level), out)
        return out

    def rotate(self, ct, step: int):
        if self.galois_keys is None:
            raise ValueError("this program needs rotations but the context holds no Galois keys")
        out = self.seal.sa.Ciphertext()
        self.ev.rotate_vector(ct, int(step), self.galois_keys, out)
        self._count("rotations")
        return out

    def _target_scale(self, ct) -> float:
        return self.seal.last_prime(ct) * self.scale / ct.scale

    def mul_vector(self, ct, vec, key):
        scale = self._target_scale(ct)
        full_key = (key, tuple(ct.parms_id()), round(scale))
        pt = self.cache.get(full_key)
        if pt is None:
            pt = self.seal.encode(vec, ct.parms_id(), scale)
            self._remember(full_key, pt)
        out = self.seal.sa.Ciphertext()
        self.ev.multiply_plain(ct, pt, out)
        self._count("plain_products")
        return out

    def _remember(self, key, pt) -> None:
        """Cache an encoded plaintext while the cache stays within ``max_cache_bytes`` (then encode each time)."""
        size = pt.coeff_count() * 8  # N x primes at this level, 64-bit words
        with self._lock:
            used = self.cache.get("__bytes__", 0)
            if used + size <= self.max_cache_bytes:
                self.cache[key] = pt
                self.cache["__bytes__"] = used + size

    def mul_scalar(self, ct, value):
        pt = self.seal.encode(float(value), ct.parms_id(), self._target_scale(ct))
        out = self.seal.sa.Ciphertext()
        self.ev.multiply_plain(ct, pt, out)
        self._count("plain_products")
        return out

    def add(self, a, b):
        if a is None:
            return b
        self.ev.add_inplace(a, b)
        return a

    def add_vector(self, ct, vec, key):
        full_key = (key, tuple(ct.parms_id()), round(ct.scale))
        pt = self.cache.get(full_key)
        if pt is None:
            pt = self.seal.encode(vec, ct.parms_id(), ct.scale)
            self._remember(full_key, pt)
        self.ev.add_plain_inplace(ct, pt)
        return ct

    def add_scalar(self, ct, value):
        self.ev.add_plain_inplace(ct, self.seal.encode(float(value), ct.parms_id(), ct.scale))
        return ct

    def rescale(self, ct):
        self.ev.rescale_to_next_inplace(ct)
        self._count("rescales")
        return ct

    def multiply(self, a, b):
        out = self.seal.sa.Ciphertext()
        self.ev.multiply(a, b, out)
        self._count("products")
        return out

    def relin_rescale(self, ct):
        self.ev.relinearize_inplace(ct, self.relin_keys)
        return self.rescale(ct)
