"""Dataset sources behind one registry: ``load_dataset("fashion-mnist")``, ``load_dataset("digits")``, ...

Every loader returns an :class:`ImageDataset` with float32 images in ``[0, 1]`` shaped ``(N, C, H, W)``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np

from polyfhe.data.dataset import ImageDataset
from polyfhe.data.formats import is_cifar10_folder, is_image_folder, load_cifar10, load_image_folder, load_npz
from polyfhe.data.idx import read_idx

log = logging.getLogger(__name__)

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)


def _find_idx(root: Path, stem: str) -> Path:
    for candidate in (root / stem, root / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"missing {stem}[.gz] in {root}; Fashion-MNIST comes from Debian's package "
        "'dataset-fashion-mnist' (apt-get install dataset-fashion-mnist) or pass a folder holding the IDX files"
    )


def load_idx_folder(root: str | Path, name: str = "idx", classes: tuple[str, ...] | None = None) -> ImageDataset:
    """An (Fashion-)MNIST-style folder: train/t10k images and labels in IDX format."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(
            f"dataset folder {root} does not exist; expected the four (Fashion-)MNIST IDX files "
            "train/t10k-images-idx3-ubyte[.gz] and train/t10k-labels-idx1-ubyte[.gz] there. Fashion-MNIST comes "
            f"from Debian's package 'dataset-fashion-mnist' (installs {FASHION_MNIST_DIR})"
        )
    parts = {
        key: read_idx(_find_idx(root, stem))
        for key, stem in (
            ("x_train", "train-images-idx3-ubyte"), ("y_train", "train-labels-idx1-ubyte"),
            ("x_test", "t10k-images-idx3-ubyte"), ("y_test", "t10k-labels-idx1-ubyte"),
        )
    }
    for split in ("train", "test"):
        if len(parts[f"x_{split}"]) != len(parts[f"y_{split}"]):
            raise ValueError(f"{root}: {split} images and labels differ in length")
    n_classes = int(max(parts["y_train"].max(), parts["y_test"].max())) + 1
    return ImageDataset(
        name=name,
        x_train=(parts["x_train"][:, None].astype(np.float32) / 255.0),
        y_train=parts["y_train"].astype(np.int64),
        x_test=(parts["x_test"][:, None].astype(np.float32) / 255.0),
        y_test=parts["y_test"].astype(np.int64),
        classes=classes or tuple(str(i) for i in range(n_classes)),
    )


def load_fashion_mnist(root: str | Path | None = None) -> ImageDataset:
    return load_idx_folder(root or FASHION_MNIST_DIR, "fashion-mnist", FASHION_MNIST_CLASSES)


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> ImageDataset:
    """scikit-learn's 8x8 digits (ships with scikit-learn), split deterministically."""
    from sklearn.datasets import load_digits as sk_digits

    bunch = sk_digits()
    x = (bunch.images.astype(np.float32) / 16.0)[:, None]
    y = bunch.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = round(len(x) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return ImageDataset("digits", x[train], y[train], x[test], y[test], tuple(str(i) for i in range(10)))


def load_mnist(root: str | Path) -> ImageDataset:
    """An MNIST IDX folder (the four ``*-ubyte[.gz]`` files)."""
    return load_idx_folder(root, "mnist")


SOURCES: dict[str, Callable[..., ImageDataset]] = {
    "fashion-mnist": load_fashion_mnist,
    "digits": load_digits,
    "mnist": load_mnist,
    "cifar10": load_cifar10,
    "imagefolder": load_image_folder,
    "npz": load_npz,
}

# Sources that read nothing but a user-supplied path, and what that path must hold.
NEEDS_ROOT: dict[str, str] = {
    "mnist": "a folder with train/t10k-images-idx3-ubyte[.gz] and train/t10k-labels-idx1-ubyte[.gz]",
    "cifar10": "the unpacked 'cifar-10-batches-py' folder (data_batch_1..5, test_batch)",
    "imagefolder": "a folder <root>/<class>/<image> or <root>/train/<class>/... with <root>/test or <root>/val",
    "npz": "an .npz file with arrays 'x' (images) and 'y' (labels)",
}


def available_sources() -> list[str]:
    return sorted(SOURCES)


def load_dataset(source: str, **kwargs) -> ImageDataset:
    """Load a named source (see :func:`available_sources`)."""
    try:
        loader = SOURCES[source]
    except KeyError:
        raise ValueError(f"unknown dataset {source!r}; available: {', '.join(available_sources())}") from None
    if source in NEEDS_ROOT and kwargs.get("root") is None:
        raise ValueError(f"dataset {source!r} needs a path (root=...): {NEEDS_ROOT[source]}")
    return loader(**kwargs)


def detect_source(path: str | Path) -> str:
    """Which registered reader fits the files at ``path`` (a folder or an ``.npz`` file)."""
    path = Path(path).expanduser()
    if path.is_file() and path.suffix == ".npz":
        return "npz"
    if path.is_dir():
        if is_cifar10_folder(path) or is_cifar10_folder(path / "cifar-10-batches-py"):
            return "cifar10"
        if any((path / f"train-images-idx3-ubyte{ext}").is_file() for ext in ("", ".gz")):
            return "fashion-mnist" if "fashion" in path.name.lower() else "mnist"
        if is_image_folder(path) or is_image_folder(path / "train"):
            return "imagefolder"
    kinds = "; ".join(f"{name}: {what}" for name, what in NEEDS_ROOT.items())
    if not path.exists():
        raise FileNotFoundError(
            f"dataset path {path} does not exist. Give a source name ({', '.join(available_sources())}) or a path "
            f"holding one of: {kinds}. Fashion-MNIST comes from Debian's 'dataset-fashion-mnist' package "
            f"(files in {FASHION_MNIST_DIR})"
        )
    raise ValueError(f"cannot tell what dataset {path} holds; expected one of: {kinds}")


def open_dataset(spec: str | Path, root: str | Path | None = None, **kwargs) -> ImageDataset:
    """A source name (``digits``, ``fashion-mnist`` ...) or a path whose format is detected; ``root`` points a
    named source at its files (e.g. ``open_dataset("fashion-mnist", root="~/data/fm")``)."""
    spec_str = str(spec)
    if spec_str in SOURCES:
        if root is not None:
            kwargs["root"] = Path(root).expanduser()
        return load_dataset(spec_str, **kwargs)
    if root is not None:
        raise ValueError(f"root={root!r} only goes with a source name ({', '.join(available_sources())}), "
                         f"not with the path {spec_str!r}")
    path = Path(spec_str).expanduser()
    return load_dataset(detect_source(path), root=path, **kwargs)


def load_default_dataset() -> ImageDataset:
    """Fashion-MNIST when installed, else scikit-learn's digits (and say so)."""
    try:
        return load_fashion_mnist()
    except FileNotFoundError as exc:
        log.warning("Fashion-MNIST unavailable (%s); falling back to scikit-learn's digits", exc)
        return load_digits()
