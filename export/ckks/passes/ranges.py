"""Pass ``ranges``: the circuit's calibrated value ranges, which size the scale's headroom.

Reads ``circuit`` and the options' ``calibration``; writes ``ranges``. :func:`calibration_ranges` is the one
place values are profiled; ``spend_levels`` calls it again for a circuit it factors.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from polyfhe.exporters.ckks.circuit import Circuit
from polyfhe.exporters.ckks.passes import Pass
from polyfhe.exporters.ckks.state import CompileState, ValueRanges

__all__ = ["PASS", "calibration_ranges", "calibration_samples"]

log = logging.getLogger(__name__)


def calibration_samples(circuit: Circuit, calibration: Any) -> np.ndarray | None:
    """Calibration samples shaped (n, *input shape), or None for no samples (or a CalibrationResult)."""
    if calibration is None or hasattr(calibration, "node_ranges"):
        return None
    x = np.asarray(calibration, dtype=np.float64)
    return x.reshape((-1, *circuit.input_shape[1:]))


def calibration_ranges(circuit: Circuit, calibration: Any) -> ValueRanges:
    """Ranges of ``circuit`` from an array of samples or a CalibrationResult (none: a guess, said in the log)."""
    if calibration is None:
        log.warning("no calibration data: assuming inputs in [0, 1] and values below 2^12; pass calibration=X "
                    "(a few hundred representative inputs) for parameters fitted to the model")
        return ValueRanges(float(2**12), (0.0, 1.0), {"calibrated": False})
    if hasattr(calibration, "node_ranges") and hasattr(calibration, "input_range"):
        rng = calibration.input_range
        max_abs = max([abs(r.abs_max) for r in calibration.node_ranges.values()] + [abs(rng.abs_max)])
        return ValueRanges(max_abs, (float(rng.min), float(rng.max)),
                           {"calibrated": True, "calibration": "CalibrationResult",
                            "samples": int(getattr(calibration, "num_samples", 0))})
    x = calibration_samples(circuit, calibration)
    ranges = circuit.value_ranges(x)
    return ValueRanges(max(ranges.values()), (float(x.min()), float(x.max())),
                       {"calibrated": True, "samples": len(x), "max_abs_value": max(ranges.values())})


def run(state: CompileState) -> None:
    state.ranges = calibration_ranges(state.circuit, state.options.calibration)


PASS = Pass("ranges", run, ("ranges",))
