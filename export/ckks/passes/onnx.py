"""Pass ``onnx``: the model as an ONNX graph, folded first when it is a module.

Reads ``model`` and the options' input shape; writes ``proto``, ``name`` and, for a module, ``report``.
Folding is not a pass of its own: :func:`~polyfhe.exporters.onnx.export_onnx` folds the module and checks the
exported graph against the unfolded one in onnxruntime, a check a separate fold would lose. That export also
analyses the graph it checked, so its report is kept and the ``analyze`` pass does not run the analyzer again.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import onnx

from polyfhe.exporters.ckks.passes import Pass
from polyfhe.exporters.ckks.state import CompileState

__all__ = ["PASS", "load_onnx", "to_onnx_model"]


def load_onnx(model: Any, input_shape: tuple[int, ...] | None = None) -> tuple[onnx.ModelProto, str, Any]:
    """(ONNX ModelProto, name, analysis report or None) for a module (folded and exported), path, bytes or proto."""
    from torch import nn

    from polyfhe.analysis.loader import load_model

    if isinstance(model, nn.Module):
        from polyfhe.exporters.onnx import export_onnx

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "model.onnx"
            exported = export_onnx(model, path, input_shape, require_polynomial=False)  # refused by name later
            return onnx.load(str(path)), getattr(model, "model_name", type(model).__name__), exported.analysis
    name = Path(model).stem if isinstance(model, (str, Path)) else "onnx"
    return load_model(model), name, None


def to_onnx_model(model: Any, input_shape: tuple[int, ...] | None = None) -> tuple[onnx.ModelProto, str]:
    """An ONNX ModelProto for a module (folded and exported), a path, bytes or a ModelProto; plus a name."""
    proto, name, _ = load_onnx(model, input_shape)
    return proto, name


def run(state: CompileState) -> None:
    state.proto, state.name, state.report = load_onnx(state.model, state.options.model_input_shape)


PASS = Pass("onnx", run, ("proto", "name", "report"))
