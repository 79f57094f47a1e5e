"""``polyfhe.analyze`` takes a torch module (exported to ONNX first) beside ONNX models; anything else, or a module
without a known input shape, is refused with what is accepted and how to get there. Reports print short."""

from __future__ import annotations

import onnx
import pytest
import torch
from ckks_testlib import Square
from torch import nn

import polyfhe
from polyfhe.analysis import ModelLoadError
from polyfhe.analysis import analyze as analyze_onnx
from polyfhe.exporters.onnx import export_onnx


def _mlp(*middle: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 6), *middle, nn.Linear(6, 3))


def test_a_module_is_exported_then_analysed(tmp_path):
    model = _mlp(Square())
    report = polyfhe.analyze(model, input_shape=(3, 2, 2))
    assert report.polynomial and report.degree == 2 and report.mult_depth == 1
    path = polyfhe.export(model, target="onnx", path=tmp_path / "m.onnx", input_shape=(3, 2, 2))
    assert report.to_dict() == polyfhe.analyze(path).to_dict()  # the same as exporting it by hand


def test_a_module_with_an_input_shape_needs_no_argument():
    model = polyfhe.create_model("monet_lr_bn", num_classes=10, img_size=8)
    report = polyfhe.analyze(model)
    assert report.polynomial and report.degree >= 2


def test_a_non_polynomial_module_is_reported_not_refused():
    report = polyfhe.analyze(_mlp(nn.ReLU()), input_shape=(3, 2, 2))
    assert not report.polynomial and [v.op for v in report.violations] == ["Relu"]


def test_a_module_without_a_shape_says_how_to_give_one():
    with pytest.raises(ValueError, match=r"polyfhe.analyze\(module, input_shape=\(1, 28, 28\)\).*"
                                         r"polyfhe.export\(model, target=\"onnx\""):
        polyfhe.analyze(_mlp(Square()))


def test_wrong_types_say_what_is_accepted():
    with pytest.raises(ModelLoadError, match=r"ModelProto, a path to a .onnx file or its bytes.*nn.Module.*got int"):
        polyfhe.analyze(42)
    with pytest.raises(ModelLoadError, match=r"torch module \(Sequential\).*polyfhe.analyze\(module, input_shape="):
        analyze_onnx(_mlp(Square()))  # the analyzer itself reads ONNX only, and says how to get there
    with pytest.raises(ValueError, match="input_shape= is for a torch nn.Module"):
        polyfhe.analyze(onnx.ModelProto(), input_shape=(1, 2))


def test_reports_print_short(tmp_path):
    model = polyfhe.create_model("monet_lr_bn", num_classes=10, img_size=8)
    report = analyze_onnx(polyfhe.export(model, target="onnx", path=tmp_path / "monet.onnx"))
    text = repr(report)
    assert "\n" not in text and len(text) < 250 and "NodeInfo" not in text
    assert f"nodes={len(report.nodes)}" in text and f"degree={report.degree}" in text
    relu = _mlp(nn.ReLU(), nn.Linear(6, 6), nn.ReLU())
    bad = analyze_onnx(export_onnx(relu, tmp_path / "relu.onnx", (3, 2, 2), require_polynomial=False).path)
    assert "violations=2 (first: Relu at '/2/Relu')" in repr(bad)
    lines = str(bad).splitlines()
    assert lines[0] == repr(bad) and sum("violation:" in line for line in lines) == 2
