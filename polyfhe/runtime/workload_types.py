"""What one evaluation of a program does and holds: the data type engines' tallies and the cost model share."""

from __future__ import annotations

from dataclasses import dataclass, field

from polyfhe.program.params import CKKSParams
from polyfhe.runtime.opcosts import Tally

__all__ = ["COUNTER_NAMES", "Workload", "data_primes", "empty_counters"]

COUNTER_NAMES = ("rotations", "key_switches", "plain_products", "encodes_cold")  # as the manifest's info.planned


@dataclass(frozen=True)
class Workload:
    """One evaluation (one query): operation sites and counts, plus what memory depends on.

    ``tally`` excludes bootstraps (``bootstraps`` of ``boot_spec``); ``encodes`` are the plaintexts a cold run
    encodes (``plaintext_bytes`` all of them held at their levels); ``live_ciphertexts`` the most ciphertexts
    (registers, rotated copies) held at once; ``samples`` the images one evaluation serves.
    """

    engine: str
    source: str  # "compiled" or "estimated"
    params: CKKSParams
    tally: Tally
    galois_keys: int
    relin: bool
    plaintexts: int
    plaintext_bytes: int
    live_ciphertexts: int
    samples: int = 1
    bootstraps: int = 0
    boot_spec: dict | None = None
    counters: dict = field(default_factory=dict)  # rotations, key switches, products, encodes (as info.planned)
    notes: tuple[str, ...] = ()

    @property
    def depth(self) -> int:
        return self.params.levels


def data_primes(params: CKKSParams, level: int) -> int:
    """Primes of a ciphertext after ``level`` rescales (special prime excluded)."""
    return len(params.coeff_mod_bits) - 1 - level


def empty_counters() -> dict[str, int]:
    return dict.fromkeys(COUNTER_NAMES, 0)
