"""The S2-MLP spatial shift used by MONet's first Mu-Layer (spec 1.5).

Out-of-place and built from slices and concatenations only, so it exports to ONNX as pure data movement
(Slice + Concat) that the degree analyzer accepts and the CKKS compiler turns into masked rotations.
The reference code shifts in place on overlapping slices, which broadcasts the first row/column on CPU and
races on CUDA; we implement the intended shift instead.
"""

from __future__ import annotations

import torch


def spatial_shift(x: torch.Tensor) -> torch.Tensor:
    """Shift four channel groups of a channels-last ``(B, H, W, C)`` tensor by one pixel.

    Group boundaries are ``C//4, C//2, 3C//4``. Group 0 moves down along H, group 1 up, group 2 right along W,
    group 3 left. Borders replicate (the row or column that has no source keeps its own value).
    """
    if x.dim() != 4:
        raise ValueError(f"spatial_shift expects a channels-last (B, H, W, C) tensor, got shape {tuple(x.shape)}")
    c = x.shape[-1]
    q1, q2, q3 = c // 4, c // 2, (3 * c) // 4
    down = torch.cat([x[:, :1, :, :q1], x[:, :-1, :, :q1]], dim=1)
    up = torch.cat([x[:, 1:, :, q1:q2], x[:, -1:, :, q1:q2]], dim=1)
    right = torch.cat([x[:, :, :1, q2:q3], x[:, :, :-1, q2:q3]], dim=2)
    left = torch.cat([x[:, :, 1:, q3:], x[:, :, -1:, q3:]], dim=2)
    return torch.cat([down, up, right, left], dim=-1)
