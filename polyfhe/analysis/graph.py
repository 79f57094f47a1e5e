"""Graph plumbing: node names, implicit (outer-scope) inputs of control-flow nodes, topological order."""

from __future__ import annotations

import heapq
from collections import defaultdict

import onnx

from polyfhe.analysis.errors import ModelLoadError

__all__ = ["implicit_inputs", "node_dependencies", "node_label", "topological_order"]


def node_label(node: onnx.NodeProto, index: int) -> str:
    """The node's name, or ``{op_type}_{index}`` (index in ``graph.node``) when it has none."""
    return node.name or f"{node.op_type}_{index}"


def implicit_inputs(node: onnx.NodeProto) -> list[str]:
    """Outer-scope values read inside the node's subgraphs (If/Loop/Scan bodies).

    They are real data dependencies: a Loop body that reads an encrypted tensor makes the Loop's
    outputs encrypted even if its explicit inputs are constants.
    """
    names: set[str] = set()
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            names |= _outer_names(attr.g)
        elif attr.type == onnx.AttributeProto.GRAPHS:
            for g in attr.graphs:
                names |= _outer_names(g)
    return sorted(names)


def node_dependencies(node: onnx.NodeProto) -> list[str]:
    """Explicit (non-empty) and implicit inputs of a node."""
    return [n for n in node.input if n] + implicit_inputs(node)


def _outer_names(graph: onnx.GraphProto) -> set[str]:
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    defined |= {t.values.name for t in graph.sparse_initializer}
    used: set[str] = set()
    for node in graph.node:
        defined.update(node.output)
        used.update(node_dependencies(node))
    return used - defined - {""}


def topological_order(graph: onnx.GraphProto) -> list[tuple[int, onnx.NodeProto]]:
    """Nodes as ``(index in graph.node, node)`` in dependency order, stable w.r.t. the file order.

    Raises ModelLoadError for values that are read but never defined and for cycles: both mean the
    file is corrupt (or truncated inside the node list).
    """
    available = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    available |= {t.values.name for t in graph.sparse_initializer}
    producer: dict[str, int] = {}
    for idx, node in enumerate(graph.node):
        for out in node.output:
            if out:
                producer[out] = idx
    consumers: dict[int, list[int]] = defaultdict(list)
    pending = [0] * len(graph.node)
    for idx, node in enumerate(graph.node):
        for name in set(node_dependencies(node)):
            if name in producer:
                pending[idx] += 1
                consumers[producer[name]].append(idx)
            elif name not in available:
                label = node_label(node, idx)
                raise ModelLoadError(f"node {label} ({node.op_type}) reads undefined value {name!r}")
    ready = [idx for idx, count in enumerate(pending) if count == 0]
    heapq.heapify(ready)
    order: list[tuple[int, onnx.NodeProto]] = []
    while ready:
        idx = heapq.heappop(ready)
        order.append((idx, graph.node[idx]))
        for consumer in consumers[idx]:
            pending[consumer] -= 1
            if pending[consumer] == 0:
                heapq.heappush(ready, consumer)
    if len(order) != len(graph.node):
        stuck = [node_label(graph.node[i], i) for i, count in enumerate(pending) if count > 0]
        raise ModelLoadError(f"graph has a cycle through nodes {stuck[:5]}")
    return order
