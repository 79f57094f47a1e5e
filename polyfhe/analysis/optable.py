"""The op table shared by the analyzer and the CKKS compiler.

It is derived, not written twice: every op the analyzer accepts on encrypted values comes from its rule
(:func:`~polyfhe.analysis.registry.register_rule`), with the :class:`Lowering` kinds the rule declares,
plus the public shape ops (Shape, Size), whose outputs the compiler reads as constants. The compiler's
side is its handler registry ``LINEAR_OPS`` (``export/ckks/affine.py``) and ``lower.py`` for the other
kinds; ``tests/export/ckks/test_ckks_op_table.py`` holds the two to this table in both directions and compiles
one graph per (op, kind).

An entry says how an op is lowered when it is; the operand patterns a rule accepts as polynomial but the
compiler does not lower are the analyzer's ``not_lowered`` answer. Engines name the compiler whose lowerings
they run (:data:`LOWERING_ENGINES`): every CKKS engine runs the CKKS compiler's programs.
"""

from __future__ import annotations

from dataclasses import dataclass

from polyfhe.analysis import rules as _rules  # noqa: F401  (registers the built-in rules)
from polyfhe.analysis.constants import PUBLIC_SHAPE_OPS
from polyfhe.analysis.registry import CKKS_COMPILER, Lowering, allowed_ops, get_rule
from polyfhe.program.engines import BACKEND_NAMES

__all__ = ["LOWERING_ENGINES", "Lowering", "OpEntry", "compiler_for", "op_table", "ops_lowered_as"]

# engine (or compiler) name -> the compiler whose lowerings it runs, as named in ``NotLowered.engine``
LOWERING_ENGINES: dict[str, str] = {CKKS_COMPILER: CKKS_COMPILER, **{name: CKKS_COMPILER for name in BACKEND_NAMES}}


@dataclass(frozen=True)
class OpEntry:
    """One op on encrypted values: when the analyzer accepts it and how the compiler lowers it."""

    op: str
    summary: str
    lowering: tuple[Lowering, ...]

    @property
    def lowered(self) -> bool:
        """False for an op that is polynomial but that the compiler never lowers."""
        return bool(self.lowering)


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


def compiler_for(engine: str) -> str:
    """The compiler an engine runs; raises ``ValueError`` listing the accepted names."""
    if engine not in LOWERING_ENGINES:
        raise ValueError(f"unknown engine {engine!r}; accepted: {sorted(LOWERING_ENGINES)}")
    return LOWERING_ENGINES[engine]
