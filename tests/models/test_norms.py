"""PolyNeXt norm layers: LayerNorm2d, ChannelBatchNorm, RunningRowSumNorm and the norm factory."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from polyfhe.models.layers.norms import (
    ChannelBatchNorm,
    LayerNorm2d,
    RunningRowSumNorm,
    make_norm,
)


# ---------------------------------------------------------------------------------------------- LayerNorm2d
def test_layernorm2d_matches_per_pixel_layer_norm() -> None:
    x = torch.randn(2, 5, 3, 4, dtype=torch.float64)
    norm = LayerNorm2d(5).double()
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.0, -2.0, 0.5, 3.0, 1.5]))
    expected = F.layer_norm(x.permute(0, 2, 3, 1), (5,), weight=norm.weight, eps=1e-5).permute(0, 3, 1, 2)
    torch.testing.assert_close(norm(x), expected)
    assert [n for n, _ in norm.named_parameters()] == ["weight"]


def test_layernorm2d_constant_pixel_gives_zero_not_nan() -> None:
    # For this float32 value E[x^2] - mu^2 rounds to -0.125; without the clamp rsqrt gives NaN.
    x = torch.full((1, 3, 2, 2), 1234.567)
    y = LayerNorm2d(3)(x)
    assert torch.isfinite(y).all() and torch.all(y == 0)


# ------------------------------------------------------------------------------------------ ChannelBatchNorm
def _cbn_example() -> torch.Tensor:
    # x[b, c, 0, w]; position w=0 holds 1,3,5,7 (mu 4, var 5); w=1 holds 2,6,2,10 (mu 5, var 11).
    return torch.tensor([[[[1.0, 2.0]], [[3.0, 6.0]]], [[[5.0, 2.0]], [[7.0, 10.0]]]], dtype=torch.float64)


def test_channel_batchnorm_training_uses_per_position_batch_stats() -> None:
    norm = ChannelBatchNorm(2, (1, 2)).double().train()
    with torch.no_grad():
        norm.gamma_c.copy_(torch.tensor([2.0, 3.0]))
        norm.gamma_hw.copy_(torch.tensor([[[[0.5, -1.0]]]]))
    y = norm(_cbn_example())
    eps = 1e-5
    assert y[0, 0, 0, 0].item() == pytest.approx((1 - 4) / math.sqrt(5 + eps) * 0.5 * 2.0)
    assert y[1, 1, 0, 1].item() == pytest.approx((10 - 5) / math.sqrt(11 + eps) * -1.0 * 3.0)
    assert y[0, 1, 0, 1].item() == pytest.approx((6 - 5) / math.sqrt(11 + eps) * -1.0 * 3.0)


def test_channel_batchnorm_running_statistics_ema() -> None:
    norm = ChannelBatchNorm(2, (1, 2)).double().train()
    norm(_cbn_example())
    torch.testing.assert_close(norm.running_mean.flatten(), torch.tensor([0.4, 0.5], dtype=torch.float64))
    torch.testing.assert_close(norm.running_var.flatten(), torch.tensor([1.4, 2.0], dtype=torch.float64))
    # Second batch: every value 1 at w=0 (mu 1, var 0) and 3 at w=1 (mu 3, var 0).
    second = torch.tensor([1.0, 3.0], dtype=torch.float64).view(1, 1, 1, 2).expand(3, 2, 1, 2)
    norm(second)
    torch.testing.assert_close(
        norm.running_mean.flatten(), torch.tensor([0.9 * 0.4 + 0.1, 0.9 * 0.5 + 0.3], dtype=torch.float64)
    )
    torch.testing.assert_close(
        norm.running_var.flatten(), torch.tensor([0.9 * 1.4, 0.9 * 2.0], dtype=torch.float64)
    )
    assert int(norm.num_batches_tracked) == 2


def test_channel_batchnorm_eval_uses_running_stats_per_sample() -> None:
    norm = ChannelBatchNorm(3, (2, 2)).double().eval()
    with torch.no_grad():
        norm.running_mean.copy_(torch.tensor([[[[1.0, -1.0], [0.5, 2.0]]]]))
        norm.running_var.copy_(torch.tensor([[[[4.0, 1.0], [0.25, 9.0]]]]))
        norm.gamma_c.copy_(torch.tensor([1.0, 2.0, -1.0]))
    x = torch.randn(4, 3, 2, 2, dtype=torch.float64)
    y = norm(x)
    expected = (x - norm.running_mean) / torch.sqrt(norm.running_var + 1e-5) * norm.gamma_c.view(1, 3, 1, 1)
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(norm(x[1:2]), y[1:2])  # batch-independent
    assert int(norm.num_batches_tracked) == 0


def test_channel_batchnorm_bias_follows_code_order() -> None:
    norm = ChannelBatchNorm(2, (1, 1), bias=True).double().eval()
    with torch.no_grad():
        norm.beta_hw.fill_(0.5)
        norm.gamma_c.copy_(torch.tensor([2.0, 3.0]))
    x = torch.tensor([[[[1.0]], [[-1.0]]]], dtype=torch.float64)
    s = 1 / math.sqrt(1 + 1e-5)
    torch.testing.assert_close(
        norm(x).flatten(), torch.tensor([(s + 0.5) * 2, (-s + 0.5) * 3], dtype=torch.float64)
    )
    assert sum(p.numel() for p in norm.parameters()) == 2 + 1 + 1


def test_channel_batchnorm_is_built_at_construction() -> None:
    norm = ChannelBatchNorm(8, (7, 5))
    assert norm.gamma_hw.shape == (1, 1, 7, 5) and norm.running_var.shape == (1, 1, 7, 5)
    assert sum(p.numel() for p in norm.parameters()) == 8 + 35
    assert set(dict(norm.named_buffers())) == {"running_mean", "running_var", "num_batches_tracked"}
    assert torch.all(norm.running_mean == 0) and torch.all(norm.running_var == 1)


@pytest.mark.parametrize("training", [True, False])
def test_channel_batchnorm_wrong_resolution_raises(training: bool) -> None:
    norm = ChannelBatchNorm(4, (8, 8)).train(training)
    with pytest.raises(ValueError, match=r"\(8, 8\).*\(16, 16\)"):
        norm(torch.randn(2, 4, 16, 16))
    assert torch.all(norm.running_mean == 0) and int(norm.num_batches_tracked) == 0


# ----------------------------------------------------------------------------------------- RunningRowSumNorm
def _rows_example() -> torch.Tensor:
    # (B=2, n_h=1, T=2, T=2); row sums b0: [4, 4], b1: [8, 2] -> batch-mean denominator [6, 3].
    return torch.tensor([[[[1.0, 3.0], [2.0, 2.0]]], [[[2.0, 6.0], [1.0, 1.0]]]], dtype=torch.float64)


def test_running_row_sum_norm_training_divides_by_batch_mean_row_sum() -> None:
    norm = RunningRowSumNorm(1, 2).double().train()
    with torch.no_grad():
        norm.gamma.copy_(torch.tensor([[[[1.0], [2.0]]]]))
    y = norm(_rows_example())
    eps = 1e-6
    torch.testing.assert_close(y[0, 0, 0], torch.tensor([1.0, 3.0], dtype=torch.float64) / (6 + eps))
    torch.testing.assert_close(y[1, 0, 1], torch.tensor([1.0, 1.0], dtype=torch.float64) / (3 + eps) * 2.0)


def test_running_row_sum_norm_ema_and_eval() -> None:
    norm = RunningRowSumNorm(1, 2).double().train()
    norm(_rows_example())
    torch.testing.assert_close(norm.running_denom.flatten(), torch.tensor([1.5, 1.2], dtype=torch.float64))
    norm(torch.ones(1, 1, 2, 2, dtype=torch.float64))  # row sums 2
    expected_denom = torch.tensor([0.9 * 1.5 + 0.2, 0.9 * 1.2 + 0.2], dtype=torch.float64)
    torch.testing.assert_close(norm.running_denom.flatten(), expected_denom)
    assert int(norm.num_batches_tracked) == 2
    norm.eval()
    a = _rows_example()
    y = norm(a)
    torch.testing.assert_close(y, a / (expected_denom.view(1, 1, 2, 1) + 1e-6))
    torch.testing.assert_close(norm(a[1:]), y[1:])
    torch.testing.assert_close(norm.running_denom.flatten(), expected_denom)  # eval leaves stats alone


def test_running_row_sum_norm_shapes_and_wrong_tokens() -> None:
    norm = RunningRowSumNorm(3, 49)
    assert norm.gamma.shape == (1, 3, 49, 1) and norm.running_denom.shape == (1, 3, 49, 1)
    assert torch.all(norm.running_denom == 1)
    with pytest.raises(ValueError, match="49"):
        norm(torch.rand(2, 3, 196, 196))
    with pytest.raises(ValueError):
        norm(torch.rand(2, 2, 49, 49))


# ------------------------------------------------------------------------------------------------- factory
def test_make_norm_kinds() -> None:
    assert isinstance(make_norm("ln", 6), LayerNorm2d)
    bn = make_norm("bn", 6, (4, 3))
    assert isinstance(bn, ChannelBatchNorm) and bn.resolution == (4, 3) and bn.beta_hw is None
    assert make_norm("bn", 6, (4, 3), bias=True).beta_hw is not None


def test_make_norm_errors() -> None:
    with pytest.raises(ValueError, match="resolution"):
        make_norm("bn", 6)
    with pytest.raises(ValueError, match=r"'gn'.*bn, ln"):
        make_norm("gn", 6)
