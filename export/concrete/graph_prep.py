"""Make a polyfhe ONNX graph readable by Concrete ML: fold every subgraph of constants and public shapes.

Our exporter keeps ``Shape -> Gather -> Div -> Slice`` chains (a Mu-layer's channel split, reshapes written with
``x.shape``); CKKS folds them in the analyzer, but Concrete ML tries to quantise them and fails with a bare
``AssertionError``. Here they become Constant nodes where their values are the same at batch 1 and 2, a reshape
to ``(x.shape[0], ...)`` gets the constant shape ``(-1, ...)``, dead nodes and initialisers are dropped; the caller
checks the result against the original graph.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import helper, numpy_helper

from polyfhe.analysis.constants import ConstantFolder

__all__ = ["fold_public_shapes"]

log = logging.getLogger(__name__)


def _set_batch(proto: onnx.ModelProto, value: int | None) -> None:
    for info in [*proto.graph.input, *proto.graph.output]:
        dims = info.type.tensor_type.shape.dim
        if not dims:
            continue
        if value is None:
            dims[0].ClearField("dim_value")
            dims[0].dim_param = "batch"
        else:
            dims[0].ClearField("dim_param")
            dims[0].dim_value = value


def _folders(proto: onnx.ModelProto) -> tuple[list[ConstantFolder], dict[str, list[int]]]:
    """Constant folders of the graph at batch 1 and batch 2 (a value both know and agree on does not depend on
    the batch; ``x.shape[0]`` does), and the static output shapes at batch 1."""
    folders, shapes = [], {}
    for batch in (1, 2):
        copy = onnx.ModelProto()
        copy.CopyFrom(proto)
        del copy.graph.value_info[:]
        _set_batch(copy, batch)
        inferred = onnx.shape_inference.infer_shapes(copy, data_prop=True)
        folders.append(ConstantFolder(inferred))
        if batch == 1:
            for info in [*inferred.graph.value_info, *inferred.graph.output]:
                dims = info.type.tensor_type.shape.dim
                if dims and all(d.HasField("dim_value") for d in dims):
                    shapes[info.name] = [d.dim_value for d in dims]
    return folders, shapes


def _batch_free_reshapes(proto: onnx.ModelProto, folders: list[ConstantFolder], shapes: dict) -> int:
    """Reshapes whose target shape is computed from ``x.shape[0]`` get the constant ``[-1, ...]`` instead (the
    rest read off the inferred output shape): Concrete ML cannot quantise the shape arithmetic."""
    rewritten = 0
    for node in proto.graph.node:
        if node.op_type != "Reshape" or len(node.input) < 2 or _known(folders, node.input[1]) is not None:
            continue
        values = [f.value(node.input[1]) for f in folders]
        out = shapes.get(node.output[0])
        if any(v is None for v in values) or out is None or [int(values[0][0]), int(values[1][0])] != [1, 2]:
            continue
        name = f"{node.output[0]}__batch_free_shape"
        proto.graph.initializer.append(numpy_helper.from_array(np.array([-1, *out[1:]], dtype=np.int64), name))
        node.input[1] = name
        rewritten += 1
    return rewritten


def _known(folders: list[ConstantFolder], name: str) -> np.ndarray | None:
    values = [f.value(name) for f in folders]
    if any(v is None for v in values):
        return None
    first = np.asarray(values[0])
    return first if all(np.asarray(v).shape == first.shape and np.array_equal(v, first) for v in values) else None


def _fold_once(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """One pass: nodes whose outputs are known at compile time, whatever the batch, become Constants; unused
    nodes go."""
    folders, shapes = _folders(proto)
    folded = _batch_free_reshapes(proto, folders, shapes)
    if folded:
        folders, shapes = _folders(proto)
    graph = proto.graph
    nodes = []
    for node in graph.node:
        values = [_known(folders, o) for o in node.output] if node.op_type != "Constant" else [None]
        if node.output and all(v is not None for v in values):
            nodes += [helper.make_node("Constant", [], [o], value=numpy_helper.from_array(np.asarray(v), o))
                      for o, v in zip(node.output, values)]
            folded += 1
        else:
            nodes.append(node)
    needed, kept = {o.name for o in graph.output}, []
    for node in reversed(nodes):
        if any(o in needed for o in node.output):
            kept.append(node)
            needed.update(i for i in node.input if i)
    del graph.node[:]
    graph.node.extend(reversed(kept))
    used = {i for n in graph.node for i in n.input}
    initializers = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    return proto, folded


def fold_public_shapes(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """(a copy of ``proto`` with constant and shape subgraphs folded, number of nodes folded)."""
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    _set_batch(out, None)
    del out.graph.value_info[:]
    total = 0
    while True:
        out, folded = _fold_once(out)
        total += folded
        if not folded:
            break
    onnx.checker.check_model(out)
    if total:
        log.info("folded %d constant or shape nodes for Concrete ML", total)
    return out, total
