"""User data in any of the usual shapes, a short fine-tune and an accuracy, for :func:`polynomialize`.

``data`` is ``(X, y)`` (numpy arrays or tensors), ``X`` alone, a dataset with ``x_train``/``y_train``
(:class:`~polyfhe.data.dataset.ImageDataset`) or any iterable of ``(x, y)`` batches (a ``DataLoader``).
Integer labels mean classification (cross-entropy, accuracy); float targets mean regression (mean squared error).
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from polyfhe.training.loop import TrainingDiverged

__all__ = ["DataSource", "accuracy", "as_source", "fine_tune"]

log = logging.getLogger(__name__)


def _tensor(value: Any) -> Tensor:
    if torch.is_tensor(value):
        return value
    array = np.asarray(value)
    return torch.from_numpy(array.astype(np.float32) if array.dtype.kind == "f" else array)


@dataclass(frozen=True)
class DataSource:
    """In-memory ``(x, y)`` tensors (``y`` may be None) or a re-iterable of batches."""

    x: Tensor | None = None
    y: Tensor | None = None
    loader: Iterable | None = None

    @property
    def labelled(self) -> bool:
        if self.loader is not None:
            return True  # a loader is assumed to yield (x, y); an x-only loader is found out at the first batch
        return self.y is not None

    def batches(self, batch_size: int, shuffle: bool = False,
                generator: torch.Generator | None = None) -> Iterator[tuple[Tensor, Tensor | None]]:
        if self.loader is not None:
            for batch in self.loader:
                if isinstance(batch, (tuple, list)):
                    yield _tensor(batch[0]), (_tensor(batch[1]) if len(batch) > 1 else None)
                else:
                    yield _tensor(batch), None
            return
        assert self.x is not None
        order = torch.randperm(len(self.x), generator=generator) if shuffle else torch.arange(len(self.x))
        for i in range(0, len(self.x), batch_size):
            idx = order[i:i + batch_size]
            yield self.x[idx], (self.y[idx] if self.y is not None else None)

    def head(self, n: int) -> Tensor:
        """The first ``n`` inputs (fewer when the data holds fewer), for calibration."""
        parts, seen = [], 0
        for x, _ in self.batches(max(n, 1)):
            parts.append(x[:n - seen])
            seen += len(parts[-1])
            if seen >= n:
                break
        if not parts:
            raise ValueError("the data holds no samples")
        return torch.cat(parts)


def as_source(data: Any) -> DataSource:
    """Wrap ``(X, y)``, ``X``, an ImageDataset or a DataLoader (see the module docstring)."""
    if hasattr(data, "x_train") and hasattr(data, "y_train"):
        return DataSource(_tensor(data.x_train), _tensor(data.y_train))
    if isinstance(data, (tuple, list)) and len(data) == 2:
        x, y = _tensor(data[0]), _tensor(data[1])
        if len(x) != len(y):
            raise ValueError(f"data=(X, y) must have as many labels as inputs, got {len(x)} and {len(y)}")
        return DataSource(x, y)
    if torch.is_tensor(data) or isinstance(data, np.ndarray):
        return DataSource(_tensor(data))
    if isinstance(data, Iterable):
        return DataSource(loader=data)
    raise TypeError(f"data must be (X, y), X, a dataset with x_train/y_train or a DataLoader; got {type(data)}")


def _loss(out: Tensor, y: Tensor) -> Tensor:
    if y.dtype.is_floating_point:
        return F.mse_loss(out, y.to(out.dtype).reshape(out.shape))
    return F.cross_entropy(out, y.long())


def _device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


@torch.no_grad()
def accuracy(model: nn.Module, source: DataSource, batch_size: int = 1024) -> float | None:
    """Top-1 accuracy on labelled classification data; None for unlabelled data or float targets."""
    if not source.labelled:
        return None
    was_training, device = model.training, _device(model)
    model.eval()
    correct = total = 0
    try:
        for x, y in source.batches(batch_size):
            if y is None or y.dtype.is_floating_point:
                return None
            pred = model(x.to(device)).argmax(1).cpu()
            correct += int((pred == y.long()).sum())
            total += len(y)
    finally:
        model.train(was_training)
    return correct / total if total else None


def fine_tune(model: nn.Module, source: DataSource, *, epochs: int, lr: float, batch_size: int,
              weight_decay: float = 0.0, seed: int = 0, max_grad_norm: float = 5.0) -> list[float]:
    """Adam for ``epochs`` over ``source`` (in place); returns the mean loss of each epoch.

    Gradients are clipped: a freshly fitted polynomial can turn an outlier into a huge gradient in the first
    steps. A non-finite loss raises :class:`TrainingDiverged` rather than returning NaN weights.
    """
    from tqdm.auto import tqdm

    device = _device(model)
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    generator = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    step = 0
    model.train()
    for epoch in range(epochs):
        total, seen = 0.0, 0
        batches = tqdm(source.batches(batch_size, shuffle=True, generator=generator), desc=f"epoch {epoch + 1}",
                       unit="batch", leave=False, disable=not sys.stderr.isatty())
        for x, y in batches:
            if y is None:
                raise ValueError("fine-tuning needs labels: pass data=(X, y) or a loader yielding (x, y) batches")
            loss = _loss(model(x.to(device)), y.to(device))
            if not math.isfinite(loss.item()):
                raise TrainingDiverged(
                    f"fine-tuning the polynomial model diverged at epoch {epoch + 1}, step {step} (loss "
                    f"{loss.item()}); try a smaller lr= (was {lr:g}) or degree=2", step, epoch)
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            opt.step()
            total, seen, step = total + loss.item() * len(x), seen + len(x), step + 1
        losses.append(total / max(seen, 1))
        log.info("polynomialize fine-tune epoch %d/%d: loss %.4f", epoch + 1, epochs, losses[-1])
    model.eval()
    return losses
