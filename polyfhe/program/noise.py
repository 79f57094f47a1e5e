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

A program that bootstraps gets that parameter bound too, and it is not enforced (:attr:`ErrorTolerance.enforced`):
nothing here models a bootstrap's error (each leaves a relative error near 1e-4 of its input range, see
docs/bootstrapping.md, which the layers after it amplify), and a noise record the compiler made for its circuit
before the bootstraps were placed leaves it out as well, so a larger error is reported, not judged wrong.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from polyfhe.program.manifest import ProgramManifest
from polyfhe.program.params import CKKSParams, largest_value

__all__ = ["FALLBACK_SHARE", "RELATIVE", "SAFETY", "ErrorTolerance", "bootstrap_count", "error_tolerance",
           "fresh_noise", "operation_noise", "tolerance_for"]

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


@dataclass(frozen=True)
class ErrorTolerance:
    """The largest logit error an encrypted run may show against the plaintext program, and how far it is trusted.

    ``source``: ``"compiler"`` (the noise the compiler simulated, ``info["noise"]``) or ``"parameters"``
    (:data:`FALLBACK_SHARE` of :func:`largest_value`); ``enforced``: whether a larger error means the result is wrong
    (false for a program that bootstraps: the bound leaves its bootstraps' error out); ``note``: one sentence saying
    where the bound comes from and what it leaves out; ``bootstraps``: the program's bootstraps."""

    value: float
    source: str
    enforced: bool
    note: str
    bootstraps: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def bootstrap_count(manifest: ProgramManifest) -> int:
    """How many bootstraps ``manifest`` runs: its bootstrap steps, or where it has none the compiler's record of
    them (``info["bootstrap"]["count"]``, at least 1 when the record is there)."""
    steps = sum(1 for step in manifest.steps if step.op == "bootstrap")
    record = manifest.info.get("bootstrap") if isinstance(manifest.info, dict) else None
    if steps or not isinstance(record, dict):
        return steps
    count = record.get("count")
    return max(1, int(count)) if isinstance(count, int | float) and math.isfinite(count) else 1


def tolerance_for(manifest: ProgramManifest) -> ErrorTolerance:
    """The tolerance ``polyfhe run`` checks an encrypted result of ``manifest``'s program against."""
    boots = bootstrap_count(manifest)
    if boots:
        value = FALLBACK_SHARE * largest_value(manifest.params)
        return ErrorTolerance(value, "parameters", False, (
            f"a bound from the program's parameters ({value:.3g}: 2^{math.log2(FALLBACK_SHARE):g} of the largest "
            f"value they hold); it does not include the error of the program's {boots} bootstrap(s), which nothing "
            "simulates, so a larger error is reported but not judged wrong"), boots)
    value, source = error_tolerance(manifest.params, manifest.info)
    if source == "compiler":
        return ErrorTolerance(value, source, True, (
            f"the compiler's noise prediction ({SAFETY:g} times the logit error the parameters' noise gave in its "
            "simulation of the circuit, at least a share of the largest logit)"))
    return ErrorTolerance(value, source, True, (
        "a bound from the program's parameters (it was exported before programs recorded their noise)"))


def error_tolerance(params: CKKSParams, info: dict) -> tuple[float, str]:
    """(largest logit error the noise explains, where the number comes from): the compiler's prediction
    (``info["noise"]["tolerance"]``), else :data:`FALLBACK_SHARE` of :func:`largest_value` of the parameters.
    A program that bootstraps (``info["bootstrap"]``) always gets the latter: a noise record leaves its bootstraps'
    error out (:func:`tolerance_for` says so and does not enforce it)."""
    noise = info.get("noise") if isinstance(info, dict) else None
    boots = isinstance(info, dict) and bool(info.get("bootstrap"))
    if (not boots and isinstance(noise, dict) and isinstance(noise.get("tolerance"), int | float)
            and noise["tolerance"] > 0):
        return float(noise["tolerance"]), "compiler"
    return FALLBACK_SHARE * largest_value(params), "parameters"
