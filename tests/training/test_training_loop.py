"""End-to-end training on tiny data: outputs on disk, resume, divergence, CPU autocast, bad input, the CLI."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from polyfhe.cli import main
from polyfhe.data.sources import ImageDataset, load_digits
from polyfhe.training import TrainingDiverged, TrainResult, train
from polyfhe.training import loop as loop_module
from polyfhe.training.checkpoint import CheckpointError, load_checkpoint
from polyfhe.training.data import make_splits
from polyfhe.training.loop import evaluate

TINY = {"dims": [16], "depths": [1]}  # a one-block MONet: milliseconds per step



@pytest.fixture(scope="module")
def small_digits() -> ImageDataset:
    d = load_digits()
    return ImageDataset("digits", d.x_train[:320], d.y_train[:320], d.x_test[:120], d.y_test[:120], d.classes)


def _train(data, out: Path, epochs: int = 1, **options) -> TrainResult:
    options = {"batch_size": 32, "progress": False, "model_kwargs": TINY, "device": "cpu", **options}
    return train("monet_lr_bn", data, epochs, out, **options)


def test_progress_bar_is_quiet_when_stderr_is_not_a_terminal(tmp_path: Path, small_digits: ImageDataset,
                                                            capsys, monkeypatch) -> None:
    """A log file or CI gets no progress bar; a terminal gets one."""
    _train(small_digits, tmp_path / "pipe", progress=True)
    assert "epoch 1/1" not in capsys.readouterr().err  # pytest's captured stderr is no terminal
    monkeypatch.setattr("sys.stderr.isatty", lambda: True, raising=False)
    _train(small_digits, tmp_path / "tty", progress=True)
    assert "epoch 1/1" in capsys.readouterr().err


def test_run_writes_checkpoint_metrics_log_and_plot(tmp_path: Path, small_digits: ImageDataset) -> None:
    result = _train(small_digits, tmp_path, epochs=4, lr=1e-2)
    assert {"model.safetensors", "config.json", "metrics.json", "log.csv", "curves.png", "last"} <= {
        p.name for p in tmp_path.iterdir()}
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["epochs"] == 4 and metrics["wall_time_s"] > 0 and metrics["steps"] == 4 * (288 // 32)
    assert 0.3 < metrics["test_accuracy"] <= 1.0 and metrics["val_accuracy"] is not None  # chance is 0.1
    rows = list(csv.DictReader((tmp_path / "log.csv").read_text().splitlines()))
    assert [r["epoch"] for r in rows] == ["1", "2", "3", "4"] and float(rows[3]["train_loss"]) < float(rows[0]["train_loss"])
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # the saved model is the evaluated one: it reproduces the reported test accuracy from disk
    model, info = load_checkpoint(tmp_path, expect_model="monet_lr_bn")
    assert info.extra["normalization"] == result.normalization.to_dict() and info.epoch == 4
    splits = make_splits(small_digits, val_fraction=0.1, seed=0, normalize=True)
    _, acc = evaluate(model.eval(), splits.x_test, splits.y_test, result.normalization,
                      device=torch.device("cpu"), batch_size=64, amp=False)
    assert acc == pytest.approx(metrics["test_accuracy"])
    reopened = TrainResult.load(tmp_path)
    assert reopened.metrics == result.metrics and reopened.config == result.config


def test_resume_continues_and_refuses_other_architectures(tmp_path: Path, small_digits: ImageDataset) -> None:
    _train(small_digits, tmp_path, epochs=1)
    resumed = _train(small_digits, tmp_path, epochs=2, resume=str(tmp_path))
    assert resumed.metrics.epochs == 2 and [r.epoch for r in resumed.metrics.history] == [1, 2]
    assert resumed.metrics.steps == 2 * (288 // 32)
    assert len(list(csv.DictReader((tmp_path / "log.csv").read_text().splitlines()))) == 2
    with pytest.raises(CheckpointError, match="'monet_lr_bn'.*'cpolynext_lr_bn'"):
        train("cpolynext_lr_bn", small_digits, 2, tmp_path / "other", device="cpu", resume=str(tmp_path))


def test_nan_loss_stops_with_step_and_keeps_last_good_checkpoint(
    tmp_path: Path, small_digits: ImageDataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = {"n": 0}
    real_loss = loop_module.soft_cross_entropy

    def failing_loss(logits, targets):
        calls["n"] += 1
        loss = real_loss(logits, targets)
        return loss * math.nan if calls["n"] == 12 else loss  # 9 steps per epoch: step 12 is in epoch 2

    monkeypatch.setattr(loop_module, "soft_cross_entropy", failing_loss)
    with pytest.raises(TrainingDiverged, match=r"loss became nan at step 12 \(epoch 2.*last.*epoch 1.*--lr") as info:
        _train(small_digits, tmp_path, epochs=3)
    assert info.value.step == 12 and info.value.epoch == 2
    _, kept = load_checkpoint(tmp_path / "last")
    assert kept.epoch == 1


def test_nan_in_first_epoch_says_no_checkpoint_yet(tmp_path: Path, small_digits: ImageDataset) -> None:
    poisoned = ImageDataset("digits", np.full_like(small_digits.x_train, np.nan), small_digits.y_train,
                            small_digits.x_test, small_digits.y_test, small_digits.classes)
    with pytest.raises(TrainingDiverged, match="step 1 .*no checkpoint was written yet"):
        _train(poisoned, tmp_path, normalize=False)


def test_bf16_autocast_ema_and_head_dropout_ramp_on_cpu(tmp_path: Path, small_digits: ImageDataset) -> None:
    tiny = ImageDataset("digits", small_digits.x_train[:64], small_digits.y_train[:64],
                        small_digits.x_test[:16], small_digits.y_test[:16], small_digits.classes)
    # the LN variant: an untrained BN PolyNeXt overflows in eval mode (spec 2.7), which would test nothing here
    result = train("cpolynext_lr", tiny, 2, tmp_path, device="cpu", amp="bf16", batch_size=32, progress=False,
                   ema_decay=0.9, drop_rate=0.4, rampout=4, val_fraction=0.25, mixup=0.2, cutmix=1.0)
    assert result.metrics.amp == "bf16" and result.metrics.weights in ("ema", "raw")
    assert all(r.val_accuracy_ema is not None for r in result.metrics.history)
    assert math.isfinite(result.metrics.test_loss)
    # the raw model's dropout buffer was set for epoch index 1 of a 4-epoch ramp: 0.4 * 1/4
    raw, _ = load_checkpoint(tmp_path / "last")
    assert float(raw.head.dropout.p) == pytest.approx(0.1)


def test_bad_options_are_named(tmp_path: Path, small_digits: ImageDataset) -> None:
    with pytest.raises(ValueError, match="unknown training options.*'lrate'.*accepted"):
        _train(small_digits, tmp_path, lrate=1.0)
    with pytest.raises(ValueError, match="compile=True needs a CUDA device"):
        _train(small_digits, tmp_path, compile=True)
    with pytest.raises(ValueError, match="optimizer 'adam' unknown"):
        _train(small_digits, tmp_path, optimizer="adam")
    with pytest.raises(KeyError, match="unknown model 'monet_xl'"):
        train("monet_xl", small_digits, 1, tmp_path)
    with pytest.raises(ValueError, match="cannot build 'monet_lr_bn'.*drop_rate"):
        _train(small_digits, tmp_path, drop_rate=0.1)  # head dropout exists in PolyNeXt only
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            _train(small_digits, tmp_path, device="cuda")


def test_time_budget_stops_early(tmp_path: Path, small_digits: ImageDataset) -> None:
    result = _train(small_digits, tmp_path, epochs=50, time_budget_s=1e-3)
    assert result.metrics.epochs == 1 and result.metrics.steps == 1
    assert "time budget" in result.metrics.stopped_early


def test_cli_train_and_bad_data(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    rc = main(["train", "--model", "monet_lr_bn", "--data", "digits", "--epochs", "1", "--out", str(out),
               "--device", "cpu", "--no-progress", "--train-subset", "64", "--batch-size", "32",
               "--model-arg", "dims=[8]", "--model-arg", "depths=[1]", "--lr", "2e-3"])
    assert rc == 0 and "test accuracy" in capsys.readouterr().out
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 2 and json.loads((out / "config.json").read_text())["model_kwargs"]["dims"] == [8]
    rc = main(["train", "--model", "monet_lr_bn", "--data", str(tmp_path / "missing"), "--epochs", "1",
               "--out", str(tmp_path / "x")])
    assert rc == 2 and "does not exist" in capsys.readouterr().err


@pytest.mark.gpu
def test_cuda_bf16_and_compile(tmp_path: Path, small_digits: ImageDataset) -> None:
    result = _train(small_digits, tmp_path, epochs=2, device="cuda", compile=True, ema_decay=0.9, lr=1e-2)
    assert result.metrics.device.startswith("cuda") and result.metrics.amp == "bf16"
    assert result.metrics.test_accuracy > 0.3
    model, _ = load_checkpoint(tmp_path)  # saved from the compiled run without "_orig_mod." prefixes
    assert next(model.parameters()).device.type == "cpu"
