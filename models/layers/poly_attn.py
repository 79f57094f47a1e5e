"""PolyAttn: the polynomial attention mixer of APolyNeXt stages 3-4 (spec 2.5).

qkv (1x1, C -> 2A) gives a shared qk tensor and v. Two different depthwise 5x5 convs turn the same qk into
Q and K; a depthwise 3x3 turns v into V. Scores S = sigmoid(lambda_h) * Q K^T + 1 go through the kernel
A_raw = S^4 (two squarings, so A_raw >= 0), a row normalisation, then O = A V, a depthwise 3x3
``final_conv`` and ``proj`` (A -> C). Heads: n_h = ceil(C / 64) of width 32, so A = 32 n_h.

The row normalisation depends on the norm kind: the LN models use the data-dependent l1 normalisation
(not polynomial); the BN models use ``RunningRowSumNorm`` and add ``norm2`` (ChannelBatchNorm(A)) between
``final_conv`` and ``proj``. Attention dropout (p = 0 in every shipped config) is omitted.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from polyfhe.models.layers.norms import Resolution, RunningRowSumNorm, make_norm
from polyfhe.models.layers.poly_conv import depthwise_conv

__all__ = ["L1RowNorm", "PolyAttn", "PolyAttnMixer", "attention_heads"]


def attention_heads(channels: int, head_dim: int = 32) -> int:
    """n_h = ceil(C / (2 * head_dim)): the attention width 32 n_h is about C / 2."""
    return math.ceil(channels / (2 * head_dim))


class L1RowNorm(nn.Module):
    """LN-variant row normalisation: A_raw / max(sum_k A_raw, eps) along the key axis. Not polynomial."""

    def __init__(self, eps: float = 1e-12) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, a_raw: Tensor) -> Tensor:
        return a_raw / a_raw.sum(dim=-1, keepdim=True).clamp_min(self.eps)


def _tokens(resolution: Resolution | None) -> int:
    if resolution is None:
        raise ValueError("BN PolyAttn needs the feature-map resolution to size RunningRowSumNorm")
    return int(resolution[0]) * int(resolution[1])


@dataclass(frozen=True)
class _AttnNorms:
    """How one norm kind normalises attention rows and what (if anything) sits before ``proj``."""

    row_norm: Callable[[int, Resolution | None], nn.Module]
    norm2: Callable[[int, Resolution | None], nn.Module]


_ATTN_NORMS: dict[str, _AttnNorms] = {
    "ln": _AttnNorms(
        row_norm=lambda n_heads, res: L1RowNorm(),
        norm2=lambda width, res: nn.Identity(),
    ),
    "bn": _AttnNorms(
        row_norm=lambda n_heads, res: RunningRowSumNorm(n_heads, _tokens(res)),
        norm2=lambda width, res: make_norm("bn", width, res),
    ),
}


class PolyAttn(nn.Module):
    """Polynomial-kernel attention over all H*W tokens with depthwise-conv Q/K/V."""

    def __init__(
        self,
        channels: int,
        norm: str = "ln",
        resolution: Resolution | None = None,
        head_dim: int = 32,
    ) -> None:
        super().__init__()
        if norm not in _ATTN_NORMS:
            raise ValueError(f"unknown norm kind {norm!r}; known kinds: {', '.join(sorted(_ATTN_NORMS))}")
        self.channels = channels
        self.head_dim = head_dim
        self.n_heads = attention_heads(channels, head_dim)
        self.width = self.n_heads * head_dim
        self.kernel_offset = 1.0  # the "+1" of S = sigma(lambda) Q K^T + 1
        self.qkv = nn.Conv2d(channels, 2 * self.width, kernel_size=1, bias=False)
        self.q_conv = depthwise_conv(self.width, 5)
        self.k_conv = depthwise_conv(self.width, 5)
        self.v_conv = depthwise_conv(self.width, 3)
        init_scale = math.log(head_dim**-0.5 / (1.0 - head_dim**-0.5))  # logit(1/sqrt(d)) -> sigma = 0.1768
        self.scale = nn.Parameter(torch.full((self.n_heads,), init_scale))
        norms = _ATTN_NORMS[norm]
        self.norm = norms.row_norm(self.n_heads, resolution)
        self.final_conv = depthwise_conv(self.width, 3)
        self.norm2 = norms.norm2(self.width, resolution)
        self.proj = nn.Conv2d(self.width, channels, kernel_size=1, bias=False)

    def _split_heads(self, t: Tensor) -> Tensor:
        # Channel index head * head_dim + d (head-major); token index h * W + w (row-major).
        b, _, h, w = t.shape
        return t.reshape(b, self.n_heads, self.head_dim, h * w).transpose(2, 3)

    def attention_kernel(self, q: Tensor, k: Tensor) -> Tensor:
        """A_raw = (sigma(lambda_h) Q K^T + 1)^4 computed as two squarings (two ct x ct products)."""
        s = torch.sigmoid(self.scale).view(1, -1, 1, 1) * (q @ k.transpose(-2, -1)) + self.kernel_offset
        s2 = s * s
        return s2 * s2

    def forward(self, x: Tensor) -> Tensor:
        b, _, h, w = x.shape
        qk, v = self.qkv(x).chunk(2, dim=1)
        q = self._split_heads(self.q_conv(qk))
        k = self._split_heads(self.k_conv(qk))
        v = self._split_heads(self.v_conv(v))
        a = self.norm(self.attention_kernel(q, k))
        o = (a @ v).transpose(2, 3).reshape(b, self.width, h, w)
        return self.proj(self.norm2(self.final_conv(o)))


class PolyAttnMixer(nn.Module):
    """The attention branch of an attention stack: pre-norm Norm(C) followed by PolyAttn."""

    def __init__(
        self, channels: int, norm: str = "ln", resolution: Resolution | None = None, head_dim: int = 32
    ) -> None:
        super().__init__()
        self.norm = make_norm(norm, channels, resolution)
        self.attn = PolyAttn(channels, norm=norm, resolution=resolution, head_dim=head_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.attn(self.norm(x))
