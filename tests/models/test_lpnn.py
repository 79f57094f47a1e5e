"""LPNN: hand parameter counts, exact BN folding, analyzer order = config formula, encrypted = plaintext."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from torch import nn

import polyfhe
from polyfhe.exporters.onnx import export_onnx
from polyfhe.folding.lpnn import FoldedLPNN, LadderAffines, fold_ladder_stack
from polyfhe.models.lpnn import LPNNConfig, build_lpnn, lpnn_degree
from polyfhe.zoo import count_parameters


def _linear(i: int, o: int) -> int:
    return i * o + o


@pytest.mark.parametrize(
    "overrides, expected",
    [
        # lpnn_bn: 784 -> 3 x 256 -> 10. Layer 1: W 784x256+256, V 784x256+256, BN 2x256; layers 2, 3: W 256x256+256,
        # V 784x256+256, BN 2x256; head 256x10+10. 402,432 + 2 x 267,264 + 2,570.
        ({}, 939_530),
        # skip factors: layer 3's V reads h_1 (256 wide) instead of x: 200,960 - 65,792 = 135,168 fewer.
        ({"factor_source": "skip"}, 804_362),
        # no BN, 8x8x2 input, widths (32, 16), 3 classes: 2 x (128*32+32) + (32*16+16) + (128*16+16) + (16*3+3)
        # = 8,256 + 528 + 2,064 + 51.
        ({"norm": "none", "img_size": 8, "in_chans": 2, "widths": (32, 16), "num_classes": 3}, 10_899),
    ],
)
def test_parameter_counts_match_hand_counts(overrides: dict, expected: int) -> None:
    with torch.device("meta"):
        model = polyfhe.create_model("lpnn_bn", **overrides)
    assert count_parameters(model) == expected
    cfg = model.cfg
    sizes = (cfg.in_features, *cfg.widths)
    bn = 2 if cfg.norm == "bn" else 0
    formula = sum(_linear(sizes[l - 1], sizes[l]) + _linear(sizes[s], sizes[l]) + bn * sizes[l]
                  for l, s in enumerate(cfg.sources(), start=1)) + _linear(sizes[-1], cfg.num_classes)
    assert formula == expected


def test_depth_width_shorthand_and_shapes() -> None:
    model = build_lpnn(depth=2, width=24, img_size=8, in_chans=3, num_classes=7)
    assert model.cfg.widths == (24, 24) and model.input_shape == (3, 8, 8)
    assert model.eval()(torch.randn(5, 3, 8, 8)).shape == (5, 7)
    assert polyfhe.create_model("lpnn_bn", depth=5).cfg.widths == (256,) * 5


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        ({"widths": ()}, ValueError, "widths must be a non-empty tuple"),
        ({"widths": (32, 0)}, ValueError, "widths must be a non-empty tuple"),
        ({"factor_source": "previous"}, ValueError, "factor_source must be one of"),
        ({"norm": "ln"}, ValueError, "norm must be one of"),
        ({"drop_rate": 1.0}, ValueError, r"drop_rate must be in \[0, 1\)"),
        ({"img_size": 0}, ValueError, "must be positive"),
        ({"depth": 0}, ValueError, "depth must be a positive int"),
        ({"depth": 2, "widths": (8, 8)}, ValueError, "either widths"),
        ({"hidden": 3}, TypeError, "unknown LPNN options"),
    ],
)
def test_bad_config_is_rejected(overrides: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        polyfhe.create_model("lpnn_bn", **overrides)


def test_wrong_input_shape_is_rejected() -> None:
    with pytest.raises(ValueError, match="expects input"):
        polyfhe.create_model("lpnn_bn", widths=(8,))(torch.randn(2, 1, 8, 8))


def _with_running_stats(model: nn.Module, shape: tuple[int, ...]) -> nn.Module:
    """Non-trivial BN: a few training batches (dropout active too), then random statistics and affine parameters,
    since a few batches at momentum 0.1 leave the running statistics close to (0, 1)."""
    gen = torch.Generator().manual_seed(3)

    def rand(like: torch.Tensor, low: float, high: float) -> torch.Tensor:
        return torch.rand(like.shape, generator=gen, dtype=torch.float64) * (high - low) + low

    with torch.no_grad():
        model.train()
        for _ in range(4):
            model(torch.randn(64, *shape, dtype=torch.float64, generator=gen) * 1.5 + 0.3)
        for layer in model.layers:
            norm = layer.norm
            norm.running_mean.copy_(rand(norm.running_mean, -1.0, 1.0))
            norm.running_var.copy_(rand(norm.running_var, 0.2, 3.0))
            norm.weight.copy_(rand(norm.weight, 0.5, 1.5))
            norm.bias.copy_(rand(norm.bias, -1.0, 1.0))
    return model.eval()


@pytest.mark.parametrize("factor_source", ["input", "skip"])
@pytest.mark.parametrize("widths", [(16,), (24, 16, 12)])
def test_fold_is_exact_in_float64(factor_source: str, widths: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    model = build_lpnn(widths=widths, factor_source=factor_source, img_size=8, drop_rate=0.2).double()
    model = _with_running_stats(model, model.input_shape)
    norm = model.layers[0].norm
    assert norm.running_mean.abs().max() > 0.1 and (norm.running_var - 1).abs().max() > 0.1
    folded = polyfhe.fold(model)
    x = torch.randn(32, *model.input_shape, dtype=torch.float64)
    with torch.no_grad():
        ref, out = model(x), folded(x)
        without_bn = build_lpnn(widths=widths, factor_source=factor_source, img_size=8, norm="none").double()
        without_bn.load_state_dict({k: v for k, v in model.state_dict().items() if ".norm." not in k})
        assert (without_bn.eval()(x) - ref).abs().max() > 1e-2 * ref.abs().max()  # the BN matters
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-9
    # Only linear maps, products and a flatten remain: dropout and BN are gone.
    kinds = {type(m) for m in folded.modules()}
    assert kinds <= {FoldedLPNN, nn.ModuleList, nn.Linear}, kinds


def _mat(value: float) -> torch.Tensor:
    return torch.tensor([[value]], dtype=torch.float64)


def _vec(value: float) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float64)


def test_fold_weight_math_by_hand() -> None:
    """One layer of width 1 on a scalar input: every folded number checked against the formula."""
    layer = LadderAffines(w=_mat(2.0), b=_vec(1.0), v=_mat(3.0), c=_vec(-1.0), scale=_vec(0.5), shift=_vec(4.0))
    (f,), (hw, hb) = fold_ladder_stack([layer], [0], head_w=_mat(10.0), head_b=_vec(1.0))
    # h = 0.5 * (2x + 1)(3x - 1) + 4;  head = 10 h + 1 = 10 * ((x + 0.5)(3x - 1)) + 41
    assert (f.w.item(), f.b.item(), f.v.item(), f.c.item()) == (1.0, 0.5, 3.0, -1.0)
    assert (hw.item(), hb.item()) == (10.0, 41.0)
    assert f.scale is None and f.shift is None
    with pytest.raises(ValueError, match="factor source must be an earlier layer"):
        fold_ladder_stack([layer], [1], _mat(1.0), _vec(0.0))


def _onnx_ops(path: Path) -> set[str]:
    return {node.op_type for node in onnx.load(str(path)).graph.node}


@pytest.mark.parametrize(
    "widths, factor_source, hand_degree",
    [
        ((16,), "input", 2), ((16, 16), "input", 3), ((16, 12, 8), "input", 4),
        ((8,) * 4, "skip", 8),  # orders 2, 3, 2+3, 3+5: each layer adds the order of h_{l-2}
    ],
)
def test_analyzer_degree_matches_the_config(widths, factor_source, hand_degree, tmp_path: Path) -> None:
    model = build_lpnn(widths=widths, factor_source=factor_source, img_size=8).eval()
    report = export_onnx(model, tmp_path / "lpnn.onnx", fold_first=True).analysis
    cfg: LPNNConfig = model.cfg
    if factor_source == "input":
        assert hand_degree == cfg.depth + 1  # the paper's ladder: +1 per hidden layer
    assert report.polynomial and report.degree == lpnn_degree(cfg) == hand_degree
    assert report.mult_depth == cfg.depth  # one ct x ct product per ladder layer
    assert _onnx_ops(tmp_path / "lpnn.onnx") <= {"Flatten", "Reshape", "Gemm", "MatMul", "Add", "Mul"}


@pytest.mark.fhe
def test_encrypted_inference_matches_plaintext_on_digits() -> None:
    from ckks_testlib import accuracy, digits, encrypted_and_plain, train

    torch.manual_seed(0)
    model = train(build_lpnn(widths=(32, 32), img_size=8, drop_rate=0.0), epochs=15, lr=0.01)
    _, _, x, y = digits()
    assert accuracy(model, x, y) > 0.85  # a trained decision is compared, not chance
    enc, plain = encrypted_and_plain(model, x)
    assert enc.shape == plain.shape and len(enc) >= 16
    assert np.array_equal(enc.argmax(1), plain.argmax(1))
    assert np.abs(enc - plain).max() < 1e-3  # measured 4e-6 on logits up to 16
