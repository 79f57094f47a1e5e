"""The logit error CKKS noise predicts for a compiled circuit: the circuit run in float64 on sample inputs twice,
once as is and once with the noise of its parameters added where encryption and every level put it
(:mod:`polyfhe.program.noise`). ``polyfhe run`` checks an encrypted result against the tolerance recorded here."""

from __future__ import annotations

import numpy as np

from polyfhe.exporters.ckks.circuit import Circuit
from polyfhe.program.noise import RELATIVE, SAFETY, fresh_noise, operation_noise
from polyfhe.program.params import CKKSParams

__all__ = ["SAMPLES", "noise_info"]

SAMPLES = 16  # inputs the noise is pushed through: enough for the largest error of a few hundred draws


def _inputs(circuit: Circuit, samples: np.ndarray | None, input_range: tuple[float, float]) -> np.ndarray:
    if samples is not None and len(samples):
        return np.asarray(samples[:SAMPLES], dtype=np.float64).reshape(min(len(samples), SAMPLES), -1)
    lo, hi = input_range  # no samples (a CalibrationResult, or none): uniform in the calibrated range
    return np.random.default_rng(0).uniform(lo, hi, (SAMPLES, circuit.input_size))


def noise_info(circuit: Circuit, params: CKKSParams, samples: np.ndarray | None,
               input_range: tuple[float, float]) -> dict:
    """``{"noise": {...}}`` for the manifest's info: ``tolerance`` (``SAFETY`` times the largest simulated logit
    error, at least ``RELATIVE`` of the largest logit), ``simulated`` (that error), ``output_abs_max`` (that
    logit) and the standard deviations added (value units)."""
    x = _inputs(circuit, samples, input_range)
    rng = np.random.default_rng(0)
    fresh, level = fresh_noise(params), operation_noise(params)

    def perturb(reg: int, values: np.ndarray) -> np.ndarray:
        return values + rng.normal(0.0, fresh if reg == 0 else level, values.shape)

    clean = circuit.evaluate(x)
    noisy = circuit.evaluate(x, perturb=perturb)
    simulated = float(np.abs(noisy - clean).max())
    largest = float(np.abs(clean).max())
    tolerance = max(SAFETY * simulated, RELATIVE * largest, SAFETY * level)
    return {"noise": {"tolerance": tolerance, "simulated": simulated, "output_abs_max": largest,
                      "samples": len(x), "fresh_std": fresh, "level_std": level}}
