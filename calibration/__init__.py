"""Calibration: running statistics as a cumulative average, and per-value ranges for the CKKS exporter.

``calibrate(model, images)`` recomputes every BN-like layer's running statistics (BatchNorm, MONet's
TokenBatchNorm, PolyNeXt's ChannelBatchNorm and RunningRowSumNorm) and profiles the ranges of every encrypted
value of the folded ONNX graph; the :class:`CalibrationResult` is stored beside a checkpoint as
``calibration.json``. :mod:`polyfhe.calibration.reduction` is the range reduction every profiler shares.

Names load on first use, so the compiler can import the numpy-only reduction without the training stack.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "as_images": "api", "calibrate": "api", "sample_images": "api",
    "ValueRange": "reduction", "array_range": "reduction",
    "profile_onnx_ranges": "ranges",
    "CALIBRATION_FILE": "result", "CalibrationResult": "result",
    "STATS_LAYERS": "running_stats", "CalibrationError": "running_stats", "RunningStatsReport": "running_stats",
    "describe_running_stats": "running_stats", "recompute_from_array": "running_stats",
    "recompute_running_stats": "running_stats",
}

__all__ = [
    "CALIBRATION_FILE", "STATS_LAYERS", "CalibrationError", "CalibrationResult", "RunningStatsReport", "ValueRange",
    "array_range", "as_images", "calibrate", "describe_running_stats", "profile_onnx_ranges", "recompute_from_array",
    "recompute_running_stats", "sample_images",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'polyfhe.calibration' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"polyfhe.calibration.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
