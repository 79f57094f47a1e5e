"""Fold-rule registry and the generic rules (BatchNorm next to Linear/Conv, dropout, refused norms).

A rule maps one module to its folded replacement: ``rule(module, ctx) -> nn.Module``. Family-specific rules
(MONet, PolyNeXt) live in their own modules and register here through :func:`register_fold_rule`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from polyfhe.folding import weight_math as wm
from polyfhe.folding.primitives import ConstantAffine, conv_from, linear_from
from polyfhe.models.layers.affine import Affine


class FoldError(ValueError):
    """The model contains something that cannot become a fixed polynomial map."""


@dataclass(frozen=True)
class FoldContext:
    """What rules may need besides the module: recorded input shapes (by module id) and the module's path."""

    input_shapes: dict[int, tuple[int, ...]] = field(default_factory=dict)
    path: str = ""

    def at(self, path: str) -> FoldContext:
        return replace(self, path=path)

    def input_shape(self, module: nn.Module) -> tuple[int, ...] | None:
        return self.input_shapes.get(id(module))


FoldRule = Callable[[nn.Module, FoldContext], nn.Module]
FOLD_RULES: dict[type, FoldRule] = {}


def register_fold_rule(*types: type) -> Callable[[FoldRule], FoldRule]:
    def decorator(rule: FoldRule) -> FoldRule:
        for t in types:
            FOLD_RULES[t] = rule
        return rule

    return decorator


# --- refused normalisations ---------------------------------------------------------------------------------

REFUSED_NORMS: tuple[type, ...] = (
    nn.LayerNorm, nn.GroupNorm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LocalResponseNorm,
    nn.RMSNorm,
)
SUPPORTED_NORMS = "BatchNorm1d/2d, TokenBatchNorm (MONet BN), ChannelBatchNorm and RunningRowSumNorm (PolyNeXt BN)"


def _is_refused(module: nn.Module) -> bool:
    return isinstance(module, REFUSED_NORMS) or "LayerNorm" in type(module).__name__


def check_refused(model: nn.Module, model_name: str | None = None) -> None:
    """Raise :class:`FoldError` naming the first data-dependent norm and what to use instead."""
    for path, module in model.named_modules():
        if _is_refused(module):
            hint = f"use the BN variant '{model_name}_bn'" if model_name and not model_name.endswith("_bn") else (
                "build the model with norm='bn'"
            )
            raise FoldError(
                f"cannot fold module '{path or '<root>'}' ({type(module).__name__}): its statistics are computed "
                f"from the data (division by a data-dependent norm), so it is not polynomial; {hint}. "
                f"Supported norms: {SUPPORTED_NORMS}."
            )


# --- generic rules ------------------------------------------------------------------------------------------

BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d)


def bn_scale_shift(bn: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, shift) of an inference-mode BatchNorm with running statistics, or of a ResMLP Affine."""
    if isinstance(bn, Affine):
        return bn.alpha.detach().double(), bn.beta.detach().double()
    if bn.running_mean is None or bn.running_var is None:
        raise FoldError(f"{type(bn).__name__} has no running statistics (track_running_stats=False); calibrate it")
    return wm.batchnorm_affine(bn.running_mean, bn.running_var, bn.weight, bn.bias, bn.eps)


def affine_module(scale: torch.Tensor, shift: torch.Tensor, ndim_after_channel: int, like: torch.Tensor) -> ConstantAffine:
    """A ConstantAffine on channel axis 1 of a tensor with ``ndim_after_channel`` trailing axes."""
    view = (-1,) + (1,) * ndim_after_channel
    return ConstantAffine(scale.reshape(view).to(like.dtype), shift.reshape(view).to(like.dtype))


@register_fold_rule(nn.BatchNorm1d, nn.BatchNorm2d)
def fold_lone_batchnorm(bn: nn.Module, ctx: FoldContext) -> nn.Module:
    scale, shift = bn_scale_shift(bn)
    shape = ctx.input_shape(bn)
    trailing = (len(shape) - 2) if shape is not None else (2 if isinstance(bn, nn.BatchNorm2d) else 0)
    return affine_module(scale, shift, trailing, bn.running_mean)


@register_fold_rule(Affine)
def fold_lone_affine(affine: Affine, _: FoldContext) -> ConstantAffine:
    return ConstantAffine(affine.alpha.detach().clone(), affine.beta.detach().clone())


@register_fold_rule(nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.AlphaDropout, nn.Identity)
def fold_dropout(_: nn.Module, __: FoldContext) -> nn.Module:
    return nn.Identity()


def _fold_bn_into_next(bn: nn.Module, layer: nn.Module, ctx: FoldContext) -> nn.Module | None:
    """The layer with the BN before it folded in, or None when that needs a resolution nobody recorded."""
    scale, shift = bn_scale_shift(bn)
    if isinstance(layer, nn.Linear):
        return linear_from(*wm.fold_affine_before(layer.weight, layer.bias, scale, shift), like=layer)
    pads = any(p != 0 for p in layer.padding) if not isinstance(layer.padding, str) else layer.padding != "valid"
    if not pads:
        w, b = wm.fold_affine_before(layer.weight, layer.bias, scale, shift, groups=layer.groups)
        return conv_from(w, b, like=layer)
    # Zero padding: the scale folds into the weights, the shift becomes a per-position bias map (the border
    # pixels see fewer shifted inputs), computed once at the recorded resolution.
    shape = ctx.input_shape(bn)
    if shape is None:
        return None
    w, b = wm.fold_affine_before(layer.weight, layer.bias, scale, torch.zeros_like(shift), groups=layer.groups)
    const = shift.reshape(1, -1, 1, 1).expand(1, shift.numel(), *shape[2:])
    bias_map = F.conv2d(const, layer.weight.double(), layer.bias.double() if layer.bias is not None else None,
                        layer.stride, layer.padding, layer.dilation, layer.groups)
    conv = conv_from(w, torch.zeros_like(b), like=layer)
    return nn.Sequential(conv, ConstantAffine(None, bias_map[0].to(layer.weight.dtype)))


def _fold_bn_into_prev(layer: nn.Module, bn: nn.Module) -> nn.Module:
    scale, shift = bn_scale_shift(bn)
    w, b = wm.fold_affine_after(layer.weight, layer.bias, scale, shift)
    return linear_from(w, b, like=layer) if isinstance(layer, nn.Linear) else conv_from(w, b, like=layer)


LINEAR_LAYERS = (nn.Linear, nn.Conv2d)


def fold_sequential(seq: nn.Sequential, ctx: FoldContext) -> nn.Sequential:
    """Fuse (Linear/Conv, BN) and (BN, Linear/Conv) neighbours, and ResMLP Affines next to a Linear (both act
    on the last axis); other children are left for the driver."""
    children = list(seq.children())
    out: list[nn.Module] = []
    i = 0
    while i < len(children):
        cur = children[i]
        nxt = children[i + 1] if i + 1 < len(children) else None
        if (isinstance(cur, LINEAR_LAYERS) and isinstance(nxt, BATCH_NORMS)) or (
            isinstance(cur, nn.Linear) and isinstance(nxt, Affine)
        ):
            out.append(_fold_bn_into_prev(cur, nxt))
            i += 2
        elif isinstance(cur, Affine) and isinstance(nxt, nn.Linear):
            out.append(_fold_bn_into_next(cur, nxt, ctx))
            i += 2
        elif isinstance(cur, BATCH_NORMS) and isinstance(nxt, LINEAR_LAYERS) and (
            fused := _fold_bn_into_next(cur, nxt, ctx.at(f"{ctx.path}.{i}"))
        ) is not None:
            out.append(fused)
            i += 2
        else:
            out.append(cur)
            i += 1
    return nn.Sequential(*out)
