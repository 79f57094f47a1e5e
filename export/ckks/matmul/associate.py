"""Linear attention reassociated: ``(D Q K^T + c) V = D Q (K^T V) + c 1 (1^T V)``, when that is cheaper.

Without a softmax, and with the l1 normaliser a constant in eval mode, the scores of linear attention reach
``V`` only through an affine map whose scale ``D`` is per query row and whose offset ``c`` is per query row too
(``S = D Q K^T + c``, then ``S V``). Then, exactly,

    S V = D Q (K^T V) + c (1^T V)

where ``c (1^T V)`` is linear in ``V`` (column sums broadcast to the rows). On ``T`` tokens with head width
``d`` the left side multiplies ``T x T x d`` twice, the right ``d x T x d`` and ``T x d x d``: fewer products,
and a ``d x d`` intermediate instead of ``T x T``, whenever ``d < T``. :func:`reassociate` rewrites each such
chain whose reassociated form needs fewer products; a polynomial kernel (``S**2``, PolyAttn's ``S**4``) is not
affine and is left as it is.
"""

from __future__ import annotations

import logging

import numpy as np
import scipy.sparse as sp

from polyfhe.exporters.ckks.circuit import Circuit, LinearNode, MatMulNode, node_reads

__all__ = ["reassociate"]

log = logging.getLogger(__name__)


def _readers(nodes: list, reg: int) -> list:
    return [n for n in nodes if reg in node_reads(n)]


def _row_affine(link: LinearNode, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray] | None:
    """(scale, offset) per row ``(batch..., m)`` when ``link`` is ``s -> d_row * s + c_row``, else None."""
    matrix = sp.csr_matrix(link.matrices[0])
    size = int(np.prod(shape))
    if matrix.shape != (size, size) or (matrix - sp.diags(matrix.diagonal())).count_nonzero():
        return None
    rows = size // shape[-1]
    scale = matrix.diagonal().reshape(rows, shape[-1])
    offset = (np.zeros(size) if link.bias is None else np.asarray(link.bias, dtype=np.float64)).reshape(rows, -1)
    if not (np.allclose(scale, scale[:, :1], rtol=1e-12, atol=0) and np.allclose(offset, offset[:, :1],
                                                                                  rtol=1e-12, atol=0)):
        return None
    return scale[:, 0], offset[:, 0]


def _chain(circuit: Circuit, nodes: list, second: MatMulNode):
    """(first MatMul, the affine link, its row scale and offset) when ``second`` multiplies ``affine(Q K^T)``."""
    link = next((n for n in nodes if n.out == second.a and isinstance(n, LinearNode)), None)
    if link is None or len(link.inputs) != 1 or _readers(nodes, second.a) != [second]:
        return None
    first = next((n for n in nodes if n.out == link.inputs[0] and isinstance(n, MatMulNode)), None)
    if first is None or _readers(nodes, first.out) != [link] or second.a_shape != first.out_shape:
        return None
    batch = first.out_shape[:-2]
    if any(tuple(s[:-2]) != tuple(batch) for s in (first.a_shape, first.b_shape, second.b_shape)):
        return None  # broadcast batch axes: not worth the bookkeeping
    affine = _row_affine(link, first.out_shape)
    return None if affine is None else (first, link, *affine)


def _products(a_shape, b_shape) -> int:
    return int(np.prod(a_shape[:-1])) * int(b_shape[-1]) * int(a_shape[-1])


def _inline(circuit: Circuit, nodes: list, combine: LinearNode) -> bool:
    """Compose ``combine`` into its readers when they are all linear maps (so it costs no level of its own)."""
    readers = _readers(nodes, combine.out)
    if combine.out == circuit.output or not readers or not all(isinstance(n, LinearNode) for n in readers):
        return False
    for reader in readers:
        at = reader.inputs.index(combine.out)
        matrix = sp.csr_matrix(reader.matrices[at])
        del reader.inputs[at], reader.matrices[at]
        for reg, inner in zip(combine.inputs, combine.matrices, strict=True):
            composed = sp.csr_matrix(matrix @ inner)
            if reg in reader.inputs:
                j = reader.inputs.index(reg)
                reader.matrices[j] = sp.csr_matrix(reader.matrices[j] + composed)
            else:
                reader.inputs.append(reg)
                reader.matrices.append(composed)
    return True


def reassociate(circuit: Circuit) -> Circuit:
    """``circuit`` (rewritten in place and returned) with every cheaper linear-attention chain reassociated."""
    nodes = list(circuit.nodes)
    next_reg = max(circuit.sizes) + 1
    for second in [n for n in nodes if isinstance(n, MatMulNode)]:
        found = _chain(circuit, nodes, second)
        if found is None:
            continue
        first, link, scale, offset = found
        *batch, m, d = first.a_shape
        tokens, width = second.b_shape[-2], second.b_shape[-1]
        kv_shape, out_shape = (*batch, d, width), (*batch, m, width)
        before = _products(first.a_shape, first.b_shape) + _products(second.a_shape, second.b_shape)
        after = _products(first.b_shape, second.b_shape) + _products(first.a_shape, kv_shape)
        if after >= before:
            continue
        kv, qkv = next_reg, next_reg + 1
        next_reg += 2
        for reg, shape in ((kv, kv_shape), (qkv, out_shape)):
            circuit.sizes[reg], circuit.shapes[reg] = int(np.prod(shape)), tuple(shape)
        label = second.label or first.label
        kv_node = MatMulNode(kv, first.b, second.b, tuple(first.b_shape), tuple(second.b_shape), kv_shape,
                             int(np.prod(kv_shape)), f"{label} K^T V (reassociated)")
        q_node = MatMulNode(qkv, first.a, kv, tuple(first.a_shape), kv_shape, out_shape, int(np.prod(out_shape)),
                            f"{label} Q (K^T V) (reassociated)")
        rows = int(np.prod(out_shape[:-1]))
        inputs, matrices = [qkv], [sp.diags(np.repeat(scale, width)).tocsr()]
        if np.any(offset):
            # out[(b, m), j] += c[(b, m)] * sum_t v[(b, t), j]
            b_idx, m_idx, t_idx, j_idx = np.indices((int(np.prod(batch)), m, tokens, width)).reshape(4, -1)
            out_flat = (b_idx * m + m_idx) * width + j_idx
            v_flat = (b_idx * tokens + t_idx) * width + j_idx
            values = offset[b_idx * m + m_idx]
            matrices.append(sp.csr_matrix((values, (out_flat, v_flat)), shape=(rows * width, circuit.sizes[second.b])))
            inputs.append(second.b)
        combine = LinearNode(second.out, inputs, matrices, None, second.size, f"{label} (reassociated rows)")
        at = nodes.index(second)
        nodes[at:at + 1] = [kv_node, q_node, combine]
        nodes = [n for n in nodes if n is not first and n is not link]
        for reg in (first.out, link.out):
            del circuit.sizes[reg], circuit.shapes[reg]
        if _inline(circuit, nodes, combine):
            nodes.remove(combine)
            del circuit.sizes[combine.out], circuit.shapes[combine.out]
        circuit.matmuls.append({"label": label, "reassociated": "(Q K^T) V -> Q (K^T V)",
                                "products_before": before, "products_after": after})
        log.info("%s: (Q K^T) V reassociated into Q (K^T V): %d products instead of %d", label, after, before)
    circuit.nodes = nodes
    return circuit
