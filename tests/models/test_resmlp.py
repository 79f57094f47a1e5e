"""Polynomial ResMLP: hand-counted parameters, exact float64 fold, analyzer degree 2**depth, encrypted inference."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch import nn

import polyfhe
from polyfhe.exporters.onnx import export_onnx
from polyfhe.folding import fold
from polyfhe.folding.resmlp import FoldedCrossPatch, TokenSum, fold_affine_into_cross_patch
from polyfhe.models.layers.affine import Affine
from polyfhe.models.resmlp import ResMLPConfig
from polyfhe.zoo import count_parameters

log = logging.getLogger(__name__)


def _hand_count(cfg: ResMLPConfig) -> int:
    """Written out from the architecture, independently of the modules."""
    d, n, h = cfg.dim, (cfg.img_size // cfg.patch_size) ** 2, cfg.expansion * cfg.dim
    patch_embed = cfg.in_chans * cfg.patch_size**2 * d + d
    block = (
        2 * d  # Aff1 (alpha, beta)
        + n * n + n  # cross-patch Linear over tokens
        + d  # ls1
        + 2 * d  # Aff2
        + 2 * (d * h + h)  # W1, W2 (+ biases)
        + h * d + d  # W3
        + d  # ls2
    )
    return patch_embed + cfg.depth * block + 2 * d + d * cfg.num_classes + cfg.num_classes


def test_default_parameter_count_and_sizes() -> None:
    model = polyfhe.create_model("resmlp_poly")
    cfg = model.cfg
    # 1360 (embed) + 2 * 41730 (blocks) + 160 (final Affine) + 810 (head)
    assert count_parameters(model) == _hand_count(cfg) == 85_790
    assert (cfg.num_tokens, cfg.dim, cfg.hidden, cfg.depth, cfg.degree) == (49, 80, 160, 2, 4)
    assert cfg.largest_tensor == 49 * 160 <= 8192  # one N=16384 ciphertext (8192 slots) per tensor
    assert model.input_shape == (1, 28, 28) and model.num_classes == 10
    assert model(torch.randn(2, 1, 28, 28)).shape == (2, 10)


@pytest.mark.parametrize("overrides", [
    {"img_size": 32, "in_chans": 3, "patch_size": 8, "dim": 24, "depth": 3, "expansion": 3, "num_classes": 7},
    {"img_size": 8, "patch_size": 2, "dim": 16, "depth": 1, "expansion": 4},
])
def test_parameter_count_matches_hand_count(overrides: dict) -> None:
    model = polyfhe.create_model("resmlp_poly", **overrides)
    assert count_parameters(model) == _hand_count(model.cfg)
    assert model(torch.randn(2, *model.input_shape)).shape == (2, model.num_classes)


def _randomise(model: nn.Module) -> None:
    """Non-trivial Affine, layer-scale and head values so that a wrong fold shows."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Affine):
                m.alpha.uniform_(0.5, 1.5)
                m.beta.uniform_(-0.5, 0.5)
        for name, p in model.named_parameters():
            if name.endswith(("ls1", "ls2")):
                p.uniform_(0.05, 0.3)
        nn.init.normal_(model.head.weight, std=0.3)
        nn.init.normal_(model.head.bias, std=0.3)
        for block in model.blocks:
            block.cross_patch.proj.bias.uniform_(-0.5, 0.5)


@pytest.mark.parametrize("overrides", [
    {},
    {"img_size": 12, "in_chans": 3, "patch_size": 3, "dim": 8, "depth": 3, "expansion": 3},
])
def test_fold_is_exact_and_leaves_no_standalone_scale(overrides: dict) -> None:
    model = polyfhe.create_model("resmlp_poly", **overrides).double()
    _randomise(model)
    folded = fold(model)
    x = torch.randn(3, *model.input_shape, dtype=torch.float64)
    with torch.no_grad():
        ref, got = model.eval()(x), folded(x)
    assert float((ref - got).abs().max() / ref.abs().max()) <= 1e-9
    # Every Affine and layer-scale went into a linear map: only linear maps, the cross-patch map (whose
    # per-channel scale cannot enter a token-mixing weight) and token sums are left.
    leaves = {type(m) for m in folded.modules() if not list(m.children())}
    assert leaves <= {nn.Linear, nn.Conv2d, FoldedCrossPatch, TokenSum}, leaves
    assert sum(isinstance(m, FoldedCrossPatch) for m in folded.modules()) == model.cfg.depth
    assert not [n for n, _ in folded.named_parameters() if "ls" in n or "alpha" in n or "beta" in n]
    assert any(isinstance(m, Affine) for m in model.modules())  # the caller's model is untouched


def test_cross_patch_weight_math_matches_direct_computation() -> None:
    g = torch.Generator().manual_seed(1)
    n, d = 5, 3
    w, b = torch.randn(n, n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)
    scale, shift, ls = (torch.randn(d, generator=g, dtype=torch.float64) for _ in range(3))
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    direct = ls * (w @ (scale * x + shift) + b[:, None])
    w2, channel_scale, bias_map = fold_affine_into_cross_patch(w, b, scale, shift, ls)
    torch.testing.assert_close(channel_scale * (w2 @ x) + bias_map, direct, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("depth", [1, 2])
def test_analyzer_degree_is_two_to_the_depth(depth: int, tmp_path) -> None:
    model = polyfhe.create_model("resmlp_poly", img_size=8, patch_size=2, dim=16, depth=depth).eval()
    report = export_onnx(model, tmp_path / "resmlp.onnx", fold_first=True).analysis
    assert report.polynomial
    assert report.degree == 2**depth == model.cfg.degree
    assert report.mult_depth == depth
    log.info("resmlp depth %d: degree %d, mult_depth %d, levels %d", depth, report.degree, report.mult_depth,
             report.levels)


@pytest.mark.parametrize("overrides, match", [
    ({"img_size": 30}, "not divisible by patch_size 4"),
    ({"img_size": 8, "patch_size": 3}, "not divisible by patch_size 3"),
    ({"depth": 0}, "depth must be a positive integer"),
    ({"expansion": 1.5}, "expansion must be a positive integer"),
    ({"layer_scale_init": 0.0}, "layer_scale_init must be > 0"),
])
def test_bad_config_is_rejected(overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        polyfhe.create_model("resmlp_poly", **overrides)


def test_unknown_option_and_wrong_input_are_rejected() -> None:
    with pytest.raises(TypeError, match="unknown ResMLP options"):
        polyfhe.create_model("resmlp_poly", width=3)
    with pytest.raises(ValueError, match="expects input"):
        polyfhe.create_model("resmlp_poly")(torch.randn(1, 3, 28, 28))


@pytest.mark.fhe
def test_encrypted_inference_matches_plaintext_on_digits() -> None:
    from ckks_testlib import accuracy, digits, encrypted_and_plain, train

    torch.manual_seed(0)
    model = polyfhe.create_model("resmlp_poly", img_size=8, patch_size=2, dim=16, depth=2, expansion=2)
    model = train(model, epochs=30, lr=0.01, batch_size=128)
    _, _, x, y = digits()
    assert accuracy(model, x[:32], y[:32]) > 0.8  # a trained decision, not chance
    enc, plain = encrypted_and_plain(model, x)
    err = float(np.abs(enc - plain).max())
    log.info("resmlp digits: %d samples, max abs error %.3g (logits up to %.3g)", len(enc), err,
             np.abs(plain).max())
    assert len(enc) >= 16
    assert np.array_equal(enc.argmax(1), plain.argmax(1))
    assert err < 1e-3 * max(1.0, float(np.abs(plain).max()))
