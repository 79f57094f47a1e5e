"""Fold rules for PolyNeXt-BN: spatial BN, row-sum norm, Sigmoid-Scale, skip scales, attention scale, pooling.

What remains is convolutions, Hadamard products, matrix products of encrypted tensors (attention) and constant
affine maps. Where an affine carries a per-position factor (ChannelBatchNorm's gamma_hw / sqrt(var_hw + eps))
next to a spatial convolution it cannot become conv weights exactly, so it stays a :class:`ConstantAffine`
(spec section 3: such a factor costs no level when merged into the neighbouring plaintext diagonals).

- ChannelBatchNorm -> ConstantAffine with per-(c, h, w) scale A and shift B;
- cell entry ``CBN(a0 s0 + a1 s1)`` -> ``s0 * (A a0) + s1 * (A a1) + B``;
- Sigmoid-Scale r = sigma(lambda) -> the last linear map of each residual branch;
- PolyConv's channel flip -> a row-reversed copy of W_in feeding reversed fine filters (spec 2.11);
- attention scale sigma(lambda_h) -> q_conv's filters; RunningRowSumNorm -> constant gamma / (R + eps);
- PolyHead ``l + l * r`` -> ``l * (r + 1)`` with the 1 in the projection's bias; mean pool -> sum, 1/(h w) in fc.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from polyfhe.folding.primitives import ConstantAffine, SpatialSum, conv_from
from polyfhe.folding.rules import FoldContext, FoldError, register_fold_rule
from polyfhe.models.layers.norms import ChannelBatchNorm, RunningRowSumNorm
from polyfhe.models.layers.poly_attn import PolyAttn, PolyAttnMixer
from polyfhe.models.layers.poly_conv import PolyConv
from polyfhe.models.layers.poly_mlp import PolyMLP
from polyfhe.models.polynext import PolyHead, PolyNeXt, PolyNeXtCell, two_stream_features


# --- pure weight math -----------------------------------------------------------------------------------------
def channel_bn_affine(norm: ChannelBatchNorm) -> tuple[Tensor, Tensor]:
    """Inference ChannelBatchNorm as (A, B) of shape (1, C, H, W): y = A * x + B (code order, spec 2.7)."""
    inv = torch.rsqrt(norm.running_var.double() + norm.eps) * norm.gamma_hw.double()
    gamma_c = norm.gamma_c.double().view(1, -1, 1, 1)
    scale = inv * gamma_c
    shift = -inv * norm.running_mean.double()
    if norm.beta_hw is not None:
        shift = shift + norm.beta_hw.double()
    return scale.expand(-1, -1, *norm.resolution).clone(), (shift * gamma_c).expand_as(scale).clone()


def scaled_conv(conv: nn.Conv2d, out_scale: Tensor | float = 1.0, bias: Tensor | None = None,
                weight: Tensor | None = None) -> nn.Conv2d:
    """A copy of ``conv`` (or of its geometry with ``weight``) with output channels scaled, optional bias."""
    w = conv.weight.double() if weight is None else weight.double()
    scale = torch.as_tensor(out_scale, dtype=torch.float64)
    return conv_from(w * (scale.view(-1, 1, 1, 1) if scale.dim() else scale), bias, like=conv)


def _affine(scale: Tensor | None, shift: Tensor | None, like: Tensor) -> ConstantAffine:
    return ConstantAffine(None if scale is None else scale.to(like.dtype), None if shift is None else shift.to(like.dtype))


def _require_bn(norm: nn.Module, where: str) -> ChannelBatchNorm:
    if not isinstance(norm, ChannelBatchNorm):
        raise FoldError(f"{where}: expected ChannelBatchNorm, found {type(norm).__name__}; use a *_bn PolyNeXt")
    return norm


# --- folded modules -------------------------------------------------------------------------------------------
class FoldedPolyConv(nn.Module):
    """affine(W_out(K(K_c(W_in x) * K_f'(W_in' x)))): the flip lives in W_in' and K_f'."""

    def __init__(self, w_in: nn.Conv2d, w_in_rev: nn.Conv2d, k_coarse: nn.Conv2d, k_fine_rev: nn.Conv2d,
                 k_cons: nn.Conv2d, w_out: nn.Conv2d, out_affine: ConstantAffine) -> None:
        super().__init__()
        self.w_in, self.w_in_rev, self.k_coarse, self.k_fine_rev = w_in, w_in_rev, k_coarse, k_fine_rev
        self.k_cons, self.w_out, self.out_affine = k_cons, w_out, out_affine

    def forward(self, x: Tensor) -> Tensor:
        m = self.k_coarse(self.w_in(x)) * self.k_fine_rev(self.w_in_rev(x))
        return self.out_affine(self.w_out(self.k_cons(m)))


class FoldedPolyMLP(nn.Module):
    """fc_out'(affine(hi * lo)) with the branch's Sigmoid-Scale inside fc_out'."""

    def __init__(self, fc_in: nn.Conv2d, mid_affine: ConstantAffine, fc_out: nn.Conv2d) -> None:
        super().__init__()
        self.fc_in, self.mid_affine, self.fc_out = fc_in, mid_affine, fc_out

    def forward(self, x: Tensor) -> Tensor:
        hi, lo = self.fc_in(x).chunk(2, dim=1)
        return self.fc_out(self.mid_affine(hi * lo))


class FoldedPolyAttn(nn.Module):
    """Pre-norm affine, depthwise Q/K/V, (QK^T + 1)^4 as two squarings, constant row scale, A V, proj."""

    def __init__(self, attn: PolyAttn, in_affine: ConstantAffine, q_conv: nn.Conv2d, row_scale: ConstantAffine,
                 out_affine: ConstantAffine, proj: nn.Conv2d) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.width = attn.n_heads, attn.head_dim, attn.width
        self.kernel_offset = attn.kernel_offset
        self.in_affine, self.qkv, self.q_conv = in_affine, attn.qkv, q_conv
        self.k_conv, self.v_conv, self.final_conv = attn.k_conv, attn.v_conv, attn.final_conv
        self.row_scale, self.out_affine, self.proj = row_scale, out_affine, proj

    def _split_heads(self, t: Tensor) -> Tensor:
        b, _, h, w = t.shape
        return t.reshape(b, self.n_heads, self.head_dim, h * w).transpose(2, 3)

    def forward(self, x: Tensor) -> Tensor:
        b, _, h, w = x.shape
        qk, v = self.qkv(self.in_affine(x)).chunk(2, dim=1)
        q, k = self._split_heads(self.q_conv(qk)), self._split_heads(self.k_conv(qk))
        s = q @ k.transpose(-2, -1) + self.kernel_offset
        s2 = s * s
        a = self.row_scale(s2 * s2)
        o = (a @ self._split_heads(self.v_conv(v))).transpose(2, 3).reshape(b, self.width, h, w)
        return self.proj(self.out_affine(self.final_conv(o)))


class FoldedPolyNeXtCell(nn.Module):
    """p = s0 * scale0 + s1 * scale1 + shift; then residual mixers and MLPs with their scales folded in."""

    def __init__(self, scale0: Tensor, scale1: Tensor, shift: Tensor, mixers: nn.ModuleList,
                 mlps: nn.ModuleList) -> None:
        super().__init__()
        self.register_buffer("scale0", scale0)
        self.register_buffer("scale1", scale1)
        self.register_buffer("shift", shift)
        self.mixers, self.mlps = mixers, mlps

    def forward(self, s0: Tensor, s1: Tensor) -> Tensor:
        p = s0 * self.scale0 + s1 * self.scale1 + self.shift
        for mixer, mlp in zip(self.mixers, self.mlps, strict=True):
            p = p + mixer(p)
            p = p + mlp(p)
        return p


class FoldedPolyHead(nn.Module):
    """affine -> proj (r-half bias 1) -> l * r' -> spatial sum -> fc with 1/(h w) folded in."""

    def __init__(self, in_affine: ConstantAffine, proj: nn.Conv2d, fc: nn.Linear) -> None:
        super().__init__()
        self.in_affine, self.proj, self.pool, self.fc = in_affine, proj, SpatialSum(), fc

    def forward(self, x: Tensor) -> Tensor:
        left, right = self.proj(self.in_affine(x)).chunk(2, dim=1)
        return self.fc(self.pool(left * right))


class FoldedPolyNeXt(nn.Module):
    """Same two-stream wiring as :class:`PolyNeXt`, with folded cells and head."""

    def __init__(self, model: PolyNeXt, cells: nn.ModuleList, head: FoldedPolyHead) -> None:
        super().__init__()
        self.stem, self.reductions = model.stem, model.reductions
        self.downsample_cells = tuple(model.downsample_cells)
        self.cells, self.head = cells, head

    def forward(self, x: Tensor) -> Tensor:
        return self.head(two_stream_features(self, x))


# --- rules ----------------------------------------------------------------------------------------------------
def fold_poly_conv(mixer: PolyConv, branch_scale: Tensor) -> FoldedPolyConv:
    a, b = channel_bn_affine(_require_bn(mixer.norm, "PolyConv post-norm"))
    w_in_rev = mixer.w_in.weight.double().flip(0)
    return FoldedPolyConv(
        scaled_conv(mixer.w_in), scaled_conv(mixer.w_in, weight=w_in_rev), scaled_conv(mixer.k_coarse),
        scaled_conv(mixer.k_fine, weight=mixer.k_fine.weight.double().flip(0)), scaled_conv(mixer.k_cons),
        scaled_conv(mixer.w_out), _affine(a * branch_scale, b * branch_scale, mixer.w_out.weight),
    )


def fold_poly_mlp(mlp: PolyMLP, branch_scale: Tensor) -> FoldedPolyMLP:
    a, b = channel_bn_affine(_require_bn(mlp.norm, "PolyMLP mid-norm"))
    return FoldedPolyMLP(scaled_conv(mlp.fc_in), _affine(a, b, mlp.fc_in.weight),
                         scaled_conv(mlp.fc_out, out_scale=branch_scale))


def fold_poly_attn_mixer(mixer: PolyAttnMixer, branch_scale: Tensor) -> FoldedPolyAttn:
    attn = mixer.attn
    if not isinstance(attn.norm, RunningRowSumNorm):
        raise FoldError("PolyAttn's l1 row normalisation divides by data; use an APolyNeXt *_bn variant")
    a_in, b_in = channel_bn_affine(_require_bn(mixer.norm, "attention pre-norm"))
    a_out, b_out = channel_bn_affine(_require_bn(attn.norm2, "attention norm2"))
    head_scale = torch.sigmoid(attn.scale.double()).repeat_interleave(attn.head_dim)
    row = attn.norm.gamma.double() / (attn.norm.running_denom.double() + attn.norm.eps)
    return FoldedPolyAttn(
        attn, _affine(a_in, b_in, attn.qkv.weight), scaled_conv(attn.q_conv, out_scale=head_scale),
        _affine(row, None, attn.qkv.weight), _affine(a_out, b_out, attn.qkv.weight),
        scaled_conv(attn.proj, out_scale=branch_scale),
    )


MIXER_FOLDS = {PolyConv: fold_poly_conv, PolyAttnMixer: fold_poly_attn_mixer}


@register_fold_rule(PolyNeXtCell)
def fold_cell(cell: PolyNeXtCell, _: FoldContext) -> FoldedPolyNeXtCell:
    a, b = channel_bn_affine(_require_bn(cell.pre_norm, "cell pre-norm"))
    dtype = cell.skip_weight.dtype
    r = torch.sigmoid(cell.skip_weight.double())
    mixers, mlps = [], []
    for (ia, ib), mixer, mlp in zip(cell.skip_pairs, cell.mixers, cell.mlps, strict=True):
        mixers.append(MIXER_FOLDS[type(mixer)](mixer, r[ia]))
        mlps.append(fold_poly_mlp(mlp, r[ib]))
    return FoldedPolyNeXtCell(
        (a * cell.preprocess0.scale.double()).to(dtype), (a * cell.preprocess1.scale.double()).to(dtype),
        b.to(dtype), nn.ModuleList(mixers), nn.ModuleList(mlps),
    )


@register_fold_rule(PolyHead)
def fold_head(head: PolyHead, _: FoldContext) -> FoldedPolyHead:
    norm = _require_bn(head.norm, "head norm")
    a, b = channel_bn_affine(norm)
    half = head.proj.out_channels // 2
    bias = torch.cat([torch.zeros(half), torch.ones(half)]).double()
    h, w = norm.resolution
    fc = nn.Linear(head.fc.in_features, head.fc.out_features, dtype=head.fc.weight.dtype)
    with torch.no_grad():
        fc.weight.copy_(head.fc.weight.double() / (h * w))
        fc.bias.copy_(head.fc.bias)
    return FoldedPolyHead(_affine(a, b, head.proj.weight), scaled_conv(head.proj, bias=bias), fc)


@register_fold_rule(PolyNeXt)
def fold_polynext(model: PolyNeXt, ctx: FoldContext) -> FoldedPolyNeXt:
    cells = nn.ModuleList(fold_cell(c, ctx) for c in model.cells)
    return FoldedPolyNeXt(model, cells, fold_head(model.head, ctx))
