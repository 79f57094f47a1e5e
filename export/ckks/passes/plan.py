"""Pass ``plan``: the per-layout plan (steps, plaintext arrays, Galois keys) of the circuit on the parameters.

Reads ``circuit``, ``params``, ``boot_spec``, ``boot_memory`` and the options; writes ``plan``. A bootstrapped
program takes as many samples per ciphertext as keep its (wider) bootstraps' key generation within memory.
"""

from __future__ import annotations

import logging

from polyfhe.exporters.ckks.affine import LoweringError
from polyfhe.exporters.ckks.circuit import Circuit
from polyfhe.exporters.ckks.passes import Pass
from polyfhe.exporters.ckks.plan import max_samples_per_ciphertext, plan_batch, plan_single
from polyfhe.exporters.ckks.state import CKKSExportError, CompileState
from polyfhe.program.bootstrapping import BootstrapSpec
from polyfhe.program.engine_api import Backend, BootstrapModel
from polyfhe.program.params import CKKSParams, estimated_sizes, seeded_sizes

__all__ = ["PASS", "RESCALE_GIANTS_MIN_SCALE_BITS", "galois_key_bytes"]

log = logging.getLogger(__name__)

# At this scale and above, giant-step sums are rescaled before their rotation: cheaper key switches, and the
# key-switching noise they then add at the working scale stays far below the error budget
RESCALE_GIANTS_MIN_SCALE_BITS = 35


def galois_key_bytes(engine: Backend, params: CKKSParams) -> int:
    """Bytes of one Galois key as ``engine``'s client serialises it (its record's ``galois_key_bytes``), else
    uncompressed: what the Galois key budget counts."""
    if engine.galois_key_bytes is not None:
        return int(engine.galois_key_bytes(params))
    return estimated_sizes(params, 1)["galois_keys"]


def bootstrap_lanes(model: BootstrapModel, circuit: Circuit, params: CKKSParams, spec: BootstrapSpec,
                    memory_bytes: int | None) -> int:
    """Samples per ciphertext for a bootstrapped program: as many as fit the slots, but no more than keep the
    (wider) bootstrap's key generation within ``memory_bytes``; more lanes refresh more slots per bootstrap."""
    try:
        most = max_samples_per_ciphertext(circuit, params.slots)
    except LoweringError as exc:
        raise CKKSExportError(str(exc)) from exc
    widest = params.slots // most
    cap = max(1, (1 << model.max_refresh_log_slots(params, spec, memory_bytes)) // widest)
    if cap < most:
        log.info("bootstrapping: %d sample(s) per ciphertext instead of %d, so that the bootstrapping keys "
                 "fit the memory budget", cap, most)
    return min(most, cap)


def browser_key_allowance(params: CKKSParams, upload_budget: int) -> int:
    """Galois keys a public context sent seeded (the web page's) can hold within ``upload_budget`` bytes."""
    fixed = seeded_sizes(params, 1)["public_context"] - seeded_sizes(params, 1)["galois_key"]
    per_key = seeded_sizes(params, 1)["galois_key"]
    if fixed > upload_budget:
        raise CKKSExportError(f"the public and relinearisation keys alone take {fixed / 1e6:.1f} MB at "
                              f"{params.describe()}, over the {upload_budget / 1e6:.0f} MB upload budget")
    return (upload_budget - fixed) // per_key


def run(state: CompileState) -> None:
    options, params, circuit = state.options, state.params, state.circuit
    lanes = options.samples_per_ciphertext
    if state.boot_spec is not None and state.single and lanes is None:
        lanes = bootstrap_lanes(state.bootstrapping, circuit, params, state.boot_spec, state.boot_memory)
    try:
        max_keys = (max(2 * params.slots.bit_length(),
                        options.galois_key_budget // galois_key_bytes(state.engine, params))
                    if state.engine.composes_rotations else None)
        if options.upload_budget is not None and max_keys is not None:
            max_keys = min(max_keys, browser_key_allowance(params, options.upload_budget))
            log.info("upload budget %.0f MB: at most %d Galois keys of %.1f MB (seeded)", options.upload_budget / 1e6,
                     max_keys, seeded_sizes(params, 1)["galois_key"] / 1e6)
        if not state.single and lanes not in (None, 1):
            raise LoweringError("samples_per_ciphertext applies to layout='single'; the batch layout already "
                                "holds one sample per slot")
        state.plan = (plan_single(circuit, params.slots, max_keys, lanes,
                                  rescale_giants=params.scale_bits >= RESCALE_GIANTS_MIN_SCALE_BITS,
                                  block_sum_maps=state.engine.rotate_sums)
                      if state.single else plan_batch(circuit))
    except LoweringError as exc:
        hint = ""
        if options.upload_budget is not None:
            hint = (f"; the {options.upload_budget / 1e6:.0f} MB upload budget buys {max_keys} Galois keys of "
                    f"{seeded_sizes(params, 1)['galois_key'] / 1e6:.1f} MB at {params.describe()}: raise "
                    "upload_budget (--upload-budget-mb), or export for a smaller ring (fewer levels)")
        raise CKKSExportError(f"{state.name}: {exc}{hint}") from exc


PASS = Pass("plan", run, ("plan",))
