"""How a single-layout program stores a linear term's diagonals: each row pre-rotated by its giant step.

Diagonal ``k`` of a map acts as ``out[j] += d_k[j] * in[(j + k) mod slots]``. With baby-step size ``b``, the
program stores row ``d_k`` rolled by its giant step ``(k // b) * b``, so an evaluator can multiply baby-rotated
inputs by the stored rows and rotate each giant step's partial sum once. The planner writes this convention,
engines and rewrites read it back: one pair of functions for all of them.
"""

from __future__ import annotations

import numpy as np

__all__ = ["giant_steps", "plain_diagonals", "stored_diagonals"]


def giant_steps(ks: np.ndarray, baby: int) -> np.ndarray:
    """The giant step ``(k // baby) * baby`` of each diagonal offset."""
    return (np.asarray(ks, dtype=np.int64) // baby) * baby


def _rolled(rows: np.ndarray, shifts: np.ndarray) -> np.ndarray:
    return np.stack([np.roll(row, int(s)) for row, s in zip(rows, shifts, strict=True)]) if len(rows) else rows


def stored_diagonals(ks: np.ndarray, plain: np.ndarray, baby: int) -> np.ndarray:
    """Rows as the program stores them, from rows as the map applies them."""
    return _rolled(plain, giant_steps(ks, baby))


def plain_diagonals(ks: np.ndarray, stored: np.ndarray, baby: int) -> np.ndarray:
    """Rows as the map applies them (``out[j] += row[j] * in[j + k]``), from rows as the program stores them."""
    return _rolled(stored, -giant_steps(ks, baby))
