"""Single-layout ct x ct MatMul algorithms: orderings of the product set into registers of rows x columns.

A MatMul is ``batch * M * N * K`` scalar products ``a[m, k] * b[k, n]`` (``space.py``). Each algorithm here lays
them out in registers (one ciphertext each) of ``rows x cols`` elements; the rewrite (``rewrite.py``) then
gathers ``a`` and ``b`` into every register with a 0/1 linear map, multiplies the two elementwise (one ct x ct
product per register) and sums each product into its output element with another 0/1 map. Which algorithm is
cheap depends on how those maps land in the slots, so the choice is left to the planner's cost model
(``choose.py``), per MatMul.

* **broadcast** (``replicate`` when it fits one register, ``tiles`` when not): rows ``(n, batch, k)``, columns
  ``m``. Replicating ``a`` along ``n`` is free (registers repeat with their period), replicating ``b`` along
  ``m`` costs a diagonal per column. Small token grids.
* **offsets**: one of the three axes is *derived* from the row axis ``base`` by a cyclic offset ``r`` that
  enumerates the terms: ``derived = (base + r) mod size``. Rows are ``(r, batch, base)``, columns the third axis. Every term
  is then a *permutation* of an operand (a rotation in a channel-major layout), not a broadcast, so the slots
  a register needs are those of the operands and the result, and the gathers cost a few diagonals: the
  diagonal (Halevi-Shoup / Jiang-Kim-Lauter-Song) way of multiplying encrypted matrices, one variant per choice
  of axes. ``k`` derived from ``n`` with columns ``m`` multiplies rotated copies of ``a`` by ``b``'s
  generalised diagonals; ``n`` derived from ``m`` (columns ``m``) is attention's key offsets, ``QK^T`` one
  token shift at a time; ``m`` derived from ``n`` with columns ``k`` sums along the row (a token contraction
  such as ``K^T V``).

Terms are packed several to a register when they fit (rows stacked), and a register never holds more than the
slots given, so any size compiles; only the cost grows.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from polyfhe.exporters.ckks.matmul.space import MatMulShape

__all__ = ["ALGORITHMS", "Ordering", "Tile", "algorithm_names", "pow2_at_least", "tiles_for"]

AXES = ("m", "k", "n")


def pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())


@dataclass(frozen=True)
class Tile:
    """One product register: ``rows x cols`` elements, each the product ``a[a_index] * b[b_index]`` summed into
    ``out[out_index]`` (all three -1 for an unused element)."""

    rows: int
    cols: int
    a_index: np.ndarray
    b_index: np.ndarray
    out_index: np.ndarray

    @property
    def size(self) -> int:
        return self.rows * self.cols


@dataclass(frozen=True)
class Ordering:
    """An algorithm: which axis runs along the columns, and which (if any) is derived by an offset.

    ``derived is None``: the broadcast ordering, rows ``(n, batch, k)`` and columns ``m``. Otherwise rows are
    ``(r, batch, base)`` with ``derived = (source + r) mod size(derived)``, ``source`` the column or base axis.
    ``single``: all products in one register or not at all.
    """

    name: str
    cols: str
    derived: str | None = None
    source: str | None = None
    single: bool = False

    @property
    def base(self) -> str | None:
        return None if self.derived is None else next(a for a in AXES if a not in (self.cols, self.derived))

    def grid(self, shape: MatMulShape) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(batch, m, k, n) of every element, each of shape ``(rows, cols)``, rows in register order."""
        size = {"m": shape.m, "k": shape.k, "n": shape.n}
        if self.derived is None:
            n, beta, k, m = np.indices((shape.n, shape.batches, shape.k, shape.m))
            rows = shape.n * shape.batches * shape.k
            return (beta.reshape(rows, -1), m.reshape(rows, -1), k.reshape(rows, -1), n.reshape(rows, -1))
        terms = size[self.derived]
        r, beta, base, col = np.indices((terms, shape.batches, size[self.base], size[self.cols]))
        axis = {self.base: base, self.cols: col}
        axis[self.derived] = (axis[self.source] + r) % terms
        rows = terms * shape.batches * size[self.base]
        return tuple(a.reshape(rows, -1) for a in (beta, axis["m"], axis["k"], axis["n"]))


def _orderings() -> tuple[Ordering, ...]:
    found = [Ordering("replicate", "m", single=True), Ordering("tiles", "m")]
    for cols in AXES:
        for derived in AXES:
            if derived == cols:
                continue
            base = next(a for a in AXES if a not in (cols, derived))
            # derived from the row axis: every row is one term's slice, so a register's rows are whole
            # rotations of an operand (derived from the column axis, each row would shift within itself)
            found.append(Ordering(f"offsets_{derived}_from_{base}_cols_{cols}", cols, derived, base))
    return tuple(found)


ALGORITHMS: dict[str, Ordering] = {o.name: o for o in _orderings()}


def algorithm_names() -> list[str]:
    return list(ALGORITHMS)


def _chunks(total_rows: int, per_tile: int) -> Iterator[tuple[int, int]]:
    for start in range(0, total_rows, per_tile):
        yield start, min(total_rows, start + per_tile)


def tiles_for(ordering: Ordering, shape: MatMulShape, slots: int) -> list[Tile] | None:
    """The registers ``ordering`` needs for ``shape`` within ``slots`` each; None when it does not apply.

    Columns are padded to a power of two in the slots (the layouts pad token blocks), so a register holds
    ``slots // pow2(cols)`` rows. A derived axis of size 1 adds nothing over the broadcast ordering.
    """
    if ordering.derived is not None:
        size = {"m": shape.m, "k": shape.k, "n": shape.n}
        if size[ordering.derived] == 1 or size[ordering.cols] == 1 and ordering.source == ordering.cols:
            return None
    beta, m, k, n = ordering.grid(shape)
    rows, cols = beta.shape
    if ordering.single:
        if rows * cols > slots:
            return None
        per_tile = rows
    else:
        per_tile = slots // pow2_at_least(cols)
        if per_tile < 1:
            return None
    a_index, b_index, out_index = (x.reshape(rows, cols) for x in shape.flat_indices(
        beta.reshape(-1), m.reshape(-1), k.reshape(-1), n.reshape(-1)))
    return [Tile(stop - start, cols, a_index[start:stop].reshape(-1), b_index[start:stop].reshape(-1),
                 out_index[start:stop].reshape(-1)) for start, stop in _chunks(rows, per_tile)]
