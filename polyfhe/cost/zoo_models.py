"""Predicted cost of a zoo model, an ONNX file or a compiled program: compile it here whenever it can be
compiled (exact operation counts: what the program will do), otherwise estimate its workload from a trace
(:func:`polyfhe.cost.workload.traced_workload`).

``model_cost("cpolynext_t_bn", 224, "lattigo")`` returns a :class:`CostReport`: the prediction, which path made
it, and, when it does not fit this machine's memory, the input size that would. ``onnx_cost("model.onnx")`` and
``program_cost(load_program(folder))`` price an ONNX file and a compiled CKKS program.

The slow steps (measuring this machine's operation costs the first time, compiling) are announced to
``progress``, a callable taking one line of text, before they start.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from polyfhe.cost.model import CostPrediction, calibrated_costs, predict
from polyfhe.cost.workload import TracedModel, program_workload, trace_model, traced_workload
from polyfhe.program.engines import DEFAULT_BACKEND, bootstrapping_engines, get_backend
from polyfhe.program.params import RING_SIZES, CKKSParams, ParameterError, choose_params

__all__ = [
    "COMPILE_LIMITS",
    "METHODS",
    "CostReport",
    "ModelTooLarge",
    "auto_compiles",
    "compiled_prediction",
    "estimate_params",
    "model_cost",
    "onnx_cost",
    "program_cost",
]

log = logging.getLogger(__name__)

Progress = Callable[[str], None]
METHODS = ("auto", "compiled", "estimated")
# "auto" compiles whatever the compiler can build here: a leveled circuit whose widest tensor fits one ciphertext
# of the largest ring, up to this many estimated plaintext products (a bound on compile time; the compiler stops
# itself, and auto falls back to the estimate, when its memory would pass half of this machine's). The traced
# estimate is a plan polyfhe does not build: on the small zoo models its latency, key bytes and memory are
# 0.01-3x the compiled program's (docs/cost-model.md), so anything that compiles is compiled.
COMPILE_LIMITS = {"widest": RING_SIZES[-1] // 2, "products": 200_000}
ASSUMED_MAX_ABS = 2.0**8  # value range an uncompiled model is priced at (sets the first prime only)
CALIBRATION_SAMPLES = 32
SYNTHETIC_NOTE = "calibrated on uniform random inputs in [0, 1]: the operation counts do not depend on the data"


class ModelTooLarge(RuntimeError):
    """The model's predicted memory exceeds this machine's; ``report`` holds the numbers and what would fit."""

    def __init__(self, report: CostReport) -> None:
        super().__init__(report.advice)
        self.report = report


@dataclass(frozen=True)
class CostReport:
    """A prediction plus how it was made and, when too big for this machine, what would fit."""

    name: str
    img_size: int | None
    prediction: CostPrediction
    method: str  # "compiled" or "estimated"
    depth: int
    fitting_img_size: int | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def advice(self) -> str:
        p = self.prediction
        if p.fits:
            return ""
        need = p.memory_needed / 1e9
        have = (p.machine_bytes or 0) / 1e9
        fit = (f"; at --img-size {self.fitting_img_size} it would fit" if self.fitting_img_size
               else "; no smaller input of this model fits either")
        return (f"{self.name} at {self.img_size}x{self.img_size} on {p.engine} needs about {need:.1f} GB "
                f"(this machine: {have:.1f} GB usable) and {p.image_seconds:,.0f} s per image here: run it on a "
                f"machine with at least {math.ceil(need * 1.25)} GB{fit}")

    def to_dict(self) -> dict:
        return {"name": self.name, "img_size": self.img_size, "method": self.method, "depth": self.depth,
                "fitting_img_size": self.fitting_img_size, "advice": self.advice, **self.prediction.to_dict(),
                "notes": [*self.notes, *self.prediction.notes]}


def estimate_params(traced: TracedModel, engine: str) -> tuple[CKKSParams, int | None]:
    """(parameters, bootstrap slots or None) an estimated plan would run on: the smallest leveled ring that holds
    the depth (multi-ciphertext tensors need no particular ring), else the cheapest bootstrapping residual chain."""
    slots = min(traced.widest, max(RING_SIZES) // 2)
    try:
        return choose_params(traced.depth, min(slots, RING_SIZES[-1] // 2), ASSUMED_MAX_ABS), None
    except ParameterError:
        model = get_backend(engine).bootstrapping
        if model is None:
            able = " or ".join(bootstrapping_engines())
            raise ParameterError(f"{traced.depth} levels do not fit any leveled ring, and {engine!r} cannot "
                                 f"bootstrap: use --backend {able}") from None
    width = min(traced.widest, model.ring // 2)
    choice = model.candidates(traced.depth, width)[0]
    return choice.params, 1 << math.ceil(math.log2(width))


def _samples(traced: TracedModel, params: CKKSParams) -> int:
    """Images one ciphertext interleaves when the widest tensor leaves room (as the compiler does)."""
    return max(1, params.slots // max(traced.widest, 1)) if traced.widest <= params.slots // 2 else 1


def _build(name: str, img_size: int | None):
    import torch

    from polyfhe.models.registry import create_model

    overrides = {"img_size": img_size} if img_size else {}
    with torch.device("meta"):
        meta = create_model(name, **overrides)
    return meta, tuple(meta.input_shape)


def _calibration(shape: tuple[int, ...]) -> np.ndarray:
    """Random images in [0, 1]: the timing of a program does not depend on its weights' training."""
    return np.random.default_rng(0).random((CALIBRATION_SAMPLES, *shape), dtype=np.float32)


def _say(progress: Progress | None, text: str) -> None:
    log.info("%s", text)
    if progress is not None:
        progress(text)


def compile_model(name: str, img_size: int | None, engine: str, **export_kwargs):
    """The zoo model compiled here (untrained; BatchNorm statistics from random images, zero heads made random)."""
    import torch
    from torch import nn

    from polyfhe.calibration import recompute_from_array
    from polyfhe.exporters.ckks import export_ckks
    from polyfhe.models.registry import create_model

    torch.manual_seed(0)
    model = create_model(name, **({"img_size": img_size} if img_size else {}))
    x = _calibration(tuple(model.input_shape))
    recompute_from_array(model, x)
    for m in model.modules():  # a zero-initialised head compiles to an empty map: no work to time
        if isinstance(m, nn.Linear) and not torch.any(m.weight):
            nn.init.normal_(m.weight, std=0.02)
    return export_ckks(model.eval(), calibration=x, input_shape=tuple(model.input_shape), backend=engine,
                       **export_kwargs)


def compiled_prediction(program, *, machine_bytes: int | None = -1,
                        progress: Progress | None = None) -> CostPrediction:
    engine = program.manifest.backend
    return predict(program_workload(program), calibrated_costs(engine, progress=progress),
                   machine_bytes=machine_bytes)


def program_cost(program, *, machine_bytes: int | None = -1, progress: Progress | None = None) -> CostReport:
    """The report for an already compiled CKKS program (a Concrete ML program is refused: its cost is TFHE's)."""
    if getattr(program, "scheme", "ckks") != "ckks":
        raise ValueError(f"program {program.program_id} is a {program.scheme.upper()} program (Concrete ML); "
                         "polyfhe cost prices CKKS programs (SEAL, Lattigo): export the model with --target ckks "
                         "for a prediction, or time this one with `polyfhe run`")
    m = program.manifest
    return CostReport(m.model_name if m.model_name is not None else program.program_id,
                      m.input_shape[-1] if m.input_shape else None,
                      compiled_prediction(program, machine_bytes=machine_bytes, progress=progress), "compiled",
                      m.params.levels)


def _estimated(traced: TracedModel, engine: str, machine_bytes: int | None,
               progress: Progress | None = None) -> CostPrediction:
    params, boot_slots = estimate_params(traced, engine)
    workload = traced_workload(traced, engine, params, bootstrap_slots=boot_slots, samples=_samples(traced, params))
    return predict(workload, calibrated_costs(engine, progress=progress), machine_bytes=machine_bytes)


def auto_compiles(traced: TracedModel, engine: str) -> bool:
    """Whether ``method="auto"`` compiles this traced model: a leveled ring holds its depth, its widest tensor fits
    one ciphertext, and its estimated plaintext products are within :data:`COMPILE_LIMITS`."""
    try:
        params, boot = estimate_params(traced, engine)
    except ParameterError:
        return False
    if boot is not None or traced.widest > COMPILE_LIMITS["widest"]:
        return False
    est = traced_workload(traced, engine, params)
    return est.counters["plain_products"] <= COMPILE_LIMITS["products"]



def _fitting_size(name: str, img_size: int, engine: str, machine_bytes: int | None) -> int | None:
    """The largest input size (halving, then multiples of 8 below) whose estimate fits ``machine_bytes``."""
    sizes = sorted({s for s in (img_size // 2, img_size // 4, img_size // 8, 64, 32, 16, 8) if 8 <= s < img_size},
                   reverse=True)
    for size in sizes:
        try:
            meta, shape = _build(name, size)
            p = _estimated(trace_model(meta, shape), engine, machine_bytes)
        except (ParameterError, ValueError, RuntimeError) as exc:
            log.debug("img_size %d: %s", size, exc)
            continue
        if p.fits:
            return size
    return None


def _compile_error_types() -> tuple[type[Exception], ...]:
    from polyfhe.exporters.ckks import CKKSExportError, LoweringError

    return CKKSExportError, LoweringError, ParameterError, MemoryError


def model_cost(name: str, img_size: int | None = None, engine: str = DEFAULT_BACKEND, *, method: str = "auto",
               machine_bytes: int | None = -1, raise_if_too_large: bool = False,
               progress: Progress | None = None) -> CostReport:
    """Predicted cost of zoo model ``name`` at ``img_size`` on ``engine`` (``machine_bytes`` -1: this machine's
    memory, None: no limit). ``method``: "compiled" builds the program here (exact counts), "estimated" traces it,
    "auto" compiles whatever compiles here (:func:`auto_compiles`; the estimate when the compiler gives up, with
    its reason in the notes) and estimates the rest. ``progress`` hears of each slow step before it starts."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; accepted: {list(METHODS)}")
    meta, shape = _build(name, img_size)
    traced = trace_model(meta, shape)
    size = img_size or shape[-1]
    report = None
    if method == "compiled" or (method == "auto" and auto_compiles(traced, engine)):
        calibrated_costs(engine, progress=progress)  # measured before the compile, so its announcement comes first
        _say(progress, f"compiling {name} at {size}x{size} for {engine} to count its operations exactly (seconds "
                       "to minutes; --method estimated traces it instead, in about a second)")
        try:
            program = compile_model(name, img_size, engine)
        except _compile_error_types() as exc:
            if method == "compiled":
                raise
            log.info("compiling %s failed (%s): estimating it instead", name, exc)
            note = f"compiling it here failed ({exc}): estimated from a trace instead"
            report = CostReport(name, size, _estimated(traced, engine, machine_bytes, progress), "estimated",
                                traced.depth, notes=(note,))
        else:
            report = CostReport(name, size, compiled_prediction(program, machine_bytes=machine_bytes,
                                                                progress=progress), "compiled", traced.depth)
    if report is None:
        report = CostReport(name, size, _estimated(traced, engine, machine_bytes, progress), "estimated",
                            traced.depth)
    if not report.prediction.fits:
        fitting = _fitting_size(name, size, engine, report.prediction.machine_bytes)
        report = CostReport(report.name, size, report.prediction, report.method, report.depth, fitting,
                            report.notes)
        if raise_if_too_large:
            raise ModelTooLarge(report)
    return report


def onnx_input_shape(path: str | Path) -> tuple[int, ...]:
    """(C, H, W) of an ONNX file's graph input (its first non-initializer input, batch dimension dropped)."""
    from polyfhe.analysis.loader import input_dims

    dims = input_dims(path)  # a ModelLoadError is a ValueError
    if len(dims) < 2 or not all(dims[1:]):
        raise ValueError(f"{path}: the graph input has shape {dims} (None: symbolic); polyfhe cost "
                         "needs every dimension but the batch fixed")
    return tuple(int(d) for d in dims[1:])


def onnx_cost(path: str | Path, engine: str = DEFAULT_BACKEND, *, method: str = "auto",
              machine_bytes: int | None = -1,
              progress: Progress | None = None) -> CostReport:
    """Predicted cost of the ONNX model at ``path`` on ``engine``: checked by the degree analyzer, compiled here
    with random inputs in [0, 1] as calibration (operation counts do not depend on the data; the scale may),
    and priced. ``method`` "estimated" is refused: the trace needs the torch model."""
    from polyfhe.analysis import analyze

    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; accepted: {list(METHODS)}")
    path = Path(path)
    if method == "estimated":
        raise ValueError(f"{path.name}: --method estimated traces a zoo model's torch module; an ONNX file is "
                         "priced by compiling it (--method auto or compiled)")
    shape = onnx_input_shape(path)
    report = analyze(str(path))
    if not report.polynomial:
        offenders = ", ".join(f"{v.node} ({v.op})" for v in report.violations[:5])
        raise ValueError(f"{path.name} is not polynomial on its input, so it cannot run under CKKS: {offenders} "
                         "(`polyfhe check` explains; polyfhe.polynomialize replaces ReLUs)")
    calibrated_costs(engine, progress=progress)
    _say(progress, f"compiling {path.name} (input {'x'.join(map(str, shape))}, {report.levels} levels) for {engine} "
                   "to count its operations exactly (seconds to minutes)")
    from polyfhe.exporters.ckks import export_ckks

    program = export_ckks(path, calibration=_calibration(shape), backend=engine)
    prediction = compiled_prediction(program, machine_bytes=machine_bytes, progress=progress)
    return CostReport(path.stem, shape[-1], prediction, "compiled", program.params.levels, notes=(SYNTHETIC_NOTE,))
