"""``polyfhe demo`` end to end on a small slice of digits: train, (calibrate), fold, export, analyse, accuracy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from polyfhe.cli import main
from polyfhe.training.checkpoint import load_checkpoint


def test_demo_trains_folds_exports_and_reports(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rc = main(["demo", "--data", "digits", "--epochs", "2", "--train-subset", "256", "--batch-size", "32",
               "--lr", "1e-2", "--device", "cpu", "--no-progress", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "degree analysis" in out and "ct x ct depth" in out and "folded ONNX model" in out
    summary = json.loads((tmp_path / "demo.json").read_text())
    assert summary["model"] == "monet_fhe_bn" and summary["onnx"]["analysis"]["polynomial"] is True
    assert summary["onnx"]["analysis"]["mult_depth"] == 4  # two Poly-Blocks: 2 ct x ct products each
    # folding and exporting keep the calibrated model's predictions, and the model learned something
    assert summary["folded_onnx_accuracy"] == pytest.approx(summary["calibrated_torch_accuracy"], abs=1e-9)
    assert summary["folded_onnx_accuracy"] > 0.3  # chance is 0.1
    assert summary["running_stats"] == "recomputed" and (tmp_path / "calibrated" / "calibration.json").is_file()
    calibrated, info = load_checkpoint(tmp_path / "calibrated", expect_model="monet_fhe_bn")
    trained, _ = load_checkpoint(tmp_path / "train")
    assert info.extra["calibrated"] is True and "normalization" in info.extra
    stats = [k for k in trained.state_dict() if k.endswith("running_var")]
    assert stats and any(not torch.equal(calibrated.state_dict()[k], trained.state_dict()[k]) for k in stats)
    assert (tmp_path / "train" / "metrics.json").is_file() and (tmp_path / "monet_fhe_bn.onnx").is_file()


def test_demo_reuses_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from polyfhe.training import train

    train("monet_fhe_bn", "digits", 1, tmp_path / "run", device="cpu", train_subset=64, batch_size=32,
          progress=False, model_kwargs={"dims": [32]})
    assert main(["demo", "--data", "digits", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "d"),
                 "--samples", "50", "--keep-stats"]) == 0
    out = capsys.readouterr().out
    assert "on 50 test images" in out and "running statistics kept from training" in out
    trained, _ = load_checkpoint(tmp_path / "run")
    kept, _ = load_checkpoint(tmp_path / "d" / "calibrated")
    assert all(torch.equal(value, kept.state_dict()[key]) for key, value in trained.state_dict().items())
    assert (tmp_path / "d" / "calibrated" / "calibration.json").is_file()
