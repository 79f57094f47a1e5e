"""PolyMLP: the channel mixer of every PolyNeXt stack (spec 2.4).

x -> W_ab x (C -> C2) -> split into hi (first C2/2) and lo (last C2/2) -> hi * lo -> Norm(C2/2) -> W_o (C2/2 -> C).
One ciphertext x ciphertext product; the norm folds into W_o at inference. There is no inner skip and no
activation: the Hadamard product is the only non-linearity. Drop path is applied by the owning cell.
"""

from __future__ import annotations

from torch import Tensor, nn

from polyfhe.models.layers.norms import Resolution, make_norm

__all__ = ["PolyMLP"]


class PolyMLP(nn.Module):
    """Gated 1x1 MLP with a Hadamard product of the two halves of its expansion."""

    def __init__(
        self, channels: int, hidden: int, norm: str = "ln", resolution: Resolution | None = None
    ) -> None:
        super().__init__()
        if hidden % 2:
            raise ValueError(f"PolyMLP hidden width must be even (split into two halves), got {hidden}")
        self.channels = channels
        self.hidden = hidden
        self.fc_in = nn.Conv2d(channels, hidden, kernel_size=1, bias=False)
        self.norm = make_norm(norm, hidden // 2, resolution)
        self.fc_out = nn.Conv2d(hidden // 2, channels, kernel_size=1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        hi, lo = self.fc_in(x).chunk(2, dim=1)
        return self.fc_out(self.norm(hi * lo))
