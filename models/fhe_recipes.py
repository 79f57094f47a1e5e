"""FHE-sized recipes: small BN models for 28x28x1 images that fit leveled CKKS at N=16384.

The CKKS compiler packs one flattened image per ciphertext, so every intermediate tensor must fit the 8192
slots of N=16384, and the folded graph should need at most 11 levels (ckks.md 1.3: N=16384 at a 30-bit
scale). The recipes reduce 28x28 to a 7x7 token grid in their first (linear) layer: 49 tokens leave room
for 128-160 channels, while 196 tokens would cap the width near 40 (MONet) or 10 (PolyNeXt's head).

* ``monet_fhe_bn``: MONet-BN, patch 2 + pyramid 2x2 (one 4x4/4 conv after folding), 2 Poly-Blocks of width
  128 with expansion 1 and shrink 4 (widest tensor 7*7*128 = 6272): degree 16, ct x ct depth 4, 9 levels.
  Expansion 1 instead of 3: at equal slots, a wider block beat a narrower one with a 3x second Mu-Layer.
* ``cpolynext_fhe_bn``: one CPolyNeXt-BN cell on the ImageNet stem (7x7 stride 4 -> 7x7) with 40 channels
  (PolyHead's 4C = 160 channels give the widest tensor, 7840), 2 stacks, PolyConv hidden 3C, PolyMLP 4C:
  degree 32, ct x ct depth 5, 11 levels.
* ``apolynext_fhe_bn``: the same stem and head around one APolyNeXt-BN cell whose mixer is PolyAttn: 40
  channels (one head, attention width 32, scores 49x49 = 2401 per image), 1 stack (PolyAttn + PolyMLP 4C):
  degree 36, ct x ct depth 6 (PolyAttn alone is 4: Q K^T, two squarings, A V), 11 levels. A second stack
  needs 19 levels (N=32768), a third 27 (bootstrapping).

The first two reached >= 90% on Fashion-MNIST (``bench/levels_vs_accuracy.py``, 25 epochs, see
docs/fhe-recipes.md). All are plain :class:`MONet` / :class:`PolyNeXt` instances, so ``fold()`` and the ONNX
export apply unchanged. ``img_size``, ``in_chans`` and ``num_classes`` can be overridden (``img_size=8`` for
scikit-learn's digits gives 2x2 tokens), as can the MONet config fields and the cells' ``channels``,
``stacks``, ``exp_mlp`` (and CPolyNeXt's ``exp_conv``).
"""

from __future__ import annotations

from typing import Any

from polyfhe.models.monet import MONet, MONetConfig, build_monet
from polyfhe.models.polynext import ARCHS, PolyNeXt, PolyNeXtArch, StageConfig, build_polynext
from polyfhe.models.registry import register_model

__all__ = ["APOLYNEXT_FHE", "CPOLYNEXT_FHE", "MONET_FHE", "MONET_FHE_DEEP", "apolynext_fhe_arch",
           "build_apolynext_fhe", "build_cpolynext_fhe", "build_monet_fhe", "build_monet_fhe_deep",
           "cpolynext_fhe_arch"]

_FHE_CFG = {"num_classes": 10, "img_size": 28, "in_chans": 1}

MONET_FHE = MONetConfig(
    dims=(128,), depths=(2,), expansion=1, shrink=4, patch_size=2, pyramid=True, img_size=28, in_chans=1,
    num_classes=10, norm="bn",
)
# Six narrower Poly-Blocks (width 64, second Mu-Layer 2x wide): 25 levels, so it runs only with bootstrapping
# (three bootstraps on a 7-level residual chain); every tensor is at most 128 x 64 padded tokens = 8192 slots.
MONET_FHE_DEEP = MONetConfig(
    dims=(64,), depths=(6,), expansion=2, shrink=4, patch_size=2, pyramid=True, img_size=28, in_chans=1,
    num_classes=10, norm="bn",
)
# channels, stacks, exp_conv, exp_mlp of the one-cell CPolyNeXt recipe.
CPOLYNEXT_FHE: dict[str, Any] = {"channels": 40, "stacks": 2, "exp_conv": 3.0, "exp_mlp": 4.0}
# channels, stacks, exp_mlp of the one-cell APolyNeXt recipe (PolyAttn has no expansion: one head of width 32
# per 64 channels).
APOLYNEXT_FHE: dict[str, Any] = {"channels": 40, "stacks": 1, "exp_mlp": 4.0}


def build_monet_fhe(**overrides: Any) -> MONet:
    """MONet-BN with 2 Poly-Blocks of width 128 on a 7x7 token grid (28x28x1 input)."""
    return build_monet(MONET_FHE, **overrides)


def build_monet_fhe_deep(**overrides: Any) -> MONet:
    """MONet-BN with 6 Poly-Blocks of width 64 on a 7x7 token grid: deep enough to need bootstrapping."""
    return build_monet(MONET_FHE_DEEP, **overrides)


def _one_cell_arch(name: str, channels: int, stacks: int, stage: StageConfig) -> PolyNeXtArch:
    """A one-cell PolyNeXt on the ImageNet stem with T-style paired Sigmoid-Scales (both FHE recipes)."""
    if channels < 1 or stacks < 1:
        raise ValueError(f"channels and stacks must be positive, got channels={channels}, stacks={stacks}")
    return PolyNeXtArch(
        name=name, stages=(stage,), stem="imagenet", downsample=("sep3x3", "sep3x3"),
        skip_logits=ARCHS["t"].skip_logits, skip_paired=True,
    )


def cpolynext_fhe_arch(channels: int, stacks: int, exp_conv: float, exp_mlp: float) -> PolyNeXtArch:
    """One CPolyNeXt cell of ``stacks`` (PolyConv, PolyMLP) pairs; T-style paired Sigmoid-Scales."""
    stage = StageConfig(channels, 1, stacks, exp_conv, exp_mlp, coarse_kernel=3, coarse_dilation=2)
    return _one_cell_arch("CPolyNeXt-FHE", channels, stacks, stage)


def build_cpolynext_fhe(**overrides: Any) -> PolyNeXt:
    """One-cell CPolyNeXt-BN: stem 7x7/4 (28 -> 7x7), 40 channels, 2 stacks, PolyHead."""
    arch = cpolynext_fhe_arch(**{k: overrides.pop(k, v) for k, v in CPOLYNEXT_FHE.items()})
    return build_polynext(arch, norm="bn", **overrides)


def apolynext_fhe_arch(channels: int, stacks: int, exp_mlp: float) -> PolyNeXtArch:
    """One APolyNeXt cell of ``stacks`` (PolyAttn, PolyMLP) pairs; T-style paired Sigmoid-Scales."""
    # exp_conv and the coarse kernel are unused by the attention mixer; 1.0 keeps conv_hidden meaningful.
    stage = StageConfig(channels, 1, stacks, 1.0, exp_mlp, mixer="attn")
    return _one_cell_arch("APolyNeXt-FHE", channels, stacks, stage)


def build_apolynext_fhe(**overrides: Any) -> PolyNeXt:
    """One-cell APolyNeXt-BN: stem 7x7/4 (28 -> 7x7), 40 channels, 1 stack of (PolyAttn, PolyMLP), PolyHead."""
    arch = apolynext_fhe_arch(**{k: overrides.pop(k, v) for k, v in APOLYNEXT_FHE.items()})
    return build_polynext(arch, norm="bn", **overrides)


register_model(
    "monet_fhe_bn", family="monet", norm="bn", default_cfg=_FHE_CFG,
    description="MONet-BN for CKKS: 2 Poly-Blocks x 128 on 7x7 tokens (<= 8192 slots, 9 levels)",
)(build_monet_fhe)
register_model(
    "monet_fhe_deep_bn", family="monet", norm="bn", default_cfg=_FHE_CFG,
    description="MONet-BN for bootstrapped CKKS: 6 Poly-Blocks x 64 on 7x7 tokens (25 levels, 3 bootstraps)",
)(build_monet_fhe_deep)
register_model(
    "cpolynext_fhe_bn", family="polynext", norm="bn", default_cfg=_FHE_CFG,
    description="CPolyNeXt-BN for CKKS: one cell x 40 channels, 2 stacks on 7x7 (<= 8192 slots, 11 levels)",
)(build_cpolynext_fhe)
register_model(
    "apolynext_fhe_bn", family="polynext", norm="bn", default_cfg=_FHE_CFG,
    description="APolyNeXt-BN for CKKS: one PolyAttn cell x 40 channels, 1 stack on 7x7 (<= 8192 slots, 11 levels)",
)(build_apolynext_fhe)
