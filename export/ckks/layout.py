"""Slot layouts for the single layout: which slot holds which tensor element, per register.

The number of non-zero diagonals (hence plaintext products and rotations) of a linear map depends on how
its input and output tensors are laid out in the slots. Channel mixing in a token-major layout ``t*C + c``
has offsets ``t*(C_out - C_in) + c - k`` that change with every token when the width changes (thousands of
diagonals); in a channel-major layout ``c*T + t`` they are ``(c - k)*T`` (at most ``C_in + C_out - 1``).
Layouts are free: the client packs the input and unpacks the output with the program's public slot maps,
and every map in between is rewritten in slot coordinates. Products need equal layouts on both operands.

Per register we try the natural order and "channel-major" (last axis first) and keep the one with fewer
diagonals for the map that produces it; the input gets a *token-aligned* packing built from its first
consumer, so that a patch embedding (stride = kernel) becomes channel mixing too.
"""

from __future__ import annotations

import numpy as np

from polyfhe.export.ckks.circuit import Circuit, LinearNode, MatMulNode, MulNode

__all__ = ["choose_layouts", "diagonal_count"]


def _squeeze(shape: tuple[int, ...]) -> tuple[int, ...]:
    dims = tuple(d for d in shape if d != 1)
    return dims or (1,)


def natural(shape: tuple[int, ...]) -> np.ndarray:
    return np.arange(int(np.prod(shape)))


def channel_major(shape: tuple[int, ...]) -> np.ndarray:
    """slot_of[logical index] for the layout that puts the last axis first (c*T + t)."""
    dims = _squeeze(shape)
    if len(dims) < 2:
        return natural(shape)
    logical = np.arange(int(np.prod(dims))).reshape(dims)
    moved = np.moveaxis(logical, -1, 0).reshape(-1)  # slot s holds logical moved[s]
    slot_of = np.empty_like(moved)
    slot_of[moved] = np.arange(len(moved))
    return slot_of


def tokens_of(shape: tuple[int, ...]) -> int:
    dims = _squeeze(shape)
    return int(np.prod(dims[:-1])) if len(dims) >= 2 else 1


def diagonal_count(matrix: np.ndarray, slot_out: np.ndarray, slot_in: np.ndarray, slots: int) -> int:
    rows, cols = np.nonzero(matrix)
    return len(np.unique((slot_in[cols] - slot_out[rows]) % slots))


def token_aligned(matrix: np.ndarray, slot_out: np.ndarray, tokens: int, slots: int) -> np.ndarray | None:
    """Input packing ``rank*T + token`` where each input element goes to the token it mostly feeds."""
    n = matrix.shape[1]
    rows, cols = np.nonzero(matrix)
    if tokens <= 1 or len(cols) == 0:
        return None
    tok = slot_out[rows] % tokens
    first = np.full(n, -1)
    order = np.lexsort((tok, cols))  # per column, the smallest token it feeds
    seen = np.ones(len(order), dtype=bool)
    seen[1:] = cols[order][1:] != cols[order][:-1]
    first[cols[order][seen]] = tok[order][seen]
    unused = np.nonzero(first < 0)[0]
    first[unused] = np.arange(len(unused)) % tokens
    slot_of = np.empty(n, dtype=np.int64)
    counts = np.zeros(tokens, dtype=np.int64)
    for j in np.argsort(first, kind="stable"):
        slot_of[j] = counts[first[j]] * tokens + first[j]
        counts[first[j]] += 1
    return slot_of if slot_of.max() < slots else None


def _candidates(shape: tuple[int, ...]) -> list[np.ndarray]:
    a, b = natural(shape), channel_major(shape)
    return [a] if np.array_equal(a, b) else [a, b]


def _cost(node: LinearNode, slot_out: np.ndarray, layouts: dict[int, np.ndarray], slots: int) -> int:
    return sum(diagonal_count(m, slot_out, layouts[r], slots) for r, m in zip(node.inputs, node.matrices, strict=True))


def choose_layouts(circuit: Circuit, slots: int) -> dict[int, np.ndarray]:
    """slot_of arrays for every register (logical element index -> slot)."""
    layouts: dict[int, np.ndarray] = {}
    forced: dict[int, int] = {}  # register -> register whose layout it must share (product operands)
    for node in circuit.nodes:
        if isinstance(node, MulNode):
            forced[node.b] = node.a
    first = next((n for n in circuit.nodes if isinstance(n, LinearNode) and 0 in n.inputs), None)
    layouts[0] = natural(circuit.shapes[0])
    if first is not None:
        matrix = first.matrices[first.inputs.index(0)]
        out_shape = circuit.shapes[first.out]
        best = (diagonal_count(matrix, channel_major(out_shape), layouts[0], slots), layouts[0])
        for slot_out in _candidates(out_shape):
            packed = token_aligned(matrix, slot_out, tokens_of(out_shape), slots)
            if packed is not None:
                best = min(best, (diagonal_count(matrix, slot_out, packed, slots), packed), key=lambda b: b[0])
        layouts[0] = best[1]
    for node in circuit.nodes:
        shape = circuit.shapes[node.out]
        if isinstance(node, LinearNode):
            if node.out in forced and forced[node.out] in layouts:
                layouts[node.out] = layouts[forced[node.out]]
                continue
            options = _candidates(shape)
            layouts[node.out] = min(options, key=lambda s, node=node: _cost(node, s, layouts, slots))
        elif isinstance(node, MulNode):
            layouts[node.out] = layouts[node.a]
        elif isinstance(node, MatMulNode):
            layouts[node.out] = natural(shape)
    if any(isinstance(n, MulNode) and not np.array_equal(layouts[n.a], layouts[n.b]) for n in circuit.nodes):
        return {reg: natural(shape) for reg, shape in circuit.shapes.items()}  # safe fallback: one layout
    return layouts
