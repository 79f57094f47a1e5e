"""What a person sees of a CKKS program: a one-line ``repr``, a ``summary()`` that stays a dict and prints as a
table, and ``run_plain`` (the simulation mode) taking one sample or any batch, numpy or torch."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from ckks_testlib import Square
from torch import nn

import polyfhe

SHAPE = (3, 2, 2)  # a leading axis other than 1: one sample must not be read as a batch of three


@pytest.fixture(scope="module")
def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 6), Square(), nn.Linear(6, 3)).eval()


@pytest.fixture(scope="module")
def x() -> np.ndarray:
    return np.random.default_rng(0).random((40, *SHAPE))


@pytest.fixture(scope="module", params=["single", "batch"])
def program(request, model, x):
    return polyfhe.export(model, target="ckks", calibration=x[:16], input_shape=SHAPE, layout=request.param)


def _torch(model, x) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(x, dtype=torch.float32)).numpy().astype(np.float64)


def test_repr_is_one_short_line(program):
    text = repr(program)
    m = program.manifest
    assert "\n" not in text and len(text) < 250
    assert text.startswith(f"CKKSProgram(id={m.program_id}, backend=seal, layout={m.layout}, ")
    for part in (f"N={m.params.poly_modulus_degree}", f"depth={m.depth}", "input=(3, 2, 2)", "outputs=3",
                 f"steps={len(m.steps)}", f"arrays={len(program.arrays)} ("):
        assert part in text
    assert str(program) == text


def test_summary_is_a_dict_that_prints_as_a_table(program):
    summary = program.summary()
    assert isinstance(summary, dict)
    assert summary["program_id"] == program.program_id and summary["output_size"] == 3
    assert json.loads(json.dumps(summary))["layout"] == program.manifest.layout  # dumps like the dict it was
    text = str(summary)
    lines = text.splitlines()
    assert lines[0] == repr(program)
    assert any(line.split() == ["poly_modulus_degree", str(program.params.poly_modulus_degree)] for line in lines)
    assert "{'" not in text  # nested entries are indented, not dumped


def test_run_plain_takes_one_sample_a_batch_or_a_tensor(program, model, x):
    batch = program.run_plain(x)
    assert batch.shape == (len(x), 3)
    np.testing.assert_allclose(batch, _torch(model, x), rtol=1e-4, atol=1e-5)
    one = program.run_plain(x[5])  # shape (3, 2, 2): one sample, not three
    assert one.shape == (1, 3)
    np.testing.assert_allclose(one, batch[5:6], atol=1e-12)
    tensor = torch.tensor(x, dtype=torch.float32, requires_grad=True)
    np.testing.assert_allclose(program.run_plain(tensor), batch, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(program.run_plain(x.reshape(len(x), -1)), batch, atol=1e-12)  # flat rows
    assert program.run_plain(x[:0]).shape == (0, 3)


def test_run_plain_runs_batches_larger_than_a_ciphertext(program, x):
    many = np.concatenate([x] * (program.manifest.samples_per_query // len(x) + 2))
    assert len(many) > program.manifest.samples_per_query
    got = program.run_plain(many)
    np.testing.assert_allclose(got, np.concatenate([program.run_plain(x)] * (len(many) // len(x))), atol=1e-12)


def test_run_plain_says_what_shape_it_takes(program):
    with pytest.raises(ValueError, match=r"neither one sample of shape \(3, 2, 2\) \(12 values\) nor a batch"):
        program.run_plain(np.zeros((2, 5)))
