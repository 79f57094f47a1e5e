"""Registry behaviour over every registered model (built on the meta device: no weights allocated)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import polyfhe
from polyfhe.models.registry import model_entry

REQUIRED = [
    "monet_t", "monet_s", "monet_t_bn", "monet_s_bn", "monet_t_single", "monet_t_single_bn",
    *[f"{fam}_{size}{suffix}" for fam in ("cpolynext", "apolynext") for size in "tsbl" for suffix in ("", "_bn")],
    "cpolynext_lr", "cpolynext_lr_bn",
]


def test_required_names_are_registered() -> None:
    missing = set(REQUIRED) - set(polyfhe.list_models())
    assert not missing


def test_unknown_model_lists_available_names() -> None:
    with pytest.raises(KeyError) as info:
        polyfhe.create_model("nope")
    message = str(info.value)
    assert "nope" in message and "monet_t" in message and "cpolynext_lr_bn" in message


def test_list_models_filters() -> None:
    bn = polyfhe.list_models("*_bn")
    assert bn and all(name.endswith("_bn") for name in bn)


def _is_data_dependent_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.GroupNorm)) or "LayerNorm" in type(module).__name__


@pytest.mark.parametrize("name", polyfhe.list_models())
def test_every_model_exposes_shape_classes_and_norm_kind(name: str) -> None:
    entry = model_entry(name)
    with torch.device("meta"):
        model = polyfhe.create_model(name)
    assert tuple(model.input_shape) == (
        entry.default_cfg["in_chans"], entry.default_cfg["img_size"], entry.default_cfg["img_size"]
    )
    assert model.num_classes == entry.default_cfg["num_classes"]
    has_ln = any(_is_data_dependent_norm(m) for m in model.modules())
    assert has_ln == (entry.norm == "ln"), f"{name}: norm={entry.norm} but LayerNorm present={has_ln}"
    if entry.spec_params is not None:
        assert sum(p.numel() for p in model.parameters()) == entry.spec_params


@pytest.mark.parametrize("name", ["monet_lr", "cpolynext_lr"])
def test_overrides_reach_the_model(name: str) -> None:
    with torch.device("meta"):
        model = polyfhe.create_model(name, num_classes=3, img_size=16, in_chans=2)
    assert tuple(model.input_shape) == (2, 16, 16) and model.num_classes == 3
