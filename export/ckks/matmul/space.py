"""The product set of a ct x ct MatMul and the flat indices of its operands and result.

``out[..., m, n] = sum_k a[..., m, k] * b[..., k, n]`` is ``batch * M * N * K`` scalar products. Every single-layout
algorithm (``algorithms.py``) is an *ordering* of that set into registers of rows x columns; this module turns an
ordering, given as arrays of ``(batch, m, k, n)`` per element, into the flat indices the rewrite needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from polyfhe.exporters.ckks.affine import LoweringError

__all__ = ["MatMulShape", "matmul_index_maps"]


@dataclass(frozen=True)
class MatMulShape:
    """Shapes of one MatMul: ``a (..., M, K) @ b (..., K, N) -> out (batch..., M, N)`` (numpy broadcasting)."""

    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]
    out_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        *_, m, n = self.out_shape
        if self.a_shape[-2] != m or self.b_shape[-1] != n or self.b_shape[-2] != self.a_shape[-1]:
            raise LoweringError(f"MatMul shapes {self.a_shape} @ {self.b_shape} -> {self.out_shape} disagree")

    @classmethod
    def of(cls, a_shape, b_shape, out_shape) -> MatMulShape:
        return cls(tuple(int(d) for d in a_shape), tuple(int(d) for d in b_shape), tuple(int(d) for d in out_shape))

    @property
    def batch(self) -> tuple[int, ...]:
        return self.out_shape[:-2]

    @property
    def batches(self) -> int:
        return int(np.prod(self.batch, dtype=np.int64))

    @property
    def m(self) -> int:
        return self.out_shape[-2]

    @property
    def n(self) -> int:
        return self.out_shape[-1]

    @property
    def k(self) -> int:
        return self.a_shape[-1]

    @property
    def products(self) -> int:
        """Scalar products: the slots a single-register expansion needs."""
        return self.batches * self.m * self.n * self.k

    def describe(self) -> str:
        return "x".join(str(d) for d in (*self.batch, self.m, self.n, self.k))

    def flat_indices(self, beta: np.ndarray, m: np.ndarray, k: np.ndarray, n: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Flat indices into a, b and out of the products ``(beta, m, k, n)`` (beta: flat batch index)."""
        batch_index = np.unravel_index(beta, self.batch) if self.batch else ()

        def flat(shape: tuple[int, ...], tail: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
            lead = shape[:-2]
            offset = len(self.batch) - len(lead)
            index = [batch_index[offset + j] if d != 1 else np.zeros_like(beta) for j, d in enumerate(lead)]
            return np.ravel_multi_index((*index, *tail), shape)  # size-1 axes broadcast: always element 0

        out = np.ravel_multi_index((*batch_index, m, n), self.out_shape)
        return flat(self.a_shape, (m, k)), flat(self.b_shape, (k, n)), out


def matmul_index_maps(a_shape: tuple[int, ...], b_shape: tuple[int, ...], out_shape: tuple[int, ...]
                      ) -> tuple[tuple[int, ...], np.ndarray, np.ndarray, np.ndarray]:
    """(shape of the ``(N, *batch, K, M)`` index space, and per element of it: flat index into a, b, out).

    The single-register ordering (``algorithms.REPLICATE``) in the form earlier releases exposed.
    """
    shape = MatMulShape.of(a_shape, b_shape, out_shape)
    space = (shape.n, *shape.batch, shape.k, shape.m)
    grid = np.indices((shape.n, shape.batches, shape.k, shape.m)).reshape(4, -1)
    a_index, b_index, out_index = shape.flat_indices(grid[1], grid[3], grid[2], grid[0])
    return space, a_index, b_index, out_index
