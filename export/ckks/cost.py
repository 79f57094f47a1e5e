"""The planner's cost model: what computing a tensor from given registers costs in the single layout.

While lowering, a tensor can often be computed in several ways (merged back to early registers, or from a
register that already holds a part of it); every way at the same CKKS level is equally deep, so the planner
takes the cheapest. A map's cost is dominated by its plaintext diagonals (an encode and a plaintext product
each) and its rotations (a key switch each, about ``ROTATION_COST`` products; BSGS needs about
``2 sqrt(diagonals)``). Diagonals are counted in the layouts the planner prefers (padded channel-major), so
the estimate follows what ``plan.py`` will emit.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from polyfhe.exporters.ckks.circuit import Circuit, LinearNode
from polyfhe.exporters.ckks.layout import (
    UNBOUNDED_SLOTS,
    circuit_input_packing,
    count_offsets,
    nonzero,
    period_of,
    preferred_layout,
    preferred_width,
    token_aligned,
)

__all__ = ["COMPOSED_COST", "NEW_KEY_COST", "ROTATION_COST", "circuit_cost", "map_cost", "term_diagonals"]

# A key switch in plaintext products: a constant, not this machine's measured ratio, so that a model compiles to
# the same program on every machine
ROTATION_COST = 20.0
NEW_KEY_COST = 0.5  # a new Galois key (upload, key generation), in key switches: reuse beats a fresh step
COMPOSED_COST = 4.0  # a step past the key budget is composed of ~3 key switches on every use, in key switches


@lru_cache(maxsize=256)
def _layout(shape: tuple[int, ...]) -> np.ndarray:
    return preferred_layout(shape)


def term_diagonals(stacked, in_shape: tuple[int, ...], out_shape: tuple[int, ...],
                   packed_input: bool = False, input_slots: np.ndarray | None = None) -> int:
    """Plaintext diagonals of one term, a sparse ``(n_in, out_size)`` matrix (input basis images).

    ``packed_input``: the term reads the program input, which the client packs for its first consumer
    (token-aligned, see ``layout.py``). ``input_slots`` is that packing once the first consumer is known;
    before, the term is counted as if it were the first consumer.
    """
    cols, rows, _ = nonzero(stacked)
    if len(rows) == 0:
        return 0
    slot_in, slot_out = _layout(tuple(in_shape)), _layout(tuple(out_shape))
    if packed_input and input_slots is not None:
        slot_in = input_slots
    elif packed_input:
        width = _token_width(tuple(out_shape))
        matrix = stacked.T
        packed = token_aligned(matrix, slot_out, width, 1 << 62) if width > 1 else None
        slot_in = slot_in if packed is None else packed
    return count_offsets(slot_out[rows], slot_in[cols], period_of(slot_out), period_of(slot_in))


@lru_cache(maxsize=256)
def _token_width(shape: tuple[int, ...]) -> int:
    """Token block width of the preferred layout: slots between consecutive channels."""
    dims = [d for d in shape if d != 1]
    return preferred_width(tuple(dims)) if len(dims) >= 2 else 1


def map_cost(diagonals: int) -> float:
    """Products plus key switches (in product units) of a BSGS map with this many diagonals."""
    return diagonals + ROTATION_COST * 2.0 * np.sqrt(diagonals) if diagonals else 0.0


def circuit_cost(circuit: Circuit) -> float:
    """Estimated cost of a whole circuit in plaintext-product units, per prime of the modulus chain.

    Per map, :func:`map_cost` of its diagonals counted as :func:`term_diagonals` does, the input in the packing
    its first reader gives it. Multiply by the primes of the chain to compare circuits of different depth:
    products and key switches grow with the primes they touch.
    """
    packing = circuit_input_packing(circuit, UNBOUNDED_SLOTS)
    return sum(map_cost(sum(term_diagonals(matrix.T, circuit.shapes[reg], circuit.shapes[node.out],
                                           packed_input=reg == 0, input_slots=packing)
                            for reg, matrix in zip(node.inputs, node.matrices, strict=True)))
               for node in circuit.nodes if isinstance(node, LinearNode))
