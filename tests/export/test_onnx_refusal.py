"""A refused export offers the way in (polyfhe.polynomialize) and leaves no file behind."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

import polyfhe
from polyfhe.analysis import Violation
from polyfhe.exporters.ckks import CKKSExportError
from polyfhe.exporters.onnx import ExportError


def _relu_mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))


def test_refused_onnx_export_leaves_no_file_and_names_polynomialize(tmp_path: Path) -> None:
    target = tmp_path / "relu.onnx"
    with pytest.raises(ExportError) as err:
        polyfhe.export(_relu_mlp(), target="onnx", path=target, input_shape=(1, 4, 4))
    assert list(tmp_path.iterdir()) == [], "a refused export left a file behind"
    text = str(err.value)
    assert "Relu" in text and "polyfhe.polynomialize(model" in text and "no file was written" in text


def test_refused_onnx_export_keeps_an_earlier_good_file(tmp_path: Path) -> None:
    target = tmp_path / "model.onnx"
    target.write_bytes(b"earlier export")
    with pytest.raises(ExportError):
        polyfhe.export(_relu_mlp(), target="onnx", path=target, input_shape=(1, 4, 4))
    assert target.read_bytes() == b"earlier export" and [p.name for p in tmp_path.iterdir()] == ["model.onnx"]


def test_accepted_onnx_export_is_written_where_asked(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 3)).eval()
    path = polyfhe.export(model, target="onnx", path=tmp_path / "lin.onnx", input_shape=(1, 4, 4))
    assert path == tmp_path / "lin.onnx" and [p.name for p in tmp_path.iterdir()] == ["lin.onnx"]


def test_ckks_export_of_a_relu_model_offers_polynomialize() -> None:
    with pytest.raises(CKKSExportError, match=r"(?s)Relu.*The way in: .*polyfhe\.polynomialize\(model, data="):
        polyfhe.export(_relu_mlp(), target="ckks", input_shape=(1, 4, 4))


def test_analyzer_reason_and_remedy_name_the_way_in(tmp_path: Path) -> None:
    from polyfhe.analysis.hints import remedy
    from polyfhe.exporters.onnx import export_onnx

    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.SiLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(2, 3))
    exported = export_onnx(model, tmp_path / "m.onnx", (1, 4, 4), require_polynomial=False)
    reasons = {v.op: v.reason for v in exported.analysis.violations}
    assert "polyfhe.polynomialize" in reasons["Sigmoid"] and "average pooling" in reasons["MaxPool"]
    assert remedy([Violation("n", "Softmax", "")]).startswith("Softmax has no polynomial stand-in")
    assert remedy([Violation("n", "Einsum", "")]) == ""
