"""The compiler's pass list: its order, the driver's retry loop, one analysis per export, and each pass writing
only the state fields it declares."""

from __future__ import annotations

import dataclasses
import inspect
import sys

import pytest
import torch
from ckks_testlib import Square, digits
from torch import nn

from polyfhe.exporters.ckks import CKKSExportError, export_ckks, pipeline
from polyfhe.exporters.ckks.passes import Pass
from polyfhe.exporters.ckks.state import CompileOptions, CompileState, SpendForMemory
from polyfhe.program.params import CKKSParams

# INSECURE on purpose: a tiny ring with 3 levels between bootstraps, so a small model bootstraps quickly
SMALL_RING = CKKSParams(4096, (60, 40, 40, 40, 60), 40, security="none")


def _mlp(depth: int = 1) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Flatten(), nn.Linear(64, 16)]
    for _ in range(depth):
        layers += [Square(), nn.Linear(16, 16)]
    return nn.Sequential(*layers, nn.Linear(16, 10)).eval()


def _calibration():
    return digits()[0][:16].reshape(-1, 1, 8, 8)


def test_passes_run_in_their_named_order():
    assert [p.name for p in pipeline.PASSES] == [
        "onnx", "analyze", "lower", "expand_matmuls", "replicate", "ranges", "spend_levels", "parameters", "plan",
        "bootstrap", "counters", "server_memory", "program"]
    assert [p.name for p in pipeline.PASSES[:pipeline.FRONT]] == ["onnx", "analyze"]


def test_a_retry_runs_as_a_loop_and_stops(monkeypatch):
    """A pass that asks for another try every time gets MAX_TRIES tries, then a refusal; the ONNX export and
    the lowering of the same sites are not repeated."""
    tries, lowered = [], []

    def always_over(state: CompileState) -> None:
        tries.append(state.memory_spend)
        raise SpendForMemory("over budget", {"factored": [], "reason": "memory"})

    from polyfhe.exporters.ckks.passes import lower as lower_pass
    from polyfhe.exporters.onnx import export_onnx

    exports = []
    monkeypatch.setattr("polyfhe.exporters.onnx.export_onnx", lambda *a, **k: exports.append(1) or export_onnx(*a, **k))
    real_lower = lower_pass.lower_onnx
    monkeypatch.setattr(lower_pass, "lower_onnx", lambda *a: lowered.append(1) or real_lower(*a))
    passes = tuple(Pass(p.name, always_over, ()) if p.name == "server_memory" else p for p in pipeline.PASSES)
    monkeypatch.setattr(pipeline, "PASSES", passes)
    with pytest.raises(CKKSExportError, match=f"no program after {pipeline.MAX_TRIES} tries"):
        export_ckks(_mlp(), calibration=_calibration(), input_shape=(1, 8, 8))
    assert len(tries) == pipeline.MAX_TRIES and tries[0] is None and tries[1] == {"factored": [], "reason": "memory"}
    assert len(exports) == 1 and len(lowered) == 1


@pytest.mark.parametrize("as_onnx", [False, True])
def test_the_analyzer_runs_once_per_export(as_onnx, monkeypatch):
    import polyfhe.analysis
    import polyfhe.exporters.onnx as onnx_export

    calls = []
    real = polyfhe.analysis.analyze

    def counted(model):
        calls.append(1)
        return real(model)

    monkeypatch.setattr(polyfhe.analysis, "analyze", counted)
    monkeypatch.setattr(onnx_export, "analyze", counted)
    model = _mlp()
    if as_onnx:
        from polyfhe.exporters.ckks import to_onnx_model

        model = to_onnx_model(model, (1, 8, 8))[0]
        calls.clear()
    export_ckks(model, calibration=_calibration(), input_shape=(1, 8, 8))
    assert len(calls) == 1


def _state_fields(state: CompileState) -> dict:
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}


CASES = {
    "seal": (lambda: _mlp(), {}),
    "lattigo bootstrapped": (lambda: _mlp(depth=3),
                             {"backend": "lattigo", "params": SMALL_RING, "allow_insecure": True,
                              "bootstrap_memory": 10**12}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_pass_writes_only_the_fields_it_declares(case):
    build, kwargs = CASES[case]
    state = CompileState(model=build(), options=CompileOptions(calibration=_calibration(), input_shape=(1, 8, 8),
                                                               **kwargs))
    written = set()
    for step in pipeline.PASSES:
        before = _state_fields(state)
        step.run(state)
        changed = {name for name, value in _state_fields(state).items() if value is not before[name]}
        assert changed <= set(step.writes), f"{step.name} wrote {changed - set(step.writes)}"
        written |= changed
        doc = inspect.getdoc(sys.modules[step.run.__module__])
        assert doc.startswith(f"Pass ``{step.name}``") and all(f"``{f}``" in doc for f in step.writes)
    assert state.program is not None and {"proto", "circuit", "params", "plan", "planned", "program"} <= written
    assert ("boot_info" in written) == (case == "lattigo bootstrapped")


def test_a_polynomial_graph_the_compiler_does_not_lower_is_refused_by_name():
    """Gemm of two encrypted operands is polynomial (degree 2), but not lowered: the analyze pass says so."""
    import numpy as np
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0]),
             helper.make_node("Gemm", ["x", "xt"], ["y"], name="gemm_xx")]
    graph = helper.make_graph(nodes, "gemm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(CKKSExportError, match=r"is polynomial \(degree 2\) but the CKKS compiler does not lower "
                                              r"every node yet: gemm_xx \(Gemm\)"):
        export_ckks(proto, calibration=np.random.default_rng(0).random((4, 4), dtype=np.float32),
                    input_shape=(4,))
