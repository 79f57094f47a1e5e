"""fold(): exact (float64) for MONet-BN and random generic models; refuses data-dependent norms."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

import polyfhe
from polyfhe.folding import FoldError, fold
from polyfhe.folding.primitives import ConstantAffine, SpatialSum

ALLOWED_LEAVES = (nn.Linear, nn.Conv2d, ConstantAffine, SpatialSum, nn.Identity, nn.Flatten, nn.ModuleList)


def _warm_up_statistics(model: nn.Module, shape: tuple[int, ...], steps: int = 3) -> None:
    """Give BatchNorms non-trivial running statistics so folding has something to get wrong."""
    model.train()
    with torch.no_grad():
        for _ in range(steps):
            model(torch.randn(8, *shape, dtype=torch.float64) * 1.5 + 0.3)
    model.eval()


def _randomise_affines(model: nn.Module) -> None:
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)) and m.affine:
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
            if isinstance(m, nn.Linear) and m.weight.abs().max() == 0:
                nn.init.normal_(m.weight, std=0.1)


def _rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / a.abs().max().clamp_min(1e-300))


@pytest.mark.parametrize(
    "name, overrides",
    [("monet_lr_bn", {}), ("monet_lr_bn", {"img_size": 8, "patch_size": 1}),
     # Full-depth random nets overflow even float64 (degree 2^68, spec 2.7's caution): keep every stage,
     # downsample and block type, one block per stage.
     ("monet_t_bn", {"img_size": 32, "depths": (1, 1, 1, 1)}), ("monet_s_bn", {"img_size": 32, "depths": (1, 1, 1, 1)}),
     ("monet_t_single_bn", {"img_size": 56, "depths": (3,)})],
)
def test_monet_bn_fold_is_exact(name: str, overrides: dict) -> None:
    model = polyfhe.create_model(name, num_classes=10, **overrides).double()
    _randomise_affines(model)
    _warm_up_statistics(model, model.input_shape)
    folded = fold(model)
    x = torch.randn(3, *model.input_shape, dtype=torch.float64)
    with torch.no_grad():
        err = _rel_error(model(x), folded(x))
    assert err <= 1e-9
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in folded.modules())
    leaves = [m for m in folded.modules() if not list(m.children())]
    assert all(isinstance(m, ALLOWED_LEAVES) for m in leaves), {type(m).__name__ for m in leaves}


def test_fold_does_not_mutate_the_callers_model() -> None:
    model = polyfhe.create_model("monet_lr_bn").double().train()
    before = copy.deepcopy(model.state_dict())
    fold(model)
    assert model.training
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("name", ["monet_lr", "monet_t"])
def test_layernorm_models_are_refused_with_the_bn_alternative(name: str) -> None:
    with pytest.raises(FoldError) as info:
        fold(polyfhe.create_model(name, img_size=32))
    assert "LayerNorm" in str(info.value) and f"{name}_bn" in str(info.value)


@pytest.mark.parametrize("norm", [nn.GroupNorm(2, 4), nn.InstanceNorm2d(4), nn.LayerNorm([4, 6, 6])])
def test_other_data_dependent_norms_are_refused_naming_the_module(norm: nn.Module) -> None:
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), norm)
    with pytest.raises(FoldError, match=r"module '1' \(" + type(norm).__name__):
        fold(model, input_shape=(1, 6, 6))


class Square(nn.Module):
    """A user's own polynomial module: fold must keep it as it is."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x


def _random_conv_stack(rng: random.Random) -> tuple[nn.Module, tuple[int, int, int]]:
    channels, size = rng.choice([1, 3]), rng.choice([8, 9, 12])
    layers: list[nn.Module] = []
    c = channels
    for _ in range(rng.randint(2, 5)):
        kind = rng.choice(["conv", "bn", "square", "dropout", "depthwise"])
        if kind == "conv":
            out, k = rng.choice([2, 4, 6]), rng.choice([1, 3])
            layers.append(nn.Conv2d(c, out, k, stride=rng.choice([1, 2]) if size > 4 else 1,
                                    padding=rng.choice([0, k // 2]), bias=rng.random() < 0.5))
            c = out
        elif kind == "depthwise":
            layers.append(nn.Conv2d(c, c, 3, padding=1, groups=c, bias=False))
        elif kind == "bn":
            layers.append(nn.BatchNorm2d(c))
        elif kind == "square":
            layers.append(Square())
        else:
            layers.append(nn.Dropout(0.2))
        if rng.random() < 0.4:
            layers.append(nn.BatchNorm2d(c))
    layers += [nn.Flatten(), nn.LazyLinear(7), nn.BatchNorm1d(7), nn.Linear(7, 5), nn.BatchNorm1d(5)]
    model = nn.Sequential(*layers)
    with torch.no_grad():
        model(torch.zeros(2, channels, size, size))  # materialise LazyLinear
    return model.double(), (channels, size, size)


@pytest.mark.parametrize("seed", range(12))
def test_random_generic_models_fold_exactly(seed: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model, shape = _random_conv_stack(rng)
    _randomise_affines(model)
    _warm_up_statistics(model, shape)
    folded = fold(model, input_shape=shape)
    x = torch.randn(4, *shape, dtype=torch.float64)
    with torch.no_grad():
        err = _rel_error(model(x), folded(x))
    assert err <= 1e-9, folded
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in folded.modules())
    assert sum(isinstance(m, Square) for m in folded.modules()) == sum(isinstance(m, Square) for m in model.modules())


def test_batchnorm_before_zero_padded_conv_keeps_the_border_exact() -> None:
    model = nn.Sequential(nn.BatchNorm2d(2), nn.Conv2d(2, 3, 3, padding=1)).double()
    _randomise_affines(model)
    with torch.no_grad():
        model[0].running_mean.uniform_(-2, 2)
        model[0].running_var.uniform_(0.5, 2)
    model.eval()
    folded = fold(model, input_shape=(2, 5, 5))
    x = torch.randn(2, 2, 5, 5, dtype=torch.float64)
    with torch.no_grad():
        assert _rel_error(model(x), folded(x)) <= 1e-12
    # Without the bias map (plain fold into the conv bias) the border would be wrong: the test can fail.
    naive = copy.deepcopy(model)
    scale = naive[0].weight / torch.sqrt(naive[0].running_var + naive[0].eps)
    shift = naive[0].bias - scale * naive[0].running_mean
    conv = naive[1]
    with torch.no_grad():
        w = conv.weight * scale.reshape(1, -1, 1, 1)
        b = conv.bias + (conv.weight * shift.reshape(1, -1, 1, 1)).sum(dim=(1, 2, 3))
        assert _rel_error(model(x), nn.functional.conv2d(x, w, b, padding=1)) > 1e-3


def test_resmlp_affine_folds_into_neighbouring_linears_and_alone() -> None:
    from polyfhe.models.layers.affine import Affine

    model = nn.Sequential(Affine(6), nn.Linear(6, 5), Affine(5), Square(), Affine(5), nn.Linear(5, 3),
                          Affine(3)).double()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Affine):
                m.alpha.uniform_(0.5, 1.5)
                m.beta.uniform_(-1, 1)
    folded = fold(model, input_shape=(6,))
    x = torch.randn(4, 6, dtype=torch.float64)
    with torch.no_grad():
        assert _rel_error(model(x), folded(x)) <= 1e-12
    assert not any(isinstance(m, Affine) for m in folded.modules())
    assert sum(isinstance(m, nn.Linear) for m in folded.modules()) == 2


@pytest.mark.parametrize("name", ["cpolynext_fhe_bn", "monet_fhe_bn", "lpnn_bn", "taylor_mixer", "resmlp_poly"])
def test_folded_model_of_a_trainable_model_has_no_autograd_history(name: str) -> None:
    """Fold rules compute weights from parameters that require grad; the folded module must still deep-copy
    (the exporters copy it) and hold only leaf tensors. A trained CPolyNeXt once kept its skip scales' history."""
    model = polyfhe.create_model(name).train(False)
    folded = polyfhe.fold(model)
    for module in folded.modules():
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            assert tensor.grad_fn is None, f"{name}: {type(module).__name__} holds a non-leaf tensor"
    copy.deepcopy(folded)
