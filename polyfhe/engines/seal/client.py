"""The key holder: generates keys, encrypts inputs, decrypts results. The secret key never leaves it."""

from __future__ import annotations

import logging
import time

import numpy as np

from polyfhe.engines.seal.context import SealContext
from polyfhe.program.boundary import (
    KeyMismatchError,
    check_input,
    check_result,
    galois_element,
    identity_header,
    join_results,
    open_backup,
    open_public_context,
    split_queries,
)
from polyfhe.program.manifest import ProgramManifest
from polyfhe.program.slot_layout import pack_single, unpack_single
from polyfhe.program.wire import (
    KIND_CIPHERTEXT,
    KIND_CONTEXT,
    KIND_SECRET,
    WireError,
    pack,
    unpack,
)

__all__ = ["CKKSClient"]

log = logging.getLogger(__name__)


class CKKSClient:
    """Keys for one program; ``public_context()`` is what a server gets, ``encrypt``/``decrypt`` move bytes."""

    def __init__(self, manifest: ProgramManifest) -> None:
        self._begin(manifest)
        t0 = time.perf_counter()
        keygen = self.seal.sa.KeyGenerator(self.seal.context)
        self._secret_key = keygen.secret_key()
        self.public_key = self.seal.sa.PublicKey()
        keygen.create_public_key(self.public_key)
        self._make_evaluation_keys(keygen)
        self.keygen_seconds = time.perf_counter() - t0
        self._start()
        log.info("keys for program %s in %.2f s (%d Galois keys)", manifest.program_id, self.keygen_seconds,
                 len(manifest.galois_steps))

    @classmethod
    def load(cls, manifest: ProgramManifest, secret_context: bytes,
             public_context: bytes | None = None) -> CKKSClient:
        """The client whose private backup (:meth:`secret_context`) this is: it decrypts what the original
        encrypted and what a server computed with the original's keys. With the public context saved beside the
        backup, :meth:`public_context` returns those same bytes (a server session opened with them stays
        valid); without it, relinearisation and Galois keys are derived again from the secret key (new bytes).
        Raises ``WireError``/``SerializationError`` (corrupt bytes) or :class:`KeyMismatchError`."""
        box = open_backup(manifest, secret_context)
        if "public_key" not in box.sections:
            raise WireError("the private backup holds no public key")
        self = cls.__new__(cls)
        self._begin(manifest)
        t0 = time.perf_counter()
        self._secret_key = self.seal.load("secret_key", box.sections["secret_key"])
        self.public_key = self.seal.load("public_key", box.sections["public_key"])
        if public_context is None:
            self._make_evaluation_keys(self.seal.sa.KeyGenerator(self.seal.context, self._secret_key))
        else:
            context = open_public_context(manifest, public_context)
            if bytes(context.sections.get("public_key", b"")) != bytes(box.sections["public_key"]):
                raise KeyMismatchError("the public context was made with other keys than this private backup")
            self._public_context = bytes(public_context)
        self.keygen_seconds = time.perf_counter() - t0
        self._start()
        self._check_key_pair()
        log.info("keys for program %s restored in %.2f s", manifest.program_id, self.keygen_seconds)
        return self

    def _begin(self, manifest: ProgramManifest) -> None:
        self.manifest = manifest
        self.seal = SealContext(manifest.params)
        self._header = identity_header(manifest)
        self._public_context: bytes | None = None  # a restored client's saved public context
        self.relin_keys = self.galois_keys = None

    def _make_evaluation_keys(self, keygen) -> None:
        sa = self.seal.sa
        self.relin_keys = sa.RelinKeys()
        keygen.create_relin_keys(self.relin_keys)
        if self.manifest.galois_steps:
            self.galois_keys = sa.GaloisKeys()
            n = self.manifest.params.poly_modulus_degree
            elements = sorted({galois_element(step, n) for step in self.manifest.galois_steps})
            keygen.create_galois_keys(elements, self.galois_keys)

    def _start(self) -> None:
        self._encryptor = self.seal.sa.Encryptor(self.seal.context, self.public_key)
        self._decryptor = self.seal.sa.Decryptor(self.seal.context, self._secret_key)

    def _check_key_pair(self) -> None:
        """Encrypt with the public key, decrypt with the secret key: a backup whose halves were made apart would
        otherwise decrypt every result to noise."""
        probe = np.linspace(-1.0, 1.0, 8)
        ct, pt = self.seal.sa.Ciphertext(), self.seal.sa.Plaintext()
        self._encryptor.encrypt(self.seal.encode(probe, self.seal.context.first_parms_id(),
                                                 self.manifest.params.scale), ct)
        self._decryptor.decrypt(ct, pt)
        if not np.allclose(self.seal.encoder.decode_double(pt)[: len(probe)], probe, atol=1e-3):
            raise KeyMismatchError("the private backup's public key does not belong to its secret key")

    # ------------------------------------------------------------------------------------------------------
    def public_context(self) -> bytes:
        """Public key, relinearisation keys and exactly the Galois keys the program rotates by. No secret."""
        if self._public_context is not None:
            return self._public_context
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
    def _check_input(self, x, clip: bool = False) -> np.ndarray:
        return check_input(self.manifest, x, clip)

    def encrypt(self, x, clip: bool = False) -> bytes:
        """One query: one sample, or a batch (n, ...) of up to ``samples_per_ciphertext`` (single) or ``slots``
        (batch) samples (more: :meth:`encrypt_batch`). Values outside the calibrated range are refused unless
        ``clip`` (then clipped to it, with a :class:`~polyfhe.program.boundary.NumericalWarning`)."""
        arr = self._check_input(x, clip)
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

    def encrypt_batch(self, x, clip: bool = False) -> list[bytes]:
        """Any number of samples as queries of at most ``manifest.samples_per_query`` samples each, in order;
        :meth:`decrypt` of the list of results joins their logits."""
        return [self.encrypt(chunk) for chunk in split_queries(self.manifest, x, clip)]

    def decrypt(self, data: bytes | list[bytes]) -> np.ndarray:
        """Logits of shape (samples, output_size); a list of results (:meth:`encrypt_batch`) joined in order."""
        if isinstance(data, list | tuple):
            return join_results(self.decrypt, data)
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
