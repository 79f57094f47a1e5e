"""Accepted graphs: right degree, ct x ct depth, CKKS levels and op counts."""

from __future__ import annotations

import json

import numpy as np
import pytest
from analysis_testlib import make_model, node
from onnx import TensorProto, helper

from polyfhe.analysis import AnalysisReport, analyze

F32 = TensorProto.FLOAT


def _w(*shape: int) -> np.ndarray:
    return np.random.default_rng(0).normal(size=shape)


def _analyze(nodes, inputs, outputs, inits=None, **kw) -> AnalysisReport:
    report = analyze(make_model(nodes, inputs, outputs, inits, **kw))
    assert report.polynomial, report.violations
    assert report.lowered_by("ckks"), report.not_lowered
    return report


@pytest.mark.parametrize(
    "k, degree, depth, ct_mults",
    [(1, 1, 0, 0), (2, 2, 1, 1), (3, 3, 2, 2), (4, 4, 2, 2), (5, 5, 3, 3), (8, 8, 3, 3)],
)
def test_pow_degree_and_depth(k: int, degree: int, depth: int, ct_mults: int) -> None:
    report = _analyze([node("Pow", ["x", "k"], "y")], {"x": (1, 4)}, ["y"], {"k": np.array(float(k))})
    assert (report.degree, report.mult_depth, report.levels) == (degree, depth, depth)
    assert report.op_counts.ct_ct_mults == ct_mults


def test_pow_zero_is_a_public_constant() -> None:
    report = _analyze([node("Pow", ["x", "k"], "y")], {"x": (1, 4)}, ["y"], {"k": np.array(0, np.int64)})
    assert report.degree == 0 and not report.output_info[0].encrypted


def test_levels_merge_adjacent_linear_maps() -> None:
    """y = W3((W1 x + b1) * (W2 x + b2)): degree 2, one ct x ct, three levels (the brief's example)."""
    nodes = [
        node("MatMul", ["x", "W1"], "a"), node("Add", ["a", "b1"], "a1"),
        node("MatMul", ["x", "W2"], "c"), node("Add", ["c", "b2"], "c1"),
        node("Mul", ["a1", "c1"], "p"), node("MatMul", ["p", "W3"], "y"),
    ]
    inits = {"W1": _w(4, 4), "W2": _w(4, 4), "W3": _w(4, 2), "b1": _w(4), "b2": _w(4)}
    report = _analyze(nodes, {"x": (1, 4)}, ["y"], inits)
    assert (report.degree, report.mult_depth, report.levels) == (2, 1, 3)
    assert report.op_counts.ct_ct_mults == 1 and report.op_counts.pt_mults == 3
    assert report.op_counts.by_op == {"Add": 2, "MatMul": 3, "Mul": 1}


LEVEL_STEPS = {
    "MatMul": lambda cur, out: node("MatMul", [cur, "W"], out),
    "AddBias": lambda cur, out: node("Add", [cur, "b"], out),
    "Transpose": lambda cur, out: node("Transpose", [cur], out, perm=[1, 0]),
    "MulConst": lambda cur, out: node("Mul", ["c", cur], out),
    "DivConst": lambda cur, out: node("Div", [cur, "c"], out),
    "Square": lambda cur, out: node("Mul", [cur, cur], out),
    "ReduceMean": lambda cur, out: node("ReduceMean", [cur, "axes"], out, keepdims=1),
}


@pytest.mark.parametrize(
    "ops, levels",
    [
        (["MatMul"], 1),
        (["MatMul", "MatMul"], 1),  # W2 W1 x: one merged plaintext matrix
        (["MatMul", "AddBias", "Transpose", "Transpose", "MatMul"], 1),  # a bias / data movement between
        (["MulConst", "MatMul", "DivConst"], 1),  # elementwise scales fold into the linear map
        (["Square"], 1),
        (["Square", "MatMul"], 2),
        (["MatMul", "Square", "MatMul", "Square"], 4),
        (["ReduceMean", "MatMul"], 1),
    ],
)
def test_levels_rules(ops: list[str], levels: int) -> None:
    inits = {"W": _w(4, 4), "b": _w(4), "c": _w(4), "axes": np.array([1], np.int64)}
    nodes, cur = [], "x"
    for i, op in enumerate(ops):
        nodes.append(LEVEL_STEPS[op](cur, f"h{i}"))
        cur = f"h{i}"
    shape = (4, 4) if "Transpose" in ops else (1, 4)
    assert _analyze(nodes, {"x": shape}, [cur], inits).levels == levels


def test_levels_take_the_max_over_branches_and_outputs() -> None:
    nodes = [node("Mul", ["x", "x"], "x2"), node("Mul", ["x2", "x2"], "x4"), node("Add", ["x4", "x"], "y"),
             node("MatMul", ["x", "W"], "z")]
    report = _analyze(nodes, {"x": (1, 4)}, ["y", "z"], {"W": _w(4, 4)})
    assert (report.degree, report.mult_depth, report.levels) == (4, 2, 2)
    assert [(o.name, o.degree, o.level) for o in report.output_info] == [("y", 4, 2), ("z", 1, 1)]


def test_div_by_constant() -> None:
    report = _analyze([node("Div", ["x", "d"], "y")], {"x": (1, 4)}, ["y"], {"d": np.array(3.0)})
    assert (report.degree, report.mult_depth, report.levels) == (1, 0, 1)
    assert report.op_counts.pt_mults == 1


def test_constant_subgraphs_may_use_any_op() -> None:
    """Batch-norm style (x - mean) / Sqrt(var + eps) * Exp(g): the non-polynomial ops act on weights only."""
    nodes = [
        node("Add", ["var", "eps"], "ve"), node("Sqrt", ["ve"], "sd"), node("Exp", ["g"], "eg"),
        node("Relu", ["g"], "rg"), node("Sigmoid", ["rg"], "sg"), node("Sub", ["x", "mean"], "xc"),
        node("Div", ["xc", "sd"], "xn"), node("Mul", ["xn", "eg"], "xs"), node("Mul", ["xs", "sg"], "y"),
    ]
    inits = {"var": np.abs(_w(4)), "eps": np.array(1e-5), "g": _w(4), "mean": _w(4)}
    report = _analyze(nodes, {"x": (1, 4)}, ["y"], inits)
    assert report.degree == 1
    assert report.op_counts.by_op == {"Div": 1, "Mul": 2, "Sub": 1}
    const_nodes = {n.name for n in report.nodes if not n.encrypted}
    assert {"Sqrt_1", "Exp_2", "Relu_3", "Sigmoid_4"} <= const_nodes


def test_pow_exponent_computed_by_a_constant_subgraph() -> None:
    """Exponent = Cast(Constant 2.0 -> int64) + Size(x) with x of shape (1, 1): evaluated to 3."""
    nodes = [
        helper.make_node("Constant", [], ["two"], value=helper.make_tensor("t", TensorProto.DOUBLE, [], [2.0])),
        node("Cast", ["two"], "two_i", to=TensorProto.INT64),
        node("Size", ["x"], "n"),
        node("Add", ["two_i", "n"], "k"),
        node("Pow", ["x", "k"], "y"),
    ]
    report = _analyze(nodes, {"x": (1, 1)}, ["y"])
    assert (report.degree, report.mult_depth) == (3, 2)


def test_shape_of_encrypted_is_public() -> None:
    nodes = [node("Shape", ["x"], "s"), node("ConstantOfShape", ["s"], "ones",
             value=helper.make_tensor("v", TensorProto.DOUBLE, [1], [1.0])),
             node("Add", ["x", "ones"], "y1"), node("Reshape", ["y1", "s"], "y")]
    report = _analyze(nodes, {"x": (2, 3)}, ["y"])
    shape_info = next(n for n in report.nodes if n.op == "Shape")
    assert not shape_info.encrypted and shape_info.degree == 0
    assert report.degree == 1 and report.op_counts.by_op == {"Add": 1, "Reshape": 1}


def test_conv_and_data_movement_zoo() -> None:
    """Conv, Reshape, Transpose, Concat, Slice, ReduceMean, Gemm, MatMul ct x ct and friends."""
    i64 = np.int64
    nodes = [
        node("Conv", ["x", "Wc", "bc"], "c", pads=[1, 1, 1, 1]),                 # (1,2,4,4)
        node("Pad", ["c", "pads"], "cp", mode="constant"),                        # (1,2,4,4)
        node("AveragePool", ["cp"], "ap", kernel_shape=[1, 1]),
        node("Mul", ["ap", "ap"], "sq"),                                          # degree 2
        node("Concat", ["sq", "c"], "cat", axis=1),                               # (1,4,4,4)
        node("Slice", ["cat", "st", "en", "ax"], "sl"),                           # (1,2,4,4)
        node("Transpose", ["sl"], "tr", perm=[0, 1, 3, 2]),
        node("Reshape", ["tr", "shape8"], "r8"),                                  # (8,4)
        node("Split", ["r8", "halves"], ["r_a", "r_b"], axis=0),                  # (4,4) each
        node("MatMul", ["r_a", "r_b"], "mm"),                                     # ct x ct: degree 4
        node("Gather", ["mm", "idx"], "ga", axis=0),                              # (2,4)
        node("Unsqueeze", ["ga", "ax0"], "un"),
        node("Squeeze", ["un", "ax0"], "sqz"),
        node("Flatten", ["sqz"], "fl", axis=0),                                   # (1,8)
        node("Gemm", ["fl", "Wg", "bg"], "gm"),                                   # (1,3)
        node("ReduceMean", ["gm", "ax1"], "rm", keepdims=1),
        node("ReduceSum", ["gm", "ax1"], "rs", keepdims=1),
        node("Expand", ["rs", "shape13"], "ex"),
        node("Sum", ["ex", "rm", "gm"], "sm"),
        node("Cast", ["sm"], "cs", to=TensorProto.DOUBLE),
        node("Dropout", ["cs"], ["dr", "mask"]),
        node("GlobalAveragePool", ["cp"], "gap"),
        node("Neg", ["dr"], "y"),
    ]
    inits = {
        "Wc": _w(2, 1, 3, 3), "bc": _w(2), "pads": np.zeros(8, i64),
        "st": np.array([1], i64), "en": np.array([3], i64), "ax": np.array([1], i64),
        "shape8": np.array([8, 4], i64), "halves": np.array([4, 4], i64), "idx": np.array([0, 2], i64),
        "ax0": np.array([0], i64), "ax1": np.array([1], i64), "Wg": _w(8, 3), "bg": _w(3),
        "shape13": np.array([1, 3], i64),
    }
    report = _analyze(nodes, {"x": (1, 1, 4, 4)}, ["y", "gap"], inits)
    assert report.degree == 4
    assert report.mult_depth == 2
    assert report.op_counts.ct_ct_mults == 2
    assert set(report.op_counts.by_op) == {n.op_type for n in nodes}


def test_conv_transpose_and_gemm_with_constant_left_operand() -> None:
    nodes = [node("ConvTranspose", ["x", "W"], "c"), node("Flatten", ["c"], "f"),
             node("Gemm", ["A", "f"], "y", transB=1)]
    report = _analyze(nodes, {"x": (1, 1, 2, 2)}, ["y"], {"W": _w(1, 1, 2, 2), "A": _w(2, 9)})
    assert (report.degree, report.levels) == (1, 1)


@pytest.mark.parametrize("mode, fill", [("constant", 2.5), ("constant", 0.0), ("edge", None), ("reflect", None),
                                        ("wrap", None)])
def test_pad_fills_and_modes_are_affine(mode: str, fill: float | None) -> None:
    """A non-zero fill is a public constant added to a linear map; edge/reflect/wrap only move data."""
    inputs = ["x", "pads"] + (["v"] if fill is not None else [])
    inits = {"pads": np.array([0, 1, 0, 2], np.int64), **({"v": np.array(fill)} if fill is not None else {})}
    nodes = [node("Pad", inputs, "p", mode=mode), node("Mul", ["p", "p"], "y")]
    report = _analyze(nodes, {"x": (1, 4)}, ["y"], inits)
    assert (report.degree, report.mult_depth) == (2, 1)


def test_pad_fill_attribute_before_opset_11() -> None:
    report = _analyze([node("Pad", ["x"], "y", pads=[0, 1, 0, 1], value=2.0)], {"x": (1, 4)}, ["y"], opset=10)
    assert report.degree == 1


def test_tile_is_data_movement() -> None:
    report = _analyze([node("Tile", ["x", "reps"], "y")], {"x": (1, 4)}, ["y"], {"reps": np.array([2, 3], np.int64)})
    assert (report.degree, report.levels) == (1, 0)


def test_initializer_shadowing_an_input_is_constant() -> None:
    model = make_model([node("Mul", ["x", "w"], "y")], {"x": (1, 2), "w": (1, 2)}, ["y"], {"w": _w(1, 2)})
    report = analyze(model)
    assert report.inputs == ("x",) and report.degree == 1


def test_report_roundtrips_through_json() -> None:
    report = _analyze([node("Pow", ["x", "k"], "y")], {"x": (1, 4)}, ["y"], {"k": np.array(3.0)})
    data = json.loads(json.dumps(report.to_dict()))
    assert AnalysisReport.from_dict(data) == report
    assert data["degree"] == 3 and data["violations"] == [] and data["polynomial"] is True


def test_limits() -> None:
    report = _analyze([node("Pow", ["x", "k"], "y")], {"x": (1, 4)}, ["y"], {"k": np.array(3.0)})
    assert report.within_limits(max_degree=3, max_depth=2, max_levels=2)
    assert not report.within_limits(max_degree=2)
    assert report.limit_failures(max_depth=1) == ("mult_depth 2 exceeds the limit 1",)


def test_float32_models_and_opset_13() -> None:
    nodes = [node("ReduceSum", ["x", "ax"], "s", keepdims=1), node("Mul", ["s", "x"], "y")]
    report = _analyze(nodes, {"x": (1, 4)}, ["y"], {"ax": np.array([1], np.int64)}, opset=13, elem_type=F32)
    assert (report.degree, report.opset) == (2, 13)
