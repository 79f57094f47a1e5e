"""What one Lattigo bootstrap costs, in key switches at the bootstrapping modulus: fitted to measured bootstraps,
so another machine prices it with its own calibrated key-switch cost (:mod:`polyfhe.runtime.bootcost`)."""

from __future__ import annotations

__all__ = ["BOOTSTRAPPER_START_BOOTSTRAPS", "BOOTSTRAP_MEASUREMENTS", "BOOTSTRAP_PRICE_BY_RING",
           "bootstrap_key_switches"]

# Bootstrapping is priced in key switches at the bootstrapping modulus (the residual primes, the circuit's 16 and
# the special primes), so another machine scales it by its own calibrated key-switch cost. Lattigo's bootstrap runs
# CoeffsToSlots (4 levels) and SlotsToCoeffs (3 levels) as BSGS linear transforms, and EvalMod once per ciphertext
# CoeffsToSlots produces (two at full slots, N/2: the real and imaginary halves; one below, where both halves share
# a ciphertext). Measured (bench/bootstrap_slots.py, one bootstrap alone), the slots below the full ring change
# little, and how much the full ring adds depends on the ring: N=2^12 0.35-0.36 s below it, 0.55 s at it (1.5x);
# N=2^14 2.2-2.5 s below, 2.7-3.0 s at it (1.24x). So the price is a fixed part for the transforms and a part per
# EvalMod ciphertext, per ring (``BOOTSTRAP_PRICE_BY_RING``, the nearest measured ring for others). Key switches
# priced by this machine's Lattigo calibration; an otherwise idle 2-core AMD EPYC machine, Lattigo 6.2 through
# orion-v2-evaluator 2.1.8. Each row: (log2 slots, log2 of the ring the bootstrap runs on, residual primes,
# special primes, seconds per bootstrap, warm).
BOOTSTRAP_MEASUREMENTS = (
    (13, 16, 8, 8, 7.4),  # width-32 monet_fhe_deep_bn, residual N=2^14 ring-switched to 2^16: 6 in a 50.5 s query
    (15, 16, 12, 6, 41.0),  # one bootstrap, 11 levels at 2^40 on N=2^16: 39-43 s on one core
    (12, 14, 8, 6, 2.3),  # N=2^14, [60, 40 x 7, 60], bootstrapping on its own ring (docs/results/issue37)
    (13, 14, 8, 6, 2.85),
    (8, 12, 4, 6, 0.35),  # N=2^12, [60, 40 x 3, 60], its own ring
    (10, 12, 4, 6, 0.36),
    (11, 12, 4, 6, 0.55),
)
# log2 ring -> (key switches of the transforms, key switches per EvalMod ciphertext): N=2^12 and 2^14 reproduce
# their sparse and full-ring points; N=2^16's two points (one a ring-switched bootstrap) disagree on the share, so
# it is EvalMod alone at the geometric middle of both: within 1.45x of each.
BOOTSTRAP_PRICE_BY_RING = {12: (21.0, 25.7), 14: (41.7, 13.1), 16: (0.0, 59.4)}
# The first bootstrap of a process also encodes the bootstrapper's own transforms: measured 2.4-3.6 s more at
# N=2^14 (2^12 and 2^13 slots), 0.1-0.5 s at N=2^12; priced as one bootstrap more, on the cold query only.
BOOTSTRAPPER_START_BOOTSTRAPS = 1.0


def bootstrap_key_switches(log_slots: int, logn: int = 16) -> float:
    """Key switches one bootstrap costs (fitted to :data:`BOOTSTRAP_MEASUREMENTS`): the transforms, and EvalMod
    per ciphertext (two when the slots fill the ring), as measured on the nearest ring."""
    ring = min(BOOTSTRAP_PRICE_BY_RING, key=lambda r: (abs(r - logn), -r))
    transforms, evalmod = BOOTSTRAP_PRICE_BY_RING[ring]
    ciphertexts = 2 if log_slots >= logn - 1 else 1
    return transforms + evalmod * ciphertexts
