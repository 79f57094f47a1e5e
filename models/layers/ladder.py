"""The ladder layer of LPNN: a product activation ``(W h + b) * (V s + c)``, then BatchNorm and dropout.

``h`` is the previous hidden layer and ``s`` the source of the second factor (the network input in the paper's
form). The product replaces a nonlinearity: multiplying by a degree-1 factor raises the polynomial order by
exactly one, which is what gives the network its ladder of orders.
"""

from __future__ import annotations

import torch
from torch import nn

LADDER_NORMS = ("bn", "none")


class LadderLayer(nn.Module):
    """``drop(norm((proj(h)) * factor(s)))``; ``norm`` is BatchNorm1d over the ``out_features`` units."""

    def __init__(self, in_features: int, source_features: int, out_features: int, norm: str = "bn",
                 drop_rate: float = 0.0) -> None:
        super().__init__()
        if norm not in LADDER_NORMS:
            raise ValueError(f"ladder norm must be one of {LADDER_NORMS}, got {norm!r}")
        if not 0.0 <= drop_rate < 1.0:
            raise ValueError(f"drop_rate must be in [0, 1), got {drop_rate}")
        if min(in_features, source_features, out_features) < 1:
            raise ValueError(
                f"ladder sizes must be positive, got in={in_features}, source={source_features}, out={out_features}"
            )
        self.proj = nn.Linear(in_features, out_features)  # W_l, b_l: acts on h_{l-1}
        self.factor = nn.Linear(source_features, out_features)  # V_l, c_l: acts on the input (or a skip)
        self.norm = nn.BatchNorm1d(out_features) if norm == "bn" else nn.Identity()
        self.drop = nn.Dropout(drop_rate) if drop_rate > 0 else nn.Identity()

    def forward(self, h: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        return self.drop(self.norm(self.proj(h) * self.factor(source)))


__all__ = ["LADDER_NORMS", "LadderLayer"]
