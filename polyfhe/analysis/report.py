"""Typed results of the degree analyzer.

These frozen dataclasses are the boundary between ``analyze()`` and its consumers (the CLI, the CKKS
exporter choosing parameters, tests). Each has ``to_dict()`` / ``from_dict()`` producing plain
JSON-serialisable values, so a report can be stored next to a compiled program and read back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

__all__ = ["AnalysisReport", "NodeInfo", "NotLowered", "OpCounts", "OutputInfo", "Violation"]


@dataclass(frozen=True)
class Violation:
    """A node that makes the graph non-polynomial (or not provably so) on encrypted data."""

    node: str
    op: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"node": self.node, "op": self.op, "reason": self.reason}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Violation:
        return cls(node=str(data["node"]), op=str(data["op"]), reason=str(data.get("reason", "")))


@dataclass(frozen=True)
class NotLowered:
    """A polynomial node that ``engine``'s compiler does not lower: the model is polynomial, yet it will not compile."""

    node: str
    op: str
    engine: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"node": self.node, "op": self.op, "engine": self.engine, "reason": self.reason}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NotLowered:
        return cls(node=str(data["node"]), op=str(data["op"]), engine=str(data.get("engine", "")),
                   reason=str(data.get("reason", "")))


class _ScalarRecord:
    """``to_dict``/``from_dict`` for frozen dataclasses whose fields are JSON scalars (see ``_FIELD_TYPES``)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Any:
        values = {}
        for f in fields(cls):  # type: ignore[arg-type]
            convert = _FIELD_TYPES[f.name]
            values[f.name] = convert(data.get(f.name)) if convert is _opt_int else convert(data[f.name])
        return cls(**values)


@dataclass(frozen=True)
class NodeInfo(_ScalarRecord):
    """Per-node result. ``degree``/``mult_depth``/``level`` are None downstream of a violation."""

    name: str
    op: str
    encrypted: bool
    degree: int | None
    mult_depth: int | None
    level: int | None


@dataclass(frozen=True)
class OutputInfo(_ScalarRecord):
    """Degree, ct x ct depth and CKKS level of one graph output."""

    name: str
    encrypted: bool
    degree: int | None
    mult_depth: int | None
    level: int | None


@dataclass(frozen=True)
class OpCounts:
    """Operations applied to encrypted values.

    ``by_op`` counts nodes per ONNX op type (violating nodes included); ``ct_ct_mults`` counts
    ciphertext x ciphertext multiplications (``Pow(x, k)`` counts its square-and-multiply steps);
    ``pt_mults`` counts plaintext-linear maps (each costs a rescale unless merged with a neighbour).
    """

    by_op: Mapping[str, int] = field(default_factory=dict)
    ct_ct_mults: int = 0
    pt_mults: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_op", dict(sorted(self.by_op.items())))

    def to_dict(self) -> dict[str, Any]:
        return {"by_op": dict(self.by_op), "ct_ct_mults": self.ct_ct_mults, "pt_mults": self.pt_mults}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OpCounts:
        return cls(
            by_op={str(k): int(v) for k, v in dict(data.get("by_op", {})).items()},
            ct_ct_mults=int(data.get("ct_ct_mults", 0)),
            pt_mults=int(data.get("pt_mults", 0)),
        )


@dataclass(frozen=True)
class AnalysisReport:
    """Whole-model result of :func:`polyfhe.analysis.analyze`: two answers, polynomial and lowered.

    ``polynomial`` is True only when no node violates the allow-list. ``degree`` (total degree in the
    encrypted inputs), ``mult_depth`` (sequential ct x ct products) and ``levels`` (CKKS rescales after
    merging adjacent plaintext-linear maps) are maxima over the graph outputs, and None when the graph is
    not polynomial: nothing downstream of a violation is bounded. ``not_lowered`` lists the polynomial
    nodes an engine's compiler has no lowering for (a Gemm of two encrypted operands, ...).
    """

    polynomial: bool
    degree: int | None
    mult_depth: int | None
    levels: int | None
    violations: tuple[Violation, ...]
    op_counts: OpCounts
    nodes: tuple[NodeInfo, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    opset: int
    output_info: tuple[OutputInfo, ...] = ()
    graph_name: str = ""
    not_lowered: tuple[NotLowered, ...] = ()

    def __post_init__(self) -> None:
        for name in ("violations", "nodes", "inputs", "outputs", "output_info", "not_lowered"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    def __repr__(self) -> str:
        """One line: the answers and how many nodes (the per-node records are in ``nodes`` and ``to_dict()``)."""
        first = f" (first: {self.violations[0].op} at {self.violations[0].node!r})" if self.violations else ""
        return (f"AnalysisReport(polynomial={self.polynomial}, degree={self.degree}, mult_depth={self.mult_depth}, "
                f"levels={self.levels}, nodes={len(self.nodes)}, violations={len(self.violations)}{first}, "
                f"not_lowered={len(self.not_lowered)}, opset={self.opset})")

    def __str__(self) -> str:
        """A few readable lines: the answers, the op counts, then each violation and node without a lowering."""
        ops = ", ".join(f"{op} {n}" for op, n in self.op_counts.by_op.items())
        lines = [repr(self), f"  ops on encrypted values: {ops or 'none'}",
                 f"  ct x ct products: {self.op_counts.ct_ct_mults}, plaintext maps: {self.op_counts.pt_mults}"]
        reasons: set[str] = set()
        for v in self.violations[:10]:  # a reason shared by several nodes (the allow-list) is said once
            lines.append(f"  violation: {v.node} ({v.op})" + ("" if v.reason in reasons else f": {v.reason}"))
            reasons.add(v.reason)
        if len(self.violations) > 10:
            lines.append(f"  ... and {len(self.violations) - 10} more violations")
        lines += [f"  not lowered by {e.engine}: {e.node} ({e.op})" for e in self.not_lowered[:10]]
        return "\n".join(lines)

    def not_lowered_by(self, engine: str) -> tuple[NotLowered, ...]:
        """The entries naming ``engine`` (a compiler name such as ``"ckks"``)."""
        return tuple(entry for entry in self.not_lowered if entry.engine == engine)

    def lowered_by(self, engine: str) -> bool:
        """True when the model is polynomial and ``engine``'s compiler lowers every node."""
        return self.polynomial and not self.not_lowered_by(engine)

    def limit_failures(
        self, max_degree: int | None = None, max_depth: int | None = None, max_levels: int | None = None
    ) -> tuple[str, ...]:
        """Human-readable reasons why the model exceeds the given limits (empty when within them).

        A non-polynomial model exceeds every limit, since its degree is unbounded.
        """
        if not self.polynomial:
            return ("model is not polynomial",)
        checks = (
            ("degree", self.degree, max_degree),
            ("mult_depth", self.mult_depth, max_depth),
            ("levels", self.levels, max_levels),
        )
        return tuple(
            f"{name} {value} exceeds the limit {limit}"
            for name, value, limit in checks
            if limit is not None and value is not None and value > limit
        )

    def within_limits(
        self, max_degree: int | None = None, max_depth: int | None = None, max_levels: int | None = None
    ) -> bool:
        """True when the model is polynomial and within every given limit."""
        return not self.limit_failures(max_degree, max_depth, max_levels)

    def to_dict(self) -> dict[str, Any]:
        return {
            "polynomial": self.polynomial,
            "degree": self.degree,
            "mult_depth": self.mult_depth,
            "levels": self.levels,
            "violations": [v.to_dict() for v in self.violations],
            "op_counts": self.op_counts.to_dict(),
            "nodes": [n.to_dict() for n in self.nodes],
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "output_info": [o.to_dict() for o in self.output_info],
            "opset": self.opset,
            "graph_name": self.graph_name,
            "not_lowered": [entry.to_dict() for entry in self.not_lowered],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AnalysisReport:
        return cls(
            polynomial=bool(data["polynomial"]),
            degree=_opt_int(data.get("degree")),
            mult_depth=_opt_int(data.get("mult_depth")),
            levels=_opt_int(data.get("levels")),
            violations=tuple(Violation.from_dict(v) for v in data.get("violations", ())),
            op_counts=OpCounts.from_dict(data.get("op_counts", {})),
            nodes=tuple(NodeInfo.from_dict(n) for n in data.get("nodes", ())),
            inputs=tuple(str(i) for i in data.get("inputs", ())),
            outputs=tuple(str(o) for o in data.get("outputs", ())),
            opset=int(data.get("opset", 0)),
            output_info=tuple(OutputInfo.from_dict(o) for o in data.get("output_info", ())),
            graph_name=str(data.get("graph_name", "")),
            not_lowered=tuple(NotLowered.from_dict(e) for e in data.get("not_lowered", ())),
        )


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


# Field name -> converter used by ``_ScalarRecord.from_dict``; ``_opt_int`` fields may be missing or null.
_FIELD_TYPES: dict[str, Any] = {
    "name": str, "op": str, "encrypted": bool, "degree": _opt_int, "mult_depth": _opt_int, "level": _opt_int,
}
