"""MONet (Multilinear Operator Networks, ICLR 2024): multi-stage T/S, single-stage T, and low-resolution configs.

Built from ``shared/specs/models.md`` section 1. Choices where the paper and code disagree ([gap] in the spec):
- per-stage block counts follow the code (T: 4+8+12+10 = 34, S: 4+6+12+14 = 36), not the paper's "32";
- the spatial shift is the intended out-of-place one (spec 1.5), not the reference's in-place bug;
- init follows the code (spec 1.7), not the paper's Xavier claim;
- BN variant: all three LayerNorms of a Poly-Block become per-channel BatchNorms, with separate instances for
  the two block-norm sites (spec 1.8), so a BN block has 2*dim more parameters than an LN block;
- single-stage T (spec 1.9, not in the reference code): width 192, 32 blocks, expansion 3, shrink 4,
  patch embedding 7x7/7 then 2x2/2 (16x16 tokens at 224), 14,113,256 parameters with LN and alpha.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import nn

from polyfhe.models.configs import build_from_config, check_image_batch
from polyfhe.models.layers.mu_layer import PolyBlock, lecun_trunc_normal_
from polyfhe.models.registry import register_model


@dataclass(frozen=True)
class MONetConfig:
    """Architecture of one MONet; stages are separated by 3x3 stride-2 downsampling convolutions."""

    dims: tuple[int, ...] = (64, 128, 192, 192)
    depths: tuple[int, ...] = (4, 8, 12, 10)
    expansion: int = 3
    shrink: int = 8  # hidden / low-rank width of the Mu-Layer's second branch
    patch_size: int = 2  # first patch-embedding conv: p x p, stride p
    pyramid: bool = True  # second patch-embedding conv 2x2 stride 2 (the code's pyramid level 2)
    img_size: int = 224
    in_chans: int = 3
    num_classes: int = 1000
    norm: str = "ln"
    drop_path_rate: float = 0.0

    def __post_init__(self) -> None:
        if len(self.dims) != len(self.depths) or not self.dims:
            raise ValueError(f"dims {self.dims} and depths {self.depths} must be non-empty and of equal length")
        if self.norm not in ("ln", "bn"):
            raise ValueError(f"norm must be 'ln' or 'bn', got {self.norm!r}")
        if self.img_size % self.embed_stride:
            raise ValueError(
                f"img_size {self.img_size} is not divisible by the patch-embedding stride {self.embed_stride} "
                f"(patch_size={self.patch_size}, pyramid={self.pyramid})"
            )

    @property
    def embed_stride(self) -> int:
        return self.patch_size * (2 if self.pyramid else 1)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class MONet(nn.Module):
    """Pyramid patch embedding, stages of Poly-Blocks (channels-last), mean pool, linear head (no head norm)."""

    def __init__(self, cfg: MONetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.num_classes = cfg.num_classes
        self.input_shape = (cfg.in_chans, cfg.img_size, cfg.img_size)
        d0 = cfg.dims[0]
        embed: list[nn.Module] = [nn.Conv2d(cfg.in_chans, d0, cfg.patch_size, stride=cfg.patch_size)]
        if cfg.pyramid:
            embed.append(nn.Conv2d(d0, d0, 2, stride=2))
        self.patch_embed = nn.Sequential(*embed)

        rates = torch.linspace(0, cfg.drop_path_rate, sum(cfg.depths)).tolist() if cfg.drop_path_rate else None
        stages: list[nn.Module] = []
        downsamples: list[nn.Module] = []
        k = 0
        for i, (dim, depth) in enumerate(zip(cfg.dims, cfg.depths)):
            blocks = []
            for _ in range(depth):
                blocks.append(PolyBlock(dim, cfg.expansion, cfg.shrink, cfg.norm, rates[k] if rates else 0.0))
                k += 1
            stages.append(nn.Sequential(*blocks))
            if i + 1 < len(cfg.dims):
                downsamples.append(nn.Conv2d(dim, cfg.dims[i + 1], 3, stride=2, padding=1))
        self.stages = nn.ModuleList(stages)
        self.downsamples = nn.ModuleList(downsamples)
        self.head = nn.Linear(cfg.dims[-1], cfg.num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                lecun_trunc_normal_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens after the last stage, channels-first ``(B, C, h, w)``."""
        check_image_batch(self, x)
        x = self.patch_embed(x)
        for i, stage in enumerate(self.stages):
            x = stage(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
            if i < len(self.downsamples):
                x = self.downsamples[i](x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.forward_features(x).mean(dim=(2, 3)))


MULTI_STAGE_T = MONetConfig()
MULTI_STAGE_S = MONetConfig(dims=(128, 192, 256, 384), depths=(4, 6, 12, 14))
SINGLE_STAGE_T = MONetConfig(dims=(192,), depths=(32,), shrink=4, patch_size=7)
LOW_RES = MONetConfig(
    dims=(64,), depths=(2,), shrink=8, patch_size=2, pyramid=True, img_size=28, in_chans=1, num_classes=10
)

_IMAGENET = {"num_classes": 1000, "img_size": 224, "in_chans": 3}


def build_monet(base: MONetConfig, **overrides: Any) -> MONet:
    """Build a MONet from ``base`` with any :class:`MONetConfig` field overridden (lists become tuples)."""
    return build_from_config(MONet, base, overrides, "MONet")


def _register(name: str, base: MONetConfig, norm: str, default_cfg: dict[str, Any], **spec: Any) -> None:
    def builder(**overrides: Any) -> MONet:
        return build_monet(replace(base, norm=norm), **overrides)

    builder.__doc__ = f"MONet {name}: dims {base.dims}, depths {base.depths}, norm {norm}."
    register_model(name, family="monet", norm=norm, default_cfg=default_cfg, **spec)(builder)


_register("monet_t", MULTI_STAGE_T, "ln", _IMAGENET, spec_params=10_339_436, spec_ct_depth=68)
_register("monet_t_bn", MULTI_STAGE_T, "bn", _IMAGENET, spec_ct_depth=68, spec_levels=278)
_register("monet_s", MULTI_STAGE_S, "ln", _IMAGENET, spec_params=32_880_688, spec_ct_depth=72)
_register("monet_s_bn", MULTI_STAGE_S, "bn", _IMAGENET, spec_ct_depth=72)
_register("monet_t_single", SINGLE_STAGE_T, "ln", _IMAGENET, spec_params=14_113_256)
_register("monet_t_single_bn", SINGLE_STAGE_T, "bn", _IMAGENET)
_LOW_RES_CFG = {"num_classes": 10, "img_size": 28, "in_chans": 1}
_register("monet_lr", LOW_RES, "ln", _LOW_RES_CFG)
_register("monet_lr_bn", LOW_RES, "bn", _LOW_RES_CFG)

__all__ = ["MONet", "MONetConfig", "build_monet"]
