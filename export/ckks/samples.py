"""Calibration data as the compiler reads it: one numpy array of samples ``(N, *input shape)``.

``export(model, target="ckks", calibration=...)`` takes a numpy array, a torch tensor (any device or dtype,
with or without grad), a ``TensorDataset``, a ``DataLoader`` (or any iterable of batches; an ``(x, y)`` batch
contributes ``x``), a list of samples, an ImageDataset (its training split) or a ``CalibrationResult``. The
first kinds become one array here, so every pass (and the input shape inferred for a module) sees the same
samples. torch is never imported: tensors are recognised by what they offer.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = ["ACCEPTED", "CalibrationDataError", "calibration_array"]

log = logging.getLogger(__name__)

ACCEPTED = ("a numpy array or torch tensor of samples shaped (N, C, H, W), a TensorDataset or DataLoader of such "
            "samples, a list of samples, or a CalibrationResult from polyfhe.calibrate()")


class CalibrationDataError(ValueError):
    """Calibration data of a kind the compiler cannot read as samples."""


def _is_tensor(value: Any) -> bool:
    return hasattr(value, "detach") and hasattr(value, "cpu") and hasattr(value, "numpy")


def _as_numpy(value: Any) -> np.ndarray:
    """A tensor (detached, on the host, floats widened to float64: numpy has no bfloat16) or array-like."""
    if _is_tensor(value):
        tensor = value.detach().cpu()
        if tensor.is_floating_point():
            tensor = tensor.double()
        return tensor.numpy()
    return np.asarray(value)


def _first(item: Any) -> Any:
    """The inputs of a batch or dataset item: ``x`` of ``(x, y)``, the item itself otherwise."""
    return item[0] if isinstance(item, (tuple, list)) and item else item


def _from_iterable(data: Iterable, name: str) -> np.ndarray:
    """Samples of a list (stacked), batches of a DataLoader (concatenated) or items of a dataset (stacked)."""
    items = data if isinstance(data, (list, tuple)) else (_first(item) for item in data)
    parts = [_as_numpy(item) for item in items]
    if not parts:
        raise CalibrationDataError(f"calibration data {name} yielded no samples")
    batched = getattr(data, "batch_size", None) is not None
    try:
        array = np.concatenate(parts) if batched else np.stack(parts)
    except ValueError as exc:
        raise CalibrationDataError(f"the samples of {name} do not share one shape ({exc}); "
                                   f"calibration takes {ACCEPTED}") from exc
    log.debug("calibration: %d samples of shape %s from %s", len(array), array.shape[1:], name)
    return array


def calibration_array(calibration: Any) -> Any:
    """``calibration`` as a numpy array of samples; None and a CalibrationResult come back unchanged."""
    if calibration is None or isinstance(calibration, np.ndarray) or hasattr(calibration, "node_ranges"):
        return calibration
    if hasattr(calibration, "x_train"):  # an ImageDataset, as polyfhe.calibrate() takes it
        calibration = calibration.x_train
    if _is_tensor(calibration) or isinstance(calibration, np.ndarray):
        return _as_numpy(calibration)
    tensors = getattr(calibration, "tensors", None)  # TensorDataset: its first tensor holds the inputs
    if isinstance(tensors, tuple) and tensors:
        return _as_numpy(tensors[0])
    if isinstance(calibration, (str, bytes, dict)):
        raise CalibrationDataError(f"calibration must be {ACCEPTED}; got {type(calibration).__name__}")
    if isinstance(calibration, Iterable):
        return _from_iterable(calibration, type(calibration).__name__)
    if hasattr(calibration, "__getitem__") and hasattr(calibration, "__len__"):  # a map-style torch Dataset
        return _from_iterable((calibration[i] for i in range(len(calibration))), type(calibration).__name__)
    raise CalibrationDataError(f"calibration must be {ACCEPTED}; got {type(calibration).__name__}")
