"""CKKS compiler without encryption: lowering, both layouts' plans on plaintext slots, parameters, programs."""

from __future__ import annotations

import json
import logging

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from ckks_testlib import digits, digits_mlp, square_cnn
from onnx import TensorProto, helper, numpy_helper

from polyfhe.exporters.ckks import CKKSExportError, export_ckks
from polyfhe.program.ckks_program import load_program
from polyfhe.program.manifest import ProgramError
from polyfhe.program.params import CKKSParams, ParameterError, choose_params, validate


def _torch_out(model, x):
    with torch.no_grad():
        return model(torch.tensor(x, dtype=torch.float32)).numpy()


@pytest.mark.parametrize("layout", ["single", "batch"])
@pytest.mark.parametrize("build", [digits_mlp, square_cnn], ids=["mlp", "cnn"])
def test_compiled_plan_matches_torch(build, layout):
    model = build()
    _, _, x, _ = digits()
    prog = export_ckks(model, calibration=x[:64], layout=layout, input_shape=(1, 8, 8))
    got = prog.run_plain(x[:16])
    want = _torch_out(model, x[:16])
    assert np.max(np.abs(got - want)) <= 1e-4 * max(1.0, np.abs(want).max())
    assert prog.manifest.params.security == "tc128"
    assert (prog.manifest.galois_steps == ()) == (layout == "batch")


def _graph_model() -> onnx.ModelProto:
    """Linear data movement and reductions around two ct x ct products, written by hand."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(8, 6)).astype(np.float32)
    inits = [
        numpy_helper.from_array(w, "W"),
        numpy_helper.from_array(np.array([1, 4, 8], dtype=np.int64), "shape"),
        numpy_helper.from_array(np.array([0, 0, 0, 0, 1, 0], dtype=np.int64), "pads"),
        numpy_helper.from_array(np.array([1], dtype=np.int64), "s0"),
        numpy_helper.from_array(np.array([4], dtype=np.int64), "s1"),
        numpy_helper.from_array(np.array([1], dtype=np.int64), "ax"),
        numpy_helper.from_array(np.array(2.0, dtype=np.float32), "two"),
        numpy_helper.from_array(np.array([3, 0, 1], dtype=np.int64), "idx"),
        numpy_helper.from_array(np.array(3.0, dtype=np.float32), "three"),
    ]
    nodes = [
        helper.make_node("Reshape", ["x", "shape"], ["r"]),  # (1,4,8)
        helper.make_node("MatMul", ["r", "W"], ["m"]),  # (1,4,6)
        helper.make_node("Transpose", ["m"], ["t"], perm=[0, 2, 1]),  # (1,6,4)
        helper.make_node("Pad", ["t", "pads"], ["p"]),  # (1,7,4)
        helper.make_node("Slice", ["p", "s0", "s1", "ax"], ["sl"]),  # (1,3,4)
        helper.make_node("Mul", ["sl", "sl"], ["sq"]),
        helper.make_node("Gather", ["t", "idx"], ["g"], axis=1),  # (1,3,4)
        helper.make_node("Sub", ["sq", "g"], ["d"]),
        helper.make_node("Concat", ["d", "g"], ["c"], axis=1),  # (1,6,4)
        helper.make_node("Pow", ["c", "three"], ["cube"]),
        helper.make_node("Div", ["cube", "two"], ["h"]),
        helper.make_node("ReduceMean", ["h"], ["y"], axes=[2], keepdims=0),  # (1,6)
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_handwritten_onnx_graph_lowers_exactly():
    model = _graph_model()
    x = np.random.default_rng(1).uniform(-1, 1, size=(5, 32)).astype(np.float32)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = np.concatenate([sess.run(None, {"x": row[None]})[0] for row in x])
    for layout in ("single", "batch"):
        prog = export_ckks(model, calibration=x, layout=layout)
        assert prog.manifest.info["degree"] == 6
        np.testing.assert_allclose(prog.run_plain(x), want, rtol=1e-4, atol=1e-5)


def _attention_like() -> onnx.ModelProto:
    """(x W1) @ (x W2)^T: a ct x ct MatMul, as PolyAttn's QK^T."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(size=(4, 3)).astype(np.float32), n) for n in ("Wq", "Wk")]
    nodes = [
        helper.make_node("MatMul", ["x", "Wq"], ["q"]), helper.make_node("MatMul", ["x", "Wk"], ["k"]),
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]), helper.make_node("MatMul", ["q", "kt"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "a", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 5, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5, 5])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize("layout", ["single", "batch"])
def test_ct_ct_matmul_compiles_in_both_layouts(layout):
    model = _attention_like()
    x = np.random.default_rng(2).normal(size=(3, 1, 5, 4)).astype(np.float32)
    prog = export_ckks(model, calibration=x, layout=layout)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = np.concatenate([sess.run(None, {"x": row})[0].reshape(1, -1) for row in x])
    np.testing.assert_allclose(prog.run_plain(x), want, rtol=1e-4, atol=1e-5)


def test_non_polynomial_graph_names_the_node():
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with pytest.raises(CKKSExportError, match=r"(?i)relu"):
        export_ckks(model, input_shape=(1, 8, 8))


def test_parameters_too_deep_say_needed_and_available():
    with pytest.raises(ParameterError) as err:
        choose_params(levels=40, slots_needed=100, max_abs_value=10.0)
    text = str(err.value)
    assert "40 levels" in text and "N=32768" in text


def test_parameters_fit_and_grow_with_depth():
    shallow = choose_params(levels=2, slots_needed=64, max_abs_value=10.0)
    deep = choose_params(levels=9, slots_needed=64, max_abs_value=10.0)
    assert shallow.poly_modulus_degree == 8192 and deep.poly_modulus_degree == 16384
    assert deep.total_bits <= 438 and deep.levels == 9


def test_insecure_override_refused_unless_allowed(caplog):
    insecure = CKKSParams(8192, (60, 60, 60, 60), 40)
    with pytest.raises(ParameterError, match="128-bit"):
        validate(insecure)
    with caplog.at_level(logging.WARNING):
        checked = validate(insecure, allow_insecure=True)
    assert checked.security == "none" and "INSECURE" in caplog.text


def test_program_roundtrip_and_tamper_detection(tmp_path):
    model = digits_mlp()
    _, _, x, _ = digits()
    prog = export_ckks(model, calibration=x[:32], input_shape=(1, 8, 8))
    prog.save(tmp_path / "p")
    again = load_program(tmp_path / "p")
    assert again.program_id == prog.program_id
    np.testing.assert_allclose(again.run_plain(x[:4]), prog.run_plain(x[:4]))
    manifest = json.loads((tmp_path / "p" / "manifest.json").read_text())
    manifest["steps"][0]["level"] = 7
    (tmp_path / "p" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ProgramError, match="id mismatch"):
        load_program(tmp_path / "p")
    with pytest.raises(ProgramError, match="does not exist"):
        load_program(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ProgramError, match="manifest.json is missing"):
        load_program(tmp_path / "empty")
    (tmp_path / "empty" / "manifest.json").write_text("{not json")  # broken, and no arrays.npz either
    with pytest.raises(ProgramError, match="manifest.json is not valid JSON"):
        load_program(tmp_path / "empty")


def test_manifest_refuses_bad_samples_per_ciphertext(tmp_path):
    _, _, x, _ = digits()
    prog = export_ckks(digits_mlp(), calibration=x[:32], input_shape=(1, 8, 8))
    prog.save(tmp_path)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    for bad in (3, 0, 1 << 30):
        manifest["samples_per_ciphertext"] = bad
        (tmp_path / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(ProgramError, match="samples_per_ciphertext"):
            load_program(tmp_path)
