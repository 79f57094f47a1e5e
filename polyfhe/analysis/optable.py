"""The op table shared by the analyzer and the CKKS compiler.

It is derived, not written twice: every op the analyzer accepts on encrypted values comes from its rule
(:func:`~polyfhe.analysis.registry.register_rule`), with the :class:`Lowering` kinds the rule declares,
plus the public shape ops (Shape, Size), whose outputs the compiler reads as constants. The compiler's
side is its handler registry ``LINEAR_OPS`` (``export/ckks/affine.py``) and ``lower.py`` for the other
kinds; ``tests/export/ckks/test_ckks_op_table.py`` holds the two to this table in both directions and compiles
one graph per (op, kind).
"""

from __future__ import annotations

from dataclasses import dataclass

from polyfhe.analysis import rules as _rules  # noqa: F401  (registers the built-in rules)
from polyfhe.analysis.constants import PUBLIC_SHAPE_OPS
from polyfhe.analysis.registry import Lowering, allowed_ops, get_rule

__all__ = ["Lowering", "OpEntry", "op_table", "ops_lowered_as"]


@dataclass(frozen=True)
class OpEntry:
    """One op on encrypted values: when the analyzer accepts it and how the compiler lowers it."""

    op: str
    summary: str
    lowering: tuple[Lowering, ...]


def op_table() -> dict[str, OpEntry]:
    """Op type -> entry, for every op the analyzer lets touch an encrypted value."""
    table = {op: OpEntry(op, "always: shapes are public", (Lowering.PUBLIC,)) for op in sorted(PUBLIC_SHAPE_OPS)}
    for op in allowed_ops():
        rule = get_rule("", op)
        table[op] = OpEntry(op, rule.summary, rule.lowering)
    return dict(sorted(table.items()))


def ops_lowered_as(kind: Lowering) -> frozenset[str]:
    """Ops the compiler lowers (at least sometimes) in the given way, e.g. those needing a linear handler."""
    return frozenset(op for op, entry in op_table().items() if kind in entry.lowering)
