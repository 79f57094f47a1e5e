"""A compiled CKKS program: its manifest plus the named numpy arrays its steps read. No pickle, no torch.

It lives below the runtime and the engines: ``run_plain``, ``client()`` and ``server()`` reach them through the
name registry (:mod:`polyfhe.program.engines`), never by import.

``save(dir)`` writes ``manifest.json`` and ``arrays.npz``; :func:`load_program` reads them back with
``allow_pickle=False`` and checks the format, the array names every step refers to, and the program id (a
hash over the manifest and the arrays), so a tampered or truncated program is refused before it runs.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from polyfhe.program.engines import get_backend, load_other_format, new_plaintext_store, plain_executor
from polyfhe.program.manifest import ProgramError, ProgramManifest, compute_program_id
from polyfhe.program.params import CKKSParams, fingerprint_params
from polyfhe.program.slot_layout import as_samples, sample_shape
from polyfhe.program.summary import ProgramSummary

__all__ = ["CKKSProgram", "SharedState", "load_program"]

log = logging.getLogger(__name__)


@dataclass
class SharedState:
    """What the servers of one program share in this process: built on first use, never saved."""

    # SEAL's encoded diagonals and biases: a polyfhe.runtime.plaintexts.PlaintextStore (made through the registry)
    plaintexts: Any = field(default_factory=new_plaintext_store)
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
        return get_backend(self.manifest.backend).client(self.manifest, **kwargs)

    def server(self, public_context: bytes, **kwargs):
        """An evaluator for one client's public context, from the engine the manifest names."""
        return get_backend(self.manifest.backend).server(self, public_context, **kwargs)

    def run_plain(self, x: Any) -> np.ndarray:
        """Simulation mode: the compiled program's own steps on plaintext, no keys and no encryption.

        What ``fhe="simulate"`` is in Concrete ML: the same packing, the same merged maps and products in the
        same order, in float64, so it shows what the program computes (its accuracy, its agreement with the
        model) at numpy speed; only CKKS's noise is missing. ``x``: one sample (``input_shape`` values) or a
        batch ``(n, ...)`` of any size, as a numpy array or torch tensor; returns ``(n, output_size)`` logits
        (``(1, output_size)`` for one sample, like ``client.decrypt``). Large batches run in chunks of what one
        ciphertext holds.
        """
        m = self.manifest
        flat = as_samples(m, x)
        if not len(flat):
            return np.zeros((0, m.output_size))
        chunk = m.samples_per_query if m.layout == "batch" else len(flat)  # single layout: run_plain packs lanes
        run_plain = plain_executor()
        return np.concatenate([run_plain(m, self.arrays, flat[i:i + chunk]) for i in range(0, len(flat), chunk)])

    def summary(self) -> ProgramSummary:
        """What the program is and what compiling it measured: a dict (keys as in ``manifest.info`` plus the
        program's shape and parameters) that ``print()`` shows as a readable table."""
        m = self.manifest
        return ProgramSummary(
            {"program_id": m.program_id, "backend": m.backend, "layout": m.layout, "params": m.params.to_dict(),
             "input_shape": list(m.input_shape), "output_size": m.output_size, "depth": m.depth,
             "steps": len(m.steps), "galois_keys": len(m.galois_steps), **m.info}, title=repr(self))

    def __repr__(self) -> str:
        m = self.manifest
        size = _bytes(sum(a.nbytes for a in self.arrays.values()))
        return (f"CKKSProgram(id={m.program_id}, backend={m.backend}, layout={m.layout}, "
                f"N={m.params.poly_modulus_degree}, depth={m.depth}, input={sample_shape(m)}, "
                f"outputs={m.output_size}, steps={len(m.steps)}, arrays={len(self.arrays)} ({size}))")


def _bytes(n: int) -> str:
    for unit, size in (("GB", 2**30), ("MB", 2**20), ("kB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _require_file(root: Path, path: Path) -> None:
    if not path.is_file():
        raise ProgramError(f"{root} is not a CKKS program directory: {path.name} is missing "
                           "(create one with `polyfhe export MODEL --target ckks --out DIR`)")


def load_program(directory: str | Path) -> CKKSProgram:
    """Load and verify a program saved by :meth:`CKKSProgram.save` (or a Concrete ML program's ``save``: then a
    :class:`~polyfhe.engines.concrete.program.ConcreteProgram`)."""
    root = Path(directory)
    if not root.is_dir():
        what = "is a file, not a program folder" if root.exists() else "does not exist"
        raise ProgramError(f"{root} {what}; a CKKS program is a folder holding manifest.json and arrays.npz "
                           "(create one with `polyfhe export MODEL --target ckks --out DIR`)")
    other = load_other_format(root)
    if other is not None:
        return other
    manifest_path, arrays_path = root / "manifest.json", root / "arrays.npz"
    _require_file(root, manifest_path)
    try:  # the manifest first: a broken one is the problem to name, whatever else is missing
        manifest = ProgramManifest.from_dict(json.loads(manifest_path.read_text()))
    except json.JSONDecodeError as exc:
        raise ProgramError(f"{manifest_path} is not valid JSON: {exc}") from exc
    _require_file(root, arrays_path)
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
