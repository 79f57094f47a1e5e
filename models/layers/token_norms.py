"""Norms for channels-last token tensors ``(..., C)`` as used inside MONet's Poly-Blocks.

``make_token_norm`` is a registry: ``"ln"`` gives the reference LayerNorm (eps 1e-6), ``"bn"`` a standard
per-channel BatchNorm over every leading axis (spec 1.8), which becomes a constant affine at inference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class TokenBatchNorm(nn.BatchNorm1d):
    """BatchNorm over the last (channel) axis of a channels-last tensor of any rank >= 2.

    Statistics are taken over all leading axes (batch and spatial), exactly like ``BatchNorm2d`` on the
    channels-first view, with the usual running mean/var EMA (momentum 0.1, eps 1e-5).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or x.shape[-1] != self.num_features:
            raise ValueError(
                f"TokenBatchNorm({self.num_features}) expects (..., {self.num_features}), got {tuple(x.shape)}"
            )
        shape = x.shape
        return super().forward(x.reshape(-1, shape[-1])).reshape(shape)


TOKEN_NORMS: dict[str, Callable[[int], nn.Module]] = {
    "ln": lambda channels: nn.LayerNorm(channels, eps=1e-6),
    "bn": lambda channels: TokenBatchNorm(channels),
}


def make_token_norm(kind: str, channels: int) -> nn.Module:
    """Build the channels-last norm of type ``kind`` (one of ``TOKEN_NORMS``)."""
    try:
        return TOKEN_NORMS[kind](channels)
    except KeyError:
        raise ValueError(f"unknown norm {kind!r}; supported: {', '.join(sorted(TOKEN_NORMS))}") from None
