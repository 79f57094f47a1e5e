"""The zoo table behind ``polyfhe models``: parameters, MACs at the model's resolution, norm, spec depth numbers.

Models are built on PyTorch's ``meta`` device, so counting parameters and MACs of the 224x224 ImageNet models
allocates no weights and takes under a second per model. The analyzer's numbers (degree, ct x ct depth, levels)
need each BN variant exported to ONNX, which takes seconds to a minute per model: :func:`zoo_rows` adds them only
when asked (``polyfhe models --analyze``).
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from polyfhe.models.registry import create_model, list_models, model_entry

log = logging.getLogger(__name__)

T = TypeVar("T")
# (items, description, total) -> the same items, drawing progress as they are consumed
Progress = Callable[[Iterable[T], str, int], Iterable[T]]


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


class _ExpectedOverflow(logging.Filter):
    """Drops the exporter's "output overflows on random inputs" warning: a randomly initialised deep polynomial
    net overflows float32 (degree 2^49 and up), which says nothing about its structure, the only thing the
    analyzer's numbers depend on. Every other record passes."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.model = name

    def filter(self, record: logging.LogRecord) -> bool:
        if "output overflows on random inputs" in str(record.msg):
            log.debug("%s: untrained model overflows float32 on random inputs (expected; structure only)",
                      self.model)
            return False
        return True


def with_analysis(row: ZooRow) -> ZooRow:
    """Fill degree, ct x ct depth and levels from the analyzer (LN variants are not polynomial: left empty)."""
    from polyfhe.analysis import analyze
    from polyfhe.exporters.onnx import export_zoo_model_for_check

    if row.norm == "ln":
        return row
    exporter_log = logging.getLogger("polyfhe.exporters.onnx")
    overflow = _ExpectedOverflow(row.name)
    exporter_log.addFilter(overflow)
    try:
        with tempfile.TemporaryDirectory(prefix="polyfhe-zoo-") as tmp:
            report = analyze(export_zoo_model_for_check(row.name, analysis_img_size(row.name), tmp))
    finally:
        exporter_log.removeFilter(overflow)
    return replace(row, degree=report.degree, mult_depth=report.mult_depth, levels=report.levels)


def _quiet(items: Iterable[T], desc: str, total: int) -> Iterator[T]:
    return iter(items)


def zoo_rows(pattern: str = "*", with_macs: bool = True, with_analyzer: bool = False,
             progress: Progress | None = None) -> list[ZooRow]:
    """Rows for every registered model matching ``pattern``, optionally with the analyzer's numbers (an ONNX
    export of every BN variant: minutes for the whole zoo). ``progress(items, description, total)`` wraps each
    loop, e.g. in a progress bar; by default nothing is drawn."""
    wrap = progress or _quiet
    names = list_models(pattern)
    what = "counting parameters and MACs" if with_macs else "counting parameters"
    rows = [zoo_row(name, with_macs) for name in wrap(names, what, len(names))]
    if with_analyzer:
        rows = [with_analysis(r) for r in wrap(rows, "analysing BN variants", len(rows))]
    return rows
