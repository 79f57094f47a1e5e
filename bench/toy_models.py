"""Small polynomial models and a short digits trainer, shared by the benchmarks and the CKKS tests."""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import nn

from polyfhe.data.sources import load_digits

__all__ = ["Cube", "Square", "digits", "train"]


class Square(nn.Module):
    def forward(self, x):
        return x * x


class Cube(nn.Module):
    def forward(self, x):
        return torch.pow(x, 3)


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
