"""A compiled Concrete ML (TFHE) program with the same shape of API as :class:`~polyfhe.program.ckks_program.CKKSProgram`.

A program folder holds ``manifest.json``, Concrete ML's ``client.zip`` and ``server.zip`` and the folded
``model.onnx`` it was compiled from; the program id hashes the manifest and the three files, so a changed or
truncated folder is refused. ``client()`` makes keys in a worker process and hands out only evaluation keys;
``server(public_keys)`` evaluates in another, one worker per server, so a key set that kills its worker costs that
session alone. Bytes at the boundary use polyfhe's containers (:mod:`polyfhe.program.wire`), bounded and checked
for program and scheme, and evaluation keys walked against the program's key set (:mod:`.keyset`), before
Concrete ML parses a byte. A program says what a server session costs (:meth:`ConcreteProgram.max_context_bytes`,
:meth:`ConcreteProgram.session_memory_bytes`), so a server's limits and key budget count it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from polyfhe.engines.concrete import FORMAT, keyset
from polyfhe.engines.concrete.keys import check_keys_fit, describe, progress
from polyfhe.engines.concrete.worker import (
    ConcreteCallError,
    ConcreteWorkerDied,
    Worker,
    array_blob,
    blob_array,
)
from polyfhe.program.errors import ProgramError
from polyfhe.program.wire import KIND_CIPHERTEXT, KIND_CONTEXT, MAGIC, WireError, pack, unpack

__all__ = ["FORMAT", "ConcreteClient", "ConcreteManifest", "ConcreteProgram", "ConcreteServer",
           "is_concrete_program", "load_concrete_program", "load_for_serving"]

log = logging.getLogger(__name__)

FILES = ("client.zip", "server.zip", "model.onnx")
DEFAULT_MAX_KEYS_BYTES = 4 << 30  # polyfhe.engines.concrete.keys.DEFAULT_MAX_KEYS_BYTES: the server's context limit
DEFAULT_MAX_CIPHERTEXT_BYTES = 64 << 20


class ConcreteProgramError(ProgramError):
    """A program folder is missing, malformed or does not match its id (a ``ValueError``, as every program's)."""


@dataclass(frozen=True)
class ConcreteManifest:
    """What a Concrete program is: shapes, quantisation knobs and what compiling measured (``info``)."""

    input_shape: tuple[int, ...]
    output_size: int
    n_bits: int | dict
    rounding_threshold_bits: int | dict | None
    p_error: float | None
    quantization: str  # "post-training" or "quantization-aware" (and how)
    versions: dict[str, str]
    files: dict[str, str]  # file name -> sha256
    info: dict[str, Any] = field(default_factory=dict)
    program_id: str = ""
    format: str = FORMAT
    scheme: str = "concrete"
    layout: str = "single"  # one sample per query, like the CKKS single layout
    samples_per_query: int = 1

    @property
    def input_size(self) -> int:
        return int(np.prod(self.input_shape[1:]))

    def to_dict(self) -> dict:
        return {"format": self.format, "scheme": self.scheme, "program_id": self.program_id,
                "input_shape": list(self.input_shape), "output_size": self.output_size, "n_bits": self.n_bits,
                "rounding_threshold_bits": self.rounding_threshold_bits, "p_error": self.p_error,
                "quantization": self.quantization, "versions": self.versions, "files": self.files,
                "info": self.info}

    @classmethod
    def from_dict(cls, d: dict) -> ConcreteManifest:
        if d.get("format") != FORMAT:
            raise ConcreteProgramError(f"unknown program format {d.get('format')!r}; this polyfhe reads {FORMAT!r}")
        try:
            return cls(input_shape=tuple(int(i) for i in d["input_shape"]), output_size=int(d["output_size"]),
                       n_bits=d["n_bits"], rounding_threshold_bits=d.get("rounding_threshold_bits"),
                       p_error=d.get("p_error"), quantization=str(d["quantization"]),
                       versions={str(k): str(v) for k, v in d["versions"].items()},
                       files={str(k): str(v) for k, v in d["files"].items()}, info=dict(d.get("info", {})),
                       program_id=str(d.get("program_id", "")))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConcreteProgramError(f"malformed Concrete program manifest: {type(exc).__name__}: {exc}") from exc

    def identity(self) -> dict:
        """What ties keys and ciphertexts to this program (servers check it before Concrete ML parses them)."""
        return {"program_id": self.program_id, "params": self.params_fingerprint, "scheme": self.scheme}

    @property
    def params_fingerprint(self) -> str:
        return "concrete:" + self.files.get("client.zip", "")[:16]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def compute_program_id(manifest: ConcreteManifest) -> str:
    core = manifest.to_dict()
    core.pop("program_id")
    core.pop("info")
    return hashlib.sha256(json.dumps(core, sort_keys=True).encode()).hexdigest()[:24]


class ConcreteProgram:
    """Manifest + Concrete ML's artifacts; ``client()`` for the key holder, ``server(public_keys)`` for the
    evaluator. The folder it reads from stays where it is (a temporary one lives as long as this object)."""

    scheme = "concrete"

    def __init__(self, manifest: ConcreteManifest, directory: Path, owned: tempfile.TemporaryDirectory | None = None):
        self.manifest, self.directory, self._owned = manifest, Path(directory), owned
        # set by export: per-sample logits of the quantised model in the clear on the calibration inputs
        # ("calibration") and, with eval_data, on those ("quantized") and of Concrete's FHE simulation ("simulated");
        # kept in memory only, for checks and benchmarks
        self.evaluation: dict[str, np.ndarray] = {}
        self._keyset: tuple[keyset.KeySpec, ...] | None = None

    @classmethod
    def create(cls, directory: Path, input_shape: tuple[int, ...], output_size: int, settings: dict,
               quantization: str, versions: dict, info: dict,
               owned: tempfile.TemporaryDirectory | None = None) -> ConcreteProgram:
        files = {name: _sha256(Path(directory) / name) for name in FILES}
        manifest = ConcreteManifest(tuple(input_shape), int(output_size), settings["n_bits"],
                                    settings.get("rounding_threshold_bits"), settings.get("p_error"),
                                    quantization, versions, files, info)
        manifest = replace(manifest, program_id=compute_program_id(manifest))
        return cls(manifest, directory, owned)

    @property
    def program_id(self) -> str:
        return self.manifest.program_id

    @property
    def params_fingerprint(self) -> str:
        return self.manifest.params_fingerprint

    def save(self, directory: str | Path) -> Path:
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        for name in FILES:
            if (self.directory / name).resolve() != (out / name).resolve():
                shutil.copyfile(self.directory / name, out / name)
        (out / "manifest.json").write_text(json.dumps(self.manifest.to_dict(), indent=1))
        log.info("saved Concrete program %s to %s", self.program_id, out)
        return out

    def keyset(self) -> tuple[keyset.KeySpec, ...]:
        """The evaluation keys this program's client specs (``client.zip``) describe, read once."""
        if self._keyset is None:
            try:
                self._keyset = keyset.keyset_from_client_zip(self.directory / "client.zip")
            except keyset.KeysetSpecError as exc:
                raise ConcreteProgramError(f"program {self.program_id}: {exc}") from exc
        return self._keyset

    def max_context_bytes(self) -> int:
        """The most bytes a valid public context for this program can have as uploaded: the container, its header
        as :class:`ConcreteClient` writes it, and the largest key set the client specs allow."""
        keys = keyset.max_message_bytes(self.keyset())
        header = {**self.manifest.identity(), "sections": [["evaluation_keys", keys]]}
        return len(MAGIC) + 1 + 4 + len(json.dumps(header, sort_keys=True).encode()) + keys

    def session_memory_bytes(self, upload: int) -> int:
        """What a server session for a public context of ``upload`` bytes holds at its peak: the server's copy of
        the keys (to restart its worker) and the worker itself, measured (docs/concrete.md)."""
        return int(upload) + keyset.session_memory_bytes(self.keyset(), int(upload))

    def client(self, **kwargs: Any) -> ConcreteClient:
        return ConcreteClient(self, **kwargs)

    def server(self, public_keys: bytes, **kwargs: Any) -> ConcreteServer:
        return ConcreteServer(self, public_keys, **kwargs)

    def summary(self) -> dict:
        m = self.manifest
        return {"program_id": m.program_id, "scheme": m.scheme, "input_shape": list(m.input_shape),
                "output_size": m.output_size, "n_bits": m.n_bits,
                "rounding_threshold_bits": m.rounding_threshold_bits, "p_error": m.p_error,
                "quantization": m.quantization, **m.info}


def is_concrete_program(directory: str | Path) -> bool:
    """Whether ``directory`` holds a manifest that says it is a Concrete program (no other check)."""
    path = Path(directory) / "manifest.json"
    try:
        return path.is_file() and json.loads(path.read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def load_concrete_program(directory: str | Path) -> ConcreteProgram:
    """Load and verify a program saved by :meth:`ConcreteProgram.save`."""
    root = Path(directory)
    for name in ("manifest.json", *FILES):
        if not (root / name).is_file():
            raise ConcreteProgramError(f"{root} is not a Concrete program folder: {name} is missing (create one "
                                       "with `polyfhe export MODEL --target concrete --out DIR`)")
    try:
        manifest = ConcreteManifest.from_dict(json.loads((root / "manifest.json").read_text()))
    except json.JSONDecodeError as exc:
        raise ConcreteProgramError(f"{root / 'manifest.json'} is not valid JSON: {exc}") from exc
    for name in FILES:
        if manifest.files.get(name) != _sha256(root / name):
            raise ConcreteProgramError(f"{root / name} does not match the manifest (modified or corrupt program)")
    if compute_program_id(manifest) != manifest.program_id:
        raise ConcreteProgramError(f"program id mismatch in {root} (modified manifest)")
    return ConcreteProgram(manifest, root)


def load_for_serving(directory: str | Path) -> ConcreteProgram:
    """The program, for a server: its sessions run in Concrete ML's environment, so a machine without one refuses
    the program at start-up (the environment's message, naming the command that creates it), not per session."""
    from polyfhe.engines.concrete.env import ConcreteEnvMissing, find_env

    try:
        find_env()
    except ConcreteEnvMissing as exc:
        raise ConcreteProgramError(str(exc)) from exc
    return load_concrete_program(directory)


def _check_identity(header: dict, manifest: ConcreteManifest, what: str) -> None:
    if header.get("program_id") != manifest.program_id:
        raise WireError(f"{what} was made for program {header.get('program_id')!r}, this server runs "
                        f"{manifest.program_id!r}")
    if header.get("params") != manifest.params_fingerprint or header.get("scheme") != "concrete":
        raise WireError(f"{what} was made for other parameters or another scheme than this Concrete program")


class ConcreteClient:
    """Key holder: keys are made in a worker process and the secret key never leaves it (nor touches disk).

    Before any key is made, the manifest's prediction (``info["keys"]``, read from the compiled circuit) is checked
    against ``max_keys_bytes`` (the server's default context limit; None: no limit) and the memory free:
    :class:`~polyfhe.engines.concrete.keys.ConcreteKeysTooLarge` says what would not fit, in seconds."""

    def __init__(self, program: ConcreteProgram, threads: int | None = None,
                 max_keys_bytes: int | None = DEFAULT_MAX_KEYS_BYTES) -> None:
        self.program = program
        predicted = program.manifest.info.get("keys")
        check_keys_fit(predicted, max_keys_bytes)
        self._worker = Worker("client", threads=threads)
        self._worker.call("client_open", {"dir": str(program.directory.resolve())})
        t0 = time.perf_counter()
        with progress("making keys", describe(predicted) if predicted else "no size prediction in the manifest"):
            _, (keys,) = self._worker.call("keygen")
        self.keygen_seconds = time.perf_counter() - t0
        self._public = pack(KIND_CONTEXT, program.manifest.identity(), {"evaluation_keys": keys})

    @property
    def manifest(self) -> ConcreteManifest:
        return self.program.manifest

    def public_context(self) -> bytes:
        """The evaluation keys for a server, in a polyfhe container (no secret key inside)."""
        return self._public

    def encrypt(self, x: Any) -> bytes:
        m = self.program.manifest
        arr = np.asarray(x, dtype=np.float64)
        if arr.size != m.input_size:
            raise ValueError(f"input of shape {arr.shape} is not one sample of shape {m.input_shape[1:]} "
                             f"({m.input_size} values); Concrete programs take one sample per query")
        if not np.all(np.isfinite(arr)):
            raise ValueError("input contains NaN or infinite values")
        _, (ct,) = self._worker.call("encrypt", {"shape": [1, *m.input_shape[1:]]},
                                     [array_blob(arr.reshape(1, *m.input_shape[1:]))[1]])
        return pack(KIND_CIPHERTEXT, {**m.identity(), "role": "input", "count": 1, "samples": 1}, {"ct0": ct})

    def decrypt(self, data: bytes) -> np.ndarray:
        box = unpack(data, KIND_CIPHERTEXT, max_bytes=DEFAULT_MAX_CIPHERTEXT_BYTES)
        _check_identity(box.header, self.program.manifest, "result")
        if list(box.sections) != ["ct0"]:
            raise WireError("a Concrete result holds exactly one ciphertext")
        try:
            reply, (blob,) = self._worker.call("decrypt", {}, [bytes(box.sections["ct0"])])
        except ConcreteCallError as exc:
            raise WireError(f"the result was refused: {exc.message}") from None
        return blob_array(blob, reply["shape"]).reshape(1, -1)

    def close(self) -> None:
        self._worker.close()


@dataclass
class RunStats:
    seconds: float = 0.0
    counts: dict = field(default_factory=dict)
    plaintext: dict = field(default_factory=dict)


class ConcreteServer:
    """Evaluator for one client's evaluation keys, in a worker process of its own. Bad bytes get
    :class:`~polyfhe.program.wire.WireError`: keys that are not exactly a key set for the program's client specs
    before any worker starts; a worker that dies on keys or a ciphertext costs this server alone (the caller
    carries on: keys refused, or the worker restarted for the next query)."""

    def __init__(self, program: ConcreteProgram, public_context: bytes, *,
                 max_context_bytes: int = DEFAULT_MAX_KEYS_BYTES,
                 max_ciphertext_bytes: int = DEFAULT_MAX_CIPHERTEXT_BYTES, threads: int | None = None,
                 **_ignored: Any) -> None:
        self.program = program
        self.max_ciphertext_bytes = max_ciphertext_bytes
        box = unpack(public_context, KIND_CONTEXT, max_bytes=max_context_bytes)
        _check_identity(box.header, program.manifest, "public context")
        if list(box.sections) != ["evaluation_keys"]:
            raise WireError(f"a Concrete public context holds only evaluation_keys, not {sorted(box.sections)}")
        keyset.check_evaluation_keys(box.sections["evaluation_keys"], program.keyset())
        self._keys = bytes(box.sections["evaluation_keys"])
        self.context_bytes = len(public_context)
        self._worker = Worker("server", threads=threads)
        try:
            self._open()
        except BaseException:
            self._worker.close()
            raise
        self.last_run = RunStats()

    def _open(self) -> None:
        self._worker.call("server_open", {"dir": str(self.program.directory.resolve())})
        try:
            self._worker.call("server_keys", {}, [self._keys])
        except ConcreteCallError as exc:
            if exc.bad_input:
                raise WireError(f"the evaluation keys were refused: {exc.message}") from None
            raise
        except ConcreteWorkerDied as exc:  # this session's worker only: the keys are refused, nothing else ends
            if exc.out_of_memory:
                raise MemoryError(str(exc)) from None
            log.warning("Concrete server worker ended while it loaded evaluation keys: %s", exc)
            raise WireError("Concrete ML's worker ended while it loaded the evaluation keys: they are refused (this "
                            "session's worker only; the server's other sessions carry on)") from None

    def run(self, data: bytes) -> bytes:
        """Evaluate on one encrypted sample (bytes in, bytes out)."""
        box = unpack(data, KIND_CIPHERTEXT, max_bytes=self.max_ciphertext_bytes)
        _check_identity(box.header, self.program.manifest, "ciphertext")
        if list(box.sections) != ["ct0"] or box.header.get("count") != 1 or box.header.get("samples") != 1:
            raise WireError("a Concrete query holds exactly one ciphertext of one sample")
        if not self._worker.alive:  # ended since the last query (killed, or died on one): bring it back first
            self._open()
        t0 = time.perf_counter()
        try:
            reply, (out,) = self._worker.call("server_run", {}, [bytes(box.sections["ct0"])])
        except ConcreteCallError as exc:
            if exc.bad_input:
                raise WireError(f"the ciphertext was refused: {exc.message}") from None
            raise
        except ConcreteWorkerDied as exc:
            log.warning("Concrete server worker died on a query; restarting it")
            self._open()
            raise WireError(f"the ciphertext could not be evaluated ({exc}); the server carries on") from None
        self.last_run = RunStats(time.perf_counter() - t0, {"engine_seconds": reply.get("seconds")})
        return pack(KIND_CIPHERTEXT, {**self.program.manifest.identity(), "role": "output", "count": 1,
                                      "samples": 1}, {"ct0": out})

    def close(self) -> None:
        self._worker.close()
