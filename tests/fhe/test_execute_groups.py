"""Adjacent independent linear steps run as one group (shared pool rounds) and compute what they compute alone."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

import polyfhe
from polyfhe.fhe import execute as ex


class _TwoBranches(nn.Module):
    """x -> (A x) * (B x) -> C: two maps read the same register, then a chain."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 24), nn.Linear(64, 24), nn.Linear(24, 5)

    def forward(self, x):
        x = x.flatten(1)
        return self.c(self.a(x) * self.b(x))


def _program():
    torch.manual_seed(0)
    x = np.random.default_rng(0).random((8, 1, 8, 8))
    return x, polyfhe.export(_TwoBranches().eval(), target="ckks", calibration=x, input_shape=(1, 8, 8))


def test_groups_are_runs_of_linear_steps_that_do_not_read_each_other():
    _, program = _program()
    steps = program.manifest.steps
    ops = [s.op for s in steps]
    first = ops.index("linear")
    assert ex._independent_linear_run(steps, first) == 2  # A x and B x
    mul = ops.index("mul")
    assert ex._independent_linear_run(steps, mul) == 1  # not a linear step
    assert ex._independent_linear_run(steps, len(steps) - 1) == 1  # C reads the product


def test_a_group_computes_exactly_what_its_steps_compute_one_by_one(monkeypatch):
    x, program = _program()
    grouped = program.run_plain(x)
    monkeypatch.setattr(ex, "_independent_linear_run", lambda steps, start: 1)
    alone = program.run_plain(x)
    np.testing.assert_array_equal(grouped, alone)
    torch.manual_seed(0)  # the weights _program exported
    model = _TwoBranches().eval()
    want = model(torch.from_numpy(x).float()).detach().numpy()
    np.testing.assert_allclose(grouped, want, atol=1e-4)
