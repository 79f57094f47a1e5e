"""Stochastic depth (drop path): identity at eval, so it never reaches an exported graph."""

from __future__ import annotations

import torch
from torch import nn


class DropPath(nn.Module):
    """Drop a whole residual branch per sample with probability ``p`` during training."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"drop-path rate must be in [0, 1), got {p}")
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = 1.0 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)
        return x * mask / keep

    def extra_repr(self) -> str:
        return f"p={self.p}"
