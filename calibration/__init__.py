"""Calibration: running statistics as a cumulative average, and per-value ranges for the CKKS exporter.

``calibrate(model, images)`` recomputes every BN-like layer's running statistics (BatchNorm, MONet's
TokenBatchNorm, PolyNeXt's ChannelBatchNorm and RunningRowSumNorm) and profiles the ranges of every encrypted
value of the folded ONNX graph; the :class:`CalibrationResult` is stored beside a checkpoint as
``calibration.json``.
"""

from polyfhe.calibration.api import as_images, calibrate, sample_images
from polyfhe.calibration.ranges import ValueRange, array_range, profile_onnx_ranges
from polyfhe.calibration.result import CALIBRATION_FILE, CalibrationResult
from polyfhe.calibration.running_stats import (
    STATS_LAYERS,
    CalibrationError,
    RunningStatsReport,
    describe_running_stats,
    recompute_from_array,
    recompute_running_stats,
)

__all__ = [
    "CALIBRATION_FILE",
    "STATS_LAYERS",
    "CalibrationError",
    "CalibrationResult",
    "RunningStatsReport",
    "ValueRange",
    "array_range",
    "as_images",
    "calibrate",
    "describe_running_stats",
    "profile_onnx_ranges",
    "recompute_from_array",
    "recompute_running_stats",
    "sample_images",
]
