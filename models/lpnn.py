"""LPNN (Ladder Polynomial Neural Networks, Liu, Gu and Hu, arXiv 2106.13834): feedforward product activations.

Hidden layer ``l`` computes ``h_l = drop(BN((W_l h_{l-1} + b_l) * (V_l x + c_l)))`` with ``h_0 = x`` the flattened
image, and a linear head reads ``h_L``. Only the paper's abstract and introduction were retrievable here (the
search corpora hold no full text), so this follows them and issue 17's description, and says where we chose:

- Product activation (paper): the linear map of the previous layer times a linear map of the network input, so the
  polynomial order rises by exactly one per hidden layer. The biases ``b_l``, ``c_l`` keep every lower order in
  the polynomial (our reading; the paper's exact bias/augmentation convention was not checked).
- Order: counting the input as order 1, ``L`` hidden layers give order ``L + 1`` (the head is linear);
  :func:`lpnn_degree` computes it from the config and the tests compare it with the ONNX analyzer.
- BatchNorm and dropout (paper: usable because the network is feedforward): BN over the product's units, then
  dropout (order from issue 17). At inference BN is affine and folds exactly (issue 17 cites the paper's eq. 14
  for the product form): its scale goes into the rows of ``W_l`` and ``b_l``, its shift into the bias of every
  map that reads ``h_l`` (``polyfhe/folding/lpnn.py``).
- Second factor from a skip (our option, ``factor_source="skip"``): layer ``l >= 2`` multiplies by ``V_l h_{l-2}``
  instead of ``V_l x`` (layer 1 uses ``x``). Orders then add like Fibonacci numbers (2, 3, 5, 8, ...), not +1.
- Initialisation (our choice): PyTorch's default uniform fan-in init for ``W``, ``V`` and the head; the BN after
  each product takes care of the product's scale.
- ``lpnn_bn`` (our choice): 3 hidden layers of 256 units, dropout 0.1 (order 4, 939,530 parameters). The paper
  reports 0.117 test error on Fashion-MNIST (per issue 17); its widths and depth could not be checked here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from polyfhe.models.configs import build_from_config, check_image_batch
from polyfhe.models.layers.ladder import LADDER_NORMS, LadderLayer
from polyfhe.models.registry import register_model

FACTOR_SOURCES = ("input", "skip")


@dataclass(frozen=True)
class LPNNConfig:
    """One LPNN; ``widths`` has one entry per hidden ladder layer (``depth = len(widths)``)."""

    widths: tuple[int, ...] = (256, 256, 256)
    drop_rate: float = 0.1
    factor_source: str = "input"  # "input": V_l x (the paper); "skip": V_l h_{l-2} for l >= 2
    norm: str = "bn"
    img_size: int = 28
    in_chans: int = 1
    num_classes: int = 10

    def __post_init__(self) -> None:
        if not self.widths or any(not isinstance(w, int) or w < 1 for w in self.widths):
            raise ValueError(f"widths must be a non-empty tuple of positive ints (one per hidden layer), "
                             f"got {self.widths!r}")
        if self.factor_source not in FACTOR_SOURCES:
            raise ValueError(f"factor_source must be one of {FACTOR_SOURCES}, got {self.factor_source!r}")
        if self.norm not in LADDER_NORMS:
            raise ValueError(f"norm must be one of {LADDER_NORMS}, got {self.norm!r}")
        if not 0.0 <= self.drop_rate < 1.0:
            raise ValueError(f"drop_rate must be in [0, 1), got {self.drop_rate}")
        if min(self.img_size, self.in_chans, self.num_classes) < 1:
            raise ValueError(f"img_size, in_chans and num_classes must be positive, got {self.img_size}, "
                             f"{self.in_chans}, {self.num_classes}")

    @property
    def depth(self) -> int:
        return len(self.widths)

    @property
    def in_features(self) -> int:
        return self.in_chans * self.img_size * self.img_size

    def sources(self) -> tuple[int, ...]:
        """For hidden layer ``l = 1..L``, the index ``k`` of ``h_k`` its second factor reads (``h_0 = x``)."""
        if self.factor_source == "input":
            return (0,) * self.depth
        return tuple(max(0, l - 2) for l in range(1, self.depth + 1))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def lpnn_degree(cfg: LPNNConfig) -> int:
    """Polynomial order of the network: ``deg h_0 = 1``, ``deg h_l = deg h_{l-1} + deg h_{source(l)}``."""
    degrees = [1]
    for l, src in enumerate(cfg.sources(), start=1):
        degrees.append(degrees[l - 1] + degrees[src])
    return degrees[-1]


class LPNN(nn.Module):
    """Flatten, ``L`` ladder layers, linear head."""

    def __init__(self, cfg: LPNNConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.num_classes = cfg.num_classes
        self.input_shape = (cfg.in_chans, cfg.img_size, cfg.img_size)
        self.sources = cfg.sources()
        sizes = (cfg.in_features, *cfg.widths)
        self.layers = nn.ModuleList(
            LadderLayer(sizes[l - 1], sizes[src], sizes[l], cfg.norm, cfg.drop_rate)
            for l, src in enumerate(self.sources, start=1)
        )
        self.head = nn.Linear(cfg.widths[-1], cfg.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_image_batch(self, x)
        hs = [x.flatten(1)]
        for layer, src in zip(self.layers, self.sources):
            hs.append(layer(hs[-1], hs[src]))
        return self.head(hs[-1])


LPNN_BN = LPNNConfig()


def build_lpnn(base: LPNNConfig = LPNN_BN, **overrides: Any) -> LPNN:
    """An LPNN from ``base`` with :class:`LPNNConfig` fields overridden; ``depth``/``width`` are shorthands for
    ``widths=(width,) * depth`` (either one alone keeps the other from ``base``)."""
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()}
    depth, width = fields.pop("depth", None), fields.pop("width", None)
    if (depth is not None or width is not None) and "widths" in fields:
        raise ValueError("give either widths=(...) or depth/width, not both")
    if depth is not None or width is not None:
        depth = base.depth if depth is None else depth
        width = base.widths[-1] if width is None else width
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be a positive int, got {depth!r}")
        fields["widths"] = (width,) * depth
    return build_from_config(LPNN, base, fields, "LPNN", also_accepted=("depth", "width"))


def _build_lpnn_bn(**overrides: Any) -> LPNN:
    """LPNN-BN: 3 ladder layers x 256 (order 4), BN + dropout 0.1, 28x28x1 inputs."""
    return build_lpnn(LPNN_BN, **overrides)


register_model(
    "lpnn_bn", family="lpnn", norm="bn", default_cfg={"num_classes": 10, "img_size": 28, "in_chans": 1},
    description="LPNN-BN: 3 ladder (product-activation) layers x 256 on flattened 28x28x1, order 4",
)(_build_lpnn_bn)

__all__ = ["FACTOR_SOURCES", "LPNN", "LPNN_BN", "LPNNConfig", "build_lpnn", "lpnn_degree"]
