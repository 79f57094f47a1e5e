"""Pass ``spend_levels`` (single layout, ``spend_levels``): compute depthwise convolutions on their own, a level
each, when the ring has levels to spare and that is clearly cheaper (``spend.py``).

Reads ``proto``, ``circuit``, ``ranges``, ``ring`` and the options; writes ``circuit``, ``ranges``,
``spend_info``, ``ring`` and ``min_scale_bits``. The ring stays the one the budget was computed for, so
spending never moves a program to a larger ring; a factored circuit whose registers need more headroom than
that ring has left is dropped.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from polyfhe.exporters.ckks.matmul import expand_matmuls
from polyfhe.exporters.ckks.passes import Pass
from polyfhe.exporters.ckks.passes.ranges import calibration_ranges
from polyfhe.exporters.ckks.spend import MIN_SPEND_SCALE_BITS, LevelSpend, spend_budget, spend_levels
from polyfhe.exporters.ckks.state import CompileState
from polyfhe.program.params import ParameterError, choose_params

__all__ = ["PASS"]

log = logging.getLogger(__name__)


def _ring_and_budget(state: CompileState, slots_needed: int) -> tuple[int, int] | None:
    """The ring the merged circuit gets and its level budget; None when no ring fits (refused later)."""
    circuit, options, max_abs = state.circuit, state.options, state.ranges.max_abs
    if options.params is not None:
        return options.params.poly_modulus_degree, options.params.levels
    try:
        ring = choose_params(circuit.depth, slots_needed, max_abs, scale_bits=options.scale_bits,
                             poly_modulus_degree=state.ring, reserve_bits=state.reserve_bits).poly_modulus_degree
    except ParameterError:
        return None
    return ring, spend_budget(circuit.depth, ring, max_abs, state.reserve_bits, options.scale_bits)


def run(state: CompileState) -> None:
    if not (state.single and state.options.spend_levels):
        return
    circuit, options = state.circuit, state.options
    slots_needed = circuit.max_size()
    chosen = _ring_and_budget(state, slots_needed)
    if chosen is None:
        return
    ring, budget = chosen
    state.ring = ring
    decision = spend_levels(state.proto, circuit, budget, options.term_memory)
    if not decision.factored:
        state.spend_info = decision.to_info()
        return
    decision = replace(decision, circuit=expand_matmuls(  # re-lowered: MatMuls again
        decision.circuit, ring // 2, max_registers=state.engine.matmul_registers, engine=options.backend))
    factored = calibration_ranges(decision.circuit, options.calibration)
    if options.params is None:
        try:
            choose_params(decision.circuit.depth, slots_needed, factored.max_abs, scale_bits=options.scale_bits,
                          min_scale_bits=MIN_SPEND_SCALE_BITS, poly_modulus_degree=ring,
                          reserve_bits=state.reserve_bits)
        except ParameterError:
            log.info("the factored circuit's %d levels do not fit N=%d at its value ranges: kept merged",
                     decision.circuit.depth, ring)
            state.spend_info = LevelSpend(circuit, circuit.depth, budget).to_info()
            return
    state.circuit, state.ranges, state.spend_info = decision.circuit, factored, decision.to_info()
    state.min_scale_bits = MIN_SPEND_SCALE_BITS


PASS = Pass("spend_levels", run, ("circuit", "ranges", "spend_info", "ring", "min_scale_bits"))
