"""Lattigo v6 through the ``orion-v2-lattigo`` (client) and ``orion-v2-evaluator`` (server) wheels.

The server lowers the program once to the evaluator's model container (:mod:`.lattigo_format`) and runs it with
Lattigo's hoisted baby-step giant-step linear transforms. The two wheels are separate Go runtimes: keys and
ciphertexts cross between them as Lattigo's binary marshalling, which is also what travels on the wire.

Lattigo does not check parameter security; polyfhe does, on the primes Lattigo actually generates (special
prime included), against the HE standard's 128-bit bounds.
"""

from __future__ import annotations

import ctypes
import json
import logging
import math
import threading
import time
from dataclasses import replace

import numpy as np

from polyfhe.engines.lattigo.bootkeys import generate_in_child
from polyfhe.engines.lattigo.bootmodel import BOOTSTRAPPING
from polyfhe.engines.lattigo.bootparams import bootstrap_key_bytes
from polyfhe.engines.lattigo.bootsecurity import check_bootstrap_security
from polyfhe.engines.lattigo.bootshape import bootstrap_key_shape, expected_bootstrap_keys
from polyfhe.engines.lattigo.format import (
    LattigoModel,
    bootstrap_spec,
    evaluation_key_set,
    galois_element,
    lattigo_params,
    lower_program,
    secret_weight,
)
from polyfhe.engines.lattigo.go_env import warn_if_missing
from polyfhe.engines.lattigo.keybytes import (
    KeyShape,
    bootstrap_keys_bytes,
    check_bootstrap_keys,
    check_ciphertext,
    check_evaluation_keys,
    evaluation_keys_bytes,
)
from polyfhe.engines.lattigo.servermem import LATTIGO_KEY_COPIES
from polyfhe.program.bootstrapping import BootstrapSpec
from polyfhe.program.boundary import (
    DEFAULT_MAX_CIPHERTEXT_BYTES,
    DEFAULT_MAX_CONTEXT_BYTES,
    InputError,
    RunStats,
    check_identity,
    check_input,
    check_result,
    identity_header,
    join_results,
    open_backup,
    open_public_context,
    open_query,
    pack_result,
    split_queries,
)
from polyfhe.program.engine_api import Backend, BackendUnavailable, CostTraits, KeySetTooLarge
from polyfhe.program.params import MAX_BITS_128, ParameterError, estimated_sizes
from polyfhe.program.slot_layout import pack_single, unpack_single
from polyfhe.program.wire import (
    KIND_CIPHERTEXT,
    KIND_CONTEXT,
    KIND_SECRET,
    MAGIC,
    MAX_HEADER,
    WireError,
    pack,
    unpack,
)

__all__ = ["BACKEND", "LattigoClient", "LattigoServer", "key_set_bytes", "lattigo_primes", "lower",
           "max_context_bytes", "modulus_bits", "planned_counts"]

log = logging.getLogger(__name__)

NAME = "lattigo"
INSTALL_HINT = "pip install orion-v2-lattigo orion-v2-evaluator (Python >= 3.11, Linux x86-64 or macOS wheels)"


def _missing(wheel: str, role: str, exc: ImportError) -> BackendUnavailable:
    return BackendUnavailable(f"the Lattigo backend's {role} needs the {wheel} wheel: {INSTALL_HINT}")


def _client_lib():
    """Lattigo's client primitives: (ckks, rlwe). Imported here, in the one module allowed to (pyproject's
    import contracts), on first use, so the registry loads without the wheels."""
    try:
        import lattigo.ckks
        import lattigo.rlwe
    except ImportError as exc:
        raise _missing("orion-v2-lattigo", "client", exc) from exc
    return lattigo.ckks, lattigo.rlwe


def _evaluator_lib():
    try:
        import orion_evaluator
    except ImportError as exc:
        raise _missing("orion-v2-evaluator", "server", exc) from exc
    return orion_evaluator


def _available() -> None:
    _client_lib()
    _evaluator_lib()


def lattigo_primes(params, bootstrap: dict | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(ciphertext primes Q[0..L], special primes) that Lattigo generates for ``params`` (for a program that
    bootstraps, primes that are also NTT primes of the bootstrapping ring)."""
    ckks, _ = _client_lib()
    p = ckks.Parameters.from_dict(lattigo_params(params, bootstrap))
    try:
        return tuple(int(q) for q in p.moduli_chain()), tuple(int(q) for q in p.aux_moduli_chain())
    finally:
        p.close()


def modulus_bits(params, bootstrap: dict | None = None) -> float:
    """log2 of the whole modulus Lattigo builds for ``params`` (ciphertext primes and the special prime)."""
    return sum(math.log2(q) for chain in lattigo_primes(params, bootstrap) for q in chain)


def lower(program) -> LattigoModel:
    """The program lowered for Lattigo's own primes (its adds' scale corrections depend on them)."""
    return lower_program(program, lattigo_primes(program.params, bootstrap_spec(program.manifest))[0])


def check_security(params, bootstrap: dict | None = None) -> None:
    """Refuse parameters past the 128-bit bound unless the program was exported with ``allow_insecure``; for a
    program that bootstraps, the bootstrapping keys' whole modulus is checked too, on the real primes: the residual
    ones as this wheel generates them, the circuit's and special ones as Lattigo adds them
    (``bootsecurity.py``)."""
    bound = MAX_BITS_128.get(params.poly_modulus_degree)
    residual_q, residual_p = lattigo_primes(params, bootstrap)
    bits = sum(math.log2(q) for q in (*residual_q, *residual_p))
    if bootstrap:
        spec = BootstrapSpec.from_dict(bootstrap)
        verdict = check_bootstrap_security(params, spec, residual_q, secret_weight(1 << spec.logn))
        if not verdict.secure:
            if params.security != "none":
                raise ParameterError(f"bootstrapping on {params.describe()} is not 128-bit secure: "
                                     f"{'; '.join(verdict.problems)}. Use fewer residual levels, a smaller scale or "
                                     "the bootstrapping ring itself as the residual ring")
            log.warning("INSECURE BOOTSTRAPPING PARAMETERS on Lattigo (N=%d): %s. Never use them for real data.",
                        params.poly_modulus_degree, "; ".join(verdict.problems))
    if bound is not None and bits <= bound:
        return
    if params.security != "none":
        raise ParameterError(f"Lattigo's primes for {params.describe()} total {bits:.2f} bits, over the 128-bit "
                             f"bound of {bound} bits for N={params.poly_modulus_degree}: export with fewer levels, "
                             "a smaller scale or a larger ring")
    log.warning("INSECURE CKKS PARAMETERS on Lattigo: %s totals %.2f bits (128-bit bound %s). Never use them for "
                "real data.", params.describe(), bits, bound)


def planned_counts(counts: dict) -> dict:
    """The lowering's predicted operation counts as run statistics, each key ``planned_*``: the evaluator does not
    measure them, so nothing reporting them may pass them off as this run's."""
    return {f"planned_{k}": v for k, v in counts.items()}


def key_set_bytes(params, keys: int) -> int:
    """Marshalled bytes of ``keys`` key-switching keys (Galois keys plus the relinearisation key): one
    ciphertext pair per ciphertext prime, over every prime including the special one (measured: 2,624 MB for
    monet_fhe_bn's 90 + 1 keys at N=16384 with 10 + 1 primes)."""
    return estimated_sizes(params, keys)["galois_keys"]  # the same layout as SEAL's uncompressed keys


def context_limit(program) -> int:
    """The public context a server accepts for ``program`` by default: the Galois key budget, plus the predicted
    bootstrapping keys (with a tenth to spare) for a program that bootstraps."""
    spec = bootstrap_spec(program.manifest)
    extra = 0 if not spec else bootstrap_key_bytes(program.params, BootstrapSpec.from_dict(spec)) * 11 // 10
    return DEFAULT_MAX_CONTEXT_BYTES + extra


def max_context_bytes(program) -> int:
    """The most bytes a valid public context for ``program`` can have on the wire: the container's prefix (magic,
    kind, u32 header length), the largest header :func:`~polyfhe.program.wire.unpack` reads, the evaluation key set
    at the one size :func:`check_evaluation_keys` accepts and, for a program that bootstraps, the bootstrapping keys
    at the one size their parameters imply (:func:`bootstrap_keys_bytes`). Exact but for the header's slack; pure
    arithmetic (no wheel). The relinearisation key is counted unless the manifest says the program needs none."""
    spec = bootstrap_spec(program.manifest)
    params = lattigo_params(program.params, spec)
    n = program.params.poly_modulus_degree
    galois_keys = len({galois_element(step, n) for step in program.manifest.galois_steps})
    needs_relin = bool(program.manifest.info.get(NAME, {}).get("needs_relin", True))
    total = len(MAGIC) + 1 + 4 + MAX_HEADER
    total += evaluation_keys_bytes(KeyShape.from_lattigo_params(params), galois_keys, needs_relin)
    if spec:
        total += bootstrap_keys_bytes(bootstrap_key_shape(params, spec))
    return total


def _check_key_set(params, galois_keys: int, needs_relin: bool) -> None:
    """Refuse at export a key set no server would accept (over its default context limit), with the numbers."""
    size = key_set_bytes(params, galois_keys + int(needs_relin))
    if size > DEFAULT_MAX_CONTEXT_BYTES:
        raise KeySetTooLarge(
            f"Lattigo needs {galois_keys} rotation keys ({size / 2**30:.1f} GiB of keys at {params.describe()}), "
            f"over the {DEFAULT_MAX_CONTEXT_BYTES / 2**30:.0f} GiB public context a server accepts: it has no "
            "composed rotations, so every rotation step the plan uses needs a key. Use backend='seal', which "
            "composes rare rotations from a bounded key set, or a model with fewer channel blocks per map")


def _prepare(program):
    """Lower once at export: the rotation steps the evaluator needs become the manifest's Galois keys."""
    from polyfhe.program.ckks_program import CKKSProgram

    check_security(program.params, bootstrap_spec(program.manifest))
    lowered = lower(program)
    _check_key_set(program.params, len(lowered.galois_steps), lowered.needs_relin)
    info = {**program.manifest.info, NAME: {"galois_keys": len(lowered.galois_steps), "needs_relin":
                                            lowered.needs_relin, "modulus_bits": round(modulus_bits(program.params), 3),
                                            **lowered.counts}}
    manifest = replace(program.manifest, backend=NAME, galois_steps=lowered.galois_steps, info=info)
    return CKKSProgram.create(manifest, program.arrays)


def _new_evaluator(module, params: dict, keys, bootstrap_keys):
    """Lattigo's evaluator on the key sections, read in place: the wheel's constructor first copies every buffer
    into ctypes memory, and Go copies it again before unmarshalling, so a server holding a 4 GB bootstrapping key
    set would peak at four copies of it; Go's own copy is the only one here. Falls back to the wheel's constructor
    where its internals differ from the version this was written for (orion-v2-evaluator 2.1)."""
    ffi = getattr(module, "ffi", None)
    internals = ("_lib_call", "_make_errout", "_check_err", "_delete_handle", "GoHandle")
    if ffi is None or not all(hasattr(ffi, name) for name in internals):
        return module.Evaluator(params, bytes(keys), None if bootstrap_keys is None else bytes(bootstrap_keys))
    arrays = [np.frombuffer(k, dtype=np.uint8) for k in (keys, bootstrap_keys) if k is not None]
    for arr in arrays:
        if not len(arr):
            raise ValueError("an empty key section")
    lib, err = ffi._lib_call(), ffi._make_errout()
    btp = arrays[1] if len(arrays) > 1 else None
    handle = lib.EvalNewEvaluator(json.dumps(params).encode(), ctypes.c_void_p(arrays[0].ctypes.data),
                                  ctypes.c_ulong(len(arrays[0])),
                                  None if btp is None else ctypes.c_void_p(btp.ctypes.data),
                                  ctypes.c_ulong(0 if btp is None else len(btp)), ctypes.byref(err))
    ffi._check_err(err)
    evaluator = module.Evaluator.__new__(module.Evaluator)
    evaluator._handle = ffi.GoHandle(int(handle), tag="Evaluator", delete_fn=ffi._delete_handle)
    return evaluator


def _marshalled(key) -> bytes:
    """A Go key's bytes; the Go object is freed at once."""
    try:
        return key.marshal_binary()
    finally:
        key.close()


# ------------------------------------------------------------------------------------------------------------
class LattigoClient:
    """Keys for one program on Lattigo: the secret key stays in this process (in Go memory)."""

    def __init__(self, manifest, *, _secret: bytes | None = None, _public_context: bytes | None = None) -> None:
        """``_secret``, ``_public_context``: what :meth:`load` restores (a marshalled secret key; the public
        context packed with it, kept as is)."""
        if manifest.backend != NAME:
            raise ValueError(f"program {manifest.program_id} was exported for backend {manifest.backend!r}")
        ckks, rlwe = _client_lib()
        spec = bootstrap_spec(manifest)
        check_security(manifest.params, spec)
        self.manifest = manifest
        self._rlwe = rlwe
        self._header = {**identity_header(manifest), "backend": NAME}
        t0 = time.perf_counter()
        self._lattigo_params = lattigo_params(manifest.params, spec)
        self._params = ckks.Parameters.from_dict(self._lattigo_params)
        keygen = rlwe.KeyGenerator(self._params)
        self._secret_key = keygen.gen_secret_key() if _secret is None else self._unmarshal_secret(_secret)
        public_key = keygen.gen_public_key(self._secret_key)
        if _public_context is None:
            # packed once and kept as the only copy: the key set is gigabytes at N=16384
            self._public_context = self._pack_public_context(keygen, spec)
        else:
            keygen.close()
            self._public_context = _public_context
        self.keygen_seconds = time.perf_counter() - t0
        self._encoder = ckks.Encoder(self._params)
        self._encryptor = rlwe.Encryptor(self._params, public_key)
        self._decryptor = rlwe.Decryptor(self._params, self._secret_key)
        log.info("Lattigo keys for program %s %s in %.2f s (%d Galois keys, %.0f MB)", manifest.program_id,
                 "made" if _secret is None else "restored", self.keygen_seconds, len(manifest.galois_steps),
                 len(self._public_context) / 1e6)

    @classmethod
    def load(cls, manifest, secret_context: bytes, public_context: bytes | None = None) -> LattigoClient:
        """The client whose private backup (:meth:`secret_context`) this is. With the public context saved beside
        it, :meth:`public_context` returns those same bytes (a server session opened with them stays valid);
        without it the evaluation keys are made again from the secret key. Raises ``WireError`` or
        ``KeyMismatchError`` (keys of another program, parameters or engine)."""
        box = open_backup(manifest, secret_context)
        if public_context is not None:
            open_public_context(manifest, public_context)
            public_context = bytes(public_context)
        return cls(manifest, _secret=bytes(box.sections["secret_key"]), _public_context=public_context)

    def _unmarshal_secret(self, data: bytes):
        try:
            return self._rlwe.SecretKey.unmarshal_binary(data)
        except Exception as exc:  # the wheel raises its own error types from Go
            raise WireError(f"the private backup's secret key is not a Lattigo secret key: {exc}") from exc

    def _pack_public_context(self, keygen, spec: dict | None) -> bytes:
        """Relinearisation and Galois keys (and bootstrapping keys) packed as the public context; closes
        ``keygen`` before the bootstrapping keys are made."""
        manifest = self.manifest
        n = manifest.params.poly_modulus_degree
        relin = None
        if manifest.info.get(NAME, {}).get("needs_relin", True):
            relin = _marshalled(keygen.gen_relin_key(self._secret_key))
        galois = {}
        for step in manifest.galois_steps:  # one key at a time: Go holds one, not the whole set
            element = galois_element(step, n)
            galois[element] = _marshalled(keygen.gen_galois_key(self._secret_key, element))
        keygen.close()
        sections = {"evaluation_keys": evaluation_key_set(relin, galois)}
        del relin, galois
        if spec:
            sections["bootstrap_keys"] = [self._bootstrap_keys(spec)]
        return pack(KIND_CONTEXT, {**self._header, "params_full": manifest.params.to_dict(),
                                   "galois_steps": list(manifest.galois_steps)}, sections)

    def _bootstrap_keys(self, spec: dict) -> bytes:
        """Lattigo's bootstrapping evaluation keys (their own relinearisation, Galois and encapsulation keys on the
        bootstrapping modulus) for the spec's ring and slots, generated in a child process
        (``lattigo_bootkeys``) so that the Go heap it peaks at is gone when it ends."""
        predicted = bootstrap_key_bytes(self.manifest.params, BootstrapSpec.from_dict(spec))
        return generate_in_child(self._lattigo_params, spec, self._secret_key.marshal_binary(),
                                 secret_weight(1 << int(spec["logn"])), limit=max(4 * predicted, 1 << 28))

    def public_context(self) -> bytes:
        """Relinearisation and exactly the program's Galois keys (Lattigo's ``MemEvaluationKeySet``), and the
        bootstrapping keys of a program that bootstraps. No secret."""
        if self._public_context is None:
            raise RuntimeError("the public context was released (release_public_context); make a new client "
                               "for new keys")
        return self._public_context

    def release_public_context(self) -> None:
        """Forget the packed public context once the server has it: with bootstrapping keys it is gigabytes,
        and encrypting and decrypting need only the keys this client keeps in Go."""
        self._public_context = None

    def secret_context(self) -> bytes:
        """A private backup holding the secret key; keep it on the client, never upload it (servers refuse it)."""
        header = {**self._header, "params_full": self.manifest.params.to_dict()}
        return pack(KIND_SECRET, header, {"secret_key": self._secret_key.marshal_binary()})

    def encrypt(self, x, clip: bool = False) -> bytes:
        """One query of up to ``samples_per_ciphertext`` samples (more: :meth:`encrypt_batch`); values outside the
        calibrated range are refused unless ``clip`` (then clipped, with a ``NumericalWarning``)."""
        arr = check_input(self.manifest, x, clip)
        if self.manifest.layout != "single":
            raise InputError("the Lattigo backend runs the single layout only")
        values = pack_single(self.manifest, arr)
        params = self.manifest.params
        plaintext = self._encoder.encode(values.tolist(), params.levels, 1 << params.scale_bits)
        ct = self._encryptor.encrypt_new(plaintext)
        data = ct.marshal_binary()
        ct.close()
        plaintext.close()
        header = {**self._header, "role": "input", "count": 1, "samples": len(arr)}
        return pack(KIND_CIPHERTEXT, header, {"ct0": data})

    def encrypt_batch(self, x, clip: bool = False) -> list[bytes]:
        """Any number of samples as queries of at most ``samples_per_query`` each; :meth:`decrypt` of the list of
        results joins their logits."""
        return [self.encrypt(chunk) for chunk in split_queries(self.manifest, x, clip)]

    def decrypt(self, data: bytes | list[bytes]) -> np.ndarray:
        if isinstance(data, list | tuple):
            return join_results(self.decrypt, data)
        box = unpack(data, KIND_CIPHERTEXT)
        _, samples = check_result(self.manifest, box)
        params = self.manifest.params
        check_ciphertext(box.sections["ct0"], params.poly_modulus_degree, set(range(1, params.levels + 2)), "result")
        try:
            ct = self._rlwe.Ciphertext.unmarshal_binary(box.sections["ct0"])
        except Exception as exc:
            raise WireError(f"result is not a Lattigo ciphertext: {exc}") from exc
        plaintext = self._decryptor.decrypt_new(ct)
        values = np.asarray(self._encoder.decode(plaintext, self.manifest.params.slots))
        ct.close()
        plaintext.close()
        return unpack_single(self.manifest, values, samples)


# ------------------------------------------------------------------------------------------------------------
def _shared(program, key: str, make):
    """``program.shared.engines[key]``, made once under the program's lock (sessions starting at once share it)."""
    with program.shared.lock:
        value = program.shared.engines.get(key)
        if value is None:
            value = program.shared.engines[key] = make()
    return value


def _shared_lowering(program) -> LattigoModel:
    """The program's Lattigo lowering, checked against its manifest; without the container's bytes once the
    evaluator's model is loaded (Go holds its own copy)."""
    return _shared(program, f"{NAME}-lowered", lambda: _checked_lowering(program))


def _shared_model(program):
    """The evaluator's model (immutable once loaded); loading it drops the container's bytes from the shared
    lowering (hundreds of MB of float64 diagonals for a deep program)."""
    lowered = _shared_lowering(program)  # outside the (non-reentrant) lock that ``load`` runs under

    def load():
        model = _load_model(program, lowered)
        program.shared.engines[f"{NAME}-lowered"] = replace(lowered, data=b"")
        return model

    return _shared(program, NAME, load)


def _checked_lowering(program) -> LattigoModel:
    """The program lowered again for Lattigo, checked against its manifest."""
    lowered: LattigoModel = lower(program)
    if tuple(lowered.galois_steps) != tuple(program.manifest.galois_steps):
        raise ValueError(f"program {program.program_id}: its Galois steps do not match its Lattigo lowering "
                         "(exported by another polyfhe version?); export it again with backend='lattigo'")
    return lowered


def _load_model(program, lowered: LattigoModel):
    """The evaluator's model: Go copies the container and encodes every diagonal."""
    t0 = time.perf_counter()
    model = _evaluator_lib().Model.load(lowered.data)
    log.info("loaded Lattigo model for %s (%.0f MB) in %.2f s", program.program_id, len(lowered.data) / 1e6,
             time.perf_counter() - t0)
    return model


class LattigoServer:
    """Runs a program on one client's evaluation keys. Lattigo's evaluator is not thread-safe: runs are serialised
    per session (different sessions run in parallel, each on its own evaluator)."""

    def __init__(self, program, public_context: bytes, *, max_context_bytes: int | None = None,
                 max_ciphertext_bytes: int = DEFAULT_MAX_CIPHERTEXT_BYTES, **_ignored) -> None:
        self.program = program
        self.max_ciphertext_bytes = max_ciphertext_bytes
        limit = context_limit(program) if max_context_bytes is None else max_context_bytes
        box = unpack(public_context, KIND_CONTEXT, max_bytes=limit)
        check_identity(box.header, program, "public context")
        if box.header.get("backend") != NAME or "evaluation_keys" not in box.sections:
            raise WireError(f"public context was made for backend {box.header.get('backend', 'seal')!r}; this "
                            f"program runs on {NAME!r} (make keys with this program's client)")
        evaluator = _evaluator_lib()
        warn_if_missing()
        self._lowered = _shared_lowering(program)
        spec = bootstrap_spec(program.manifest)
        params = lattigo_params(program.params, spec)
        if spec and "bootstrap_keys" not in box.sections:
            raise WireError(f"program {program.program_id} bootstraps, and this public context holds no "
                            "bootstrapping keys (make keys with this program's client)")
        n = program.params.poly_modulus_degree
        shape = KeyShape.from_lattigo_params(params, lattigo_primes(program.params, spec))  # exact residue bounds
        check_evaluation_keys(box.sections["evaluation_keys"], shape,
                              {galois_element(s, n) for s in program.manifest.galois_steps},
                              self._lowered.needs_relin)
        if spec:  # exactly the keys, Galois elements and prime counts Lattigo's bootstrapping parameters imply
            check_bootstrap_keys(box.sections["bootstrap_keys"],
                                 expected_bootstrap_keys(program.params, spec, shape.q_moduli))
        try:
            self._evaluator = _new_evaluator(evaluator, params, box.sections["evaluation_keys"],
                                             box.sections.get("bootstrap_keys") if spec else None)
        except Exception as exc:
            raise WireError(f"evaluation keys are not valid Lattigo keys for {program.params.describe()}: "
                            f"{exc}") from exc
        # the keys first: Go collects their copies before the diagonals are encoded, so a bootstrapping
        # server's peak is the larger of the two phases, not their sum
        self._model = _shared_model(program)
        self._lowered = _shared_lowering(program)  # without the container's bytes now
        _, self._rlwe = _client_lib()
        self._lock = threading.Lock()
        self.context_bytes = len(public_context)
        self.plaintext_store = None
        self.last_run = RunStats()

    def _load_input(self, data: bytes) -> tuple[bytes, int]:
        (raw,), samples = open_query(data, self.program, self.max_ciphertext_bytes)
        check_ciphertext(raw, self.program.params.poly_modulus_degree, {self._lowered.input_level + 1},
                         "input ciphertext")
        try:
            ct = self._rlwe.Ciphertext.unmarshal_binary(raw)
            level = ct.level()
            ct.close()
        except Exception as exc:
            raise WireError(f"input is not a Lattigo ciphertext: {exc}") from exc
        if level != self._lowered.input_level:
            raise WireError(f"input ciphertext is at level {level}; this program takes fresh ones at level "
                            f"{self._lowered.input_level}")
        return raw, samples

    def run(self, data: bytes) -> bytes:
        raw, samples = self._load_input(data)
        t0 = time.perf_counter()
        with self._lock:
            try:
                outs = self._evaluator.forward(self._model, [raw])
            except Exception as exc:  # the evaluator's own checks: scale, level, size, missing keys
                raise WireError(f"Lattigo refused the input: {exc}") from exc
        seconds = time.perf_counter() - t0
        # Lattigo's evaluator reports no operation counts: these are the lowering's predictions, named as such
        self.last_run = RunStats(seconds, planned_counts(self._lowered.counts), {})
        log.info("evaluated program %s on Lattigo in %.2f s", self.program.program_id, seconds)
        return pack_result(self.program, [outs[0]], samples, backend=NAME)


def _workload(program):
    from polyfhe.engines.lattigo.tally import compiled_workload

    return compiled_workload(program)


def _traced_linear(*args: int):
    from polyfhe.engines.lattigo.tally import traced_linear

    return traced_linear(*args)


def _probes():
    from polyfhe.engines.lattigo.probes import lattigo_probes

    return lattigo_probes(_client_lib(), _evaluator_lib())


# what a fresh server process loads before any key: its resident memory is the server's base
SERVER_IMPORTS = ("import polyfhe.runtime.execute; from polyfhe.engines.lattigo import engine as l; "
                  "l._client_lib(); l._evaluator_lib()")
# The evaluator encodes every diagonal when it loads the model, each over its level's primes and the special prime.
# A server holds the key set three times while it starts, and every diagonal as float64 twice (once in Python,
# once in Go) in its container (docs/benchmarks.md, "Memory").
COST = CostTraits(encodes_at_load=True, special_primes_in_plaintexts=1, key_copies=float(LATTIGO_KEY_COPIES),
                  container_copies=2.0, traced_linear=_traced_linear)
# Lattigo's primes lie up to a few millionths of a bit above 2^bits: the 128-bit bound is kept with a bit to spare
RESERVE_BITS = 1

# A ct x ct MatMul spread over several registers decrypted to wrong values on the evaluator for some plans
# (linear attention, tests/export/ckks/test_ckks_matmul_algorithms.py) where SEAL is exact: refused until that is
# understood, rather than answered wrongly. One register (small token grids) is as before.
MATMUL_REGISTERS = 1

BACKEND = Backend(NAME, "Lattigo v6 (hoisted BSGS) through the orion-v2 wheels", ("single",), _available, _prepare,
                  LattigoClient, LattigoServer, composes_rotations=False, bootstrapping=BOOTSTRAPPING,
                  max_context_bytes=max_context_bytes,
                  distributions=("orion-v2-lattigo", "orion-v2-evaluator"), reserve_bits=RESERVE_BITS,
                  workload=_workload, probes=_probes, server_imports=SERVER_IMPORTS, cost=COST,
                  matmul_registers=MATMUL_REGISTERS, rotate_sums=False)
