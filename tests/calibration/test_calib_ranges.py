"""profile_onnx_ranges: every input-dependent float value, exact statistics, proto/path/bytes inputs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from polyfhe.calibration import ValueRange, profile_onnx_ranges
from polyfhe.calibration import ranges as ranges_module


def _graph() -> onnx.ModelProto:
    """h = x (2 W) + b, y = h * h; w2 = 2 W depends on initializers only and y_shape is int64."""
    w = np.array([[1.0, -2.0], [0.5, 3.0], [-1.0, 0.25]], dtype=np.float32)
    b = np.array([0.1, -0.2], dtype=np.float32)
    nodes = [
        helper.make_node("Mul", ["W", "two"], ["w2"]),
        helper.make_node("MatMul", ["x", "w2"], ["h0"]),
        helper.make_node("Add", ["h0", "b"], ["h"]),
        helper.make_node("Mul", ["h", "h"], ["y"]),
        helper.make_node("Shape", ["y"], ["y_shape"]),
    ]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2]),
         helper.make_tensor_value_info("y_shape", TensorProto.INT64, [2])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "b"),
         numpy_helper.from_array(np.array(2.0, dtype=np.float32), "two")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


def _expected(x: np.ndarray) -> dict[str, np.ndarray]:
    w = np.array([[1.0, -2.0], [0.5, 3.0], [-1.0, 0.25]], dtype=np.float32) * 2
    h0 = x @ w
    h = h0 + np.array([0.1, -0.2], dtype=np.float32)
    return {"x": x, "h0": h0, "h": h, "y": h * h}


def test_every_input_dependent_float_value_is_profiled_exactly() -> None:
    x = np.random.default_rng(0).normal(size=(10, 3)).astype(np.float32)
    got = profile_onnx_ranges(_graph(), x, batch_size=3)  # 4 batches, the last one short
    assert set(got) == {"x", "h0", "h", "y"}  # not w2 (constant) nor y_shape (int64)
    for name, values in _expected(x).items():
        v = values.astype(np.float64)
        r = got[name]
        assert r.shape == v.shape[1:] and r.count == v.size
        np.testing.assert_allclose([r.min, r.max, r.abs_max], [v.min(), v.max(), np.abs(v).max()], rtol=1e-6)
        np.testing.assert_allclose([r.mean, r.std], [v.mean(), v.std()], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose([r.p001, r.p999], np.percentile(v, [0.1, 99.9]), rtol=1e-5, atol=1e-6)


def test_path_bytes_and_proto_give_the_same_ranges(tmp_path: Path) -> None:
    x = np.random.default_rng(1).normal(size=(4, 3)).astype(np.float32)
    model = _graph()
    path = tmp_path / "g.onnx"
    onnx.save(model, path)
    by_proto = profile_onnx_ranges(model, x)
    assert profile_onnx_ranges(path, x) == by_proto
    assert profile_onnx_ranges(model.SerializeToString(), x) == by_proto


def test_input_of_the_wrong_shape_is_refused() -> None:
    with pytest.raises(ValueError, match=r"shape \(4, 5\) does not fit graph input 'x'"):
        profile_onnx_ranges(_graph(), np.zeros((4, 5), dtype=np.float32))
    with pytest.raises(ValueError, match="empty"):
        profile_onnx_ranges(_graph(), np.zeros((0, 3), dtype=np.float32))


def test_subsampled_percentiles_keep_exact_extremes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ranges_module, "PERCENTILE_SAMPLES", 64)
    x = np.random.default_rng(2).uniform(-1, 1, size=(500, 3)).astype(np.float32)
    r = profile_onnx_ranges(_graph(), x, batch_size=100)["x"]
    assert r.count == x.size
    assert r.min == pytest.approx(float(x.min())) and r.max == pytest.approx(float(x.max()))
    assert -1.0 <= r.p001 < -0.5 and 0.5 < r.p999 <= 1.0  # estimates from about 64 of 1500 numbers


def test_value_range_round_trip_is_strict_json_even_when_non_finite() -> None:
    r = ValueRange("v", (2, 3), -math.inf, math.inf, math.inf, -1.0, 1.0, math.nan, math.nan, 6)
    text = json.dumps(r.to_dict(), allow_nan=False)
    back = ValueRange.from_dict(json.loads(text))
    assert back.shape == (2, 3) and back.max == math.inf and back.min == -math.inf and math.isnan(back.mean)
    finite = ValueRange("w", (4,), -2.0, 3.0, 3.0, -1.9, 2.9, 0.5, 1.0, 40)
    assert ValueRange.from_dict(json.loads(json.dumps(finite.to_dict()))) == finite
