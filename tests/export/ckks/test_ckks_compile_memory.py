"""Compile memory: the lowering's terms stay near the program's size on deep residual models, and an export
over its budget stops with an error that names the node before the memory is taken (``memory.py``)."""

from __future__ import annotations

import logging
import tracemalloc

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from ckks_testlib import bench_module

from polyfhe.data.sources import load_dataset
from polyfhe.exporters.ckks import CKKSExportError, export_ckks
from polyfhe.exporters.ckks.memory import CompileMemoryError, TermBudget, composed_nnz_bound
from polyfhe.program.params import CKKSParams

# 3 levels between bootstraps; INSECURE on purpose (a small ring keeps the plan, and so the test, small)
SMALL_RING = CKKSParams(4096, (60, 40, 40, 40, 60), 40, security="none")


def _user_monet(blocks: int, dim: int, x: np.ndarray) -> torch.nn.Module:
    """The bench's plain-torch MONet-BN (shifts as fixed depthwise convolutions, low-rank branches), with
    BatchNorm statistics from ``x`` and output maps scaled down so that 8 untrained blocks stay finite."""
    with bench_module("user_models") as user_models:
        model = user_models.UserMONetBN(dim=dim, blocks=blocks, hidden1=dim, hidden2=2 * dim)
    with torch.no_grad():
        for block in model.blocks:
            for mu in (block.mu1, block.mu2):
                mu.c.weight.mul_(0.3)
    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.momentum = None  # a cumulative average: one pass over x sets the statistics
    model.train()
    with torch.no_grad():
        model(torch.from_numpy(x))
    return model.eval()


@pytest.fixture(scope="module")
def fashion() -> np.ndarray:
    return load_dataset("fashion-mnist").x_train[:64].astype(np.float32)


def test_composed_nnz_bound_bounds_the_product():
    rng = np.random.default_rng(0)
    for density in (0.01, 0.1, 0.5):
        left = sp.random(40, 60, density=density, format="csr", random_state=rng)
        right = sp.random(60, 30, density=density, format="csr", random_state=rng)
        bound = composed_nnz_bound(left, right)
        assert (left @ right).nnz <= bound <= 40 * 30
    assert composed_nnz_bound(sp.csr_matrix((5, 5)), sp.identity(5, format="csr")) == 0
    assert composed_nnz_bound(sp.identity(5, format="csr"), sp.identity(5, format="csr")) == 5


def test_budget_refuses_before_composing():
    budget = TermBudget(limit=10_000)
    dense = sp.csr_matrix(np.ones((50, 50)))
    with pytest.raises(CompileMemoryError, match=r"node X \(Conv\): composing a 50 x 50 term .* compile memory "
                                                 r"budget of 0\.0 MB; raise it with compile_memory="):
        budget.check_compose(dense, dense, "node X (Conv)")
    TermBudget(limit=None).check_compose(dense, dense, "unbounded")  # no limit: never refuses


def test_deep_user_monet_compiles_in_memory_proportional_to_its_program(fashion, caplog):
    """8 Poly-Blocks (16 products, 33 levels, bootstrapped on a small ring): the lowering used to compose every
    earlier block's register through every later block, the terms growing dense (7.4 GB traced for this
    model, 11x its plaintext bytes); now the compile's traced peak stays within twice the program's plaintext
    bytes, and the program computes the model."""
    model = _user_monet(blocks=8, dim=16, x=fashion)
    caplog.set_level(logging.INFO, logger="polyfhe.exporters.ckks")
    tracemalloc.start()
    try:
        prog = export_ckks(model, calibration=fashion, input_shape=(1, 28, 28), backend="lattigo", params=SMALL_RING,
                           allow_insecure=True, bootstrap="auto")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    info = prog.manifest.info
    assert info["depth"] >= 33 and info["bootstrap"]["count"] > 0
    plaintext_bytes = info["planned"]["plaintext_bytes"]
    assert peak <= 2 * plaintext_bytes, f"compile traced {peak / 1e6:.0f} MB for {plaintext_bytes / 1e6:.0f} MB"
    with torch.no_grad():
        expected = model(torch.from_numpy(fashion[:4])).numpy()
    assert np.abs(prog.run_plain(fashion[:4]) - expected).max() <= 1e-4 * np.abs(expected).max()
    passes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("pass ")]
    assert any(m.startswith("pass lower:") and "peak" in m for m in passes)  # progress: each pass, time, memory


def test_export_over_the_compile_memory_budget_names_the_node(fashion):
    model = _user_monet(blocks=2, dim=8, x=fashion)
    with pytest.raises(CKKSExportError, match=r"node .*: composing a \d+ x \d+ term would take up to .* over the "
                                              r"compile memory budget of 0\.1 MB"):
        export_ckks(model, calibration=fashion, input_shape=(1, 28, 28), compile_memory=100_000)
    with pytest.raises(CKKSExportError, match="compile_memory must be a positive number of bytes"):
        export_ckks(model, calibration=fashion, input_shape=(1, 28, 28), compile_memory=0)
