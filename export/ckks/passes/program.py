"""Pass ``program``: the manifest (plan, parameters, what was decided) and the engine's prepared program.

Reads every field the passes before it wrote; writes ``program``. A leveled ring whose key set the engine
refuses raises :class:`~polyfhe.exporters.ckks.state.BootstrapInstead` when bootstrapping may replace it, for
the driver to retry on a residual chain.
"""

from __future__ import annotations

import logging

from polyfhe.exporters.ckks.noise import noise_info
from polyfhe.exporters.ckks.passes import Pass
from polyfhe.exporters.ckks.passes.bootstrap import program_manifest
from polyfhe.exporters.ckks.passes.ranges import calibration_samples
from polyfhe.exporters.ckks.state import BootstrapInstead, CKKSExportError, CompileState
from polyfhe.program.ckks_program import CKKSProgram
from polyfhe.program.engines import KeySetTooLarge
from polyfhe.program.params import ParameterError

__all__ = ["PASS", "manifest_info"]

log = logging.getLogger(__name__)


def manifest_info(state: CompileState) -> dict:
    """What the manifest records of the compile: counters, bootstraps, degree and depth, spends, calibration."""
    circuit, report = state.circuit, state.report
    boot = {"bootstrap": {**state.boot_info, "server_memory": state.server_peak}} if state.boot_info else {}
    return {
        "planned": state.planned, **boot,
        "model_name": state.name, "degree": circuit.degrees()[circuit.output], "depth": circuit.depth,
        "analyzer": {"degree": report.degree, "mult_depth": report.mult_depth, "levels": report.levels},
        **({"level_spend": state.spend_info} if state.spend_info else {}),
        **({"matmuls": circuit.matmuls} if circuit.matmuls else {}),
        **({"memory_spend": {**state.memory_spend, "depth": circuit.depth}} if state.memory_spend else {}),
        "output_shape": list(circuit.output_shape), **state.plan.stats, **state.ranges.info,
        **_noise(state),
    }


def _noise(state: CompileState) -> dict:
    """The logit error the parameters' noise predicts (``export/ckks/noise.py``); none for a program that
    bootstraps (``polyfhe run`` then falls back to a bound from its parameters)."""
    if state.boot_spec is not None:
        return {}
    samples = calibration_samples(state.circuit, state.options.calibration)
    return noise_info(state.circuit, state.params, samples, state.ranges.input_range)


def run(state: CompileState) -> None:
    name, backend = state.name, state.options.backend
    manifest = program_manifest(state, state.options.layout, state.ranges.input_range, manifest_info(state))
    try:
        state.program = state.engine.prepare(CKKSProgram.create(manifest, state.plan.arrays))
    except KeySetTooLarge as exc:
        refusal = f"{name} on backend {backend!r}: {exc}"
        if not (state.leveled_auto and state.may_bootstrap):
            raise CKKSExportError(refusal) from exc
        ring = state.bootstrapping.ring
        raise BootstrapInstead(
            f"{name}: {exc}; compiling with bootstrapping instead, on a residual chain of the bootstrapping ring "
            f"N={ring} itself (fewer levels, so smaller keys; 128-bit bootstrapping switches no rings)",
            refusal) from exc
    except (ParameterError, ValueError) as exc:
        raise CKKSExportError(f"{name} on backend {backend!r}: {exc}") from exc
    log.info("CKKS program %s: %s, %s, depth %d, %d Galois keys, %d sample(s) per ciphertext",
             state.program.program_id, state.options.layout, state.params.describe(), state.circuit.depth,
             len(state.plan.galois_steps), manifest.samples_per_ciphertext)


PASS = Pass("program", run, ("program",))
