"""polyfhe.polynomialize: activations become fitted polynomials, the copy is polynomial and runs encrypted."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from ckks_testlib import digits
from torch import nn

import polyfhe
from polyfhe.models.layers.poly_activation import PolyActivation, fit_polynomial, power_tree
from polyfhe.program.params import CKKSParams
from polyfhe.training.polynomialize import PolynomializeError, PolynomializeReport

# INSECURE on purpose: a small ring that holds the tiny CNN's levels and encrypts in milliseconds
SMALL_RING = CKKSParams(8192, (60, 40, 40, 40, 40, 40, 60), 40, security="none")


def _relu_cnn(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(64, 16), nn.GELU(), nn.Linear(16, 10))


def _trained_relu_cnn() -> nn.Module:
    x, y, _, _ = digits()
    model = _relu_cnn()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    xt, yt = torch.tensor(x, dtype=torch.float32), torch.tensor(y)
    for _ in range(4):
        for i in range(0, len(xt), 128):
            opt.zero_grad()
            F.cross_entropy(model(xt[i:i + 128]), yt[i:i + 128]).backward()
            opt.step()
    return model.eval()


def test_fit_polynomial_is_exact_on_a_polynomial_and_least_squares_on_relu():
    u = np.linspace(-1, 1, 101)
    np.testing.assert_allclose(fit_polynomial(u, 0.5 - u + 2 * u**2, 2), [0.5, -1.0, 2.0], atol=1e-12)
    coeffs = fit_polynomial(u, np.maximum(u, 0), 2)
    assert coeffs[1] == pytest.approx(0.5, abs=1e-9) and coeffs[2] > 0  # ReLU = x/2 + |x|/2: odd part exact
    with pytest.raises(ValueError, match="degree"):
        fit_polynomial(u, u, 0)


def test_poly_activation_evaluates_its_polynomial_with_a_product_tree():
    act = PolyActivation([1.0, -2.0, 0.5, 0.25, 0.125], scale=2.0)
    x = torch.linspace(-3, 3, 13)
    u = x / 2
    want = 1 - 2 * u + 0.5 * u**2 + 0.25 * u**3 + 0.125 * u**4
    torch.testing.assert_close(act(x), want)
    assert act.degree == 4 and len(power_tree(u, 4)) == 4


def test_activations_and_max_pooling_are_replaced_in_a_copy():
    model = _relu_cnn()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, _, _, _ = digits()
    poly = polyfhe.polynomialize(model, data=torch.tensor(x[:128], dtype=torch.float32))
    assert [type(m).__name__ for m in model][2:4] == ["ReLU", "MaxPool2d"], "the input model was modified"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert isinstance(poly[2], PolyActivation) and isinstance(poly[3], nn.AvgPool2d)
    assert isinstance(poly[6], PolyActivation)
    report = poly.polynomialize_report
    assert [(r.path, r.was) for r in report.replaced] == [("2", "ReLU"), ("3", "MaxPool2d"), ("6", "GELU")]
    assert report.epochs == 0 and report.accuracy_final is None  # no labels: fit only
    assert PolynomializeReport.from_dict(report.to_dict()) == report
    # the fit tracks the activation on the values that reach it: far better than x*x would
    relu_fit = report.replaced[0]
    assert relu_fit.fit_rmse is not None and relu_fit.fit_rmse < 0.1 * relu_fit.scale


@pytest.mark.fhe
def test_polynomialized_model_is_polynomial_and_its_encrypted_run_matches_the_plain_one():
    """The acceptance path: a trained ReLU CNN, polynomialized and fine-tuned on digits, analyses as
    polynomial, compiles for CKKS and decrypts to what the program computes in plaintext."""
    x, y, x_test, y_test = digits()
    model = _trained_relu_cnn()
    poly = polyfhe.polynomialize(model, data=(x, y), eval_data=(x_test, y_test), epochs=2, lr=1e-2)
    report = poly.polynomialize_report
    assert report.epochs == 2 and report.accuracy_original > 0.8
    assert report.accuracy_final > report.accuracy_fitted - 0.02 and report.accuracy_final > 0.8
    analysis = polyfhe.analyze(polyfhe.export(poly, target="onnx", path=_tmp_onnx(), input_shape=(1, 8, 8)))
    assert analysis.polynomial and analysis.degree == 4 and analysis.mult_depth == 2
    prog = polyfhe.export(poly, target="ckks", calibration=x[:64], input_shape=(1, 8, 8), params=SMALL_RING,
                          allow_insecure=True)
    client = prog.client()
    server = prog.server(client.public_context())
    rows = x_test[:prog.manifest.samples_per_ciphertext]
    encrypted = client.decrypt(server.run(client.encrypt(rows)))
    plain = prog.run_plain(rows)
    with torch.no_grad():
        torch_out = poly(torch.tensor(rows, dtype=torch.float32)).numpy()
    np.testing.assert_allclose(plain, torch_out, atol=1e-3 * np.abs(torch_out).max())
    np.testing.assert_allclose(encrypted, plain, atol=1e-2 * np.abs(plain).max())
    assert (encrypted.argmax(1) == plain.argmax(1)).mean() >= 0.9


def _tmp_onnx():
    import tempfile
    from pathlib import Path

    return Path(tempfile.mkdtemp(prefix="polyfhe-test-")) / "poly.onnx"


def test_square_init_and_no_data_fit_on_a_range():
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.SiLU(), nn.Linear(8, 3))
    square = polyfhe.polynomialize(model, init="square")
    torch.testing.assert_close(square[2](torch.tensor([3.0])), torch.tensor([9.0]))
    ranged = polyfhe.polynomialize(model, input_range=(-2.0, 2.0))
    record = ranged.polynomialize_report.replaced[0]
    assert record.was == "SiLU" and record.scale == 2.0 and record.fit_rmse < 0.1


class _FunctionalRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(F.relu(self.body(x.flatten(1))))


def test_functional_activations_and_softmax_are_refused_by_name():
    x = torch.rand(8, 1, 4, 4)
    with pytest.raises(PolynomializeError, match=r"<model> calls relu.*modules only"):
        polyfhe.polynomialize(_FunctionalRelu(), data=x)
    with pytest.raises(PolynomializeError, match=r"3 \(Softmax\).*no polynomial stand-in"):
        polyfhe.polynomialize(nn.Sequential(nn.Flatten(), nn.Linear(16, 3), nn.ReLU(), nn.Softmax(1)), data=x)
    with pytest.raises(PolynomializeError, match=r"maxpool='avg'"):
        polyfhe.polynomialize(nn.Sequential(nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4, 2)), maxpool="error")


def test_polynomialize_is_a_public_name():
    assert "polynomialize" in polyfhe.__all__ and "polynomialize" in dir(polyfhe)
    assert callable(polyfhe.polynomialize)


def test_a_data_loader_and_a_dataset_are_accepted():
    from torch.utils.data import DataLoader, TensorDataset

    from polyfhe.data.sources import load_digits

    data = load_digits()
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))
    loader = DataLoader(TensorDataset(torch.tensor(data.x_train), torch.tensor(data.y_train)), batch_size=64)
    for source in (loader, data):
        report = polyfhe.polynomialize(model, data=source, epochs=1).polynomialize_report
        assert report.calibration_samples == 512 and report.epochs == 1 and report.accuracy_final is not None


def test_a_report_prints_as_a_few_short_lines() -> None:
    from polyfhe.training.polynomialize import PolynomializeReport, Replacement

    report = PolynomializeReport(
        replaced=tuple(Replacement(f"features.{i}.act", "ReLU()", "Polynomial(degree=2)", (0.1, 0.5, 0.3), 1.0, 0.02)
                       for i in range(6)),
        degree=2, init="least-squares", calibration_samples=512, epochs=3, epoch_losses=(0.9, 0.5, 0.4),
        accuracy_original=0.91, accuracy_fitted=0.62, accuracy_final=0.89, seconds=41.5)
    text = str(report)
    lines = text.splitlines()
    assert len(lines) == 2 + 6 and max(map(len, lines)) <= 120, text
    assert "accuracy: original 91.0%, fitted 62.0%, fine-tuned 89.0%" in text
    assert "features.3.act: ReLU() -> Polynomial(degree=2) (fit rmse 0.02)" in text
