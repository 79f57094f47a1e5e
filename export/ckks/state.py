"""What the CKKS compiler's passes share: the caller's options, checked once, and the state the passes fill in.

:class:`CompileOptions` holds every keyword of :func:`~polyfhe.exporters.ckks.export_ckks`; :class:`CompileState`
is what flows from pass to pass (``passes/``), each pass reading some fields and writing others. The two retry
knobs (``force_bootstrap``, ``memory_spend``) are state fields the driver (``pipeline.py``) sets on a new try.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

from polyfhe.exporters.ckks.circuit import Circuit
from polyfhe.exporters.ckks.plan import Plan
from polyfhe.exporters.ckks.samples import CalibrationDataError, calibration_array
from polyfhe.program.bootstrapping import BootstrapSpec
from polyfhe.program.budgets import BATCH_MEMORY_BUDGET, GALOIS_KEY_BUDGET
from polyfhe.program.engine_api import Backend, BootstrapModel
from polyfhe.program.engines import DEFAULT_BACKEND, BackendUnavailable, get_backend
from polyfhe.program.machine import machine_memory_budget
from polyfhe.program.manifest import LAYOUTS
from polyfhe.program.params import DEFAULT_MIN_SCALE_BITS, CKKSParams

__all__ = ["BATCH_MEMORY_BUDGET", "BOOTSTRAP_MODES", "GALOIS_KEY_BUDGET", "BootstrapInstead",
           "CKKSExportError", "CompileOptions", "CompileState", "Retry", "SpendForMemory", "UnpackForMemory",
           "ValueRanges"]

BOOTSTRAP_MODES = ("auto", "off")


class CKKSExportError(ValueError):
    """The model cannot become a CKKS program (not polynomial, unsupported op, no parameters fit)."""


class Retry(Exception):
    """A pass asks the driver for another try; ``message`` says why (logged as a warning)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class SpendForMemory(Retry):
    """The server would not fit its memory budget: try again with ``memory_spend`` (the sites on their own)."""

    def __init__(self, message: str, memory_spend: dict) -> None:
        super().__init__(message)
        self.memory_spend = memory_spend


class UnpackForMemory(Retry):
    """The server would not fit its memory budget with packed bootstraps (their masked and retargeted maps hold
    more diagonals): try again bootstrapping each register alone before computing anything on its own."""


class BootstrapInstead(Retry):
    """The engine refused the leveled ring's key set: try again bootstrapping; ``refusal`` heads any later error."""

    def __init__(self, message: str, refusal: str) -> None:
        super().__init__(message)
        self.refusal = refusal


def _installed_engine(backend: str) -> Backend:
    """The engine record of ``backend``, refused as an export error when unknown or not installed."""
    try:
        engine = get_backend(backend)
        engine.available()
    except (ValueError, BackendUnavailable) as exc:
        raise CKKSExportError(str(exc)) from exc
    return engine


@dataclass(frozen=True)
class CompileOptions:
    """The caller's choices (see ``export_ckks`` for each); constructing one checks them, with the engine."""

    calibration: Any = None
    layout: str = "single"
    input_shape: tuple[int, ...] | None = None
    params: CKKSParams | None = None
    poly_modulus_degree: int | None = None
    scale_bits: int | None = None
    allow_insecure: bool = False
    batch_memory_budget: int = BATCH_MEMORY_BUDGET
    galois_key_budget: int = GALOIS_KEY_BUDGET
    samples_per_ciphertext: int | None = None
    backend: str = DEFAULT_BACKEND
    spend_levels: bool = True
    bootstrap: str = "auto"
    bootstrap_memory: int | None = None
    pack_bootstraps: bool = True
    replicate_input: bool = True
    compile_memory: int | None = None  # bytes of affine terms the lowering may hold (None: memory.py's default)
    upload_budget: int | None = None  # bytes of public context as the web page sends it (seeded keys); None: no cap
    engine: Backend = field(init=False, repr=False, compare=False)  # the record of ``backend``

    def __post_init__(self) -> None:
        try:  # tensors, datasets and loaders become one array of samples, read alike by every pass
            object.__setattr__(self, "calibration", calibration_array(self.calibration))
        except CalibrationDataError as exc:
            raise CKKSExportError(str(exc)) from exc
        if self.layout not in LAYOUTS:
            raise CKKSExportError(f"unknown layout {self.layout!r}; accepted: {list(LAYOUTS)}")
        engine = _installed_engine(self.backend)
        object.__setattr__(self, "engine", engine)
        if self.layout not in engine.layouts:
            raise CKKSExportError(f"backend {self.backend!r} runs layouts {list(engine.layouts)}, not {self.layout!r}")
        if self.upload_budget is not None and not engine.web_client:
            raise CKKSExportError(f"upload_budget sizes a web page's upload; the page is a client of SEAL programs "
                                  f"only, not of backend {self.backend!r}")
        if self.upload_budget is not None and self.upload_budget <= 0:
            raise CKKSExportError(f"upload_budget must be a positive number of bytes, got {self.upload_budget}")
        if self.compile_memory is not None and self.compile_memory <= 0:
            raise CKKSExportError(f"compile_memory must be a positive number of bytes, got {self.compile_memory}")
        if self.bootstrap not in BOOTSTRAP_MODES:
            raise CKKSExportError(f"unknown bootstrap mode {self.bootstrap!r}; accepted: {list(BOOTSTRAP_MODES)}")

    @property
    def term_memory(self) -> int | None:
        """Bytes the lowering's terms may take: ``compile_memory``, else half of this machine's memory."""
        from polyfhe.exporters.ckks.memory import COMPILE_MEMORY_FRACTION

        if self.compile_memory is not None:
            return self.compile_memory
        return machine_memory_budget(COMPILE_MEMORY_FRACTION)

    @property
    def model_input_shape(self) -> tuple[int, ...] | None:
        """``input_shape``, else the calibration samples' shape (a module without a known input size)."""
        if self.input_shape is None and isinstance(self.calibration, np.ndarray) and self.calibration.ndim >= 2:
            return tuple(self.calibration.shape[1:])
        return self.input_shape


@dataclass(frozen=True)
class ValueRanges:
    """Calibrated ranges of a circuit: the largest |value| of any register, the input range, what set them."""

    max_abs: float
    input_range: tuple[float, float]
    info: dict


@dataclass
class CompileState:
    """Everything the passes read and write for one try at compiling ``model`` (see each pass for which)."""

    model: Any
    options: CompileOptions
    force_bootstrap: bool = False  # retry knob: skip the leveled rings, bootstrap on the residual chain
    memory_spend: dict | None = None  # retry knob: the sites computed on their own for the server's memory
    proto: onnx.ModelProto | None = None
    name: str = ""
    report: Any = None  # polyfhe.analysis.AnalysisReport
    lowered: tuple[frozenset, Circuit] | None = None  # (factored sites, the circuit lower_onnx made of them)
    circuit: Circuit | None = None
    ranges: ValueRanges | None = None
    spend_info: dict | None = None
    ring: int | None = None  # the ring a level spend was decided for (else the caller's)
    min_scale_bits: int = DEFAULT_MIN_SCALE_BITS
    params: CKKSParams | None = None
    boot_spec: BootstrapSpec | None = None
    boot_memory: int | None = None
    leveled_auto: bool = False  # params were chosen among the leveled rings (a bootstrap may replace them)
    plan: Plan | None = None
    boot_info: dict | None = None
    planned: dict | None = None
    server_peak: dict | None = None
    program: Any = None  # polyfhe.program.ckks_program.CKKSProgram
    seconds: dict[str, float] = field(default_factory=dict)  # each pass's time, summed over tries

    def __post_init__(self) -> None:
        if self.ring is None:
            self.ring = self.options.poly_modulus_degree

    @property
    def engine(self) -> Backend:
        return self.options.engine

    @property
    def may_bootstrap(self) -> bool:
        """Whether a circuit too deep for the leveled rings may bootstrap instead."""
        return self.options.bootstrap == "auto" and self.engine.bootstraps and self.options.layout == "single"

    @property
    def bootstrapping(self) -> BootstrapModel:
        """The engine's bootstrapping model; only asked where a program bootstraps (or may)."""
        model = self.engine.bootstrapping
        if model is None:
            raise CKKSExportError(f"backend {self.options.backend!r} does not bootstrap")
        return model

    @property
    def single(self) -> bool:
        return self.options.layout == "single"

    @property
    def reserve_bits(self) -> int:
        """Bits the engine keeps below the 128-bit bound when primes are picked."""
        return self.engine.reserve_bits

    def retry(self, options: CompileOptions, force_bootstrap: bool, memory_spend: dict | None) -> CompileState:
        """A fresh try with these options and knobs, keeping what the front passes made (same inputs)."""
        return CompileState(model=self.model, options=options, force_bootstrap=force_bootstrap,
                            memory_spend=memory_spend, proto=self.proto, name=self.name, report=self.report,
                            lowered=self.lowered, seconds=self.seconds)
