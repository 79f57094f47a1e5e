"""One op table for the analyzer and the CKKS compiler: every graph the analyzer accepts compiles, and agrees.

The table (:func:`polyfhe.analysis.optable.op_table`) is derived from the analyzer's rules; here it is held
against the compiler both ways (the linear handler registry, and one small graph per (op, lowering kind) that
must be accepted, compile and match onnxruntime), and against two of ONNX's own backend test models.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import polyfhe
from polyfhe.analysis import analyze
from polyfhe.analysis.optable import Lowering, op_table, ops_lowered_as
from polyfhe.exporters.ckks.affine import LINEAR_OPS

LINEAR, COMBINE, PRODUCT, ALIAS, PUBLIC = (Lowering.LINEAR, Lowering.COMBINE, Lowering.PRODUCT, Lowering.ALIAS,
                                          Lowering.PUBLIC)
I64 = np.int64
BACKEND_DATA = Path(onnx.__file__).parent / "backend" / "test" / "data"


def _w(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def _ints(*values: int) -> np.ndarray:
    return np.array(values, I64)


def _model(nodes, shape, inits=None, opset: int = 18, out_type: int = TensorProto.FLOAT) -> onnx.ModelProto:
    """A graph over one float input ``x`` of a fixed shape and one output ``y``."""
    graph = helper.make_graph(
        nodes, "sample", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("y", out_type, None)],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in (inits or {}).items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def n(op: str, inputs: list[str], outputs: str | list[str] = "y", **attrs) -> onnx.NodeProto:
    return helper.make_node(op, inputs, [outputs] if isinstance(outputs, str) else outputs, **attrs)


@dataclass(frozen=True)
class Sample:
    """A graph exercising ``op`` lowered as ``kind`` (the compiler's layout where single cannot hold it)."""

    op: str
    kind: Lowering
    name: str
    build: Callable[[], onnx.ModelProto]
    layout: str = "single"

    @property
    def id(self) -> str:
        return f"{self.op}-{self.kind}-{self.name}"


IMG = (1, 2, 5, 5)
SAMPLES = [
    # ---------------------------------------------------------------- one encrypted operand: affine handlers
    Sample("Add", LINEAR, "const", lambda: _model([n("Add", ["x", "c"])], (1, 4), {"c": _w(4)})),
    Sample("Sub", LINEAR, "const_minus_x", lambda: _model([n("Sub", ["c", "x"])], (1, 4), {"c": _w(3, 1)})),
    Sample("Sum", LINEAR, "consts", lambda: _model([n("Sum", ["c", "x", "d"])], (1, 4), {"c": _w(4), "d": _w(2, 1, 1)})),
    Sample("Sum", LINEAR, "single", lambda: _model([n("Sum", ["x"])], (1, 4))),
    Sample("Mul", LINEAR, "const", lambda: _model([n("Mul", ["c", "x"])], (1, 4), {"c": _w(4)})),
    Sample("Div", LINEAR, "const", lambda: _model([n("Div", ["x", "c"])], (1, 4), {"c": np.float32(4.0)})),
    Sample("MatMul", LINEAR, "x_w", lambda: _model([n("MatMul", ["x", "W"])], (2, 4), {"W": _w(4, 3)})),
    Sample("MatMul", LINEAR, "w_x", lambda: _model([n("MatMul", ["W", "x"])], (1, 4, 2), {"W": _w(3, 4)})),
    Sample("MatMul", LINEAR, "w_vector", lambda: _model([n("MatMul", ["W", "x"])], (4,), {"W": _w(3, 4)})),
    Sample("Gemm", LINEAR, "a", lambda: _model([n("Gemm", ["x", "W", "b"], transB=1, alpha=0.5, beta=2.0)], (1, 4),
                                               {"W": _w(3, 4), "b": _w(3)})),
    Sample("Gemm", LINEAR, "b", lambda: _model([n("Gemm", ["A", "x", "b"], transA=1, transB=1)], (3, 4),
                                               {"A": _w(4, 5), "b": _w(3)})),
    Sample("Gemm", LINEAR, "c", lambda: _model([n("Gemm", ["A", "B", "x"], beta=-0.5)], (2, 3),
                                               {"A": _w(2, 4), "B": _w(4, 3, seed=1)})),
    Sample("Neg", LINEAR, "", lambda: _model([n("Neg", ["x"])], (1, 4))),
    Sample("Identity", LINEAR, "", lambda: _model([n("Identity", ["x"])], (1, 4))),
    Sample("Dropout", LINEAR, "mask", lambda: _model([n("Dropout", ["x"], ["y", "mask"])], (1, 4), opset=13)),
    Sample("Reshape", LINEAR, "", lambda: _model([n("Reshape", ["x", "s"])], (1, 6), {"s": _ints(3, -1)})),
    Sample("Flatten", LINEAR, "", lambda: _model([n("Flatten", ["x"], axis=2)], (1, 2, 3))),
    Sample("Squeeze", LINEAR, "", lambda: _model([n("Squeeze", ["x", "a"])], (1, 3, 1), {"a": _ints(2)})),
    Sample("Unsqueeze", LINEAR, "", lambda: _model([n("Unsqueeze", ["x", "a"])], (1, 3), {"a": _ints(1)})),
    Sample("Transpose", LINEAR, "", lambda: _model([n("Transpose", ["x"], perm=[0, 2, 1])], (1, 2, 3))),
    Sample("Expand", LINEAR, "", lambda: _model([n("Expand", ["x", "s"])], (1, 4), {"s": _ints(3, 4)})),
    Sample("Gather", LINEAR, "", lambda: _model([n("Gather", ["x", "i"], axis=1)], (1, 4), {"i": _ints(3, -4, 1)})),
    Sample("Slice", LINEAR, "inputs", lambda: _model([n("Slice", ["x", "s", "e", "a", "t"])], (1, 6),
                                                     {"s": _ints(-1), "e": _ints(-6), "a": _ints(1), "t": _ints(-2)})),
    Sample("Slice", LINEAR, "opset9_attrs", lambda: _model([n("Slice", ["x"], starts=[1], ends=[4], axes=[1])],
                                                           (1, 6), opset=9)),
    Sample("Tile", LINEAR, "", lambda: _model([n("Tile", ["x", "r"])], (1, 2, 3), {"r": _ints(2, 1, 3)})),
    Sample("ReduceSum", LINEAR, "", lambda: _model([n("ReduceSum", ["x", "a"], keepdims=0)], (1, 3, 4), {"a": _ints(2)})),
    Sample("ReduceMean", LINEAR, "", lambda: _model([n("ReduceMean", ["x", "a"])], (1, 3, 4), {"a": _ints(-1)})),
    Sample("Pad", LINEAR, "fill", lambda: _model([n("Pad", ["x", "p", "v"])], (1, 2, 3),
                                                 {"p": _ints(0, 1, 2, 0, 0, 1), "v": np.float32(-1.5)})),
    Sample("Pad", LINEAR, "crop_axes", lambda: _model([n("Pad", ["x", "p", "", "a"])], (1, 3, 4),
                                                      {"p": _ints(-1, 2, 1, -2), "a": _ints(1, 2)})),
    Sample("Pad", LINEAR, "edge", lambda: _model([n("Pad", ["x", "p"], mode="edge")], (1, 3), {"p": _ints(0, 2, 0, 1)})),
    Sample("Pad", LINEAR, "reflect", lambda: _model([n("Pad", ["x", "p"], mode="reflect")], (1, 2, 4),
                                                    {"p": _ints(0, 1, 2, 0, 1, -1)})),
    Sample("Pad", LINEAR, "wrap", lambda: _model([n("Pad", ["x", "p"], mode="wrap")], (1, 4), {"p": _ints(0, 3, 0, 2)},
                                                 opset=19)),
    Sample("Pad", LINEAR, "opset10_value", lambda: _model([n("Pad", ["x"], pads=[0, 1, 0, 2], value=3.0)], (1, 3),
                                                          opset=10)),
    Sample("Conv", LINEAR, "asymmetric_strided_grouped", lambda: _model(
        [n("Conv", ["x", "W", "b"], pads=[0, 1, 2, 1], strides=[2, 1], dilations=[1, 2], group=2)], IMG,
        {"W": _w(4, 1, 3, 2), "b": _w(4)})),
    Sample("Conv", LINEAR, "same_upper", lambda: _model(
        [n("Conv", ["x", "W"], auto_pad="SAME_UPPER", strides=[2, 2])], IMG, {"W": _w(3, 2, 2, 2)})),
    Sample("Conv", LINEAR, "1d", lambda: _model([n("Conv", ["x", "W", "b"], pads=[1, 1])], (1, 2, 6),
                                                {"W": _w(3, 2, 3), "b": _w(3)})),
    Sample("ConvTranspose", LINEAR, "strided_padded_grouped", lambda: _model(
        [n("ConvTranspose", ["x", "W", "b"], strides=[2, 2], pads=[1, 0, 0, 1], output_padding=[1, 1],
           dilations=[1, 2], group=2)], IMG, {"W": _w(2, 2, 3, 2), "b": _w(4)})),
    Sample("ConvTranspose", LINEAR, "1d", lambda: _model([n("ConvTranspose", ["x", "W"], strides=[3])], (1, 2, 4),
                                                         {"W": _w(2, 1, 2)})),
    Sample("ConvTranspose", LINEAR, "output_shape", lambda: _model(
        [n("ConvTranspose", ["x", "W"], strides=[2, 2], output_shape=[10, 9])], IMG, {"W": _w(2, 3, 3, 3)})),
    Sample("AveragePool", LINEAR, "asymmetric_pads", lambda: _model(
        [n("AveragePool", ["x"], kernel_shape=[3, 2], pads=[1, 0, 0, 1], strides=[2, 1])], IMG)),
    Sample("AveragePool", LINEAR, "ceil_count_pad", lambda: _model(
        [n("AveragePool", ["x"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 0, 0], ceil_mode=1,
           count_include_pad=1)], IMG)),
    Sample("AveragePool", LINEAR, "ceil", lambda: _model(
        [n("AveragePool", ["x"], kernel_shape=[2, 3], strides=[2, 2], pads=[0, 1, 0, 1], ceil_mode=1)], IMG)),
    Sample("AveragePool", LINEAR, "same_lower", lambda: _model(
        [n("AveragePool", ["x"], kernel_shape=[2, 3], auto_pad="SAME_LOWER")], IMG)),
    Sample("GlobalAveragePool", LINEAR, "", lambda: _model([n("GlobalAveragePool", ["x"])], IMG)),
    # ---------------------------------------------------------------- several encrypted operands or outputs
    Sample("Add", COMBINE, "", lambda: _model([n("Mul", ["x", "c"], "t"), n("Add", ["x", "t"])], (1, 4),
                                              {"c": _w(4)})),
    Sample("Sub", COMBINE, "", lambda: _model([n("Neg", ["x"], "t"), n("Sub", ["t", "x"])], (1, 4))),
    Sample("Sum", COMBINE, "", lambda: _model([n("Neg", ["x"], "t"), n("Sum", ["x", "c", "t", "x"])], (1, 4),
                                              {"c": _w(4)})),
    Sample("Concat", COMBINE, "", lambda: _model([n("Neg", ["x"], "t"), n("Concat", ["t", "c", "x"], axis=1)], (1, 4),
                                                 {"c": _w(1, 2)})),
    Sample("Split", COMBINE, "", lambda: _model([n("Split", ["x", "s"], ["a", "b"], axis=1),
                                                 n("Concat", ["b", "a"], axis=1)], (1, 5), {"s": _ints(2, 3)})),
    # ---------------------------------------------------------------- ct x ct products
    Sample("Mul", PRODUCT, "", lambda: _model([n("Add", ["x", "c"], "t"), n("Mul", ["t", "x"])], (1, 4),
                                              {"c": _w(4)})),
    Sample("Pow", PRODUCT, "", lambda: _model([n("Pow", ["x", "k"])], (1, 4), {"k": np.float32(3.0)})),
    Sample("MatMul", PRODUCT, "", lambda: _model(
        [n("MatMul", ["x", "W"], "q"), n("Transpose", ["x"], "xt", perm=[0, 2, 1]), n("MatMul", ["q", "xt"])],
        (1, 3, 4), {"W": _w(4, 4)})),
    # ---------------------------------------------------------------- the rest
    Sample("Cast", ALIAS, "", lambda: _model([n("Cast", ["x"], to=TensorProto.DOUBLE)], (1, 4),
                                             out_type=TensorProto.DOUBLE)),
    Sample("Shape", PUBLIC, "", lambda: _model([n("Neg", ["x"], "t"), n("Shape", ["x"], "s"),
                                                n("Reshape", ["t", "s"])], (1, 4))),
    Sample("Size", PUBLIC, "", lambda: _model([n("Size", ["x"], "s"), n("Cast", ["s"], "f", to=TensorProto.FLOAT),
                                               n("Mul", ["x", "f"])], (1, 4))),
    Sample("Pow", PUBLIC, "zero", lambda: _model([n("Pow", ["x", "k"], "one"), n("Add", ["x", "one"])], (1, 4),
                                                 {"k": np.float32(0.0)})),
]


def _reference(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """onnxruntime on one sample at a time (the inputs have a fixed batch axis), flattened per sample."""
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return np.stack([np.asarray(session.run(None, {name: row})[0], np.float64).reshape(-1) for row in x])


def _assert_close(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(want).max())))


def test_every_table_entry_has_a_lowering_and_a_sample():
    """A new rule (or lowering kind) without a compiled sample graph here fails: the table is checked whole."""
    table = op_table()
    assert not [op for op, entry in table.items() if not entry.lowering], "accepted but never lowered"
    declared = {(op, kind) for op, entry in table.items() for kind in entry.lowering}
    assert {(s.op, s.kind) for s in SAMPLES} == declared
    assert set(polyfhe.analysis.allowed_ops()) | {"Shape", "Size"} == set(table)


def test_linear_handlers_are_exactly_the_linear_ops():
    """Both directions: every op lowered linearly has a handler, and no handler serves an op the analyzer refuses."""
    assert sorted(ops_lowered_as(LINEAR) - set(LINEAR_OPS)) == [], "no affine handler"
    assert sorted(set(LINEAR_OPS) - ops_lowered_as(LINEAR)) == [], "handler for an op the analyzer refuses"


@pytest.mark.parametrize("sample", SAMPLES, ids=[s.id for s in SAMPLES])
def test_sample_is_accepted_compiles_and_matches_onnxruntime(sample: Sample, caplog):
    model = sample.build()
    report = analyze(model)
    assert report.polynomial, report.violations
    assert sample.op in {node.op for node in report.nodes}
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    x = np.random.default_rng(1).uniform(-1, 1, size=(3, *shape)).astype(np.float32)
    program = polyfhe.export(model, target="ckks", layout=sample.layout)
    _assert_close(program.run_plain(x), _reference(model, x))
    if sample.kind is PRODUCT:
        assert report.op_counts.ct_ct_mults > 0 and program.manifest.info["depth"] >= 1


def _backend_case(relative: str) -> tuple[Path, np.ndarray, np.ndarray]:
    root = BACKEND_DATA / relative
    if not (root / "model.onnx").is_file():
        pytest.skip(f"onnx {onnx.__version__} does not ship the backend test model {relative}")
    tensors = []
    for name in ("input_0.pb", "output_0.pb"):
        proto = onnx.TensorProto()
        proto.ParseFromString((root / "test_data_set_0" / name).read_bytes())
        tensors.append(numpy_helper.to_array(proto))
    return root / "model.onnx", tensors[0], tensors[1]


@pytest.mark.parametrize("relative", ["pytorch-converted/test_ConstantPad2d", "pytorch-operator/test_operator_repeat"],
                         ids=["ConstantPad2d_fill_2", "repeat_Tile"])
def test_onnx_backend_models_compile_and_match(relative: str):
    """Pad with the fill value 2 (opset 6 attributes) and Tile: refused by the analyzer before the shared table.

    Their input has a fixed leading axis, so the whole input tensor is one sample of the program.
    """
    path, x, want = _backend_case(relative)
    assert analyze(path).polynomial
    program = polyfhe.export(str(path), target="ckks", layout="single")
    got = program.run_plain(x[None])
    _assert_close(got, want.reshape(1, -1).astype(np.float64))
