"""``analyze(model) -> AnalysisReport``: prove an ONNX graph is polynomial in its encrypted inputs.

Semantics (fail closed):

* Classification. Initializers (also those shadowing a graph input), Constant outputs and anything
  computed only from them are ``const``: any op is allowed there, it runs at compile time. Shape/Size
  outputs are const too (shapes are public). Every other graph input is ``encrypted``, and so is
  everything depending on one, including through the bodies of If/Loop/Scan.
* Nodes with an encrypted input must match a rule in :mod:`polyfhe.analysis.rules`; otherwise they are
  a :class:`Violation` naming the node (``name`` or ``{op_type}_{index}``) and op. Outputs of a
  violating node are UNKNOWN, so the report's degree/depth/levels become None; all violations are
  still collected.
* Lowered is a second answer: a polynomial node the CKKS compiler has no lowering for (its rule names a
  reason, or declares no lowering at all) is a :class:`NotLowered` entry, never a violation.
* ``degree`` is an upper bound on the total degree of the outputs in the inputs (cancellations are not
  detected), ``mult_depth`` counts sequential ct x ct products (x^4 costs 2), ``levels`` counts CKKS
  rescales including plaintext multiplications after merging adjacent plaintext-linear maps.
"""

from __future__ import annotations

import logging
from collections import Counter

import onnx

from polyfhe.analysis import rules as _rules  # noqa: F401  (registers the built-in rules)
from polyfhe.analysis.constants import ConstantFolder, is_public_shape_op
from polyfhe.analysis.graph import implicit_inputs, node_label, topological_order
from polyfhe.analysis.hints import ACTIVATION_OPS, POOLING_OPS
from polyfhe.analysis.loader import ModelLike, default_opset, load_model
from polyfhe.analysis.registry import (
    CKKS_COMPILER,
    NodeContext,
    RuleResult,
    RuleViolation,
    allowed_ops,
    get_rule,
)
from polyfhe.analysis.report import AnalysisReport, NodeInfo, NotLowered, OpCounts, OutputInfo, Violation
from polyfhe.analysis.values import CONST, UNKNOWN, ValueState

__all__ = ["analyze"]

log = logging.getLogger(__name__)


def analyze(model: ModelLike) -> AnalysisReport:
    """Analyze an ONNX model given as a ``ModelProto``, a path (str/Path) or serialized bytes.

    Raises :class:`~polyfhe.analysis.ModelLoadError` when the input cannot be read as a valid model.
    """
    proto = load_model(model)
    return _Analysis(proto).run()


class _Analysis:
    """One pass over the graph in topological order, propagating :class:`ValueState`."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.graph = model.graph
        self.opset = default_opset(model)
        self.folder = ConstantFolder(model)
        self.states: dict[str, ValueState] = {}
        self.violations: list[Violation] = []
        self.not_lowered: list[NotLowered] = []
        self.nodes: list[NodeInfo] = []
        self.by_op: Counter[str] = Counter()
        self.ct_mults = 0
        self.pt_mults = 0

    def run(self) -> AnalysisReport:
        encrypted_inputs = self._seed()
        for index, node in topological_order(self.graph):
            self._visit(index, node)
        outputs = tuple(self._output_info(o.name) for o in self.graph.output)
        polynomial = not self.violations
        report = AnalysisReport(
            polynomial=polynomial,
            degree=_max_or_none([o.degree for o in outputs]) if polynomial else None,
            mult_depth=_max_or_none([o.mult_depth for o in outputs]) if polynomial else None,
            levels=_max_or_none([o.level for o in outputs]) if polynomial else None,
            violations=tuple(self.violations),
            op_counts=OpCounts(dict(self.by_op), self.ct_mults, self.pt_mults),
            nodes=tuple(self.nodes),
            inputs=encrypted_inputs,
            outputs=tuple(o.name for o in outputs),
            opset=self.opset,
            output_info=outputs,
            graph_name=self.graph.name,
            not_lowered=tuple(self.not_lowered),
        )
        log.info(
            "analyzed %s: polynomial=%s degree=%s mult_depth=%s levels=%s violations=%d not_lowered=%d",
            self.graph.name or "<graph>", report.polynomial, report.degree, report.mult_depth,
            report.levels, len(report.violations), len(report.not_lowered),
        )
        return report

    def _seed(self) -> tuple[str, ...]:
        constants = {t.name for t in self.graph.initializer}
        constants |= {t.values.name for t in self.graph.sparse_initializer}
        for name in constants:
            self.states[name] = CONST
        encrypted = []
        for value in self.graph.input:
            if value.name in constants:
                log.debug("input %s has an initializer: treated as a constant", value.name)
                continue
            self.states[value.name] = ValueState.fresh_input()
            encrypted.append(value.name)
        return tuple(encrypted)

    def _visit(self, index: int, node: onnx.NodeProto) -> None:
        label = node_label(node, index)
        inputs = tuple(self.states[name] if name else None for name in node.input)
        captured = [self.states[name] for name in implicit_inputs(node)]
        touches_encrypted = any(s is not None and s.encrypted for s in (*inputs, *captured))
        if not touches_encrypted or is_public_shape_op(node):
            self._record(label, node, (CONST,) * len(node.output))
            return
        self.by_op[node.op_type] += 1
        result = self._apply_rule(label, node, inputs, captured)
        self.ct_mults += result.ct_mults
        self.pt_mults += result.pt_mults
        self._record(label, node, result.outputs)

    def _apply_rule(
        self, label: str, node: onnx.NodeProto, inputs: tuple[ValueState | None, ...], captured: list[ValueState]
    ) -> RuleResult:
        qualified = f"{node.domain}::{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type
        failed = RuleResult(tuple(UNKNOWN for _ in node.output))
        if any(s.encrypted for s in captured):
            self._violate(label, node, f"{qualified} reads encrypted values inside a subgraph; "
                          "control flow on encrypted data is not supported")
            return failed
        rule = get_rule(node.domain, node.op_type)
        if rule is None:
            allowed = ", ".join(allowed_ops())
            way_in = (" (polyfhe.polynomialize(model, data=...) replaces it with a trainable polynomial)"
                      if node.op_type in ACTIVATION_OPS else
                      " (polyfhe.polynomialize(model, data=...) replaces it with average pooling)"
                      if node.op_type in POOLING_OPS else "")
            self._violate(label, node, f"{qualified} has no polynomial rule and cannot be applied to encrypted "
                          f"values{way_in}; allowed on encrypted values: {allowed}")
            return failed
        ctx = NodeContext(node=node, label=label, inputs=inputs, folder=self.folder, opset=self.opset)
        try:
            result = rule.fn(ctx)
        except RuleViolation as violation:
            self._violate(label, node, violation.reason)
            return failed
        if len(result.outputs) != len(node.output):
            raise RuntimeError(f"rule for {node.op_type} returned {len(result.outputs)} states "
                               f"for {len(node.output)} outputs")
        unlowered = result.unlowered or ("" if rule.lowering else
                                         f"{qualified} is polynomial but the CKKS compiler has no lowering for it")
        if unlowered:
            log.debug("not lowered at %s (%s): %s", label, node.op_type, unlowered)
            self.not_lowered.append(NotLowered(node=label, op=node.op_type, engine=CKKS_COMPILER, reason=unlowered))
        return result

    def _violate(self, label: str, node: onnx.NodeProto, reason: str) -> None:
        log.debug("violation at %s (%s): %s", label, node.op_type, reason)
        self.violations.append(Violation(node=label, op=node.op_type, reason=reason))

    def _record(self, label: str, node: onnx.NodeProto, outputs: tuple[ValueState, ...]) -> None:
        for name, state in zip(node.output, outputs, strict=True):
            if name:
                self.states[name] = state
        enc = [s for s in outputs if s.encrypted]
        self.nodes.append(
            NodeInfo(
                name=label,
                op=node.op_type,
                encrypted=bool(enc),
                degree=_max_or_none([s.degree for s in enc]),
                mult_depth=_max_or_none([s.mult_depth for s in enc]),
                level=_max_or_none([s.lvl for s in enc]),
            )
        )

    def _output_info(self, name: str) -> OutputInfo:
        state = self.states.get(name, CONST)
        return OutputInfo(name, state.encrypted, state.degree, state.mult_depth, state.lvl)


def _max_or_none(values: list[int | None]) -> int | None:
    """Maximum, 0 for no values (constants), None if any value is unknown."""
    if any(v is None for v in values):
        return None
    return max((v for v in values if v is not None), default=0)
