"""The one shape every data loader returns."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["ImageDataset"]


@dataclass(frozen=True)
class ImageDataset:
    """A train/test split of images ``(N, C, H, W)`` in [0, 1] with integer labels."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    classes: tuple[str, ...]

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return tuple(self.x_train.shape[1:])  # type: ignore[return-value]

    @property
    def num_classes(self) -> int:
        return len(self.classes)
