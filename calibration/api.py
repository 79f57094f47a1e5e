"""``calibrate(model, data)``: recompute running statistics, then measure every encrypted value's range.

The ranges are taken on the folded, exported ONNX graph (the graph the CKKS exporter compiles), not on the
training module, so their keys are the ONNX value names the exporter sees.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from polyfhe.calibration.ranges import array_range, profile_onnx_ranges
from polyfhe.calibration.result import CalibrationResult
from polyfhe.calibration.running_stats import (
    CalibrationError,
    describe_running_stats,
    recompute_running_stats,
)

__all__ = ["as_images", "calibrate", "sample_images"]

log = logging.getLogger(__name__)


def as_images(data: Any, input_shape: tuple[int, ...] | None = None) -> np.ndarray:
    """Calibration images as a float32 ``(N, C, H, W)`` array from an array, a tensor or an ImageDataset.

    An ImageDataset contributes its training split. Images must already be in the model's input normalisation.
    """
    if hasattr(data, "x_train"):
        data = data.x_train
    if isinstance(data, torch.Tensor):
        data = data.detach().cpu().numpy()
    if not isinstance(data, np.ndarray):
        raise TypeError(f"calibration data must be a numpy array, a torch tensor or an ImageDataset, "
                        f"got {type(data).__name__}")
    if not np.issubdtype(data.dtype, np.floating):
        raise CalibrationError("calibration images must be floating point (the model's input normalisation), "
                               f"got dtype {data.dtype}")
    if data.ndim != 4 or len(data) == 0:
        raise CalibrationError(
            f"calibration data must be a non-empty (N, C, H, W) batch, got shape {data.shape}"
        )
    if input_shape is not None and tuple(data.shape[1:]) != tuple(input_shape):
        raise CalibrationError(f"calibration images have shape {tuple(data.shape[1:])} but the model expects "
                               f"{tuple(input_shape)} (C, H, W)")
    return data.astype(np.float32, copy=False)


def sample_images(x: np.ndarray, samples: int, seed: int = 0) -> np.ndarray:
    """A seeded random subset of ``samples`` images in their original order (all of ``x`` if smaller)."""
    if samples >= len(x):
        return x
    return x[np.sort(np.random.default_rng(seed).choice(len(x), samples, replace=False))]


def _batches(x: np.ndarray, batch_size: int, like: torch.Tensor | None) -> Iterator[torch.Tensor]:
    device = like.device if like is not None else torch.device("cpu")
    dtype = like.dtype if like is not None and like.is_floating_point() else torch.float32
    for start in range(0, len(x), batch_size):
        yield torch.from_numpy(x[start:start + batch_size]).to(device=device, dtype=dtype)


def calibrate(
    model: nn.Module,
    data: Any,
    *,
    batches: int | None = None,
    batch_size: int = 256,
    onnx_ranges: bool = True,
    recompute_stats: bool = True,
) -> CalibrationResult:
    """Recalibrate ``model``'s running statistics in place (eval mode afterwards) and profile value ranges.

    ``data``: images ``(N, C, H, W)`` (numpy, torch, or an ImageDataset's training split) in the model's input
    normalisation. ``batches`` limits how many batches of ``batch_size`` are used (None: all of ``data``).
    With ``onnx_ranges`` the model is folded and exported (checked) to a temporary ONNX file whose every
    encrypted value is profiled in onnxruntime; without it only the input range is recorded.
    ``recompute_stats=False`` keeps the running statistics from training and only profiles ranges: a checkpoint
    trained on the same data already holds statistics of its final weights (docs/fhe-recipes.md measures both).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if batches is not None and batches < 1:
        raise ValueError(f"batches must be positive or None, got {batches}")
    x = as_images(data, getattr(model, "input_shape", None))
    if batches is not None:
        x = x[: batches * batch_size]
    like = next(model.parameters(), None)
    if recompute_stats:
        stats = recompute_running_stats(model, _batches(x, batch_size, like))
    else:
        model.eval()
        stats = describe_running_stats(model)
    model_name = getattr(model, "model_name", type(model).__name__)
    if not onnx_ranges:
        return CalibrationResult(model_name, len(x), array_range("input", x), {}, stats.to_dict())

    from polyfhe.exporters.onnx import INPUT_NAME, export_onnx

    with tempfile.TemporaryDirectory(prefix="polyfhe-calibrate-") as tmp:
        exported = export_onnx(model, Path(tmp) / "model.onnx", input_shape=tuple(x.shape[1:]))
        ranges = profile_onnx_ranges(exported.path, x, batch_size=batch_size)
    log.info("calibrated %s on %d samples: %d value ranges, largest |value| %.3g", model_name, len(x),
             len(ranges), max(r.abs_max for r in ranges.values()))
    return CalibrationResult(model_name, len(x), ranges[INPUT_NAME], ranges, stats.to_dict())
