"""Replicated input packing: the client lays out each token's receptive field, so a strided stem is channel mixing.

The client packs the program input in any public order it is told, and it may write one pixel into several
slots at no cost. A convolution whose windows overlap (a 7x7 stem at stride 4) reads each pixel from up to
four tokens; packed once per pixel, its map has a diagonal per (rank, neighbouring token) pair: about 1,024
for CPolyNeXt's stem at 28x28. Packed *im2col-style* instead, slot ``rank * T' + token`` holding the pixel at
offset ``rank = (channel, dy, dx)`` from the token's anchor, every token finds its whole window in its own
block, and the stem is a pure channel map from ``ranks`` to ``C_out`` channels: about ``max(ranks, C_out)``
block diagonals (Lee et al. 2022's multiplexed packing, Orion's single-shot packing, done by the client).

The pass rewrites the circuit so that register 0 *is* the replicated vector (``Circuit.input_gather`` says
which input element each of its entries copies, ``Circuit.input_slots`` fixes their slots). It applies only
when every reader of the input is a linear map, the token grid of the readers with image outputs divides the
image, the replicated input is no wider than the widest other register (the ring and the samples per
ciphertext stay as they were), and the readers' diagonals in their preferred layouts strictly drop. Readers
off the grid (a head reading the stem through a residual stream) read each pixel's first copy.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import numpy as np
import scipy.sparse as sp

from polyfhe.exporters.ckks.circuit import Circuit, LinearNode, node_reads
from polyfhe.exporters.ckks.layout import (
    UNBOUNDED_SLOTS,
    circuit_input_packing,
    diagonal_count,
    period_of,
    pow2_at_least,
    preferred_layout,
)

__all__ = ["replicate_input"]

log = logging.getLogger(__name__)


def _spatial(shape: tuple[int, ...]) -> tuple[int, int, int] | None:
    """(channels, height, width) of an NCHW-like tensor shape with leading ones dropped, or None."""
    dims = list(shape)
    while len(dims) > 3 and dims[0] == 1:
        dims.pop(0)
    if len(dims) == 2:
        dims = [1, *dims]
    if len(dims) != 3 or min(dims[1:]) < 2:
        return None
    return int(dims[0]), int(dims[1]), int(dims[2])


@dataclass(frozen=True)
class _Geometry:
    """The input image ``(C, H, W)``, the readers' token grid ``(Ho, Wo)`` and the stride between anchors."""

    image: tuple[int, int, int]
    grid: tuple[int, int]

    @property
    def stride(self) -> tuple[int, int]:
        return self.image[1] // self.grid[0], self.image[2] // self.grid[1]

    @property
    def tokens(self) -> int:
        return self.grid[0] * self.grid[1]

    def key(self, channel, dy, dx):
        """One integer per window offset ``(channel, dy, dx)``; offsets lie in ``(-H, H) x (-W, W)``."""
        _, h, w = self.image
        return (channel * (2 * h + 1) + dy + h) * (2 * w + 1) + dx + w

    def offset(self, keys) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        _, h, w = self.image
        channel, rest = np.divmod(keys, (2 * h + 1) * (2 * w + 1))
        return channel, rest // (2 * w + 1) - h, rest % (2 * w + 1) - w


@dataclass
class _Reads:
    """One map's input term: its non-zeros, and the distinct (token, pixel) pairs they read."""

    position: int  # the node's index in the circuit
    term: int
    rows: np.ndarray
    vals: np.ndarray
    pair: np.ndarray  # per non-zero: its index into the pairs below
    ti: np.ndarray  # per pair: the reading token's grid row and column, the pixel's channel, row, column
    tj: np.ndarray
    channel: np.ndarray
    y: np.ndarray
    x: np.ndarray

    @classmethod
    def of(cls, position: int, node: LinearNode, geo: _Geometry) -> _Reads:
        term = node.inputs.index(0)
        coo = node.matrices[term].tocoo()
        keep = coo.data != 0
        rows, cols = coo.row[keep], coo.col[keep]
        pairs, pair = np.unique((rows % geo.tokens) * (geo.image[0] * geo.image[1] * geo.image[2]) + cols,
                                return_inverse=True)
        token, col = np.divmod(pairs, geo.image[0] * geo.image[1] * geo.image[2])
        ti, tj = np.divmod(token, geo.grid[1])
        channel, rest = np.divmod(col, geo.image[1] * geo.image[2])
        y, x = np.divmod(rest, geo.image[2])
        return cls(position, term, rows, coo.data[keep], pair.reshape(-1), ti, tj, channel, y, x)

    def keys(self, geo: _Geometry, di: int = 0, dj: int = 0) -> np.ndarray:
        """Per pair: the pixel's window offset seen from the token ``(di, dj)`` away from the reading one."""
        sh, sw = geo.stride
        return geo.key(self.channel, self.y - (self.ti + di) * sh, self.x - (self.tj + dj) * sw)


def _basis(reads: list[_Reads], geo: _Geometry, max_period: int) -> np.ndarray | None:
    """The window offsets to pack: the union of the smallest readers' windows that fits ``max_period`` slots."""
    basis = np.zeros(0, dtype=np.int64)
    for window in sorted((np.unique(r.keys(geo)) for r in reads), key=len):
        union = np.union1d(basis, window)
        if pow2_at_least(len(union)) * pow2_at_least(geo.tokens) > max_period:
            break
        basis = union
    return basis if len(basis) else None


def _deltas(grid: tuple[int, int]) -> list[tuple[int, int]]:
    """Token offsets, nearest first (the tie-break of :func:`_assign`)."""
    near = [(di, dj) for di in range(1 - grid[0], grid[0]) for dj in range(1 - grid[1], grid[1])]
    return sorted(near, key=lambda d: (abs(d[0]) + abs(d[1]), abs(d[0]), d))


def _assign(r: _Reads, geo: _Geometry, basis: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Per non-zero, the (rank, token) of the packed copy it reads; None when some pixel has no copy.

    A pixel outside the reading token's packed window is read from another token's block. Each token offset
    used adds a shifted copy of the map's diagonals, so the offsets are chosen as a greedy set cover: the one
    serving the most pending (token, pixel) pairs first (a dilated 3x3 conv after a 7x7 stem needs its nine
    taps' offsets, not the sixteen-odd nearest ones).
    """
    rank = np.full(len(r.ti), -1, dtype=np.int64)
    token = np.full(len(r.ti), -1, dtype=np.int64)
    options = []
    for di, dj in _deltas(geo.grid):
        ti, tj, keys = r.ti + di, r.tj + dj, r.keys(geo, di, dj)
        found = np.searchsorted(basis, keys).clip(max=len(basis) - 1)
        ok = (ti >= 0) & (ti < geo.grid[0]) & (tj >= 0) & (tj < geo.grid[1]) & (basis[found] == keys)
        if ok.any():
            options.append((np.flatnonzero(ok), found, ti * geo.grid[1] + tj))
    while np.any(rank < 0) and options:
        gains = [int(np.count_nonzero(rank[ok] < 0)) for ok, _, _ in options]
        best = int(np.argmax(gains))  # ties: the nearest offset
        if gains[best] == 0:
            break
        ok, found, tok = options.pop(best)
        new = ok[rank[ok] < 0]
        rank[new], token[new] = found[new], tok[new]
    if np.any(rank < 0):
        return None
    return rank[r.pair], token[r.pair]


def _rewrite(node: LinearNode, term: int, rows, cols, vals, size: int) -> LinearNode:
    matrices = list(node.matrices)
    matrices[term] = sp.csr_matrix((vals, (rows, cols)), shape=(node.size, size))
    return replace(node, matrices=matrices)


def _geometry(circuit: Circuit, readers: list) -> _Geometry | None:
    """The image and the token grid of the first reader whose output is an image, when it divides the input
    and every reader is a linear map; None otherwise."""
    if not readers or any(not isinstance(n, LinearNode) for n in readers):
        return None  # a product or MatMul of the raw input needs it in one layout with its other operand
    image = _spatial(circuit.shapes[0])
    grids = [o[1:] for o in (_spatial(circuit.shapes[n.out]) for n in readers) if o is not None]
    if image is None or not grids or image[1] % grids[0][0] or image[2] % grids[0][1]:
        return None
    return _Geometry(image, grids[0])


def _on_grid(circuit: Circuit, node: LinearNode, geo: _Geometry) -> bool:
    out = _spatial(circuit.shapes[node.out])
    return out is not None and out[1:] == geo.grid


def replicate_input(circuit: Circuit) -> Circuit:
    """``circuit`` with its input packed im2col-style when that strictly cuts its readers' diagonals; else itself.

    The returned circuit reads the replicated input: register 0 then holds ``len(input_gather)`` values, the
    flat input's elements ``input_gather``, at slots ``input_slots``; :meth:`Circuit.evaluate` gathers them.
    """
    if circuit.input_gather is not None:
        return circuit
    positions = [i for i, n in enumerate(circuit.nodes) if 0 in node_reads(n)]
    geo = _geometry(circuit, [circuit.nodes[i] for i in positions])
    if geo is None:
        return circuit
    widest = max(period_of(preferred_layout(circuit.shapes[r])) for r in circuit.shapes if r != 0)
    on_grid = [i for i in positions if _on_grid(circuit, circuit.nodes[i], geo)]
    reads = [_Reads.of(i, circuit.nodes[i], geo) for i in on_grid]
    basis = _basis(reads, geo, widest)  # no wider than every other register: it must not cost a ring or lanes
    if basis is None:
        return circuit
    # packed value (rank, token) copies the pixel at the token's anchor + the rank's offset, inside the image
    channel, dy, dx = geo.offset(basis)
    ti, tj = np.divmod(np.arange(geo.tokens), geo.grid[1])
    y = ti[None, :] * geo.stride[0] + dy[:, None]
    x = tj[None, :] * geo.stride[1] + dx[:, None]
    inside = (y >= 0) & (y < geo.image[1]) & (x >= 0) & (x < geo.image[2])
    index = np.full(inside.shape, -1, dtype=np.int64)
    index[inside] = np.arange(int(inside.sum()))  # out-of-image offsets are never read: not packed
    gather = ((channel[:, None] * geo.image[1] + y) * geo.image[2] + x)[inside].astype(np.int64)
    rank_of, token_of = np.nonzero(inside)
    slots = (rank_of * pow2_at_least(geo.tokens) + token_of).astype(np.int64)
    nodes = list(circuit.nodes)
    for r in reads:
        assigned = _assign(r, geo, basis)
        if assigned is None:
            return circuit
        nodes[r.position] = _rewrite(nodes[r.position], r.term, r.rows, index[assigned], r.vals, len(gather))
    first_copy = np.full(int(np.prod(geo.image)), -1, dtype=np.int64)
    pixels, first = np.unique(gather, return_index=True)
    first_copy[pixels] = first  # each pixel's first packed copy
    for i in (i for i in positions if i not in on_grid):  # off the grid (a head read through a residual): any copy
        node = nodes[i]
        term = node.inputs.index(0)
        coo = node.matrices[term].tocoo()
        cols = first_copy[coo.col]
        if np.any(cols < 0):
            return circuit
        nodes[i] = _rewrite(node, term, coo.row, cols, coo.data, len(gather))
    candidate = replace(circuit, nodes=nodes, sizes={**circuit.sizes, 0: len(gather)},
                        shapes={**circuit.shapes, 0: (len(gather),)}, input_gather=gather, input_slots=slots)
    before, after = _reader_diagonals(circuit), _reader_diagonals(candidate)
    if after >= before:
        log.debug("replicated input packing: %d diagonals against %d packed once; not used", after, before)
        return circuit
    log.info("replicated input packing (im2col, %d window offsets x %d tokens, %d values): the maps reading the "
             "input need %d plaintext diagonals instead of %d", len(basis), geo.tokens, len(gather), after, before)
    return candidate


def _reader_diagonals(circuit: Circuit) -> int:
    """Diagonals of the maps reading the input, their outputs in the preferred layout, the input as packed."""
    packing = circuit_input_packing(circuit, UNBOUNDED_SLOTS)
    period = period_of(packing)
    return sum(diagonal_count(m, preferred_layout(circuit.shapes[n.out]), packing, period)
               for n in circuit.nodes if isinstance(n, LinearNode)
               for r, m in zip(n.inputs, n.matrices, strict=True) if r == 0)
