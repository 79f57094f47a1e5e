"""The CKKS compiler's passes, one module each; ``pipeline.py`` names their order and runs them.

Each module's ``PASS`` is a :class:`Pass`: its name, its function over the
:class:`~polyfhe.exporters.ckks.state.CompileState`, and the state fields it writes (its docstring says what
it reads, and why it does what it does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Pass"]


@dataclass(frozen=True)
class Pass:
    """One compiler pass: ``run(state)`` writes the state fields named in ``writes`` and no others."""

    name: str
    run: Callable[[Any], None]
    writes: tuple[str, ...]
