"""The zoo table behind ``polyfhe models``: parameters, MACs at the model's resolution, norm, spec depth numbers.

Models are built on PyTorch's ``meta`` device, so counting parameters and MACs of the 224x224 ImageNet models
allocates no weights and takes about a second per model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from polyfhe.models.registry import create_model, list_models, model_entry


@dataclass(frozen=True)
class ZooRow:
    """One line of the zoo table; ``degree``/``levels`` come from the analyzer when it has run."""

    name: str
    family: str
    norm: str
    params: int
    macs: int | None
    input_shape: tuple[int, int, int]
    num_classes: int
    spec_params: int | None
    spec_ct_depth: int | None
    spec_levels: int | None
    degree: int | None = None
    mult_depth: int | None = None
    levels: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ZooRow":
        return cls(**{**data, "input_shape": tuple(data["input_shape"])})


def count_parameters(model: nn.Module) -> int:
    """Trainable and frozen parameters, each shared tensor counted once (as ``sum(p.numel())`` does)."""
    return sum(p.numel() for p in model.parameters())


def count_macs(model: nn.Module, input_shape: tuple[int, ...]) -> int:
    """Multiply-accumulates of one forward pass (matmuls and convolutions; elementwise ops are not counted)."""
    device = next(model.parameters()).device
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.eval()(torch.empty((1, *input_shape), device=device))
    return counter.get_total_flops() // 2


def zoo_row(name: str, with_macs: bool = True, **overrides: Any) -> ZooRow:
    """Build ``name`` on the meta device and describe it."""
    entry = model_entry(name)
    with torch.device("meta"):
        model = create_model(name, **overrides)
    return ZooRow(
        name=name,
        family=entry.family,
        norm=entry.norm,
        params=count_parameters(model),
        macs=count_macs(model, model.input_shape) if with_macs else None,
        input_shape=tuple(model.input_shape),
        num_classes=model.num_classes,
        spec_params=entry.spec_params if not overrides else None,
        spec_ct_depth=entry.spec_ct_depth,
        spec_levels=entry.spec_levels,
    )


def zoo_rows(pattern: str = "*", with_macs: bool = True) -> list[ZooRow]:
    """Rows for every registered model matching ``pattern``."""
    return [zoo_row(name, with_macs) for name in list_models(pattern)]
