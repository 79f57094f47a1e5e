"""What every model family's config and builder share: override checks, positive sizes, the input-shape check."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import fields, replace
from typing import Any

import torch
from torch import nn

__all__ = ["build_from_config", "check_image_batch", "check_positive_ints"]


def build_from_config(model_cls: type[nn.Module], base: Any, overrides: dict[str, Any], label: str,
                      also_accepted: Iterable[str] = ()) -> nn.Module:
    """``model_cls(base with overrides)``; lists become tuples, unknown names raise ``TypeError`` listing the
    accepted ones (``also_accepted``: shorthands the caller resolved before)."""
    names = {f.name for f in fields(base)}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()}
    unknown = set(values) - names
    if unknown:
        raise TypeError(f"unknown {label} options {sorted(unknown)}; accepted: {sorted([*names, *also_accepted])}")
    return model_cls(replace(base, **values))


def check_positive_ints(owner: str, values: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the first value that is not a positive int (bools are refused)."""
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{owner}.{name} must be a positive integer, got {value!r}")


def check_image_batch(model: nn.Module, x: torch.Tensor) -> None:
    """Image models take ``(B, *model.input_shape)``; anything else is refused before it reaches a layer."""
    if not torch.jit.is_tracing() and tuple(x.shape[1:]) != tuple(model.input_shape):
        raise ValueError(f"{type(model).__name__} expects input (B, {model.input_shape}), got {tuple(x.shape)}")
