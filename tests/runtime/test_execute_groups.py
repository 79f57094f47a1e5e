"""Adjacent independent linear steps (shared pool rounds) and products (a worker each) run as one group and
compute what they compute alone."""

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
    assert ex._ready_steps(steps, first, have, set()) == [first, first + 1]  # A x and B x
    assert ex._ready_steps(steps, first, have, {first + 1}) == [first]  # already run ahead
    assert ex._ready_steps(steps, mul, have, set()) == [mul]  # the only product
    last = len(steps) - 1
    assert ex._ready_steps(steps, last, have, set()) == [last]  # C needs the product: not ready
    # a later step that reads only ready registers joins the group, ahead of its place
    assert ex._ready_steps(steps, first, {0: "input", steps[mul].out: "product"}, set()) == [
        first, first + 1, last]


def test_a_group_computes_exactly_what_its_steps_compute_one_by_one(monkeypatch):
    x, program = _program()
    grouped = program.run_plain(x)
    monkeypatch.setattr(ex, "_ready_steps", lambda steps, start, regs, computed: [start])
    alone = program.run_plain(x)
    np.testing.assert_array_equal(grouped, alone)
    torch.manual_seed(0)  # the weights _program exported
    model = _TwoBranches().eval()
    want = model(torch.from_numpy(x).float()).detach().numpy()
    np.testing.assert_allclose(grouped, want, atol=1e-4)


class _TwoProducts(nn.Module):
    """x -> (A x) * (B x) + (C x) * (D x): two products whose operands are all ready at once."""

    def __init__(self) -> None:
        super().__init__()
        self.maps = nn.ModuleList(nn.Linear(64, 24) for _ in range(4))

    def forward(self, x):
        a, b, c, d = (m(x.flatten(1)) for m in self.maps)
        return a * b + c * d


def test_independent_products_run_as_one_group(monkeypatch):
    torch.manual_seed(0)
    model = _TwoProducts().eval()
    x = np.random.default_rng(0).random((8, 1, 8, 8))
    program = polyfhe.export(model, target="ckks", calibration=x, input_shape=(1, 8, 8))
    steps = program.manifest.steps
    muls = [i for i, s in enumerate(steps) if s.op == "mul"]
    have = {0: "input", **{s.out: "ready" for s in steps if s.op == "linear" and set(s.reads()) == {0}}}
    assert len(muls) == 2 and ex._ready_steps(steps, muls[0], have, set()) == muls
    grouped = program.run_plain(x)
    monkeypatch.setattr(ex, "_ready_steps", lambda steps, start, regs, computed: [start])
    np.testing.assert_array_equal(grouped, program.run_plain(x))
    want = model(torch.from_numpy(x).float()).detach().numpy()
    np.testing.assert_allclose(grouped, want, atol=1e-4)
