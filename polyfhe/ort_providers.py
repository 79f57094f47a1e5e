"""Which onnxruntime execution providers a session runs on, decided in one place.

CUDA when onnxruntime-gpu offers ``CUDAExecutionProvider`` (CPU behind it for the ops CUDA lacks), CPU
otherwise. ``POLYFHE_ORT_DEVICE=cpu`` (or ``device="cpu"``) forces CPU; ``cuda`` insists on CUDA and fails
when it is missing. TF32 is switched off on CUDA: ONNX parity checks compare against float32 torch at 1e-5, and TF32's
10-bit mantissa would fail them on a correct graph. The first session on each provider logs which one ran, and
a session that asked for CUDA but came up without it (missing CUDA libraries) says so instead of silently
running on the CPU.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ENV_VAR = "POLYFHE_ORT_DEVICE"
DEVICES = ("auto", "cpu", "cuda")
CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
CUDA_OPTIONS = {"use_tf32": "0"}  # float32 parity with torch; see the module docstring
DISTRIBUTIONS = ("onnxruntime", "onnxruntime-gpu")  # both install the same `onnxruntime` module
CONFLICT_FIX = "pip uninstall -y onnxruntime onnxruntime-gpu && pip install onnxruntime-gpu"

_announced: set[str] = set()


def requested_device(device: str | None = None) -> str:
    """``device`` if given, else ``$POLYFHE_ORT_DEVICE``, else ``auto``; refuses anything else by name."""
    chosen = (device if device is not None else os.environ.get(ENV_VAR, "") or "auto").strip().lower()
    if chosen not in DEVICES:
        source = "device" if device is not None else ENV_VAR
        raise ValueError(f"{source}={chosen!r} unknown; accepted: {', '.join(DEVICES)}")
    return chosen


def available_providers() -> list[str]:
    import onnxruntime as ort

    return list(ort.get_available_providers())


def choose_providers(device: str | None = None, available: Sequence[str] | None = None) -> list[Any]:
    """``[(CUDA, options), CPU]`` when CUDA is offered and not refused, else ``[CPU]``."""
    wanted = requested_device(device)
    offered = list(available) if available is not None else available_providers()
    if wanted == "cpu":
        return [CPU]
    if CUDA in offered:
        return [(CUDA, dict(CUDA_OPTIONS)), CPU]
    if wanted == "cuda":
        raise RuntimeError(f"onnxruntime on CUDA was asked for, but this onnxruntime offers only {offered}; "
                           f"install the gpu extra as the README says ({CONFLICT_FIX})")
    return [CPU]


def installed_distributions() -> list[str]:
    """Which of onnxruntime / onnxruntime-gpu pip has installed (both at once is a broken install)."""
    found = []
    for name in DISTRIBUTIONS:
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        found.append(name)
    return found


def _provider_name(provider: Any) -> str:
    return provider[0] if isinstance(provider, tuple) else provider


def announce(asked: Sequence[Any], running: Sequence[str]) -> None:
    """Log once per process and provider which one runs; warn when CUDA was asked for but did not come up."""
    first = running[0] if running else "none"
    if not _announced:
        both = installed_distributions()
        if len(both) > 1:
            log.warning("both %s are installed and share one `onnxruntime` module (the last one installed "
                        "wins); fix: %s", " and ".join(both), CONFLICT_FIX)
    if _provider_name(asked[0]) == CUDA and first != CUDA and "cuda-fallback" not in _announced:
        _announced.add("cuda-fallback")
        log.warning("onnxruntime offers %s but the session runs on %s (CUDA libraries missing or "
                    "mismatched?); results are right but slower; %s=cpu silences this", CUDA, first, ENV_VAR)
    if first not in _announced:
        _announced.add(first)
        log.info("onnxruntime runs on %s (%s=cpu|cuda|auto to choose)", first, ENV_VAR)


def inference_session(model: str | Path | bytes, options: Any = None, *, device: str | None = None) -> Any:
    """``ort.InferenceSession`` of a path or serialized model on the providers that :func:`choose_providers`
    picks; the first session on each provider logs which one runs."""
    import onnxruntime as ort

    providers = choose_providers(device)
    source = str(model) if isinstance(model, Path) else model
    session = ort.InferenceSession(source, options, providers=providers)
    announce(providers, session.get_providers())
    return session
