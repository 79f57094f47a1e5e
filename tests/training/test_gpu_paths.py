"""The device-independent logic of the GPU training path, checked on CPU: device and autocast choice,
torch.compile's refusal and hand-off, batched loss reads (exact divergence step, same accounting), fused AdamW
only on CUDA parameters, normalisation tensors made once, and head dropout that never reads its rate on the host."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from polyfhe.data.sources import ImageDataset, load_digits
from polyfhe.models.polynext import RampDropout
from polyfhe.training import TrainingDiverged, train
from polyfhe.training import loop as loop_module
from polyfhe.training.checkpoint import load_checkpoint
from polyfhe.training.data import Normalization, make_splits, to_device
from polyfhe.training.loop import (
    LOSS_READ_EVERY,
    PendingLosses,
    autocast,
    evaluate,
    loss_read_interval,
    maybe_compile,
    resolve_amp,
    resolve_device,
)
from polyfhe.training.recipe import build_optimizer, on_cuda

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
TINY = {"dims": [16], "depths": [1]}


@pytest.fixture(scope="module")
def small_digits() -> ImageDataset:
    d = load_digits()
    return ImageDataset("digits", d.x_train[:320], d.y_train[:320], d.x_test[:120], d.y_test[:120], d.classes)


def _train(data, out: Path, epochs: int = 1, **options):
    options = {"batch_size": 32, "progress": False, "model_kwargs": TINY, "device": "cpu", **options}
    return train("monet_lr_bn", data, epochs, out, **options)


# ------------------------------------------------------------------------------------------ device, autocast
def test_autocast_auto_means_cuda_only() -> None:
    assert resolve_amp("auto", CUDA) and resolve_amp("auto", torch.device("cuda:1"))
    assert not resolve_amp("auto", CPU)
    assert resolve_amp("bf16", CPU) and not resolve_amp("off", CUDA)


def test_autocast_context_casts_only_when_enabled() -> None:
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with autocast(CPU, resolve_amp("auto", CPU)):
        assert (a @ b).dtype == torch.float32
    with autocast(CPU, True):
        assert (a @ b).dtype == torch.bfloat16


def test_auto_device_follows_cuda_availability(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == CUDA and resolve_device("cuda:0") == torch.device("cuda:0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == CPU
    with pytest.raises(ValueError, match="'cuda' requested but CUDA is not available.*--device cpu"):
        resolve_device("cuda")


# ------------------------------------------------------------------------------------------------- compile
def test_compile_refused_on_cpu_and_handed_to_torch_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    model = torch.nn.Linear(2, 2)
    assert maybe_compile(model, False, CPU) is model and maybe_compile(model, False, CUDA) is model
    with pytest.raises(ValueError, match="compile=True needs a CUDA device, got cpu; drop --compile"):
        maybe_compile(model, True, CPU)
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda m: compiled.append(m) or ("compiled", m))
    assert maybe_compile(model, True, CUDA) == ("compiled", model) and compiled == [model]


# -------------------------------------------------------------------------------------- batched loss reads
def test_loss_reads_every_step_on_cpu_batched_on_cuda() -> None:
    assert loss_read_interval(CPU) == 1 and loss_read_interval(CUDA) == LOSS_READ_EVERY > 1
    pending = PendingLosses(3)
    for step in (1, 2):
        pending.add(step, torch.tensor(float(step) / 4, requires_grad=True) * 1, 32, 1e-3 * step)
        assert not pending.due
    pending.add(3, torch.tensor(math.nan), 16, 3e-3)
    assert pending.due
    drained = pending.drain()
    assert [(s, n, lr) for s, _, n, lr in drained] == [(1, 32, 1e-3), (2, 32, 2e-3), (3, 16, 3e-3)]
    assert [v for _, v, _, _ in drained[:2]] == [0.25, 0.5] and math.isnan(drained[2][1])
    assert pending.drain() == [] and not pending.due


def test_batched_reads_name_the_exact_diverging_step(
    tmp_path: Path, small_digits: ImageDataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on CUDA: losses read every 5 steps, yet the NaN of step 12 (epoch 2) is reported as step 12."""
    monkeypatch.setattr(loop_module, "loss_read_interval", lambda device: 5)
    calls = {"n": 0}
    real_loss = loop_module.soft_cross_entropy

    def failing_loss(logits, targets):
        calls["n"] += 1
        loss = real_loss(logits, targets)
        return loss * math.nan if calls["n"] == 12 else loss

    monkeypatch.setattr(loop_module, "soft_cross_entropy", failing_loss)
    with pytest.raises(TrainingDiverged, match=r"loss became nan at step 12 \(epoch 2.*epoch 1") as info:
        _train(small_digits, tmp_path, epochs=3)
    assert info.value.step == 12 and calls["n"] == 14  # read at step 14: two more steps ran before it
    _, kept = load_checkpoint(tmp_path / "last")
    assert kept.epoch == 1  # the weights that saw the NaN were never saved


def test_batched_reads_account_the_same_losses(
    tmp_path: Path, small_digits: ImageDataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    every_step = _train(small_digits, tmp_path / "a", epochs=2)
    monkeypatch.setattr(loop_module, "loss_read_interval", lambda device: 4)  # 9 steps: reads at 4, 8, end
    batched = _train(small_digits, tmp_path / "b", epochs=2)
    assert [r.train_loss for r in batched.metrics.history] == [r.train_loss for r in every_step.metrics.history]
    assert batched.metrics.test_accuracy == every_step.metrics.test_accuracy


def test_test_accuracy_is_float32_after_bf16_training(tmp_path: Path, small_digits: ImageDataset) -> None:
    result = _train(small_digits, tmp_path, epochs=2, amp="bf16", lr=1e-2)
    assert result.metrics.amp == "bf16"
    model, _ = load_checkpoint(tmp_path)
    splits = make_splits(small_digits, val_fraction=0.1, seed=0, normalize=True)
    _, fp32 = evaluate(model.eval(), splits.x_test, splits.y_test, result.normalization, device=CPU,
                       batch_size=64, amp=False)
    assert result.metrics.test_accuracy == fp32


# ------------------------------------------------------------------------------------ optimizer, data, model
def test_fused_adamw_only_for_cuda_parameters() -> None:
    model = torch.nn.Linear(3, 2)
    assert not build_optimizer("adamw", model, 1e-3, 0.05).defaults["fused"]
    assert not on_cuda([{"params": list(model.parameters())}]) and not on_cuda([{"params": []}])
    fake_cuda = [SimpleNamespace(is_cuda=True), SimpleNamespace(is_cuda=True)]
    assert on_cuda([{"params": fake_cuda[:1]}, {"params": fake_cuda[1:]}])
    assert not on_cuda([{"params": [fake_cuda[0], next(model.parameters())]}])


def test_normalization_tensors_and_host_copies() -> None:
    norm = Normalization((0.5, 0.25), (2.0, 0.5))
    mean, std = norm.tensors(CPU)
    assert mean.shape == std.shape == (1, 2, 1, 1) and mean.dtype == torch.float32
    x = torch.rand(3, 2, 4, 4)
    torch.testing.assert_close((x - mean) / std, norm.apply(x))
    torch.testing.assert_close(norm.apply(x).numpy(), norm.apply_numpy(x.numpy()))
    idx = torch.arange(5)
    assert torch.equal(to_device(idx, CPU), idx)


def test_head_dropout_keeps_its_rate_on_the_device() -> None:
    x = torch.ones(4000, 8)
    off = RampDropout(0.0).train()
    assert off(x) is x
    drop = RampDropout(0.5, rampout=2).train()
    drop.set_epoch(0)
    assert torch.equal(drop(x), x)  # ramp starts at 0
    drop.set_epoch(1)  # p = 0.25: a quarter dropped, the rest scaled by 4/3
    y = drop(x).numpy()
    np.testing.assert_allclose(np.unique(y), [0.0, 4 / 3], rtol=1e-6)
    assert abs((y == 0).mean() - 0.25) < 0.02 and abs(y.mean() - 1.0) < 0.03
    assert drop.eval()(x) is x
