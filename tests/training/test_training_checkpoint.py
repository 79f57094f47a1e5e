"""Checkpoints round-trip every parameter and buffer and fail clearly on mismatches and damage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from polyfhe.models.registry import create_model
from polyfhe.training.checkpoint import (
    CheckpointError,
    CheckpointInfo,
    load_checkpoint,
    read_checkpoint_info,
    save_checkpoint,
)

KWARGS = {"num_classes": 3, "img_size": 8, "in_chans": 1, "dims": (8,), "depths": (1,)}


def _trained_like_model() -> torch.nn.Module:
    model = create_model("monet_lr_bn", **KWARGS)
    with torch.no_grad():
        model.train()(torch.rand(4, 1, 8, 8))  # moves BatchNorm running statistics away from 0/1
        model.head.weight.normal_()
    return model.eval()


def test_round_trip_keeps_parameters_and_buffers(tmp_path: Path) -> None:
    model = _trained_like_model()
    save_checkpoint(model, tmp_path, model_name="monet_lr_bn", model_kwargs=KWARGS, epoch=4, extra={"note": "x"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]  # no temp files left
    loaded, info = load_checkpoint(tmp_path / "model.safetensors", expect_model="monet_lr_bn")
    assert info == CheckpointInfo("monet_lr_bn", {**KWARGS, "dims": [8], "depths": [1]}, 4, {"note": "x"})
    assert loaded.model_name == "monet_lr_bn"
    reference = model.state_dict()
    assert any("running_mean" in k for k in reference)
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, reference[key]), key
    x = torch.rand(2, 1, 8, 8)
    assert torch.equal(loaded.eval()(x), model(x))


def test_info_dict_round_trip() -> None:
    info = CheckpointInfo("m", {"dims": (1, 2)}, 3, {"a": 1.5})
    assert CheckpointInfo.from_dict(info.to_dict()) == CheckpointInfo("m", {"dims": [1, 2]}, 3, {"a": 1.5})
    with pytest.raises(CheckpointError, match="model_name"):
        CheckpointInfo.from_dict({"epoch": 1})


def test_other_architecture_names_both(tmp_path: Path) -> None:
    save_checkpoint(_trained_like_model(), tmp_path, model_name="monet_lr_bn", model_kwargs=KWARGS)
    with pytest.raises(CheckpointError, match="'monet_lr_bn'.*'cpolynext_t_bn'"):
        load_checkpoint(tmp_path, expect_model="cpolynext_t_bn")


def test_missing_and_corrupt_files(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")
    save_checkpoint(_trained_like_model(), tmp_path, model_name="monet_lr_bn", model_kwargs=KWARGS)
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_checkpoint_info(tmp_path)


def test_weights_that_do_not_fit_the_config(tmp_path: Path) -> None:
    save_checkpoint(_trained_like_model(), tmp_path, model_name="monet_lr_bn", model_kwargs=KWARGS)
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_kwargs"]["dims"] = [16]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="do not fit 'monet_lr_bn'"):
        load_checkpoint(tmp_path)
