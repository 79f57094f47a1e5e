"""MONet's Mu-Layer and Poly-Block (spec 1.3, 1.4), channels-last.

Mu-Layer (paper: Y = C[(AX) * (BDX) + AX]) as the reference realises it:

    a  = shift(U1 z + b1)            # ``proj_a``      (paper A), hidden m
    g  = shift(U2 z + b2)            # ``proj_down``   (paper D), low rank l = m // shrink
    g' = U3 g + b3                   # ``proj_up``     (paper B), back to m
    y  = C(N1(a) + alpha * N1(a) * N3(g')) + c      # ``proj_out`` (paper C)

N1/N3 are LayerNorm (reference) or BatchNorm (our BN variant, spec 1.8). There is no activation anywhere:
the only non-linearity is the Hadamard product, so a Poly-Block has degree 4 in its input.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from polyfhe.models.layers.drop import DropPath
from polyfhe.models.layers.shift import spatial_shift
from polyfhe.models.layers.token_norms import make_token_norm


class MuLayer(nn.Module):
    """One multilinear unit on ``(B, H, W, dim)`` tokens; ``shift=True`` for the first unit of a block."""

    def __init__(self, dim: int, hidden: int, shrink: int, norm: str = "ln", shift: bool = False) -> None:
        super().__init__()
        low = hidden // shrink
        if low < 1:
            raise ValueError(f"hidden={hidden} with shrink={shrink} leaves no low-rank channels")
        self.shift = shift
        self.proj_a = nn.Linear(dim, hidden)
        self.proj_down = nn.Linear(dim, low)
        self.proj_up = nn.Linear(low, hidden)
        self.norm_a = make_token_norm(norm, hidden)
        self.norm_g = make_token_norm(norm, hidden)
        self.alpha = nn.Parameter(torch.ones(1))
        self.proj_out = nn.Linear(hidden, dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Reference init (spec 1.7): Kaiming-normal with bias 1 on U1..U3; Kaiming(a=0.001) on C."""
        for proj in (self.proj_a, self.proj_down, self.proj_up):
            nn.init.kaiming_normal_(proj.weight, mode="fan_in", nonlinearity="relu")
            nn.init.ones_(proj.bias)
        nn.init.kaiming_normal_(self.proj_out.weight, a=0.001)
        nn.init.zeros_(self.proj_out.bias)
        nn.init.ones_(self.alpha)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        a = self.proj_a(z)
        g = self.proj_down(z)
        if self.shift:
            a = spatial_shift(a)
            g = spatial_shift(g)
        a = self.norm_a(a)
        g = self.norm_g(self.proj_up(g))
        return self.proj_out(a + self.alpha * a * g)


class PolyBlock(nn.Module):
    """Two residual Mu-Layers with pre-norm: x + Mu1(N(x)) then x + Mu2(N'(x)).

    LN variant: one LayerNorm instance applied at both sites, as in the reference (``norm2 is norm1``).
    BN variant: two separate BatchNorms, because one BN would mix the running statistics of two sites.
    """

    def __init__(
        self, dim: int, expansion: int = 3, shrink: int = 8, norm: str = "ln", drop_path: float = 0.0
    ) -> None:
        super().__init__()
        self.norm1 = make_token_norm(norm, dim)
        self.norm2 = self.norm1 if norm == "ln" else make_token_norm(norm, dim)
        self.mu1 = MuLayer(dim, dim, shrink, norm, shift=True)
        self.mu2 = MuLayer(dim, dim * expansion, shrink, norm, shift=False)
        self.drop_path = DropPath(drop_path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(self.mu1(self.norm1(x)))
        return x + self.drop_path(self.mu2(self.norm2(x)))


def lecun_trunc_normal_(weight: torch.Tensor) -> torch.Tensor:
    """Truncated (at 2 std) LeCun-normal init, used by the reference for MONet's convolutions."""
    fan_in = weight[0].numel()
    std = math.sqrt(1.0 / fan_in) / 0.87962566103423978  # std correction of a [-2, 2] truncated normal
    return nn.init.trunc_normal_(weight, std=std, a=-2 * std, b=2 * std)
