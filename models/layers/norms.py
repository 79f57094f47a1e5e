"""Normalisation layers of PolyNeXt (spec section 2.7/2.8) and the norm factory the cells and heads use.

* ``LayerNorm2d``: the LN variant's per-pixel LayerNorm over channels. It divides by a data-dependent
  sqrt, so it is not polynomial; it exists for training the LN models.
* ``ChannelBatchNorm``: the BN variant's spatial BatchNorm. Statistics are taken over (batch, channel) at
  every spatial position, so at inference it becomes a constant per-(c, h, w) affine map.
* ``RunningRowSumNorm``: the BN variant's replacement for PolyAttn's l1 row normalisation. At inference it
  is a constant per-(head, query) scale.

Unlike the reference code, every BN buffer and parameter is created at construction from an explicit
resolution: there is no lazy creation, and a forward at another resolution raises instead of silently
re-creating the statistics.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Resolution = tuple[int, int]

__all__ = [
    "NORM_KINDS",
    "ChannelBatchNorm",
    "LayerNorm2d",
    "Resolution",
    "RunningRowSumNorm",
    "make_norm",
]


class LayerNorm2d(nn.Module):
    """Per-pixel LayerNorm over the channels of a (B, C, H, W) tensor; weight only by default.

    The same maths as the reference implementation (biased variance); computed by ``F.layer_norm``.
    """

    def __init__(self, channels: int, eps: float = 1e-5, bias: bool = False) -> None:
        super().__init__()
        self.channels = channels
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        # One F.layer_norm over the channels of the NHWC view (a view, no copy, when x is channels-last), in x's
        # dtype: autocast would run it in float32 and every elementwise product up to the next conv would then
        # move twice the bytes (the bf16 kernel keeps float32 statistics). On an H200, bf16, batch 128, this
        # took CPolyNeXt-T's eager training from 0.51 to 0.76 of ConvFormer-S18's img/s (docs/gpu.md); the
        # E[x^2] - mu^2 form it replaces ran as six kernels per norm.
        if x.device.type in ("cuda", "cpu") and torch.is_autocast_enabled(x.device.type):
            with torch.autocast(x.device.type, enabled=False):
                return self._layer_norm(x)
        return self._layer_norm(x)

    def _layer_norm(self, x: Tensor) -> Tensor:
        weight = self.weight.to(x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.layer_norm(x.permute(0, 2, 3, 1), (self.channels,), weight, bias, self.eps).permute(0, 3, 1, 2)

    def extra_repr(self) -> str:
        return f"{self.channels}, eps={self.eps}, bias={self.bias is not None}"


def _check_resolution(expected: Resolution, received: tuple[int, ...], owner: str) -> None:
    if tuple(received) != tuple(expected):
        raise ValueError(
            f"{owner} was built for resolution {tuple(expected)} but received {tuple(received)}; "
            "BN PolyNeXt models are tied to the resolution they were constructed for"
        )


class ChannelBatchNorm(nn.Module):
    """Spatial BatchNorm: per-position statistics over (batch, channel), spec 2.7.

    y = ((x - mu_hw) / sqrt(var_hw + eps) * gamma_hw [+ beta_hw]) * gamma_c. The order (beta_hw added before
    the gamma_c multiply) follows the reference code; beta_c is never created there, so it is not here.
    Training normalises with the biased batch statistics and folds that same biased variance into
    ``running_var`` by EMA (momentum 0.1); eval uses the running buffers.
    """

    def __init__(
        self,
        channels: int,
        resolution: Resolution,
        eps: float = 1e-5,
        momentum: float = 0.1,
        bias: bool = False,
    ) -> None:
        super().__init__()
        h, w = (int(v) for v in resolution)
        if h <= 0 or w <= 0:
            raise ValueError(f"ChannelBatchNorm resolution must be positive, got {resolution}")
        self.channels = channels
        self.resolution: Resolution = (h, w)
        self.eps = eps
        self.momentum = momentum
        self.gamma_c = nn.Parameter(torch.ones(channels))
        self.gamma_hw = nn.Parameter(torch.ones(1, 1, h, w))
        self.beta_hw = nn.Parameter(torch.zeros(1, 1, h, w)) if bias else None
        self.register_buffer("running_mean", torch.zeros(1, 1, h, w))
        self.register_buffer("running_var", torch.ones(1, 1, h, w))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

    def _statistics(self, x: Tensor) -> tuple[Tensor, Tensor]:
        if not self.training:
            return self.running_mean, self.running_var
        mu = x.mean(dim=(0, 1), keepdim=True)
        var = ((x * x).mean(dim=(0, 1), keepdim=True) - mu * mu).clamp_min(0.0)
        with torch.no_grad():
            self.running_mean.mul_(1.0 - self.momentum).add_(self.momentum * mu.detach())
            self.running_var.mul_(1.0 - self.momentum).add_(self.momentum * var.detach())
            self.num_batches_tracked.add_(1)
        return mu, var

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 4 or x.shape[1] != self.channels:
            raise ValueError(f"ChannelBatchNorm expects (B, {self.channels}, H, W), got {tuple(x.shape)}")
        _check_resolution(self.resolution, tuple(x.shape[-2:]), "ChannelBatchNorm")
        mu, var = self._statistics(x)
        y = (x - mu) * torch.rsqrt(var + self.eps) * self.gamma_hw
        if self.beta_hw is not None:
            y = y + self.beta_hw
        return y * self.gamma_c.view(1, -1, 1, 1)

    def extra_repr(self) -> str:
        return (
            f"{self.channels}, resolution={self.resolution}, eps={self.eps}, momentum={self.momentum}, "
            f"bias={self.beta_hw is not None}"
        )


class RunningRowSumNorm(nn.Module):
    """BN replacement for PolyAttn's l1 row normalisation on A_raw of shape (B, n_heads, T, T), spec 2.7.

    Training divides by the batch mean of the row sums (shape (1, n_heads, T, 1)) and folds it into
    ``running_denom`` by EMA; eval divides by ``running_denom``, a constant per-(head, query) scale.
    Output: A_raw / (R + eps) * gamma. No abs: A_raw >= 0 by construction (even power).
    """

    def __init__(self, n_heads: int, tokens: int, eps: float = 1e-6, momentum: float = 0.1) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.tokens = tokens
        self.eps = eps
        self.momentum = momentum
        self.gamma = nn.Parameter(torch.ones(1, n_heads, tokens, 1))
        self.register_buffer("running_denom", torch.ones(1, n_heads, tokens, 1))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

    def _denominator(self, a_raw: Tensor) -> Tensor:
        if not self.training:
            return self.running_denom
        denom = a_raw.sum(dim=-1, keepdim=True).mean(dim=0, keepdim=True)
        with torch.no_grad():
            self.running_denom.mul_(1.0 - self.momentum).add_(self.momentum * denom.detach())
            self.num_batches_tracked.add_(1)
        return denom

    def forward(self, a_raw: Tensor) -> Tensor:
        expected = (self.n_heads, self.tokens, self.tokens)
        if a_raw.dim() != 4 or tuple(a_raw.shape[1:]) != expected:
            raise ValueError(
                f"RunningRowSumNorm was built for (B, n_heads, T, T) = (B, {self.n_heads}, {self.tokens}, "
                f"{self.tokens}) but received {tuple(a_raw.shape)}"
            )
        return a_raw / (self._denominator(a_raw) + self.eps) * self.gamma

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}, tokens={self.tokens}, eps={self.eps}, momentum={self.momentum}"


NormBuilder = Callable[[int, "Resolution | None", bool], nn.Module]


def _build_ln(channels: int, resolution: Resolution | None, bias: bool) -> nn.Module:
    return LayerNorm2d(channels, bias=bias)


def _build_bn(channels: int, resolution: Resolution | None, bias: bool) -> nn.Module:
    if resolution is None:
        raise ValueError("norm kind 'bn' (ChannelBatchNorm) needs the feature-map resolution (H, W)")
    return ChannelBatchNorm(channels, resolution, bias=bias)


NORM_KINDS: dict[str, NormBuilder] = {"ln": _build_ln, "bn": _build_bn}


def make_norm(
    kind: str, channels: int, resolution: Resolution | None = None, bias: bool = False
) -> nn.Module:
    """Build the norm of ``kind`` ("ln" or "bn") for ``channels`` channels at ``resolution`` (bn only)."""
    try:
        builder = NORM_KINDS[kind]
    except KeyError:
        raise ValueError(
            f"unknown norm kind {kind!r}; known kinds: {', '.join(sorted(NORM_KINDS))}"
        ) from None
    return builder(channels, resolution, bias)
