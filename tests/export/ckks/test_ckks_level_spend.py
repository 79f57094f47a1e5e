"""Spending levels: depthwise convolutions computed on their own when the ring has levels to spare.

The models are plain torch code, as users write them: a CPolyNeXt-like block whose depthwise 3x3 conv sits
between a product and a channel map. Correctness is checked without encryption (``run_plain`` executes the
compiled steps on plaintext slot vectors) and against the float64 torch model.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from ckks_testlib import Square, digits, train
from torch import nn

import polyfhe
from polyfhe.exporters.ckks import spend, to_onnx_model
from polyfhe.exporters.ckks.lower import factoring_sites, lower_onnx
from polyfhe.exporters.ckks.plan import plan_single
from polyfhe.program.params import ParameterError, choose_params, max_levels


class ConsolidationBlock(nn.Module):
    """Patch embedding -> 1x1 expansion -> x^2 -> depthwise 3x3 -> 1x1 projection -> x^2 -> linear head."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 2, stride=2)
        self.expand = nn.Conv2d(8, width, 1)
        self.square = Square()
        self.depthwise = nn.Conv2d(width, width, 3, padding=1, groups=width, bias=False)
        self.bn = nn.BatchNorm2d(width)
        self.project = nn.Conv2d(width, 8, 1)
        self.head = nn.Linear(8 * 16, 10)

    def forward(self, x):
        h = self.square(self.expand(self.stem(x)))
        h = self.project(self.bn(self.depthwise(h)))
        return self.head(torch.flatten(self.square(h), 1))


@pytest.fixture(scope="module")
def block():
    torch.manual_seed(0)
    model = train(ConsolidationBlock(), epochs=5, lr=0.005)
    proto, _ = to_onnx_model(model, (1, 8, 8))
    return model, proto


def _diagonals(circuit) -> int:
    return plan_single(circuit, 4096).stats["plaintext_diagonals"]


def test_factoring_sites_are_spatial_grouped_convolutions(block):
    _, proto = block
    names = {n.name: n for n in proto.graph.node}
    sites = factoring_sites(proto)
    assert len(sites) == 1 and "depthwise" in sites[0]
    assert names[sites[0]].op_type == "Conv"  # the 1x1 and the dense 2x2 convolutions are no sites


def test_a_factored_convolution_costs_a_level_and_saves_diagonals(block):
    _, proto = block
    merged = lower_onnx(proto)
    factored = lower_onnx(proto, frozenset(factoring_sites(proto)))
    assert factored.depth == merged.depth + 1
    assert _diagonals(factored) < _diagonals(merged)
    x = digits()[2][:16].reshape(-1, 1, 8, 8)
    np.testing.assert_allclose(factored.evaluate(x), merged.evaluate(x), rtol=1e-10, atol=1e-10)


def test_no_level_is_spent_without_budget_or_sites(block):
    _, proto = block
    merged = lower_onnx(proto)
    kept = spend.spend_levels(proto, merged, budget=merged.depth)
    assert kept.circuit is merged and kept.factored == ()
    assert kept.to_info()["spent"] == 0
    plain = onnx.helper.make_model(onnx.helper.make_graph(
        [onnx.helper.make_node("Mul", ["x", "x"], ["y"], name="sq")], "sq",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])]))
    assert spend.spend_levels(plain, lower_onnx(plain), budget=10).factored == ()


def test_spending_needs_a_clear_saving(block, monkeypatch):
    _, proto = block
    merged = lower_onnx(proto)
    monkeypatch.setattr(spend, "MIN_SAVING", 2.0)  # no saving is that large
    assert spend.spend_levels(proto, merged, budget=merged.depth + 3).factored == ()
    monkeypatch.setattr(spend, "MIN_SAVING", -1.0)  # any circuit that fits is taken
    taken = spend.spend_levels(proto, merged, budget=merged.depth + 3)
    assert taken.factored and taken.circuit.depth == merged.depth + 1
    assert taken.to_info() == {"lower_bound": merged.depth, "budget": merged.depth + 3, "spent": 1,
                               "factored": list(taken.factored), "estimated_cost": taken.estimated_cost}
    too_tight = spend.spend_levels(proto, merged, budget=merged.depth)
    assert too_tight.factored == ()


def test_exported_program_with_spent_levels_computes_the_model(block, monkeypatch):
    model, _ = block
    monkeypatch.setattr(spend, "MIN_SAVING", -1.0)
    x_train, _, x_test, _ = digits()
    calibration = x_train[:128].reshape(-1, 1, 8, 8)
    program = polyfhe.export(model, target="ckks", calibration=calibration, input_shape=(1, 8, 8))
    info = program.manifest.info
    assert info["level_spend"]["spent"] == 1
    assert program.manifest.depth == info["analyzer"]["levels"] + 1  # the analyzer's bound, and what was spent
    assert program.params.levels >= program.manifest.depth and program.params.scale_bits >= spend.MIN_SPEND_SCALE_BITS
    x = x_test[:8].reshape(-1, 1, 8, 8)
    with torch.no_grad():
        expected = model.double()(torch.tensor(x)).numpy()
    model.float()
    got = program.run_plain(x)
    assert np.abs(got - expected).max() <= 1e-6 * max(1.0, np.abs(expected).max())
    merged = polyfhe.export(model, target="ckks", calibration=calibration, input_shape=(1, 8, 8), spend_levels=False)
    assert merged.manifest.depth == info["analyzer"]["levels"] and "level_spend" not in merged.manifest.info


@pytest.mark.parametrize("ring", [8192, 16384, 32768])
@pytest.mark.parametrize("scale_bits", [27, 31, 40])
def test_max_levels_is_what_choose_params_fits(ring, scale_bits):
    levels = max_levels(ring, 50.0, scale_bits)
    params = choose_params(levels, 1, 50.0, scale_bits=scale_bits, poly_modulus_degree=ring)
    assert params.levels == levels
    with pytest.raises(ParameterError):
        choose_params(levels + 1, 1, 50.0, scale_bits=scale_bits, poly_modulus_degree=ring)
