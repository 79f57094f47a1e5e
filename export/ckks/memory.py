"""Compile memory: what the lowering's affine terms hold, and a budget checked before a term is composed.

The lowering keeps every encrypted tensor as sparse terms over registers (``affine.py``). Those terms are the
compiler's memory: composing a term with an op's matrix can multiply its non-zeros many times (a 3x3 convolution
spreads every row over nine tokens, a channel map over every channel). :func:`composed_nnz_bound` bounds a
product's non-zeros from the operands' sparsity patterns alone (one sparse product of counts), so the budget is
checked *before* the product is formed: an export that would outgrow the machine stops with an error that names
the node, the register and the bytes, instead of being killed by the kernel.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from polyfhe.exporters.ckks.affine import LoweringError

__all__ = [
    "BYTES_PER_NONZERO",
    "COMPILE_MEMORY_FRACTION",
    "CompileMemoryError",
    "TermBudget",
    "composed_nnz_bound",
    "term_bytes",
]

BYTES_PER_NONZERO = 12  # a float64 value and an int32 column index (CSR)
COMPILE_MEMORY_FRACTION = 0.5  # of this machine's physical memory, when the caller gives no budget
# scipy forms a product in new arrays beside its operands, and the sum a term joins copies it once more
COMPOSE_OVERHEAD = 2


class CompileMemoryError(LoweringError):
    """Lowering the graph would hold more term bytes than the compile memory budget allows."""


def _size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def term_bytes(matrix: sp.spmatrix) -> int:
    """Bytes a sparse term holds (values, indices and row pointers)."""
    if sp.issparse(matrix) and hasattr(matrix, "indices"):
        return int(matrix.data.nbytes + matrix.indices.nbytes + matrix.indptr.nbytes)
    return int(getattr(matrix, "nbytes", 0))


def composed_nnz_bound(left: sp.csr_matrix, right: sp.csr_matrix) -> int:
    """An upper bound on the non-zeros of ``left @ right``: each row of the product has at most the summed row
    counts of the ``right`` rows its non-zeros select, and at most ``right``'s width."""
    if left.nnz == 0 or right.nnz == 0:
        return 0
    left = sp.csr_matrix(left)
    right_rows = np.diff(sp.csr_matrix(right).indptr).astype(np.float64)
    pattern = sp.csr_matrix((np.ones(left.nnz), left.indices, left.indptr), shape=left.shape)
    per_row = pattern @ right_rows
    return int(np.minimum(per_row, right.shape[1]).sum())


@dataclass
class TermBudget:
    """Live term bytes against ``limit`` (None: unbounded); ``peak`` is the most seen, for the log and tests."""

    limit: int | None
    live: int = 0
    peak: int = 0

    def observe(self, terms: Iterable[sp.spmatrix]) -> int:
        """Set the live bytes from every term the lowering still holds (each array counted once)."""
        seen: set[int] = set()
        total = 0
        for arr in terms:
            if id(arr) not in seen:
                seen.add(id(arr))
                total += term_bytes(arr)
        self.live = total
        self.peak = max(self.peak, total)
        return total

    def check_compose(self, left: sp.csr_matrix, right: sp.csr_matrix, where: str) -> None:
        """Refuse to form ``left @ right`` when its bound, on top of what is live, passes the limit."""
        if self.limit is None:
            return
        needed = COMPOSE_OVERHEAD * BYTES_PER_NONZERO * composed_nnz_bound(left, right)
        if self.live + needed > self.limit:
            raise CompileMemoryError(
                f"{where}: composing a {left.shape[0]} x {right.shape[1]} term would take up to "
                f"{_size(needed)} on top of the {_size(self.live)} the lowering holds, over the "
                f"compile memory budget of {_size(self.limit)}; raise it with compile_memory= "
                f"(polyfhe export --compile-memory GB) on a machine with more memory, or use a narrower or "
                f"shallower model")
        self.live += needed // COMPOSE_OVERHEAD  # until the node's end, when observe() counts what is held
