"""Fixtures for the server tests: two tiny saved CKKS programs and real server processes on loopback."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from serve_testlib import OTHER, TINY, start_server


def _export(model, calibration: np.ndarray, folder: Path, **kwargs):
    import polyfhe

    program = polyfhe.export(model, target="ckks", calibration=calibration, input_shape=(1, 8, 8), **kwargs)
    program.save(folder)
    return program


@pytest.fixture(scope="session")
def programs(tmp_path_factory) -> dict:
    """Programs folder with ``tiny`` (64->12->x^2->4, card.json), ``other`` (64->6->x^2->3, another scale)
    and ``broken`` (not a program: the server must skip it and serve the others)."""
    import torch
    from torch import nn

    class Square(nn.Module):
        def forward(self, x):
            return x * x

    root = tmp_path_factory.mktemp("programs")
    calib = np.random.default_rng(0).random((64, 1, 8, 8)).astype(np.float32)
    torch.manual_seed(0)
    tiny = nn.Sequential(nn.Flatten(), nn.Linear(64, 12), Square(), nn.Linear(12, 4)).eval()
    other = nn.Sequential(nn.Flatten(), nn.Linear(64, 6), Square(), nn.Linear(6, 3)).eval()
    progs = {TINY: _export(tiny, calib, root / TINY), OTHER: _export(other, calib, root / OTHER, scale_bits=35)}
    (root / TINY / "card.json").write_text(json.dumps({"accuracy": 0.875, "dataset": "random 8x8"}))
    (root / "broken").mkdir()
    (root / "broken" / "manifest.json").write_text("{not json")
    assert progs[TINY].params != progs[OTHER].params
    return {"root": root, **progs}


@pytest.fixture(scope="session")
def samples(programs) -> tuple[np.ndarray, np.ndarray]:
    """Eight inputs of ``tiny`` and their plaintext-program logits (the reference for encrypted answers)."""
    x = np.random.default_rng(1).random((8, 1, 8, 8))
    plain = np.concatenate([programs[TINY].run_plain(x[i:i + 1]) for i in range(len(x))])
    return x, plain


def _server_fixture(*flags: str, scope: str = "module"):
    @pytest.fixture(scope=scope)
    def fixture(programs, tmp_path_factory):
        server = start_server(programs["root"], tmp_path_factory.mktemp("log") / "server.log", *flags)
        yield server
        server.stop()

    return fixture


# The main server: generous limits except a 1 MiB ciphertext body (an input is about 0.4 MB).
server = _server_fixture("--max-ciphertext-mb", "1", "--max-context-mb", "40", "--max-sessions", "12",
                         scope="session")

# 30 MiB of key budget: one tiny context (about 19 MB) fits, two do not.
budget_server = _server_fixture("--key-budget-mb", "30", "--max-context-mb", "25")
# One session at most, expiring 3 s after its last use.
ttl_server = _server_fixture("--max-sessions", "1", "--session-ttl", "3")
# One worker, no queue, every evaluation 4 s long, requests cut at 3 s.
slow_server = _server_fixture("--max-concurrency", "1", "--max-queue", "0", "--test-eval-delay", "4",
                              "--request-timeout", "3")
