"""Predicted cost of a zoo model (or compiled program) at an input size: compile it when that is cheap here,
otherwise estimate its workload from a trace (:func:`polyfhe.cost.workload.traced_workload`).

``model_cost("cpolynext_t_bn", 224, "lattigo")`` returns a :class:`CostReport`: the prediction, which path made
it, and, when it does not fit this machine's memory, the input size that would.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import numpy as np

from polyfhe.cost.model import CostPrediction, calibrated_costs, predict
from polyfhe.cost.workload import TracedModel, program_workload, trace_model, traced_workload
from polyfhe.program.bootparams import BOOTSTRAP_RING, bootstrap_candidates
from polyfhe.program.engines import BACKEND_NAMES, get_backend
from polyfhe.program.params import RING_SIZES, CKKSParams, ParameterError, choose_params

__all__ = [
    "COMPILE_LIMITS",
    "METHODS",
    "CostReport",
    "ModelTooLarge",
    "compiled_prediction",
    "estimate_params",
    "model_cost",
    "program_cost",
]

log = logging.getLogger(__name__)

METHODS = ("auto", "compiled", "estimated")
# "auto" compiles only what compiles quickly here: one leveled ciphertext of at most this many padded values and
# at most this many estimated plaintext products (cpolynext_fhe_bn at 28x28, ~13k diagonals, takes 40 s, 2.6 GB)
COMPILE_LIMITS = {"widest": 1 << 14, "products": 8000}
ASSUMED_MAX_ABS = 2.0**8  # value range an uncompiled model is priced at (sets the first prime only)
CALIBRATION_SAMPLES = 32


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
                "fitting_img_size": self.fitting_img_size, "advice": self.advice, **self.prediction.to_dict()}


def estimate_params(traced: TracedModel, engine: str) -> tuple[CKKSParams, int | None]:
    """(parameters, bootstrap slots or None) an estimated plan would run on: the smallest leveled ring that holds
    the depth (multi-ciphertext tensors need no particular ring), else the cheapest bootstrapping residual chain."""
    slots = min(traced.widest, max(RING_SIZES) // 2)
    try:
        return choose_params(traced.depth, min(slots, RING_SIZES[-1] // 2), ASSUMED_MAX_ABS), None
    except ParameterError:
        if not get_backend(engine).bootstraps:
            able = " or ".join(name for name in BACKEND_NAMES if get_backend(name).bootstraps)
            raise ParameterError(f"{traced.depth} levels do not fit any leveled ring, and {engine!r} cannot "
                                 f"bootstrap: use --backend {able}") from None
    width = min(traced.widest, BOOTSTRAP_RING // 2)
    choice = bootstrap_candidates(traced.depth, width)[0]
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


def compiled_prediction(program, *, machine_bytes: int | None = -1) -> CostPrediction:
    return predict(program_workload(program), calibrated_costs(program.manifest.backend), machine_bytes=machine_bytes)


def program_cost(program, *, machine_bytes: int | None = -1) -> CostReport:
    """The report for an already compiled program."""
    m = program.manifest
    return CostReport(m.model_name if m.model_name is not None else program.program_id, m.input_shape[-1] if m.input_shape else None,
                      compiled_prediction(program, machine_bytes=machine_bytes), "compiled", m.params.levels)


def _estimated(traced: TracedModel, engine: str, machine_bytes: int | None) -> CostPrediction:
    params, boot_slots = estimate_params(traced, engine)
    workload = traced_workload(traced, engine, params, bootstrap_slots=boot_slots, samples=_samples(traced, params))
    return predict(workload, calibrated_costs(engine), machine_bytes=machine_bytes)


def _auto_compiles(traced: TracedModel, engine: str) -> bool:
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


def model_cost(name: str, img_size: int | None = None, engine: str = "seal", *, method: str = "auto",
               machine_bytes: int | None = -1, raise_if_too_large: bool = False) -> CostReport:
    """Predicted cost of zoo model ``name`` at ``img_size`` on ``engine`` (``machine_bytes`` -1: this machine's
    memory, None: no limit). ``method``: "compiled" builds the program here, "estimated" traces it, "auto" compiles
    only small leveled models (:data:`COMPILE_LIMITS`)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; accepted: {list(METHODS)}")
    meta, shape = _build(name, img_size)
    traced = trace_model(meta, shape)
    size = img_size or shape[-1]
    if method == "compiled" or (method == "auto" and _auto_compiles(traced, engine)):
        report = CostReport(name, size, compiled_prediction(compile_model(name, img_size, engine),
                                                            machine_bytes=machine_bytes), "compiled", traced.depth)
    else:
        report = CostReport(name, size, _estimated(traced, engine, machine_bytes), "estimated", traced.depth)
    if not report.prediction.fits:
        fitting = _fitting_size(name, size, engine, report.prediction.machine_bytes)
        report = CostReport(report.name, size, report.prediction, report.method, report.depth, fitting)
        if raise_if_too_large:
            raise ModelTooLarge(report)
    return report
