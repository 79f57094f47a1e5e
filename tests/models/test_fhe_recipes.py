"""FHE recipes: sizes, exact fold, and the CKKS budget (levels, slots per encrypted tensor) of the export."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

import polyfhe
from polyfhe.calibration import profile_onnx_ranges, recompute_running_stats
from polyfhe.exporters.onnx import export_onnx
from polyfhe.models.layers.norms import ChannelBatchNorm, RunningRowSumNorm
from polyfhe.models.layers.token_norms import TokenBatchNorm
from polyfhe.zoo import count_parameters

RECIPES = ("monet_fhe_bn", "cpolynext_fhe_bn", "apolynext_fhe_bn")
SLOTS_N16384 = 8192
MAX_LEVELS = 19  # N=32768 at a 40-bit scale (ckks.md 1.3); the recipes aim for 11 (N=16384)
# Documented in docs/fhe-recipes.md: params at 28x28 and 8x8, degree, ct x ct depth, levels, largest tensor.
EXPECTED = {
    "monet_fhe_bn": (236_174, 236_174, 16, 4, 9, 6272),
    "cpolynext_fhe_bn": (54_750, 54_480, 32, 5, 11, 7840),
    "apolynext_fhe_bn": (25_399, 25_129, 36, 6, 11, 7840),
}
# ct x ct products and plaintext-linear maps after folding (the analyzer table of docs/fhe-recipes.md).
EXPECTED_OPS = {"monet_fhe_bn": (4, 18), "cpolynext_fhe_bn": (5, 26), "apolynext_fhe_bn": (6, 18)}


def _calibrated(name: str, img_size: int) -> torch.nn.Module:
    """float64, random affines and head, running statistics from one batch like the data tested on."""
    model = polyfhe.create_model(name, img_size=img_size).double()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, TokenBatchNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
            elif isinstance(m, ChannelBatchNorm):
                m.gamma_c.uniform_(0.5, 1.5)
                m.gamma_hw.uniform_(0.5, 1.5)
            elif isinstance(m, RunningRowSumNorm):
                m.gamma.uniform_(0.5, 1.5)
            elif isinstance(m, torch.nn.Linear) and not m.weight.any():  # MONet's zero-initialised head
                m.weight.normal_(0, 0.1)
            if hasattr(m, "skip_weight"):
                m.skip_weight.uniform_(-2, 0)
    recompute_running_stats(model, [torch.rand(32, *model.input_shape, dtype=torch.float64)])
    return model


def _value_sizes(path: Path, input_shape: tuple[int, ...]) -> dict[str, int]:
    """Per-image element count of every encrypted value (batch axis excluded).

    ONNX shape inference gives most shapes; it leaves the ``chunk``/shift slices symbolic (their bounds are
    computed from Shape ops), so those come from the shapes onnxruntime actually produces.
    """
    proto = onnx.shape_inference.infer_shapes(onnx.load(str(path)))
    sizes = {}
    for vi in (*proto.graph.input, *proto.graph.value_info, *proto.graph.output):
        dims = vi.type.tensor_type.shape.dim[1:]
        if all(d.HasField("dim_value") for d in dims):
            sizes[vi.name] = math.prod(d.dim_value for d in dims)
    observed = profile_onnx_ranges(path, np.random.default_rng(0).uniform(size=(2, *input_shape)))
    for name, r in observed.items():
        assert sizes.setdefault(name, math.prod(r.shape)) == math.prod(r.shape), name
    return sizes


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("size", [28, 8])
def test_recipe_builds_with_overrides(name: str, size: int) -> None:
    model = polyfhe.create_model(name, img_size=size)
    assert model.input_shape == (1, size, size) and model.num_classes == 10
    assert count_parameters(model) == EXPECTED[name][0 if size == 28 else 1]
    with torch.no_grad():
        assert model.eval()(torch.rand(2, 1, size, size)).shape == (2, 10)
    other = polyfhe.create_model(name, img_size=size, in_chans=3, num_classes=4)
    assert other.input_shape == (3, size, size) and other(torch.rand(2, 3, size, size)).shape == (2, 4)


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("size", [28, 8])
def test_recipe_fold_is_exact(name: str, size: int) -> None:
    model = _calibrated(name, size)
    folded = polyfhe.fold(model)
    x = torch.rand(4, 1, size, size, dtype=torch.float64)
    with torch.no_grad():
        ref, got = model(x), folded(x)
    assert torch.isfinite(ref).all() and ref.abs().max() > 1e-6
    assert float((ref - got).abs().max() / ref.abs().max()) <= 1e-9
    norms = (TokenBatchNorm, ChannelBatchNorm, RunningRowSumNorm)
    assert not any(isinstance(m, norms) for m in folded.modules())


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_fits_ckks_at_n16384(name: str, tmp_path: Path) -> None:
    _, _, degree, depth, levels, largest = EXPECTED[name]
    exported = export_onnx(_calibrated(name, 28).float(), tmp_path / f"{name}.onnx")
    report = exported.analysis
    assert report.polynomial and not report.violations
    assert (report.degree, report.mult_depth, report.levels) == (degree, depth, levels)
    assert (report.op_counts.ct_ct_mults, report.op_counts.pt_mults) == EXPECTED_OPS[name]
    assert report.levels <= min(MAX_LEVELS, 11) and not report.not_lowered_by("ckks")
    sizes = _value_sizes(exported.path, (1, 28, 28))
    biggest = max(sizes, key=sizes.get)
    assert sizes[biggest] == largest and sizes[biggest] <= SLOTS_N16384, biggest


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_at_8x8_stays_within_the_budget(name: str, tmp_path: Path) -> None:
    exported = export_onnx(_calibrated(name, 8).float(), tmp_path / f"{name}.onnx")
    assert exported.analysis.polynomial and exported.analysis.levels <= MAX_LEVELS
    assert exported.analysis.levels == EXPECTED[name][4]  # depth does not depend on the resolution
    assert max(_value_sizes(exported.path, (1, 8, 8)).values()) <= SLOTS_N16384


def test_cpolynext_recipe_rejects_bad_cell_options() -> None:
    with pytest.raises(ValueError, match="channels and stacks must be positive"):
        polyfhe.create_model("cpolynext_fhe_bn", stacks=0)
    with pytest.raises(ValueError, match="skip logits"):
        polyfhe.create_model("cpolynext_fhe_bn", stacks=9)


def test_apolynext_recipe_rejects_bad_cell_options() -> None:
    with pytest.raises(ValueError, match="channels and stacks must be positive"):
        polyfhe.create_model("apolynext_fhe_bn", channels=0)
    with pytest.raises(ValueError, match="skip logits"):
        polyfhe.create_model("apolynext_fhe_bn", stacks=9)
    with pytest.raises(TypeError):
        polyfhe.create_model("apolynext_fhe_bn", exp_conv=2.0)  # PolyAttn has no expansion to set


def test_apolynext_recipe_is_one_attention_cell() -> None:
    model = polyfhe.create_model("apolynext_fhe_bn")
    (cell,) = model.cells
    (mixer,) = cell.mixers
    attn = mixer.attn
    assert type(attn).__name__ == "PolyAttn" and attn.n_heads == 1 and attn.width == 32
    assert isinstance(attn.norm, RunningRowSumNorm) and attn.norm.tokens == 49  # 7x7 tokens
    assert cell.mlps[0].hidden == 160 and model.head.proj.out_channels == 160
    wide = polyfhe.create_model("apolynext_fhe_bn", channels=64, stacks=2, exp_mlp=2.0)
    assert len(wide.cells[0].mixers) == 2 and wide.cells[0].mixers[0].attn.n_heads == 1
    assert wide.cells[0].mlps[0].hidden == 128
    assert polyfhe.create_model("apolynext_fhe_bn", channels=65).cells[0].mixers[0].attn.n_heads == 2


def test_apolynext_recipe_scores_and_stacks(tmp_path: Path) -> None:
    """The attention scores are heads x 49 x 49 per image; a second stack needs N=32768's 19 levels."""
    exported = export_onnx(_calibrated("apolynext_fhe_bn", 28).float(), tmp_path / "one.onnx")
    sizes = _value_sizes(exported.path, (1, 28, 28))
    assert any("mixers" in name and size == 49 * 49 for name, size in sizes.items())
    two = polyfhe.create_model("apolynext_fhe_bn", stacks=2).double()
    recompute_running_stats(two, [torch.rand(32, 1, 28, 28, dtype=torch.float64)])
    report = export_onnx(two.float(), tmp_path / "two.onnx").analysis
    assert report.polynomial and (report.degree, report.mult_depth, report.levels) == (648, 11, 19)
    assert report.levels <= MAX_LEVELS
