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

import logging
import math
import os
from dataclasses import dataclass, replace

from polyfhe.fhe.params import MAX_BITS_128, CKKSParams, ParameterError

log = logging.getLogger(__name__)

__all__ = ["BOOTSTRAP_RING", "BootstrapChoice", "BootstrapSpec", "bootstrap_candidates", "bootstrap_key_bytes",
           "bootstrap_modulus_bits", "bootstraps_needed", "choose_bootstrap_params", "default_spec", "machine_memory_budget",
           "max_refresh_log_slots", "server_peak_bytes", "special_primes"]

BOOTSTRAP_RING = 1 << 16
COEFFS_TO_SLOTS_BITS = (56,) * 4
EVAL_MOD_BITS = (60,) * 9
SLOTS_TO_COEFFS_BITS = (39,) * 3
CIRCUIT_BITS = sum(COEFFS_TO_SLOTS_BITS) + sum(EVAL_MOD_BITS) + sum(SLOTS_TO_COEFFS_BITS)
# Key switching inside the bootstrap: 61-bit special primes, as many as make the bootstrapping keys smallest
# within the 128-bit bound (``special_primes``): a key holds ceil(#Q / #P) digits of #Q + #P primes each, so
# more special primes make every key smaller (memory is what limits bootstrapping here), at the price of
# residual levels. Six is the count the residual chains are sized with.
SPECIAL_PRIME_BITS = 61
BOOT_SPECIAL_PRIMES = (SPECIAL_PRIME_BITS,) * 6
SPECIAL_PRIME_COUNTS = range(4, 13)
FIRST_PRIME_BITS = 60  # the bootstrap reads its input from Q[0]: room for the message at Lattigo's 2^8 ratio
RESIDUAL_SPECIAL_BITS = 60
# The ring a program runs on between bootstraps: the smallest that holds its slots (down to 2^14; 2^13 leaves
# one level), so its linear maps, plaintexts and Galois keys cost a quarter of the bootstrapping ring's; the
# bootstrap switches the ciphertext to N=2^16 and back (Lattigo's ring switching: every residual prime is
# then = 1 mod 2^17).
RESIDUAL_RINGS = (1 << 14, 1 << 15, 1 << 16)
# Galois keys Lattigo's bootstrapping holds at 2^log_slots slots (CoeffsToSlots, SlotsToCoeffs, conjugation,
# relinearisation and the sparse-secret encapsulation keys); measured here from the marshalled key sets
# (Lattigo 6.2: 34 keys at 2^10 slots, 40 at 2^12, 42 at 2^13), extrapolated by 2 per doubling above.
BOOTSTRAP_KEYS_BY_LOG_SLOTS = {10: 34, 11: 37, 12: 40, 13: 42}
# Generating and marshalling the bootstrapping keys through the wheel peaks at this multiple of their size
# (Go's keys, Go's marshalled buffer, its C copy, Python's bytes; measured 3.96x at 4.3 and 5.9 GB).
KEYGEN_PEAK_FACTOR = 4.0
# A Lattigo server holds its key set three times while it starts: the uploaded context, Go's copy of it and the
# unmarshalled keys.
LATTIGO_KEY_COPIES = 3
# A bootstrapping Lattigo server, measured on monet_fhe_deep_bn (width 64: 9,992 and, shifts factored, 3,833
# diagonals; 4.26 GB of bootstrapping keys for 2^13 slots on N=2^16; residual N=2^14; GOGC=25). It loads the keys
# first, so their copies are collected before the diagonals are encoded. Serving,
# Go's heap holds every encoded diagonal (1.3x the planner's plaintext bytes: Lattigo's transforms beside the raw
# float64 diagonals), the keys, and the bootstrapper's own transforms and temporaries (0.85x its key bytes), and
# grows by GOGC=25% past what is live before it collects; the Python process adds about 1 GB.
SERVER_PLAINTEXT_FACTOR = 1.3
BOOTSTRAPPER_STATE_PER_KEY_BYTE = 0.85
GO_HEAP_GROWTH = 1.25
SERVER_PROCESS_BYTES = 1_000_000_000


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


CIRCUIT_PRIMES = len(COEFFS_TO_SLOTS_BITS) + len(EVAL_MOD_BITS) + len(SLOTS_TO_COEFFS_BITS)


def bootstrap_galois_keys(log_slots: int) -> int:
    """Keys in Lattigo's bootstrapping key set at ``2^log_slots`` slots (measured table, see above)."""
    if log_slots in BOOTSTRAP_KEYS_BY_LOG_SLOTS:
        return BOOTSTRAP_KEYS_BY_LOG_SLOTS[log_slots]
    top = max(BOOTSTRAP_KEYS_BY_LOG_SLOTS)
    low = min(BOOTSTRAP_KEYS_BY_LOG_SLOTS)
    return BOOTSTRAP_KEYS_BY_LOG_SLOTS[top] + 2 * (log_slots - top) if log_slots > top else \
        BOOTSTRAP_KEYS_BY_LOG_SLOTS[low]


def bootstrap_key_bytes(params: CKKSParams, spec: BootstrapSpec) -> int:
    """Bytes of the bootstrapping keys: each holds ceil(#Q / #P) digits of two polynomials over #Q + #P primes
    on the bootstrapping ring (8 bytes a coefficient), #Q = residual ciphertext primes + the circuit's."""
    q = len(params.coeff_mod_bits) - 1 + CIRCUIT_PRIMES
    p = len(spec.logp)
    digits = -(-q // p)
    return bootstrap_galois_keys(spec.log_slots) * digits * 2 * (1 << spec.logn) * (q + p) * 8


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


def bootstraps_needed(depth: int, levels: int) -> int:
    """Bootstraps for ``depth`` levels on a chain of ``levels``: a segment spends one level scaling into the
    bootstrap, so each gives ``levels - 1`` (the last ``levels``)."""
    return max(0, math.ceil((depth - levels) / (levels - 1)))


@dataclass(frozen=True)
class BootstrapChoice:
    """One candidate residual chain: its parameters, spec, bootstraps, and predicted bootstrapping-key bytes."""

    params: CKKSParams
    spec: BootstrapSpec
    bootstraps: int
    key_bytes: int

    @property
    def keygen_peak_bytes(self) -> int:
        return int(KEYGEN_PEAK_FACTOR * self.key_bytes)

    def describe(self) -> str:
        return (f"residual N={self.params.poly_modulus_degree}, {self.params.levels} levels at 2^"
                f"{self.params.scale_bits}, {self.bootstraps} bootstrap(s) of 2^{self.spec.log_slots} slots, "
                f"bootstrapping keys {self.key_bytes / 1e9:.1f} GB (key generation peaks near "
                f"{self.keygen_peak_bytes / 1e9:.0f} GB)")


def bootstrap_candidates(depth: int, slots_needed: int, *, scale_bits: int | None = None, max_scale_bits: int = 40,
                         min_scale_bits: int = 30) -> list[BootstrapChoice]:
    """Every residual ring and scale that holds ``slots_needed`` with at least 2 levels, cheapest first: fewest
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
            out.append(BootstrapChoice(params, spec, bootstraps_needed(depth, levels), bootstrap_key_bytes(params, spec)))
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


def machine_memory_budget(fraction: float = 0.75) -> int | None:
    """``fraction`` of this machine's physical memory (None where the platform does not say): the rest holds the
    program, its plaintexts and the evaluator beside the bootstrapping keys."""
    try:
        return int(fraction * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


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
    (ring switching from a smaller residual ring), with the special primes that make its keys smallest;
    insecure test rings (``allow_insecure``) bootstrap on their own ring with six special primes."""
    log_slots = max(1, math.ceil(math.log2(max(slots, 2))))
    log_slots = min(log_slots, int(math.log2(params.slots)))
    if params.security != "tc128" and params.poly_modulus_degree < BOOTSTRAP_RING:
        return BootstrapSpec(int(math.log2(params.poly_modulus_degree)), BOOT_SPECIAL_PRIMES, log_slots)
    logn = int(math.log2(BOOTSTRAP_RING))
    return BootstrapSpec(logn, special_primes(params, logn), log_slots)


def check_bootstrap_security(params: CKKSParams, spec: BootstrapSpec) -> tuple[bool, int, int | None]:
    """(secure, modulus bits, bound) of the bootstrapping keys' modulus."""
    bits = bootstrap_modulus_bits(params, spec)
    bound = MAX_BITS_128.get(1 << spec.logn)
    return (bound is not None and bits <= bound), bits, bound


def server_peak_bytes(plaintext_bytes: int, bootstrap_keys: int, galois_keys: int) -> tuple[int, int]:
    """(while loading the keys, while serving): a bootstrapping Lattigo server's resident bytes (see
    ``SERVER_PLAINTEXT_FACTOR``); the larger is its peak."""
    loading = SERVER_PROCESS_BYTES + LATTIGO_KEY_COPIES * bootstrap_keys + galois_keys
    live = (SERVER_PLAINTEXT_FACTOR * plaintext_bytes + (1.0 + BOOTSTRAPPER_STATE_PER_KEY_BYTE) * bootstrap_keys
            + galois_keys)
    return int(loading), int(SERVER_PROCESS_BYTES + GO_HEAP_GROWTH * live)
