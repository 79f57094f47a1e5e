"""Fold rules for MONet-BN: every BatchNorm, alpha and the pooling factor go into the Linear/Conv weights.

A folded Mu-Layer is ``C(A z * (B' shift(D z) + 1))``: the block norm folds into A and D (it precedes them),
N1 folds into A (a per-channel affine commutes with the shift), N3 and alpha fold into B', and the reference's
``a + alpha * a * g`` becomes ``a * (1 + alpha * g)``, the ``+1`` going into B's bias. Nothing but four linear
maps, one Hadamard product and data movement remains (degree 2 per Mu-Layer, spec section 3).
"""

from __future__ import annotations

import torch
from torch import nn

from polyfhe.folding import weight_math as wm
from polyfhe.folding.primitives import ConstantAffine, SpatialSum, conv_from, linear_from
from polyfhe.folding.rules import FoldContext, FoldError, bn_scale_shift, register_fold_rule
from polyfhe.models.layers.mu_layer import MuLayer, PolyBlock
from polyfhe.models.layers.shift import spatial_shift
from polyfhe.models.layers.token_norms import TokenBatchNorm
from polyfhe.models.monet import MONet


class FoldedMuLayer(nn.Module):
    """``proj_out(proj_a(z) * proj_up(proj_down(z)))`` with the spatial shift on both branches when enabled."""

    def __init__(self, proj_a: nn.Linear, proj_down: nn.Linear, proj_up: nn.Linear, proj_out: nn.Linear,
                 shift: bool) -> None:
        super().__init__()
        self.proj_a, self.proj_down, self.proj_up, self.proj_out = proj_a, proj_down, proj_up, proj_out
        self.shift = shift

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        a, g = self.proj_a(z), self.proj_down(z)
        if self.shift:
            a, g = spatial_shift(a), spatial_shift(g)
        return self.proj_out(a * self.proj_up(g))


class FoldedPolyBlock(nn.Module):
    """Two residual folded Mu-Layers (the block norms live inside their input projections)."""

    def __init__(self, mu1: FoldedMuLayer, mu2: FoldedMuLayer) -> None:
        super().__init__()
        self.mu1, self.mu2 = mu1, mu2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mu1(x)
        return x + self.mu2(x)


class FoldedMONet(nn.Module):
    """Folded MONet: one merged patch-embedding conv, folded blocks, downsampling convs, sum-pool + head."""

    def __init__(self, patch_embed: nn.Conv2d, stages: nn.ModuleList, downsamples: nn.ModuleList,
                 head: nn.Linear) -> None:
        super().__init__()
        self.patch_embed, self.stages, self.downsamples = patch_embed, stages, downsamples
        self.pool = SpatialSum()
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        for i, stage in enumerate(self.stages):
            x = stage(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
            if i < len(self.downsamples):
                x = self.downsamples[i](x)
        return self.head(self.pool(x))


def _token_affine(norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(norm, TokenBatchNorm):
        raise FoldError(f"MONet fold expects TokenBatchNorm, found {type(norm).__name__}; use a MONet BN variant")
    return bn_scale_shift(norm)


def fold_mu_layer(mu: MuLayer, block_norm: nn.Module) -> FoldedMuLayer:
    """Pure rewrite of one Mu-Layer preceded by its block norm (see the module docstring)."""
    s0, t0 = _token_affine(block_norm)
    sa, ta = _token_affine(mu.norm_a)
    sg, tg = _token_affine(mu.norm_g)
    alpha = mu.alpha.detach().double().reshape(())
    w_a, b_a = wm.fold_affine_before(mu.proj_a.weight, mu.proj_a.bias, s0, t0)
    w_a, b_a = wm.fold_affine_after(w_a, b_a, sa, ta)
    w_d, b_d = wm.fold_affine_before(mu.proj_down.weight, mu.proj_down.bias, s0, t0)
    w_u, b_u = wm.fold_affine_after(mu.proj_up.weight, mu.proj_up.bias, alpha * sg, alpha * tg)
    return FoldedMuLayer(
        linear_from(w_a, b_a, mu.proj_a), linear_from(w_d, b_d, mu.proj_down),
        linear_from(w_u, b_u + 1.0, mu.proj_up),
        linear_from(mu.proj_out.weight.detach().double(), mu.proj_out.bias.detach().double(), mu.proj_out),
        mu.shift,
    )


@register_fold_rule(PolyBlock)
def fold_poly_block(block: PolyBlock, _: FoldContext) -> FoldedPolyBlock:
    return FoldedPolyBlock(fold_mu_layer(block.mu1, block.norm1), fold_mu_layer(block.mu2, block.norm2))


@register_fold_rule(TokenBatchNorm)
def fold_token_batchnorm(norm: TokenBatchNorm, _: FoldContext) -> ConstantAffine:
    scale, shift = bn_scale_shift(norm)
    return ConstantAffine(scale.to(norm.running_mean.dtype), shift.to(norm.running_mean.dtype))


def _merged_patch_embed(embed: nn.Sequential) -> nn.Conv2d:
    convs = list(embed)
    conv = convs[0]
    w, b = conv.weight.detach().double(), conv.bias.detach().double()
    for nxt in convs[1:]:
        w, b = wm.compose_patch_convs(w, b, nxt.weight, nxt.bias)
    stride = w.shape[-1]
    merged = nn.Conv2d(conv.in_channels, w.shape[0], stride, stride=stride, dtype=conv.weight.dtype)
    with torch.no_grad():
        merged.weight.copy_(w)
        merged.bias.copy_(b)
    return merged


@register_fold_rule(MONet)
def fold_monet(model: MONet, ctx: FoldContext) -> FoldedMONet:
    last_stage_in = ctx.input_shape(model.stages[-1])
    if last_stage_in is None:
        raise FoldError("folding MONet needs its input resolution (model.input_shape or fold(input_shape=...))")
    pool_size = last_stage_in[1] * last_stage_in[2]  # channels-last (B, h, w, C)
    stages = nn.ModuleList(
        nn.Sequential(*(fold_poly_block(b, ctx) for b in stage)) for stage in model.stages
    )
    downsamples = nn.ModuleList(
        conv_from(d.weight.detach().double(), d.bias.detach().double(), like=d) for d in model.downsamples
    )
    head = linear_from(model.head.weight.detach().double() / pool_size, model.head.bias.detach().double(),
                       model.head)
    return FoldedMONet(_merged_patch_embed(model.patch_embed), stages, downsamples, head)
