"""Degree analyzer: prove an ONNX graph computes only additions and multiplications on encrypted data.

``analyze(model)`` returns an :class:`AnalysisReport` (polynomial?, violations with node and op, degree,
ct x ct depth, CKKS levels, op counts, and separately the polynomial nodes a compiler does not lower). New ops are allowed through :func:`register_rule`; every op
without a rule fails closed on encrypted values.
"""

from polyfhe.analysis.analyzer import analyze
from polyfhe.analysis.errors import ModelLoadError
from polyfhe.analysis.loader import load_model
from polyfhe.analysis.registry import (
    NodeContext,
    RuleResult,
    RuleViolation,
    allowed_ops,
    describe_allowed,
    register_rule,
)
from polyfhe.analysis.report import AnalysisReport, NodeInfo, NotLowered, OpCounts, OutputInfo, Violation
from polyfhe.analysis.values import ValueState

__all__ = [
    "AnalysisReport",
    "ModelLoadError",
    "NodeContext",
    "NodeInfo",
    "NotLowered",
    "OpCounts",
    "OutputInfo",
    "RuleResult",
    "RuleViolation",
    "ValueState",
    "Violation",
    "allowed_ops",
    "analyze",
    "describe_allowed",
    "load_model",
    "register_rule",
]
