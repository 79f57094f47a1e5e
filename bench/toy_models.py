"""Small polynomial models and a short digits trainer, shared by the benchmarks and the CKKS tests."""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import nn

from polyfhe.data.sources import load_digits
from polyfhe.models.layers.shift import spatial_shift

__all__ = ["Cube", "DeepResidual", "LinearAttention", "ShiftBlocks", "Square", "StemNet", "digits", "train"]


class Square(nn.Module):
    def forward(self, x):
        return x * x


class Cube(nn.Module):
    def forward(self, x):
        return torch.pow(x, 3)


class StemNet(nn.Module):
    """Written as users write a CPolyNeXt-like net: a 7x7 stride-4 stem, a dilated depthwise branch times a
    pointwise one, a residual, average pooling and a linear head (overlapping windows: the input is replicated)."""

    def __init__(self, width: int = 64, kernel: int = 7, stride: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, width, kernel, stride=stride, padding=(kernel - stride + 1) // 2)
        self.bn = nn.BatchNorm2d(width)
        self.spatial = nn.Sequential(nn.Conv2d(width, width, 3, padding=2, dilation=2, groups=width),
                                     nn.Conv2d(width, width, 1))
        self.gate = nn.Conv2d(width, width, 1)
        self.proj = nn.Conv2d(width, width, 1)
        self.head = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bn(self.stem(x))
        x = x + self.proj(self.spatial(x) * self.gate(x))
        return self.head(x.mean(dim=(2, 3)))


class DeepResidual(nn.Module):
    """64 -> 32, three residual square blocks, -> 10: 8 levels, with skip registers live across the cuts."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.stem = nn.Linear(64, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
        self.head = nn.Linear(width, 10)
        self.square = Square()

    def forward(self, x):
        h = self.stem(x.flatten(1))
        for block in self.blocks:
            h = h + 0.25 * self.square(block(h))
        return self.head(h)


class ShiftBlocks(nn.Module):
    """Plain torch, MONet-style: a 2x2 patch embedding to 4x4 tokens of 16 channels, then Mu-Layer-like blocks
    ``x + C(shift(U1 x) * U3(shift(U2 x)))`` with the slice-and-concat spatial shift, then a linear head."""

    def __init__(self, blocks: int = 2, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Conv2d(1, width, 2, stride=2)
        self.u1 = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
        self.u2 = nn.ModuleList(nn.Linear(width, width // 4) for _ in range(blocks))
        self.u3 = nn.ModuleList(nn.Linear(width // 4, width) for _ in range(blocks))
        self.c = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
        self.head = nn.Linear(width * 16, 10)

    def forward(self, x):
        x = self.embed(x).permute(0, 2, 3, 1)  # channels last: (B, H, W, C)
        for u1, u2, u3, c in zip(self.u1, self.u2, self.u3, self.c, strict=True):
            x = x + 0.2 * c(spatial_shift(u1(x)) * u3(spatial_shift(u2(x))))
        return self.head(x.flatten(1))


class LinearAttention(nn.Module):
    """(D Q K^T + c) V over ``tokens`` tokens of ``width`` channels: two ct x ct MatMuls the compiler reassociates
    to Q (K^T V) and prices per algorithm."""

    def __init__(self, tokens: int, width: int, offset: float) -> None:
        super().__init__()
        self.tokens, self.offset = tokens, offset
        self.q, self.k, self.v = (nn.Linear(width, width, bias=False) for _ in range(3))
        self.o = nn.Linear(width, width)
        self.register_buffer("row_scale", torch.linspace(0.5, 1.5, tokens).reshape(tokens, 1))

    def forward(self, x):
        a = (self.q(x) @ self.k(x).transpose(-2, -1)) * self.row_scale / self.tokens + self.offset
        return self.o(a @ self.v(x))


@functools.lru_cache(maxsize=1)
def digits():
    data = load_digits()
    return data.x_train.astype(np.float64), data.y_train, data.x_test.astype(np.float64), data.y_test


def train(model: nn.Module, epochs: int = 30, lr: float = 0.01, batch_size: int = 256,
          data: tuple[np.ndarray, np.ndarray] | None = None) -> nn.Module:
    """A few AdamW epochs (on ``data`` = (x, y), digits' training split by default): enough for the tests to check
    real decisions, not chance. One torch thread: these tiny matrices run several times slower when two threads
    fight over a busy 2-core machine."""
    x, y = data if data is not None else digits()[:2]
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    xt, yt = torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.long)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model.train()
        for _ in range(epochs):
            for i in range(0, len(xt), batch_size):
                opt.zero_grad()
                nn.functional.cross_entropy(model(xt[i:i + batch_size]), yt[i:i + batch_size]).backward()
                opt.step()
    finally:
        torch.set_num_threads(threads)
    return model.eval()
