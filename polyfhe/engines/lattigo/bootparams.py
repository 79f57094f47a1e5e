"""Lattigo's bootstrapping keys and the residual chains a program runs on between bootstraps.

How many keys Lattigo's bootstrapping holds and how large they are, what generating them peaks at, the special
primes that make them smallest, and the residual chains (with their bootstrapping spec) the compiler may choose
among, cheapest first, each checked by :func:`~polyfhe.engines.lattigo.bootsecurity.check_bootstrap_security`.
Pure data and arithmetic; no wheel import.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace

from polyfhe.engines.lattigo.bootcircuit import (
    BOOT_SPECIAL_PRIMES,
    BOOTSTRAP_RING,
    CIRCUIT_BITS,
    CIRCUIT_PRIMES,
    FIRST_PRIME_BITS,
    RESIDUAL_RINGS,
    RESIDUAL_SPECIAL_BITS,
    SPECIAL_PRIME_BITS,
    SPECIAL_PRIME_COUNTS,
)
from polyfhe.engines.lattigo.bootsecurity import check_bootstrap_security
from polyfhe.program.bootstrapping import BootstrapChoice, BootstrapSpec, bootstraps_needed
from polyfhe.program.params import MAX_BITS_128, CKKSParams, ParameterError
from polyfhe.program.sizes import key_switching_key_bytes

log = logging.getLogger(__name__)

__all__ = ["BOOTSTRAP_KEYS_BY_LOG_SLOTS", "KEYGEN_PEAK_FACTOR", "bootstrap_candidates", "bootstrap_galois_keys",
           "bootstrap_key_bytes", "bootstrap_modulus_bits", "choose_bootstrap_params", "default_spec",
           "keygen_peak_bytes", "max_refresh_log_slots", "residual_levels", "special_primes"]

# Galois keys Lattigo's bootstrapping holds at 2^log_slots slots (CoeffsToSlots, SlotsToCoeffs, conjugation,
# relinearisation and the sparse-secret encapsulation keys); measured here from the marshalled key sets
# (Lattigo 6.2: 34 keys at 2^10 slots, 40 at 2^12, 42 at 2^13), extrapolated by 2 per doubling above.
BOOTSTRAP_KEYS_BY_LOG_SLOTS = {10: 34, 11: 37, 12: 40, 13: 42}
# Generating and marshalling the bootstrapping keys through the wheel peaks at this multiple of their size
# (Go's keys, Go's marshalled buffer, its C copy, Python's bytes; measured 3.96x at 4.3 and 5.9 GB).
KEYGEN_PEAK_FACTOR = 4.0


def bootstrap_modulus_bits(params: CKKSParams, spec: BootstrapSpec) -> int:
    """*Planned* bits of the modulus the bootstrapping keys live on (residual ciphertext primes, the circuit counted
    with 9 EvalMod primes, one more than Lattigo's 8, and the special primes): what chains are sized with. The
    security verdict is :func:`check_bootstrap_security`'s, on the real primes."""
    return sum(params.coeff_mod_bits[:-1]) + CIRCUIT_BITS + sum(spec.logp)


def bootstrap_galois_keys(log_slots: int) -> int:
    """Keys in Lattigo's bootstrapping key set at ``2^log_slots`` slots (measured table, see above)."""
    if log_slots in BOOTSTRAP_KEYS_BY_LOG_SLOTS:
        return BOOTSTRAP_KEYS_BY_LOG_SLOTS[log_slots]
    top = max(BOOTSTRAP_KEYS_BY_LOG_SLOTS)
    low = min(BOOTSTRAP_KEYS_BY_LOG_SLOTS)
    return BOOTSTRAP_KEYS_BY_LOG_SLOTS[top] + 2 * (log_slots - top) if log_slots > top else \
        BOOTSTRAP_KEYS_BY_LOG_SLOTS[low]


def keygen_peak_bytes(key_bytes: int) -> int:
    """Resident peak of generating and marshalling ``key_bytes`` of bootstrapping keys (``KEYGEN_PEAK_FACTOR``)."""
    return int(KEYGEN_PEAK_FACTOR * key_bytes)


def bootstrap_key_bytes(params: CKKSParams, spec: BootstrapSpec) -> int:
    """Bytes of the bootstrapping keys: each holds ceil(#Q / #P) digits of two polynomials over #Q + #P primes
    on the bootstrapping ring (8 bytes a coefficient), #Q = residual ciphertext primes + the circuit's."""
    q = len(params.coeff_mod_bits) - 1 + CIRCUIT_PRIMES
    p = len(spec.logp)
    digits = -(-q // p)
    return bootstrap_galois_keys(spec.log_slots) * key_switching_key_bytes(1 << spec.logn, digits, q + p)


def special_primes(params: CKKSParams, logn: int = 16) -> tuple[int, ...]:
    """The special primes that make the bootstrapping keys smallest within the 128-bit bound at ``2^logn``."""
    bound = MAX_BITS_128[1 << logn]
    used = sum(params.coeff_mod_bits[:-1]) + CIRCUIT_BITS
    q = len(params.coeff_mod_bits) - 1 + CIRCUIT_PRIMES
    fits = [p for p in SPECIAL_PRIME_COUNTS if used + p * SPECIAL_PRIME_BITS <= bound]
    if not fits:
        return BOOT_SPECIAL_PRIMES
    best = min(fits, key=lambda p: (-(-q // p) * (q + p), p))
    return (SPECIAL_PRIME_BITS,) * best


def residual_levels(poly_modulus_degree: int, scale_bits: int, boot_logn: int = 16) -> int:
    """Levels a residual chain of ``scale_bits`` primes keeps within both 128-bit bounds: the chain (special
    prime included) on its own ring, and chain + bootstrap circuit + six special primes on the bootstrapping ring."""
    own = MAX_BITS_128[poly_modulus_degree] - FIRST_PRIME_BITS - RESIDUAL_SPECIAL_BITS
    boot = MAX_BITS_128[1 << boot_logn] - CIRCUIT_BITS - sum(BOOT_SPECIAL_PRIMES) - FIRST_PRIME_BITS
    return max(0, min(own, boot) // scale_bits)


def bootstrap_candidates(depth: int, slots_needed: int, *, scale_bits: int | None = None, max_scale_bits: int = 40,
                         min_scale_bits: int = 30) -> list[BootstrapChoice]:
    """Every residual ring and scale that holds ``slots_needed`` with at least 2 levels and bootstraps 128-bit
    securely (:func:`check_bootstrap_security`: today N=2^16 only, no ring switching), cheapest first: fewest
    bootstraps (one costs about as much as tens of levels of linear work), then the smaller ring (a quarter of
    the work and memory per halving), then the larger scale (precision)."""
    if BOOTSTRAP_RING // 2 < slots_needed:
        raise ParameterError(f"{slots_needed} values do not fit the {BOOTSTRAP_RING // 2} slots of the "
                             f"bootstrapping ring N={BOOTSTRAP_RING}")
    scales = [scale_bits] if scale_bits else list(range(max_scale_bits, min_scale_bits - 1, -1))
    out = []
    for ring in RESIDUAL_RINGS:
        if ring // 2 < slots_needed:
            continue
        for s in scales:
            levels = residual_levels(ring, s)
            if levels < 2:
                continue
            params = CKKSParams(ring, (FIRST_PRIME_BITS, *([s] * levels), RESIDUAL_SPECIAL_BITS), s)
            spec = default_spec(params, slots_needed)
            verdict = check_bootstrap_security(params, spec)
            if not verdict.secure:  # ring switching below 2^16 always is (``bootsecurity``)
                log.debug("bootstrapping candidate %s skipped: %s", params.describe(), "; ".join(verdict.problems))
                continue
            keys = bootstrap_key_bytes(params, spec)
            out.append(BootstrapChoice(params, spec, bootstraps_needed(depth, levels), keys, keygen_peak_bytes(keys)))
    if not out:
        raise ParameterError(f"no residual chain of at least 2 levels fits at scales {scales[0]}..{scales[-1]}")
    return sorted(out, key=lambda c: (c.bootstraps, c.params.poly_modulus_degree, -c.params.scale_bits))


def max_refresh_log_slots(params: CKKSParams, spec: BootstrapSpec, memory_bytes: int | None) -> int:
    """The most slots (log2) one bootstrap may refresh while its key generation fits ``memory_bytes``: more
    interleaved samples widen every refresh, and the wider bootstrap holds more keys. Never below
    ``spec.log_slots`` (the choice of chain already checked that one)."""
    top = int(math.log2(params.slots))
    if memory_bytes is None:
        return top
    fits = [s for s in range(spec.log_slots, top + 1)
            if KEYGEN_PEAK_FACTOR * bootstrap_key_bytes(params, replace(spec, log_slots=s)) <= memory_bytes]
    return max(fits, default=spec.log_slots)


def choose_bootstrap_params(depth: int, slots_needed: int, *, scale_bits: int | None = None,
                            max_scale_bits: int = 40, min_scale_bits: int = 30,
                            memory_bytes: int | None = None) -> tuple[CKKSParams, BootstrapSpec]:
    """The cheapest residual chain (:func:`bootstrap_candidates`) whose bootstrapping key generation fits
    ``memory_bytes`` (None: no limit); a clear error with what each candidate needs when none does."""
    candidates = bootstrap_candidates(depth, slots_needed, scale_bits=scale_bits, max_scale_bits=max_scale_bits,
                                      min_scale_bits=min_scale_bits)
    fitting = [c for c in candidates if memory_bytes is None or c.keygen_peak_bytes <= memory_bytes]
    if fitting and fitting[0] is not candidates[0]:
        log.warning("bootstrapping: %s would need more than the %.1f GB memory budget; using %s",
                    candidates[0].describe(), memory_bytes / 1e9, fitting[0].describe())
    if not fitting:
        smallest = min(candidates, key=lambda c: c.keygen_peak_bytes)
        raise ParameterError(
            f"a circuit of {depth} levels on {slots_needed} slots cannot bootstrap within {memory_bytes / 1e9:.1f} GB: "
            f"the smallest choice, {smallest.describe()}; run it on a machine with at least "
            f"{smallest.keygen_peak_bytes / 1e9:.0f} GB, or use a narrower model (fewer slots) or a shallower one")
    return fitting[0].params, fitting[0].spec


def default_spec(params: CKKSParams, slots: int) -> BootstrapSpec:
    """Bootstrapping that refreshes the power of two of slots holding ``slots``: on the 128-bit ring N=2^16
    itself (128-bit programs bootstrap on their own N=2^16 ring: ring switching from a smaller residual ring was
    found insecure and is not used), with the special primes that make its keys smallest; insecure test rings
    (``allow_insecure``) bootstrap on their own ring with six special primes."""
    log_slots = max(1, math.ceil(math.log2(max(slots, 2))))
    log_slots = min(log_slots, int(math.log2(params.slots)))
    if params.security != "tc128" and params.poly_modulus_degree < BOOTSTRAP_RING:
        return BootstrapSpec(int(math.log2(params.poly_modulus_degree)), BOOT_SPECIAL_PRIMES, log_slots)
    logn = int(math.log2(BOOTSTRAP_RING))
    return BootstrapSpec(logn, special_primes(params, logn), log_slots)
