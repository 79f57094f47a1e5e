"""What both halves of any engine check at the byte boundary: inputs against the manifest, containers against
the program's identity (program id, parameters, engine, Galois steps), and the query and result containers."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from polyfhe.program.manifest import ProgramManifest
from polyfhe.program.params import CKKSParams, ParameterError, fingerprint_params
from polyfhe.program.program_formats import LEGACY_BACKEND
from polyfhe.program.wire import (
    KIND_CIPHERTEXT,
    KIND_CONTEXT,
    KIND_SECRET,
    Container,
    WireError,
    pack,
    unpack,
)

if TYPE_CHECKING:
    from polyfhe.program.ckks_program import CKKSProgram

__all__ = ["DEFAULT_MAX_CIPHERTEXT_BYTES", "DEFAULT_MAX_CONTEXT_BYTES", "RANGE_TOLERANCE", "InputError",
           "KeyMismatchError", "NumericalWarning", "RunStats", "check_identity", "check_input", "check_key_identity",
           "check_result", "check_samples", "galois_element", "identity_header", "join_results", "open_backup",
           "open_public_context", "open_query", "pack_result", "split_queries"]

log = logging.getLogger(__name__)


class InputError(ValueError):
    """An input of the wrong shape, type or values for the program."""


class KeyMismatchError(ValueError):
    """Keys made for another program, other parameters or another engine, or two halves that do not belong
    together; the message says what was expected and what was found."""


def galois_element(step: int, poly_modulus_degree: int, generator: int = 3) -> int:
    """The Galois element of a left rotation by ``step`` slots: generator^step mod 2N (SEAL's generator is 3)."""
    return pow(generator, step % (poly_modulus_degree // 2), 2 * poly_modulus_degree)


def identity_header(manifest: ProgramManifest) -> dict:
    """What ties bytes to one program: its id and a fingerprint of its parameters (servers check both)."""
    return {"program_id": manifest.program_id, "params": fingerprint_params(manifest.params)}


RANGE_TOLERANCE = 0.05  # inputs may pass the calibrated range by this share of its span (calibration samples a range)


class NumericalWarning(UserWarning):
    """A numerical hazard the caller must see: inputs changed (clipped) before encryption, or an encrypted result
    further from the plaintext program than the parameters' noise explains."""


def check_samples(manifest: ProgramManifest, x, clip: bool = False) -> np.ndarray:
    """``x`` as (samples, input_size) float64, any number of samples, checked against the program's input shape and
    calibrated range; raises :class:`InputError`. ``clip``: clip values outside the calibrated range to it (with a
    :class:`NumericalWarning` saying how many) instead of refusing them."""
    m = manifest
    arr = np.asarray(x)
    if arr.dtype.kind not in "fiub":
        raise InputError(f"input dtype {arr.dtype} is not real numeric; expected float images "
                         f"of shape {tuple(m.input_shape)}")
    dtype = arr.dtype
    arr = arr.astype(np.float64)
    per_sample = m.input_size
    sample = tuple(m.input_shape[1:])
    if arr.size == per_sample:
        arr = arr.reshape(1, per_sample)
    elif arr.ndim > 1 and arr.shape[0] > 0 and (tuple(arr.shape[1:]) == sample or arr.shape[1:] == (per_sample,)):
        arr = arr.reshape(-1, per_sample)
    else:
        raise InputError(_shape_message(arr.shape, sample, per_sample))
    if not np.all(np.isfinite(arr)):
        raise InputError("input contains NaN or infinite values")
    return _check_range(m, arr, dtype, clip)


def _shape_message(shape: tuple[int, ...], sample: tuple[int, ...], per_sample: int) -> str:
    """What was given, what one sample and a batch are, and (only where the trailing axes say so) how to batch."""
    text = (f"input of shape {tuple(shape)} is not one sample of this program, shape {sample} ({per_sample} "
            f"values), nor a batch of them, shape (n, {', '.join(map(str, sample))}) or (n, {per_sample})")
    squeezed = tuple(d for d in sample if d != 1)
    if len(shape) > 1 and tuple(shape[1:]) == squeezed and squeezed != sample:
        text += (f"; if these are {shape[0]} samples without their size-1 axes, restore them (x.reshape(-1, "
                 f"{', '.join(map(str, sample))})); if it is one image with {shape[0]} channels, this program takes "
                 f"{sample[0]}")
    return text


def _check_range(m: ProgramManifest, arr: np.ndarray, dtype: np.dtype, clip: bool) -> np.ndarray:
    """Refuse (or clip) values past the calibrated range: the scale's headroom is sized for it, and values far
    outside it overflow the modulus and decrypt to garbage without any error."""
    lo, hi = m.input_range
    if clip:
        outside = int(np.count_nonzero((arr < lo) | (arr > hi)))
        if outside:
            message = (f"clipped {outside} of {arr.size} input values to the calibrated range [{lo:.6g}, {hi:.6g}] "
                       f"of program {m.program_id} (they spanned [{arr.min():.6g}, {arr.max():.6g}]); the result is "
                       "the program's on the clipped input")
            log.warning(message)
            warnings.warn(message, NumericalWarning, stacklevel=_caller_level())
        return np.clip(arr, lo, hi)
    slack = RANGE_TOLERANCE * max(hi - lo, 1e-12)
    if arr.min() >= lo - slack and arr.max() <= hi + slack:
        return arr
    raise InputError(f"input values span [{arr.min():.6g}, {arr.max():.6g}], outside the range program "
                     f"{m.program_id} takes: [{lo:.6g}, {hi:.6g}] (calibrated; {RANGE_TOLERANCE:.0%} of its span "
                     f"is tolerated either side). Encrypted results of inputs outside it overflow or lose precision "
                     f"without any error. {_normalise_hint(arr, dtype, lo, hi)}")


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside polyfhe: a warning names the caller's line, not ours."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def _normalise_hint(arr: np.ndarray, dtype: np.dtype, lo: float, hi: float) -> str:
    if (dtype == np.uint8 or (arr.min() >= 0 and 1.5 < arr.max() <= 255)) and hi <= 1.0 + RANGE_TOLERANCE:
        return ("These look like 8-bit pixels (0-255): divide them by 255 first (x / 255), as the calibration data "
                "was; clipping them to the range instead would turn almost every pixel white.")
    return ("Normalise inputs the way the calibration data was (the same scaling and shift), or pass clip=True "
            "(`--clip` on the command line) to clip the few values past the range.")


def check_input(manifest: ProgramManifest, x, clip: bool = False) -> np.ndarray:
    """``x`` as (samples, input_size) float64, checked against the program (:func:`check_samples`), at most as many
    samples as one query holds; raises :class:`InputError`."""
    arr = check_samples(manifest, x, clip)
    capacity = manifest.samples_per_query
    if len(arr) > capacity:
        raise InputError(f"{len(arr)} samples exceed the {capacity} this program packs into one ciphertext "
                         f"({manifest.layout} layout); encrypt_batch(x) encrypts them in chunks of {capacity} (one "
                         "query each) and decrypt(list of results) joins the logits")
    return arr


def split_queries(manifest: ProgramManifest, x, clip: bool = False) -> list[np.ndarray]:
    """``x`` checked (:func:`check_samples`) and split into chunks of at most ``samples_per_query`` samples, one
    query each."""
    arr = check_samples(manifest, x, clip)
    step = manifest.samples_per_query
    return [arr[i:i + step] for i in range(0, len(arr), step)]


def join_results(decrypt, results) -> np.ndarray:
    """The logits of a list of results (one per query of ``encrypt_batch``), decrypted one by one and joined."""
    if not results:
        raise InputError("decrypt takes a result or a non-empty list of results")
    return np.concatenate([decrypt(r) for r in results])


def _keys_for(program_id, fingerprint, params_full, backend) -> str:
    try:
        params = CKKSParams.from_dict(params_full).describe() if params_full else f"parameters {fingerprint}"
    except ParameterError:
        params = f"parameters {fingerprint}"
    return f"program {program_id} on {backend} ({params})"


def check_key_identity(header: dict, manifest: ProgramManifest, what: str) -> None:
    """Refuse keys whose header names another program, parameter set or engine than ``manifest``: keys of
    another program would decrypt its results to noise instead of failing."""
    found = (header.get("program_id"), header.get("params"), header.get("backend", LEGACY_BACKEND))
    expected = (manifest.program_id, fingerprint_params(manifest.params), manifest.backend)
    if found != expected:
        raise KeyMismatchError(f"{what} holds keys for {_keys_for(*found[:2], header.get('params_full'), found[2])}"
                               f"; expected keys for {_keys_for(*expected[:2], manifest.params.to_dict(), expected[2])}")


def open_backup(manifest: ProgramManifest, data: bytes) -> Container:
    """A private backup (``secret_context()``) checked to be this program's; raises ``WireError`` (not a
    backup, truncated) or :class:`KeyMismatchError`."""
    box = unpack(data, KIND_SECRET)
    check_key_identity(box.header, manifest, "the private backup")
    if "secret_key" not in box.sections:
        raise WireError("the private backup holds no secret key")
    return box


def open_public_context(manifest: ProgramManifest, data: bytes) -> Container:
    """A public context checked to be this program's, with its Galois steps; raises like :func:`open_backup`."""
    box = unpack(data, KIND_CONTEXT)
    check_key_identity(box.header, manifest, "the public context")
    if list(box.header.get("galois_steps", [])) != list(manifest.galois_steps):
        raise KeyMismatchError("the public context holds Galois keys for other rotation steps than the program's")
    return box


def check_result(manifest: ProgramManifest, box) -> tuple[int, int]:
    """(count, samples) of a result container for this program; raises :class:`WireError`."""
    if box.header.get("program_id") != manifest.program_id:
        raise WireError(f"ciphertext is for program {box.header.get('program_id')!r}, this client holds "
                        f"keys for {manifest.program_id!r}")
    count, samples = int(box.header.get("count", -1)), int(box.header.get("samples", -1))
    expected = 1 if manifest.layout == "single" else manifest.output_size
    if count != expected or len(box.sections) != count:
        raise WireError(f"result holds {count} ciphertexts, expected {expected}")
    capacity = manifest.samples_per_query
    if not 1 <= samples <= capacity:
        raise WireError(f"result claims {samples} samples; one ciphertext of this program holds 1 to {capacity}")
    return count, samples


DEFAULT_MAX_CONTEXT_BYTES = 4 << 30
DEFAULT_MAX_CIPHERTEXT_BYTES = 1 << 30


@dataclass
class RunStats:
    """One evaluation: its server compute time, what it did, and the program's plaintext store afterwards.

    ``counts`` holds this run's rotations, key_switches, plain_products, products (ct x ct), rescales, encodes
    (scalar_encodes among them), plaintext_hits and evictions (the store's, during the run: with sessions of one
    program running at once, theirs too), plus ``plaintext_bytes``: what the store holds after the run.
    ``plaintext`` is the store's state (:class:`~polyfhe.runtime.plaintexts.StoreStats`, totals since it was made).
    """

    seconds: float = 0.0
    counts: dict = field(default_factory=dict)
    plaintext: dict = field(default_factory=dict)


def check_identity(header: dict, program: CKKSProgram, what: str) -> None:
    if header.get("program_id") != program.program_id:
        raise WireError(f"{what} was made for program {header.get('program_id')!r}, this server runs "
                        f"{program.program_id!r}")
    if header.get("params") != fingerprint_params(program.params):
        raise WireError(f"{what} uses other CKKS parameters than {program.params.describe()}")


def open_query(data: bytes, program: CKKSProgram, max_bytes: int) -> tuple[list[bytes], int]:
    """(ciphertext sections ct0, ct1, ..., samples) of an input container for ``program``: bounded, the program's
    own, as many ciphertexts as its layout takes; raises :class:`WireError` with the reason. Engine-neutral."""
    box = unpack(data, KIND_CIPHERTEXT, max_bytes=max_bytes)
    check_identity(box.header, program, "ciphertext")
    m = program.manifest
    expected = 1 if m.layout == "single" else m.input_size
    names = [f"ct{i}" for i in range(expected)]
    if box.header.get("count") != expected or list(box.sections) != names:
        raise WireError(f"input holds {len(box.sections)} ciphertexts, the program takes {expected}")
    samples = box.header.get("samples", 1)
    capacity = m.samples_per_query
    if not isinstance(samples, int) or not 1 <= samples <= capacity:
        raise WireError(f"input claims {samples!r} samples; one ciphertext of this program holds 1 to {capacity}")
    return [box.sections[name] for name in names], samples


def pack_result(program: CKKSProgram, ciphertexts: list[bytes], samples: int, **extra) -> bytes:
    """The output container the program's client decrypts (``extra``: more header fields, e.g. the backend)."""
    header = {**identity_header(program.manifest), **extra, "role": "output", "count": len(ciphertexts),
              "samples": samples}
    return pack(KIND_CIPHERTEXT, header, {f"ct{i}": ct for i, ct in enumerate(ciphertexts)})
