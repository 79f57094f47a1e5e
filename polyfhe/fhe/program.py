"""A compiled CKKS program: a JSON manifest plus named numpy arrays. No pickle, no torch.

``save(dir)`` writes ``manifest.json`` and ``arrays.npz``; :func:`load_program` reads them back with
``allow_pickle=False`` and checks the format, the array names every step refers to, and the program id (a
hash over the manifest and the arrays), so a tampered or truncated program is refused before it runs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from polyfhe.fhe.params import CKKSParams
from polyfhe.fhe.plaintexts import PlaintextStore

__all__ = ["FORMAT", "CKKSProgram", "ProgramError", "ProgramManifest", "Step", "load_program"]

log = logging.getLogger(__name__)

FORMAT = "polyfhe-ckks/1"
LAYOUTS = ("single", "batch")


class ProgramError(ValueError):
    """A program directory is missing, malformed or does not match its id."""


@dataclass(frozen=True)
class Step:
    """One instruction: ``op`` in {"linear", "mul", "matmul"}; ``level`` = rescales consumed once it is done."""

    op: str
    out: int
    inputs: tuple[int, ...]
    size: int
    level: int
    attrs: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"op": self.op, "out": self.out, "inputs": list(self.inputs), "size": self.size,
                "level": self.level, "attrs": self.attrs}

    @classmethod
    def from_dict(cls, d: dict) -> Step:
        return cls(str(d["op"]), int(d["out"]), tuple(int(i) for i in d["inputs"]), int(d["size"]),
                   int(d["level"]), dict(d.get("attrs", {})))

    def reads(self) -> list[int]:
        """Registers this step reads: its inputs and its linear terms' inputs."""
        return sorted({*self.inputs, *(int(t["input"]) for t in self.attrs.get("terms", []))})

    def array_names(self) -> list[str]:
        names = [t[k] for t in self.attrs.get("terms", []) for k in ("diags", "ks", "data", "indices", "indptr")
                 if k in t]
        return names + ([self.attrs["bias"]] if self.attrs.get("bias") else [])


@dataclass(frozen=True)
class ProgramManifest:
    layout: str
    params: CKKSParams
    input_shape: tuple[int, ...]
    input_size: int
    output_size: int
    output: int
    steps: tuple[Step, ...]
    galois_steps: tuple[int, ...]
    input_range: tuple[float, float]
    info: dict[str, Any] = field(default_factory=dict)  # model name, degree, depth, calibration, errors
    input_slots: tuple[int, ...] = ()  # single layout: the slot of each input element (public packing)
    output_slots: tuple[int, ...] = ()  # single layout: the slot of each output element
    samples_per_ciphertext: int = 1  # single layout: k interleaved samples (sample j in slots u*k + j)
    # single layout, replicated packing: packed value i is input element input_gather[i], at slot input_slots[i]
    # (empty: packed value i is input element i)
    input_gather: tuple[int, ...] = ()
    program_id: str = ""
    format: str = FORMAT
    backend: str = "seal"  # the engine whose client makes its keys and whose server runs it
    scheme: ClassVar[str] = "ckks"  # beside Concrete ML's programs (polyfhe.concrete), which say "concrete"

    def to_dict(self) -> dict:
        return {
            "format": self.format, "program_id": self.program_id, "layout": self.layout,
            "params": self.params.to_dict(), "input_shape": list(self.input_shape), "input_size": self.input_size,
            "output_size": self.output_size, "output": self.output, "steps": [s.to_dict() for s in self.steps],
            "galois_steps": list(self.galois_steps), "input_range": list(self.input_range), "info": self.info,
            "input_slots": list(self.input_slots), "output_slots": list(self.output_slots),
            "samples_per_ciphertext": self.samples_per_ciphertext, "backend": self.backend,
            **({"input_gather": list(self.input_gather)} if self.input_gather else {}),  # older ids stay valid
        }

    @classmethod
    def from_dict(cls, d: dict) -> ProgramManifest:
        if d.get("format") != FORMAT:
            raise ProgramError(f"unknown program format {d.get('format')!r}; this polyfhe reads {FORMAT!r}")
        if d.get("layout") not in LAYOUTS:
            raise ProgramError(f"unknown layout {d.get('layout')!r}; accepted: {list(LAYOUTS)}")
        from polyfhe.fhe.backends import BACKEND_NAMES

        if d.get("backend", "seal") not in BACKEND_NAMES:
            raise ProgramError(f"unknown backend {d.get('backend')!r}; accepted: {list(BACKEND_NAMES)}")
        try:
            lanes = int(d.get("samples_per_ciphertext", 1))
            slots = CKKSParams.from_dict(d["params"]).slots
            if lanes < 1 or lanes & (lanes - 1) or slots % lanes or (lanes > 1 and d["layout"] != "single"):
                raise ValueError(f"samples_per_ciphertext={lanes} must be a power of two dividing the {slots} "
                                 "slots, and 1 outside the single layout")
            gather = tuple(int(i) for i in d.get("input_gather", []))
            if gather and (len(gather) != len(d.get("input_slots", [])) or min(gather) < 0
                           or max(gather) >= int(d["input_size"])):
                raise ValueError(f"input_gather must give one input element (0..{int(d['input_size']) - 1}) per "
                                 f"packed slot ({len(d.get('input_slots', []))}), got {len(gather)} values")
            return cls(
                layout=d["layout"], params=CKKSParams.from_dict(d["params"]),
                input_shape=tuple(int(i) for i in d["input_shape"]), input_size=int(d["input_size"]),
                output_size=int(d["output_size"]), output=int(d["output"]),
                steps=tuple(Step.from_dict(s) for s in d["steps"]),
                galois_steps=tuple(int(g) for g in d["galois_steps"]),
                input_range=(float(d["input_range"][0]), float(d["input_range"][1])),
                info=dict(d.get("info", {})), program_id=str(d.get("program_id", "")),
                input_slots=tuple(int(i) for i in d.get("input_slots", [])),
                output_slots=tuple(int(i) for i in d.get("output_slots", [])), samples_per_ciphertext=lanes,
                backend=str(d.get("backend", "seal")), input_gather=gather,
            )
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ProgramError(f"malformed program manifest: {type(exc).__name__}: {exc}") from exc

    @property
    def samples_per_query(self) -> int:
        """Samples one input ciphertext (bundle) holds: the interleaved ones (single) or a slot each (batch)."""
        return self.samples_per_ciphertext if self.layout == "single" else self.params.slots

    @property
    def virtual_slots(self) -> int:
        """Slots one sample of the single layout spans (the plan's ring); all slots when one per ciphertext."""
        return self.params.slots // self.samples_per_ciphertext

    @property
    def depth(self) -> int:
        return max((s.level for s in self.steps), default=0)


def compute_program_id(manifest: ProgramManifest, arrays: dict[str, np.ndarray]) -> str:
    core = manifest.to_dict()
    core.pop("program_id")
    core.pop("info")
    digest = hashlib.sha256(json.dumps(core, sort_keys=True).encode())
    for name in sorted(arrays):
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(arrays[name]).tobytes())
    return digest.hexdigest()[:24]


@dataclass
class SharedState:
    """What the servers of one program share in this process: built on first use, never saved."""

    plaintexts: PlaintextStore = field(default_factory=PlaintextStore)  # SEAL's encoded diagonals and biases
    engines: dict[str, Any] = field(default_factory=dict)  # an engine's loaded model, by backend name
    lock: threading.Lock = field(default_factory=threading.Lock)  # guards ``engines`` while a model loads


@dataclass
class CKKSProgram:
    """Manifest + arrays; ``client()`` for the key holder, ``server(public_context)`` for the evaluator."""

    manifest: ProgramManifest
    arrays: dict[str, np.ndarray]
    shared: SharedState = field(default_factory=SharedState, repr=False, compare=False)

    @classmethod
    def create(cls, manifest: ProgramManifest, arrays: dict[str, np.ndarray]) -> CKKSProgram:
        return cls(replace(manifest, program_id=compute_program_id(manifest, arrays)), arrays)

    @property
    def params(self) -> CKKSParams:
        return self.manifest.params

    scheme: ClassVar[str] = "ckks"

    @property
    def program_id(self) -> str:
        return self.manifest.program_id

    @property
    def params_fingerprint(self) -> str:
        """What keys and ciphertexts made for this program carry as ``params`` (servers compare it)."""
        from polyfhe.fhe.params import fingerprint_params

        return fingerprint_params(self.params)

    def save(self, directory: str | Path) -> Path:
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(out / "arrays.npz", **self.arrays)
        (out / "manifest.json").write_text(json.dumps(self.manifest.to_dict(), indent=1))
        log.info("saved CKKS program %s to %s", self.program_id, out)
        return out

    def client(self, **kwargs):
        """The key holder for this program, from the engine the manifest names."""
        from polyfhe.fhe.backends import get_backend

        return get_backend(self.manifest.backend).client(self.manifest, **kwargs)

    def server(self, public_context: bytes, **kwargs):
        """An evaluator for one client's public context, from the engine the manifest names."""
        from polyfhe.fhe.backends import get_backend

        return get_backend(self.manifest.backend).server(self, public_context, **kwargs)

    def run_plain(self, x: np.ndarray) -> np.ndarray:
        """Execute the compiled steps on plaintext slots (no encryption): the reference for one sample batch."""
        from polyfhe.fhe.execute import run_plain

        return run_plain(self, x)

    def summary(self) -> dict:
        m = self.manifest
        return {"program_id": m.program_id, "backend": m.backend, "layout": m.layout, "params": m.params.to_dict(),
                "input_shape": list(m.input_shape), "output_size": m.output_size, "depth": m.depth,
                "steps": len(m.steps), "galois_keys": len(m.galois_steps), **m.info}


def load_program(directory: str | Path) -> CKKSProgram:
    """Load and verify a program saved by :meth:`CKKSProgram.save` (or a Concrete ML program's ``save``: then a
    :class:`~polyfhe.concrete.program.ConcreteProgram`)."""
    root = Path(directory)
    from polyfhe.concrete.program import is_concrete_program, load_concrete_program

    if is_concrete_program(root):
        return load_concrete_program(root)
    manifest_path, arrays_path = root / "manifest.json", root / "arrays.npz"
    for p in (manifest_path, arrays_path):
        if not p.is_file():
            raise ProgramError(f"{root} is not a CKKS program directory: {p.name} is missing "
                               "(create one with `polyfhe export MODEL --target ckks --out DIR`)")
    try:
        manifest = ProgramManifest.from_dict(json.loads(manifest_path.read_text()))
    except json.JSONDecodeError as exc:
        raise ProgramError(f"{manifest_path} is not valid JSON: {exc}") from exc
    try:
        with np.load(arrays_path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
    except Exception as exc:
        raise ProgramError(f"cannot read {arrays_path}: {type(exc).__name__}: {exc}") from exc
    missing = sorted({n for s in manifest.steps for n in s.array_names()} - set(arrays))
    if missing:
        raise ProgramError(f"{arrays_path} lacks arrays the program uses: {missing[:5]}")
    expected = compute_program_id(manifest, arrays)
    if expected != manifest.program_id:
        raise ProgramError(f"program id mismatch in {root}: manifest says {manifest.program_id}, "
                           f"content hashes to {expected} (modified or corrupt program)")
    return CKKSProgram(manifest, arrays)
