"""Concrete ML's boundary without Concrete ML: environment checks, the worker protocol, program files, and the
byte checks a server makes before any Concrete parser sees a byte. These run in the default test run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from polyfhe.engines.concrete import (
    ConcreteEnvMissing,
    ConcreteProgram,
    ConcreteProgramError,
    find_env,
    load_concrete_program,
)
from polyfhe.engines.concrete.env import ConcreteEnv
from polyfhe.engines.concrete.program import ConcreteServer
from polyfhe.engines.concrete.worker import ConcreteCallError, ConcreteWorkerDied, Worker
from polyfhe.program.wire import KIND_CIPHERTEXT, KIND_CONTEXT, KIND_SECRET, WireError, pack


def test_missing_environment_names_the_command(tmp_path):
    with pytest.raises(ConcreteEnvMissing, match=r"polyfhe setup concrete --path .*does-not-exist|does not exist"):
        find_env(tmp_path / "does-not-exist")
    half = tmp_path / "half"
    (half / "bin").mkdir(parents=True)
    (half / "bin" / "python").write_text("")
    with pytest.raises(ConcreteEnvMissing, match="not complete") as exc:
        find_env(half)
    assert f"polyfhe setup concrete --path {half}" in str(exc.value)


def test_export_without_environment_fails_before_compiling(tmp_path, monkeypatch):
    import torch
    from torch import nn

    import polyfhe

    monkeypatch.setenv("POLYFHE_CONCRETE_ENV", str(tmp_path / "nowhere"))
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 2))
    with pytest.raises(ConcreteEnvMissing, match="polyfhe setup concrete"):
        polyfhe.export(model, target="concrete", calibration=torch.rand(8, 1, 2, 2).numpy())


def _own_python_worker() -> Worker:
    """A worker started with polyfhe's own interpreter: the protocol works, Concrete ML is not importable there."""
    return Worker("test", ConcreteEnv(Path(sys.prefix)))


def test_worker_protocol_errors_and_isolation():
    worker = _own_python_worker()
    try:
        with pytest.raises(ConcreteCallError, match="unknown command 'nope'"):
            worker.call("nope")
        with pytest.raises(ConcreteCallError) as exc:
            worker.call("ping")  # imports concrete.ml: absent from polyfhe's environment, as it must be
        assert exc.value.error == "ModuleNotFoundError" and not exc.value.bad_input
        assert worker.alive  # an exception in a command leaves the worker serving
    finally:
        worker.close()


def test_worker_death_is_reported_and_the_next_call_restarts_it(tmp_path):
    worker = _own_python_worker()
    try:
        with pytest.raises(ConcreteCallError):
            worker.call("nope")
        worker._proc.kill()
        worker._proc.wait()
        with pytest.raises(ConcreteCallError, match="unknown command"):
            worker.call("nope")  # a dead worker between calls is restarted
        assert worker.restarts == 1
    finally:
        worker.close()
    # a worker that dies while it serves a call (here: at once, exit code 3) is reported, not hung on
    dying = tmp_path / "dying"
    (dying / "bin").mkdir(parents=True)
    script = dying / "bin" / "python"
    script.write_text("#!/bin/sh\necho 'native abort' >&2\nexit 3\n")
    script.chmod(0o755)
    with pytest.raises(ConcreteWorkerDied, match="exit code 3.*native abort"):
        Worker("test", ConcreteEnv(dying)).call("nope", {}, [b"x" * (1 << 20)])


def _fake_program(folder: Path) -> ConcreteProgram:
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("client.zip", "server.zip", "model.onnx"):
        (folder / name).write_bytes(name.encode() * 10)
    return ConcreteProgram.create(folder, (1, 1, 8, 8), 10, {"n_bits": 4, "rounding_threshold_bits": 6,
                                                             "p_error": None}, "post-training",
                                  {"concrete_ml": "1.9.0"}, {"model_name": "fake"})


def test_program_files_are_verified(tmp_path):
    program = _fake_program(tmp_path / "src")
    saved = program.save(tmp_path / "saved")
    loaded = load_concrete_program(saved)
    assert loaded.program_id == program.program_id and loaded.manifest.input_size == 64
    (saved / "server.zip").write_bytes(b"changed")
    with pytest.raises(ConcreteProgramError, match="server.zip does not match"):
        load_concrete_program(saved)
    saved = program.save(tmp_path / "again")
    manifest = json.loads((saved / "manifest.json").read_text())
    manifest["n_bits"] = 8
    (saved / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConcreteProgramError, match="program id mismatch"):
        load_concrete_program(saved)
    (saved / "client.zip").unlink()
    with pytest.raises(ConcreteProgramError, match="client.zip is missing"):
        load_concrete_program(saved)


@pytest.mark.parametrize("case", ["secret", "other_program", "extra_section", "oversized", "ciphertext_kind"])
def test_server_refuses_bad_public_keys_before_concrete_parses_them(tmp_path, monkeypatch, case):
    monkeypatch.setenv("POLYFHE_CONCRETE_ENV", str(tmp_path / "nowhere"))  # a worker would fail: never reached
    program = _fake_program(tmp_path / "p")
    ident = program.manifest.identity()
    body = {
        "secret": pack(KIND_SECRET, ident, {"secret_key": b"k"}),
        "other_program": pack(KIND_CONTEXT, {**ident, "program_id": "0" * 24}, {"evaluation_keys": b"k"}),
        "extra_section": pack(KIND_CONTEXT, ident, {"evaluation_keys": b"k", "public_key": b"p"}),
        "oversized": pack(KIND_CONTEXT, ident, {"evaluation_keys": b"k" * 4096}),
        "ciphertext_kind": pack(KIND_CIPHERTEXT, ident, {"ct0": b"c"}),
    }[case]
    with pytest.raises(WireError):
        ConcreteServer(program, body, max_context_bytes=1024)


def test_inputs_of_the_wrong_size_are_refused_by_the_client(tmp_path):
    from polyfhe.engines.concrete.program import ConcreteClient

    client = ConcreteClient.__new__(ConcreteClient)  # no worker: the check comes first
    client.program = _fake_program(tmp_path / "p")
    with pytest.raises(ValueError, match="one sample of shape"):
        client.encrypt(np.zeros((2, 1, 8, 8)))
    with pytest.raises(ValueError, match="NaN"):
        client.encrypt(np.full((1, 8, 8), np.nan))


def test_concrete_refusals_name_the_node_and_the_knob():
    from polyfhe.exporters.concrete.export import _explain

    settings = {"n_bits": 12, "rounding_threshold_bits": None, "p_error": None}
    wide = ("Function you are trying to compile cannot be compiled\n%3 = matmul(%1, %2)  # EncryptedTensor<int28> "
            "@ /1/Gemm.matmul   \n^^^^^^^^^^ this 28-bit value is used as an input to a table lookup\n")
    text = _explain(ConcreteCallError("RuntimeError", wide), settings)
    assert "node /1/Gemm produces a 28-bit value" in text and "rounding_threshold_bits (now None" in text
    text = _explain(ConcreteCallError("NoParametersFound", "no parameters"), settings)
    assert "lower n_bits (now 12)" in text and "raise p_error" in text


def test_unimplemented_ops_are_named_with_their_nodes():
    import onnx
    from onnx import TensorProto, helper

    from polyfhe.exporters.concrete.export import _explain

    graph = helper.make_graph([helper.make_node("CumSum", ["x", "axis"], ["y"], name="/head/CumSum")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor("axis", TensorProto.INT64, [], [1])])
    proto = helper.make_model(graph)
    onnx.checker.check_model(proto)
    message = ("The following ONNX operators are required to convert the torch model to numpy but are not "
               "currently implemented: CumSum.")
    text = _explain(ConcreteCallError("ValueError", message), {"n_bits": 4, "rounding_threshold_bits": None,
                                                                "p_error": None}, proto)
    assert "/head/CumSum (CumSum)" in text and "does not implement (CumSum)" in text


class ChannelSplit:
    """A Mu-layer-like block written the way users write it: the channel split reads ``x.shape``."""

    @staticmethod
    def build():
        import torch
        from torch import nn

        class Split(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.conv = nn.Conv2d(1, 4, 3, padding=1)
                self.head = nn.Linear(2 * 64, 10)

            def forward(self, x):
                h = self.conv(x)
                half = h.shape[1] // 2
                a, b = h[:, :half], h[:, half:]
                return self.head((a * b).reshape(x.shape[0], -1))

        torch.manual_seed(0)
        return Split().eval()


def test_shape_subgraphs_are_folded_for_concrete():
    from polyfhe.exporters.concrete.export import to_concrete_onnx
    from polyfhe.exporters.concrete.graph_prep import fold_public_shapes
    from polyfhe.ort_providers import inference_session

    model = ChannelSplit.build()
    x = np.random.default_rng(0).random((5, 1, 8, 8)).astype(np.float32)
    from polyfhe.exporters.concrete.export import _opset_graph

    raw, _ = _opset_graph(model, (1, 8, 8))
    assert any(n.op_type == "Shape" for n in raw.graph.node)
    folded, count = fold_public_shapes(raw)
    assert count > 0 and not any(n.op_type in ("Shape", "Gather") for n in folded.graph.node)
    name = raw.graph.input[0].name
    run = lambda proto: inference_session(proto.SerializeToString()).run(None, {name: x})[0]
    np.testing.assert_allclose(run(folded), run(raw), rtol=1e-6, atol=1e-6)  # at batch 5: no batch of 1 baked in
    assert folded.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    checked, _ = to_concrete_onnx(model, (1, 8, 8), check_x=x)
    assert not any(n.op_type == "Shape" for n in checked.graph.node)


def test_a_worker_past_its_memory_limit_is_stopped_with_the_reason(tmp_path):
    hungry = tmp_path / "hungry"
    (hungry / "bin").mkdir(parents=True)
    script = hungry / "bin" / "python"
    # takes ~200 MB and waits: stands in for a key generation that outgrows the machine
    script.write_text(f"#!/bin/sh\nexec {sys.executable} -c \"import time; b = bytearray(200 << 20); "
                      "b[::4096] = b'x' * len(b[::4096]); time.sleep(60)\"\n")
    script.chmod(0o755)
    worker = Worker("client", ConcreteEnv(hungry), memory_limit_bytes=100 << 20)
    with pytest.raises(ConcreteWorkerDied, match=r"passed 0\.[12] GB, more than the 0\.1 GB"):
        worker.call("keygen")


def test_dilated_convolutions_are_named():
    from onnx import TensorProto, helper

    from polyfhe.exporters.concrete.export import _explain

    conv = helper.make_node("Conv", ["x", "w"], ["y"], name="/stage1/dw/Conv", dilations=[2, 2], pads=[2, 2, 2, 2])
    graph = helper.make_graph([conv], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 8, 8])],
                              [helper.make_tensor("w", TensorProto.FLOAT, [1, 1, 3, 3], [0.1] * 9)])
    text = _explain(ConcreteCallError("AssertionError", "The convolution operator in Concrete does not support "
                                      "dilation"), {"n_bits": 4, "rounding_threshold_bits": None, "p_error": None},
                    helper.make_model(graph))
    assert "/stage1/dw/Conv (dilations [2, 2])" in text and "undilated" in text


def test_key_prediction_checks_limit_and_memory():
    """The refusal before key generation (no Concrete needed): the server's limit, then the memory free."""
    from polyfhe.engines.concrete.keys import ConcreteKeysTooLarge, check_keys_fit, keygen_memory_bytes

    keys = {"evaluation_keys_bytes": 3_440_000_000, "bootstrap_keys_bytes_in_memory": 6_860_000_000,
            "keyswitch_keys_bytes_in_memory": 4_010_000_000}
    check_keys_fit(keys, 4 << 30, free_bytes=None)
    check_keys_fit(None, 1)  # a manifest without a prediction: nothing to check
    with pytest.raises(ConcreteKeysTooLarge, match=r"would be 3\.44 GB.*over the server's limit of 1\.07 GB.*"
                                                   r"--max-context-mb 3282"):
        check_keys_fit(keys, 1 << 30, free_bytes=None)
    assert keygen_memory_bytes(keys) == 3_440_000_000 + 10_870_000_000 + (1 << 30)
    with pytest.raises(ConcreteKeysTooLarge, match=r"about 15\.38 GB of memory.*more than the 8\.00 GB"):
        check_keys_fit(keys, None, free_bytes=8_000_000_000)
