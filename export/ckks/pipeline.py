"""The CKKS compiler as a named list of passes over one :class:`~polyfhe.exporters.ckks.state.CompileState`.

:data:`PASSES` runs in order; the first :data:`FRONT` of them (the ONNX graph and its analysis) run once per
export, the rest once per try. A try ends early when a pass asks for another (:class:`Retry`): the server
would not fit its memory budget (try again with spatial sites computed on their own), or the engine refused the
leveled ring's keys (try again bootstrapping). Each retry changes a knob the try before had not, so at most
:data:`MAX_TRIES` run.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

from polyfhe.exporters.ckks.passes import (
    Pass,
    analyze,
    bootstrap,
    counters,
    expand_matmuls,
    lower,
    onnx,
    parameters,
    plan,
    program,
    ranges,
    replicate,
    server_memory,
    spend_levels,
)
from polyfhe.exporters.ckks.state import (
    BootstrapInstead,
    CKKSExportError,
    CompileOptions,
    CompileState,
    SpendForMemory,
    UnpackForMemory,
)
from polyfhe.procinfo import peak_resident_bytes, resident_bytes

__all__ = ["FRONT", "MAX_TRIES", "PASSES", "compile_model", "run_passes"]

log = logging.getLogger(__name__)

PASSES: tuple[Pass, ...] = (
    onnx.PASS,
    analyze.PASS,
    lower.PASS,
    expand_matmuls.PASS,
    replicate.PASS,
    ranges.PASS,
    spend_levels.PASS,
    parameters.PASS,
    plan.PASS,
    bootstrap.PASS,
    counters.PASS,
    server_memory.PASS,
    program.PASS,
)
FRONT = 2  # onnx, analyze: the same for every try
# the first try, then at most: its bootstraps unpacked and its sites spent for memory, bootstrapping instead, and
# that try's unpacking and memory spend
MAX_TRIES = 6


def run_passes(state: CompileState, passes: tuple[Pass, ...]) -> None:
    """Run ``passes`` in order on ``state``, logging each one's name, seconds and the process's memory."""
    for step in passes:
        start = time.perf_counter()
        step.run(state)
        seconds = time.perf_counter() - start
        state.seconds[step.name] = state.seconds.get(step.name, 0.0) + seconds
        now, peak = resident_bytes(), peak_resident_bytes()
        log.info("pass %s: %.1f s, resident %s, peak %s", step.name, seconds,
                 "?" if now is None else f"{now / 1e9:.2f} GB", "?" if peak is None else f"{peak / 1e9:.2f} GB")


def compile_model(model: Any, options: CompileOptions) -> Any:
    """``model`` compiled with ``options``: a :class:`~polyfhe.program.ckks_program.CKKSProgram`."""
    state = CompileState(model=model, options=options)
    run_passes(state, PASSES[:FRONT])
    refused = ""  # the leveled ring's refusal, put in front of the bootstrapped tries' refusals
    for _ in range(MAX_TRIES):
        try:
            run_passes(state, PASSES[FRONT:])
            return state.program
        except SpendForMemory as retry:
            log.warning("%s", retry.message)
            state = state.retry(replace(state.options, spend_levels=False), state.force_bootstrap,
                                retry.memory_spend)
        except UnpackForMemory as retry:
            log.warning("%s", retry.message)
            state = state.retry(replace(state.options, pack_bootstraps=False), state.force_bootstrap,
                                state.memory_spend)
        except BootstrapInstead as retry:
            log.warning("%s", retry.message)
            refused = retry.refusal
            state = state.retry(replace(state.options, spend_levels=False, params=None, poly_modulus_degree=None),
                                True, None)
        except CKKSExportError as exc:
            if refused:
                raise CKKSExportError(f"{refused}; bootstrapping instead was refused too: {exc}") from exc
            raise
    raise CKKSExportError(f"{state.name}: no program after {MAX_TRIES} tries")
