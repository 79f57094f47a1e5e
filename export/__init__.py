"""Exporters behind one function: ``polyfhe.export(model, target="onnx" | "ckks" | "concrete", ...)``.

Inside the code base import exporter modules directly (``from polyfhe.export.onnx import export_onnx``):
``polyfhe.export`` the attribute is this function, which shadows the subpackage.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polyfhe._callable_module import make_callable

if TYPE_CHECKING:
    from torch import nn


def _onnx_target(model: nn.Module, path: str | Path | None = None, input_shape: tuple[int, ...] | None = None,
                 **kwargs: Any) -> Path:
    from polyfhe.export.onnx import export_onnx

    if path is None:
        raise ValueError("target='onnx' needs path=... (where to write the .onnx file)")
    return export_onnx(model, path, input_shape, **kwargs).path


def _ckks_target(model: Any, **kwargs: Any) -> Any:
    from polyfhe.export.ckks import export_ckks

    return export_ckks(model, **kwargs)


def _concrete_target(model: Any, **kwargs: Any) -> Any:
    from polyfhe.concrete import export_concrete

    return export_concrete(model, **kwargs)


EXPORT_TARGETS: dict[str, Callable[..., Any]] = {"onnx": _onnx_target, "ckks": _ckks_target,
                                                 "concrete": _concrete_target}


def export(model: nn.Module, target: str = "onnx", **kwargs: Any) -> Any:
    """Export ``model`` to ``target``; "onnx" folds, exports, checks parity and polynomiality, returns the path."""
    try:
        exporter = EXPORT_TARGETS[target]
    except KeyError:
        raise ValueError(f"unknown export target {target!r}; available: {', '.join(sorted(EXPORT_TARGETS))}") from None
    return exporter(model, **kwargs)


__all__ = ["EXPORT_TARGETS", "export"]

make_callable(__name__, export)
