"""Models written the way users write them: plain torch layers, no polyfhe building blocks.

The CKKS compiler must do well on these, not only on the zoo's recipes. ``UserMONetBN`` is a MONet with
BatchNorm for 28x28 grey images: a 4x4/4 patch embedding to 32x7x7, two Poly-Blocks
``x += Mu1(BN_a(x)); x += Mu2(BN_b(x))`` whose Mu-Layers compute ``a = BN1(shift(U1 z))``,
``g = BN3(U3(shift(U2 z)))``, ``out = C(a + alpha * a * g)`` with 1x1 convolutions (hidden width 32 in Mu1 and
96 in Mu2, rank dim/8 for U2/U3), the spatial shift as a fixed depthwise 3x3 convolution that moves channel
quarters by one pixel, global average pooling and a linear head (about 23k parameters).

``UserAttentionBN`` is a small polynomial attention network for the same images: the same 4x4/4 patch embedding,
read as 7x7 = 49 tokens of width 32, two blocks of ``x += Wo((Q K^T / s) V)`` with ``Q, K, V`` single-head
projections of ``BN(x)`` (BatchNorm over the channels of every token) and ``s`` a running l1 constant
(``RunningL1Scale``: the mean row sum of ``|Q K^T|``, tracked like a BatchNorm statistic while training and a
constant in eval mode), then ``x += W3((W1 BN(x)) * (W2 BN(x)))`` (a Hadamard MLP of width 64), a last BatchNorm,
the mean over the tokens and a linear head (about 22k parameters). No softmax, no activation: in eval mode it is a
polynomial in its input whose degree each attention multiplies by 3 and each MLP by 2 (36 in all).
"""

from __future__ import annotations

import torch
from torch import nn


def shift_conv(channels: int) -> nn.Conv2d:
    """A frozen depthwise 3x3 convolution moving each quarter of the channels one pixel (right, left, down, up)."""
    conv = nn.Conv2d(channels, channels, 3, padding=1, groups=channels, bias=False)
    weight = torch.zeros(channels, 1, 3, 3)
    taps = [(1, 0), (1, 2), (0, 1), (2, 1)]  # kernel position read by each quarter
    for c in range(channels):
        row, col = taps[min(4 * c // channels, 3)]
        weight[c, 0, row, col] = 1.0
    conv.weight.data.copy_(weight)
    conv.weight.requires_grad_(False)
    return conv


class MuLayer(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        rank = max(1, dim // 8)
        self.u1 = nn.Conv2d(dim, hidden, 1)
        self.shift1 = shift_conv(hidden)
        self.bn1 = nn.BatchNorm2d(hidden)
        self.u2 = nn.Conv2d(dim, rank, 1)
        self.shift2 = shift_conv(rank)
        self.u3 = nn.Conv2d(rank, hidden, 1)
        self.bn3 = nn.BatchNorm2d(hidden)
        self.c = nn.Conv2d(hidden, dim, 1)
        self.alpha = nn.Parameter(torch.tensor(0.5))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        a = self.bn1(self.shift1(self.u1(z)))
        g = self.bn3(self.u3(self.shift2(self.u2(z))))
        return self.c(a + self.alpha * a * g)


class PolyBlock(nn.Module):
    def __init__(self, dim: int, hidden1: int, hidden2: int) -> None:
        super().__init__()
        self.bn_a = nn.BatchNorm2d(dim)
        self.mu1 = MuLayer(dim, hidden1)
        self.bn_b = nn.BatchNorm2d(dim)
        self.mu2 = MuLayer(dim, hidden2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mu1(self.bn_a(x))
        return x + self.mu2(self.bn_b(x))


class UserMONetBN(nn.Module):
    def __init__(self, num_classes: int = 10, dim: int = 32, blocks: int = 2, hidden1: int = 32,
                 hidden2: int = 96, in_chans: int = 1, patch: int = 4) -> None:
        super().__init__()
        self.embed = nn.Conv2d(in_chans, dim, patch, stride=patch)
        self.blocks = nn.Sequential(*[PolyBlock(dim, hidden1, hidden2) for _ in range(blocks)])
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.embed(x))
        return self.head(torch.flatten(self.pool(x), 1))


class RunningL1Scale(nn.Module):
    """Divide attention scores by a running l1 constant: in training by the batch's mean row sum of ``|a|``
    (detached), tracked in ``running_denom`` by an exponential moving average; in eval mode by ``running_denom``
    alone, a constant, so the division is a plain scale."""

    def __init__(self, momentum: float = 0.1) -> None:
        super().__init__()
        self.momentum = momentum
        self.register_buffer("running_denom", torch.ones(()))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return a / self.running_denom
        denom = a.detach().abs().sum(-1).mean()
        with torch.no_grad():
            self.running_denom.mul_(1.0 - self.momentum).add_(self.momentum * denom)
        return a / denom


def token_bn(bn: nn.BatchNorm1d, x: torch.Tensor) -> torch.Tensor:
    """``bn`` over the channels of every token: (B, T, C) -> (B, C, T) -> bn -> (B, T, C)."""
    return bn(x.transpose(1, 2)).transpose(1, 2)


class AttentionBlock(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.bn_a = nn.BatchNorm1d(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.scale = RunningL1Scale()
        self.wo = nn.Linear(dim, dim)
        self.bn_m = nn.BatchNorm1d(dim)
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(dim, hidden)
        self.w3 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = token_bn(self.bn_a, x)
        q, k, v = self.wq(h), self.wk(h), self.wv(h)
        a = self.scale(q @ k.transpose(-2, -1))  # (B, T, T)
        x = x + self.wo(a @ v)
        h = token_bn(self.bn_m, x)
        return x + self.w3(self.w1(h) * self.w2(h))


class UserAttentionBN(nn.Module):
    def __init__(self, num_classes: int = 10, dim: int = 32, blocks: int = 2, hidden: int = 64,
                 in_chans: int = 1, patch: int = 4) -> None:
        super().__init__()
        self.embed = nn.Conv2d(in_chans, dim, patch, stride=patch)
        self.blocks = nn.ModuleList([AttentionBlock(dim, hidden) for _ in range(blocks)])
        self.bn = nn.BatchNorm1d(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x).flatten(2).transpose(1, 2)  # (B, 49, 32): one token per patch
        for block in self.blocks:
            x = block(x)
        return self.head(token_bn(self.bn, x).mean(1))


def train_briefly(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int = 2, batch: int = 128,
                  lr: float = 2e-3, seed: int = 0) -> nn.Module:
    """A few epochs of AdamW so the logits are realistic; returns the model in eval mode."""
    torch.manual_seed(seed)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(x))
        for start in range(0, len(x), batch):
            idx = order[start:start + batch]
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
    return model.eval()
