"""Checkpoints: ``model.safetensors`` (every parameter and buffer) beside ``config.json`` (how to rebuild it).

The config names the registry model and its keyword arguments, so a checkpoint rebuilds through
:func:`polyfhe.models.registry.create_model` with no pickled code; safetensors keeps loading safe.
Both files are written to a temporary name and renamed, so a crash never leaves a half-written checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or holds another architecture than the caller expects."""


@dataclass(frozen=True)
class CheckpointInfo:
    """What ``config.json`` records: the registry model, its build arguments, the epoch and free-form extras."""

    model_name: str
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    epoch: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "model_name": self.model_name,
            "model_kwargs": _jsonable(self.model_kwargs),
            "epoch": self.epoch,
            "extra": _jsonable(self.extra),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CheckpointInfo:
        if not isinstance(data, dict) or not isinstance(data.get("model_name"), str):
            raise CheckpointError(f"checkpoint config must be a JSON object with a string 'model_name', got {data!r}")
        return cls(
            model_name=data["model_name"],
            model_kwargs=dict(data.get("model_kwargs") or {}),
            epoch=int(data.get("epoch", 0)),
            extra=dict(data.get("extra") or {}),
        )


def _jsonable(value: Any) -> Any:
    """Tuples become lists, numpy/torch scalars become Python numbers, so ``json.dumps`` never fails late."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 1) == 0:
        return value.item()
    if isinstance(value, Path):
        return str(value)
    return value


def _unwrap(model: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped, so keys carry no ``_orig_mod.`` prefix."""
    return getattr(model, "_orig_mod", model)


def _atomic_write(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_checkpoint(
    model: nn.Module,
    out_dir: str | Path,
    *,
    model_name: str,
    model_kwargs: dict[str, Any],
    epoch: int = 0,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``out_dir/model.safetensors`` and ``out_dir/config.json``; returns ``out_dir``."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in _unwrap(model).state_dict().items()}
    info = CheckpointInfo(model_name, dict(model_kwargs), int(epoch), dict(extra or {}))
    text = json.dumps(info.to_dict(), indent=2, sort_keys=True)  # fail before touching the weights file
    _atomic_write(out_dir / WEIGHTS_FILE, lambda p: save_file(state, str(p), metadata={"model_name": model_name}))
    _atomic_write(out_dir / CONFIG_FILE, lambda p: p.write_text(text + "\n"))
    log.info("saved checkpoint of %s (epoch %d) to %s", model_name, epoch, out_dir)
    return out_dir


def read_checkpoint_info(path_or_dir: str | Path) -> CheckpointInfo:
    """Only the config: cheap, no weights loaded."""
    config_path = _checkpoint_dir(path_or_dir) / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(f"no {CONFIG_FILE} at {config_path}; a checkpoint folder holds {WEIGHTS_FILE} "
                              f"and {CONFIG_FILE} (written by polyfhe train / save_checkpoint)")
    try:
        data = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{config_path} is not valid JSON ({exc}); expected a polyfhe checkpoint config") from exc
    return CheckpointInfo.from_dict(data)


def _checkpoint_dir(path_or_dir: str | Path) -> Path:
    path = Path(path_or_dir)
    return path.parent if path.name in (WEIGHTS_FILE, CONFIG_FILE) else path


def load_checkpoint(
    path_or_dir: str | Path, *, expect_model: str | None = None, map_location: str | torch.device = "cpu"
) -> tuple[nn.Module, CheckpointInfo]:
    """Rebuild the registry model from ``config.json`` and load its weights strictly."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from polyfhe.models.registry import create_model

    root = _checkpoint_dir(path_or_dir)
    if not root.exists():
        raise CheckpointError(f"checkpoint {root} does not exist; expected a folder with {WEIGHTS_FILE} and {CONFIG_FILE}")
    info = read_checkpoint_info(root)
    if expect_model is not None and info.model_name != expect_model:
        raise CheckpointError(
            f"checkpoint {root} holds architecture {info.model_name!r}, but {expect_model!r} was expected"
        )
    weights = root / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointError(f"no {WEIGHTS_FILE} in {root}; expected the weights beside {CONFIG_FILE}")
    try:
        state = load_file(str(weights), device=str(map_location))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{weights} is not a readable safetensors file ({exc})") from exc
    try:
        model = create_model(info.model_name, **info.model_kwargs)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"cannot rebuild {info.model_name!r} from {root / CONFIG_FILE}: {exc}") from exc
    model.to(map_location)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise CheckpointError(
            f"weights in {weights} do not fit {info.model_name!r} built with {info.model_kwargs}: {exc}"
        ) from exc
    return model, info


__all__ = ["CheckpointError", "CheckpointInfo", "fold_input_normalization", "load_checkpoint", "read_checkpoint_info",
           "save_checkpoint"]


def fold_input_normalization(model: nn.Module, info: CheckpointInfo) -> nn.Module:
    """``model`` taking images in [0, 1]: a run trained on (x - mean) / std gets that map as its first (constant
    affine) layer, which exporters merge into the first linear map. Unchanged when the run recorded none."""
    normalization = info.extra.get("normalization")
    if normalization is None:
        return model
    from polyfhe.training.data import Normalization

    log.info("input normalisation %s folded into the model: it takes images in [0, 1]", normalization)
    return Normalization.from_dict(normalization).prepend_to(model)
