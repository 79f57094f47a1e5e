"""Running statistics become the sample-weighted mean of per-batch statistics, for every BN-like layer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from polyfhe.calibration import CalibrationError, recompute_running_stats
from polyfhe.models.layers.norms import ChannelBatchNorm, RunningRowSumNorm
from polyfhe.models.layers.poly_attn import PolyAttnMixer
from polyfhe.models.layers.token_norms import TokenBatchNorm

SIZES = (5, 3, 8)  # unequal batches: a plain 1/k average would weight them wrongly


def _batches(*shape: int) -> list[torch.Tensor]:
    return [torch.randn(n, *shape, dtype=torch.float64) * 2 + 1 for n in SIZES]


def _weighted(stats: list[torch.Tensor]) -> torch.Tensor:
    total = sum(SIZES)
    return sum(s * n / total for s, n in zip(stats, SIZES, strict=True))


def _garbage(module: nn.Module) -> None:
    """Stale EMA state that calibration must discard."""
    for name, buf in module.named_buffers():
        if name.startswith("running_"):
            buf.fill_(123.0)


def test_token_batchnorm_cumulative_average_and_momentum_restored() -> None:
    norm = TokenBatchNorm(6).double()
    _garbage(norm)
    batches = _batches(2, 2, 6)
    report = recompute_running_stats(norm, batches)
    flat = [b.reshape(-1, 6) for b in batches]
    torch.testing.assert_close(norm.running_mean, _weighted([f.mean(0) for f in flat]))
    torch.testing.assert_close(norm.running_var, _weighted([f.var(0, unbiased=True) for f in flat]))
    assert norm.momentum == 0.1 and not norm.training
    assert report.num_batches == 3 and report.num_samples == sum(SIZES)
    assert report.layers[0].kind == "TokenBatchNorm"


def test_channel_batchnorm_cumulative_average() -> None:
    norm = ChannelBatchNorm(4, (3, 3)).double()
    _garbage(norm)
    batches = _batches(4, 3, 3)
    recompute_running_stats(norm, batches)
    means = [b.mean(dim=(0, 1), keepdim=True) for b in batches]
    variances = [b.var(dim=(0, 1), keepdim=True, unbiased=False) for b in batches]
    torch.testing.assert_close(norm.running_mean, _weighted(means))
    torch.testing.assert_close(norm.running_var, _weighted(variances))
    assert norm.momentum == 0.1 and int(norm.num_batches_tracked) == 3


def test_row_sum_norm_cumulative_average() -> None:
    norm = RunningRowSumNorm(2, 4).double()
    _garbage(norm)
    batches = [b.abs() for b in _batches(2, 4, 4)]
    recompute_running_stats(norm, batches)
    denoms = [b.sum(-1, keepdim=True).mean(0, keepdim=True) for b in batches]
    torch.testing.assert_close(norm.running_denom, _weighted(denoms))
    assert norm.momentum == 0.1


def test_whole_attention_mixer_single_batch_equals_momentum_one_forward() -> None:
    """All three layer kinds inside PolyAttn (pre-norm, R_hi, norm2) are recalibrated, in one pass."""
    mixer = PolyAttnMixer(64, "bn", (4, 4)).double()
    x = torch.randn(6, 64, 4, 4, dtype=torch.float64)
    reference = PolyAttnMixer(64, "bn", (4, 4)).double()
    reference.load_state_dict(mixer.state_dict())
    for m in reference.modules():
        if hasattr(m, "momentum"):
            m.momentum = 1.0
    with torch.no_grad():
        reference.train()(x)
    _garbage(mixer)
    report = recompute_running_stats(mixer, [x])
    assert {layer.kind for layer in report.layers} == {"ChannelBatchNorm", "RunningRowSumNorm"}
    assert len(report.layers) == 3
    for (name, got), (_, want) in zip(mixer.named_buffers(), reference.named_buffers(), strict=True):
        if name.endswith(("running_mean", "running_var", "running_denom")):
            torch.testing.assert_close(got, want, msg=name)


def test_dropout_stays_off_during_calibration() -> None:
    model = nn.Sequential(nn.Dropout(0.9), nn.BatchNorm1d(5)).double()
    batches = _batches(5)
    recompute_running_stats(model, batches)
    torch.testing.assert_close(model[1].running_var, _weighted([b.var(0) for b in batches]))
    assert not model.training and not model[0].training


class _OwnStats(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("running_scale", torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.running_scale


def test_unknown_statistics_layer_is_refused_by_name() -> None:
    model = nn.Sequential(nn.BatchNorm1d(3), _OwnStats())
    with pytest.raises(CalibrationError, match=r"1 \(_OwnStats\).*supported"):
        recompute_running_stats(model, [torch.randn(4, 3)])


def test_empty_data_is_an_error() -> None:
    with pytest.raises(CalibrationError, match="no calibration data"):
        recompute_running_stats(nn.BatchNorm1d(3), [])
