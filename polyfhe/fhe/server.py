"""The evaluator: holds a program and a client's *public* context, turns input ciphertexts into results.

It never sees a secret key (a context with one is refused) or a plaintext. Every byte string from outside
is validated (container, program id, parameters, SEAL's own checks) and rejected with a
:class:`~polyfhe.fhe.wire.WireError` or :class:`~polyfhe.fhe.seal_backend.SerializationError`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from polyfhe.fhe.client import galois_element, identity_header
from polyfhe.fhe.execute import execute
from polyfhe.fhe.params import fingerprint_params
from polyfhe.fhe.plaintexts import PlaintextStore
from polyfhe.fhe.program import CKKSProgram
from polyfhe.fhe.seal_backend import SealContext, SealOps
from polyfhe.fhe.wire import KIND_CIPHERTEXT, KIND_CONTEXT, WireError, pack, unpack

__all__ = ["CKKSServer", "RunStats", "check_identity", "open_query", "pack_result"]

log = logging.getLogger(__name__)

DEFAULT_MAX_CONTEXT_BYTES = 4 << 30
DEFAULT_MAX_CIPHERTEXT_BYTES = 1 << 30


@dataclass
class RunStats:
    """One evaluation: its server compute time, what it did, and the program's plaintext store afterwards.

    ``counts`` holds this run's rotations, key_switches, plain_products, products (ct x ct), rescales, encodes
    (scalar_encodes among them), plaintext_hits and evictions (the store's, during the run: with sessions of one
    program running at once, theirs too), plus ``plaintext_bytes``: what the store holds after the run.
    ``plaintext`` is the store's state (:class:`~polyfhe.fhe.plaintexts.StoreStats`, totals since it was made).
    """

    seconds: float = 0.0
    counts: dict = field(default_factory=dict)
    plaintext: dict = field(default_factory=dict)


def check_identity(header: dict, program: CKKSProgram, what: str) -> None:
    if header.get("program_id") != program.program_id:
        raise WireError(f"{what} was made for program {header.get('program_id')!r}, this server runs "
                        f"{program.program_id!r}")
    if header.get("params") != fingerprint_params(program.params):
        raise WireError(f"{what} uses other CKKS parameters than {program.params.describe()}")


def open_query(data: bytes, program: CKKSProgram, max_bytes: int) -> tuple[list[bytes], int]:
    """(ciphertext sections ct0, ct1, ..., samples) of an input container for ``program``: bounded, the program's
    own, as many ciphertexts as its layout takes; raises :class:`WireError` with the reason. Engine-neutral."""
    box = unpack(data, KIND_CIPHERTEXT, max_bytes=max_bytes)
    check_identity(box.header, program, "ciphertext")
    m = program.manifest
    expected = 1 if m.layout == "single" else m.input_size
    names = [f"ct{i}" for i in range(expected)]
    if box.header.get("count") != expected or list(box.sections) != names:
        raise WireError(f"input holds {len(box.sections)} ciphertexts, the program takes {expected}")
    samples = box.header.get("samples", 1)
    capacity = m.samples_per_query
    if not isinstance(samples, int) or not 1 <= samples <= capacity:
        raise WireError(f"input claims {samples!r} samples; one ciphertext of this program holds 1 to {capacity}")
    return [box.sections[name] for name in names], samples


def pack_result(program: CKKSProgram, ciphertexts: list[bytes], samples: int, **extra) -> bytes:
    """The output container the program's client decrypts (``extra``: more header fields, e.g. the backend)."""
    header = {**identity_header(program.manifest), **extra, "role": "output", "count": len(ciphertexts),
              "samples": samples}
    return pack(KIND_CIPHERTEXT, header, {f"ct{i}": ct for i, ct in enumerate(ciphertexts)})


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
        self.seal.load("public_key", box.sections["public_key"])  # validated, not needed for evaluation
        relin = self.seal.load("relin_keys", box.sections["relin_keys"])
        galois = None
        steps = program.manifest.galois_steps
        if steps:
            if "galois_keys" not in box.sections:
                raise WireError(f"public context lacks the {len(steps)} Galois keys this program rotates with")
            n = program.params.poly_modulus_degree
            # exactly the program's keys: the decoder refuses a missing or an extra one before SEAL parses it
            galois = self.seal.load("galois_keys", box.sections["galois_keys"],
                                    galois_elements={galois_element(s, n) for s in steps})
        elif "galois_keys" in box.sections:
            raise WireError("public context holds Galois keys; this program rotates by nothing")
        self.context_bytes = len(public_context)
        cache = plaintext_cache if plaintext_cache is not None else program.shared.plaintexts
        self._ops = SealOps(self.seal, relin, galois, cache, max_cache_bytes, key_steps=steps)
        self.plaintext_store = self._ops.store
        self.last_run = RunStats()

    def _load_input(self, data: bytes) -> tuple[list, int]:
        sections, samples = open_query(data, self.program, self.max_ciphertext_bytes)
        m = self.program.manifest
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
        result = execute(self.program, self._ops, start)
        outs = [result] if self.program.manifest.layout == "single" else result
        dumped = [self.seal.dump(ct) for ct in outs]
        seconds = time.perf_counter() - t0
        after, store = self._ops.stats(), self.plaintext_store.stats()
        counts = {k: v - before[k] for k, v in after.items() if k != "plaintext_bytes"}
        counts.update(evictions=store.evictions - evictions, plaintext_bytes=store.bytes)
        self.last_run = RunStats(seconds, counts, store.to_dict())
        log.info("evaluated program %s in %.2f s (%s)", self.program.program_id, self.last_run.seconds,
                 self.last_run.counts)
        return pack_result(self.program, dumped, samples)
