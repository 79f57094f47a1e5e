"""fold() of PolyNeXt-BN: spatial BN, row-sum norm, Sigmoid-Scale, flips and pooling fold exactly (float64)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import polyfhe
from polyfhe.folding import FoldError, fold
from polyfhe.folding.primitives import ConstantAffine, SpatialSum
from polyfhe.models.layers.norms import ChannelBatchNorm, RunningRowSumNorm

ALLOWED_LEAVES = (nn.Conv2d, nn.Linear, ConstantAffine, SpatialSum, nn.Identity)


def _calibrated(name: str, img_size: int) -> nn.Module:
    """Random weights with non-trivial affines, running statistics taken from one batch (momentum 1).

    Full-depth random BN nets overflow on inputs far from their statistics (spec 2.7), so the statistics come
    from the same distribution the test evaluates on, as calibration would do.
    """
    model = polyfhe.create_model(name, img_size=img_size, num_classes=10).double()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, ChannelBatchNorm):
                m.gamma_c.uniform_(0.5, 1.5)
                m.gamma_hw.uniform_(0.5, 1.5)
                m.momentum = 1.0
            elif isinstance(m, RunningRowSumNorm):
                m.gamma.uniform_(0.5, 1.5)
                m.momentum = 1.0
            if hasattr(m, "skip_weight"):
                m.skip_weight.uniform_(-4, -2)
        model.train()(torch.rand(16, *model.input_shape, dtype=torch.float64))
    return model.eval()


@pytest.mark.parametrize(
    "name, size",
    [("cpolynext_lr_bn", 16), ("cpolynext_t_bn", 32), ("apolynext_t_bn", 32), ("cpolynext_s_bn", 32),
     ("apolynext_s_bn", 32)],
)
def test_polynext_bn_fold_is_exact(name: str, size: int) -> None:
    torch.manual_seed(0)
    model = _calibrated(name, size)
    folded = fold(model)
    x = torch.rand(3, *model.input_shape, dtype=torch.float64)
    with torch.no_grad():
        ref, got = model(x), folded(x)
    assert torch.isfinite(ref).all() and ref.abs().max() > 1e-6
    assert float((ref - got).abs().max() / ref.abs().max()) <= 1e-9
    leaves = [m for m in folded.modules() if not list(m.children())]
    assert all(isinstance(m, ALLOWED_LEAVES) for m in leaves), {type(m).__name__ for m in leaves}
    assert not any(isinstance(m, (ChannelBatchNorm, RunningRowSumNorm)) for m in folded.modules())


def test_polynext_ln_is_refused_naming_layernorm2d() -> None:
    with pytest.raises(FoldError, match=r"LayerNorm2d.*'apolynext_t_bn'"):
        fold(polyfhe.create_model("apolynext_t", img_size=32))
