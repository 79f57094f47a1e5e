"""Pure weight math for folding: tensors in, tensors out, no modules (as in torch.fx's fusion utilities).

Conventions: a per-channel affine is ``y = scale * x + shift`` with ``scale``/``shift`` of shape ``(C,)``;
linear weights are ``(out, in)``; conv weights are ``(out, in // groups, *kernel)``. Everything is computed in
float64 and cast back by the caller, so folding itself adds no rounding beyond the final cast.
"""

from __future__ import annotations

import torch


def batchnorm_affine(
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inference BatchNorm as ``(scale, shift)``: ``gamma * (x - mean) / sqrt(var + eps) + beta``."""
    mean, var = running_mean.double(), running_var.double()
    gamma = weight.double() if weight is not None else torch.ones_like(mean)
    beta = bias.double() if bias is not None else torch.zeros_like(mean)
    scale = gamma / torch.sqrt(var + eps)
    return scale, beta - scale * mean


def _out_view(t: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, *([1] * (weight.dim() - 1)))


def fold_affine_after(
    weight: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor, shift: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``scale * (W x + b) + shift`` as one linear/conv map (scale over output channels)."""
    w = weight.double() * _out_view(scale.double(), weight)
    b = bias.double() if bias is not None else torch.zeros(weight.shape[0], dtype=torch.float64)
    return w, scale.double() * b + shift.double()


def _input_channel_index(weight: torch.Tensor, groups: int) -> torch.Tensor:
    """For each (out, in_per_group) weight slice, the absolute input channel it reads."""
    out_ch, in_per_group = weight.shape[0], weight.shape[1]
    out_per_group = out_ch // groups
    group = torch.arange(out_ch) // out_per_group
    return group[:, None] * in_per_group + torch.arange(in_per_group)[None, :]


def fold_affine_before(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    scale: torch.Tensor,
    shift: torch.Tensor,
    groups: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``W (scale * x + shift) + b`` as one map, valid when no zero padding touches the input.

    With zero padding the shift would also be added to the padded border, which the original did not see;
    callers handle that case with :func:`conv_bias_map` instead.
    """
    idx = _input_channel_index(weight, groups)
    s = scale.double()[idx].reshape(*idx.shape, *([1] * (weight.dim() - 2)))
    t = shift.double()[idx].reshape(*idx.shape, *([1] * (weight.dim() - 2)))
    w = weight.double() * s
    b = bias.double() if bias is not None else torch.zeros(weight.shape[0], dtype=torch.float64)
    spatial = tuple(range(1, weight.dim()))
    return w, b + (weight.double() * t).sum(dim=spatial)


def compose_patch_convs(
    w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor, b2: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two non-overlapping patch convs (k1 stride k1, then k2 stride k2) as one (k1*k2) stride (k1*k2) conv.

    Exact because every output pixel reads a disjoint input patch: MONet's pyramid patch embedding (spec 1.6).
    """
    out2, mid, k2h, k2w = w2.shape
    _, in1, k1h, k1w = w1.shape
    w = torch.einsum("ocab,ciuv->oiaubv", w2.double(), w1.double()).reshape(out2, in1, k2h * k1h, k2w * k1w)
    b1d = b1.double() if b1 is not None else torch.zeros(mid, dtype=torch.float64)
    b2d = b2.double() if b2 is not None else torch.zeros(out2, dtype=torch.float64)
    return w, b2d + torch.einsum("ocab,c->o", w2.double(), b1d)
