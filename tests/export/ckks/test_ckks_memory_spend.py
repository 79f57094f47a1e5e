"""Spending levels for memory: a bootstrapped program whose server would not fit the memory budget computes its
spatial shifts (and depthwise convolutions) on their own, a level each, instead of merging them into the channel
maps around them, which multiplies those maps' diagonals by the shift's token offsets."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ckks_testlib import ShiftBlocks, digits
from torch import nn

from polyfhe.engines.lattigo.servermem import server_peak_bytes
from polyfhe.exporters.ckks import CKKSExportError, export_ckks, to_onnx_model
from polyfhe.exporters.ckks.lower import lower_onnx, shift_sites
from polyfhe.program.params import CKKSParams
from polyfhe.runtime.execute import run_plain

# 3 levels between bootstraps, on its own ring; INSECURE on purpose (240 bits at N=4096, whose 128-bit bound is 109)
SMALL_RING = CKKSParams(4096, (60, 40, 40, 40, 60), 40, security="none")


class ChannelReorder(nn.Module):
    """Slices along the channel axis only, concatenated in another order: data movement, but no shift."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Conv2d(1, 8, 2, stride=2)
        self.head = nn.Linear(8 * 16, 10)

    def forward(self, x):
        x = self.embed(x).permute(0, 2, 3, 1)
        x = torch.cat([x[..., 4:], x[..., :4]], dim=-1)
        return self.head((x * x).flatten(1))


def _model() -> ShiftBlocks:
    torch.manual_seed(0)
    return ShiftBlocks().eval()


def test_shift_sites_are_the_tensors_a_spatial_shift_moves():
    proto, _ = to_onnx_model(_model(), (1, 8, 8))
    sites = shift_sites(proto)
    assert len(sites) == 4  # U1's and U2's outputs, in each of the two blocks
    producers = {n.name: n for n in proto.graph.node}
    assert all(producers[s].op_type in ("Add", "MatMul", "Gemm") for s in sites)
    reorder, _ = to_onnx_model(ChannelReorder().eval(), (1, 8, 8))
    assert shift_sites(reorder) == []


def test_factoring_the_shifts_trades_levels_for_diagonals():
    proto, _ = to_onnx_model(_model(), (1, 8, 8))
    merged = lower_onnx(proto)
    factored = lower_onnx(proto, frozenset(shift_sites(proto)))
    assert factored.depth > merged.depth
    x = digits()[0][:4].reshape(-1, 1, 8, 8)
    with torch.no_grad():
        reference = _model().double()(torch.from_numpy(x)).numpy()
    for circuit in (merged, factored):  # both compute the model
        out = np.stack([np.asarray(circuit.evaluate(xi[None])).reshape(-1) for xi in x])
        assert np.allclose(out, reference, atol=1e-9 * max(1.0, np.abs(reference).max()))


def _export(budget: int | None):
    x = digits()[0][:32].reshape(-1, 1, 8, 8)
    return export_ckks(_model(), calibration=x, input_shape=(1, 8, 8), backend="lattigo", params=SMALL_RING,
                       allow_insecure=True, bootstrap_memory=budget)


@pytest.fixture(scope="module")
def merged_program():
    return _export(10**12)


def test_a_server_over_budget_computes_its_shifts_on_their_own(merged_program, caplog):
    merged = merged_program.manifest.info
    peak = merged["bootstrap"]["server_memory"]["peak_bytes"]
    assert "memory_spend" not in merged
    with caplog.at_level("WARNING"):
        prog = _export(peak - 1)
    info = prog.manifest.info
    assert "computing 4 spatial convolutions and shifts on their own" in caplog.text
    spend = info["memory_spend"]
    assert spend["reason"] == "memory" and len(spend["factored"]) == 4
    assert spend["merged"]["server_peak_bytes"] == peak and spend["merged"]["diagonals"] == merged["plaintext_diagonals"]
    assert info["plaintext_diagonals"] < merged["plaintext_diagonals"]
    assert info["depth"] > merged["depth"]
    assert info["bootstrap"]["server_memory"]["peak_bytes"] <= peak - 1
    x = digits()[0][:4].reshape(-1, 1, 8, 8)
    with torch.no_grad():
        reference = _model().double()(torch.from_numpy(x)).numpy()
    plain = run_plain(prog.manifest, prog.arrays, x)
    assert np.allclose(plain, reference, atol=1e-6 * max(1.0, np.abs(reference).max()))


def test_a_server_that_fits_no_plan_is_refused_with_both_tries(merged_program):
    peak = merged_program.manifest.info["bootstrap"]["server_memory"]["peak_bytes"]
    with pytest.raises(CKKSExportError, match=r"server would peak near .* with 4 convolutions and shifts computed on "
                                              r"their own, over the .* GB memory budget\. What would fit"):
        _export(peak // 100)


def test_the_refusal_prices_its_bootstraps_from_a_cached_calibration(merged_program, monkeypatch):
    from polyfhe.runtime import bootcost, opcosts

    peak = merged_program.manifest.info["bootstrap"]["server_memory"]["peak_bytes"]
    monkeypatch.setattr(opcosts, "read_cached", lambda engine: None)
    with pytest.raises(CKKSExportError, match=r"`polyfhe cost MODEL --backend lattigo` predicts its latency"):
        _export(peak // 100)
    monkeypatch.setattr(opcosts, "read_cached", lambda engine: object())
    monkeypatch.setattr(bootcost, "bootstrap_seconds", lambda costs, spec, params: 2.5)
    with pytest.raises(CKKSExportError, match=r"its \d+ bootstraps alone would take about \d+ s per query"):
        _export(peak // 100)


def test_server_peak_is_the_larger_of_loading_and_serving():
    loading, serving = server_peak_bytes(0, 4 * 10**9, 10**9)
    assert loading > serving  # no plaintexts: the three copies of the keys while they load dominate
    loading2, serving2 = server_peak_bytes(8 * 10**9, 4 * 10**9, 10**9)
    assert loading2 == loading and serving2 > loading2 and serving2 - serving == pytest.approx(1.25 * 1.3 * 8e9, rel=1e-6)


def test_the_factored_program_runs_encrypted_and_its_server_keeps_no_container(merged_program):
    peak = merged_program.manifest.info["bootstrap"]["server_memory"]["peak_bytes"]
    prog = _export(peak - 1)
    x = digits()[2][:2].reshape(-1, 1, 8, 8)
    client = prog.client()
    server = prog.server(client.public_context())
    lanes = prog.manifest.samples_per_ciphertext
    logits = client.decrypt(server.run(client.encrypt(x[:lanes])))[: len(x[:lanes])]
    plain = run_plain(prog.manifest, prog.arrays, x[:lanes])
    assert np.abs(logits - plain).max() < 0.05 * max(1.0, np.abs(plain).max())
    assert np.array_equal(logits.argmax(1), plain.argmax(1))
    # the model's container went to Go when it loaded; the server keeps only what it checks inputs against
    assert prog.shared.engines["lattigo-lowered"].data == b""
    assert prog.manifest.info["bootstrap"]["count"] >= 1


def test_values_a_bootstrapped_ring_cannot_hold_are_refused_at_export():
    """An untrained deep BN network overflows (values near 1e25 here); the bootstrap's integer postscale would
    be refused by the engine at run time, so the export says what was wrong first."""
    model = _model()
    with torch.no_grad():
        model.c[0].weight.mul_(1e12)
    x = digits()[0][:32].reshape(-1, 1, 8, 8)
    with pytest.raises(CKKSExportError, match=r"values reach \+-.* holds at most \+-4\.5e\+15 at the lowest level a bootstrap reads\. Is the model trained"):
        export_ckks(model, calibration=x, input_shape=(1, 8, 8), backend="lattigo", params=SMALL_RING,
                    allow_insecure=True, bootstrap_memory=10**12)
