"""Constant values: which ops make public outputs, and compile-time evaluation of constant subgraphs.

A value is ``const`` when it is an initializer, a Constant output, or computed only from consts: any
op is fine there (Sqrt, Exp, Reciprocal of a weight...) because it is evaluated at compile time, never
on ciphertexts. ``Shape``/``Size`` outputs are const even on encrypted tensors, since shapes are public.

Rules sometimes need the actual value (the exponent of a Pow, the fill value of a Pad), so
:class:`ConstantFolder` evaluates constant subgraphs lazily, one node at a time, with
``onnx.reference.ReferenceEvaluator``; an encrypted tensor feeding Shape/Size is replaced by zeros of
its statically inferred shape. Anything it cannot evaluate yields None, and the rules then fail closed.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from polyfhe.analysis.graph import implicit_inputs, node_dependencies

__all__ = ["PUBLIC_SHAPE_OPS", "ConstantFolder", "is_public_shape_op"]

log = logging.getLogger(__name__)

PUBLIC_SHAPE_OPS = frozenset({"Shape", "Size"})
DEFAULT_DOMAINS = ("", "ai.onnx")


def is_public_shape_op(node: onnx.NodeProto) -> bool:
    """True for ops whose output depends only on the (public) shape of their input."""
    return node.domain in DEFAULT_DOMAINS and node.op_type in PUBLIC_SHAPE_OPS


class ConstantFolder:
    """Lazily evaluates constant values of one model, memoised by value name."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self._model = model
        graph = model.graph
        self._initializers: dict[str, Any] = {t.name: t for t in graph.initializer}
        self._initializers.update({t.values.name: t for t in graph.sparse_initializer})
        self._producer = {out: node for node in graph.node for out in node.output if out}
        self._opsets = {o.domain or "": o.version for o in model.opset_import}
        self._cache: dict[str, np.ndarray | None] = {}
        self._shapes: dict[str, tuple[tuple[int, ...] | None, int]] | None = None

    def value(self, name: str) -> np.ndarray | None:
        """The compile-time value of ``name``, or None when unknown (encrypted or not evaluable)."""
        stack = [name]
        while stack:
            current = stack[-1]
            if current in self._cache:
                stack.pop()
                continue
            if current in self._initializers:
                self._cache[current] = self._initializer_value(current)
                stack.pop()
                continue
            node = self._producer.get(current)
            if node is None:  # a graph input: encrypted data has no compile-time value
                self._cache[current] = None
                stack.pop()
                continue
            todo = [] if is_public_shape_op(node) else [d for d in node_dependencies(node) if d not in self._cache]
            if todo:
                stack.extend(todo)
                continue
            self._evaluate(node)
            stack.pop()
        return self._cache[name]

    def _initializer_value(self, name: str) -> np.ndarray | None:
        tensor = self._initializers[name]
        try:
            if isinstance(tensor, onnx.SparseTensorProto):
                return _densify(tensor)
            return numpy_helper.to_array(tensor)
        except Exception as exc:  # noqa: BLE001  (e.g. external data not loaded: the value is unknown)
            log.debug("cannot read initializer %s: %s", name, exc)
            return None

    def _evaluate(self, node: onnx.NodeProto) -> None:
        outputs: list[np.ndarray | None] = [None] * len(node.output)
        feeds = self._feeds(node)
        if feeds is not None:
            try:
                from onnx.reference import ReferenceEvaluator

                evaluator = ReferenceEvaluator(node, opsets=self._opsets)
                outputs = list(evaluator.run(None, feeds))
            except Exception as exc:  # noqa: BLE001  (unknown custom op, unsupported attribute: unknown value)
                log.debug("cannot evaluate constant node %s (%s): %s", node.name, node.op_type, exc)
        for out, val in zip(node.output, outputs, strict=False):
            if out:
                self._cache[out] = None if val is None else np.asarray(val)

    def _feeds(self, node: onnx.NodeProto) -> dict[str, np.ndarray] | None:
        if implicit_inputs(node):
            return None  # subgraphs reading outer values cannot run as a single node
        feeds: dict[str, np.ndarray] = {}
        for name in node.input:
            if not name:
                continue
            val = self._cache.get(name)
            if val is None and is_public_shape_op(node):
                val = self._value_or_placeholder(name)
            if val is None:
                return None
            feeds[name] = val
        return feeds

    def _value_or_placeholder(self, name: str) -> np.ndarray | None:
        """The value if constant, else zeros of the statically known shape (enough for Shape/Size)."""
        known = self.value(name)
        if known is not None:
            return known
        shape, elem_type = self._static_shapes().get(name, (None, 0))
        if shape is None:
            return None
        try:
            dtype = helper.tensor_dtype_to_np_dtype(elem_type) if elem_type else np.float32
        except (KeyError, ValueError, TypeError):
            dtype = np.float32
        return np.zeros(shape, dtype=dtype)

    def _static_shapes(self) -> dict[str, tuple[tuple[int, ...] | None, int]]:
        if self._shapes is None:
            try:
                inferred = onnx.shape_inference.infer_shapes(self._model)
            except Exception as exc:  # noqa: BLE001  (inference is best effort: shapes stay unknown)
                log.debug("shape inference failed: %s", exc)
                inferred = self._model
            graph = inferred.graph
            self._shapes = {}
            for info in [*graph.input, *graph.value_info, *graph.output]:
                self._shapes[info.name] = _static_shape(info)
        return self._shapes


def _static_shape(info: onnx.ValueInfoProto) -> tuple[tuple[int, ...] | None, int]:
    tensor_type = info.type.tensor_type
    if not tensor_type.HasField("shape"):
        return None, tensor_type.elem_type
    dims = tensor_type.shape.dim
    if any(not d.HasField("dim_value") for d in dims):
        return None, tensor_type.elem_type
    return tuple(d.dim_value for d in dims), tensor_type.elem_type


def _densify(sparse: onnx.SparseTensorProto) -> np.ndarray:
    values = numpy_helper.to_array(sparse.values)
    indices = numpy_helper.to_array(sparse.indices).astype(np.int64)
    shape = tuple(sparse.dims)
    dense = np.zeros(int(np.prod(shape)), dtype=values.dtype)
    flat = indices if indices.ndim == 1 else np.ravel_multi_index(tuple(indices.T), shape)
    dense[flat] = values
    return dense.reshape(shape)
