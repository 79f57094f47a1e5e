"""Adjacent independent linear steps run as one group (shared pool rounds) and compute what they compute alone."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

import polyfhe
from polyfhe.runtime import execute as ex


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


def test_a_group_is_every_linear_step_whose_inputs_are_ready():
    _, program = _program()
    steps = program.manifest.steps
    ops = [s.op for s in steps]
    first, mul = ops.index("linear"), ops.index("mul")
    have = {0: "input"}
    assert ex._ready_linear_steps(steps, first, have, set()) == [first, first + 1]  # A x and B x
    assert ex._ready_linear_steps(steps, first, have, {first + 1}) == [first]  # already run ahead
    assert ex._ready_linear_steps(steps, mul, have, set()) == [mul]  # not a linear step
    last = len(steps) - 1
    assert ex._ready_linear_steps(steps, last, have, set()) == [last]  # C needs the product: not ready
    # a later step that reads only ready registers joins the group, ahead of its place
    assert ex._ready_linear_steps(steps, first, {0: "input", steps[mul].out: "product"}, set()) == [
        first, first + 1, last]


def test_a_group_computes_exactly_what_its_steps_compute_one_by_one(monkeypatch):
    x, program = _program()
    grouped = program.run_plain(x)
    monkeypatch.setattr(ex, "_ready_linear_steps", lambda steps, start, regs, computed: [start])
    alone = program.run_plain(x)
    np.testing.assert_array_equal(grouped, alone)
    torch.manual_seed(0)  # the weights _program exported
    model = _TwoBranches().eval()
    want = model(torch.from_numpy(x).float()).detach().numpy()
    np.testing.assert_allclose(grouped, want, atol=1e-4)
