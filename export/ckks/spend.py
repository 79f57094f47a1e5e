"""Spending levels: compute depthwise convolutions on their own when the ring has levels to spare.

The lowering merges every linear map between two ct x ct products, which lands each map at the lowest level
(the analyzer's bound) but multiplies the diagonals of a channel map by the taps of every spatial (depthwise)
convolution merged into it: CPolyNeXt's 3x3 consolidation conv turns a 128-diagonal channel map into 1,152.
Computed on its own, such a convolution costs a diagonal per tap and one level. Levels are a budget: the ring
the program runs at offers more of them at a smaller scale, and each level makes every operation a little
dearer (one more prime). This pass lowers the graph a second time with the factoring sites as registers of
their own and keeps that circuit when it fits the ring's level budget and its estimated cost, levels
included, is clearly lower. Precision is the price: every 4 bits of scale cost about 16x the logit error
(measured on cpolynext_fhe_bn at 8x8: 1.9e-4 at 2^31, 3.7e-3 at 2^27), so the scale never drops below
``MIN_SPEND_SCALE_BITS`` and a spend must save at least ``MIN_SAVING``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import onnx

from polyfhe.exporters.ckks.circuit import Circuit
from polyfhe.exporters.ckks.cost import circuit_cost
from polyfhe.exporters.ckks.lower import factoring_sites, lower_onnx
from polyfhe.exporters.ckks.replicate import replicate_input
from polyfhe.program.params import max_levels

__all__ = ["MIN_SAVING", "MIN_SPEND_SCALE_BITS", "LevelSpend", "spend_budget", "spend_levels"]

log = logging.getLogger(__name__)

MIN_SPEND_SCALE_BITS = 27  # the smallest scale levels may be bought with (logit error ~4e-3 on logits ~16)
MIN_SAVING = 0.25  # spend levels only for at least this fraction of the estimated cost


@dataclass(frozen=True)
class LevelSpend:
    """What the pass decided, for the manifest and the log."""

    circuit: Circuit
    lower_bound: int  # levels of the merged circuit (the analyzer's bound)
    budget: int  # levels the ring offers at the smallest scale allowed for spending
    factored: tuple[str, ...] = ()  # convolutions computed as registers of their own
    estimated_cost: dict[str, float] = field(default_factory=dict)  # "merged" / "factored"

    def to_info(self) -> dict:
        return {"lower_bound": self.lower_bound, "budget": self.budget, "spent": self.circuit.depth - self.lower_bound,
                "factored": list(self.factored), "estimated_cost": self.estimated_cost}


def spend_levels(proto: onnx.ModelProto, merged: Circuit, budget: int, memory_limit: int | None = None) -> LevelSpend:
    """The merged circuit, or the one with its depthwise convolutions factored out when that is cheaper.

    ``budget``: the most levels the program may use (the ring's, at the smallest scale allowed);
    ``memory_limit``: the lowering's term bytes (see :func:`lower_onnx`).
    """
    keep = LevelSpend(merged, merged.depth, budget)
    sites = factoring_sites(proto)
    if not sites or budget <= merged.depth:
        return keep
    factored = lower_onnx(proto, frozenset(sites), memory_limit)
    if merged.input_gather is not None:  # the input packed as the merged circuit's is
        factored = replicate_input(factored)
    if factored.depth > budget:
        log.info("factoring %d depthwise convolutions needs %d levels; the ring offers %d: kept merged",
                 len(sites), factored.depth, budget)
        return keep
    if factored.depth == merged.depth:
        return keep  # nothing was factored (every site was a product operand already)
    # each level adds a prime to every ciphertext and key: weigh the costs by the primes of each chain
    cost_merged = circuit_cost(merged) * (merged.depth + 2)
    cost_factored = circuit_cost(factored) * (factored.depth + 2)
    costs = {"merged": round(cost_merged), "factored": round(cost_factored)}
    if cost_factored > (1.0 - MIN_SAVING) * cost_merged:
        log.info("factoring depthwise convolutions would save too little (%s): kept merged", costs)
        return LevelSpend(merged, merged.depth, budget, (), costs)
    log.info("spending %d levels on %d factored depthwise convolutions: estimated cost %s",
             factored.depth - merged.depth, len(sites), costs)
    return LevelSpend(factored, merged.depth, budget, tuple(sites), costs)


def spend_budget(levels_needed: int, ring: int, max_abs: float, reserve_bits: int, scale_bits: int | None) -> int:
    """Levels the program may use on ``ring``: at the scale asked for, else at the smallest allowed one."""
    scale = scale_bits or MIN_SPEND_SCALE_BITS
    return max(levels_needed, max_levels(ring, max_abs, scale, reserve_bits))
