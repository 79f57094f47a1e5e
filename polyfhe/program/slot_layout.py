"""Where a sample's values sit in the slots of one ciphertext (single layout), and what one sample is.

This is the program's public input layout: the Python clients, the browser client and the plain executor all
place values with :func:`pack_single` and read results back with :func:`unpack_single`, so it lives beside the
manifest it reads, below the runtime and the engines.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from polyfhe.program.manifest import ProgramManifest

__all__ = ["as_samples", "pack_single", "sample_shape", "unpack_single"]


def pack_single(manifest, values: np.ndarray) -> np.ndarray:
    """Slot vector for up to ``samples_per_ciphertext`` samples (rows of ``values``): the program's public packing.

    Each sample's virtual vector repeats its input every ``input_period`` slots; sample j goes to the real slots
    ``u*k + j``; unused lanes stay zero. A replicated packing (``input_gather``) writes some values to several slots.
    """
    rows = np.atleast_2d(np.asarray(values, dtype=np.float64))
    lanes, virtual = manifest.samples_per_ciphertext, manifest.virtual_slots
    if len(rows) > lanes:
        raise ValueError(f"{len(rows)} samples do not fit one ciphertext of this program ({lanes} per ciphertext)")
    period = manifest.input_period
    grid = np.zeros((lanes, period))
    gather = getattr(manifest, "input_gather", ())
    grid[: len(rows), list(manifest.input_slots)] = rows[:, list(gather)] if gather else rows
    return np.tile(grid, (1, virtual // period)).T.reshape(-1)


def unpack_single(manifest, vec: np.ndarray, samples: int) -> np.ndarray:
    """(samples, output_size) from a decoded slot vector of the single layout (inverse of the packing)."""
    lanes = manifest.samples_per_ciphertext
    grid = np.asarray(vec)[: manifest.params.slots].reshape(-1, lanes).T
    return grid[:samples][:, list(manifest.output_slots)]


def sample_shape(m: ProgramManifest) -> tuple[int, ...]:
    """The shape of one sample: the manifest's input shape without its leading batch axis of 1."""
    shape = tuple(m.input_shape)
    return shape[1:] if len(shape) > 1 and shape[0] == 1 else shape


def as_samples(m: ProgramManifest, x: Any) -> np.ndarray:
    """``x`` (one sample or a batch; numpy, torch or nested lists) as float64 ``(n, input_size)``."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # a torch tensor, read without importing torch
        x = x.detach().cpu()
        x = x.double() if x.is_floating_point() else x
    arr = np.asarray(x)
    if arr.dtype.kind not in "fiub":
        raise ValueError(f"input dtype {arr.dtype} is not real numeric; expected samples of shape {sample_shape(m)}")
    arr = arr.astype(np.float64, copy=False)
    if arr.size == m.input_size:
        return arr.reshape(1, m.input_size)
    if arr.ndim > 1 and int(np.prod(arr.shape[1:])) == m.input_size:
        return arr.reshape(-1, m.input_size)
    raise ValueError(f"input of shape {arr.shape} is neither one sample of shape {sample_shape(m)} "
                     f"({m.input_size} values) nor a batch (n, ...) of such samples")
