"""Polynomial ResMLP (Touvron et al. 2021, "ResMLP: Feedforward networks for image classification"), issue 17.

ResMLP's residual blocks without normalisation statistics: the Affine operator ``Aff(x) = alpha * x + beta``
(per channel) is the pre-normalisation, a Linear over the token axis mixes patches, and the channel MLP's GELU
is replaced by the Hadamard product of two projections, so every block is a polynomial that squares the degree:

    x = x + ls1 * CrossPatch(Aff1(x))                       CrossPatch: Linear(N -> N) on the token axis
    x = x + ls2 * W3((W1 Aff2(x) + b1) * (W2 Aff2(x) + b2)) + b3

Layer-scales ``ls1``/``ls2`` are per-channel vectors initialised small (0.1 up to depth 18, 1e-5 up to 24, 1e-6
beyond, as in ResMLP). A final Affine, the mean over tokens and a Linear head follow. The network degree is
``2 ** depth``. Every Affine and layer-scale folds into the neighbouring linear maps (``polyfhe.folding.resmlp``).

Choices of ours: ``b2`` starts at 1 and ``W2`` small, so each Hadamard product starts close to ``W1 z + b1``
(a near-linear block: the polynomial's degree grows only as training needs it); the head starts at zero.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from polyfhe.models.configs import build_from_config, check_image_batch, check_positive_ints
from polyfhe.models.layers.affine import Affine
from polyfhe.models.registry import register_model

__all__ = ["CrossPatch", "PolyChannelMLP", "ResMLP", "ResMLPBlock", "ResMLPConfig", "build_resmlp",
           "default_layer_scale"]


def default_layer_scale(depth: int) -> float:
    """ResMLP's (and CaiT's) LayerScale initialisation by depth."""
    return 0.1 if depth <= 18 else (1e-5 if depth <= 24 else 1e-6)


@dataclass(frozen=True)
class ResMLPConfig:
    """One polynomial ResMLP: ``(img_size / patch_size) ** 2`` tokens of ``dim`` channels, ``depth`` blocks.

    ``layer_scale_init`` None means :func:`default_layer_scale` of ``depth``.
    """

    dim: int = 80
    depth: int = 2
    expansion: int = 2
    patch_size: int = 4
    img_size: int = 28
    in_chans: int = 1
    num_classes: int = 10
    layer_scale_init: float | None = None

    def __post_init__(self) -> None:
        check_positive_ints("ResMLPConfig", {name: getattr(self, name) for name in (
            "dim", "depth", "expansion", "patch_size", "img_size", "in_chans", "num_classes")})
        if self.img_size % self.patch_size:
            raise ValueError(
                f"img_size {self.img_size} is not divisible by patch_size {self.patch_size}: the patch embedding "
                f"needs non-overlapping patches covering the image (accepted: a patch_size dividing img_size)"
            )
        if self.layer_scale_init is not None and not self.layer_scale_init > 0:
            raise ValueError(f"layer_scale_init must be > 0 or None (depth default), got {self.layer_scale_init!r}")

    @property
    def num_tokens(self) -> int:
        return (self.img_size // self.patch_size) ** 2

    @property
    def hidden(self) -> int:
        return self.expansion * self.dim

    @property
    def degree(self) -> int:
        """Polynomial degree of the logits in the input: each block squares it."""
        return 2**self.depth

    @property
    def largest_tensor(self) -> int:
        """Values in the largest per-image activation (what one single-layout ciphertext must hold)."""
        return max(self.in_chans * self.img_size**2, self.num_tokens * self.hidden)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class CrossPatch(nn.Module):
    """A Linear over the token axis of ``(B, N, D)`` tokens, shared by all channels (ResMLP's patch mixing)."""

    def __init__(self, num_tokens: int) -> None:
        super().__init__()
        self.proj = nn.Linear(num_tokens, num_tokens)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.transpose(1, 2)).transpose(1, 2)


class PolyChannelMLP(nn.Module):
    """``W3((W1 z + b1) * (W2 z + b2)) + b3``: the channel MLP with a Hadamard product in place of GELU."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(dim, hidden)
        self.fc3 = nn.Linear(hidden, dim)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.fc1(z) * self.fc2(z))


class ResMLPBlock(nn.Module):
    """Cross-patch and channel-MLP residual sublayers, each with an Affine before and a layer-scale after."""

    def __init__(self, dim: int, num_tokens: int, hidden: int, layer_scale: float) -> None:
        super().__init__()
        self.norm1 = Affine(dim)
        self.cross_patch = CrossPatch(num_tokens)
        self.ls1 = nn.Parameter(torch.full((dim,), float(layer_scale)))
        self.norm2 = Affine(dim)
        self.mlp = PolyChannelMLP(dim, hidden)
        self.ls2 = nn.Parameter(torch.full((dim,), float(layer_scale)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.ls1 * self.cross_patch(self.norm1(x))
        return x + self.ls2 * self.mlp(self.norm2(x))


class ResMLP(nn.Module):
    """Patch embedding to ``(B, N, D)`` tokens, polynomial ResMLP blocks, Affine, mean over tokens, Linear head."""

    def __init__(self, cfg: ResMLPConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.num_classes = cfg.num_classes
        self.input_shape = (cfg.in_chans, cfg.img_size, cfg.img_size)
        ls = cfg.layer_scale_init if cfg.layer_scale_init is not None else default_layer_scale(cfg.depth)
        self.patch_embed = nn.Conv2d(cfg.in_chans, cfg.dim, cfg.patch_size, stride=cfg.patch_size)
        self.blocks = nn.Sequential(
            *(ResMLPBlock(cfg.dim, cfg.num_tokens, cfg.hidden, ls) for _ in range(cfg.depth))
        )
        self.norm = Affine(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        for block in self.blocks:
            nn.init.normal_(block.mlp.fc2.weight, std=0.02)
            nn.init.ones_(block.mlp.fc2.bias)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens ``(B, N, D)`` after the last block (before the final Affine)."""
        check_image_batch(self, x)
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        return self.blocks(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.forward_features(x)).mean(dim=1))


RESMLP_POLY = ResMLPConfig()


def build_resmlp(base: ResMLPConfig = RESMLP_POLY, **overrides: Any) -> ResMLP:
    """Build a ResMLP from ``base`` with any :class:`ResMLPConfig` field overridden."""
    return build_from_config(ResMLP, base, overrides, "ResMLP")


@register_model(
    "resmlp_poly", family="resmlp", norm="none",
    default_cfg={"num_classes": 10, "img_size": 28, "in_chans": 1},
)
def resmlp_poly(**overrides: Any) -> ResMLP:
    """Polynomial ResMLP: patch 4 (49 tokens at 28x28), dim 80, depth 2, expansion 2, degree 4."""
    return build_resmlp(RESMLP_POLY, **overrides)
