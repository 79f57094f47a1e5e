"""What the compiler, the cost model and an engine that bootstraps say to each other about bootstrapping.

The facts (which ring, which circuit, how large its keys are, whether a parameter set is secure) are the
engine's: its record's ``bootstrapping`` part (:class:`~polyfhe.program.engine_api.BootstrapModel`). Here are the
values that cross that boundary and the arithmetic that holds for any engine. Pure data; no engine import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from polyfhe.program.params import CKKSParams, ParameterError

__all__ = ["BootstrapChoice", "BootstrapSecurity", "BootstrapSpec", "bootstraps_needed"]


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


@dataclass(frozen=True)
class BootstrapChoice:
    """One candidate residual chain: its parameters, spec, bootstraps, predicted bootstrapping-key bytes and the
    peak its key generation reaches (the engine's estimate)."""

    params: CKKSParams
    spec: BootstrapSpec
    bootstraps: int
    key_bytes: int
    keygen_peak_bytes: int

    def describe(self) -> str:
        return (f"residual N={self.params.poly_modulus_degree}, {self.params.levels} levels at 2^"
                f"{self.params.scale_bits}, {self.bootstraps} bootstrap(s) of 2^{self.spec.log_slots} slots, "
                f"bootstrapping keys {self.key_bytes / 1e9:.1f} GB (key generation peaks near "
                f"{self.keygen_peak_bytes / 1e9:.0f} GB)")


@dataclass(frozen=True)
class BootstrapSecurity:
    """The verdict on a bootstrapping parameter set: ``log_qp`` (sum of log2 of every Q and P prime of the
    bootstrapping modulus), ``bound`` (the 128-bit bound of its ring), and why it is insecure (``problems``)."""

    log_qp: float
    bound: int | None
    problems: tuple[str, ...]
    q: tuple[int, ...] = ()
    p: tuple[int, ...] = ()

    @property
    def secure(self) -> bool:
        return not self.problems


def bootstraps_needed(depth: int, levels: int) -> int:
    """Bootstraps for ``depth`` levels on a chain of ``levels``: a segment spends one level scaling into the
    bootstrap, so each gives ``levels - 1`` (the last ``levels``)."""
    return max(0, math.ceil((depth - levels) / (levels - 1)))

