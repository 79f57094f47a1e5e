"""ct x ct MatMul for the single layout, rewritten into the primitives every engine already runs.

Each MatMul becomes gathers, elementwise products and sums over registers that one of several algorithms lays
out (``algorithms.py``: broadcast, tiled, or the diagonal "offsets" orderings), chosen per MatMul by the
planner's cost model (``rewrite.py`` prices each: plaintext diagonals and key switches of its maps, a key
switch per product, and a level when a map cannot be composed with its neighbour). Where a linear-attention
chain allows it, ``(Q K^T) V`` is first reassociated into ``Q (K^T V)`` (``associate.py``) if that is cheaper.
What was chosen is kept on the circuit (``Circuit.matmuls``) and written to the manifest (``info.matmuls``).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from functools import lru_cache

from polyfhe.exporters.ckks.affine import LoweringError
from polyfhe.exporters.ckks.circuit import Circuit, LinearNode, MatMulNode, MulNode, node_reads
from polyfhe.exporters.ckks.cost import ROTATION_COST, circuit_cost, map_cost
from polyfhe.exporters.ckks.layout import choose_layouts, diagonal_count, period_of, pow2_at_least
from polyfhe.exporters.ckks.matmul.algorithms import ALGORITHMS, algorithm_names, tiles_for
from polyfhe.exporters.ckks.matmul.associate import reassociate
from polyfhe.exporters.ckks.matmul.rewrite import Expansion
from polyfhe.exporters.ckks.matmul.space import MatMulShape, matmul_index_maps
from polyfhe.program.params import RING_SIZES, CKKSParams, ParameterError, choose_params

__all__ = ["ALGORITHMS", "algorithm_names", "expand_matmuls", "matmul_index_maps", "slots_available"]

log = logging.getLogger(__name__)
LOOKAHEAD = 2  # a MatMul feeding another is tried with this many of its cheapest algorithms
PREFERRED_RING = 16384
PREFERRED_SLOTS = 8192  # N=16384: the ring most single-layout programs get; larger registers force N=32768


def slots_available(params: CKKSParams | None, poly_modulus_degree: int | None, bootstrap_ring: int | None) -> int:
    """The most slots the program may get: the caller's ring, else the largest leveled one, or the engine's
    bootstrapping ring (``bootstrap_ring``, where the program may bootstrap)."""
    if params is not None:
        return int(params.slots)
    return (poly_modulus_degree or (bootstrap_ring if bootstrap_ring else max(RING_SIZES))) // 2


def register_slots(circuit: Circuit, slots: int) -> int:
    """Slots a MatMul's registers may fill: no more than the widest other register needs (padded) or N=16384
    gives, so that the MatMuls do not push the program onto a larger ring by themselves."""
    matmul_outs = {n.out for n in circuit.nodes if isinstance(n, MatMulNode)}
    widest = max((pow2_at_least(size) for reg, size in circuit.sizes.items() if reg not in matmul_outs), default=1)
    return min(slots, max(PREFERRED_SLOTS, widest))


def _refusal(node: MatMulNode, slots: int) -> LoweringError:
    shape = MatMulShape.of(node.a_shape, node.b_shape, node.out_shape)
    smallest = min(pow2_at_least(d) for d in (shape.m, shape.n, shape.k))
    return LoweringError(
        f"{node.label}: no single-layout algorithm fits a ct x ct MatMul of {shape.describe()} (batch x M x N x K) "
        f"in {slots} slots: every algorithm needs a register of at least {smallest} slots (one row of its smallest "
        f"axis, padded), so it fits from {smallest} slots (a ring of N={2 * smallest}) up; or use layout='batch'")


def _candidates(circuit: Circuit, nodes: list, node: MatMulNode, slots: int, first_reg: int,
                only: str | None) -> list[Expansion]:
    shape = MatMulShape.of(node.a_shape, node.b_shape, node.out_shape)
    found, seen = [], set()
    for name in ([only] if only else algorithm_names()):
        tiles = tiles_for(ALGORITHMS[name], shape, slots)
        if tiles is None:
            continue
        key = tuple((t.rows, t.cols, t.a_index.tobytes(), t.b_index.tobytes()) for t in tiles)
        if key in seen:  # "tiles" in one register is "replicate"
            continue
        seen.add(key)
        found.append(Expansion(circuit, nodes, node, tiles, name, first_reg))
    return found


def expand_matmuls(circuit: Circuit, slots: int, algorithm: str | None = None, reassociate_chains: bool = True,
                   max_registers: int | None = None, engine: str = "") -> Circuit:
    """A copy of ``circuit`` with every :class:`MatMulNode` rewritten into gathers, products and sums.

    ``slots``: the most slots a register may take (the ring's); the registers are sized to what the rest of the
    circuit needs (:func:`register_slots`). ``max_registers``: the most registers one MatMul may use (the
    engine's limit; ``engine`` names it in the refusal). ``algorithm``: force one (a name of :data:`ALGORITHMS`; tests and
    benchmarks), else the cheapest by the cost model. The circuit computes the same function exactly (0/1 maps);
    :class:`LoweringError` when no algorithm fits ``slots``.
    """
    if algorithm is not None and algorithm not in ALGORITHMS:
        raise ValueError(f"unknown MatMul algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}")
    if not any(isinstance(n, MatMulNode) for n in circuit.nodes):
        return circuit
    target = register_slots(circuit, slots)
    wider = 2 * target
    if ring_for(circuit.depth) >= 2 * wider and wider <= slots:
        target, wider = wider, 0  # deep enough for the larger ring before any MatMul is expanded: its slots
    limit = (max_registers, engine)
    out = _expand(circuit, target, algorithm, reassociate_chains, limit)
    if wider and ring_for(out.depth) >= 2 * wider and wider <= slots:
        # the plan needs the larger ring anyway: registers as wide as its slots halve the products and gathers
        widened = _expand(circuit, wider, algorithm, reassociate_chains, limit)
        if planned_cost(widened, widened.nodes, wider) < planned_cost(out, out.nodes, target):
            log.info("registers of %d slots: the plan needs N=%d anyway", wider, ring_for(out.depth))
            out = widened
    log.info("%d ct x ct MatMul(s) expanded: largest register %d values, depth %d -> %d",
             len(out.matmuls), out.max_size(), circuit.depth, out.depth)
    return out


def _expand(circuit: Circuit, target: int, algorithm: str | None, reassociate_chains: bool,
            limit: tuple[int | None, str] = (None, "")) -> Circuit:
    """One expansion with registers of at most ``target`` slots (on a copy of ``circuit``)."""
    out = replace(circuit, nodes=[replace(n, inputs=list(n.inputs), matrices=list(n.matrices))
                                  if isinstance(n, LinearNode) else n for n in circuit.nodes],
                  sizes=dict(circuit.sizes), shapes=dict(circuit.shapes), matmuls=[])
    if reassociate_chains:
        out = reassociate(out)
    level_cost = circuit_cost(out) / max(1, out.depth)
    nodes, next_reg = list(out.nodes), max(out.sizes) + 1
    operands: set[int] = set()
    for node in [n for n in out.nodes if isinstance(n, MatMulNode)]:
        options = _candidates(out, nodes, node, target, next_reg, algorithm)
        most, engine = limit
        if most is not None:
            fitting = [e for e in options if len(e.tiles) <= most]
            if options and not fitting:
                shape = MatMulShape.of(node.a_shape, node.b_shape, node.out_shape)
                raise LoweringError(
                    f"{node.label}: a ct x ct MatMul of {shape.describe()} (batch x M x N x K) needs "
                    f"{min(len(e.tiles) for e in options)} registers of {target} slots; engine {engine!r} runs it in "
                    f"at most {most} (it fits when batch x M x N x K <= {target * most}); use backend='seal', "
                    "fewer tokens or heads, or layout='batch'")
            options = fitting
        if not options and algorithm is not None:
            raise LoweringError(f"{node.label}: algorithm {algorithm!r} does not apply to a MatMul of "
                                f"{MatMulShape.of(node.a_shape, node.b_shape, node.out_shape).describe()} in "
                                f"registers of {target} slots; leave the choice to the cost model")
        if not options:
            raise _refusal(node, target)
        best = _best(out, nodes, node, options, target, level_cost, algorithm)
        operands |= {node.a, node.b}
        nodes, next_reg = best.apply()
        shape = MatMulShape.of(node.a_shape, node.b_shape, node.out_shape)
        out.matmuls.append({"label": node.label, "shape": shape.describe(), **best.summary(),
                            "candidates": {e.algorithm: round(float(_total(e, level_cost)), 1) for e in options}})
        log.info("%s (%s): %s, %d register(s) of %s", node.label, shape.describe(), best.algorithm,
                 len(best.tiles), "x".join(map(str, best.tile_shapes[0])))
    out.nodes = _drop_unread(out, nodes, operands)
    return out


def _total(expansion: Expansion, level_cost: float) -> float:
    return expansion.cost + level_cost * expansion.extra_levels


def _next_matmul(nodes: list, node: MatMulNode) -> MatMulNode | None:
    """The MatMul that is the only reader of ``node``'s result, if one is."""
    readers = [n for n in nodes if node.out in node_reads(n)]
    return readers[0] if len(readers) == 1 and isinstance(readers[0], MatMulNode) else None


def _scratch(nodes: list) -> list:
    return [replace(n, inputs=list(n.inputs), matrices=list(n.matrices)) if isinstance(n, LinearNode) else n
            for n in nodes]


def _live(circuit: Circuit, nodes: list) -> list:
    """``nodes`` without the maps nothing reads any more (what :func:`_drop_unread` will remove)."""
    needed, kept = {circuit.output}, []
    for node in reversed(nodes):
        if node.out in needed:
            kept.append(node)
            needed |= set(node_reads(node))
    return kept[::-1]


def planned_cost(circuit: Circuit, nodes: list, slots: int) -> float:
    """What the planner will make of ``nodes``: its own layouts (``choose_layouts``), every map's diagonals and
    BSGS key switches, a key switch per product, all times the primes of the chain (depth + 2)."""
    live = _live(circuit, nodes)
    trial = replace(circuit, nodes=live)
    layouts = choose_layouts(trial, slots)
    total = 0.0
    for node in live:
        if isinstance(node, LinearNode):
            total += map_cost(sum(diagonal_count(m, layouts[node.out], layouts[r], period_of(layouts[r]))
                                  for r, m in zip(node.inputs, node.matrices, strict=True)))
        elif isinstance(node, MulNode):
            total += ROTATION_COST
    return total * (trial.depth + 2) * ring_for(trial.depth) / PREFERRED_RING


@lru_cache(maxsize=64)
def ring_for(depth: int) -> int:
    """The ring a leveled program of this depth gets (values near 1, the smallest scale): a deeper plan that
    crosses into N=32768 doubles every operation's size, which the primes alone do not say."""
    for ring in RING_SIZES:
        try:
            choose_params(depth, 1, 1.0, poly_modulus_degree=ring)
            return ring
        except ParameterError:
            continue
    return 2 * max(RING_SIZES)


def _trial(circuit: Circuit, nodes: list, option: Expansion) -> tuple[list, int, dict, dict]:
    """``option`` applied to a copy of ``nodes``; the circuit's sizes and shapes as they were before."""
    sizes, shapes = dict(circuit.sizes), dict(circuit.shapes)
    scratch = _scratch(nodes)
    trial = replace(option, nodes=scratch)
    trial_nodes, next_reg = trial.apply()
    return trial_nodes, next_reg, sizes, shapes


def _best(circuit: Circuit, nodes: list, node: MatMulNode, options: list[Expansion], slots: int,
          level_cost: float, only: str | None) -> Expansion:
    """The option whose circuit the planner will make cheapest (:func:`planned_cost`), among the best few by the
    quick estimate. For a MatMul read only by another (``K^T V`` then ``Q (K^T V)``) each option is tried with
    the follower's best few: its gathers may compose with the first's sums (a token sum broadcast straight into
    its rows), which the first's estimate alone cannot see."""
    if len(options) == 1:
        return options[0]
    follower = _next_matmul(nodes, node)
    shortlist = sorted(options, key=lambda e: _total(e, level_cost) - e.sum_cost)[:LOOKAHEAD]
    shortlist += [e for e in sorted(options, key=lambda e: _total(e, level_cost))[:LOOKAHEAD]
                  if all(e is not s for s in shortlist)]
    best, best_cost = shortlist[0], None
    for option in shortlist:
        trial_nodes, trial_reg, sizes, shapes = _trial(circuit, nodes, option)
        costs = []
        if follower is not None:
            seconds = sorted(_candidates(circuit, trial_nodes, follower, slots, trial_reg, only),
                             key=lambda e: _total(e, level_cost))[:LOOKAHEAD]
            for second in seconds:
                second_nodes, _, inner_sizes, inner_shapes = _trial(circuit, trial_nodes, second)
                costs.append(planned_cost(circuit, second_nodes, slots))
                circuit.sizes, circuit.shapes = inner_sizes, inner_shapes
        if not costs:
            costs.append(planned_cost(circuit, trial_nodes, slots))
        circuit.sizes, circuit.shapes = sizes, shapes
        cost = min(costs)
        log.debug("%s: %s plans at %.0f", node.label, option.algorithm, cost)
        if best_cost is None or cost < best_cost:
            best, best_cost = option, cost
    return best


def _drop_unread(circuit: Circuit, nodes: list, candidates: set[int]) -> list:
    """Remove the operand maps whose only reader was a MatMul (they live on, composed, in its gathers)."""
    while True:
        read = {r for n in nodes for r in node_reads(n)}
        dead = {r for r in candidates if r not in read and r != circuit.output} & {n.out for n in nodes}
        if not dead:
            return nodes
        nodes = [n for n in nodes if n.out not in dead]
        for r in dead:
            del circuit.sizes[r], circuit.shapes[r]
        candidates -= dead
