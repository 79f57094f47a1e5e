"""The evaluator: holds a program and a client's *public* context, turns input ciphertexts into results.

It never sees a secret key (a context with one is refused) or a plaintext. Every byte string from outside
is validated (container, program id, parameters, SEAL's own checks) and rejected with a
:class:`~polyfhe.program.wire.WireError` or :class:`~polyfhe.engines.seal.context.SerializationError`.

A client speaks one SEAL format version, its public context's: ours, or a compatible foreign one (node-seal's,
:mod:`polyfhe.engines.seal.dialect`). Its queries must be in that version and its answers come back in it.
"""

from __future__ import annotations

import logging
import time

from polyfhe.engines.seal.context import SealContext
from polyfhe.engines.seal.dialect import Version, check_version, describe_version, local_version, to_version
from polyfhe.engines.seal.ops import SealOps
from polyfhe.program.boundary import (
    DEFAULT_MAX_CIPHERTEXT_BYTES,
    DEFAULT_MAX_CONTEXT_BYTES,
    RunStats,
    check_identity,
    galois_element,
    open_query,
    pack_result,
)
from polyfhe.program.ckks_program import CKKSProgram
from polyfhe.program.wire import KIND_CONTEXT, WireError, unpack
from polyfhe.runtime.execute import execute
from polyfhe.runtime.plaintexts import PlaintextStore

__all__ = ["CKKSServer"]

log = logging.getLogger(__name__)

class CKKSServer:
    def __init__(self, program: CKKSProgram, public_context: bytes, *,
                 max_context_bytes: int = DEFAULT_MAX_CONTEXT_BYTES,
                 max_ciphertext_bytes: int = DEFAULT_MAX_CIPHERTEXT_BYTES,
                 plaintext_cache: PlaintextStore | None = None, max_cache_bytes: int | None = None) -> None:
        """``plaintext_cache``: the plaintext store (default: the program's, shared by all its servers);
        ``max_cache_bytes``: its budget in bytes (``None`` keeps the store's own, half of the machine's memory for a new one)."""
        self.program = program
        self.max_ciphertext_bytes = max_ciphertext_bytes
        box = unpack(public_context, KIND_CONTEXT, max_bytes=max_context_bytes)
        check_identity(box.header, program, "public context")
        self.seal = SealContext(program.params)
        for name in ("public_key", "relin_keys"):
            if name not in box.sections:
                raise WireError(f"public context lacks {name.replace('_', ' ')}")
        _, version = self.seal.load_with_version("public_key", box.sections["public_key"])  # not needed to evaluate
        self.client_version: Version = version  # the client's SEAL format: of its keys, queries and answers
        relin = self._load_key("relin_keys", box.sections["relin_keys"])
        galois = None
        steps = program.manifest.galois_steps
        if steps:
            if "galois_keys" not in box.sections:
                raise WireError(f"public context lacks the {len(steps)} Galois keys this program rotates with")
            n = program.params.poly_modulus_degree
            # exactly the program's keys: the decoder refuses a missing or an extra one before SEAL parses it
            galois = self._load_key("galois_keys", box.sections["galois_keys"],
                                    galois_elements={galois_element(s, n) for s in steps})
        elif "galois_keys" in box.sections:
            raise WireError("public context holds Galois keys; this program rotates by nothing")
        self.context_bytes = len(public_context)
        cache = plaintext_cache if plaintext_cache is not None else program.shared.plaintexts
        self._ops = SealOps(self.seal, relin, galois, cache, max_cache_bytes, key_steps=steps)
        self.plaintext_store = self._ops.store
        self.last_run = RunStats()
        if self.client_version != local_version():
            log.info("a client in SEAL format %s (ours: %s): its keys and queries are read, its answers written, "
                     "in its version", describe_version(self.client_version), describe_version(local_version()))

    def _load_key(self, kind: str, data, **kwargs):
        """A public context's section, in the version of its public key (one client, one SEAL): refused on its
        header, before anything is inflated, when it is not."""
        version = check_version(data)
        if version != self.client_version:
            raise WireError(f"the public context's {kind.replace('_', ' ')} are in SEAL format "
                            f"{describe_version(version)}, its public key in {describe_version(self.client_version)}")
        return self.seal.load(kind, data, **kwargs)

    def _load_input(self, data: bytes) -> tuple[list, int]:
        sections, samples = open_query(data, self.program, self.max_ciphertext_bytes)
        m = self.program.manifest
        for section in sections:  # on the 16-byte header, before anything is inflated
            version = check_version(section)
            if version != self.client_version:
                raise WireError(f"the query's SEAL format {describe_version(version)} differs from the public "
                                f"context's {describe_version(self.client_version)}")
        cts = [self.seal.load("ciphertext", section) for section in sections]
        top = self.seal.context.first_parms_id()
        for ct in cts:
            if list(ct.parms_id()) != list(top) or ct.size() != 2:
                raise WireError("input ciphertexts must be fresh (top level, two components)")
            if ct.scale != m.params.scale:  # exactly: plaintexts are encoded for it (clients encrypt at it)
                raise WireError(f"input ciphertext scale {ct.scale:.6g} != program scale 2^{m.params.scale_bits}")
            if ct.is_transparent():
                raise WireError("input ciphertext is transparent (its second component is zero): it encrypts "
                                "nothing; encrypt with the client's public key")
        return cts, samples

    def run(self, data: bytes) -> bytes:
        """Evaluate the program on an encrypted input (bytes in, bytes out)."""
        cts, samples = self._load_input(data)
        t0 = time.perf_counter()
        before = self._ops.stats()
        evictions = self.plaintext_store.stats().evictions
        start = cts[0] if self.program.manifest.layout == "single" else cts
        result = execute(self.program.manifest, self.program.arrays, self._ops, start)
        outs = [result] if self.program.manifest.layout == "single" else result
        dumped = [to_version(self.seal.dump(ct), self.client_version) for ct in outs]  # the client's SEAL reads it
        seconds = time.perf_counter() - t0
        after, store = self._ops.stats(), self.plaintext_store.stats()
        counts = {k: v - before[k] for k, v in after.items() if k != "plaintext_bytes"}
        counts.update(evictions=store.evictions - evictions, plaintext_bytes=store.bytes)
        self.last_run = RunStats(seconds, counts, store.to_dict())
        log.info("evaluated program %s in %.2f s (%s)", self.program.program_id, self.last_run.seconds,
                 self.last_run.counts)
        return pack_result(self.program, dumped, samples)
