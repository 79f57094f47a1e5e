"""CKKS exporter: nn.Module or polynomial ONNX -> :class:`~polyfhe.runtime.program.CKKSProgram`.

Pipeline: fold + ONNX export (modules only) -> analyzer (refuses non-polynomial graphs, naming the nodes) ->
lowering to a :class:`Circuit` of merged affine maps and products -> calibrated value ranges -> parameters
(smallest secure ring and largest scale that fit the levels; past every leveled ring, a residual chain with
bootstraps on engines that have them) -> per-layout plan -> bootstrap placement -> program (manifest + arrays).
"""

from __future__ import annotations

import logging
import math
import tempfile
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from polyfhe.exporters.ckks.affine import LoweringError
from polyfhe.exporters.ckks.bootstrap import (
    BootstrapError,
    calibrated_ranges,
    insert_bootstraps,
    place_bootstraps,
    refresh_slots,
)
from polyfhe.exporters.ckks.circuit import Circuit
from polyfhe.exporters.ckks.counters import plan_counters
from polyfhe.exporters.ckks.lower import factoring_sites, lower_onnx, shift_sites
from polyfhe.exporters.ckks.matmul import expand_matmuls, slots_available
from polyfhe.exporters.ckks.plan import max_samples_per_ciphertext, plan_batch, plan_single
from polyfhe.exporters.ckks.replicate import replicate_input as replicated
from polyfhe.exporters.ckks.spend import MIN_SPEND_SCALE_BITS, LevelSpend, spend_budget, spend_levels
from polyfhe.program.bootparams import (
    BOOTSTRAP_RING,
    BootstrapSpec,
    bootstrap_key_bytes,
    bootstrap_modulus_bits,
    check_bootstrap_security,
    choose_bootstrap_params,
    default_spec,
    machine_memory_budget,
    max_refresh_log_slots,
    server_peak_bytes,
)
from polyfhe.program.engines import DEFAULT_BACKEND, BackendUnavailable, KeySetTooLarge, get_backend
from polyfhe.program.manifest import LAYOUTS, ProgramManifest
from polyfhe.program.params import (
    DEFAULT_MIN_SCALE_BITS,
    CKKSParams,
    ParameterError,
    choose_params,
    estimated_sizes,
    largest_value,
    validate,
)
from polyfhe.runtime.program import CKKSProgram

__all__ = ["CKKSExportError", "LoweringError", "export_ckks", "to_onnx_model"]

log = logging.getLogger(__name__)

BATCH_MEMORY_BUDGET = 8 << 30  # bytes of live ciphertexts the batch layout may plan for
# At this scale and above, giant-step sums are rescaled before their rotation: cheaper key switches, and the
# key-switching noise they then add at the working scale stays far below the error budget (at 2^31 it does not:
# 2.6e-3 against 8e-5 on cpolynext_fhe_bn at 8x8)
RESCALE_GIANTS_MIN_SCALE_BITS = 35
# Lattigo's primes lie up to a few millionths of a bit above 2^bits, so the 128-bit bound is kept with a bit to spare
ENGINE_RESERVE_BITS = {"lattigo": 1}
GALOIS_KEY_BUDGET = 3 << 30  # bytes of Galois keys in a public context (beyond it, rotations are chains of keys)


def galois_key_bytes(params: CKKSParams) -> int:
    """Serialized size of one Galois key (measured: ~21.5 MB at N=16384 with 11 primes, zstd)."""
    primes = len(params.coeff_mod_bits)
    return int(2 * params.poly_modulus_degree * 8 * (primes - 1) * primes * 0.75)


class CKKSExportError(ValueError):
    """The model cannot become a CKKS program (not polynomial, unsupported op, no parameters fit)."""


def to_onnx_model(model: Any, input_shape: tuple[int, ...] | None = None) -> tuple[onnx.ModelProto, str]:
    """An ONNX ModelProto for a module (folded and exported), a path, bytes or a ModelProto; plus a name."""
    from torch import nn

    from polyfhe.analysis.loader import load_model

    if isinstance(model, nn.Module):
        from polyfhe.exporters.onnx import export_onnx

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "model.onnx"
            export_onnx(model, path, input_shape, require_polynomial=False)  # refused below, by name
            return onnx.load(str(path)), getattr(model, "model_name", type(model).__name__)
    name = Path(model).stem if isinstance(model, (str, Path)) else "onnx"
    return load_model(model), name


def _calibration_ranges(circuit: Circuit, calibration: Any) -> tuple[float, tuple[float, float], dict]:
    """(max |value| over all registers, input range, info) from an array of samples or a CalibrationResult."""
    if calibration is None:
        log.warning("no calibration data: assuming inputs in [0, 1] and values below 2^12; pass calibration=X "
                    "(a few hundred representative inputs) for parameters fitted to the model")
        return float(2**12), (0.0, 1.0), {"calibrated": False}
    if hasattr(calibration, "node_ranges") and hasattr(calibration, "input_range"):
        rng = calibration.input_range
        max_abs = max([abs(r.abs_max) for r in calibration.node_ranges.values()] + [abs(rng.abs_max)])
        return max_abs, (float(rng.min), float(rng.max)), {"calibrated": True, "calibration": "CalibrationResult",
                                                           "samples": int(getattr(calibration, "num_samples", 0))}
    x = _calibration_samples(circuit, calibration)
    ranges = circuit.value_ranges(x)
    return max(ranges.values()), (float(x.min()), float(x.max())), {"calibrated": True, "samples": len(x),
                                                                     "max_abs_value": max(ranges.values())}


@dataclass
class _Spent:
    """The circuit ``spend.py`` settled on, its calibrated ranges, and the ring and scale floor it needs."""

    circuit: Circuit
    calibrated: tuple  # (max |value|, input range, calibration info) of ``circuit``
    info: dict | None  # what was decided, for the manifest (None: not considered)
    ring: int | None
    min_scale_bits: int = DEFAULT_MIN_SCALE_BITS


def _spend(proto: onnx.ModelProto, circuit: Circuit, calibration: Any, slots_needed: int, calibrated: tuple,
           params: CKKSParams | None, ring: int | None, scale_bits: int | None, reserve_bits: int) -> _Spent:
    """``spend.py`` on the level budget of the ring the merged circuit gets. The ring stays the one the budget
    was computed for, so spending never moves a program to a larger ring; a factored circuit whose registers
    need more headroom than that ring has left is dropped."""
    max_abs = calibrated[0]
    if params is not None:
        ring, budget = params.poly_modulus_degree, params.levels
    else:
        try:
            ring = choose_params(circuit.depth, slots_needed, max_abs, scale_bits=scale_bits,
                                 poly_modulus_degree=ring, reserve_bits=reserve_bits).poly_modulus_degree
        except ParameterError:
            return _Spent(circuit, calibrated, None, ring)  # refused by the caller, with the full explanation
        budget = spend_budget(circuit.depth, ring, max_abs, reserve_bits, scale_bits)
    decision = spend_levels(proto, circuit, budget)
    if not decision.factored:
        return _Spent(circuit, calibrated, decision.to_info(), ring)
    decision = replace(decision, circuit=expand_matmuls(decision.circuit, ring // 2))  # re-lowered: MatMuls again
    factored = _calibration_ranges(decision.circuit, calibration)
    if params is None:
        try:
            choose_params(decision.circuit.depth, slots_needed, factored[0], scale_bits=scale_bits,
                          min_scale_bits=MIN_SPEND_SCALE_BITS, poly_modulus_degree=ring, reserve_bits=reserve_bits)
        except ParameterError:
            log.info("the factored circuit's %d levels do not fit N=%d at its value ranges: kept merged",
                     decision.circuit.depth, ring)
            return _Spent(circuit, calibrated, LevelSpend(circuit, circuit.depth, budget).to_info(), ring)
    return _Spent(decision.circuit, factored, decision.to_info(), ring, MIN_SPEND_SCALE_BITS)


BOOTSTRAP_MODES = ("auto", "off")
BOOTSTRAP_CALIBRATION_SAMPLES = 32  # plain runs that set the bootstraps' input ranges


def _bootstrap_hint(engine, layout: str, mode: str) -> str:
    """What would run a circuit too deep for every leveled ring (appended to the refusal)."""
    if not engine.bootstraps or mode != "auto":
        return "; backend='lattigo' with bootstrap='auto' (single layout) runs deeper circuits by bootstrapping"
    return "" if layout == "single" else "; bootstrapping needs layout='single'"


def _manifest(plan, circuit: Circuit, params: CKKSParams, layout: str, input_range: tuple, info: dict
              ) -> ProgramManifest:
    return ProgramManifest(
        layout=layout, params=params, input_shape=tuple(circuit.input_shape), input_size=circuit.input_size,
        output_size=circuit.output_size, output=circuit.output, steps=tuple(plan.steps),
        galois_steps=tuple(plan.galois_steps), input_range=input_range, info=info,
        input_slots=plan.input_slots, output_slots=plan.output_slots,
        samples_per_ciphertext=int(plan.stats.get("samples_per_ciphertext", 1)),
        input_gather=() if circuit.input_gather is None or layout != "single"
        else tuple(int(i) for i in circuit.input_gather),
    )


def _with_bootstraps(plan, circuit: Circuit, params: CKKSParams, spec: BootstrapSpec, calibration: Any,
                     max_abs: float):
    """The plan with bootstrap steps at the cheapest cuts, each scaled by its register's calibrated range."""
    lanes = int(plan.stats.get("samples_per_ciphertext", 1))
    input_period = int(plan.stats.get("input_period", params.slots // lanes))
    sizes = {name: len(arr) for name, arr in plan.arrays.items()}
    placed = place_bootstraps(plan.steps, circuit.output, circuit.depth, params.levels, sizes)
    width = refresh_slots(plan.steps, placed, input_period, lanes, params.slots)
    spec = replace(spec, log_slots=int(math.log2(width)))
    refreshed = {r for regs in placed.refreshed for r in regs}
    samples = _calibration_samples(circuit, calibration)
    if samples is None:
        log.warning("bootstrapping without calibration samples: every refreshed value is assumed within "
                    "+-%.3g; pass calibration=X for ranges fitted to the model", max_abs)
        ranges = {r: (-max_abs, max_abs) for r in refreshed}
    else:
        manifest = _manifest(plan, circuit, params, "single", (0.0, 1.0), dict(plan.stats))
        ranges = calibrated_ranges(CKKSProgram.create(manifest, plan.arrays),
                                   samples[:BOOTSTRAP_CALIBRATION_SAMPLES], refreshed, width)
    steps, _ = insert_bootstraps(plan.steps, placed, ranges, width)
    # the real log QP (every Q and P prime as Lattigo generates them), not the planned bit sizes chains are made with
    info = {**placed.to_info(), "spec": spec.to_dict(), "slots": width,
            "modulus_bits": round(check_bootstrap_security(params, spec).log_qp, 3),
            "planned_modulus_bits": bootstrap_modulus_bits(params, spec), "key_bytes": bootstrap_key_bytes(params, spec)}
    log.info("bootstrapping: %d bootstrap(s) of %d slots after levels %s (%d levels needed, %d per segment)",
             placed.count, width, list(placed.cuts), circuit.depth, params.levels)
    return replace(plan, steps=steps), info


def _server_peak(planned: dict, boot_info: dict, galois_bytes: int) -> dict:
    """A bootstrapping Lattigo server's predicted resident bytes, and what makes them up (for the manifest)."""
    plaintexts, keys = int(planned.get("plaintext_bytes", 0)), int(boot_info["key_bytes"])
    loading, serving = server_peak_bytes(plaintexts, keys, galois_bytes)
    return {"peak_bytes": max(loading, serving), "loading_bytes": loading, "serving_bytes": serving,
            "plaintext_bytes": plaintexts, "bootstrap_key_bytes": keys, "galois_key_bytes": galois_bytes}


def _server_memory_error(name: str, planned: dict, boot_info: dict, peak: dict, budget: int, tried: str,
                         params: CKKSParams) -> str:
    """Why a bootstrapped program's server would not fit ``budget``: the numbers, and what would."""
    return (
        f"{name}: its server would peak near {peak['peak_bytes'] / 1e9:.1f} GB ({peak['plaintext_bytes'] / 1e9:.1f} "
        f"GB of plaintexts for {planned.get('plain_products', '?')} diagonals, "
        f"{peak['bootstrap_key_bytes'] / 1e9:.1f} GB of bootstrapping keys for {boot_info['count']} bootstraps of "
        f"{boot_info['slots']} slots, {peak['galois_key_bytes'] / 1e9:.1f} GB of Galois keys; "
        f"{peak['loading_bytes'] / 1e9:.1f} GB while loading the keys, {peak['serving_bytes'] / 1e9:.1f} GB "
        f"serving){tried}, over the {budget / 1e9:.1f} GB memory budget. What would fit: a narrower model (fewer "
        "channels: fewer diagonals and fewer slots per bootstrap), or a machine with more memory "
        f"(bootstrap_memory= / --bootstrap-memory to plan for it){_bootstrap_time(boot_info, params)}")


def _bootstrap_time(boot_info: dict, params: CKKSParams) -> str:
    """What the bootstraps alone would take per query, from this machine's cached Lattigo calibration (never
    calibrated here: a refusal should be quick); without one, where to get the prediction."""
    from polyfhe.runtime.bootcost import bootstrap_seconds
    from polyfhe.runtime.opcosts import read_cached

    costs = read_cached("lattigo")
    if costs is None:
        return "; `polyfhe cost MODEL --backend lattigo` predicts its latency"
    seconds = boot_info["count"] * bootstrap_seconds(costs, boot_info["spec"], params)
    return f"; its {boot_info['count']} bootstraps alone would take about {seconds:.0f} s per query on this machine"


def _choose_bootstrap(depth: int, slots_needed: int, scale_bits: int | None, memory_bytes: int | None,
                      machine_default: bool) -> tuple[CKKSParams, BootstrapSpec]:
    """:func:`choose_bootstrap_params`; a refusal for memory alone also says which setting plans for a larger
    machine (the bootstrapping keys are made where the client runs, so the budget is that machine's)."""
    try:
        return choose_bootstrap_params(depth, slots_needed, scale_bits=scale_bits, memory_bytes=memory_bytes)
    except ParameterError as exc:
        if memory_bytes is None:
            raise
        try:  # would it fit without the budget? then memory is what refused it
            choose_bootstrap_params(depth, slots_needed, scale_bits=scale_bits, memory_bytes=None)
        except ParameterError:
            raise exc from None
        whose = "75% of this machine's memory (the default)" if machine_default else "the bootstrap_memory given"
        raise ParameterError(
            f"{exc}. That budget is {whose}; bootstrap_memory= (polyfhe export --bootstrap-memory GB) raises it to "
            "plan for a machine with more memory, where the client must then make its keys") from exc


def _bootstrap_lanes(circuit: Circuit, params: CKKSParams, spec: BootstrapSpec, memory_bytes: int | None) -> int:
    """Samples per ciphertext for a bootstrapped program: as many as fit the slots, but no more than keep the
    (wider) bootstrap's key generation within ``memory_bytes``; more lanes refresh more slots per bootstrap."""
    try:
        most = max_samples_per_ciphertext(circuit, params.slots)
    except LoweringError as exc:
        raise CKKSExportError(str(exc)) from exc
    widest = params.slots // most
    cap = max(1, (1 << max_refresh_log_slots(params, spec, memory_bytes)) // widest)
    if cap < most:
        log.info("bootstrapping: %d sample(s) per ciphertext instead of %d, so that the bootstrapping keys "
                 "fit the memory budget", cap, most)
    return min(most, cap)


def _calibration_samples(circuit: Circuit, calibration: Any) -> np.ndarray | None:
    """Calibration samples shaped (n, *input shape), or None for no samples (or a CalibrationResult)."""
    if calibration is None or hasattr(calibration, "node_ranges"):
        return None
    x = np.asarray(calibration, dtype=np.float64)
    return x.reshape((-1, *circuit.input_shape[1:]))


def export_ckks(
    model: Any,
    *,
    calibration: Any = None,
    layout: str = "single",
    input_shape: tuple[int, ...] | None = None,
    params: CKKSParams | None = None,
    poly_modulus_degree: int | None = None,
    scale_bits: int | None = None,
    allow_insecure: bool = False,
    batch_memory_budget: int = BATCH_MEMORY_BUDGET,
    galois_key_budget: int = GALOIS_KEY_BUDGET,
    samples_per_ciphertext: int | None = None,
    backend: str = DEFAULT_BACKEND,
    spend_levels: bool = True,
    bootstrap: str = "auto",
    bootstrap_memory: int | None = None,
    replicate_input: bool = True,
    _force_bootstrap: bool = False,
    _memory_spend: dict | None = None,
) -> CKKSProgram:
    """Compile ``model`` (module or ONNX) into a CKKS program for ``layout`` ("single" or "batch").

    ``calibration``: representative inputs (array) or a CalibrationResult; sets the output headroom.
    ``params`` / ``poly_modulus_degree`` / ``scale_bits``: overrides (insecure ones need ``allow_insecure``).
    ``galois_key_budget`` (SEAL; Lattigo plans its own keys): bytes of rotation keys in the public context;
    past it, rare rotations are composed from power-of-two keys (slower, smaller upload).
    ``samples_per_ciphertext`` (single layout): interleave this many samples per ciphertext at the cost of
    one; None takes as many as the widest tensor leaves room for (1 when it needs every slot).
    ``backend``: the engine that makes the keys and runs the program ("seal" or "lattigo"; the manifest names it).
    ``spend_levels`` (single layout): compute depthwise convolutions on their own, a level each, when the ring
    has levels to spare at a scale of at least 2^27 and that is estimated clearly cheaper (``spend.py``);
    ``False`` keeps every map merged at the analyzer's level bound (the most precise plan).
    ``bootstrap`` ("auto" or "off"; single layout, engines that bootstrap: Lattigo): when the circuit needs more
    levels than a leveled ring offers (or than ``params`` holds), run it on a residual chain and place bootstraps
    where they cost least (``bootstrap.py``); ``calibration`` samples set each bootstrap's input range.
    ``bootstrap_memory``: bytes the bootstrapping key generation may peak at (None: 75% of this machine's RAM);
    cheaper residual chains whose keys would not fit are passed over, and said so in the log. A leveled ring
    the engine cannot serve (Lattigo: its Galois keys alone over a server's context limit) is given up for a
    bootstrapped residual ring when bootstrapping is allowed.
    ``replicate_input`` (single layout): let the client pack each token's input window im2col-style (pixels
    written to several slots) when that cuts the diagonals of the maps reading the input (``replicate.py``:
    overlapping strided stems); ``False`` packs every input value once.
    """
    from polyfhe.analysis import analyze

    # a second try (another ring, or sites factored) starts again from the caller's arguments
    again = partial(export_ckks, model, calibration=calibration, layout=layout, input_shape=input_shape, params=params,
                    poly_modulus_degree=poly_modulus_degree, scale_bits=scale_bits, allow_insecure=allow_insecure,
                    batch_memory_budget=batch_memory_budget, galois_key_budget=galois_key_budget,
                    samples_per_ciphertext=samples_per_ciphertext, backend=backend, spend_levels=False,
                    bootstrap=bootstrap, bootstrap_memory=bootstrap_memory, replicate_input=replicate_input,
                    _force_bootstrap=_force_bootstrap)

    if layout not in LAYOUTS:
        raise CKKSExportError(f"unknown layout {layout!r}; accepted: {list(LAYOUTS)}")
    try:
        engine = get_backend(backend)
        engine.available()
    except (ValueError, BackendUnavailable) as exc:
        raise CKKSExportError(str(exc)) from exc
    if layout not in engine.layouts:
        raise CKKSExportError(f"backend {backend!r} runs layouts {list(engine.layouts)}, not {layout!r}")
    if bootstrap not in BOOTSTRAP_MODES:
        raise CKKSExportError(f"unknown bootstrap mode {bootstrap!r}; accepted: {list(BOOTSTRAP_MODES)}")
    may_bootstrap = bootstrap == "auto" and engine.bootstraps and layout == "single"
    if input_shape is None and isinstance(calibration, np.ndarray) and calibration.ndim >= 2:
        input_shape = tuple(calibration.shape[1:])  # a module without a known input size: the samples' shape
    proto, name = to_onnx_model(model, input_shape)
    report = analyze(proto)
    if not report.polynomial:
        shown = "; ".join(f"{v.node} ({v.op}): {v.reason}" for v in report.violations[:8])
        raise CKKSExportError(f"{name} is not polynomial, so it cannot run under CKKS: {shown}")
    try:
        circuit = lower_onnx(proto, frozenset(_memory_spend["factored"]) if _memory_spend else frozenset())
        if layout == "single":  # ct x ct MatMul as replicate / multiply / sum maps
            circuit = expand_matmuls(circuit, slots_available(params, poly_modulus_degree, may_bootstrap))
            circuit = replicated(circuit) if replicate_input else circuit
    except LoweringError as exc:
        raise CKKSExportError(f"{name}: {exc}") from exc
    max_abs, input_range, cal_info = _calibration_ranges(circuit, calibration)
    slots_needed = circuit.max_size() if layout == "single" else 1
    spend_info, min_scale_bits = None, DEFAULT_MIN_SCALE_BITS
    if layout == "single" and spend_levels:
        spent = _spend(proto, circuit, calibration, slots_needed, (max_abs, input_range, cal_info), params,
                       poly_modulus_degree, scale_bits, ENGINE_RESERVE_BITS.get(backend, 0))
        circuit, (max_abs, input_range, cal_info), spend_info = spent.circuit, spent.calibrated, spent.info
        poly_modulus_degree, min_scale_bits = spent.ring, spent.min_scale_bits
    boot_spec = None
    boot_memory = machine_memory_budget() if bootstrap_memory is None else bootstrap_memory
    leveled_auto = False
    try:
        if params is None and _force_bootstrap:
            params, boot_spec = _choose_bootstrap(circuit.depth, slots_needed, scale_bits, boot_memory,
                                                  bootstrap_memory is None)
        elif params is None:
            leveled_auto = True
            try:
                params = choose_params(circuit.depth, slots_needed, max_abs, scale_bits=scale_bits,
                                       min_scale_bits=min_scale_bits, poly_modulus_degree=poly_modulus_degree,
                                       reserve_bits=ENGINE_RESERVE_BITS.get(backend, 0))
            except ParameterError as exc:
                if not may_bootstrap:
                    raise ParameterError(f"{exc}{_bootstrap_hint(engine, layout, bootstrap)}") from exc
                leveled_auto = False
                params, boot_spec = _choose_bootstrap(circuit.depth, slots_needed, scale_bits, boot_memory,
                                                      bootstrap_memory is None)
        params = validate(params, allow_insecure=allow_insecure)
    except ParameterError as exc:
        raise CKKSExportError(str(exc)) from exc
    if params.levels < circuit.depth and may_bootstrap and boot_spec is None:
        boot_spec = default_spec(params, slots_needed)  # the caller's ring as the residual chain
    if params.levels < circuit.depth and boot_spec is None:
        raise CKKSExportError(f"{name} needs {circuit.depth} levels; {params.describe()} offers {params.levels}"
                              f"{_bootstrap_hint(engine, layout, bootstrap)}")
    if params.slots < slots_needed:
        raise CKKSExportError(f"{name} needs {slots_needed} slots; {params.describe()} has {params.slots}")
    if layout == "batch":
        ct_bytes = 2 * params.poly_modulus_degree * (params.levels + 1) * 8
        live = 3 * circuit.max_size() * ct_bytes
        if live > batch_memory_budget:
            raise CKKSExportError(
                f"layout='batch' keeps one ciphertext per tensor element: about {live / 2**30:.1f} GiB live for "
                f"{circuit.max_size()} elements at {params.describe()}, over the {batch_memory_budget / 2**30:.1f} "
                "GiB budget; use layout='single' or raise batch_memory_budget")
    if boot_spec is not None and max_abs > largest_value(params, level=1):  # bootstraps read level 1 or above
        raise CKKSExportError(
            f"{name}: its values reach +-{max_abs:.3g} on the calibration inputs; {params.describe()} holds at most "
            f"+-{largest_value(params, level=1):.3g} at the lowest level a bootstrap reads. Is the model trained? "
            "Untrained deep BatchNorm networks overflow in eval mode until their running statistics settle; "
            "calibrate with real inputs, or train longer")
    if boot_spec is not None and layout == "single" and samples_per_ciphertext is None:
        samples_per_ciphertext = _bootstrap_lanes(circuit, params, boot_spec, boot_memory)
    try:
        max_keys = (max(2 * params.slots.bit_length(), galois_key_budget // galois_key_bytes(params))
                    if engine.composes_rotations else None)
        if layout == "batch" and samples_per_ciphertext not in (None, 1):
            raise LoweringError("samples_per_ciphertext applies to layout='single'; the batch layout already "
                                "holds one sample per slot")
        plan = (plan_single(circuit, params.slots, max_keys, samples_per_ciphertext,
                            rescale_giants=params.scale_bits >= RESCALE_GIANTS_MIN_SCALE_BITS)
                if layout == "single" else plan_batch(circuit))
    except LoweringError as exc:
        raise CKKSExportError(f"{name}: {exc}") from exc
    lanes = int(plan.stats.get("samples_per_ciphertext", 1))
    boot_info = None
    if boot_spec is not None:
        try:
            plan, boot_info = _with_bootstraps(plan, circuit, params, boot_spec, calibration, max_abs)
        except BootstrapError as exc:
            raise CKKSExportError(f"{name}: {exc}") from exc
    planned = plan_counters(plan.steps, plan.arrays, [g // lanes for g in plan.galois_steps], params, layout,
                            params.slots // lanes)
    server_peak = None
    if boot_info:  # Lattigo's keys travel uncompressed
        server_peak = _server_peak(planned, boot_info, estimated_sizes(params, len(plan.galois_steps))["galois_keys"])
        boot_info["server_memory"] = server_peak
    if server_peak and boot_memory is not None and server_peak["peak_bytes"] > boot_memory:
        sites = [*factoring_sites(proto), *shift_sites(proto)] if layout == "single" else []
        if _memory_spend is not None or not sites:
            tried = (f"; with {len(_memory_spend['factored'])} convolutions and shifts computed on their own"
                     if _memory_spend else "")
            raise CKKSExportError(_server_memory_error(name, planned, boot_info, server_peak, boot_memory, tried,
                                                        params))
        log.warning("%s: its server would peak near %.1f GB, over the %.1f GB memory budget; computing %d spatial "
                    "convolutions and shifts on their own (more levels and bootstraps, far fewer diagonals) instead",
                    name, server_peak["peak_bytes"] / 1e9, boot_memory / 1e9, len(sites))
        merged = {"factored": sites, "reason": "memory", "merged": {
            "depth": circuit.depth, "diagonals": planned.get("plain_products"), "bootstraps": boot_info["count"],
            "server_peak_bytes": server_peak["peak_bytes"]}, "budget_bytes": boot_memory}
        return again(_memory_spend=merged)
    info = {
        "planned": planned,
        **({"bootstrap": boot_info} if boot_info else {}),
        "model_name": name, "degree": circuit.degrees()[circuit.output], "depth": circuit.depth,
        "analyzer": {"degree": report.degree, "mult_depth": report.mult_depth, "levels": report.levels},
        **({"level_spend": spend_info} if spend_info else {}),
        **({"memory_spend": {**_memory_spend, "depth": circuit.depth}} if _memory_spend else {}),
        "output_shape": list(circuit.output_shape), **plan.stats, **cal_info,
    }
    manifest = _manifest(plan, circuit, params, layout, input_range, info)
    try:
        program = engine.prepare(CKKSProgram.create(manifest, plan.arrays))
    except KeySetTooLarge as exc:
        if not (leveled_auto and may_bootstrap):
            raise CKKSExportError(f"{name} on backend {backend!r}: {exc}") from exc
        log.warning("%s: %s; compiling with bootstrapping instead, on a residual chain of the bootstrapping ring "
                    "N=%d itself (fewer levels, so smaller keys; 128-bit bootstrapping switches no rings)", name, exc,
                    BOOTSTRAP_RING)
        try:
            return again(params=None, poly_modulus_degree=None, _force_bootstrap=True)
        except CKKSExportError as boot_exc:  # both refusals: the leveled ring's, then the bootstrapped one's
            raise CKKSExportError(f"{name} on backend {backend!r}: {exc}; bootstrapping instead was refused too: "
                                  f"{boot_exc}") from boot_exc
    except (ParameterError, ValueError) as exc:
        raise CKKSExportError(f"{name} on backend {backend!r}: {exc}") from exc
    log.info("CKKS program %s: %s, %s, depth %d, %d Galois keys, %d sample(s) per ciphertext", program.program_id,
             layout, params.describe(), circuit.depth, len(plan.galois_steps), manifest.samples_per_ciphertext)
    return program
