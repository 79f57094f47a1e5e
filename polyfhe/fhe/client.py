"""The key holder: generates keys, encrypts inputs, decrypts results. The secret key never leaves it."""

from __future__ import annotations

import logging
import time

import numpy as np

from polyfhe.fhe.execute import pack_single, unpack_single
from polyfhe.fhe.params import fingerprint_params
from polyfhe.fhe.program import ProgramManifest
from polyfhe.fhe.seal_backend import SealContext
from polyfhe.fhe.wire import KIND_CIPHERTEXT, KIND_CONTEXT, KIND_SECRET, WireError, pack, unpack

__all__ = ["CKKSClient", "InputError", "check_input", "check_result", "galois_element", "identity_header"]

log = logging.getLogger(__name__)


class InputError(ValueError):
    """An input of the wrong shape, type or values for the program."""


def galois_element(step: int, poly_modulus_degree: int, generator: int = 3) -> int:
    """The Galois element of a left rotation by ``step`` slots: generator^step mod 2N (SEAL's generator is 3)."""
    return pow(generator, step % (poly_modulus_degree // 2), 2 * poly_modulus_degree)


def identity_header(manifest: ProgramManifest) -> dict:
    """What ties bytes to one program: its id and a fingerprint of its parameters (servers check both)."""
    return {"program_id": manifest.program_id, "params": fingerprint_params(manifest.params)}


def check_input(manifest: ProgramManifest, x) -> np.ndarray:
    """``x`` as (samples, input_size) float64, checked against the program; raises :class:`InputError`."""
    m = manifest
    arr = np.asarray(x)
    if arr.dtype.kind not in "fiub":
        raise InputError(f"input dtype {arr.dtype} is not real numeric; expected float images "
                         f"of shape {tuple(m.input_shape)}")
    arr = arr.astype(np.float64)
    per_sample = m.input_size
    if arr.size == per_sample:
        arr = arr.reshape(1, per_sample)
    elif arr.ndim > 1 and arr.shape[0] > 0 and int(np.prod(arr.shape[1:])) == per_sample:
        arr = arr.reshape(-1, per_sample)
    else:
        raise InputError(f"input of shape {arr.shape} is neither one sample of shape {tuple(m.input_shape)} "
                         f"({per_sample} values) nor a batch (n, ...) of such samples")
    capacity = m.samples_per_query
    if len(arr) > capacity:
        raise InputError(f"{len(arr)} samples exceed the {capacity} this program packs into one ciphertext "
                         f"({m.layout} layout); encrypt them in chunks of {capacity}")
    if not np.all(np.isfinite(arr)):
        raise InputError("input contains NaN or infinite values")
    lo, hi = m.input_range
    span = max(hi - lo, 1e-12)
    if arr.min() < lo - 0.05 * span or arr.max() > hi + 0.05 * span:
        log.warning("input values [%.3g, %.3g] fall outside the calibrated range [%.3g, %.3g]; encrypted "
                    "results may lose precision or overflow", arr.min(), arr.max(), lo, hi)
    return arr


def check_result(manifest: ProgramManifest, box) -> tuple[int, int]:
    """(count, samples) of a result container for this program; raises :class:`WireError`."""
    if box.header.get("program_id") != manifest.program_id:
        raise WireError(f"ciphertext is for program {box.header.get('program_id')!r}, this client holds "
                        f"keys for {manifest.program_id!r}")
    count, samples = int(box.header.get("count", -1)), int(box.header.get("samples", -1))
    expected = 1 if manifest.layout == "single" else manifest.output_size
    if count != expected or len(box.sections) != count:
        raise WireError(f"result holds {count} ciphertexts, expected {expected}")
    capacity = manifest.samples_per_query
    if not 1 <= samples <= capacity:
        raise WireError(f"result claims {samples} samples; one ciphertext of this program holds 1 to {capacity}")
    return count, samples


class CKKSClient:
    """Keys for one program; ``public_context()`` is what a server gets, ``encrypt``/``decrypt`` move bytes."""

    def __init__(self, manifest: ProgramManifest) -> None:
        self.manifest = manifest
        self.seal = SealContext(manifest.params)
        sa = self.seal.sa
        t0 = time.perf_counter()
        keygen = sa.KeyGenerator(self.seal.context)
        self._secret_key = keygen.secret_key()
        self.public_key = sa.PublicKey()
        keygen.create_public_key(self.public_key)
        self.relin_keys = sa.RelinKeys()
        keygen.create_relin_keys(self.relin_keys)
        self.galois_keys = None
        if manifest.galois_steps:
            self.galois_keys = sa.GaloisKeys()
            n = manifest.params.poly_modulus_degree
            elements = sorted({galois_element(step, n) for step in manifest.galois_steps})
            keygen.create_galois_keys(elements, self.galois_keys)
        self.keygen_seconds = time.perf_counter() - t0
        self._encryptor = sa.Encryptor(self.seal.context, self.public_key)
        self._decryptor = sa.Decryptor(self.seal.context, self._secret_key)
        self._header = identity_header(manifest)
        log.info("keys for program %s in %.2f s (%d Galois keys)", manifest.program_id, self.keygen_seconds,
                 len(manifest.galois_steps))

    # ------------------------------------------------------------------------------------------------------
    def public_context(self) -> bytes:
        """Public key, relinearisation keys and exactly the Galois keys the program rotates by. No secret."""
        sections = {"public_key": self.seal.dump(self.public_key), "relin_keys": self.seal.dump(self.relin_keys)}
        if self.galois_keys is not None:
            sections["galois_keys"] = self.seal.dump(self.galois_keys)
        header = {**self._header, "params_full": self.manifest.params.to_dict(),
                  "galois_steps": list(self.manifest.galois_steps)}
        return pack(KIND_CONTEXT, header, sections)

    def secret_context(self) -> bytes:
        """A private backup including the secret key; keep it on the client, never upload it."""
        sections = {"secret_key": self.seal.dump(self._secret_key), "public_key": self.seal.dump(self.public_key)}
        return pack(KIND_SECRET, {**self._header, "params_full": self.manifest.params.to_dict()}, sections)

    # ------------------------------------------------------------------------------------------------------
    def _check_input(self, x) -> np.ndarray:
        return check_input(self.manifest, x)

    def encrypt(self, x) -> bytes:
        """One sample, or a batch (n, ...) of up to ``samples_per_ciphertext`` (single) or ``slots`` (batch)."""
        arr = self._check_input(x)
        sa = self.seal.sa
        if self.manifest.layout == "single":
            columns = [pack_single(self.manifest, arr)]  # the program's public slot packing
        else:
            columns = [arr[:, i] for i in range(arr.shape[1])]
        sections = {}
        parms = self.seal.context.first_parms_id()
        for i, values in enumerate(columns):
            ct = sa.Ciphertext()
            self._encryptor.encrypt(self.seal.encode(values, parms, self.manifest.params.scale), ct)
            sections[f"ct{i}"] = self.seal.dump(ct)
        header = {**self._header, "role": "input", "count": len(columns), "samples": len(arr)}
        return pack(KIND_CIPHERTEXT, header, sections)

    def decrypt(self, data: bytes) -> np.ndarray:
        """Logits of shape (samples, output_size)."""
        box = unpack(data, KIND_CIPHERTEXT)
        count, samples = check_result(self.manifest, box)
        values = []
        for i in range(count):
            ct = self.seal.load("ciphertext", box.sections[f"ct{i}"])
            pt = self.seal.sa.Plaintext()
            self._decryptor.decrypt(ct, pt)
            values.append(np.asarray(self.seal.encoder.decode_double(pt)))
        if self.manifest.layout == "single":
            return unpack_single(self.manifest, values[0], samples)
        return np.stack([v[:samples] for v in values], axis=1)
