"""The few module types a folded model is made of besides Linear/Conv: constant affine maps and pooling sums."""

from __future__ import annotations

import torch
from torch import nn


class ConstantAffine(nn.Module):
    """``x * scale + shift`` with constant buffers that broadcast against the input.

    Used only where an affine cannot be absorbed exactly into a neighbouring Linear/Conv (for example a
    per-position scale next to a spatial convolution). It costs one plaintext multiplication under CKKS, and
    the analyzer merges it with an adjacent linear map.
    """

    def __init__(self, scale: torch.Tensor | None, shift: torch.Tensor | None) -> None:
        super().__init__()
        if scale is None and shift is None:
            raise ValueError("ConstantAffine needs a scale, a shift or both")
        self.register_buffer("scale", None if scale is None else scale.detach().clone())
        self.register_buffer("shift", None if shift is None else shift.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is not None:
            x = x * self.scale
        if self.shift is not None:
            x = x + self.shift
        return x

    def extra_repr(self) -> str:
        parts = [f"{n}={tuple(t.shape)}" for n, t in (("scale", self.scale), ("shift", self.shift)) if t is not None]
        return ", ".join(parts)


class SpatialSum(nn.Module):
    """Sum over the spatial axes of an NCHW tensor: average pooling with its 1/(h*w) folded into the next layer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(dim=(2, 3))


def linear_from(weight: torch.Tensor, bias: torch.Tensor, like: nn.Linear | None = None) -> nn.Linear:
    """A Linear with the given float64 weights, cast to the dtype of ``like`` (float32 by default)."""
    dtype = like.weight.dtype if like is not None else torch.float32
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=True, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    return layer


def conv_from(weight: torch.Tensor, bias: torch.Tensor | None, like: nn.Conv2d) -> nn.Conv2d:
    """A Conv2d with ``like``'s geometry (stride, padding, dilation, groups) and the given weights."""
    conv = nn.Conv2d(
        like.in_channels, weight.shape[0], tuple(weight.shape[2:]), stride=like.stride, padding=like.padding,
        dilation=like.dilation, groups=like.groups, bias=bias is not None, padding_mode=like.padding_mode,
        dtype=like.weight.dtype,
    )
    with torch.no_grad():
        conv.weight.copy_(weight)
        if bias is not None:
            conv.bias.copy_(bias)
    return conv
