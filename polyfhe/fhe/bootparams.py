"""Bootstrapping parameter sets: the residual chain a program runs on between bootstraps, and the security bound.

Lattigo (v6) bootstraps a ciphertext of the *residual* chain (first prime + one prime per level) by extending it
with the primes of its own circuit, Lattigo's defaults: CoeffsToSlots 4 x 56 bits, EvalMod 8-9 x 60 bits (9 are
counted here, the larger of its dense- and sparse-secret defaults), SlotsToCoeffs 3 x 39 bits, plus the
bootstrapping keys' special primes (``logp``). Its bootstrapping keys live on that whole modulus, so it is what
must meet the 128-bit bound: at N=2^16 the HE standard's 1,772 bits for a uniform ternary secret.

The main secret is polyfhe's usual fixed-weight ternary secret with 2N/3 non-zero coefficients (the weight of a
uniform ternary secret), not a sparse one: Lattigo's bootstrapping switches to an *ephemeral* secret of Hamming
weight 32 only for the modulus raise, under a key of about 121 bits of modulus (sparse-secret encapsulation,
Bossuat, Troncoso-Pastoriza and Hubaux, ePrint 2022/024, the paper Lattigo's default parameters come from, which
reports it above 128-bit security). So the HE standard's table applies to every key on the full modulus.

Pure data and arithmetic; no engine import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from polyfhe.fhe.params import MAX_BITS_128, CKKSParams, ParameterError

__all__ = ["BOOTSTRAP_RING", "BootstrapSpec", "bootstrap_modulus_bits", "choose_bootstrap_params"]

BOOTSTRAP_RING = 1 << 16
COEFFS_TO_SLOTS_BITS = (56,) * 4
EVAL_MOD_BITS = (60,) * 9
SLOTS_TO_COEFFS_BITS = (39,) * 3
CIRCUIT_BITS = sum(COEFFS_TO_SLOTS_BITS) + sum(EVAL_MOD_BITS) + sum(SLOTS_TO_COEFFS_BITS)
# Key switching inside the bootstrap: six 61-bit special primes, one more than Lattigo's default of about
# sqrt(#primes): a key holds ceil(#Q / #P) digits, so more special primes make every bootstrapping key smaller
# (memory is what limits key generation at N=2^16 here), at the price of residual levels.
BOOT_SPECIAL_PRIMES = (61,) * 6
FIRST_PRIME_BITS = 60  # the bootstrap reads its input from Q[0]: room for the message at Lattigo's 2^8 ratio
RESIDUAL_SPECIAL_BITS = 60


@dataclass(frozen=True)
class BootstrapSpec:
    """How the engine bootstraps: ring (log2), its special primes, the slots one bootstrap refreshes (log2)."""

    logn: int
    logp: tuple[int, ...]
    log_slots: int

    def to_dict(self) -> dict:
        return {"logn": self.logn, "logp": list(self.logp), "log_slots": self.log_slots}

    @classmethod
    def from_dict(cls, d: dict) -> BootstrapSpec:
        try:
            return cls(int(d["logn"]), tuple(int(b) for b in d["logp"]), int(d["log_slots"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ParameterError(f"malformed bootstrapping parameters {d!r}: {exc}") from exc


def bootstrap_modulus_bits(params: CKKSParams, spec: BootstrapSpec) -> int:
    """Nominal bits of the modulus the bootstrapping keys live on: residual ciphertext primes, the bootstrap
    circuit's primes and its special primes."""
    return sum(params.coeff_mod_bits[:-1]) + CIRCUIT_BITS + sum(spec.logp)


def residual_levels(poly_modulus_degree: int, scale_bits: int) -> int:
    """Levels a residual chain of ``scale_bits`` primes keeps on this ring within the 128-bit bound."""
    bound = MAX_BITS_128[poly_modulus_degree]
    room = bound - CIRCUIT_BITS - sum(BOOT_SPECIAL_PRIMES) - FIRST_PRIME_BITS
    return max(0, room // scale_bits)


def choose_bootstrap_params(depth: int, slots_needed: int, *, scale_bits: int | None = None,
                            max_scale_bits: int = 40, min_scale_bits: int = 30) -> tuple[CKKSParams, BootstrapSpec]:
    """The residual chain at N=2^16 that needs the fewest bootstraps for ``depth`` levels, largest scale first
    among equals. A segment spends one level on scaling into the bootstrap, so ``L`` residual levels give
    ``L - 1`` levels of work per bootstrap (the last segment ``L``)."""
    n = BOOTSTRAP_RING
    if n // 2 < slots_needed:
        raise ParameterError(f"{slots_needed} values do not fit the {n // 2} slots of the bootstrapping ring N={n}")
    scales = [scale_bits] if scale_bits else list(range(max_scale_bits, min_scale_bits - 1, -1))
    best = None
    for s in scales:
        levels = residual_levels(n, s)
        if levels < 2:
            continue
        bootstraps = max(0, math.ceil((depth - levels) / (levels - 1)))
        if best is None or bootstraps < best[0]:
            best = (bootstraps, s, levels)
    if best is None:
        raise ParameterError(f"no residual chain of at least 2 levels fits N={n} at scales {scales[0]}..{scales[-1]}")
    _, s, levels = best
    params = CKKSParams(n, (FIRST_PRIME_BITS, *([s] * levels), RESIDUAL_SPECIAL_BITS), s)
    return params, default_spec(params, slots_needed)


def default_spec(params: CKKSParams, slots: int) -> BootstrapSpec:
    """Bootstrapping on the program's own ring, refreshing the power of two of slots that holds ``slots``."""
    log_slots = max(1, math.ceil(math.log2(max(slots, 2))))
    log_slots = min(log_slots, int(math.log2(params.slots)))
    return BootstrapSpec(int(math.log2(params.poly_modulus_degree)), BOOT_SPECIAL_PRIMES, log_slots)


def check_bootstrap_security(params: CKKSParams, spec: BootstrapSpec) -> tuple[bool, int, int | None]:
    """(secure, modulus bits, bound) of the bootstrapping keys' modulus."""
    bits = bootstrap_modulus_bits(params, spec)
    bound = MAX_BITS_128.get(params.poly_modulus_degree)
    return (bound is not None and bits <= bound), bits, bound

