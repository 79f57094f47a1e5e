"""Load an ONNX model from a proto, a path or bytes, and refuse anything structurally broken.

Protobuf happily parses a file truncated at a field boundary (or an empty file) into a partial
``ModelProto``, so parsing alone does not prove the file is whole: we also check that the graph, its
outputs and the default-domain opset are present and that every value a node reads is defined.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TypeAlias

import onnx

from polyfhe.analysis.errors import ModelLoadError
from polyfhe.analysis.graph import topological_order

__all__ = ["ModelLike", "ModelLoadError", "default_opset", "input_dims", "load_model"]

log = logging.getLogger(__name__)

ModelLike: TypeAlias = onnx.ModelProto | str | os.PathLike | bytes | bytearray | memoryview

DEFAULT_DOMAINS = ("", "ai.onnx")


def load_model(model: ModelLike) -> onnx.ModelProto:
    """Return a validated ModelProto with model-local functions inlined (so their bodies are analyzed)."""
    proto = _parse(model)
    _validate(proto)
    return _inline_functions(proto)


def input_dims(path: str | os.PathLike) -> list[int | None]:
    """Dimensions of an ONNX file's graph input (its first input that is not an initializer; None where the
    graph leaves one symbolic), read without external data; raises :class:`ModelLoadError` when the file cannot
    be read or has no input."""
    try:
        graph = onnx.load(str(path), load_external_data=False).graph
    except Exception as exc:  # protobuf raises several types on corrupt files
        raise ModelLoadError(f"{path} is not a readable ONNX model: {type(exc).__name__}: {exc}") from exc
    initializers = {t.name for t in graph.initializer}
    inputs = [i for i in graph.input if i.name not in initializers]
    if not inputs:
        raise ModelLoadError(f"{path} has no graph input")
    return [d.dim_value if d.HasField("dim_value") else None for d in inputs[0].type.tensor_type.shape.dim]


def default_opset(model: onnx.ModelProto) -> int:
    """Version of the default ONNX domain the model imports (0 when absent)."""
    versions = [o.version for o in model.opset_import if o.domain in DEFAULT_DOMAINS]
    return max(versions, default=0)


def _parse(model: ModelLike) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, (bytes, bytearray, memoryview)):
        return _parse_bytes(bytes(model), "<bytes>")
    if isinstance(model, (str, os.PathLike)):
        path = Path(model)
        if not path.exists():
            raise ModelLoadError(f"no such file: {path}")
        if not path.is_file():
            raise ModelLoadError(f"not a file: {path}")
        try:
            return onnx.load(str(path))
        except Exception as exc:  # protobuf DecodeError, missing external data, ...
            raise ModelLoadError(f"cannot read ONNX model {path}: {type(exc).__name__}: {exc}") from exc
    raise ModelLoadError(_wrong_type(model))


def _wrong_type(model: object) -> str:
    """What was given, what is accepted, and for a torch module how to get there."""
    accepted = "an onnx.ModelProto, a path to a .onnx file or its bytes"
    if any(c.__name__ == "Module" and c.__module__.startswith("torch.nn") for c in type(model).__mro__):
        return (f"got a torch module ({type(model).__name__}) where an ONNX model is expected ({accepted}): "
                "polyfhe.analyze(module, input_shape=(1, 28, 28)) exports it first, or export it yourself with "
                "polyfhe.export(model, target=\"onnx\", path=\"model.onnx\") and analyze the file")
    return (f"expected {accepted}, or (polyfhe.analyze) a torch nn.Module with its input_shape; "
            f"got {type(model).__name__}")


def _parse_bytes(data: bytes, origin: str) -> onnx.ModelProto:
    try:
        return onnx.load_from_string(data)
    except Exception as exc:
        raise ModelLoadError(f"cannot parse ONNX model {origin}: {type(exc).__name__}: {exc}") from exc


def _validate(model: onnx.ModelProto) -> None:
    if not model.HasField("graph"):
        raise ModelLoadError("model has no graph (empty, corrupt or truncated file)")
    if model.ir_version <= 0:
        raise ModelLoadError("model has no IR version (corrupt or truncated file)")
    if default_opset(model) <= 0:
        raise ModelLoadError("model imports no default-domain opset (corrupt or truncated file)")
    graph = model.graph
    if not graph.output:
        raise ModelLoadError("graph has no outputs (corrupt or truncated file)")
    order = topological_order(graph)  # raises on undefined values and cycles
    produced = {name for _, node in order for name in node.output if name}
    known = produced | {i.name for i in graph.input} | {t.name for t in graph.initializer}
    known |= {t.values.name for t in graph.sparse_initializer}
    missing = [o.name for o in graph.output if o.name not in known]
    if missing:
        raise ModelLoadError(f"graph outputs are never produced: {missing} (corrupt or truncated file)")


def _inline_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    if not model.functions:
        return model
    try:
        from onnx import inliner

        inlined = inliner.inline_local_functions(model)
    except Exception as exc:  # noqa: BLE001  (keep the calls: they then fail closed as ops without a rule)
        log.warning("could not inline model-local functions (%s); analysing the calls as opaque ops", exc)
        return model
    log.debug("inlined %d model-local functions", len(model.functions))
    return inlined
