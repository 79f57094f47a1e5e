"""Input files of ``polyfhe run`` and ``polyfhe client infer``: a file -> ``(samples, C, H, W)`` float64, checked
against the program's manifest.

FILE is an ``.npy`` array, an ``.npz`` with array ``x`` (a stack of any number of samples: the commands encrypt
them in chunks of as many as one ciphertext holds) or an image (``.png``/``.jpg``: converted to the program's
channels and size, scaled to [0, 1]).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported by the readers: `polyfhe run --help` loads this module without numpy
    import numpy as np

__all__ = ["READERS", "RunInputError", "read_input"]


class RunInputError(ValueError):
    """An input file that is missing, unreadable or does not fit the program (exit code 2)."""


def _read_npy(path: Path, manifest: Any) -> np.ndarray:
    import numpy as np

    return _fit(np.load(path, allow_pickle=False), manifest, path, all_samples=True)


def _read_npz(path: Path, manifest: Any) -> np.ndarray:
    import numpy as np

    with np.load(path, allow_pickle=False) as data:
        if "x" not in data.files:
            raise RunInputError(f"{path} holds arrays {data.files}; expected one named 'x'")
        x = data["x"]
    return _fit(x, manifest, path, all_samples=True)


def _read_image(path: Path, manifest: Any) -> np.ndarray:
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    c, h, w = _chw(manifest)
    modes = {1: "L", 3: "RGB"}
    if c not in modes:
        raise RunInputError(f"the program takes {c} input channels; images work only for 1 (grayscale) "
                            "or 3 (RGB)")
    try:
        with Image.open(path) as img:
            img = img.convert(modes[c]).resize((w, h), Image.Resampling.BILINEAR)
            arr = np.asarray(img, dtype=np.float64) / 255.0
    except (UnidentifiedImageError, OSError) as exc:
        raise RunInputError(f"{path} is not a readable image: {exc}") from exc
    arr = arr[None] if c == 1 else arr.transpose(2, 0, 1)
    return arr.reshape(1, c, h, w)


READERS: dict[str, Callable[[Path, Any], np.ndarray]] = {
    ".npy": _read_npy, ".npz": _read_npz, ".png": _read_image, ".jpg": _read_image, ".jpeg": _read_image,
}


def _chw(manifest: Any) -> tuple[int, ...]:
    import numpy as np

    shape = tuple(manifest.input_shape[1:])
    return shape if len(shape) == 3 else (1, 1, int(np.prod(shape)))


def _fit(x: np.ndarray, manifest: Any, path: Path, all_samples: bool) -> np.ndarray:
    """Reshape to (samples, *input_shape[1:]): one sample, or a stack of any number."""
    import numpy as np

    shape = tuple(manifest.input_shape[1:])
    x = np.asarray(x)
    if x.dtype.kind not in "fiub":
        raise RunInputError(f"{path} holds {x.dtype} values; expected real numbers")
    n = manifest.input_size
    if x.size == n:
        return x.astype(np.float64).reshape(1, *shape)
    stacked = x.ndim >= 2 and int(np.prod(x.shape[1:])) == n
    if stacked and all_samples and len(x) > 0:
        return x.astype(np.float64).reshape(-1, *shape)
    raise RunInputError(f"{path} holds an array of shape {x.shape}; this {manifest.layout}-layout program "
                        f"takes one sample of shape {shape} ({n} values) or a stack (n, ...) of them")


def read_input(path: Path, manifest: Any) -> np.ndarray:
    """Read ``path`` with the reader its suffix names; raises :class:`RunInputError` with the reason."""
    if not path.is_file():
        raise RunInputError(f"input file {path} does not exist")
    reader = READERS.get(path.suffix.lower())
    if reader is None:
        raise RunInputError(f"cannot read {path.name}: accepted inputs are {', '.join(READERS)}")
    try:
        return reader(path, manifest)
    except (ValueError, OSError) as exc:
        if isinstance(exc, RunInputError):
            raise
        raise RunInputError(f"cannot read {path}: {exc}") from exc
