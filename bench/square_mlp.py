"""The untrained 64 -> hidden -> x^2 -> classes MLP the serving benchmarks and fuzz harness run (digits-sized)."""

from __future__ import annotations

import numpy as np


def square_mlp_program(hidden: int, classes: int, calibration_samples: int):
    """The MLP exported for CKKS with a random 8x8 calibration set (seeded: the same program every run)."""
    import torch
    from torch import nn

    import polyfhe

    class Square(nn.Module):
        def forward(self, x):
            return x * x

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), Square(), nn.Linear(hidden, classes)).eval()
    calib = np.random.default_rng(0).random((calibration_samples, 1, 8, 8)).astype(np.float32)
    return polyfhe.export(model, target="ckks", calibration=calib, input_shape=(1, 8, 8))
