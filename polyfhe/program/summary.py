"""A program's summary: a plain dict (indexed, compared and JSON-dumped as before) that prints readably."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["ProgramSummary"]

MAX_LIST_ITEMS = 8


def _value(value: Any) -> str:
    if isinstance(value, Mapping):  # only an empty one: the others are indented under their key
        return "none"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)) and len(value) > MAX_LIST_ITEMS:
        head = ", ".join(_value(v) for v in value[:MAX_LIST_ITEMS])
        return f"[{head}, ... ({len(value)} items)]"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return str(value)


def _lines(items: Mapping[str, Any], indent: int) -> list[str]:
    width = max((len(str(k)) for k in items), default=0)
    out = []
    for key, value in items.items():
        if isinstance(value, Mapping) and value:
            out.append(f"{' ' * indent}{key}:")
            out.extend(_lines(value, indent + 2))
        else:
            out.append(f"{' ' * indent}{str(key).ljust(width)}  {_value(value)}")
    return out


class ProgramSummary(dict):
    """``program.summary()``: every key of the dict it always was; ``print()`` shows it as an indented table
    under a one-line title (what ``repr(program)`` says)."""

    def __init__(self, *args: Any, title: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.title = title

    def __str__(self) -> str:
        return "\n".join(([self.title] if self.title else []) + _lines(self, 2 if self.title else 0))
