"""User-supplied data sets: CIFAR-10 pickles, ImageFolder trees, .npz arrays, MNIST IDX folders, detection."""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path

import numpy as np
import pytest

from polyfhe.data import detect_source, load_dataset, open_dataset
from polyfhe.data.formats import CIFAR10_TEST, CIFAR10_TRAIN, load_cifar10, load_image_folder, load_npz


# ------------------------------------------------------------------------------------------------- CIFAR-10
def _write_cifar(root: Path, per_batch: int = 3) -> None:
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in (*CIFAR10_TRAIN, CIFAR10_TEST):
        data = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
        data[0, :1024] = 255  # first image: red channel saturated, green and blue from the rng
        batch = {b"data": data, b"labels": [i % 10 for i in range(per_batch)], b"batch_label": name.encode()}
        (root / name).write_bytes(pickle.dumps(batch, protocol=2))
    meta = {b"label_names": [f"class{i}".encode() for i in range(10)]}
    (root / "batches.meta").write_bytes(pickle.dumps(meta, protocol=2))


def test_cifar10_folder_reads_channels_first(tmp_path: Path) -> None:
    _write_cifar(tmp_path / "cifar-10-batches-py")
    ds = load_cifar10(tmp_path)  # the parent of the unpacked folder works too
    assert ds.x_train.shape == (15, 3, 32, 32) and ds.x_test.shape == (3, 3, 32, 32)
    assert ds.x_train.dtype == np.float32 and 0.0 <= ds.x_train.min() and ds.x_train.max() <= 1.0
    assert np.all(ds.x_train[0, 0] == 1.0) and not np.all(ds.x_train[0, 1] == 1.0)
    assert ds.classes[3] == "class3" and list(ds.y_test) == [0, 1, 2]
    assert detect_source(tmp_path) == "cifar10"
    assert open_dataset(tmp_path / "cifar-10-batches-py").name == "cifar10"


def test_cifar10_missing_batches_named(tmp_path: Path) -> None:
    _write_cifar(tmp_path / "c")
    (tmp_path / "c" / "data_batch_3").unlink()
    with pytest.raises(FileNotFoundError, match="data_batch_3.*CIFAR-10 python version"):
        load_cifar10(tmp_path / "c")


class _Evil:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_cifar_pickle_with_code_is_refused(tmp_path: Path) -> None:
    _write_cifar(tmp_path / "c")
    (tmp_path / "c" / CIFAR10_TEST).write_bytes(pickle.dumps({b"data": _Evil(), b"labels": []}))
    with pytest.raises(ValueError, match="refusing to load builtins.print"):
        load_cifar10(tmp_path / "c")


# ------------------------------------------------------------------------------------------------------ npz
def test_npz_xy_split_and_nhwc_uint8(tmp_path: Path) -> None:
    x = np.zeros((10, 6, 5, 3), dtype=np.uint8)
    x[:, 0, 0, 2] = 255
    np.savez(tmp_path / "toy.npz", x=x, y=np.arange(10) % 4)
    ds = load_npz(tmp_path / "toy.npz", test_fraction=0.2)
    assert ds.x_train.shape == (8, 3, 6, 5) and ds.x_test.shape == (2, 3, 6, 5)
    assert np.all(ds.x_train[:, 2, 0, 0] == 1.0) and np.all(ds.x_train[:, :2, 0, 0] == 0.0)
    assert ds.num_classes == 4 and sorted(np.r_[ds.y_train, ds.y_test]) == sorted(np.arange(10) % 4)
    assert open_dataset(tmp_path / "toy.npz").name == "toy"


def test_npz_explicit_splits_and_classes(tmp_path: Path) -> None:
    np.savez(tmp_path / "s.npz", x_train=np.full((4, 5, 5), 0.5, np.float32), y_train=[0, 1, 0, 1],
             x_test=np.zeros((2, 5, 5), np.float32), y_test=[1, 0], classes=np.array(["cat", "dog"]))
    ds = load_dataset("npz", root=tmp_path / "s.npz")
    assert ds.x_train.shape == (4, 1, 5, 5) and ds.classes == ("cat", "dog") and list(ds.y_test) == [1, 0]


@pytest.mark.parametrize(("arrays", "message"), [
    ({"images": np.zeros((2, 4, 4))}, "expected 'x' and 'y'"),
    ({"x": np.full((3, 4, 4), 2.0), "y": [0, 1, 0]}, r"must lie in \[0, 1\]"),
    ({"x": np.zeros((3, 4, 4)), "y": [0, 1]}, "labels must be 3 non-negative integers"),
    ({"x": np.zeros((3, 4)), "y": [0, 1, 2]}, "images must be"),
])
def test_npz_bad_content_is_named(tmp_path: Path, arrays: dict, message: str) -> None:
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(ValueError, match=message):
        load_npz(tmp_path / "bad.npz")


# ---------------------------------------------------------------------------------------------- ImageFolder
def _write_images(folder: Path, count: int, value: int, mode: str = "RGB", size: int = 6) -> None:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        Image.new(mode, (size, size), value if mode == "L" else (value, 0, 0)).save(folder / f"{i}.png")


def test_image_folder_flat_tree_is_split(tmp_path: Path) -> None:
    _write_images(tmp_path / "tree" / "ants", 5, 200)
    _write_images(tmp_path / "tree" / "bees", 5, 50)
    ds = load_image_folder(tmp_path / "tree", test_fraction=0.2)
    assert ds.classes == ("ants", "bees") and len(ds.x_train) == 8 and len(ds.x_test) == 2
    assert ds.x_train.shape[1:] == (3, 6, 6)
    red = np.r_[ds.x_train, ds.x_test][:, 0, 0, 0]
    labels = np.r_[ds.y_train, ds.y_test]
    assert np.allclose(red[labels == 0], 200 / 255) and np.allclose(red[labels == 1], 50 / 255)
    assert detect_source(tmp_path / "tree") == "imagefolder"


def test_image_folder_train_test_grayscale_resized(tmp_path: Path) -> None:
    for split in ("train", "val"):
        _write_images(tmp_path / split / "a", 2, 10, mode="L", size=12)
        _write_images(tmp_path / split / "b", 2, 240, mode="L", size=12)
    ds = open_dataset("imagefolder", root=tmp_path, img_size=4)
    assert ds.x_train.shape == (4, 1, 4, 4) and ds.x_test.shape == (4, 1, 4, 4)


def test_image_folder_without_images(tmp_path: Path) -> None:
    (tmp_path / "empty" / "cls").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="no images"):
        load_image_folder(tmp_path / "empty")


# ------------------------------------------------------------------------------------------ MNIST IDX folder
def _idx(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def _write_idx_folder(root: Path) -> None:
    root.mkdir(parents=True)
    for prefix, n in (("train", 6), ("t10k", 2)):
        (root / f"{prefix}-images-idx3-ubyte.gz").write_bytes(gzip.compress(_idx(np.full((n, 7, 7), 51))))
        (root / f"{prefix}-labels-idx1-ubyte").write_bytes(_idx(np.arange(n) % 3))


def test_mnist_idx_folder_detected(tmp_path: Path) -> None:
    _write_idx_folder(tmp_path / "my-mnist")
    assert detect_source(tmp_path / "my-mnist") == "mnist"
    ds = open_dataset(tmp_path / "my-mnist")
    assert ds.name == "mnist" and ds.x_train.shape == (6, 1, 7, 7) and np.allclose(ds.x_train, 0.2)
    _write_idx_folder(tmp_path / "fashion")
    assert open_dataset(tmp_path / "fashion").classes[0] == "T-shirt/top"
    assert open_dataset("fashion-mnist", root=tmp_path / "fashion").x_test.shape == (2, 1, 7, 7)


# ------------------------------------------------------------------------------------------------ bad input
def test_missing_path_says_what_and_how(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"does not exist.*npz.*dataset-fashion-mnist"):
        open_dataset(tmp_path / "nothing-here")
    with pytest.raises(FileNotFoundError, match=r"IDX files.*dataset-fashion-mnist"):
        load_dataset("fashion-mnist", root=tmp_path / "nothing-here")


def test_path_only_sources_need_a_root() -> None:
    with pytest.raises(ValueError, match="needs a path"):
        load_dataset("cifar10")


def test_unrecognised_folder(tmp_path: Path) -> None:
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(ValueError, match="cannot tell what dataset"):
        detect_source(tmp_path)
