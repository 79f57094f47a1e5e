"""``export(target="ckks", calibration=...)`` reads samples from numpy, torch and torch's data containers alike,
and infers a module's input shape from any of them; when it cannot, the error says what to pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ckks_testlib import Square
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import polyfhe
from polyfhe.exporters.ckks import CKKSExportError

SHAPE = (3, 2, 2)  # a leading axis other than 1: a single sample cannot pass for a batch of one


def _mlp() -> nn.Module:
    """No ``input_shape`` attribute: only the calibration data can say what one sample is."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 6), Square(), nn.Linear(6, 3))


@pytest.fixture(scope="module")
def samples() -> np.ndarray:
    return np.random.default_rng(0).random((32, *SHAPE), dtype=np.float32)


@pytest.fixture(scope="module")
def reference(samples):
    return polyfhe.export(_mlp(), target="ckks", calibration=samples)


def test_torch_tensor_calibration_sets_the_input_shape(samples, reference):
    tensor = torch.tensor(samples, requires_grad=True)  # a tensor straight out of a training loop
    prog = polyfhe.export(_mlp(), target="ckks", calibration=tensor)
    assert tuple(prog.manifest.input_shape[1:]) == SHAPE
    assert prog.manifest.info["samples"] == len(samples)
    np.testing.assert_allclose(prog.run_plain(samples), reference.run_plain(samples), atol=1e-9)


@pytest.mark.parametrize("wrap", [
    lambda x: TensorDataset(torch.tensor(x), torch.zeros(len(x))),
    lambda x: DataLoader(TensorDataset(torch.tensor(x), torch.zeros(len(x))), batch_size=10),
    lambda x: DataLoader(torch.tensor(x), batch_size=7),
    lambda x: [torch.tensor(s) for s in x],
    lambda x: list(x),
], ids=["TensorDataset", "DataLoader-xy", "DataLoader-x", "list-of-tensors", "list-of-arrays"])
def test_datasets_and_loaders_become_one_sample_array(samples, wrap):
    from polyfhe.exporters.ckks.samples import calibration_array

    got = calibration_array(wrap(samples))
    assert isinstance(got, np.ndarray) and got.shape == samples.shape
    np.testing.assert_allclose(got, samples)


def test_a_loader_compiles_like_its_array(samples, reference):
    loader = DataLoader(TensorDataset(torch.tensor(samples), torch.zeros(len(samples))), batch_size=8)
    prog = polyfhe.export(_mlp(), target="ckks", calibration=loader)
    assert prog.manifest.input_range == reference.manifest.input_range
    assert prog.manifest.info["samples"] == len(samples)


def test_unreadable_calibration_says_what_is_accepted():
    with pytest.raises(CKKSExportError, match=r"calibration must be .*torch tensor.*DataLoader.*got str"):
        polyfhe.export(_mlp(), target="ckks", calibration="digits", input_shape=SHAPE)


def test_no_shape_anywhere_says_what_to_pass():
    with pytest.raises(ValueError, match=r"input_shape=\(C, H, W\).*calibration data shaped \(N, C, H, W\)"):
        polyfhe.export(_mlp(), target="ckks")
