"""Readers for user-supplied image collections: CIFAR-10 python pickles, ImageFolder trees and ``.npz`` arrays.

All return :class:`~polyfhe.data.dataset.ImageDataset` (float32 in [0, 1], ``(N, C, H, W)``). Nothing downloads.
CIFAR pickles are read with an unpickler that only admits the numpy names such a file needs, so a hostile
pickle cannot run code.
"""

from __future__ import annotations

import logging
import pickle
from pathlib import Path

import numpy as np

from polyfhe.data.dataset import ImageDataset

log = logging.getLogger(__name__)

CIFAR10_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST = "test_batch"
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")
GET_CIFAR = "get 'CIFAR-10 python version' (cifar-10-python.tar.gz) from the CIFAR website and unpack it"

# (module, name) pairs a CIFAR batch pickle may reference; everything else is refused.
_SAFE_PICKLE_NAMES = {
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("numpy._core.numeric", "_frombuffer"), ("numpy.core.numeric", "_frombuffer"),
    ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
}


class _NumpyOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _SAFE_PICKLE_NAMES:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}: not part of a CIFAR batch file")
        return super().find_class(module, name)


def _unpickle(path: Path) -> dict:
    try:
        with open(path, "rb") as fh:
            obj = _NumpyOnlyUnpickler(fh, encoding="bytes").load()
    except (OSError, EOFError, pickle.UnpicklingError, ValueError) as exc:
        raise ValueError(f"cannot read CIFAR batch {path}: {exc}") from exc
    if not isinstance(obj, dict):
        raise ValueError(  # noqa: TRY004 - a bad file is bad input (ValueError), not a caller's type error
            f"{path} is not a CIFAR batch (expected a dict, got {type(obj).__name__})"
        )
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in obj.items()}


def _cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    batch = _unpickle(path)
    if "data" not in batch or "labels" not in batch:
        raise ValueError(f"{path} lacks 'data'/'labels' entries; is it a CIFAR-10 python batch?")
    data = np.asarray(batch["data"], dtype=np.uint8)
    labels = np.asarray(batch["labels"], dtype=np.int64)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(data) != len(labels):
        raise ValueError(f"{path}: data {data.shape} / labels {labels.shape} are not N x 3072 / N")
    return data.reshape(-1, 3, 32, 32).astype(np.float32) / 255.0, labels


def is_cifar10_folder(root: Path) -> bool:
    return (root / CIFAR10_TEST).is_file() and (root / CIFAR10_TRAIN[0]).is_file()


def load_cifar10(root: str | Path):
    """CIFAR-10 'python version' folder: ``data_batch_1..5``, ``test_batch`` and optional ``batches.meta``."""
    root = Path(root)
    sub = root / "cifar-10-batches-py"
    if not is_cifar10_folder(root) and is_cifar10_folder(sub):
        root = sub
    missing = [n for n in (*CIFAR10_TRAIN, CIFAR10_TEST) if not (root / n).is_file()]
    if missing:
        raise FileNotFoundError(f"CIFAR-10 folder {root} lacks {', '.join(missing)}; {GET_CIFAR}")
    parts = [_cifar_batch(root / n) for n in CIFAR10_TRAIN]
    x_test, y_test = _cifar_batch(root / CIFAR10_TEST)
    classes = CIFAR10_CLASSES
    if (root / "batches.meta").is_file():
        names = _unpickle(root / "batches.meta").get("label_names")
        if names:
            classes = tuple(n.decode() if isinstance(n, bytes) else str(n) for n in names)
    return ImageDataset(
        "cifar10", np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
        x_test, y_test, classes,
    )


def _split(x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, ...]:
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = max(1, round(len(x) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def _to_nchw_unit(x: np.ndarray, where: str) -> np.ndarray:
    """(N,H,W), (N,H,W,C) or (N,C,H,W) uint8 or float in [0, 1] -> float32 (N,C,H,W) in [0, 1]."""
    if x.ndim == 3:
        x = x[:, None]
    elif x.ndim == 4 and x.shape[-1] in (1, 3, 4) and x.shape[1] not in (1, 3, 4):
        x = x.transpose(0, 3, 1, 2)
    elif x.ndim != 4:
        raise ValueError(f"{where}: images must be (N,H,W), (N,H,W,C) or (N,C,H,W), got shape {x.shape}")
    if x.dtype == np.uint8:
        return np.ascontiguousarray(x, dtype=np.float32) / 255.0
    x = np.ascontiguousarray(x, dtype=np.float32)
    lo, hi = float(x.min()), float(x.max())
    if lo < -1e-6 or hi > 1 + 1e-6:
        raise ValueError(f"{where}: float images must lie in [0, 1] (got [{lo:.3g}, {hi:.3g}]); store uint8 or rescale")
    return x


def _labels(y: np.ndarray, n: int, where: str) -> np.ndarray:
    y = np.asarray(y)
    if y.ndim != 1 or len(y) != n or not np.issubdtype(y.dtype, np.integer) or (len(y) and y.min() < 0):
        raise ValueError(f"{where}: labels must be {n} non-negative integers in a 1-D array, got {y.dtype} {y.shape}")
    return y.astype(np.int64)


def load_npz(root: str | Path, test_fraction: float = 0.2, seed: int = 0):
    """An ``.npz`` with ``x``/``y`` (split here) or ``x_train``/``y_train``/``x_test``/``y_test``; optional ``classes``."""
    path = Path(root)
    if not path.is_file():
        raise FileNotFoundError(f"npz file {path} does not exist; expected arrays 'x' (images) and 'y' (labels)")
    with np.load(path, allow_pickle=False) as z:
        keys = set(z.files)
        if {"x_train", "y_train", "x_test", "y_test"} <= keys:
            x_tr, x_te = _to_nchw_unit(z["x_train"], f"{path}:x_train"), _to_nchw_unit(z["x_test"], f"{path}:x_test")
            y_tr, y_te = _labels(z["y_train"], len(x_tr), f"{path}:y_train"), _labels(z["y_test"], len(x_te), f"{path}:y_test")
        elif {"x", "y"} <= keys:
            x = _to_nchw_unit(z["x"], f"{path}:x")
            x_tr, y_tr, x_te, y_te = _split(x, _labels(z["y"], len(x), f"{path}:y"), test_fraction, seed)
        else:
            raise ValueError(f"{path} holds {sorted(keys)}; expected 'x' and 'y' (or x_train/y_train/x_test/y_test)")
        n_classes = int(max(y_tr.max(initial=0), y_te.max(initial=0))) + 1
        classes = tuple(str(c) for c in z["classes"]) if "classes" in keys else tuple(map(str, range(n_classes)))
    if x_tr.shape[1:] != x_te.shape[1:]:
        raise ValueError(f"{path}: train images {x_tr.shape[1:]} and test images {x_te.shape[1:]} differ in shape")
    return ImageDataset(path.stem, x_tr, y_tr, x_te, y_te, classes)


def _class_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def _images_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())


def _read_tree(root: Path, classes: tuple[str, ...], size: tuple[int, int] | None, mode: str | None):
    from PIL import Image

    xs, ys = [], []
    for label, name in enumerate(classes):
        for file in _images_in(root / name) if (root / name).is_dir() else []:
            try:
                with Image.open(file) as im:
                    im = im.convert(mode or ("L" if im.mode in ("L", "1", "I;16") else "RGB"))
                    mode = mode or im.mode
                    size = size or im.size
                    if im.size != size:
                        im = im.resize(size, Image.BILINEAR)
                    xs.append(np.asarray(im, dtype=np.uint8))
            except OSError as exc:
                raise ValueError(f"cannot read image {file}: {exc}") from exc
            ys.append(label)
    if not xs:
        raise FileNotFoundError(f"no images ({', '.join(IMAGE_SUFFIXES)}) found under {root}")
    return _to_nchw_unit(np.stack(xs), str(root)), np.asarray(ys, dtype=np.int64), size, mode


def is_image_folder(root: Path) -> bool:
    return root.is_dir() and any(_images_in(d)[:1] for d in _class_dirs(root))


def load_image_folder(root: str | Path, img_size: int | None = None, test_fraction: float = 0.2, seed: int = 0):
    """``root/<class>/*.png`` (split here) or ``root/train/<class>/...`` with ``root/test`` or ``root/val``.

    Images are resized to ``img_size`` (default: the first image's size) and kept grayscale only when the
    first one is; the whole tree is held in memory, so this suits small data sets.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"image folder {root} does not exist; expected <root>/<class>/<image> files")
    size = (img_size, img_size) if img_size else None
    test_dir = next((root / n for n in ("test", "val") if (root / n).is_dir()), None)
    if (root / "train").is_dir() and test_dir is not None:
        classes = tuple(p.name for p in _class_dirs(root / "train"))
        x_tr, y_tr, size, mode = _read_tree(root / "train", classes, size, None)
        x_te, y_te, _, _ = _read_tree(test_dir, classes, size, mode)
    else:
        classes = tuple(p.name for p in _class_dirs(root))
        x, y, _, _ = _read_tree(root, classes, size, None)
        x_tr, y_tr, x_te, y_te = _split(x, y, test_fraction, seed)
    log.info("image folder %s: %d classes, %d train / %d test images", root, len(classes), len(x_tr), len(x_te))
    return ImageDataset(root.name, x_tr, y_tr, x_te, y_te, classes)
