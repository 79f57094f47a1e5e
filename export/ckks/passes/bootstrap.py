"""Pass ``bootstrap``: bootstrap steps at the plan's cheapest cuts, each scaled by its register's range.

Reads ``plan``, ``circuit``, ``params``, ``boot_spec``, ``ranges`` and the options' ``calibration`` (plain runs
of a few samples set each bootstrap's input range); writes ``plan`` and ``boot_info``. The cuts and the slots each
bootstrap refreshes are chosen together, priced by the cost model's bootstrap price. Nothing to do without a
``boot_spec``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace

from polyfhe.exporters.ckks.bootstrap import (
    BootstrapError,
    calibrated_ranges,
    insert_bootstraps,
    place_sized_bootstraps,
    refresh_slots,
    register_periods,
)
from polyfhe.exporters.ckks.pack import PackRules, by_level, mask_producers, retarget_step
from polyfhe.exporters.ckks.passes import Pass
from polyfhe.exporters.ckks.passes.ranges import calibration_samples
from polyfhe.exporters.ckks.state import CKKSExportError, CompileState
from polyfhe.program.ckks_program import CKKSProgram
from polyfhe.program.engine_api import BootstrapModel
from polyfhe.program.manifest import ProgramManifest

__all__ = ["BOOTSTRAP_CALIBRATION_SAMPLES", "PASS", "bootstrap_price", "program_manifest"]

log = logging.getLogger(__name__)

BOOTSTRAP_CALIBRATION_SAMPLES = 32  # plain runs that set the bootstraps' input ranges


def bootstrap_price(model: BootstrapModel, slots: int, logn: int) -> float:
    """What one bootstrap of ``slots`` real slots costs on ring ``2^logn``, in key switches (the engine's price,
    as the cost model reads it; only its ratio between widths matters to the placement)."""
    return model.key_switches(int(math.log2(slots)), logn)


def program_manifest(state: CompileState, layout: str, input_range: tuple, info: dict) -> ProgramManifest:
    """The manifest of ``state.plan`` on ``state.params``."""
    plan, circuit = state.plan, state.circuit
    return ProgramManifest(
        layout=layout, params=state.params, input_shape=tuple(circuit.input_shape), input_size=circuit.input_size,
        output_size=circuit.output_size, output=circuit.output, steps=tuple(plan.steps),
        galois_steps=tuple(plan.galois_steps), input_range=input_range, info=info,
        input_slots=plan.input_slots, output_slots=plan.output_slots,
        samples_per_ciphertext=int(plan.stats.get("samples_per_ciphertext", 1)),
        input_gather=() if circuit.input_gather is None or layout != "single"
        else tuple(int(i) for i in circuit.input_gather),
    )


def _insert(state: CompileState) -> None:
    plan, circuit, params, max_abs = state.plan, state.circuit, state.params, state.ranges.max_abs
    model = state.bootstrapping
    lanes = int(plan.stats.get("samples_per_ciphertext", 1))
    input_period = int(plan.stats.get("input_period", params.slots // lanes))
    sizes = {name: len(arr) for name, arr in plan.arrays.items()}
    virtual = params.slots // lanes
    periods = register_periods(plan.steps, input_period)
    rules = PackRules(plan.steps, circuit.output, virtual)
    packs = None
    if state.options.pack_bootstraps:
        def packs(cut: int, regs: tuple[int, ...], width: int) -> bool:
            return rules.packable(cut, regs, width // lanes, periods)
    placed = place_sized_bootstraps(plan.steps, circuit.output, circuit.depth, params.levels, sizes=sizes,
                                    input_period=input_period, lanes=lanes, max_slots=params.slots,
                                    price=lambda width: bootstrap_price(model, width, state.boot_spec.logn),
                                    packs=packs)
    width = refresh_slots(plan.steps, placed, input_period, lanes, params.slots)
    spec = replace(state.boot_spec, log_slots=int(math.log2(width)))
    refreshed = {r for regs in placed.refreshed for r in regs}
    samples = calibration_samples(circuit, state.options.calibration)
    if samples is None:
        log.warning("bootstrapping without calibration samples: every refreshed value is assumed within "
                    "+-%.3g; pass calibration=X for ranges fitted to the model", max_abs)
        ranges = {r: (-max_abs, max_abs) for r in refreshed}
    else:
        manifest = program_manifest(state, "single", (0.0, 1.0), dict(plan.stats))
        ranges = calibrated_ranges(CKKSProgram.create(manifest, plan.arrays),
                                   samples[:BOOTSTRAP_CALIBRATION_SAMPLES], refreshed, width)
    groups = {cut: (regs, max(periods[r] for r in regs))
              for i, (cut, regs) in enumerate(zip(placed.cuts, placed.refreshed, strict=True)) if placed.is_packed(i)}
    ordered = by_level(plan.steps) if groups else plan.steps  # a packed cut's registers before its readers
    steps, arrays = mask_producers(ordered, plan.arrays, rules, list(groups.values()), periods)
    steps, _ = insert_bootstraps(steps, placed, ranges, width, {cut: block for cut, (_, block) in groups.items()},
                                 lambda step, where: retarget_step(step, where, arrays, virtual))
    used = {name for step in steps for name in step.array_names()}
    replaced = {name for step in plan.steps for name in step.array_names()} - used  # masked or retargeted away
    arrays = {name: arr for name, arr in arrays.items() if name not in replaced}
    # the real log QP (every Q and P prime as the engine generates them), not the planned bit sizes chains are made with
    state.boot_info = {
        **placed.to_info(), "spec": spec.to_dict(), "slots": width,
        "modulus_bits": round(model.security(params, spec).log_qp, 3),
        "planned_modulus_bits": model.modulus_bits(params, spec), "key_bytes": model.key_bytes(params, spec)}
    log.info("bootstrapping: %d bootstrap(s) of %d slots after levels %s (%d levels needed, %d per segment; "
             "%d cut(s) packed)", placed.count, width, list(placed.cuts), circuit.depth, params.levels, len(groups))
    stats = dict(plan.stats)
    if groups:  # the masked and retargeted maps hold other diagonals than the plan counted
        stats["plaintext_diagonals"] = int(sum(len(arrays[t.diagonals.ks]) for s in steps for t in s.terms))
    state.plan = replace(plan, steps=steps, arrays=arrays, stats=stats)


def run(state: CompileState) -> None:
    if state.boot_spec is None:
        return
    try:
        _insert(state)
    except BootstrapError as exc:
        raise CKKSExportError(f"{state.name}: {exc}") from exc


PASS = Pass("bootstrap", run, ("plan", "boot_info"))
