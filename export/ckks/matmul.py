"""ct x ct MatMul for the single layout, rewritten into the primitives every engine already runs.

``out[..., m, n] = sum_k a[..., m, k] * b[..., k, n]`` becomes, over a common index space ``E`` holding one
slot per ``(..., m, n, k)``:

* two 0/1 linear maps replicating ``a`` and ``b`` into ``E`` (pure data movement);
* one elementwise :class:`MulNode` on ``E`` (the only ct x ct product: one level, as the MatMul);
* one 0/1 linear map summing over ``k``.

Each map is composed with its neighbours instead of costing a level of its own: the replications into the
:class:`LinearNode` that produced the operand (its matrix becomes ``R @ W``, same inputs, same level) and the
sum into every :class:`LinearNode` that reads the result (``W @ S``). Only an operand that is not the output
of a linear map (the input, a product) or a result read by a product or as the program output gets a map of
its own, a level the MatMul did not cost in the batch layout. The planner then turns these maps into
plaintext diagonals and rotations like any other.

The index space is ordered ``(n, ..., k, m)``: with ``n`` outermost, every ``n``-block is a tensor with
channels ``(..., k)`` and tokens ``m``, the channel-major order the layout planner gives attention operands,
so replicating ``a`` along ``n`` is about one diagonal and summing over ``k`` about one per ``k`` (PolyAttn on
16 tokens: 1 and 16, against 16 and 256 for ``(..., m, n, k)``).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import scipy.sparse as sp

from polyfhe.exporters.ckks.affine import LoweringError
from polyfhe.exporters.ckks.circuit import Circuit, LinearNode, MatMulNode, MulNode, node_reads
from polyfhe.program.bootparams import BOOTSTRAP_RING
from polyfhe.program.params import RING_SIZES, CKKSParams

__all__ = ["expand_matmuls", "matmul_index_maps", "slots_available"]

log = logging.getLogger(__name__)


def matmul_index_maps(a_shape: tuple[int, ...], b_shape: tuple[int, ...], out_shape: tuple[int, ...]
                      ) -> tuple[tuple[int, ...], np.ndarray, np.ndarray, np.ndarray]:
    """(shape of the index space, and per element of it: the flat index into a, into b, into out).

    The space is ``(N, *batch, K, M)`` (see the module docstring for why); batch axes broadcast as in numpy.
    """
    *batch_out, m, n = (int(d) for d in out_shape)
    k = int(a_shape[-1])
    if int(a_shape[-2]) != m or int(b_shape[-1]) != n or int(b_shape[-2]) != k:
        raise LoweringError(f"MatMul shapes {tuple(a_shape)} @ {tuple(b_shape)} -> {tuple(out_shape)} disagree")
    batch = tuple(batch_out)
    space = (n, *batch, k, m)
    grid = np.indices(space).reshape(len(space), -1)
    i_n, i_batch, i_k, i_m = grid[0], grid[1:-2], grid[-2], grid[-1]

    def flat(shape: tuple[int, ...], tail: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        lead = shape[:-2]
        index = [i_batch[len(batch) - len(lead) + j] if d != 1 else np.zeros_like(i_n)
                 for j, d in enumerate(lead)]  # numpy broadcasting: size-1 axes always read element 0
        return np.ravel_multi_index((*index, *tail), shape)

    a_index = flat(tuple(int(d) for d in a_shape), (i_m, i_k))
    b_index = flat(tuple(int(d) for d in b_shape), (i_k, i_n))
    out_index = np.ravel_multi_index((*i_batch, i_m, i_n), (*batch, m, n))
    return space, a_index, b_index, out_index


def slots_available(params: CKKSParams | None, poly_modulus_degree: int | None, bootstrap: bool) -> int:
    """The most slots the program may get: the caller's ring, else the largest leveled (or bootstrapping) one."""
    if params is not None:
        return int(params.slots)
    return (poly_modulus_degree or (BOOTSTRAP_RING if bootstrap else max(RING_SIZES))) // 2


def _ones(rows: np.ndarray, cols: np.ndarray, shape: tuple[int, int]) -> sp.csr_matrix:
    return sp.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=shape)


def _slot_limit(size: int, slots: int, node: MatMulNode) -> None:
    if size > slots:
        *batch, m, n = node.out_shape
        k = node.a_shape[-1]
        raise LoweringError(
            f"{node.label}: a ct x ct MatMul in layout='single' multiplies every product a[m,k]*b[k,n] in its own "
            f"slot: {'x'.join(str(d) for d in (*batch, m, n, k))} = {size} values, over the {slots} slots "
            f"available; it fits when batch x M x N x K <= {slots} (fewer tokens: a smaller image or feature "
            "map; fewer heads or a narrower head), or use layout='batch'")


class _Rewriter:
    def __init__(self, circuit: Circuit) -> None:
        self.circuit = circuit
        self.nodes: list = list(circuit.nodes)
        self.next_reg = max(circuit.sizes) + 1

    def _new_reg(self, shape: tuple[int, ...]) -> int:
        reg = self.next_reg
        self.next_reg += 1
        self.circuit.sizes[reg] = int(np.prod(shape))
        self.circuit.shapes[reg] = tuple(shape)
        return reg

    def _producer(self, reg: int) -> LinearNode | None:
        return next((n for n in self.nodes if n.out == reg and isinstance(n, LinearNode)), None)

    def _replicate(self, reg: int, index: np.ndarray, shape: tuple[int, ...], label: str) -> LinearNode:
        """The operand replicated into the index space, composed into the map that produced it when it has one."""
        select = _ones(np.arange(len(index)), index, (len(index), self.circuit.sizes[reg]))
        out = self._new_reg(shape)
        source = self._producer(reg)
        if source is None:  # the input or a product: a 0/1 map of its own (one level)
            return LinearNode(out, [reg], [select], None, len(index), label)
        matrices = [sp.csr_matrix(select @ m) for m in source.matrices]
        bias = None if source.bias is None else select @ np.asarray(source.bias)
        return LinearNode(out, list(source.inputs), matrices, bias, len(index), label)

    def expand(self, position: int, node: MatMulNode) -> None:
        space, a_index, b_index, out_index = matmul_index_maps(node.a_shape, node.b_shape, node.out_shape)
        size = len(a_index)
        rep_a = self._replicate(node.a, a_index, space, f"{node.label} lhs (replicated)")
        rep_b = self._replicate(node.b, b_index, space, f"{node.label} rhs (replicated)")
        prod = self._new_reg(space)
        mul = MulNode(prod, rep_a.out, rep_b.out, size, f"{node.label} (products)")
        total = _ones(out_index, np.arange(size), (node.size, size))  # sum over k
        self.nodes[position:position + 1] = [rep_a, rep_b, mul]
        direct = node.out == self.circuit.output
        for later in self.nodes[position + 3:]:
            if isinstance(later, LinearNode) and node.out in later.inputs:
                at = later.inputs.index(node.out)
                later.matrices[at] = sp.csr_matrix(later.matrices[at] @ total)
                later.inputs[at] = prod
            elif not isinstance(later, LinearNode) and node.out in (later.a, later.b):
                direct = True
        if direct:  # read by a product or as the output: the sum is a map of its own, in the MatMul's register
            self.nodes.insert(position + 3, LinearNode(node.out, [prod], [total], None, node.size,
                                                       f"{node.label} (sum over k)"))
        else:
            del self.circuit.sizes[node.out], self.circuit.shapes[node.out]

    def drop_unread(self, candidates: set[int]) -> None:
        """Remove the operand maps whose only reader was a MatMul (they now live on, composed, in its replicas)."""
        while True:
            read = {r for n in self.nodes for r in node_reads(n)}
            dead = {r for r in candidates if r not in read and r != self.circuit.output}
            dead &= {n.out for n in self.nodes}
            if not dead:
                return
            self.nodes = [n for n in self.nodes if n.out not in dead]
            for r in dead:
                del self.circuit.sizes[r], self.circuit.shapes[r]
            candidates -= dead


def expand_matmuls(circuit: Circuit, slots: int) -> Circuit:
    """A copy of ``circuit`` with every :class:`MatMulNode` rewritten into linear maps and one elementwise product.

    ``slots``: the most slots a ring may offer; an index space larger than that raises :class:`LoweringError`.
    The circuit computes the same function (exactly: the maps are 0/1); its depth grows only where an operand
    is not produced by a linear map or the result is read by a product or as the output (one level each).
    """
    matmuls = [n for n in circuit.nodes if isinstance(n, MatMulNode)]
    if not matmuls:
        return circuit
    for node in matmuls:
        _slot_limit(int(np.prod(node.out_shape)) * int(node.a_shape[-1]), slots, node)
    out = replace(circuit, nodes=[replace(n, inputs=list(n.inputs), matrices=list(n.matrices))
                                  if isinstance(n, LinearNode) else n for n in circuit.nodes],
                  sizes=dict(circuit.sizes), shapes=dict(circuit.shapes))
    rewriter = _Rewriter(out)
    operands = set()
    for node in matmuls:
        operands |= {node.a, node.b}
        rewriter.expand(next(i for i, n in enumerate(rewriter.nodes) if n is node), node)
    rewriter.drop_unread(operands)
    out.nodes = rewriter.nodes
    before, after = circuit.depth, out.depth
    log.info("%d ct x ct MatMul(s) expanded into replicate / multiply / sum maps: largest register %d values, "
             "depth %d -> %d", len(matmuls), out.max_size(), before, after)
    return out
