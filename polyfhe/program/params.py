"""CKKS parameters: the chosen ring and modulus chain, and how they are chosen from a program's needs.

Security follows the HE standard's bounds for ternary secrets (SEAL's ``CoeffModulus::MaxBitCount`` at
128 bits): the total modulus, special prime included, must stay within ``MAX_BITS_128[N]``. Each level is
one rescale by a prime of ``scale_bits``; the first prime holds the final value (scale + output headroom);
the special prime is as large as the first for key-switching noise.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass

from polyfhe.program.sizes import ciphertext_bytes, key_switching_key_bytes

__all__ = [
    "DEFAULT_MIN_SCALE_BITS", "MAX_BITS_128", "CKKSParams", "InsecureParametersError", "ParameterError",
    "choose_params", "fingerprint_params", "largest_value", "max_levels", "require_secure", "security_bits_ok",
]

log = logging.getLogger(__name__)

# Largest log2(QP) for 128-bit classical security with a uniform ternary secret (error sigma 3.2):
# * N = 2^10 .. 2^15: the Homomorphic Encryption Standard (Albrecht et al., homomorphicencryption.org, v1.1,
#   Nov. 2018; Table "uniform ternary secret", 128-bit classical), the same numbers as SEAL's tc128 table. The
#   standard stops at 2^15 (881 bits).
# * N = 2^16: 1,747 bits, OpenFHE's table (src/core/lib/lattice/stdlatticeparms.cpp, HEStd_ternary,
#   HEStd_128_classic; in every release since v1.2.0, still in v1.5.1), added by OpenFHE PR #807 (June 2024) from
#   Table 5.2 of ePrint 2024/463 (Bossuat et al., "Security Guidelines for Implementing Homomorphic Encryption"),
#   estimated with the lattice estimator under the MATZOV cost model (OpenFHE issue #806; the paper, not OpenFHE,
#   records the estimator's version). Lattigo itself publishes no bound at 2^16 for this secret.
# N=65536 serves bootstrapping programs only (the bootstrapping engine's ``bootstrapping.ring``); leveled ones choose among RING_SIZES.
MAX_BITS_128 = {1024: 27, 2048: 54, 4096: 109, 8192: 218, 16384: 438, 32768: 881, 65536: 1747}
RING_SIZES = (8192, 16384, 32768)
MAX_PRIME_BITS = 60
DEFAULT_MIN_SCALE_BITS = 30  # the smallest scale chosen unless a plan spends levels (export/ckks/spend.py)


class ParameterError(ValueError):
    """No secure parameter set fits the program, or an override is insecure or malformed."""


class InsecureParametersError(ValueError):
    """A program's parameters were exported insecure (``security="none"``) and insecure use was not allowed."""

    flag = "--allow-insecure"


def require_secure(params: CKKSParams, allow_insecure: bool, what: str) -> None:
    """Refuse to ``what`` (e.g. "run", "create keys for", "serve") a program whose parameters are insecure
    (``security="none"``: exported with ``allow_insecure``) unless ``allow_insecure``; warns when it is allowed.
    The one check the commands and the server share; raises :class:`InsecureParametersError`."""
    if params.security == "tc128":
        return
    if not allow_insecure:
        raise InsecureParametersError(
            f"refusing to {what} a program with insecure CKKS parameters ({params.describe()}): they do not meet "
            f"128-bit security and must never hold real data; pass {InsecureParametersError.flag} to {what} it "
            "anyway (tests and experiments only)")
    log.warning("INSECURE CKKS PARAMETERS allowed (%s): %s. Never use them for real data.", what, params.describe())


@dataclass(frozen=True)
class CKKSParams:
    poly_modulus_degree: int
    coeff_mod_bits: tuple[int, ...]  # first (output) prime, one prime per level, special prime
    scale_bits: int
    security: str = "tc128"  # "tc128" or "none" (allow_insecure only)

    @property
    def slots(self) -> int:
        return self.poly_modulus_degree // 2

    @property
    def levels(self) -> int:
        return len(self.coeff_mod_bits) - 2

    @property
    def total_bits(self) -> int:
        return sum(self.coeff_mod_bits)

    @property
    def scale(self) -> float:
        return float(2.0**self.scale_bits)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["coeff_mod_bits"] = list(self.coeff_mod_bits)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> CKKSParams:
        try:
            return cls(int(d["poly_modulus_degree"]), tuple(int(b) for b in d["coeff_mod_bits"]),
                       int(d["scale_bits"]), str(d.get("security", "tc128")))
        except (KeyError, TypeError, ValueError) as exc:
            raise ParameterError(f"malformed CKKS parameters {d!r}: {exc}") from exc

    def describe(self) -> str:
        return (f"N={self.poly_modulus_degree} ({self.slots} slots), modulus {list(self.coeff_mod_bits)} "
                f"= {self.total_bits} bits, scale 2^{self.scale_bits}, {self.levels} levels, security {self.security}")


def fingerprint_params(params: CKKSParams) -> str:
    import hashlib
    import json

    return hashlib.sha256(json.dumps(params.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def security_bits_ok(params: CKKSParams) -> bool:
    bound = MAX_BITS_128.get(params.poly_modulus_degree)
    return bound is not None and params.total_bits <= bound


def validate(params: CKKSParams, allow_insecure: bool = False) -> CKKSParams:
    """Check shape and security; an insecure set passes only with ``allow_insecure`` (and a loud warning)."""
    n = params.poly_modulus_degree
    if n not in MAX_BITS_128:
        raise ParameterError(f"poly_modulus_degree {n} is not supported; accepted: {sorted(MAX_BITS_128)}")
    if len(params.coeff_mod_bits) < 2 or any(not 20 <= b <= MAX_PRIME_BITS for b in params.coeff_mod_bits):
        raise ParameterError(f"coeff_mod_bits {list(params.coeff_mod_bits)}: need >= 2 primes of 20..60 bits")
    if not security_bits_ok(params) or params.security != "tc128":
        if not allow_insecure:
            raise ParameterError(
                f"{params.describe()} exceeds the 128-bit bound of {MAX_BITS_128[n]} bits for N={n}; "
                "use a larger ring or fewer/smaller primes (allow_insecure=True overrides, for experiments only)")
        log.warning("INSECURE CKKS PARAMETERS: %s (128-bit bound for N=%d is %d bits). Never use them for real data.",
                    params.describe(), n, MAX_BITS_128[n])
        return CKKSParams(params.poly_modulus_degree, params.coeff_mod_bits, params.scale_bits, "none")
    return params


def choose_params(
    levels: int,
    slots_needed: int,
    max_abs_value: float,
    *,
    scale_bits: int | None = None,
    max_scale_bits: int = 40,
    min_scale_bits: int = DEFAULT_MIN_SCALE_BITS,
    poly_modulus_degree: int | None = None,
    reserve_bits: int = 0,
) -> CKKSParams:
    """The smallest secure ring that holds ``slots_needed`` values and ``levels`` rescales, largest scale first.

    ``reserve_bits``: stay this far under the bound (an engine whose primes may lie just above ``2^bits``).

    The first prime holds ``scale * max_abs_value`` with 8 bits of margin. Raises :class:`ParameterError`
    saying how many levels are needed and how many fit when nothing does.
    """
    headroom = _headroom(max_abs_value)
    rings = [poly_modulus_degree] if poly_modulus_degree else list(RING_SIZES)
    scales = [scale_bits] if scale_bits else list(range(max_scale_bits, min_scale_bits - 1, -1))
    best_fit: list[str] = []
    for n in rings:
        if n // 2 < slots_needed:
            best_fit.append(f"N={n}: {n // 2} slots < {slots_needed} values")
            continue
        for s in scales:
            first = min(MAX_PRIME_BITS, s + headroom)
            if first - s < headroom:
                continue
            bits = (first, *([s] * levels), first)
            if sum(bits) <= MAX_BITS_128[n] - reserve_bits:
                return CKKSParams(n, bits, s)
        s = scales[-1]
        fit = max_levels(n, max_abs_value, s, reserve_bits)
        best_fit.append(f"N={n}: {fit} levels at a {s}-bit scale")
    raise ParameterError(
        f"the program needs {levels} levels on {slots_needed} slots with values up to {max_abs_value:.3g}; "
        f"leveled CKKS at 128-bit security offers: {'; '.join(best_fit)}. Use a shallower model (fewer "
        "Poly-Blocks / lower degree), a smaller input, or calibrate to tighter value ranges.")


HEADROOM_MARGIN_BITS = 8  # bits of margin above the largest value a ciphertext must hold


def _headroom(max_abs_value: float) -> int:
    """Bits the first prime holds above the scale: the largest value plus the margin."""
    return max(1, math.ceil(math.log2(max(max_abs_value, 1.0)))) + HEADROOM_MARGIN_BITS


def largest_value(params: CKKSParams, level: int = 0) -> float:
    """The largest magnitude a ciphertext of ``params`` holds at ``level`` (0: the first prime alone) with the
    margin :func:`choose_params` plans with: its primes carry the scale, the value's bits and the margin."""
    return 2.0 ** (sum(params.coeff_mod_bits[:level + 1]) - params.scale_bits - HEADROOM_MARGIN_BITS)


def max_levels(poly_modulus_degree: int, max_abs_value: float, scale_bits: int, reserve_bits: int = 0) -> int:
    """Levels a secure chain of ``scale_bits`` primes holds on this ring (first and special prime as chosen above)."""
    first = min(MAX_PRIME_BITS, scale_bits + _headroom(max_abs_value))
    return max(0, (MAX_BITS_128[poly_modulus_degree] - reserve_bits - 2 * first) // scale_bits)


BROWSER_UPLOAD_BUDGET = 150 * 10**6  # bytes of public context a web page uploads at most (docs/serve.md)
# a seeded key ciphertext beyond its one polynomial: SEAL header, members, DynArray header and count, and the
# PRNG info (type and 512-bit seed) its random half is regenerated from (measured on node-seal 7's output)
SEEDED_FRAMING = 194
KSWITCH_FRAMING = 16 + 32 + 8  # SEAL header, parms_id, row count


def seeded_sizes(params: CKKSParams, galois_keys: int) -> dict[str, int]:
    """Exact bytes of the public keys as the web page sends them: seeded (each key ciphertext's uniformly random
    second half replaced by its seed) and uncompressed, about half of :func:`estimated_sizes`."""
    n, primes = params.poly_modulus_degree, len(params.coeff_mod_bits)
    part = ciphertext_bytes(n, primes, polys=1, framing=SEEDED_FRAMING)  # one key ciphertext, seeded
    key = key_switching_key_bytes(n, primes - 1, primes, digit_framing=SEEDED_FRAMING, polys=1)  # one per data prime
    galois = KSWITCH_FRAMING + 8 * n + galois_keys * key if galois_keys else 0  # a row count per Galois element
    relin = KSWITCH_FRAMING + 8 + key
    return {"public_key": part, "relin_keys": relin, "galois_keys": galois, "galois_key": key,
            "public_context": part + relin + galois}


def estimated_sizes(params: CKKSParams, galois_keys: int) -> dict[str, int]:
    """Uncompressed SEAL object sizes in bytes; the zstd-serialised ones that travel are 10-40% smaller.

    A key-switching key (one relinearisation key, or one Galois key) holds a ciphertext per data prime.
    """
    n, primes = params.poly_modulus_degree, len(params.coeff_mod_bits)
    key = key_switching_key_bytes(n, primes - 1, primes)
    public_key = ciphertext_bytes(n, primes)
    return {"public_key": public_key, "relin_keys": key, "galois_keys": galois_keys * key,
            "public_context": (galois_keys + 1) * key + public_key, "ciphertext": ciphertext_bytes(n, primes - 1)}
