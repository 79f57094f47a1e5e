"""Slot layouts for the single layout: which slot holds which tensor element, per register.

The number of non-zero diagonals (hence plaintext products and rotations) of a linear map depends on how
its input and output tensors are laid out in the slots. Channel mixing in a token-major layout ``t*C + c``
has offsets ``t*(C_out - C_in) + c - k`` that change with every token when the width changes (thousands of
diagonals); in a channel-major layout ``c*T + t`` they are ``(c - k)*T`` (at most ``C_in + C_out - 1``), and
with token blocks padded to a power of two ``T'`` a register repeats cyclically every ``C*T'`` slots, so the
offsets are taken modulo that period and channel mixing needs about ``min(C_in, C_out)`` diagonals.
Layouts are free: the client packs the input and unpacks the output with the program's public slot maps,
and every map in between is rewritten in slot coordinates. Products need equal layouts on both operands.

Per register we try the leading axis and the last axis as channels, padded and not, and keep the one with the
fewest diagonals for the map that produces it (ties go to the padded leading-axis order, best for consumers);
the input gets a *token-aligned* packing built from its first consumer, so that a patch embedding
(stride = kernel) becomes channel mixing too.
"""

from __future__ import annotations

import logging

import numpy as np

from polyfhe.exporters.ckks.circuit import Circuit, LinearNode, MatMulNode, MulNode

log = logging.getLogger(__name__)
FALLBACK = -1  # key of choose_layouts' result when it fell back to natural layouts
UNBOUNDED_SLOTS = 1 << 62  # for estimates made before the ring (hence the slot count) is chosen

__all__ = ["UNBOUNDED_SLOTS", "candidate_layouts", "choose_layouts", "circuit_input_packing", "diagonal_count", "input_packing"]


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


def pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())


def padded(slot_of: np.ndarray, block: int) -> np.ndarray:
    """The same order with every block of ``block`` consecutive slots widened to a power of two.

    ``c*T + t`` becomes ``c*T' + t`` with ``T' = 2^ceil(log2 T)``: channel blocks then tile a power-of-two
    period, so a register replicated with that period turns channel mixing into about ``min(C_in, C_out)``
    cyclic block diagonals instead of ``C_in + C_out - 1``.
    """
    width = pow2_at_least(block)
    return (slot_of // block) * width + slot_of % block


def period_of(slot_of: np.ndarray) -> int:
    """Registers are replicated with this period across the slots: the power of two above their last slot."""
    return pow2_at_least(int(slot_of.max()) + 1)


def offsets(rows: np.ndarray, cols: np.ndarray, period_out: int, period_in: int) -> tuple[np.ndarray, np.ndarray]:
    """(diagonal offset k, output slot t) of each non-zero (row slot, column slot) of a map.

    The input repeats every ``period_in`` slots, so a column is reachable at any ``col + m*period_in``; the
    output is summed over ``period_out``-periodic copies (hybrid method), so a row may sit at any
    ``row + m*period_out`` below the larger of the two periods. Offsets are ``(col - row) mod period_in``
    reduced mod ``period_out``.
    """
    delta = (cols - rows) % period_in
    return delta % period_out, rows + (delta // period_out) * period_out


def count_offsets(rows: np.ndarray, cols: np.ndarray, period_out: int, period_in: int) -> int:
    """How many distinct offsets :func:`offsets` gives (the map's diagonals), without its arrays: with
    power-of-two periods, ``(d mod p_in) mod p_out`` is ``d mod min(p_in, p_out)``, a mask, and the distinct
    values are marked in a table of that size instead of sorted or hashed."""
    period = min(period_in, period_out)
    if period & (period - 1):  # not a power of two: the general path
        return len(np.unique(offsets(rows, cols, period_out, period_in)[0]))
    seen = np.zeros(period, dtype=bool)
    seen[(cols - rows) & (period - 1)] = True
    return int(np.count_nonzero(seen))


def nonzero(matrix) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, cols, values) of the non-zero entries of a dense or scipy sparse matrix."""
    if hasattr(matrix, "tocoo"):
        coo = matrix.tocoo()
        keep = coo.data != 0
        if keep.all():  # the usual case: no stored zeros, so no filtered copies
            return coo.row, coo.col, coo.data
        return coo.row[keep], coo.col[keep], coo.data[keep]
    rows, cols = np.nonzero(matrix)
    return rows, cols, matrix[rows, cols]


def diagonal_count(matrix, slot_out: np.ndarray, slot_in: np.ndarray, period_in: int) -> int:
    rows, cols, _ = nonzero(matrix)
    return count_offsets(slot_out[rows], slot_in[cols], period_of(slot_out), period_in)


def token_aligned(matrix: np.ndarray, slot_out: np.ndarray, width: int, slots: int) -> np.ndarray | None:
    """Input packing ``rank*width + token`` where each input element goes to the token it mostly feeds.

    ``width`` is the output layout's token block (slot = channel*width + token), padded or not.
    """
    n = matrix.shape[1]
    rows, cols, _ = nonzero(matrix)
    if width <= 1 or len(cols) == 0:
        return None
    tokens = width
    tok = slot_out[rows] % width
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
        slot_of[j] = counts[first[j]] * width + first[j]
        counts[first[j]] += 1
    return slot_of if slot_of.max() < slots else None


def input_packing(matrix, out_shape: tuple[int, ...], slots: int) -> np.ndarray:
    """The client's packing of the program input, chosen for its first consumer ``matrix`` (output ``out_shape``).

    The natural order or a token-aligned packing for one of the output's candidate layouts, whichever gives
    that map the fewest diagonals. The lowering calls this too, so that the cost of every later map reading
    the input is counted in the packing the input will really have.
    """
    base = np.arange(matrix.shape[1])
    options = [(diagonal_count(matrix, slot_out, base, period_of(base)), base) for slot_out in _candidates(out_shape, slots)]
    for slot_out, width in _blocked_candidates(out_shape, slots):
        packed = token_aligned(matrix, slot_out, width, slots)
        if packed is not None:
            options.append((diagonal_count(matrix, slot_out, packed, period_of(packed)), packed))
    return min(options, key=lambda o: (o[0], period_of(o[1])))[1]


def circuit_input_packing(circuit: Circuit, slots: int) -> np.ndarray:
    """The input's packing for the first map of ``circuit`` that reads it (the natural order if none does), or
    the replicated packing ``replicate.py`` fixed."""
    if circuit.input_slots is not None:
        return circuit.input_slots
    first = next((n for n in circuit.nodes if isinstance(n, LinearNode) and 0 in n.inputs), None)
    if first is None:
        return natural(circuit.shapes[0])
    return input_packing(first.matrices[first.inputs.index(0)], circuit.shapes[first.out], slots)


def _candidates(shape: tuple[int, ...], slots: int) -> list[np.ndarray]:
    """Layouts worth trying for a register, preferred first (ties go to the earlier one).

    The leading axis as channels (NCHW: ``c*HW' + t``) and the last axis as channels (token-major ``(T, C)``
    tensors: ``c*T' + t``), each with its token blocks padded to a power of two, then both unpadded.
    """
    return [slot_of for slot_of, _ in _blocked_candidates(shape, slots)]


def candidate_layouts(shape: tuple[int, ...], slots: int) -> list[np.ndarray]:
    """The layouts the planner tries for a register of this shape, preferred first."""
    return _candidates(shape, slots)


def preferred_layout(shape: tuple[int, ...]) -> np.ndarray:
    """The layout a register of this shape most likely gets (the first candidate): for cost estimates."""
    return _blocked_candidates(shape, 1 << 62)[0][0]


def preferred_width(shape: tuple[int, ...]) -> int:
    """The token block width of :func:`preferred_layout`."""
    return _blocked_candidates(shape, 1 << 62)[0][1]


def _blocked_candidates(shape: tuple[int, ...], slots: int) -> list[tuple[np.ndarray, int]]:
    """:func:`_candidates` with the token block width of each (slot = channel * width + token)."""
    dims = _squeeze(shape)
    size = int(np.prod(dims))
    lead, last = natural(shape), channel_major(shape)
    options = []
    if len(dims) >= 2:
        options += [(padded(lead, size // dims[0]), pow2_at_least(size // dims[0])),
                    (padded(last, size // dims[-1]), pow2_at_least(size // dims[-1]))]
        options += [(lead, size // dims[0]), (last, size // dims[-1])]
    else:
        options.append((lead, 1))
    unique: list[tuple[np.ndarray, int]] = []
    for slot_of, width in options:
        if int(slot_of.max()) < slots and not any(np.array_equal(slot_of, o) for o, _ in unique):
            unique.append((slot_of, width))
    return unique or [(lead, 1)]


def _cost(node: LinearNode, slot_out: np.ndarray, layouts: dict[int, np.ndarray], periods: dict[int, int]) -> int:
    return sum(diagonal_count(m, slot_out, layouts[r], periods[r])
               for r, m in zip(node.inputs, node.matrices, strict=True))


def choose_layouts(circuit: Circuit, slots: int) -> dict[int, np.ndarray]:
    """slot_of arrays for every register (logical element index -> slot)."""
    layouts: dict[int, np.ndarray] = {}
    periods: dict[int, int] = {}
    forced: dict[int, int] = {}  # register -> register whose layout it must share (product operands)
    for node in circuit.nodes:
        if isinstance(node, MulNode):
            forced[node.b] = node.a
    layouts[0] = circuit_input_packing(circuit, slots)
    periods[0] = period_of(layouts[0])
    for node in circuit.nodes:
        shape = circuit.shapes[node.out]
        if isinstance(node, LinearNode):
            if node.out in forced and forced[node.out] in layouts:
                layouts[node.out] = layouts[forced[node.out]]
            else:
                options = _candidates(shape, slots)
                costs = [_cost(node, s, layouts, periods) for s in options]
                layouts[node.out] = options[int(np.argmin(costs))]  # ties: the preferred (earlier) option
        elif isinstance(node, MulNode):
            layouts[node.out] = layouts[node.a]
        elif isinstance(node, MatMulNode):
            layouts[node.out] = natural(shape)
        periods[node.out] = period_of(layouts[node.out])
    if any(isinstance(n, MulNode) and not np.array_equal(layouts[n.a], layouts[n.b]) for n in circuit.nodes):
        log.warning("the operands of a product got different slot layouts; falling back to the natural layout for "
                    "every register (correct, but channel mixing costs more diagonals)")
        fallback = {reg: natural(shape) for reg, shape in circuit.shapes.items()}
        fallback[FALLBACK] = np.zeros(0, dtype=np.int64)  # marker for the manifest
        return fallback
    return layouts
