"""The recipe's pieces alone: schedule, targets, mixing, EMA, LAMB, weight-decay groups, augmentation, normalisation."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch import nn

import polyfhe
from polyfhe.training.data import Normalization, batch_indices, random_flip, random_shift, resolve_augment
from polyfhe.training.loop import epochs_within_budget
from polyfhe.training.recipe import (
    Lamb,
    ModelEma,
    cosine_lr,
    mix_batch,
    param_groups,
    smooth_one_hot,
    soft_cross_entropy,
)


def test_cosine_schedule_warms_up_then_decays_to_min() -> None:
    lrs = [cosine_lr(s, 100, 10, 1e-3, 1e-5) for s in range(101)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a < b for a, b in itertools.pairwise(lrs[:10]))
    assert all(a >= b for a, b in itertools.pairwise(lrs[10:]))
    assert lrs[100] == pytest.approx(1e-5) and lrs[55] == pytest.approx((1e-3 + 1e-5) / 2)


def test_smoothed_targets_and_loss() -> None:
    t = smooth_one_hot(torch.tensor([2, 0]), 4, 0.2)
    assert torch.allclose(t.sum(1), torch.ones(2)) and t[0, 2] == pytest.approx(0.85) and t[0, 1] == pytest.approx(0.05)
    logits = torch.tensor([[0.0, 0.0, 5.0, 0.0]])
    hard = smooth_one_hot(torch.tensor([2]), 4, 0.0)
    assert soft_cross_entropy(logits, hard) == pytest.approx(float(nn.functional.cross_entropy(logits, torch.tensor([2]))))


def test_mixup_is_a_convex_combination() -> None:
    x = torch.stack([torch.zeros(1, 4, 4), torch.ones(1, 4, 4)])
    y = smooth_one_hot(torch.tensor([0, 1]), 2, 0.0)
    mx, my = mix_batch(x, y, mixup=1.0, cutmix=0.0, prob=1.0, rng=np.random.default_rng(3))
    lam = float(my[0, 0])
    assert 0 < lam < 1 and torch.allclose(mx[0], torch.full((1, 4, 4), 1 - lam))
    assert torch.allclose(my.sum(1), torch.ones(2))


def test_cutmix_targets_follow_the_pasted_area() -> None:
    x = torch.stack([torch.zeros(1, 8, 8), torch.ones(1, 8, 8)])
    y = smooth_one_hot(torch.tensor([0, 1]), 2, 0.0)
    for seed in range(5):
        mx, my = mix_batch(x, y, mixup=0.0, cutmix=1.0, prob=1.0, rng=np.random.default_rng(seed))
        pasted = float(mx[0].mean())  # share of image 0 now taken from image 1
        assert my[0, 1] == pytest.approx(pasted)


def test_mixing_off_is_identity() -> None:
    x, y = torch.rand(2, 1, 4, 4), torch.eye(2)
    assert mix_batch(x, y, mixup=0.0, cutmix=0.0, prob=1.0, rng=np.random.default_rng(0))[0] is x
    assert mix_batch(x, y, mixup=1.0, cutmix=0.0, prob=0.0, rng=np.random.default_rng(0))[0] is x


def test_ema_averages_parameters_and_buffers() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    ema = ModelEma(model, decay=0.5)
    assert ema.current_decay() == pytest.approx(0.1)  # warm-up: (1 + 0) / (10 + 0)
    ema.updates = 100  # past warm-up: the configured 0.5
    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[1].running_mean.fill_(2.0)
        model[1].num_batches_tracked.fill_(7)
    before = ema.module[0].weight.clone()
    ema.update(model)
    assert torch.allclose(ema.module[0].weight, 0.5 * before + 0.5)
    assert torch.allclose(ema.module[1].running_mean, torch.full((2,), 1.0))  # buffers averaged (use_buffers)
    assert int(ema.module[1].num_batches_tracked) == 7  # integer buffers copied
    assert not any(p.requires_grad for p in ema.module.parameters())


def test_lamb_minimises_a_quadratic() -> None:
    w = nn.Parameter(torch.tensor([3.0, -2.0]))
    opt = Lamb([w], lr=0.05)
    for _ in range(200):
        opt.zero_grad()
        (w ** 2).sum().backward()
        opt.step()
    assert float(w.detach().norm()) < 0.2


def test_no_weight_decay_on_gains_and_biases() -> None:
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.LayerNorm(2))
    decay, no_decay = param_groups(model, 0.05)
    assert [p.shape for p in decay["params"]] == [torch.Size([2, 1, 3, 3])]
    assert len(no_decay["params"]) == 3 and no_decay["weight_decay"] == 0.0


def test_broadcast_shaped_scales_are_not_decayed() -> None:
    """PolyNeXt's cell scales are (1, C, 1, 1): vectors, not kernels, so decay would pull them to 0."""
    cell = polyfhe.create_model("cpolynext_fhe_bn").cells[0].preprocess0
    decay, no_decay = param_groups(cell, 0.05)
    assert cell.scale.shape == (1, 40, 1, 1)
    assert any(p is cell.scale for p in no_decay["params"]) and not any(p is cell.scale for p in decay["params"])
    depthwise_1x1 = nn.Conv2d(4, 4, 1, groups=4)  # (4, 1, 1, 1): a per-channel scale too
    kernel = nn.Conv2d(4, 4, 3, groups=4)  # (4, 1, 3, 3): a kernel
    decay, no_decay = param_groups(nn.Sequential(depthwise_1x1, kernel), 0.05)
    assert [p.shape for p in decay["params"]] == [torch.Size([4, 1, 3, 3])]


def test_random_shift_moves_content_without_scaling() -> None:
    x = torch.zeros(16, 1, 8, 8)
    x[:, :, 4, 4] = 1.0
    g = torch.Generator().manual_seed(0)
    out = random_shift(x, g)
    assert out.shape == x.shape and torch.allclose(out.sum((1, 2, 3)), torch.ones(16))
    positions = {tuple(torch.nonzero(o[0])[0].tolist()) for o in out}
    assert len(positions) > 1 and all(abs(r - 4) <= 1 and abs(c - 4) <= 1 for r, c in positions)


def test_random_flip_flips_about_half() -> None:
    x = torch.arange(4.0).view(1, 1, 1, 4).repeat(200, 1, 1, 1)
    out = random_flip(x, torch.Generator().manual_seed(0))
    flipped = (out[:, 0, 0, 0] == 3).sum().item()
    assert 60 < flipped < 140 and torch.equal(out[out[:, 0, 0, 0] == 3][0, 0, 0], torch.tensor([3.0, 2, 1, 0]))


def test_augmentation_defaults_never_mirror_digits() -> None:
    assert resolve_augment("auto", "digits") == "shift" and resolve_augment("auto", "mnist") == "shift"
    assert resolve_augment("auto", "cifar10") == "flip-shift" and resolve_augment("auto", "my.npz") == "none"
    assert resolve_augment("none", "cifar10") == "none" and resolve_augment("auto", "fashion-mnist") == "flip"


def test_normalization_fit_and_apply() -> None:
    x = np.random.default_rng(0).random((50, 2, 4, 4)).astype(np.float32) * [[[[1.0]], [[3.0]]]]
    norm = Normalization.fit(x)
    out = norm.apply(torch.from_numpy(x.astype(np.float32)))
    assert torch.allclose(out.mean((0, 2, 3)), torch.zeros(2), atol=1e-5)
    assert torch.allclose(out.std((0, 2, 3), unbiased=False), torch.ones(2), atol=1e-4)
    assert Normalization.from_dict(norm.to_dict()) == norm
    with pytest.raises(ValueError, match="positive std"):
        Normalization((0.0,), (0.0,))


def test_batches_drop_the_ragged_tail_for_training() -> None:
    assert [len(b) for b in batch_indices(10, 4, torch.Generator(), drop_last=True)] == [4, 4]
    assert [len(b) for b in batch_indices(10, 4, None, drop_last=False)] == [4, 4, 2]
    assert [len(b) for b in batch_indices(3, 4, None, drop_last=True)] == [3]


def test_time_budget_shortens_the_plan() -> None:
    assert epochs_within_budget(10, 1, 30.0, 100.0) == 4  # 1 done + 3 more of 30 s in 100 s
    assert epochs_within_budget(10, 1, 30.0, 1000.0) == 10  # never more than planned
    assert epochs_within_budget(10, 2, 30.0, -5.0) == 2  # over budget: stop after what is done
