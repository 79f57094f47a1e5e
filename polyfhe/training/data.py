"""In-memory tensors for training: train/val/test splits, per-channel normalisation and batch augmentation.

Images stay in [0, 1] on the device; augmentation runs on the raw batch and normalisation right after it,
so padding during a shift is black in image space (as torchvision's ``RandomCrop(padding=...)`` does).
The :class:`Normalization` travels with the checkpoint: whoever feeds the trained model (calibration,
encryption clients) must apply the same affine map to their images.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from polyfhe.data.sources import ImageDataset


@dataclass(frozen=True)
class Normalization:
    """Per-channel ``(x - mean) / std`` applied to images in [0, 1]."""

    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.mean) != len(self.std) or any(s <= 0 for s in self.std):
            raise ValueError(f"normalisation needs one positive std per mean, got mean {self.mean}, std {self.std}")

    @classmethod
    def identity(cls, channels: int) -> Normalization:
        return cls((0.0,) * channels, (1.0,) * channels)

    @classmethod
    def fit(cls, x: np.ndarray) -> Normalization:
        """Mean and std per channel of ``x`` shaped ``(N, C, H, W)``."""
        x64 = x.astype(np.float64)
        std = np.maximum(x64.std(axis=(0, 2, 3)), 1e-6)
        return cls(tuple(map(float, x64.mean(axis=(0, 2, 3)))), tuple(map(float, std)))

    def tensors(self, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
        """Mean and std shaped ``(1, C, 1, 1)`` on ``device``: make them once per run, since each copy to a GPU
        waits for it to finish its queue."""
        mean = torch.tensor(self.mean, dtype=torch.float32).view(1, -1, 1, 1)
        std = torch.tensor(self.std, dtype=torch.float32).view(1, -1, 1, 1)
        return mean.to(device), std.to(device)

    def apply(self, x: Tensor) -> Tensor:
        mean, std = self.tensors(x.device)
        return (x - mean.to(x.dtype)) / std.to(x.dtype)

    def apply_numpy(self, x: np.ndarray) -> np.ndarray:
        mean = np.asarray(self.mean, dtype=x.dtype).reshape(1, -1, 1, 1)
        return (x - mean) / np.asarray(self.std, dtype=x.dtype).reshape(1, -1, 1, 1)

    def to_dict(self) -> dict[str, Any]:
        return {"mean": list(self.mean), "std": list(self.std)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Normalization:
        return cls(tuple(float(v) for v in data["mean"]), tuple(float(v) for v in data["std"]))

    def prepend_to(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` fed by images in [0, 1]: this map becomes its first (constant affine) layer.

        Exported programs then take raw images, and the CKKS compiler merges the affine into the first linear
        map, so it costs no level. The wrapper keeps the attributes the exporters read.
        """
        from polyfhe.folding.primitives import ConstantAffine

        std = torch.tensor(self.std, dtype=torch.float32).view(-1, 1, 1)
        mean = torch.tensor(self.mean, dtype=torch.float32).view(-1, 1, 1)
        wrapped = torch.nn.Sequential(ConstantAffine(1.0 / std, -mean / std), model)
        for attr in ("input_shape", "num_classes", "model_name"):
            if hasattr(model, attr):
                setattr(wrapped, attr, getattr(model, attr))
        return wrapped.train(model.training)


@dataclass(frozen=True)
class Splits:
    """Raw [0, 1] image tensors (CPU) for train/val/test; ``x_val`` is empty when ``val_fraction`` is 0."""

    name: str
    classes: tuple[str, ...]
    x_train: Tensor
    y_train: Tensor
    x_val: Tensor
    y_val: Tensor
    x_test: Tensor
    y_test: Tensor
    normalization: Normalization

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return tuple(self.x_train.shape[1:])  # type: ignore[return-value]

    @property
    def num_classes(self) -> int:
        return len(self.classes)


def make_splits(
    ds: ImageDataset, *, val_fraction: float, seed: int, normalize: bool, train_subset: int | None = None
) -> Splits:
    """Hold out a seeded random ``val_fraction`` of the training images; fit normalisation on the rest."""
    if len(ds.x_train) < 2 or len(ds.x_test) < 1:
        raise ValueError(f"data set {ds.name!r} is too small: {len(ds.x_train)} train / {len(ds.x_test)} test images")
    order = np.random.default_rng(seed).permutation(len(ds.x_train))
    n_val = round(len(order) * val_fraction)
    val, train = order[:n_val], order[n_val:]
    if train_subset is not None:
        train = train[:train_subset]
    x_train = ds.x_train[train]
    norm = Normalization.fit(x_train) if normalize else Normalization.identity(x_train.shape[1])

    def t(a: np.ndarray) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(a))

    return Splits(
        ds.name, tuple(ds.classes), t(x_train.astype(np.float32)), t(ds.y_train[train].astype(np.int64)),
        t(ds.x_train[val].astype(np.float32)), t(ds.y_train[val].astype(np.int64)),
        t(ds.x_test.astype(np.float32)), t(ds.y_test.astype(np.int64)), norm,
    )


# ------------------------------------------------------------------------------------------- augmentation
def to_device(t: Tensor, device: torch.device) -> Tensor:
    """Copy host random draws without waiting for the GPU: a blocking copy would sync the stream every step."""
    return t.to(device, non_blocking=True)


def _pad_size(x: Tensor) -> int:
    return max(1, min(x.shape[-2:]) // 8)  # 4 px at 32x32 (CIFAR recipe), 3 px at 28, 1 px at 8


def random_shift(x: Tensor, generator: torch.Generator) -> Tensor:
    """Per-image random translation by up to ``H // 8`` pixels with zero fill (pad + random crop)."""
    b, _, h, w = x.shape
    p = _pad_size(x)
    padded = torch.nn.functional.pad(x, (p, p, p, p))
    dy = to_device(torch.randint(0, 2 * p + 1, (b,), generator=generator), x.device)
    dx = to_device(torch.randint(0, 2 * p + 1, (b,), generator=generator), x.device)
    rows = (dy[:, None] + torch.arange(h, device=x.device)[None]).view(b, 1, h, 1).expand(-1, x.shape[1], -1, w + 2 * p)
    out = padded.gather(2, rows)
    cols = (dx[:, None] + torch.arange(w, device=x.device)[None]).view(b, 1, 1, w).expand(-1, x.shape[1], h, -1)
    return out.gather(3, cols)


def random_flip(x: Tensor, generator: torch.Generator) -> Tensor:
    """Horizontal flip of a random half of the batch."""
    mask = to_device(torch.rand(x.shape[0], generator=generator) < 0.5, x.device).view(-1, 1, 1, 1)
    return torch.where(mask, x.flip(-1), x)


Augment = Callable[[Tensor, torch.Generator], Tensor]

AUGMENTATIONS: dict[str, Augment] = {
    "none": lambda x, g: x,
    "shift": random_shift,
    "flip": random_flip,
    "flip-shift": lambda x, g: random_flip(random_shift(x, g), g),
}

# Digits and MNIST must not be mirrored (a flipped 2 is no 2); clothes and natural images may. On
# Fashion-MNIST the small FHE recipes underfit, and shifts cost them accuracy (docs/fhe-recipes.md): flips only.
DEFAULT_AUGMENT: dict[str, str] = {
    "digits": "shift",
    "mnist": "shift",
    "fashion-mnist": "flip",
    "cifar10": "flip-shift",
}
FALLBACK_AUGMENT = "none"  # npz and image folders: we do not know what the images show


def resolve_augment(name: str, dataset_name: str) -> str:
    return DEFAULT_AUGMENT.get(dataset_name, FALLBACK_AUGMENT) if name == "auto" else name


def batch_indices(n: int, batch_size: int, generator: torch.Generator | None, drop_last: bool) -> Iterator[Tensor]:
    """Shuffled (with ``generator``) or ordered index batches; ``drop_last`` keeps BatchNorm batches full."""
    order = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
    stop = n - n % batch_size if drop_last and n >= batch_size else n
    for start in range(0, stop, batch_size):
        yield order[start:start + batch_size]


def steps_per_epoch(n: int, batch_size: int) -> int:
    return n // batch_size if n >= batch_size else 1
