"""``upload_budget``: a program whose public context, sent seeded by the web page, fits a byte budget (150 MB for
the page); its Galois keys are cut to fit and the other rotations composed, and it still computes the same."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from polyfhe.exporters.ckks import CKKSExportError, export_ckks
from polyfhe.program.params import seeded_sizes


class Square(nn.Module):
    def forward(self, x):
        return x * x


@pytest.fixture(scope="module")
def model_and_data():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 12), Square(), nn.Linear(12, 4)).eval()
    return model, np.random.default_rng(0).random((64, 1, 8, 8)).astype(np.float32)


def test_keys_are_cut_to_the_budget_and_the_encrypted_answer_is_unchanged(model_and_data):
    model, calib = model_and_data
    free = export_ckks(model, calibration=calib, input_shape=(1, 8, 8))
    one_key = seeded_sizes(free.params, 1)
    budget = one_key["public_context"] + 2 * one_key["galois_key"]  # room for three Galois keys
    tight = export_ckks(model, calibration=calib, input_shape=(1, 8, 8), upload_budget=budget)
    assert tight.params == free.params
    assert 1 <= len(tight.manifest.galois_steps) <= 3 < len(free.manifest.galois_steps)
    assert seeded_sizes(tight.params, len(tight.manifest.galois_steps))["public_context"] <= budget
    x = np.random.default_rng(1).random((4, 1, 8, 8))
    plain = free.run_plain(x)
    np.testing.assert_allclose(tight.run_plain(x), plain, atol=1e-9)
    client = tight.client()
    server = tight.server(client.public_context())
    encrypted = client.decrypt(server.run(client.encrypt(x)))
    np.testing.assert_allclose(encrypted, plain, atol=1e-3 * max(1.0, float(np.abs(plain).max())))
    assert server.last_run.counts["key_switches"] > server.last_run.counts["rotations"]  # chains of keys


def test_a_budget_below_the_public_and_relinearisation_keys_is_refused_with_sizes(model_and_data):
    model, calib = model_and_data
    with pytest.raises(CKKSExportError, match="relinearisation keys alone take .* MB .* over the 1 MB upload budget"):
        export_ckks(model, calibration=calib, input_shape=(1, 8, 8), upload_budget=10**6)


def test_the_budget_is_for_the_page_and_the_page_runs_seal_programs_only(model_and_data):
    model, calib = model_and_data
    with pytest.raises(CKKSExportError, match="SEAL programs only"):
        export_ckks(model, calibration=calib, input_shape=(1, 8, 8), upload_budget=10**8, backend="lattigo")
