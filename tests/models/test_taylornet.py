"""TaylorNet / R-TaylorNet / Taylor-Mixer: hand parameter counts, equality with the dense Taylor polynomial,
Taylor/Xavier/Kaiming initialisation statistics, fold exactness, analyzer degree, encrypted inference."""

from __future__ import annotations

import itertools
import logging
import math
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import polyfhe
from polyfhe.folding import fold
from polyfhe.models.layers.affine import Affine
from polyfhe.models.layers.taylor import (
    TaylorLayer,
    kron_features,
    taylor_input_std,
    taylor_layer_param_count,
)
from polyfhe.models.taylornet import TaylorMixerConfig, TaylorNetConfig, build_taylor_mixer, build_taylornet

log = logging.getLogger(__name__)


def _n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _randomise(model: nn.Module, std: float = 0.3) -> nn.Module:
    """Taylor init starts the higher-order output factors at 0: make every term and Affine non-trivial."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, TaylorLayer):
                for o in m.out_factors:
                    nn.init.normal_(o, 0.0, std)
                nn.init.normal_(m.bias, 0.0, 0.1)
            if isinstance(m, Affine):
                m.alpha.uniform_(0.5, 1.5)
                m.beta.uniform_(-0.3, 0.3)
    return model


# --- parameter counts ---------------------------------------------------------------------------------------

def test_taylor_layer_param_counts_by_hand() -> None:
    # in 5, out 3, order 3, rank 4.  Full, per order k: out*r + k*r*n + r*r^k (+ bias 3 once).
    full = 3 + (12 + 20 + 16) + (12 + 40 + 64) + (12 + 60 + 256)
    # Reducible: one shared r x n factor per order, core r x C(r+k-1, k): C(4,1)=4, C(5,2)=10, C(6,3)=20.
    reduced = 3 + (12 + 20 + 16) + (12 + 20 + 40) + (12 + 20 + 80)
    assert (full, reduced) == (495, 235)
    assert _n_params(TaylorLayer(5, 3, 3, 4)) == full == taylor_layer_param_count(5, 3, 3, 4)
    assert _n_params(TaylorLayer(5, 3, 3, 4, reducible=True)) == reduced == taylor_layer_param_count(5, 3, 3, 4, True)
    assert _n_params(TaylorLayer(5, 3, 1, 4, reducible=True)) == _n_params(TaylorLayer(5, 3, 1, 4)) == 3 + 48


def test_registered_model_param_counts_by_hand() -> None:
    # taylornet: 784 -> 64 -> 64 (order 2, rank 16), head 64 -> 10.
    l1 = 64 + (64 * 16 + 16 * 784 + 16 * 16) + (64 * 16 + 2 * 16 * 784 + 16 * 256)
    l2 = 64 + (64 * 16 + 16 * 64 + 16 * 16) + (64 * 16 + 2 * 16 * 64 + 16 * 256)
    head = 64 * 10 + 10
    assert _n_params(polyfhe.create_model("taylornet")) == l1 + l2 + head == 54_282
    # rtaylornet: order-2 cores hold C(17, 2) = 136 distinct monomials, one 16 x n factor.
    r1 = 64 + (64 * 16 + 16 * 784 + 16 * 16) + (64 * 16 + 16 * 784 + 16 * 136)
    r2 = 64 + (64 * 16 + 16 * 64 + 16 * 16) + (64 * 16 + 16 * 64 + 16 * 136)
    assert _n_params(polyfhe.create_model("rtaylornet")) == r1 + r2 + head == 36_874
    # taylor_mixer: conv 4x4 1 -> 32, 2 blocks of (Affine 32, token Taylor 49->49 rank 8, Affine 32,
    # channel Taylor 32->32 rank 8), Affine 32, head 32 -> 10.
    token = 49 + (49 * 8 + 8 * 49 + 8 * 8) + (49 * 8 + 2 * 8 * 49 + 8 * 64)
    channel = 32 + (32 * 8 + 8 * 32 + 8 * 8) + (32 * 8 + 2 * 8 * 32 + 8 * 64)
    mixer = (16 * 32 + 32) + 2 * (64 + token + 64 + channel) + 64 + (32 * 10 + 10)
    assert _n_params(polyfhe.create_model("taylor_mixer")) == mixer == 10_140


# --- the layer is the Taylor polynomial its factors describe ------------------------------------------------

def _dense_tensors(layer: TaylorLayer) -> list[np.ndarray]:
    """Independent reconstruction: T_k[o, a1..ak] = sum O[o,p] G[p, i1..ik] U1[i1,a1] ... Uk[ik,ak]."""
    r, n = layer.rank, layer.in_features
    letters = "abcdefgh"
    tensors = [layer.bias.detach().numpy()]
    for k in range(1, layer.order + 1):
        u = layer.in_factors[k - 1].detach().numpy()
        g = layer.cores[k - 1].detach().numpy()
        o = layer.out_factors[k - 1].detach().numpy()
        if layer.reducible:  # the distinct-monomial core sits at the sorted index (i1 <= ... <= ik)
            full = np.zeros((r,) + (r,) * k)
            for col, idx in enumerate(itertools.combinations_with_replacement(range(r), k)):
                full[(slice(None), *idx)] = g[:, col]
            factors = [u[0]] * k
        else:
            full = g.reshape((r,) + (r,) * k)
            factors = list(u)
        ranks, ins = letters[:k], letters[k:2 * k].upper()
        spec = f"op,p{ranks}," + ",".join(f"{a}{b}" for a, b in zip(ranks, ins, strict=True)) + f"->o{ins}"
        tensors.append(np.einsum(spec, o, full, *factors))
        assert tensors[-1].shape == (layer.out_features,) + (n,) * k
    return tensors


def _evaluate_dense(tensors: list[np.ndarray], x: np.ndarray) -> np.ndarray:
    """sum_k T_k[x, ..., x] sample by sample, with x^(outer k) as an explicit tensor."""
    rows = []
    for xb in x:
        y, power = tensors[0].copy(), np.ones(())
        for t in tensors[1:]:
            power = np.multiply.outer(power, xb)
            y += t.reshape(len(y), -1) @ power.ravel()
        rows.append(y)
    return np.stack(rows)


@pytest.mark.parametrize("reducible", [False, True])
@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_layer_equals_dense_taylor_polynomial(order: int, reducible: bool) -> None:
    torch.manual_seed(order)
    layer = _randomise(TaylorLayer(4, 3, order, 3, reducible=reducible)).double()
    x = torch.randn(6, 4, dtype=torch.float64)
    dense = _dense_tensors(layer)
    expected = _evaluate_dense(dense, x.numpy())
    got = layer(x).detach().numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-10)
    for mine, theirs in zip(layer.derivative_tensors(), dense, strict=True):
        np.testing.assert_allclose(mine.numpy(), theirs, rtol=1e-10, atol=1e-12)
    # leading batch axes (the Mixer's (B, C, N) token layout) act row by row
    x3 = x.reshape(2, 3, 4)
    np.testing.assert_allclose(layer(x3).detach().numpy().reshape(6, 3), got, rtol=1e-12, atol=1e-12)


def test_order_k_term_is_homogeneous_of_degree_k() -> None:
    layer = _randomise(TaylorLayer(5, 2, 3, 3)).double()
    x = torch.randn(4, 5, dtype=torch.float64)
    for k in (1, 2, 3):
        np.testing.assert_allclose(layer.order_term(2.5 * x, k).detach(), 2.5**k * layer.order_term(x, k).detach(),
                                   rtol=1e-12)


def test_kron_features_is_row_major_kronecker() -> None:
    a, b, c = torch.randn(2, 3), torch.randn(2, 2), torch.randn(2, 4)
    expected = torch.stack([torch.kron(torch.kron(a[i], b[i]), c[i]) for i in range(2)])
    torch.testing.assert_close(kron_features([a, b, c]), expected)


def test_reducible_drops_parameters_and_keeps_expressiveness_of_symmetric_part() -> None:
    full, red = TaylorLayer(10, 4, 3, 5), TaylorLayer(10, 4, 3, 5, reducible=True)
    assert _n_params(red) < _n_params(full)
    # The dropped hidden features are exact duplicates: the full Kronecker product of one vector holds every
    # distinct monomial C(r+k-1, k) times a multiplicity, nothing else.
    z = torch.randn(1, 5, dtype=torch.float64)
    kron = kron_features([z, z, z])[0]
    assert len(torch.unique(kron.round(decimals=12))) == math.comb(5 + 3 - 1, 3)


# --- initialisation ----------------------------------------------------------------------------------------

def test_taylor_init_statistics() -> None:
    torch.manual_seed(0)
    n, r = 400, 24
    layer = TaylorLayer(n, 64, 3, r, init="taylor")
    assert torch.count_nonzero(layer.bias) == 0
    assert all(torch.count_nonzero(o) == 0 for o in layer.out_factors[1:])  # starts as a linear map
    assert layer.out_factors[0].std().item() == pytest.approx(r**-0.5, rel=0.1)
    for k in (1, 2, 3):
        assert layer.cores[k - 1].std().item() == pytest.approx(r ** (-k / 2), rel=0.1)
        assert layer.in_factors[k - 1].std().item() == pytest.approx(taylor_input_std(n, k), rel=0.05)
    assert taylor_input_std(n, 2) == pytest.approx((1 / (n * (n + 2))) ** 0.25)
    # the point of the scheme: unit-variance hidden products of every order, unit-variance linear output
    x = torch.randn(2000, n)
    with torch.no_grad():
        for k in (1, 2, 3):
            zs = torch.nn.functional.linear(x, layer.in_factors[k - 1].reshape(k * r, n)).split(r, dim=-1)
            assert kron_features(list(zs)).var().item() == pytest.approx(1.0, rel=0.25)
        assert layer(x).var().item() == pytest.approx(1.0, rel=0.25)


@pytest.mark.parametrize("init, bound", [
    ("xavier", lambda fan_in, fan_out: math.sqrt(6 / (fan_in + fan_out))),
    ("kaiming", lambda fan_in, fan_out: math.sqrt(6 / fan_in)),  # torch default: gain sqrt(2), fan_in
])
def test_xavier_and_kaiming_init_bounds(init: str, bound) -> None:
    layer = TaylorLayer(300, 40, 2, 20, init=init)
    mats = [(layer.in_factors[1][0], 300, 20), (layer.cores[1], 400, 20), (layer.out_factors[1], 20, 40)]
    for w, fan_in, fan_out in mats:
        b = bound(fan_in, fan_out)
        assert w.abs().max().item() <= b
        assert w.std().item() == pytest.approx(b / math.sqrt(3), rel=0.1)  # uniform(-b, b)
    assert torch.count_nonzero(layer.out_factors[1]) > 0  # unlike Taylor init, every order starts active
    assert torch.count_nonzero(layer.bias) == 0


# --- bad configurations -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    ({"order": 0}, "order must be a positive integer"), ({"rank": 0}, "rank must be a positive"),
    ({"in_features": 2.5}, "in_features must be"), ({"init": "orthogonal"}, "init must be one of"),
])
def test_bad_layer_config(kwargs: dict, match: str) -> None:
    args = {"in_features": 4, "out_features": 3, "order": 2, "rank": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        TaylorLayer(**args)


def test_bad_model_configs() -> None:
    with pytest.raises(ValueError, match="expects"):
        TaylorLayer(4, 3, 2, 2)(torch.randn(2, 5))
    with pytest.raises(ValueError, match="hidden_dims"):
        TaylorNetConfig(hidden_dims=())
    with pytest.raises(ValueError, match="init must be one of"):
        TaylorNetConfig(init="he")
    with pytest.raises(ValueError, match="not divisible by patch_size"):
        TaylorMixerConfig(img_size=28, patch_size=5)
    with pytest.raises(ValueError, match="token_rank"):
        TaylorMixerConfig(token_rank=0)
    with pytest.raises(TypeError, match="unknown TaylorNet options"):
        build_taylornet(depth=3)
    with pytest.raises(ValueError, match="expects input"):
        polyfhe.create_model("taylor_mixer")(torch.randn(1, 1, 32, 32))


# --- fold, analyzer -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["taylor_mixer", "taylornet", "rtaylornet"])
def test_fold_is_exact_in_float64(name: str) -> None:
    model = _randomise(polyfhe.create_model(name), std=0.1).double()
    folded = fold(model)
    assert not any(isinstance(m, Affine) for m in folded.modules())
    x = torch.rand(3, *model.input_shape, dtype=torch.float64)
    with torch.no_grad():
        ref, got = model.eval()(x), folded(x)
    err = float((ref - got).abs().max() / ref.abs().max())
    assert err <= 1e-9


def _analysis(model: nn.Module):
    from polyfhe.exporters.onnx import export_onnx

    with tempfile.TemporaryDirectory() as tmp:
        return export_onnx(_randomise(model, std=0.1), Path(tmp) / "m.onnx").analysis


@pytest.mark.parametrize("order, layers", [(2, 1), (3, 1), (4, 1), (2, 2), (3, 2), (2, 3)])
@pytest.mark.parametrize("reducible", [False, True])
def test_analyzer_degree_is_order_to_the_layers(order: int, layers: int, reducible: bool) -> None:
    model = build_taylornet(img_size=8, hidden_dims=(6,) * layers, order=order, rank=3, reducible=reducible)
    report = _analysis(model)
    assert report.polynomial
    assert report.degree == order**layers == model.cfg.degree
    assert report.mult_depth == layers * math.ceil(math.log2(order))  # balanced product tree per layer


@pytest.mark.parametrize("depth, order", [(1, 2), (2, 2), (1, 3)])
def test_analyzer_degree_of_taylor_mixer(depth: int, order: int) -> None:
    model = build_taylor_mixer(img_size=8, patch_size=2, dim=8, depth=depth, order=order, token_rank=3,
                               channel_rank=3)
    report = _analysis(model)
    assert report.polynomial and report.degree == order ** (2 * depth) == model.cfg.degree


# --- encrypted inference -------------------------------------------------------------------------------------

@pytest.mark.fhe
@pytest.mark.parametrize("reducible", [False, True], ids=["taylornet", "rtaylornet"])
def test_tiny_taylornet_encrypted_matches_plaintext(reducible: bool) -> None:
    from ckks_testlib import accuracy, digits, encrypted_and_plain, train

    torch.manual_seed(0)
    model = train(build_taylornet(img_size=8, hidden_dims=(16,), order=2, rank=4,
                                 reducible=reducible), epochs=30, lr=0.01)
    _, _, x, y = digits()
    acc = accuracy(model, x, y)
    assert acc > 0.8  # a trained decision, not chance
    enc, plain = encrypted_and_plain(model, x)
    err = float(np.abs(enc - plain).max())
    log.info("tiny TaylorNet (reducible=%s) on CKKS: accuracy %.3f, %d samples, max abs error %.3g",
             reducible, acc, len(enc), err)
    assert len(enc) >= 16
    assert np.array_equal(enc.argmax(1), plain.argmax(1))
    assert err < 1e-2 * max(1.0, float(np.abs(plain).max()))


@pytest.mark.fhe
def test_tiny_taylor_mixer_encrypted_matches_plaintext() -> None:
    """Token- and channel-mixing Taylor layers with Affine pre-norms (degree 16) run encrypted like plaintext."""
    from ckks_testlib import accuracy, digits, encrypted_and_plain, train

    torch.manual_seed(0)
    # 12 epochs reach about 0.94 (30 gave 0.96 for 12 s more); the encrypted part is what this test is about
    model = train(build_taylor_mixer(img_size=8, patch_size=2, dim=8, token_rank=3, channel_rank=3), epochs=12,
                  lr=0.01, batch_size=64)
    _, _, x, y = digits()
    acc = accuracy(model, x, y)
    assert acc > 0.6  # a trained decision, not chance (0.1)
    enc, plain = encrypted_and_plain(model, x)
    err = float(np.abs(enc - plain).max())
    log.info("tiny Taylor-Mixer on CKKS: accuracy %.3f, %d samples, max abs error %.3g", acc, len(enc), err)
    assert len(enc) >= 16
    assert np.array_equal(enc.argmax(1), plain.argmax(1))
    assert err < 1e-2 * max(1.0, float(np.abs(plain).max()))
