"""``fold(model)``: an eval-mode copy with every normalisation and constant scale folded into affine maps.

The driver is generic: it walks the module tree and replaces each module whose type has a registered rule
(see :mod:`polyfhe.folding.rules`); ``nn.Sequential`` containers additionally get a pass that fuses adjacent
(Linear/Conv, norm) pairs. Modules without a rule are kept and recursed into, so a user's own polynomial
module (``x * x``) survives untouched and is judged by the analyzer after export. Norms whose statistics depend
on the data (LayerNorm, GroupNorm, InstanceNorm, ...) make folding fail, naming the module.
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn

from polyfhe.folding.rules import FOLD_RULES, FoldContext, FoldError, check_refused, fold_sequential

log = logging.getLogger(__name__)


def _record_input_shapes(model: nn.Module, example: torch.Tensor) -> dict[int, tuple[int, ...]]:
    shapes: dict[int, tuple[int, ...]] = {}

    def remember(module: nn.Module, args: tuple) -> None:  # a pre-hook must return None to keep the args
        if args and torch.is_tensor(args[0]):
            shapes.setdefault(id(module), tuple(args[0].shape))

    hooks = [m.register_forward_pre_hook(remember) for m in model.modules()]
    try:
        with torch.no_grad():
            model(example)
    finally:
        for h in hooks:
            h.remove()
    return shapes


def _rewrite(module: nn.Module, ctx: FoldContext, path: str) -> nn.Module:
    rule = FOLD_RULES.get(type(module))
    if rule is not None:
        return rule(module, ctx.at(path))
    if isinstance(module, nn.Sequential):
        module = fold_sequential(module, ctx.at(path))
    for name, child in list(module.named_children()):
        child_path = f"{path}.{name}" if path else name
        setattr(module, name, _rewrite(child, ctx, child_path))
    return module


def fold(model: nn.Module, input_shape: tuple[int, ...] | None = None) -> nn.Module:
    """Return a folded eval-mode copy of ``model``; the caller's model is not modified.

    ``input_shape`` (C, H, W) defaults to ``model.input_shape``; it is needed to fold a BatchNorm into a
    zero-padded convolution exactly (the border sees the padding, not the shifted value).
    """
    check_refused(model, getattr(model, "model_name", None))
    folded = copy.deepcopy(model).eval()
    shape = input_shape or getattr(model, "input_shape", None)
    shapes: dict[int, tuple[int, ...]] = {}
    if shape is not None:
        param = next(folded.parameters(), None)
        dtype = param.dtype if param is not None else torch.float32
        shapes = _record_input_shapes(folded, torch.zeros((1, *shape), dtype=dtype))
    ctx = FoldContext(input_shapes=shapes)
    with torch.no_grad():  # weight math only: folded tensors must be leaves (deep-copyable, no autograd history)
        folded = _rewrite(folded, ctx, "")
    for attr in ("input_shape", "num_classes", "model_name"):
        if hasattr(model, attr) and not hasattr(folded, attr):
            setattr(folded, attr, getattr(model, attr))
    folded.eval()
    for p in folded.parameters():
        p.requires_grad_(False)
    log.info("folded %s into %s", type(model).__name__, type(folded).__name__)
    return folded


__all__ = ["FoldError", "fold"]
