"""MONet: exact parameter counts, shapes, shift semantics, BN behaviour."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from polyfhe.models import create_model
from polyfhe.models.layers.mu_layer import MuLayer, PolyBlock
from polyfhe.models.layers.shift import spatial_shift
from polyfhe.models.layers.token_norms import TokenBatchNorm
from polyfhe.models.monet import MONetConfig
from polyfhe.zoo import count_parameters


def _mu_params(d: int, m: int, shrink: int) -> int:
    """Spec 1.9's per-Mu-Layer formula, written out independently of the modules."""
    low = m // shrink
    return d * m + m + d * low + low + low * m + m + m * d + d + 4 * m + 1


def _analytic_count(cfg: MONetConfig) -> int:
    extra_block_norm = 2 if cfg.norm == "bn" else 0  # BN: separate norm for the second block-norm site
    total = cfg.in_chans * cfg.dims[0] * cfg.patch_size**2 + cfg.dims[0]
    if cfg.pyramid:
        total += cfg.dims[0] ** 2 * 4 + cfg.dims[0]
    for i, (d, n) in enumerate(zip(cfg.dims, cfg.depths)):
        block = _mu_params(d, d, cfg.shrink) + _mu_params(d, cfg.expansion * d, cfg.shrink) + 2 * d
        total += n * (block + extra_block_norm * d)
        if i + 1 < len(cfg.dims):
            total += d * cfg.dims[i + 1] * 9 + cfg.dims[i + 1]
    return total + cfg.dims[-1] * cfg.num_classes + cfg.num_classes


@pytest.mark.parametrize(
    "name, expected",
    [("monet_t", 10_339_436), ("monet_s", 32_880_688), ("monet_t_single", 14_113_256),
     ("monet_t_bn", 10_350_444), ("monet_s_bn", 32_900_912), ("monet_t_single_bn", 14_125_544)],
)
def test_parameter_counts_match_reference(name: str, expected: int) -> None:
    with torch.device("meta"):
        model = create_model(name)
    assert count_parameters(model) == expected
    assert count_parameters(model) == _analytic_count(model.cfg)


@pytest.mark.parametrize("name", ["monet_lr", "monet_lr_bn"])
@pytest.mark.parametrize("overrides", [{}, {"img_size": 32, "in_chans": 3}, {"img_size": 8, "patch_size": 1}])
def test_low_resolution_counts_and_shapes(name: str, overrides: dict) -> None:
    model = create_model(name, **overrides)
    assert count_parameters(model) == _analytic_count(model.cfg)
    x = torch.randn(2, *model.input_shape)
    assert model(x).shape == (2, 10)


@pytest.mark.parametrize("name", ["monet_t", "monet_s_bn", "monet_t_single"])
def test_forward_shape_small_resolution(name: str) -> None:
    model = create_model(name, img_size=56 if "single" in name else 32, num_classes=7).eval()
    with torch.no_grad():
        assert model(torch.randn(2, *model.input_shape)).shape == (2, 7)


def test_wrong_input_shape_is_rejected() -> None:
    model = create_model("monet_lr")
    with pytest.raises(ValueError, match="expects input"):
        model(torch.randn(1, 3, 28, 28))


def test_bad_config_is_rejected() -> None:
    with pytest.raises(ValueError, match="not divisible"):
        create_model("monet_lr", img_size=30)
    with pytest.raises(TypeError, match="unknown MONet options"):
        create_model("monet_lr", widths=(3,))


def test_spatial_shift_hand_computed() -> None:
    # 3x3 image, 4 channels -> one channel per group; channel k holds 10*k + (3*h + w).
    base = torch.arange(9, dtype=torch.float32).reshape(3, 3)
    x = torch.stack([base + 10 * k for k in range(4)], dim=-1)[None]  # (1, 3, 3, 4)
    out = spatial_shift(x)[0]
    expected = {
        0: [[0, 1, 2], [0, 1, 2], [3, 4, 5]],          # down along H, row 0 keeps itself
        1: [[13, 14, 15], [16, 17, 18], [16, 17, 18]],  # up along H, last row keeps itself
        2: [[20, 20, 21], [23, 23, 24], [26, 26, 27]],  # right along W, col 0 keeps itself
        3: [[31, 32, 32], [34, 35, 35], [37, 38, 38]],  # left along W, last col keeps itself
    }
    for k, grid in expected.items():
        assert out[..., k].tolist() == grid, f"channel group {k}"
    assert torch.equal(x, torch.stack([base + 10 * k for k in range(4)], dim=-1)[None]), "input mutated"


def test_spatial_shift_uneven_groups_and_broadcast_bug_absent() -> None:
    x = torch.randn(2, 5, 6, 10)
    out = spatial_shift(x)
    q1, q2, q3 = 2, 5, 7
    assert torch.equal(out[:, 1:, :, :q1], x[:, :-1, :, :q1])
    assert torch.equal(out[:, :-1, :, q1:q2], x[:, 1:, :, q1:q2])
    assert torch.equal(out[:, :, 1:, q2:q3], x[:, :, :-1, q2:q3])
    assert torch.equal(out[:, :, :-1, q3:], x[:, :, 1:, q3:])
    # The reference's in-place version broadcasts row 0 over H for group 0; ours must not.
    assert not torch.equal(out[:, 2, :, :q1], out[:, 1, :, :q1])


def test_norm_types_per_variant() -> None:
    ln, bn = create_model("monet_lr"), create_model("monet_lr_bn")
    assert any(isinstance(m, nn.LayerNorm) for m in ln.modules())
    assert not any(isinstance(m, nn.LayerNorm) for m in bn.modules())
    block = bn.stages[0][0]
    assert isinstance(block.norm1, TokenBatchNorm) and block.norm2 is not block.norm1
    assert ln.stages[0][0].norm2 is ln.stages[0][0].norm1  # the reference shares one LN per block


def test_token_batchnorm_running_statistics_update() -> None:
    norm = TokenBatchNorm(3).double()
    x = torch.randn(4, 5, 5, 3, dtype=torch.float64) * 2 + 1
    norm.train()(x)
    flat = x.reshape(-1, 3)
    assert torch.allclose(norm.running_mean, 0.1 * flat.mean(0))
    assert torch.allclose(norm.running_var, 0.9 + 0.1 * flat.var(0, unbiased=True))
    y = norm.eval()(x)
    expected = (x - norm.running_mean) / torch.sqrt(norm.running_var + norm.eps)
    assert torch.allclose(y, expected * norm.weight + norm.bias)


def test_bn_variant_is_batch_independent_in_eval() -> None:
    torch.manual_seed(1)
    model = create_model("monet_lr_bn", img_size=16, in_chans=1).double()
    nn.init.normal_(model.head.weight)  # the reference's zero head would make the check vacuous
    with torch.no_grad():
        for _ in range(3):
            model.train()(torch.randn(8, 1, 16, 16, dtype=torch.float64))
    model.eval()
    x = torch.randn(6, 1, 16, 16, dtype=torch.float64)
    with torch.no_grad():
        full = model(x)
        alone = model(x[:1])
        other = model(torch.cat([x[:1], 10 * torch.randn(5, 1, 16, 16, dtype=torch.float64)]))
    assert full.abs().max() > 1e-6
    assert torch.allclose(full[:1], alone, rtol=1e-12, atol=1e-12)
    assert torch.allclose(full[:1], other[:1], rtol=1e-12, atol=1e-12)


def test_ln_variant_shares_statistics_across_tokens_not_batch() -> None:
    # Sanity: a training-mode BN block does depend on the batch (so the eval check above is meaningful).
    block = PolyBlock(8, norm="bn").double().train()
    x = torch.randn(4, 3, 3, 8, dtype=torch.float64)
    a = block(x)[:1]
    b = block(torch.cat([x[:1], 5 * x[1:]]))[:1]
    assert not torch.allclose(a, b)


def test_mu_layer_is_quadratic_along_a_line() -> None:
    # With BN in eval mode a Mu-Layer is a degree-2 polynomial: its third finite difference vanishes.
    layer = MuLayer(8, 16, shrink=4, norm="bn", shift=True).double().eval()
    x0, d = torch.randn(1, 3, 3, 8, dtype=torch.float64), torch.randn(1, 3, 3, 8, dtype=torch.float64)
    f = [layer(x0 + t * d) for t in range(4)]
    third = f[3] - 3 * f[2] + 3 * f[1] - f[0]
    second = f[2] - 2 * f[1] + f[0]
    assert third.abs().max() < 1e-9 * f[3].abs().max()
    assert second.abs().max() > 1e-3
