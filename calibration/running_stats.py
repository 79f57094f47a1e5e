"""Recompute the running statistics of every BN-like layer as a cumulative average over calibration batches.

Training leaves exponential moving averages (momentum 0.1) that lag behind the final weights; the folded
network bakes these statistics into its plaintext weights, so they should describe the final weights.

Every supported layer updates its buffers as ``new = (1 - m) * old + m * batch_stat`` in training mode
(torch's BatchNorms incl. MONet's TokenBatchNorm, PolyNeXt's spatial ChannelBatchNorm, PolyAttn's
RunningRowSumNorm R_hi). Setting ``m = n_k / N_k`` before batch k (n_k its size, N_k the samples seen so far)
turns that into the exact sample-weighted mean of the per-batch statistics: torch's ``momentum=None``
average, but also for the two PolyNeXt layers, whose update needs a float momentum. The original momentum is
restored afterwards. Only the stats layers run in training mode: dropout and drop-path stay off.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from polyfhe.calibration.ranges import float_from_json, json_float
from polyfhe.models.layers.norms import ChannelBatchNorm, RunningRowSumNorm

__all__ = ["STATS_LAYERS", "CalibrationError", "LayerStats", "RunningStatsReport", "describe_running_stats",
           "recompute_from_array", "recompute_running_stats", "stats_layers"]

log = logging.getLogger(__name__)


class CalibrationError(ValueError):
    """Calibration cannot run: no data, unsupported statistics layers, or data of the wrong shape."""


@dataclass(frozen=True)
class StatsLayer:
    """Which buffers a layer type keeps and how to reset them before a fresh average."""

    buffers: tuple[str, ...]
    reset: Callable[[nn.Module], None]


def _reset_buffers(**values: float) -> Callable[[nn.Module], None]:
    def reset(module: nn.Module) -> None:
        with torch.no_grad():
            for name, value in values.items():
                getattr(module, name).fill_(value)
            module.num_batches_tracked.zero_()

    return reset


# Checked with isinstance in this order; subclasses (TokenBatchNorm) match their base's entry.
STATS_LAYERS: dict[type, StatsLayer] = {
    _BatchNorm: StatsLayer(("running_mean", "running_var"), lambda m: m.reset_running_stats()),
    ChannelBatchNorm: StatsLayer(
        ("running_mean", "running_var"), _reset_buffers(running_mean=0.0, running_var=1.0)
    ),
    RunningRowSumNorm: StatsLayer(("running_denom",), _reset_buffers(running_denom=1.0)),
}


@dataclass(frozen=True)
class LayerStats:
    """Summary of one layer's recomputed buffers: (min, mean, max) per buffer."""

    name: str
    kind: str
    buffers: dict[str, tuple[float, float, float]]

    def to_dict(self) -> dict[str, Any]:
        buffers = {k: {"min": json_float(lo), "mean": json_float(mu), "max": json_float(hi)}
                   for k, (lo, mu, hi) in self.buffers.items()}
        return {"name": self.name, "kind": self.kind, "buffers": buffers}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayerStats:
        buffers = {k: (float_from_json(v["min"]), float_from_json(v["mean"]), float_from_json(v["max"]))
                   for k, v in data["buffers"].items()}
        return cls(str(data["name"]), str(data["kind"]), buffers)


@dataclass(frozen=True)
class RunningStatsReport:
    """What a recalibration did: how much data, and the resulting buffers of every stats layer."""

    num_batches: int
    num_samples: int
    layers: tuple[LayerStats, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"num_batches": self.num_batches, "num_samples": self.num_samples,
                "layers": [layer.to_dict() for layer in self.layers]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunningStatsReport:
        return cls(int(data["num_batches"]), int(data["num_samples"]),
                   tuple(LayerStats.from_dict(d) for d in data["layers"]))


def _spec_for(module: nn.Module) -> StatsLayer | None:
    for kind, spec in STATS_LAYERS.items():
        if isinstance(module, kind):
            return spec
    return None


def stats_layers(model: nn.Module) -> list[tuple[str, nn.Module, StatsLayer]]:
    """Every layer with running statistics; a layer with ``running_*`` buffers but no entry is refused."""
    found, unknown = [], []
    for name, module in model.named_modules():
        spec = _spec_for(module)
        if spec is not None:
            # A BatchNorm with track_running_stats=False has no buffers to recompute.
            if all(getattr(module, b, None) is not None for b in spec.buffers):
                found.append((name, module, spec))
        elif any(b.startswith("running_") for b, _ in module.named_buffers(recurse=False)):
            unknown.append(f"{name or '<root>'} ({type(module).__name__})")
    if unknown:
        raise CalibrationError(
            f"cannot recalibrate layers with running statistics of unknown kind: {', '.join(unknown)}; "
            f"supported: {', '.join(t.__name__ for t in STATS_LAYERS)} (register them in STATS_LAYERS)"
        )
    return found


def _summary(name: str, module: nn.Module, spec: StatsLayer) -> LayerStats:
    buffers = {}
    for b in spec.buffers:
        t = getattr(module, b).detach().double()
        buffers[b] = (float(t.min()), float(t.mean()), float(t.max()))
    return LayerStats(name, type(module).__name__, buffers)


def recompute_running_stats(model: nn.Module, batches: Iterable[torch.Tensor]) -> RunningStatsReport:
    """Replace every running statistic by its sample-weighted mean over ``batches``; ends in eval mode.

    ``batches`` yields input tensors already on the model's device and in its dtype.
    """
    layers = stats_layers(model)
    if not layers:
        log.info("%s has no running statistics to recompute", type(model).__name__)
    momenta = [module.momentum for _, module, _ in layers]
    model.eval()
    for _, module, spec in layers:
        spec.reset(module)
        module.train()
    num_batches = num_samples = 0
    try:
        with torch.no_grad():
            for xb in batches:
                num_batches += 1
                num_samples += len(xb)
                for _, module, _ in layers:
                    module.momentum = len(xb) / num_samples
                model(xb)
    finally:
        for (_, module, _), momentum in zip(layers, momenta, strict=True):
            module.momentum = momentum
        model.eval()
    if num_samples == 0:
        raise CalibrationError("no calibration data: the batches were empty")
    log.info("recomputed %d running-statistics layers over %d samples (%d batches)",
             len(layers), num_samples, num_batches)
    return RunningStatsReport(num_batches, num_samples, tuple(_summary(*layer) for layer in layers))


def recompute_from_array(model: nn.Module, x: Any, batch: int = 128) -> RunningStatsReport | None:
    """:func:`recompute_running_stats` over an array of images (numpy or tensor) in batches of ``batch``, on the
    model's device and dtype; None (nothing done) when ``x`` is None or the model keeps no running statistics."""
    if x is None or not stats_layers(model):
        return None
    parameter = next(model.parameters(), None)
    device, dtype = (parameter.device, parameter.dtype) if parameter is not None else ("cpu", torch.float32)
    images = torch.as_tensor(x)
    return recompute_running_stats(
        model, (images[start:start + batch].to(device=device, dtype=dtype) for start in range(0, len(images), batch)))


def describe_running_stats(model: nn.Module) -> RunningStatsReport:
    """The running statistics as they are (kept from training): a report over zero calibration samples."""
    return RunningStatsReport(0, 0, tuple(_summary(*layer) for layer in stats_layers(model)))
