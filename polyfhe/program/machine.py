"""How much memory this machine has: the budget bootstrapping keys, compiled terms and plaintext stores plan for."""

from __future__ import annotations

import os

__all__ = ["machine_memory_budget"]


def machine_memory_budget(fraction: float = 0.75) -> int | None:
    """``fraction`` of this machine's physical memory (None where the platform does not say): the rest holds the
    program, its plaintexts and the evaluator beside the bootstrapping keys."""
    try:
        return int(fraction * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None
