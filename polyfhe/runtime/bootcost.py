"""What one bootstrap costs on this machine: its key switches (fitted to measured bootstraps) priced at the
bootstrapping modulus from the engine's measured operation costs. The compiler's refusals and the cost model
both read it."""

from __future__ import annotations

import math
from dataclasses import replace

from polyfhe.program.bootparams import (
    CIRCUIT_PRIMES,
    COEFFS_TO_SLOTS_BITS,
    SLOTS_TO_COEFFS_BITS,
    BootstrapSpec,
)
from polyfhe.program.params import CKKSParams
from polyfhe.runtime.opcosts import OpCosts, OpSite

__all__ = ["BOOTSTRAP_MEASUREMENTS", "BOOTSTRAP_TRANSFORM_DEPTHS", "bootstrap_key_switches", "bootstrap_rotations",
           "bootstrap_seconds", "bootstrap_site"]

# Bootstrapping is priced in key switches at the bootstrapping modulus (N=2^16: the residual primes, the circuit's
# 16 and the special primes), so another machine scales it by its own calibrated key-switch cost. Lattigo's
# bootstrap runs CoeffsToSlots (4 levels) and SlotsToCoeffs (3 levels) as BSGS linear transforms whose rotations
# grow with log2(slots), and EvalMod once per ciphertext it produces (two at full slots, 2^15: the real and
# imaginary halves). The constants are a non-negative least-squares fit (relative errors, key switches priced by
# this machine's calibration) to the bootstraps measured on an otherwise idle 2-core AMD EPYC machine (Lattigo 6.2
# through orion-v2-evaluator 2.1.8; docs/ckks.md, "Bootstrapping"), each row (log2 slots, residual ring, residual
# primes, special primes, seconds per bootstrap). Those two points leave no room for a slot term (the fit puts
# it at zero: the 2^13-slot bootstrap on a small residual ring is as cheap per key switch as EvalMod alone), so
# the price grows with slots only through EvalMod's ciphertexts; each point is reproduced within 2x (8.9 s for
# 7.4 s, 24 s for 41 s). Two earlier points measured while other jobs held both cores (about 11 s at 2^9 slots,
# 15 s at 2^13) are left out: they measured the machine's load as much as the bootstrap.
BOOTSTRAP_MEASUREMENTS = (
    (13, 1 << 14, 8, 8, 7.4),  # width-32 monet_fhe_deep_bn, [60, 40 x 7, 60]: 6 bootstraps, 50.5 s per query
    (15, 1 << 16, 12, 6, 41.0),  # one bootstrap, 11 levels at 2^40 on N=2^16: 39-43 s on one core
)
BOOTSTRAP_EVALMOD_KEY_SWITCHES = 49.9  # per ciphertext EvalMod runs on
BOOTSTRAP_ROTATION_KEY_SWITCHES = 0.0  # per BSGS rotation of CoeffsToSlots and SlotsToCoeffs (fitted: none)
# levels of CoeffsToSlots and SlotsToCoeffs, as the bootstrapping parameters lay them out
BOOTSTRAP_TRANSFORM_DEPTHS = (len(COEFFS_TO_SLOTS_BITS), len(SLOTS_TO_COEFFS_BITS))


def bootstrap_rotations(log_slots: int) -> float:
    """BSGS rotations of CoeffsToSlots and SlotsToCoeffs at ``2^log_slots`` slots: each of their ``depth`` levels
    merges ``log_slots / depth`` FFT stages, a map of about ``2 r - 1`` diagonals (``r = 2^(log_slots/depth)``)
    that BSGS evaluates with about twice its square root in rotations."""
    total = 0.0
    for depth in BOOTSTRAP_TRANSFORM_DEPTHS:
        radix = 2.0 ** (log_slots / depth)
        total += depth * 2.0 * math.sqrt(2.0 * radix - 1.0)
    return total


def bootstrap_key_switches(log_slots: int, logn: int = 16) -> float:
    """Key switches one bootstrap costs (fitted to :data:`BOOTSTRAP_MEASUREMENTS`): EvalMod per ciphertext (two
    when the slots fill the ring) and the slot-dependent linear transforms."""
    ciphertexts = 2 if log_slots >= logn - 1 else 1
    return (BOOTSTRAP_EVALMOD_KEY_SWITCHES * ciphertexts
            + BOOTSTRAP_ROTATION_KEY_SWITCHES * bootstrap_rotations(log_slots))


def bootstrap_site(residual_primes: int, special: int, logn: int = 16) -> OpSite:
    """A key switch at the bootstrapping modulus: residual and circuit primes, ``special`` special primes."""
    primes = residual_primes + CIRCUIT_PRIMES
    return OpSite("rotation", 1 << logn, primes, math.ceil(primes / special), special)


def bootstrap_seconds(costs: OpCosts, spec: dict | None, params: CKKSParams) -> float:
    """One bootstrap of ``spec``'s slots on this machine: its key switches at the bootstrapping modulus."""
    if spec is None:
        return 0.0
    boot = BootstrapSpec.from_dict(spec)
    site = bootstrap_site(len(params.coeff_mod_bits) - 1, len(boot.logp), boot.logn)
    # Lattigo's probes run rotations and hoisted rotations together, so the fit may put a key switch's whole
    # cost on either op (the other's constants then are zero): a key switch costs the larger of the two
    per_switch = max(costs.seconds({site: 1.0}), costs.seconds({replace(site, op="hoisted_rotation"): 1.0}))
    return bootstrap_key_switches(boot.log_slots, boot.logn) * per_switch
