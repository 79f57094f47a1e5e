"""``run_plain`` evaluates many ciphertexts' worth of samples in one pass (a row each): the values are exactly those
of one ciphertext at a time, the packing the server sees (issue 60 item 1)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from testlib.ckks_testlib import digits, export_bootstrapping_mlp, square_cnn

from polyfhe.exporters.ckks import export_ckks
from polyfhe.program.slot_layout import pack_single, unpack_single
from polyfhe.runtime import execute as ex


def _one_ciphertext_at_a_time(program, x: np.ndarray) -> np.ndarray:
    """The previous run_plain: every ciphertext's slot vector through the executor alone."""
    m = program.manifest
    flat = x.reshape(len(x), -1)
    lanes = m.samples_per_ciphertext
    outs = []
    for start in range(0, len(flat), lanes):
        chunk = flat[start:start + lanes]
        vec = ex.execute(m, program.arrays, ex.NumpyOps(m.params.slots), pack_single(m, chunk))
        outs.append(unpack_single(m, vec, len(chunk)))
    return np.concatenate(outs)


@pytest.fixture(scope="module")
def programs():
    _, _, x, _ = digits()
    cnn = export_ckks(square_cnn(), calibration=x[:64], input_shape=(1, 8, 8))
    return {"cnn": cnn, "bootstrapping": export_bootstrapping_mlp()}, x


@pytest.mark.parametrize("name", ["cnn", "bootstrapping"])
def test_batched_simulation_equals_one_ciphertext_at_a_time(programs, name, monkeypatch):
    progs, x = programs
    program = progs[name]
    assert program.manifest.layout == "single"
    lanes = program.manifest.samples_per_ciphertext
    batch = np.concatenate([x] * (1 + 3 * lanes // len(x)))[: 3 * lanes + 1]  # 4 ciphertexts, the last with one
    assert len(batch) == 3 * lanes + 1
    reference = _one_ciphertext_at_a_time(program, batch)
    np.testing.assert_array_equal(program.run_plain(batch), reference)
    monkeypatch.setattr(ex, "PLAIN_PASS_VALUES", 2 * program.manifest.params.slots)  # passes of two rows
    np.testing.assert_array_equal(program.run_plain(batch), reference)
    np.testing.assert_array_equal(program.run_plain(batch[:1]), reference[:1])
