"""Nodes of an ONNX graph worth computing on their own, a level each, instead of merged into the maps around
them: depthwise convolutions (level spend) and the sources of spatial shifts (memory spend)."""

from __future__ import annotations

import numpy as np
import onnx

from polyfhe.exporters.ckks.affine import attributes

__all__ = ["factoring_sites", "shift_sites"]


def factoring_sites(model: onnx.ModelProto) -> list[str]:
    """Convolutions worth computing on their own at the price of a level: grouped (depthwise) ones with a
    spatial kernel. Merged into the channel maps around them, each of their taps multiplies those maps'
    diagonals; on their own they cost a diagonal per tap."""
    weights = {t.name: tuple(t.dims) for t in model.graph.initializer}
    sites = []
    for index, node in enumerate(model.graph.node):
        if node.op_type != "Conv" or len(node.input) < 2 or node.input[1] not in weights:
            continue
        dims = weights[node.input[1]]
        if int(attributes(node).get("group", 1)) > 1 and int(np.prod(dims[2:])) > 1:
            sites.append(node.name or f"{node.op_type}_{index}")
    return sites


_DATA_MOVEMENT = frozenset({"Slice", "Concat", "Identity"})


def _slice_axes(node: onnx.NodeProto, producer: dict, initializers: dict) -> tuple[int, ...] | str:
    """The axes a Slice cuts (its ``axes`` input when constant; otherwise a name of its own, so that two
    such slices count as different axes)."""
    if len(node.input) < 4 or not node.input[3]:
        return f"every axis of {node.name}"
    name = node.input[3]
    if name in initializers:
        return tuple(int(a) for a in onnx.numpy_helper.to_array(initializers[name]).reshape(-1))
    parent = producer.get(name)
    if parent is not None and parent.op_type == "Constant" and parent.attribute:
        return tuple(int(a) for a in onnx.numpy_helper.to_array(parent.attribute[0].t).reshape(-1))
    return f"axes {name}"


def shift_sites(model: onnx.ModelProto) -> list[str]:
    """Nodes whose output a spatial shift moves: a Concat of slices of one tensor taken along more than one
    axis (MONet's shift slices channel groups and one spatial axis per group). Merged, the shift multiplies
    the diagonals of the channel map that made its input by its token offsets (a 64-channel map becomes 640
    diagonals); with that input a register of its own, the shift is a few masked diagonals and one level."""
    producer = {out: node for node in model.graph.node for out in node.output}
    constants = {t.name: t for t in model.graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    sites: list[str] = []
    for node in model.graph.node:
        if node.op_type != "Concat" or all(c.op_type == "Concat" for c in consumers.get(node.output[0], [])):
            continue  # only the outermost Concat of a data-movement subgraph
        sources, axes, stack = set(), set(), [node]
        while stack:
            current = stack.pop()
            data = list(current.input) if current.op_type == "Concat" else list(current.input[:1])
            for name in data:
                parent = producer.get(name)
                if parent is not None and parent.op_type in _DATA_MOVEMENT:
                    stack.append(parent)
                    if parent.op_type == "Slice":
                        axes.add(_slice_axes(parent, producer, constants))
                elif name not in constants and (parent is None or parent.op_type != "Constant"):
                    sources.add(name)
        if len(sources) == 1 and len(axes) > 1:
            source = producer.get(next(iter(sources)))
            if source is not None and source.name not in sites:
                sites.append(source.name)
    return sites
