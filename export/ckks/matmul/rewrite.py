"""One MatMul rewritten by one algorithm's registers: gathers, products, sums, and what they cost.

For every register (:class:`~polyfhe.exporters.ckks.matmul.algorithms.Tile`) the operands are gathered with a
0/1 linear map, multiplied elementwise (the only ct x ct product: one level, as the MatMul) and summed into the
result with another 0/1 map. Each map may be *composed* with its linear neighbour instead of costing a level:

* a gather into the :class:`LinearNode` that produced the operand (``G @ W``, same inputs, same level);
* the sums into every :class:`LinearNode` that reads the result (``W @ S``).

Composing saves a level but can cost diagonals: ``rot(K)`` is one diagonal on its own, but composed into the
channel mixing that made ``K`` it has that map's diagonals, once per register. So each side is composed only
when that costs at most twice the separate maps plus the neighbour's own map (about what a level costs it).
:class:`Expansion` works all this out without touching the circuit; :meth:`Expansion.apply` then rewrites it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import scipy.sparse as sp

from polyfhe.exporters.ckks.circuit import Circuit, LinearNode, MatMulNode, MulNode
from polyfhe.exporters.ckks.cost import ROTATION_COST, map_cost, term_diagonals
from polyfhe.exporters.ckks.layout import candidate_layouts, count_offsets, nonzero, period_of
from polyfhe.exporters.ckks.matmul.algorithms import Tile

__all__ = ["Expansion"]

COMPOSE_SLACK = 2.0  # compose when it costs at most this times the separate maps plus the neighbour's own map


def _ones(rows: np.ndarray, cols: np.ndarray, shape: tuple[int, int]) -> sp.csr_matrix:
    keep = (rows >= 0) & (cols >= 0)
    return sp.csr_matrix((np.ones(int(keep.sum())), (rows[keep], cols[keep])), shape=shape)


def _nonzero_terms(inputs: list[int], matrices: list) -> tuple[list[int], list]:
    """The terms of a composed map that read anything (one register's regather reads that register only): a
    term of zeros would keep its register alive and cost the planner a term."""
    kept = [(r, sp.csr_matrix(m)) for r, m in zip(inputs, matrices, strict=True)]
    kept = [(r, m) for r, m in kept if m.count_nonzero()] or kept[:1]
    return [r for r, _ in kept], [m for _, m in kept]


@lru_cache(maxsize=512)
def _layouts(shape: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    """The two padded candidate layouts of a register (channels first, or last), as the planner tries them."""
    return tuple(candidate_layouts(shape, 1 << 62)[:2])


def _costs_by_layout(circuit: Circuit, inputs: list[int], matrices: list, out_shape: tuple[int, ...],
                     in_at: dict[int, int] | None = None,
                     in_shapes: dict[int, tuple[int, ...]] | None = None) -> list[float]:
    """map_cost of one linear map for each candidate layout of its output, diagonals counted as the planner
    will count them: the program input in the packing its first reader gives it, any other register in its
    best candidate layout or the one ``in_at`` fixes (the layout planner picks each register's layout for the
    map that makes it, so a ``(tokens, channels)`` tensor is often channel-major). ``in_shapes``: shapes of
    registers the circuit does not hold yet (a rewrite's own)."""
    in_at, in_shapes = in_at or {}, in_shapes or {}
    outs = _layouts(tuple(out_shape))
    diagonals = [0] * len(outs)
    for r, m in zip(inputs, matrices, strict=True):
        if r == 0:
            packed = term_diagonals(sp.csr_matrix(m).T, circuit.shapes[r], out_shape, packed_input=True)
            diagonals = [d + packed for d in diagonals]
            continue
        rows, cols, _ = nonzero(m)
        if len(rows) == 0:
            continue
        ins = _layouts(tuple(in_shapes.get(r, circuit.shapes.get(r))))
        ins = ins if in_at.get(r) is None else ins[min(in_at[r], len(ins) - 1):][:1]
        for at, slot_out in enumerate(outs):
            out_rows = slot_out[rows]
            diagonals[at] += min(count_offsets(out_rows, slot_in[cols], period_of(slot_out), period_of(slot_in))
                                 for slot_in in ins)
    return [map_cost(d) for d in diagonals]


def _cost(circuit: Circuit, inputs: list[int], matrices: list, out_shape: tuple[int, ...],
          in_shapes: dict[int, tuple[int, ...]], out_at: int | None = None,
          in_at: dict[int, int] | None = None) -> float:
    """:func:`_costs_by_layout` in the output layout ``out_at``, or its best one."""
    costs = _costs_by_layout(circuit, inputs, matrices, out_shape, in_at, in_shapes)
    return min(costs) if out_at is None else costs[min(out_at, len(costs) - 1)]


@dataclass(eq=False)
class Expansion:
    """The rewrite of ``node`` by ``tiles`` in ``circuit`` (``nodes``: the circuit's current node list)."""

    circuit: Circuit
    nodes: list
    node: MatMulNode
    tiles: list[Tile]
    algorithm: str
    first_reg: int
    cost: float = 0.0
    composed: dict[str, bool] = field(default_factory=dict)
    extra_levels: int = 0

    def __post_init__(self) -> None:
        self.tile_shapes = [(t.rows, t.cols) for t in self.tiles]
        self.gathers = {side: [_ones(np.arange(t.size), getattr(t, f"{side}_index"),
                                     (t.size, self.circuit.sizes[getattr(self.node, side)])) for t in self.tiles]
                        for side in ("a", "b")}
        self.sums = [_ones(t.out_index, np.arange(t.size), (self.node.size, t.size)) for t in self.tiles]
        self._plan()

    # -- planning ------------------------------------------------------------------------------------------
    def _producer(self, reg: int) -> LinearNode | None:
        return next((n for n in self.nodes if n.out == reg and isinstance(n, LinearNode)), None)

    def _readers(self) -> tuple[list[LinearNode], bool]:
        """Linear readers of the result, and whether anything else (a product, the output) reads it."""
        position = next(i for i, n in enumerate(self.nodes) if n is self.node)
        linear, direct = [], self.node.out == self.circuit.output
        for later in self.nodes[position + 1:]:
            if isinstance(later, LinearNode) and self.node.out in later.inputs:
                linear.append(later)
            elif not isinstance(later, LinearNode) and self.node.out in (later.a, later.b):
                direct = True
        return linear, direct

    def _operand_layout(self, reg: int, source: LinearNode | None) -> int | None:
        """The candidate layout the planner will give an operand: the cheapest for the map that makes it."""
        options = _layouts(self.circuit.shapes[reg])
        if source is None or len(options) == 1:
            return None
        costs = [_cost(self.circuit, source.inputs, source.matrices, self.circuit.shapes[reg], {}, at)
                 for at in range(len(options))]
        return int(np.argmin(costs))

    def _side_costs(self, side: str) -> list[tuple[float, bool]]:
        """(cost, composed) of one side's gathers for each candidate layout of the registers."""
        reg = getattr(self.node, side)
        source = self._producer(reg)
        reg_at = self._operand_layout(reg, source)
        own = None if source is None else _cost(self.circuit, source.inputs, source.matrices,
                                                self.circuit.shapes[reg], {})
        layouts = len(_layouts(self.tile_shapes[0]))
        separate, composed = [0.0] * layouts, None if source is None else [0.0] * layouts
        for g, shape in zip(self.gathers[side], self.tile_shapes, strict=True):
            for at, c in enumerate(_costs_by_layout(self.circuit, [reg], [g], shape, {reg: reg_at})):
                separate[at] += c
            if source is not None:
                matrices = [g @ m for m in source.matrices]
                for at, c in enumerate(_costs_by_layout(self.circuit, source.inputs, matrices, shape)):
                    composed[at] += c
        found = []
        for at in range(layouts):
            use = composed is not None and (len(self.tiles) == 1
                                            or composed[at] <= COMPOSE_SLACK * separate[at] + own)
            found.append((composed[at], True) if use else (separate[at], False))
        return found

    def _plan(self) -> None:
        """Cost the gathers as the layout planner will lay them out: the gather made first picks the registers'
        layout by its own cost, the other gets the same (a product's operands share one). Either side may go
        first; the cheaper order is kept."""
        costs = {side: self._side_costs(side) for side in ("a", "b")}
        best = None
        for first, second in (("a", "b"), ("b", "a")):
            tile_at = min(range(len(costs[first])), key=lambda i: (costs[first][i][0], i))
            total = costs[first][tile_at][0] + costs[second][tile_at][0]
            if best is None or total < best[0]:
                best = (total, first, tile_at)
        total, self.first_side, self.tile_at = best
        self.composed = {side: costs[side][self.tile_at][1] for side in ("a", "b")}
        self.cost = ROTATION_COST * len(self.tiles) + total  # a relinearisation (key switch) per product
        self.extra_levels = int(not (self.composed["a"] and self.composed["b"]))
        linear, direct = self._readers()
        tile_regs = {-(j + 1): s for j, s in enumerate(self.tile_shapes)}
        fixed = {r: self.tile_at for r in tile_regs}
        sum_cost = _cost(self.circuit, list(tile_regs), self.sums, self.circuit.shapes[self.node.out], tile_regs,
                         in_at=fixed)
        self.compose_sums = {}
        for reader in linear:
            at = reader.inputs.index(self.node.out)
            own = _cost(self.circuit, reader.inputs, reader.matrices, self.circuit.shapes[reader.out], {})
            others = [(r, m) for i, (r, m) in enumerate(zip(reader.inputs, reader.matrices, strict=True)) if i != at]
            composed = _cost(self.circuit, [r for r, _ in others] + list(tile_regs),
                             [m for _, m in others] + [reader.matrices[at] @ s for s in self.sums],
                             self.circuit.shapes[reader.out], tile_regs, in_at=fixed)
            compose = composed <= COMPOSE_SLACK * sum_cost + own
            self.compose_sums[id(reader)] = compose
            self.cost += (composed - own) if compose else 0.0
        self.materialise_sum = direct or not all(self.compose_sums.values())
        self.sum_cost = sum_cost if self.materialise_sum else 0.0
        if self.materialise_sum:
            self.cost += sum_cost
            self.extra_levels += int(not direct)

    # -- rewriting -----------------------------------------------------------------------------------------
    def apply(self) -> tuple[list, int]:
        """Rewrite: returns the new node list and the next free register number."""
        circuit, node, reg = self.circuit, self.node, self.first_reg
        products, inserted = [], []
        gathered: dict[str, list[LinearNode]] = {}
        for side in ("a", "b"):
            operand = getattr(node, side)
            source = self._producer(operand) if self.composed[side] else None
            gathered[side] = []
            for j, (gather, shape) in enumerate(zip(self.gathers[side], self.tile_shapes, strict=True)):
                circuit.sizes[reg], circuit.shapes[reg] = int(np.prod(shape)), shape
                label = f"{node.label} {'lhs' if side == 'a' else 'rhs'} ({self.algorithm} {j + 1}/{len(self.tiles)})"
                if source is None:
                    gathered[side].append(LinearNode(reg, [operand], [gather], None, int(np.prod(shape)), label))
                else:
                    bias = None if source.bias is None else gather @ np.asarray(source.bias)
                    inputs, matrices = _nonzero_terms(source.inputs, [gather @ m for m in source.matrices])
                    gathered[side].append(LinearNode(reg, inputs, matrices, bias, int(np.prod(shape)), label))
                reg += 1
        for j, shape in enumerate(self.tile_shapes):
            circuit.sizes[reg], circuit.shapes[reg] = int(np.prod(shape)), shape
            first, second = gathered[self.first_side][j], gathered["b" if self.first_side == "a" else "a"][j]
            inserted += [first, second]
            products.append(MulNode(reg, first.out, second.out, int(np.prod(shape)),
                                    f"{node.label} (products, {self.algorithm} {j + 1}/{len(self.tiles)})"))
            inserted.append(products[-1])
            reg += 1
        position = next(i for i, n in enumerate(self.nodes) if n is node)
        nodes = self.nodes[:position] + inserted + self.nodes[position + 1:]
        for later in nodes[position + len(inserted):]:
            if isinstance(later, LinearNode) and node.out in later.inputs and self.compose_sums.get(id(later)):
                at = later.inputs.index(node.out)
                matrix = later.matrices[at]
                del later.inputs[at], later.matrices[at]
                inputs, matrices = _nonzero_terms([p.out for p in products], [matrix @ s for s in self.sums])
                later.inputs += inputs
                later.matrices += matrices
        if self.materialise_sum:
            nodes.insert(position + len(inserted), LinearNode(node.out, [p.out for p in products], list(self.sums),
                                                              None, node.size, f"{node.label} (sums)"))
        else:
            del circuit.sizes[node.out], circuit.shapes[node.out]
        return nodes, reg

    def summary(self) -> dict:
        return {"algorithm": self.algorithm, "registers": len(self.tiles),
                "register_shape": list(self.tile_shapes[0]), "products": len(self.tiles),
                "composed": {"lhs": self.composed["a"], "rhs": self.composed["b"],
                             "sums": not self.materialise_sum or all(self.compose_sums.values())},
                "estimated_cost": round(float(self.cost), 1)}
