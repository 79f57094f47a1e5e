"""The zoo table behind ``polyfhe models``: parameters, MACs at the model's resolution, norm, spec depth numbers.

Models are built on PyTorch's ``meta`` device, so counting parameters and MACs of the 224x224 ImageNet models
allocates no weights and takes about a second per model.
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from tqdm import tqdm

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
    def from_dict(cls, data: dict[str, Any]) -> ZooRow:
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


# Smallest convenient resolution per model family for structural analysis: degree, ct x ct depth and levels
# depend on the graph's operators, not on its spatial size.
_ANALYSIS_IMG_SIZE = {"monet_t_single": 28, "cpolynext_lr": 16}


def analysis_img_size(name: str) -> int:
    base = name.removesuffix("_bn")
    return _ANALYSIS_IMG_SIZE.get(base, min(32, int(model_entry(name).default_cfg["img_size"])))


def with_analysis(row: ZooRow) -> ZooRow:
    """Fill degree, ct x ct depth and levels from the analyzer (LN variants are not polynomial: left empty)."""
    from polyfhe.analysis import analyze
    from polyfhe.exporters.onnx import export_zoo_model_for_check

    if row.norm == "ln":
        return row
    with tempfile.TemporaryDirectory(prefix="polyfhe-zoo-") as tmp:
        report = analyze(export_zoo_model_for_check(row.name, analysis_img_size(row.name), tmp))
    return replace(row, degree=report.degree, mult_depth=report.mult_depth, levels=report.levels)


def zoo_rows(pattern: str = "*", with_macs: bool = True, with_analyzer: bool = False) -> list[ZooRow]:
    """Rows for every registered model matching ``pattern``, optionally with the analyzer's numbers."""
    names = list_models(pattern)
    rows = [zoo_row(name, with_macs) for name in names]
    if with_analyzer:
        rows = [with_analysis(r) for r in tqdm(rows, desc="analyzing zoo", unit="model", leave=False, disable=None)]
    return rows
