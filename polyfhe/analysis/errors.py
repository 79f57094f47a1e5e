"""Exceptions of the analysis package."""

from __future__ import annotations

__all__ = ["ModelLoadError"]


class ModelLoadError(ValueError):
    """The input is not a readable, structurally valid ONNX model (missing, corrupt or truncated).

    The CLI maps it to exit code 2 ("cannot read the input"), distinct from 1 ("not polynomial").
    """
