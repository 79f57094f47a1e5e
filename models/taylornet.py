"""TaylorNet, R-TaylorNet and Taylor-Mixer (Zhao et al., "TaylorNet: A Taylor-Driven Generic Neural
Architecture", ICLR 2023 submission), issue 17.

- ``taylornet``: flatten -> Taylor layers (:class:`~polyfhe.models.layers.taylor.TaylorLayer`) -> Linear head.
  No activation and no normalisation: L Taylor layers of order K give a polynomial of degree K**L.
- ``rtaylornet``: the same with reducible Taylor layers (shared symmetric factor, distinct monomials only).
- ``taylor_mixer``: MLP-Mixer with each MLP + GELU replaced by one Taylor layer, as the paper's Taylor-Mixer:
  patch embedding -> blocks ``x = x + TokenTaylor(Aff1(x))``, ``x = x + ChannelTaylor(Aff2(x))`` -> Affine ->
  mean over tokens -> Linear head. The pre-norm is ResMLP's Affine (``alpha * x + beta``, no statistics) in place
  of the Mixer's LayerNorm, which is not polynomial. Degree ``K ** (2 * depth)``.

No fold rule is needed: Taylor layers hold constant weights only, and the Mixer's Affines become exact
``ConstantAffine`` maps by the generic rule (they cannot enter a token-mixing layer shared by all channels; the
analyzer and compiler merge them with the adjacent projection anyway: 9 levels with or without them).

Choices of ours (not fixed by the paper): the Linear heads keep torch's default initialisation (``init`` only
selects the Taylor layers' scheme); the Taylor layers expand around 0; the Mixer has no layer-scale.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from polyfhe.models.configs import build_from_config, check_image_batch, check_positive_ints
from polyfhe.models.layers.affine import Affine
from polyfhe.models.layers.taylor import TAYLOR_INITS, TaylorLayer
from polyfhe.models.registry import register_model

__all__ = ["TaylorMixer", "TaylorMixerBlock", "TaylorMixerConfig", "TaylorNet", "TaylorNetConfig",
           "build_taylor_mixer", "build_taylornet"]


def _check_positive(cls: str, obj: Any, names: tuple[str, ...]) -> None:
    check_positive_ints(cls, {name: getattr(obj, name) for name in names})


def _check_init(cls: str, init: str) -> None:
    if init not in TAYLOR_INITS:
        raise ValueError(f"{cls}.init must be one of {', '.join(map(repr, TAYLOR_INITS))}, got {init!r}")


@dataclass(frozen=True)
class TaylorNetConfig:
    """An MLP of Taylor layers on the flattened image: widths ``hidden_dims``, each of ``order`` and ``rank``."""

    hidden_dims: tuple[int, ...] = (64, 64)
    order: int = 2
    rank: int = 16
    reducible: bool = False
    init: str = "taylor"
    img_size: int = 28
    in_chans: int = 1
    num_classes: int = 10

    def __post_init__(self) -> None:
        _check_positive("TaylorNetConfig", self, ("order", "rank", "img_size", "in_chans", "num_classes"))
        if not self.hidden_dims or any(not isinstance(h, int) or isinstance(h, bool) or h < 1
                                       for h in self.hidden_dims):
            raise ValueError(f"TaylorNetConfig.hidden_dims must be a non-empty tuple of positive integers, "
                             f"got {self.hidden_dims!r}")
        _check_init("TaylorNetConfig", self.init)

    @property
    def in_features(self) -> int:
        return self.in_chans * self.img_size**2

    @property
    def degree(self) -> int:
        """Polynomial degree of the logits in the input: each Taylor layer raises it to the ``order``-th power."""
        return self.order ** len(self.hidden_dims)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class TaylorNet(nn.Module):
    """Flatten, ``len(hidden_dims)`` Taylor layers, Linear head."""

    def __init__(self, cfg: TaylorNetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.num_classes = cfg.num_classes
        self.input_shape = (cfg.in_chans, cfg.img_size, cfg.img_size)
        widths = (cfg.in_features, *cfg.hidden_dims)
        self.layers = nn.Sequential(*(
            TaylorLayer(a, b, cfg.order, cfg.rank, reducible=cfg.reducible, init=cfg.init)
            for a, b in itertools.pairwise(widths)
        ))
        self.head = nn.Linear(cfg.hidden_dims[-1], cfg.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_image_batch(self, x)
        return self.head(self.layers(x.flatten(1)))


@dataclass(frozen=True)
class TaylorMixerConfig:
    """Taylor-Mixer: ``(img_size / patch_size) ** 2`` tokens of ``dim`` channels, ``depth`` Mixer blocks."""

    dim: int = 32
    depth: int = 2
    patch_size: int = 4
    order: int = 2
    token_rank: int = 8
    channel_rank: int = 8
    reducible: bool = False
    init: str = "taylor"
    img_size: int = 28
    in_chans: int = 1
    num_classes: int = 10

    def __post_init__(self) -> None:
        _check_positive("TaylorMixerConfig", self, ("dim", "depth", "patch_size", "order", "token_rank",
                                                    "channel_rank", "img_size", "in_chans", "num_classes"))
        _check_init("TaylorMixerConfig", self.init)
        if self.img_size % self.patch_size:
            raise ValueError(
                f"img_size {self.img_size} is not divisible by patch_size {self.patch_size}: the patch embedding "
                f"needs non-overlapping patches covering the image (accepted: a patch_size dividing img_size)"
            )

    @property
    def num_tokens(self) -> int:
        return (self.img_size // self.patch_size) ** 2

    @property
    def degree(self) -> int:
        """Each block holds two Taylor layers in sequence (the residuals keep the linear part)."""
        return self.order ** (2 * self.depth)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class TaylorMixerBlock(nn.Module):
    """Token mixing (a Taylor layer over the token axis) and channel mixing, each behind an Affine pre-norm."""

    def __init__(self, cfg: TaylorMixerConfig) -> None:
        super().__init__()
        n, d = cfg.num_tokens, cfg.dim
        self.norm1 = Affine(d)
        self.token_mix = TaylorLayer(n, n, cfg.order, cfg.token_rank, reducible=cfg.reducible, init=cfg.init)
        self.norm2 = Affine(d)
        self.channel_mix = TaylorLayer(d, d, cfg.order, cfg.channel_rank, reducible=cfg.reducible, init=cfg.init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.token_mix(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mix(self.norm2(x))


class TaylorMixer(nn.Module):
    """Patch embedding to ``(B, N, D)`` tokens, Taylor-Mixer blocks, Affine, mean over tokens, Linear head."""

    def __init__(self, cfg: TaylorMixerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.num_classes = cfg.num_classes
        self.input_shape = (cfg.in_chans, cfg.img_size, cfg.img_size)
        self.patch_embed = nn.Conv2d(cfg.in_chans, cfg.dim, cfg.patch_size, stride=cfg.patch_size)
        self.blocks = nn.Sequential(*(TaylorMixerBlock(cfg) for _ in range(cfg.depth)))
        self.norm = Affine(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_image_batch(self, x)
        x = self.blocks(self.patch_embed(x).flatten(2).transpose(1, 2))
        return self.head(self.norm(x).mean(dim=1))


TAYLORNET = TaylorNetConfig()
RTAYLORNET = TaylorNetConfig(reducible=True)
TAYLOR_MIXER = TaylorMixerConfig()


def build_taylornet(base: TaylorNetConfig = TAYLORNET, **overrides: Any) -> TaylorNet:
    """Build a TaylorNet from ``base`` with any :class:`TaylorNetConfig` field overridden."""
    return build_from_config(TaylorNet, base, overrides, "TaylorNet")


def build_taylor_mixer(base: TaylorMixerConfig = TAYLOR_MIXER, **overrides: Any) -> TaylorMixer:
    """Build a Taylor-Mixer from ``base`` with any :class:`TaylorMixerConfig` field overridden."""
    return build_from_config(TaylorMixer, base, overrides, "TaylorMixer")


_SMALL = {"num_classes": 10, "img_size": 28, "in_chans": 1}


@register_model("taylornet", family="taylornet", norm="none", default_cfg=_SMALL)
def taylornet(**overrides: Any) -> TaylorNet:
    """TaylorNet: two Taylor layers (784 -> 64 -> 64, order 2, rank 16) and a Linear head, degree 4."""
    return build_taylornet(TAYLORNET, **overrides)


@register_model("rtaylornet", family="taylornet", norm="none", default_cfg=_SMALL)
def rtaylornet(**overrides: Any) -> TaylorNet:
    """R-TaylorNet: TaylorNet with reducible Taylor layers (shared symmetric factors), degree 4."""
    return build_taylornet(RTAYLORNET, **overrides)


@register_model("taylor_mixer", family="taylornet", norm="none", default_cfg=_SMALL)
def taylor_mixer(**overrides: Any) -> TaylorMixer:
    """Taylor-Mixer: patch 4 (49 tokens), dim 32, depth 2, order-2 Taylor token/channel mixing, degree 16."""
    return build_taylor_mixer(TAYLOR_MIXER, **overrides)
