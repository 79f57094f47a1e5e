"""Fold rules for the polynomial ResMLP: every Affine and layer-scale goes into the neighbouring linear maps.

Per block (tokens ``x`` of shape ``(N, D)``, Aff = ``a * x + b`` per channel, ``P`` the cross-patch Linear):

- ``ls1 * P(Aff1(x))``: P mixes tokens and Aff1 acts per channel, so they commute into
  ``(ls1 * a1)[d] * (P x)[n, d] + ls1[d] * (b1[d] * rowsum(P)[n] + c[n])``: the token-mixing weights stay, a
  per-channel scale and an ``(N, D)`` bias map join them in one :class:`FoldedCrossPatch`;
- ``ls2 * W3((W1 Aff2(z) + b1) * (W2 Aff2(z) + b2)) + b3``: Aff2 folds into W1 and W2 (it precedes both),
  ls2 into W3's output rows and bias;
- final Affine and mean over tokens: ``head(mean_n(a x + b))`` = ``(W a / N) sum_n x + (W b + c)``.

What remains is the patch-embedding conv, Linear maps, one Hadamard product per block and token sums.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from polyfhe.folding import weight_math as wm
from polyfhe.folding.primitives import conv_from, linear_from
from polyfhe.folding.rules import FoldContext, register_fold_rule
from polyfhe.models.resmlp import ResMLP, ResMLPBlock

__all__ = [
    "FoldedChannelMLP", "FoldedCrossPatch", "FoldedResMLP", "FoldedResMLPBlock", "TokenSum",
    "fold_affine_into_cross_patch", "fold_affine_into_head", "fold_resmlp",
]


# --- pure weight math -----------------------------------------------------------------------------------------
def fold_affine_into_cross_patch(
    weight: Tensor, bias: Tensor, scale: Tensor, shift: Tensor, out_scale: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``out_scale * P(scale * x + shift)`` for a token-mixing Linear P (weight ``(N, N)``, bias ``(N,)``) acting
    on the token axis of ``x`` ``(N, D)`` with per-channel ``scale``/``shift``/``out_scale`` ``(D,)``.

    Returns ``(weight, channel_scale (D,), bias_map (N, D))`` with the map equal to
    ``channel_scale[d] * (weight @ x)[n, d] + bias_map[n, d]``.
    """
    w = weight.double()
    s_out = out_scale.double()
    channel_scale = s_out * scale.double()
    bias_map = s_out[None, :] * (w.sum(dim=1)[:, None] * shift.double()[None, :] + bias.double()[:, None])
    return w, channel_scale, bias_map


def fold_affine_into_head(
    weight: Tensor, bias: Tensor, scale: Tensor, shift: Tensor, num_tokens: int
) -> tuple[Tensor, Tensor]:
    """``W mean_n(scale * x_n + shift) + c`` as a Linear on the token sum ``sum_n x_n``."""
    w, b = wm.fold_affine_before(weight, bias, scale, shift)
    return w / num_tokens, b


# --- folded modules -------------------------------------------------------------------------------------------
class FoldedCrossPatch(nn.Module):
    """``channel_scale * (W @ x) + bias_map`` on ``(B, N, D)`` tokens: the cross-patch Linear with the Affine
    before it and the layer-scale after it (a per-channel scale cannot enter a token-mixing weight)."""

    def __init__(self, weight: Tensor, channel_scale: Tensor, bias_map: Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("weight", weight.to(dtype))
        self.register_buffer("channel_scale", channel_scale.to(dtype))
        self.register_buffer("bias_map", bias_map.to(dtype))

    def forward(self, x: Tensor) -> Tensor:
        mixed = torch.matmul(x.transpose(1, 2), self.weight.t()).transpose(1, 2)
        return mixed * self.channel_scale + self.bias_map

    def extra_repr(self) -> str:
        return f"tokens={self.weight.shape[0]}, channels={self.channel_scale.numel()}"


class FoldedChannelMLP(nn.Module):
    """``fc3(fc1(x) * fc2(x))`` with Aff2 inside fc1/fc2 and the layer-scale inside fc3."""

    def __init__(self, fc1: nn.Linear, fc2: nn.Linear, fc3: nn.Linear) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = fc1, fc2, fc3

    def forward(self, x: Tensor) -> Tensor:
        return self.fc3(self.fc1(x) * self.fc2(x))


class FoldedResMLPBlock(nn.Module):
    def __init__(self, cross_patch: FoldedCrossPatch, mlp: FoldedChannelMLP) -> None:
        super().__init__()
        self.cross_patch, self.mlp = cross_patch, mlp

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.cross_patch(x)
        return x + self.mlp(x)


class TokenSum(nn.Module):
    """Sum over the token axis of ``(B, N, D)``: mean pooling with its ``1/N`` folded into the head."""

    def forward(self, x: Tensor) -> Tensor:
        return x.sum(dim=1)


class FoldedResMLP(nn.Module):
    """Patch-embedding conv, folded blocks, token sum, head (the final Affine and 1/N inside the head)."""

    def __init__(self, patch_embed: nn.Conv2d, blocks: nn.Sequential, head: nn.Linear) -> None:
        super().__init__()
        self.patch_embed, self.blocks, self.head = patch_embed, blocks, head
        self.pool = TokenSum()

    def forward(self, x: Tensor) -> Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        return self.head(self.pool(self.blocks(x)))


# --- rules ----------------------------------------------------------------------------------------------------
def _affine(module: nn.Module) -> tuple[Tensor, Tensor]:
    return module.alpha.detach().double(), module.beta.detach().double()


def _fold_block(block: ResMLPBlock) -> FoldedResMLPBlock:
    dtype = block.ls1.dtype
    a1, b1 = _affine(block.norm1)
    proj = block.cross_patch.proj
    cross = FoldedCrossPatch(
        *fold_affine_into_cross_patch(proj.weight.detach(), proj.bias.detach(), a1, b1, block.ls1.detach()), dtype
    )
    a2, b2 = _affine(block.norm2)
    mlp = block.mlp
    fc1 = linear_from(*wm.fold_affine_before(mlp.fc1.weight.detach(), mlp.fc1.bias.detach(), a2, b2), like=mlp.fc1)
    fc2 = linear_from(*wm.fold_affine_before(mlp.fc2.weight.detach(), mlp.fc2.bias.detach(), a2, b2), like=mlp.fc2)
    ls2 = block.ls2.detach().double()
    fc3 = linear_from(
        *wm.fold_affine_after(mlp.fc3.weight.detach(), mlp.fc3.bias.detach(), ls2, torch.zeros_like(ls2)),
        like=mlp.fc3,
    )
    return FoldedResMLPBlock(cross, FoldedChannelMLP(fc1, fc2, fc3))


@register_fold_rule(ResMLPBlock)
def fold_resmlp_block(block: ResMLPBlock, _: FoldContext) -> FoldedResMLPBlock:
    return _fold_block(block)


@register_fold_rule(ResMLP)
def fold_resmlp(model: ResMLP, _: FoldContext) -> FoldedResMLP:
    a, b = _affine(model.norm)
    head = linear_from(
        *fold_affine_into_head(model.head.weight.detach(), model.head.bias.detach(), a, b, model.cfg.num_tokens),
        like=model.head,
    )
    embed = model.patch_embed
    patch_embed = conv_from(embed.weight.detach().double(), embed.bias.detach().double(), like=embed)
    blocks = nn.Sequential(*(_fold_block(block) for block in model.blocks))
    return FoldedResMLP(patch_embed, blocks, head)

