"""Per-value abstract state and the algebra the rules combine it with.

A value is either public (``const``: known at compile time) or ``encrypted`` (depends on a graph input).
For encrypted values we track an upper bound on the total degree in the inputs, the ct x ct
multiplicative depth, and two CKKS level counters:

* ``lvl``: rescales consumed when the value is used as is;
* ``lvl_lin``: rescales consumed if a further plaintext-linear map is applied on top of it. Adjacent
  plaintext-linear maps (a bias add or data movement in between is fine) merge into one plaintext
  matrix, so the second map costs nothing: after a linear map ``lvl == lvl_lin``; after a ct x ct
  product or a fresh input, ``lvl_lin == lvl + 1``.

``UNKNOWN`` is the state of values downstream of a violation: nothing about them is bounded.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["CONST", "UNKNOWN", "ValueState", "ceil_log2", "join", "linear", "power", "power_mults", "product"]


@dataclass(frozen=True)
class ValueState:
    """Abstract state of one tensor. Fields other than ``encrypted`` are None only for UNKNOWN."""

    encrypted: bool
    degree: int | None = 0
    mult_depth: int | None = 0
    lvl: int | None = 0
    lvl_lin: int | None = 0

    @property
    def unknown(self) -> bool:
        return self.degree is None

    @classmethod
    def fresh_input(cls) -> ValueState:
        """A freshly encrypted graph input: degree 1, no products yet, one level for a linear map."""
        return cls(encrypted=True, degree=1, mult_depth=0, lvl=0, lvl_lin=1)


CONST = ValueState(encrypted=False)
UNKNOWN = ValueState(encrypted=True, degree=None, mult_depth=None, lvl=None, lvl_lin=None)


def ceil_log2(k: int) -> int:
    """Squarings needed for x**k in the best chain (x^3 and x^4 both need 2)."""
    return max(0, (k - 1).bit_length())


def power_mults(k: int) -> int:
    """ct x ct multiplications of square-and-multiply for x**k."""
    return 0 if k < 2 else (k.bit_length() - 1) + (k.bit_count() - 1)


def _encrypted(states: Iterable[ValueState | None]) -> list[ValueState]:
    return [s for s in states if s is not None and s.encrypted]


def join(states: Iterable[ValueState | None]) -> ValueState:
    """Add/Sub/Sum/Concat: maxima over the encrypted operands; constant operands cost nothing."""
    enc = _encrypted(states)
    if not enc:
        return CONST
    if any(s.unknown for s in enc):
        return UNKNOWN
    return ValueState(
        encrypted=True,
        degree=max(s.degree for s in enc),
        mult_depth=max(s.mult_depth for s in enc),
        lvl=max(s.lvl for s in enc),
        lvl_lin=max(s.lvl_lin for s in enc),
    )


def linear(data: ValueState, *additive: ValueState | None) -> ValueState:
    """A plaintext-linear map (const weights) on ``data``, plus optional additive terms (a bias).

    The map merges with any pending linear map of ``data``, so its level becomes ``data.lvl_lin``.
    """
    if data.unknown:
        return UNKNOWN
    mapped = ValueState(True, data.degree, data.mult_depth, data.lvl_lin, data.lvl_lin)
    return join([mapped, *additive])


def product(a: ValueState, b: ValueState) -> ValueState:
    """A ciphertext x ciphertext product: degrees add, one more level and depth."""
    if a.unknown or b.unknown:
        return UNKNOWN
    lvl = max(a.lvl, b.lvl) + 1
    return ValueState(
        encrypted=True,
        degree=a.degree + b.degree,
        mult_depth=max(a.mult_depth, b.mult_depth) + 1,
        lvl=lvl,
        lvl_lin=lvl + 1,
    )


def power(a: ValueState, k: int) -> ValueState:
    """``a ** k`` for a constant integer k >= 1 by repeated squaring (k = 1 is the identity)."""
    if a.unknown or k == 1:
        return a
    steps = ceil_log2(k)
    lvl = a.lvl + steps
    return ValueState(
        encrypted=True,
        degree=a.degree * k,
        mult_depth=a.mult_depth + steps,
        lvl=lvl,
        lvl_lin=lvl + 1,
    )
