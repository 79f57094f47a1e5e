"""Independent products run on the pool's workers at once where their SEAL calls release the GIL (the native
path), and compute the same bytes as run one after another or through TenSEAL's bindings."""

from __future__ import annotations

import dataclasses
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

import polyfhe
from polyfhe.engines.seal.ops import SealOps
from polyfhe.program.ckks_program import CKKSProgram
from polyfhe.runtime import execute as ex

pytestmark = pytest.mark.fhe


class _TwoProducts(nn.Module):
    """x -> (A x) * (B x) + (C x) * (D x): two products whose operands are all ready at once."""

    def __init__(self) -> None:
        super().__init__()
        self.maps = nn.ModuleList(nn.Linear(64, 24) for _ in range(4))

    def forward(self, x):
        a, b, c, d = (m(x.flatten(1)) for m in self.maps)
        return a * b + c * d


@pytest.fixture(scope="module")
def exported():
    torch.manual_seed(0)
    model = _TwoProducts().eval()
    x = np.random.default_rng(0).random((8, 1, 8, 8))
    return x, polyfhe.export(model, target="ckks", calibration=x, input_shape=(1, 8, 8))


def test_products_are_grouped_only_where_the_ops_run_them_without_the_gil(exported):
    _, program = exported
    steps = program.manifest.steps
    muls = [i for i, s in enumerate(steps) if s.op == "mul"]
    assert len(muls) == 2
    have = {0: "input", **{s.out: "ready" for s in steps if s.op == "linear" and set(s.reads()) == {0}}}
    parallel = SimpleNamespace(parallel_products=True, slots=16)
    assert ex._ready_group(steps, muls[0], have, set(), parallel) == muls
    assert ex._ready_group(steps, muls[0], have, {muls[1]}, parallel) == [muls[0]]  # already run ahead
    assert ex._ready_group(steps, muls[0], {0: "input"}, set(), parallel) == [muls[0]]  # operands not ready
    assert ex._ready_group(steps, muls[0], have, set(), ex.NumpyOps(16)) == [muls[0]]
    assert ex.InterleavedOps(parallel, 2).parallel_products  # a wrapper asks the ops it wraps
    first = next(i for i, s in enumerate(steps) if s.op == "linear")
    assert len(ex._ready_group(steps, first, have, set(), parallel)) == 4  # linear steps group as before


def test_grouped_products_compute_the_same_bytes(exported, monkeypatch):
    x, program = exported
    client = program.client()
    context, query = client.public_context(), client.encrypt(x[:4])
    monkeypatch.setenv(ex.THREADS_ENV, "2")
    workers: list[str] = []
    single_mul = ex._single_mul

    def recorded(*args):
        workers.append(threading.current_thread().name)
        return single_mul(*args)

    monkeypatch.setattr(ex, "_single_mul", recorded)  # only grouped products call it through the module
    monkeypatch.setattr(SealOps, "decompose", lambda self, ct: None)  # bytes as the bindings': no hoisting
    answers, counts = {}, {}
    for mode in ("grouped", "one by one", "bindings"):
        fresh = CKKSProgram.create(dataclasses.replace(program.manifest), program.arrays)  # its own plaintexts
        server = fresh.server(context)
        assert server._ops.parallel_products
        if mode == "bindings":
            server._ops.native = None
        with monkeypatch.context() as patch:
            if mode == "one by one":
                patch.setattr(SealOps, "parallel_products", property(lambda self: False))
            answers[mode] = server.run(query)
        counts[mode] = server.last_run.counts
        assert len(workers) == (2 if mode == "grouped" else 0)
        assert all(name.startswith("polyfhe-ckks") for name in workers)  # the pool's workers
        workers.clear()
    assert answers["grouped"] == answers["one by one"] == answers["bindings"]
    assert counts["grouped"] == counts["one by one"] == counts["bindings"]
    assert counts["grouped"]["products"] == 2
    assert np.abs(client.decrypt(answers["grouped"]) - program.run_plain(x[:4])).max() < 1e-3
