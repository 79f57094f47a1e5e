"""The manifest of a compiled CKKS program: its steps, parameters, layout and identity (JSON, no pickle).

:class:`~polyfhe.program.ckks_program.CKKSProgram` pairs it with the named arrays the steps refer to; the program id
hashes both, so a tampered or truncated program is refused before it runs.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from polyfhe.program.errors import ProgramError
from polyfhe.program.params import CKKSParams
from polyfhe.program.program_formats import LEGACY_BACKEND
from polyfhe.program.steps import Step

__all__ = ["FORMAT", "ProgramError", "ProgramManifest", "Step", "compute_program_id"]

log = logging.getLogger(__name__)

FORMAT = "polyfhe-ckks/1"
LAYOUTS = ("single", "batch")


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
    backend: str = LEGACY_BACKEND  # the engine whose client makes its keys and whose server runs it
    scheme: ClassVar[str] = "ckks"  # beside Concrete ML's programs (polyfhe.engines.concrete), which say "concrete"

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
        from polyfhe.program.engines import BACKEND_NAMES

        if d.get("backend", LEGACY_BACKEND) not in BACKEND_NAMES:
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
                backend=str(d.get("backend", LEGACY_BACKEND)), input_gather=gather,
            )
        except ProgramError:
            raise
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

    # typed views of the ``info`` entries other modules read (the JSON keeps ``info`` a free-form object)
    @property
    def model_name(self) -> str | None:
        name = self.info.get("model_name")
        return None if name is None else str(name)

    @property
    def degree(self) -> int | None:
        """The model's polynomial degree, as the analyzer found it."""
        degree = self.info.get("degree")
        return None if degree is None else int(degree)

    @property
    def input_period(self) -> int:
        """Single layout: the (virtual) slots the packed input repeats with; all virtual slots where unrecorded."""
        return int(self.info.get("input_period", self.virtual_slots))

    @property
    def planned(self) -> Mapping[str, int]:
        """Counts per query the compiler tallied (rotations, key switches, products, plaintext bytes...)."""
        return self.info.get("planned") or {}

    @property
    def bootstrap_spec(self) -> dict | None:
        """The bootstrapping parameters the program was compiled for (None: it does not bootstrap)."""
        return (self.info.get("bootstrap") or {}).get("spec")

    @property
    def engine_info(self) -> Mapping[str, Any]:
        """What the engine recorded when it lowered the program (``info[backend]``)."""
        return self.info.get(self.backend) or {}


def compute_program_id(manifest: ProgramManifest, arrays: dict[str, np.ndarray]) -> str:
    core = manifest.to_dict()
    core.pop("program_id")
    core.pop("info")
    digest = hashlib.sha256(json.dumps(core, sort_keys=True).encode())
    for name in sorted(arrays):
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(arrays[name]).tobytes())
    return digest.hexdigest()[:24]
