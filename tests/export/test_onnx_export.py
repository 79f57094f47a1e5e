"""polyfhe.export(target="onnx"): fold, checker, onnxruntime parity, analyzer; bad input is refused clearly."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
import torch
from torch import nn

import polyfhe
from polyfhe.exporters.onnx import ExportError, export_onnx


def _trained_like(name: str, **overrides) -> nn.Module:
    model = polyfhe.create_model(name, **overrides)
    nn.init.normal_(model.head.weight, std=0.1)
    model.train()
    with torch.no_grad():
        for _ in range(2):
            model(torch.rand(8, *model.input_shape))
    return model.eval()


def test_export_monet_bn_is_checked_and_polynomial(tmp_path: Path) -> None:
    model = _trained_like("monet_lr_bn")
    path = polyfhe.export(model, target="onnx", path=tmp_path / "m.onnx")
    proto = onnx.load(str(path))
    assert proto.opset_import[0].version >= 17
    report = polyfhe.analyze(path)
    assert report.polynomial and report.degree == 16 and report.mult_depth == 4
    result = export_onnx(model, tmp_path / "again.onnx")
    assert result.max_rel_error <= 1e-5


@pytest.mark.parametrize("fold_first", [True, False])
def test_export_does_not_mutate_the_model(tmp_path: Path, fold_first: bool) -> None:
    model = _trained_like("monet_lr_bn").double()
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    if fold_first:
        polyfhe.export(model, target="onnx", path=tmp_path / "m.onnx")
    else:
        export_onnx(polyfhe.fold(model), tmp_path / "m.onnx", fold_first=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.training, "export switched the caller's model to eval mode"
    assert next(model.parameters()).dtype == torch.float64, "export cast the caller's model to float32"


def test_non_polynomial_model_is_refused_naming_the_node(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))
    with pytest.raises(ExportError, match="Relu"):
        polyfhe.export(model, target="onnx", path=tmp_path / "relu.onnx", input_shape=(1, 4, 4))


def test_square_activation_user_model_is_accepted(tmp_path: Path) -> None:
    class Square(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * x

    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), Square(), nn.Flatten(),
                          nn.Linear(64, 10))
    result = export_onnx(model.eval(), tmp_path / "sq.onnx", input_shape=(1, 4, 4))
    assert result.analysis.polynomial and result.analysis.degree == 2 and result.analysis.mult_depth == 1


def test_missing_input_shape_and_unknown_target_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="input_shape"):
        polyfhe.export(nn.Linear(3, 2), target="onnx", path=tmp_path / "l.onnx")
    with pytest.raises(ValueError, match="available: ckks, concrete, onnx"):
        polyfhe.export(nn.Linear(3, 2), target="tflite")


def test_an_onnx_file_gets_the_umask_mode_not_a_private_one(tmp_path: Path) -> None:
    """An ONNX file holds no secret: it is written with the process's umask (0644 under 022), like any file."""
    import os

    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 2)).eval()
    old = os.umask(0o022)
    try:
        path = polyfhe.export(model, target="onnx", path=tmp_path / "m.onnx", input_shape=(1, 2, 2))
        os.umask(0o027)
        other = polyfhe.export(model, target="onnx", path=tmp_path / "n.onnx", input_shape=(1, 2, 2))
    finally:
        os.umask(old)
    assert oct(Path(path).stat().st_mode & 0o777) == "0o644"
    assert oct(Path(other).stat().st_mode & 0o777) == "0o640"
