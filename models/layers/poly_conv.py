"""PolyConv: the spatial mixer of convolutional PolyNeXt stacks (spec 2.3).

h = W_in x (C -> Ci); m_j = K_c(h)_j * K_f(h)_{Ci-1-j}; out = Norm(W_out(K(m))).
K_c is a dilated depthwise "coarse" conv, K_f a depthwise 3x3 "fine" conv whose output is channel-reversed
before the product, so that every hidden channel is multiplied with a different channel's fine response.
K is a depthwise 3x3 consolidation conv. The norm is a post-norm on the branch; drop path is applied by
the owning cell. All convs are bias-free.
"""

from __future__ import annotations

from torch import Tensor, nn

from polyfhe.models.layers.norms import Resolution, make_norm

__all__ = ["PolyConv", "depthwise_conv"]


def depthwise_conv(channels: int, kernel_size: int, dilation: int = 1, stride: int = 1) -> nn.Conv2d:
    """Bias-free depthwise conv with 'same' padding (for stride 1)."""
    if kernel_size % 2 == 0:
        raise ValueError(f"depthwise kernels must be odd, got {kernel_size}")
    padding = dilation * (kernel_size - 1) // 2
    return nn.Conv2d(
        channels,
        channels,
        kernel_size,
        stride=stride,
        padding=padding,
        dilation=dilation,
        groups=channels,
        bias=False,
    )


class PolyConv(nn.Module):
    """Coarse x channel-reversed fine depthwise product between two 1x1 convs."""

    def __init__(
        self,
        channels: int,
        hidden: int,
        coarse_kernel: int = 3,
        coarse_dilation: int = 2,
        norm: str = "ln",
        resolution: Resolution | None = None,
    ) -> None:
        super().__init__()
        self.channels = channels
        self.hidden = hidden
        self.w_in = nn.Conv2d(channels, hidden, kernel_size=1, bias=False)
        self.k_coarse = depthwise_conv(hidden, coarse_kernel, dilation=coarse_dilation)
        self.k_fine = depthwise_conv(hidden, 3)
        self.k_cons = depthwise_conv(hidden, 3)
        self.w_out = nn.Conv2d(hidden, channels, kernel_size=1, bias=False)
        self.norm = make_norm(norm, channels, resolution)

    def hadamard(self, h: Tensor) -> Tensor:
        """m_j = K_c(h)_j * K_f(h)_{Ci-1-j}: the single ciphertext x ciphertext product of the mixer."""
        return self.k_coarse(h) * self.k_fine(h).flip(1)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(self.w_out(self.k_cons(self.hadamard(self.w_in(x)))))
