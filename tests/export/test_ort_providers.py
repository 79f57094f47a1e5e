"""polyfhe.ort_providers: CUDA when onnxruntime offers it, CPU when forced or absent, one log line per provider,
and every session builder of the library (parity check, range profiling, demo accuracy, CKKS shape probe) using it.

No GPU here: the CUDA path is exercised with a faked provider list and a session recorder that runs on CPU.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from polyfhe import ort_providers
from polyfhe.ort_providers import CPU, CUDA, CUDA_OPTIONS, ENV_VAR, choose_providers, inference_session

GPU_BUILD = ["TensorrtExecutionProvider", CUDA, CPU]
REAL_INSTALLED_DISTRIBUTIONS = ort_providers.installed_distributions
CPU_BUILD = ["AzureExecutionProvider", CPU]


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with nothing announced, no device forced, and one installed onnxruntime."""
    monkeypatch.setattr(ort_providers, "_announced", set())
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr(ort_providers, "installed_distributions", lambda: ["onnxruntime"])


class SessionRecorder:
    """Stands in for ``ort.InferenceSession``: records the providers asked for, runs on the real CPU provider,
    and reports the providers a GPU build would have started (``running``)."""

    def __init__(self, running: list[str] | None = None) -> None:
        self.asked: list[list] = []
        self.running = running
        self._real = ort.InferenceSession

    def __call__(self, model, options=None, providers=None):
        self.asked.append(list(providers))
        session = self._real(model, options, providers=[CPU])
        running = self.running if self.running is not None else [ort_providers._provider_name(p) for p in providers]
        session.get_providers = lambda: list(running)
        return session


def _square_model() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["input", "W"], ["h"]), helper.make_node("Mul", ["h", "h"], ["logits"])],
        "square", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, 2])],
        [numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(3, 2) / 4, "W")],
    )
    # IR 8 (opset 17's): a newer onnx stamps its own latest IR version, which an older onnxruntime refuses
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


# ----------------------------------------------------------------------------------------------- the choice
def test_cuda_first_with_tf32_off_when_offered() -> None:
    assert choose_providers(available=GPU_BUILD) == [(CUDA, {"use_tf32": "0"}), CPU]
    assert choose_providers(available=CPU_BUILD) == [CPU]
    first = choose_providers(available=GPU_BUILD)[0][1]
    first["use_tf32"] = "1"  # callers get a copy: the module's defaults stay put
    assert CUDA_OPTIONS == {"use_tf32": "0"}


def test_cpu_forced_by_argument_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert choose_providers("cpu", available=GPU_BUILD) == [CPU]
    monkeypatch.setenv(ENV_VAR, "CPU")
    assert choose_providers(available=GPU_BUILD) == [CPU]
    assert choose_providers("auto", available=GPU_BUILD)[0][0] == CUDA  # the argument wins over the variable


def test_cuda_insisted_on_fails_without_it_and_bad_names_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(RuntimeError, match="offers only.*CPUExecutionProvider.*onnxruntime-gpu"):
        choose_providers("cuda", available=CPU_BUILD)
    with pytest.raises(ValueError, match="device='gpu' unknown; accepted: auto, cpu, cuda"):
        choose_providers("gpu", available=GPU_BUILD)
    monkeypatch.setenv(ENV_VAR, "tpu")
    with pytest.raises(ValueError, match=f"{ENV_VAR}='tpu' unknown"):
        choose_providers(available=GPU_BUILD)


def test_reads_onnxruntimes_own_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ort, "get_available_providers", lambda: GPU_BUILD)
    assert choose_providers()[0][0] == CUDA
    monkeypatch.setattr(ort, "get_available_providers", lambda: CPU_BUILD)
    assert choose_providers() == [CPU]


# ---------------------------------------------------------------------------------------------- the session
def test_real_cpu_session_runs_and_logs_its_provider_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="polyfhe.ort_providers")
    x = np.ones((2, 3), dtype=np.float32)
    first = inference_session(_square_model().SerializeToString(), device="cpu")
    second = inference_session(_square_model().SerializeToString(), device="cpu")
    np.testing.assert_allclose(first.run(None, {"input": x})[0], second.run(None, {"input": x})[0])
    w = numpy_helper.to_array(_square_model().graph.initializer[0])
    np.testing.assert_allclose(first.run(None, {"input": x})[0], (x @ w) ** 2, rtol=1e-6)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"onnxruntime runs on {CPU} ({ENV_VAR}=cpu|cuda|auto to choose)"]


def test_cuda_session_is_announced_and_a_silent_fallback_is_not(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="polyfhe.ort_providers")
    monkeypatch.setattr(ort_providers, "available_providers", lambda: GPU_BUILD)
    recorder = SessionRecorder()
    monkeypatch.setattr(ort, "InferenceSession", recorder)
    inference_session(_square_model().SerializeToString())
    assert recorder.asked == [[(CUDA, {"use_tf32": "0"}), CPU]]
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [f"onnxruntime runs on {CUDA}"]

    caplog.clear()
    recorder.running = [CPU]  # CUDA asked for, but its libraries did not load: onnxruntime runs on CPU silently
    for _ in range(2):
        inference_session(_square_model().SerializeToString())
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "runs on CPUExecutionProvider" in warnings[0].getMessage()
    assert sum("onnxruntime runs on CPUExecutionProvider" in r.getMessage() for r in caplog.records) == 1


def test_both_distributions_installed_is_named_with_the_fix(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(ort_providers, "installed_distributions", lambda: ["onnxruntime", "onnxruntime-gpu"])
    inference_session(_square_model().SerializeToString(), device="cpu")
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "onnxruntime and onnxruntime-gpu" in warning
    assert "pip uninstall -y onnxruntime onnxruntime-gpu && pip install onnxruntime-gpu" in warning


def test_installed_distributions_reads_package_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    def fake(name: str):
        if name == "onnxruntime-gpu":
            return object()
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", fake)
    assert REAL_INSTALLED_DISTRIBUTIONS() == ["onnxruntime-gpu"]


# ------------------------------------------------------------------------------ every caller goes through it
def test_library_sessions_ask_for_cuda_and_the_shape_probe_stays_on_cpu(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import torch

    from polyfhe.calibration import profile_onnx_ranges
    from polyfhe.commands.demo import onnx_accuracy
    from polyfhe.exporters.ckks.lower import lower_onnx
    from polyfhe.exporters.onnx import export_onnx

    monkeypatch.setattr(ort_providers, "available_providers", lambda: GPU_BUILD)
    recorder = SessionRecorder()
    monkeypatch.setattr(ort, "InferenceSession", recorder)
    cuda_first = [(CUDA, {"use_tf32": "0"}), CPU]

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3, 2))
    exported = export_onnx(model, tmp_path / "m.onnx", input_shape=(3,), fold_first=False)
    assert recorder.asked == [cuda_first] and exported.max_rel_error <= 1e-5

    x = np.random.default_rng(0).random((5, 3), dtype=np.float32)
    ranges = profile_onnx_ranges(onnx.load(str(exported.path)), x)
    assert recorder.asked[-1] == cuda_first and ranges["input"].max == pytest.approx(float(x.max()))

    labels = model(torch.from_numpy(x)).argmax(1).numpy()
    assert onnx_accuracy(exported.path, x, labels) == 1.0 and recorder.asked[-1] == cuda_first

    lower_onnx(_square_model())
    assert recorder.asked[-1] == [CPU]
