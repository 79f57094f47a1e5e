"""Issue 17's families go through ``polyfhe.train`` like the zoo's own: trained, checkpointed, reloaded, folded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import polyfhe
from polyfhe.data.sources import ImageDataset, load_digits
from polyfhe.training import train
from polyfhe.training.checkpoint import load_checkpoint

# Small instances for 8x8 digits: a few hundred steps in seconds on one thread.
FAMILIES = {
    "lpnn_bn": {"widths": [32, 32]},
    "taylornet": {"hidden_dims": [16], "rank": 4},
    "rtaylornet": {"hidden_dims": [16], "rank": 4},
    "taylor_mixer": {"patch_size": 2, "dim": 8, "token_rank": 4, "channel_rank": 4},
    "resmlp_poly": {"patch_size": 2, "dim": 16},
}


@pytest.fixture(scope="module")
def small_digits() -> ImageDataset:
    d = load_digits()
    return ImageDataset("digits", d.x_train[:640], d.y_train[:640], d.x_test[:200], d.y_test[:200], d.classes)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_trains_checkpoints_and_folds(name: str, small_digits: ImageDataset, tmp_path: Path) -> None:
    result = train(name, small_digits, 20, tmp_path, device="cpu", lr=1e-2, batch_size=64, progress=False,
                   model_kwargs=FAMILIES[name])
    assert result.metrics.test_accuracy > 0.5  # chance is 0.1: the model learned
    model, info = load_checkpoint(tmp_path, expect_model=name)
    assert info.model_name == name and tuple(model.input_shape) == (1, 8, 8)
    assert polyfhe.model_entry(name).family in {"lpnn", "taylornet", "resmlp"}
    x = torch.randn(16, 1, 8, 8, dtype=torch.float64)
    model = model.double().eval()
    folded = polyfhe.fold(model)
    with torch.no_grad():
        ref, got = model(x), folded(x)
    assert torch.allclose(got, ref, rtol=1e-9, atol=1e-9 * float(ref.abs().max()))
