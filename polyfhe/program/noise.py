"""The noise CKKS adds to a program's values, and the tolerance an encrypted result is checked against.

A slot's error, in value units (divided by the scale): a rescale, a key switch and a fresh encryption (SEAL and
Lattigo encrypt over the special prime too and divide by it) each round every coefficient (uniform in +-1/2, times
``1 + s`` for a ternary secret ``s``); decoding evaluates the polynomial at a root of unity, which multiplies a
coefficient's standard deviation by sqrt(N). Measured on SEAL (N=8192, scale 2^40): 1.3e-9 after encryption,
1.8e-9 predicted. The compiler pushes this noise through the circuit on sample inputs (``export/ckks/noise.py``) and
records a tolerance in ``manifest.info["noise"]``: :data:`SAFETY` times the largest simulated logit error, at least
:data:`RELATIVE` of the largest logit. The margin is wide on purpose: encoding errors are not simulated (a single
linear map at 2^40 showed one slot 70 times the simulated noise), and the check is there to catch results that are
wrong (an overflow decrypts to values near the modulus, a scale error is off by percents), not to grade precision.
A program exported before the record has only its parameters: :func:`error_tolerance` falls back to
:data:`FALLBACK_SHARE` of the largest value they were sized for, loose but far below what an overflow decrypts to.
"""

from __future__ import annotations

import math

from polyfhe.program.params import CKKSParams, largest_value

__all__ = ["FALLBACK_SHARE", "RELATIVE", "SAFETY", "error_tolerance", "fresh_noise", "operation_noise"]

SAFETY = 100.0  # the recorded tolerance over the largest simulated error (encodings, unlucky draws)
RELATIVE = 2.0 ** -10  # the recorded tolerance is at least this share of the largest logit on the sample inputs
KEY_SWITCHES = 4.0  # rounding terms per level beside its rescale (relinearisation, a BSGS sum's rotations)
FALLBACK_SHARE = 2.0 ** -7  # of largest_value(params): the tolerance of a program that records no noise


def fresh_noise(params: CKKSParams) -> float:
    """Standard deviation of one slot's error right after encryption, in value units."""
    return _rounding(params)


def operation_noise(params: CKKSParams) -> float:
    """Standard deviation of the error one level (a rescale and its key switches) adds to a slot, in value units."""
    return (1 + KEY_SWITCHES) * _rounding(params)


def _rounding(params: CKKSParams) -> float:
    """One slot's error after every coefficient is rounded once (a uniform ternary secret has 2N/3 nonzero)."""
    n = params.poly_modulus_degree
    return math.sqrt((1 + 2 * n / 3) / 12) * math.sqrt(n) / params.scale


def error_tolerance(params: CKKSParams, info: dict) -> tuple[float, str]:
    """(largest logit error the noise explains, where the number comes from): the compiler's prediction
    (``info["noise"]["tolerance"]``), else :data:`FALLBACK_SHARE` of :func:`largest_value` of the parameters."""
    noise = info.get("noise") if isinstance(info, dict) else None
    if isinstance(noise, dict) and isinstance(noise.get("tolerance"), int | float) and noise["tolerance"] > 0:
        return float(noise["tolerance"]), "compiler"
    return FALLBACK_SHARE * largest_value(params), "parameters"
