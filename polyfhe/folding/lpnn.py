"""Fold rule for LPNN: every BatchNorm after a product activation goes into the adjacent linear maps, exactly.

At inference a ladder layer is ``h_l = s_l * ((W_l h + b_l) * (V_l f + c_l)) + t_l`` (dropout is the identity).
A per-unit scale commutes with the product, so ``s_l`` goes into the rows of ``W_l`` and ``b_l`` (the paper's
eq. 14 for the product form); the shift ``t_l`` cannot enter the product, so it is carried into the bias of every
map that reads ``h_l``: the next layer's ``W``, the head, and with skip factors a later ``V``. What remains is
linear maps, one Hadamard product per layer and a flatten.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from polyfhe.folding import weight_math as wm
from polyfhe.folding.primitives import linear_from
from polyfhe.folding.rules import FoldContext, FoldError, bn_scale_shift, register_fold_rule
from polyfhe.models.lpnn import LPNN


@dataclass(frozen=True)
class LadderAffines:
    """One ladder layer as tensors: ``(w h + b) * (v f + c)``, then the per-unit affine ``scale * . + shift``
    (``None``: no norm after the product)."""

    w: torch.Tensor
    b: torch.Tensor
    v: torch.Tensor
    c: torch.Tensor
    scale: torch.Tensor | None = None
    shift: torch.Tensor | None = None


def _absorb_shift(w: torch.Tensor, b: torch.Tensor, shift: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``W (h + shift) + b`` as ``W h + b'``."""
    if shift is None:
        return w.double(), b.double()
    return wm.fold_affine_before(w, b, torch.ones_like(shift), shift)


def fold_ladder_stack(
    layers: Sequence[LadderAffines], sources: Sequence[int], head_w: torch.Tensor, head_b: torch.Tensor
) -> tuple[list[LadderAffines], tuple[torch.Tensor, torch.Tensor]]:
    """Pure weight math: the layers without norms (``scale``/``shift`` None) and the head, all in float64.

    ``sources[l - 1]`` is the index ``k`` of the ``h_k`` that layer ``l``'s second factor reads (``h_0`` = input,
    which has no shift). Each layer first takes the shifts of what it reads into its biases, then its own scale.
    """
    if len(sources) != len(layers):
        raise ValueError(f"{len(layers)} ladder layers but {len(sources)} factor sources")
    shifts: list[torch.Tensor | None] = [None]  # shift still to be added to h_k; h_0 (input) has none
    folded: list[LadderAffines] = []
    for l, (layer, src) in enumerate(zip(layers, sources), start=1):
        if not 0 <= src < l:
            raise ValueError(f"layer {l} reads h_{src}; a factor source must be an earlier layer (0..{l - 1})")
        w, b = _absorb_shift(layer.w, layer.b, shifts[l - 1])
        v, c = _absorb_shift(layer.v, layer.c, shifts[src])
        if layer.scale is not None:
            w, b = wm.fold_affine_after(w, b, layer.scale, torch.zeros_like(b))
        folded.append(LadderAffines(w, b, v, c))
        shifts.append(layer.shift.double() if layer.shift is not None else None)
    return folded, _absorb_shift(head_w, head_b, shifts[-1])


class FoldedLPNN(nn.Module):
    """Flatten, then per layer ``proj(h) * factor(source)``, then the head: Linear maps and products only."""

    def __init__(self, projs: nn.ModuleList, factors: nn.ModuleList, sources: Sequence[int], head: nn.Linear) -> None:
        super().__init__()
        self.projs, self.factors, self.head = projs, factors, head
        self.sources = tuple(sources)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hs = [x.flatten(1)]
        for proj, factor, src in zip(self.projs, self.factors, self.sources):
            hs.append(proj(hs[-1]) * factor(hs[src]))
        return self.head(hs[-1])


def _layer_affines(layer: nn.Module, path: str) -> LadderAffines:
    if isinstance(layer.norm, nn.Identity):
        scale = shift = None
    elif isinstance(layer.norm, nn.BatchNorm1d):
        scale, shift = bn_scale_shift(layer.norm)
    else:
        raise FoldError(f"LPNN layer '{path}' has norm {type(layer.norm).__name__}; only BatchNorm1d or none fold")
    return LadderAffines(layer.proj.weight.detach(), layer.proj.bias.detach(), layer.factor.weight.detach(),
                         layer.factor.bias.detach(), scale, shift)


@register_fold_rule(LPNN)
def fold_lpnn(model: LPNN, ctx: FoldContext) -> FoldedLPNN:
    affines = [_layer_affines(layer, f"{ctx.path}.layers.{i}".lstrip(".")) for i, layer in enumerate(model.layers)]
    folded, (head_w, head_b) = fold_ladder_stack(affines, model.sources, model.head.weight.detach(),
                                                 model.head.bias.detach())
    projs = nn.ModuleList(linear_from(f.w, f.b, like=layer.proj) for f, layer in zip(folded, model.layers))
    factors = nn.ModuleList(linear_from(f.v, f.c, like=layer.factor) for f, layer in zip(folded, model.layers))
    return FoldedLPNN(projs, factors, model.sources, linear_from(head_w, head_b, like=model.head))


__all__ = ["FoldedLPNN", "LadderAffines", "fold_ladder_stack", "fold_lpnn"]
