"""ResMLP-style Affine: ``alpha * x + beta`` over the last (channel) axis, the norm-free alternative to LN."""

from __future__ import annotations

import torch
from torch import nn


class Affine(nn.Module):
    """Learned per-channel scale and shift on channels-last tensors; a constant affine map at inference."""

    def __init__(self, dim: int, alpha_init: float = 1.0) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.full((dim,), float(alpha_init)))
        self.beta = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.alpha + self.beta
