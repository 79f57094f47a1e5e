"""Plaintexts encoded before the first query (``polyfhe/engines/seal/prewarm.py``): the first query then encodes nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import polyfhe
from polyfhe.engines.seal.prewarm import warm_plaintexts


class _Square(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x


class _ConvNet(nn.Module):
    """Written as users write one: a strided stem, BN, a residual Hadamard branch (ct x ct at a lower level than
    the residual it is added to), average pooling and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.spatial = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.gate = nn.Conv2d(8, 8, 1)
        self.proj = nn.Conv2d(8, 8, 1)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bn(self.stem(x))
        x = x + self.proj(self.spatial(x) * self.gate(x))
        return self.head(x.mean(dim=(2, 3)))


def _program(model: nn.Module, **kwargs):
    torch.manual_seed(0)
    x = np.random.default_rng(0).random((8, 1, 8, 8))
    model.eval()
    return x, polyfhe.export(model, target="ckks", calibration=x, input_shape=(1, 8, 8), **kwargs)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), _Square(), nn.Linear(16, 4))


def _conv() -> nn.Module:
    torch.manual_seed(0)
    model = _ConvNet()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-0.2, 0.2)
        model.bn.running_var.uniform_(0.5, 1.5)
    return model


@pytest.mark.fhe
@pytest.mark.parametrize("make", [_mlp, _conv], ids=["mlp-interleaved", "conv-residual-product"])
def test_a_warmed_program_answers_its_first_query_without_encoding(make):
    x, program = _program(make())
    stats = warm_plaintexts(program)
    planned = program.manifest.info["planned"]
    assert stats.encoded == planned["encodes_cold"] == stats.held > 0  # every diagonal and bias, once
    assert warm_plaintexts(program).encoded == 0  # a second warm-up finds them all
    client = program.client()
    server = program.server(client.public_context())
    lanes = program.manifest.samples_per_ciphertext
    out = client.decrypt(server.run(client.encrypt(x[:lanes])))
    counts = server.last_run.counts
    assert counts["encodes"] - counts["scalar_encodes"] == 0  # the first query found every plaintext held
    assert counts["plaintext_hits"] == planned["encodes_cold"]
    assert np.abs(out - program.run_plain(x[:lanes])).max() < 1e-3


def test_engines_that_encode_at_load_and_the_batch_layout_are_left_alone():
    _, batch = _program(_mlp(), layout="batch")
    assert warm_plaintexts(batch).encoded == 0 and len(batch.shared.plaintexts) == 0
