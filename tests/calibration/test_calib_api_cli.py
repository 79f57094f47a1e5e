"""calibrate() end to end on an FHE recipe, CalibrationResult storage, ``polyfhe calibrate CHECKPOINT``."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import polyfhe
from polyfhe.calibration import CALIBRATION_FILE, CalibrationError, CalibrationResult, sample_images
from polyfhe.cli import main as cli_main
from polyfhe.data.sources import load_digits
from polyfhe.models.layers.token_norms import TokenBatchNorm
from polyfhe.training.checkpoint import load_checkpoint, save_checkpoint

KWARGS = {"img_size": 8, "num_classes": 10, "in_chans": 1}


def _images(n: int = 96, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0, 1, size=(n, 1, 8, 8)).astype(np.float32)


def _norms(model: torch.nn.Module) -> list[TokenBatchNorm]:
    return [m for m in model.modules() if isinstance(m, TokenBatchNorm)]


def test_calibrate_updates_stats_in_place_and_ranges_match_the_model() -> None:
    model = polyfhe.create_model("monet_fhe_bn", **KWARGS).train()
    x = _images()
    result = polyfhe.calibrate(model, torch.from_numpy(x), batch_size=40)  # 3 batches, the last short
    assert not model.training
    norms = _norms(model)
    assert len(norms) == 12 and all(n.momentum == 0.1 and int(n.num_batches_tracked) == 3 for n in norms)
    assert result.model_name == "monet_fhe_bn" and result.num_samples == 96
    assert result.stats_summary["num_samples"] == 96 and len(result.stats_summary["layers"]) == 12
    assert result.input_range == result.node_ranges["input"]
    assert result.input_range.min == pytest.approx(float(x.min())) and result.input_range.shape == (1, 8, 8)
    with torch.no_grad():
        logits = model(torch.from_numpy(x)).double().numpy()
    out = result.range_of("logits")  # the ranges are those of the calibrated model's own graph
    assert out.shape == (10,) and out.count == logits.size
    np.testing.assert_allclose([out.min, out.max, out.mean], [logits.min(), logits.max(), logits.mean()],
                               rtol=1e-4, atol=1e-5)
    assert len(result.node_ranges) > 50 and result.max_abs >= out.abs_max


def test_batches_limits_the_data_and_bad_shapes_are_refused() -> None:
    model = polyfhe.create_model("cpolynext_fhe_bn", **KWARGS)
    result = polyfhe.calibrate(model, _images(), batches=1, batch_size=32, onnx_ranges=False)
    assert result.num_samples == 32 and result.node_ranges == {}
    assert result.stats_summary["num_batches"] == 1
    with pytest.raises(CalibrationError, match=r"shape \(1, 28, 28\).*expects \(1, 8, 8\)"):
        polyfhe.calibrate(model, np.zeros((4, 1, 28, 28), dtype=np.float32))
    with pytest.raises(CalibrationError, match="floating point"):
        polyfhe.calibrate(model, np.zeros((4, 1, 8, 8), dtype=np.uint8))


def test_keep_stats_profiles_ranges_and_leaves_the_trained_statistics_alone() -> None:
    model = polyfhe.create_model("monet_fhe_bn", **KWARGS).train()
    with torch.no_grad():  # statistics "from training" that a recalibration on these images would replace
        model(torch.from_numpy(_images(64, seed=1) * 3.0))
    before = copy.deepcopy(model.state_dict())
    result = polyfhe.calibrate(model, _images(), batch_size=40, recompute_stats=False)
    assert not model.training
    assert all(torch.equal(value, model.state_dict()[key]) for key, value in before.items())
    assert result.num_samples == 96 and result.stats_summary["num_samples"] == 0
    layers = result.stats_summary["layers"]
    assert len(layers) == 12 and layers[0]["buffers"]["running_var"]["max"] == pytest.approx(
        float(_norms(model)[0].running_var.max()))
    assert "logits" in result.node_ranges and result.input_range.count == _images().size
    recalibrated = polyfhe.calibrate(copy.deepcopy(model).train(), _images(), batch_size=40, onnx_ranges=False)
    assert recalibrated.stats_summary["layers"] != layers  # the option is what kept them


def test_result_round_trips_through_strict_json(tmp_path: Path) -> None:
    model = polyfhe.create_model("cpolynext_fhe_bn", **KWARGS)
    result = polyfhe.calibrate(model, _images(40), batch_size=16)
    path = result.save(tmp_path)
    assert path == tmp_path / CALIBRATION_FILE
    json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert CalibrationResult.load(tmp_path) == result
    assert CalibrationResult.load(path) == result
    with pytest.raises(FileNotFoundError, match="polyfhe calibrate"):
        CalibrationResult.load(tmp_path / "missing")


def test_cli_calibrates_a_checkpoint_in_place(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model = polyfhe.create_model("monet_fhe_bn", **KWARGS)
    extra = {"a": 1, "normalization": {"mean": [0.3], "std": [0.4]}}  # as polyfhe train records it
    save_checkpoint(model, tmp_path, model_name="monet_fhe_bn", model_kwargs=KWARGS, epoch=3, extra=extra)
    expected = copy.deepcopy(model)
    subset = (sample_images(load_digits().x_train, 300, seed=5) - 0.3) / 0.4
    polyfhe.calibrate(expected, subset, batch_size=128, onnx_ranges=False)

    code = cli_main(["calibrate", str(tmp_path), "--data", "digits", "--samples", "300", "--seed", "5",
                     "--batch-size", "128"])
    assert code == 0, capsys.readouterr().err
    assert "value ranges" in capsys.readouterr().out
    reloaded, info = load_checkpoint(tmp_path)
    assert info.epoch == 3 and info.extra["a"] == 1 and info.extra["normalization"] == extra["normalization"]
    assert info.extra["calibration"]["data"] == "digits" and info.extra["calibration"]["normalized"]
    for got, want in zip(_norms(reloaded), _norms(expected), strict=True):
        torch.testing.assert_close(got.running_mean, want.running_mean)
        torch.testing.assert_close(got.running_var, want.running_var)
    result = CalibrationResult.load(tmp_path)
    assert result.num_samples == 300 and "logits" in result.node_ranges
    assert result.input_range.min == pytest.approx(-0.75) and result.input_range.max == pytest.approx(1.75)


def test_cli_keep_stats_writes_ranges_only(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model = polyfhe.create_model("cpolynext_fhe_bn", **KWARGS)
    with torch.no_grad():
        model.train()(torch.from_numpy(_images(32, seed=2)))
    save_checkpoint(model.eval(), tmp_path, model_name="cpolynext_fhe_bn", model_kwargs=KWARGS)
    code = cli_main(["calibrate", str(tmp_path), "--data", "digits", "--samples", "64", "--keep-stats"])
    assert code == 0, capsys.readouterr().err
    assert "kept the trained statistics" in capsys.readouterr().out
    reloaded, info = load_checkpoint(tmp_path)
    assert all(torch.equal(value, reloaded.state_dict()[key]) for key, value in model.state_dict().items())
    assert info.extra["calibration"]["running_stats"] == "kept"
    assert "logits" in CalibrationResult.load(tmp_path).node_ranges
    with pytest.raises(SystemExit):  # ranges-only and statistics-only at once make no sense
        cli_main(["calibrate", str(tmp_path), "--data", "digits", "--keep-stats", "--no-ranges"])


def test_cli_reports_bad_input_with_exit_code_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli_main(["calibrate", str(tmp_path / "nope"), "--data", "digits"]) == 2
    assert "does not exist" in capsys.readouterr().err
    model = polyfhe.create_model("monet_fhe_bn")
    save_checkpoint(model, tmp_path, model_name="monet_fhe_bn", model_kwargs={})
    assert cli_main(["calibrate", str(tmp_path), "--data", "digits"]) == 2  # 8x8 digits into a 28x28 model
    assert "expects (1, 28, 28)" in capsys.readouterr().err
    assert not (tmp_path / CALIBRATION_FILE).exists()
