"""Rejections fail closed and name the node and op."""

from __future__ import annotations

import numpy as np
import pytest
from analysis_testlib import make_model, node
from onnx import TensorProto, helper

from polyfhe.analysis import AnalysisReport, allowed_ops, analyze

I64 = np.int64


def _reject(nodes, inputs=None, outputs=("y",), inits=None, **kw) -> AnalysisReport:
    report = analyze(make_model(nodes, inputs or {"x": (1, 4)}, list(outputs), inits, **kw))
    assert not report.polynomial
    assert report.degree is None and report.mult_depth is None and report.levels is None
    assert not report.within_limits()
    return report


def _single(report: AnalysisReport) -> tuple[str, str, str]:
    assert len(report.violations) == 1, report.violations
    v = report.violations[0]
    return v.node, v.op, v.reason


@pytest.mark.parametrize(
    "op, extra_inputs, attrs",
    [
        ("Relu", [], {}),
        ("Sigmoid", [], {}),
        ("Softmax", [], {"axis": -1}),
        ("Abs", [], {}),
        ("Erf", [], {}),
        ("Tanh", [], {}),
        ("Max", ["x"], {}),
        ("Sqrt", [], {}),
        ("Reciprocal", [], {}),
        ("LayerNormalization", ["scale", "bias"], {"axis": -1}),
        ("Einsum", ["x"], {"equation": "ij,ij->ij"}),
    ],
)
def test_non_polynomial_ops_are_violations(op: str, extra_inputs: list[str], attrs: dict) -> None:
    inits = {"scale": np.ones(4), "bias": np.zeros(4)}
    report = _reject([node(op, ["x", *extra_inputs], "y", name=f"my_{op.lower()}", **attrs)], inits=inits)
    name, got_op, reason = _single(report)
    assert (name, got_op) == (f"my_{op.lower()}", op)
    assert "allowed on encrypted values" in reason and "MatMul" in reason and "Pow" in reason
    assert report.op_counts.by_op == {op: 1}


def test_unnamed_node_is_named_by_op_and_index() -> None:
    nodes = [node("Mul", ["x", "x"], "a"), node("Relu", ["a"], "y")]
    assert _single(_reject(nodes))[:2] == ("Relu_1", "Relu")


def test_custom_domain_op() -> None:
    nodes = [helper.make_node("FancyAct", ["x"], ["y"], domain="com.example", name="fancy")]
    name, op, reason = _single(_reject(nodes, extra_opsets={"com.example": 1}))
    assert (name, op) == ("fancy", "FancyAct")
    assert "com.example::FancyAct" in reason


@pytest.mark.parametrize(
    "nodes, inits, needle",
    [
        ([node("Div", ["one", "x"], "y")], {"one": np.array(1.0)}, "Div by an encrypted value"),
        ([node("Div", ["x", "x"], "y")], {}, "Div by an encrypted value"),
        ([node("Pow", ["x", "k"], "y")], {"k": np.array(2.5)}, "not a non-negative integer"),
        ([node("Pow", ["x", "k"], "y")], {"k": np.array(-1.0)}, "not a non-negative integer"),
        ([node("Pow", ["x", "k"], "y")], {"k": np.array(np.nan)}, "not a finite number"),
        ([node("Pow", ["x", "x"], "y")], {}, "encrypted exponent"),
        ([node("Pow", ["two", "x"], "y")], {"two": np.array(2.0)}, "encrypted exponent"),
        ([node("Cast", ["x"], "y", to=TensorProto.INT64)], {}, "INT64"),
        ([node("Gather", ["table", "x"], "y")], {"table": np.ones((4, 2))}, "encrypted indices"),
        ([node("Pad", ["x", "pads"], "y", mode="mirror")], {"pads": np.array([0, 1, 0, 1], I64)}, "mirror"),
        ([node("Pad", ["x", "pads", "v"], "y")], {"pads": np.array([0, 1, 0, 1], I64), "v": np.array(np.inf)},
         "not finite"),
        ([node("Reshape", ["w", "x"], "y")], {"w": np.ones(4)}, "must be a constant"),
        ([node("Dropout", ["x", "r", "t"], "y")], {"r": np.array(0.5), "t": np.array(True)}, "training_mode"),
    ],
    ids=["div_const_by_ct", "div_ct_by_ct", "pow_fraction", "pow_negative", "pow_nan", "pow_ct_ct",
         "pow_const_base_ct_exp", "cast_int", "gather_ct_indices", "pad_unknown_mode", "pad_infinite_fill",
         "reshape_ct_shape", "dropout_training"],
)
def test_conditional_rules_reject(nodes, inits, needle: str) -> None:
    name, op, reason = _single(_reject(nodes, inits=inits))
    assert op == nodes[0].op_type and name == f"{op}_0"
    assert needle in reason


def test_pow_exponent_that_cannot_be_evaluated_fails_closed() -> None:
    nodes = [helper.make_node("Opaque", ["k0"], ["k"], domain="com.example"), node("Pow", ["x", "k"], "y")]
    report = _reject(nodes, inits={"k0": np.array(2.0)}, extra_opsets={"com.example": 1})
    assert _single(report)[:2] == ("Pow_1", "Pow")
    assert "could not be evaluated" in report.violations[0].reason


def test_subgraph_capturing_encrypted_value() -> None:
    branch = helper.make_graph([node("Relu", ["x"], "r")], "b", [],
                               [helper.make_tensor_value_info("r", TensorProto.DOUBLE, None)])
    nodes = [helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=branch, name="branch")]
    name, op, reason = _single(_reject(nodes, inits={"cond": np.array(True)}))
    assert (name, op) == ("branch", "If") and "subgraph" in reason


def test_all_violations_are_reported_and_downstream_is_unknown() -> None:
    nodes = [node("Relu", ["x"], "a"), node("Mul", ["a", "a"], "b"), node("Sigmoid", ["b"], "c"),
             node("MatMul", ["x", "W"], "d"), node("Add", ["c", "d"], "y")]
    report = _reject(nodes, inits={"W": np.eye(4)})
    assert [(v.node, v.op) for v in report.violations] == [("Relu_0", "Relu"), ("Sigmoid_2", "Sigmoid")]
    info = {n.name: n for n in report.nodes}
    assert info["Mul_1"].degree is None and info["MatMul_3"].degree == 1 and info["Add_4"].degree is None


def test_dead_branch_violation_still_counts() -> None:
    """Fail closed: a violation on a value that no output uses still makes the model non-polynomial."""
    nodes = [node("Relu", ["x"], "dead"), node("Neg", ["x"], "y")]
    assert _single(_reject(nodes))[:2] == ("Relu_0", "Relu")


def test_violation_serialises() -> None:
    report = _reject([node("Relu", ["x"], "y")])
    data = report.to_dict()
    assert data["polynomial"] is False and data["degree"] is None
    assert data["violations"][0]["node"] == "Relu_0" and data["violations"][0]["op"] == "Relu"


def test_allow_list_matches_the_spec() -> None:
    expected = {
        "Add", "Sub", "Neg", "Mul", "MatMul", "Gemm", "Conv", "ConvTranspose", "Pow", "Div", "Sum", "ReduceSum",
        "ReduceMean", "AveragePool", "GlobalAveragePool", "Pad", "Reshape", "Transpose", "Flatten", "Squeeze",
        "Unsqueeze", "Concat", "Split", "Slice", "Gather", "Identity", "Expand", "Cast", "Dropout", "Tile",
    }
    assert set(allowed_ops()) == expected
