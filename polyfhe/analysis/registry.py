"""The op -> rule registry. It fails closed: an op without a rule is never allowed on encrypted values.

A rule runs only for nodes with at least one encrypted input (nodes on constants are folded at compile
time and need no rule). It returns the abstract state of every output plus the multiplications it
costs, or raises :class:`RuleViolation` with a reason when the op is not polynomial in its encrypted
inputs (e.g. ``Div`` by an encrypted value).

Each rule also declares how the CKKS compiler lowers the op (:class:`Lowering`), so that the analyzer and
the compiler share one op table (:mod:`polyfhe.analysis.optable`), and a test holds both sides to it. Being
polynomial and being lowered are two answers: a rule accepts every polynomial use of its op and, for the
operand patterns the compiler has no lowering for (a ct x ct Gemm, an encrypted Conv bias), names the reason
in :attr:`RuleResult.unlowered` instead of refusing the node.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
import onnx
from onnx import helper

from polyfhe.analysis.constants import ConstantFolder
from polyfhe.analysis.values import ValueState

__all__ = [
    "CKKS_COMPILER",
    "Lowering",
    "NodeContext",
    "Rule",
    "RuleFn",
    "RuleResult",
    "RuleViolation",
    "allowed_ops",
    "describe_allowed",
    "get_rule",
    "register_rule",
]

DEFAULT_DOMAINS = ("", "ai.onnx")
CKKS_COMPILER = "ckks"  # the compiler whose lowerings the rules declare (export/ckks; every CKKS engine runs it)


class Lowering(StrEnum):
    """How the CKKS compiler (``export/ckks``) lowers an op on encrypted values; an op may use several."""

    LINEAR = "linear"  # one encrypted operand: a handler in affine.LINEAR_OPS maps the stacked basis images
    COMBINE = "combine"  # several encrypted operands or outputs, merged or cut symbolically (lower.py)
    PRODUCT = "product"  # ct x ct: the operands are materialised as registers and multiplied (lower.py)
    ALIAS = "alias"  # the same affine expression under a new name (lower.py)
    PUBLIC = "public"  # the output does not depend on encrypted values; the compiler reads it as a constant


class RuleViolation(Exception):
    """Raised by a rule: the node is not polynomial (or not provably so) on its encrypted inputs."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class RuleResult:
    """Output states of a node (one per ONNX output), the multiplications it performs, and why the CKKS
    compiler does not lower this use of the op (empty when it does)."""

    outputs: tuple[ValueState, ...]
    ct_mults: int = 0
    pt_mults: int = 0
    unlowered: str = ""


@dataclass(frozen=True)
class NodeContext:
    """What a rule sees: the node, its input states (None for omitted optional inputs), constants."""

    node: onnx.NodeProto
    label: str
    inputs: tuple[ValueState | None, ...]
    folder: ConstantFolder
    opset: int

    @property
    def op(self) -> str:
        return self.node.op_type

    def input(self, index: int) -> ValueState | None:
        return self.inputs[index] if index < len(self.inputs) else None

    def operand(self, index: int) -> ValueState:
        """State of a required input; a malformed node without it is reported, not crashed on."""
        state = self.input(index)
        if state is None:
            raise RuleViolation(f"{self.op} is missing its required input {index}")
        return state

    def is_encrypted(self, index: int) -> bool:
        state = self.input(index)
        return state is not None and state.encrypted

    def attr(self, name: str, default: Any = None) -> Any:
        for attribute in self.node.attribute:
            if attribute.name == name:
                value = helper.get_attribute_value(attribute)
                return value.decode() if isinstance(value, bytes) else value
        return default

    def const_value(self, index: int) -> np.ndarray | None:
        """Compile-time value of input ``index`` (None if absent, encrypted or not evaluable)."""
        if index >= len(self.node.input) or not self.node.input[index] or self.is_encrypted(index):
            return None
        return self.folder.value(self.node.input[index])

    def require_const(self, positions: range | tuple[int, ...], role: str) -> None:
        """Fail when any of the given inputs (e.g. a shape or indices) is encrypted."""
        for index in positions:
            if self.is_encrypted(index):
                name = self.node.input[index]
                raise RuleViolation(f"{self.op} input {index} ({role}, {name!r}) must be a constant, not encrypted")

    def same_for_all(self, state: ValueState, ct_mults: int = 0, pt_mults: int = 0, unlowered: str = "") -> RuleResult:
        """Result with ``state`` on every output."""
        return RuleResult(tuple(state for _ in self.node.output), ct_mults, pt_mults, unlowered)


RuleFn = Callable[[NodeContext], RuleResult]


@dataclass(frozen=True)
class Rule:
    """A registered rule; ``summary`` says under which conditions the op is allowed."""

    op_type: str
    summary: str
    fn: RuleFn
    lowering: tuple[Lowering, ...] = ()


_RULES: dict[str, Rule] = {}


def register_rule(
    *op_types: str, lowering: Sequence[Lowering | str], summary: str = "", override: bool = False
) -> Callable[[RuleFn], RuleFn]:
    """Decorator registering ``fn`` as the rule of the given default-domain op types.

    ``lowering`` says how the CKKS compiler lowers the op (required: the op table is checked against the
    compiler); ``()`` declares an op that is polynomial but that the compiler does not lower (the analyzer
    then reports every use of it as not lowered).
    """
    kinds = tuple(Lowering(kind) for kind in lowering)

    def decorate(fn: RuleFn) -> RuleFn:
        for op_type in op_types:
            if op_type in _RULES and not override:
                raise ValueError(f"a rule for {op_type} is already registered")
            _RULES[op_type] = Rule(op_type, summary, fn, kinds)
        return fn

    return decorate


def get_rule(domain: str, op_type: str) -> Rule | None:
    """The rule for an op, or None: only default-domain ONNX ops have rules (custom ops fail closed)."""
    if domain not in DEFAULT_DOMAINS:
        return None
    return _RULES.get(op_type)


def allowed_ops() -> tuple[str, ...]:
    """Op types allowed on encrypted values (each subject to its rule's conditions)."""
    return tuple(sorted(_RULES))


def describe_allowed() -> dict[str, str]:
    """Op type -> the condition under which it is allowed on encrypted values."""
    return {op: _RULES[op].summary for op in allowed_ops()}
