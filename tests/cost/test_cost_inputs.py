"""What ``polyfhe cost`` takes (zoo name, .onnx file, program folder; anything else refused with what is accepted),
which method its default picks, and how it announces its slow steps."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import pytest
from ckks_testlib import square_cnn
from cost_testlib import synthetic_costs

from polyfhe.cost import zoo_models
from polyfhe.cost.workload import program_workload, trace_model
from polyfhe.runtime import opcosts

ACCEPTED = ("zoo model name", ".onnx file", "program folder")


_costs = synthetic_costs


@pytest.fixture
def seeded_cache(tmp_path, monkeypatch):
    """A calibration cache holding known constants, so nothing measures this machine."""
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("POLYFHE_CACHE_DIR", str(cache))
    for engine in ("seal", "lattigo"):
        opcosts.write_cached(_costs(engine), cache)
    return cache


@pytest.fixture(scope="module")
def square_onnx(tmp_path_factory) -> Path:
    from polyfhe.exporters.onnx import export_onnx

    path = tmp_path_factory.mktemp("onnx") / "square_cnn.onnx"
    export_onnx(square_cnn(), path, (1, 8, 8))
    return path


def _json(out: str) -> dict:
    return json.loads(out[:out.rindex("}") + 1])


# ------------------------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------------------------
def test_cli_prices_an_onnx_file_by_compiling_it(seeded_cache, square_onnx, capsys):
    from polyfhe.cli import main
    from polyfhe.exporters.ckks import export_ckks

    assert main(["cost", str(square_onnx), "--json"]) == 0
    report = _json(capsys.readouterr().out)
    assert report["method"] == "compiled" and report["name"] == "square_cnn" and report["img_size"] == 8
    # the same compile: the graph's input shape, random [0, 1] calibration images
    calibration = zoo_models._calibration((1, 8, 8))
    program = export_ckks(square_onnx, calibration=calibration)
    assert report["counters"]["plain_products"] == program_workload(program).counters["plain_products"]
    assert report["depth"] == program.params.levels
    assert any("random inputs" in note for note in report["notes"])


def test_cli_onnx_refuses_the_traced_estimate_and_img_size(seeded_cache, square_onnx, capsys):
    from polyfhe.cli import main

    assert main(["cost", str(square_onnx), "--method", "estimated"]) == 1
    assert "--method auto or compiled" in capsys.readouterr().out
    assert main(["cost", str(square_onnx), "--img-size", "16"]) == 1
    assert "--img-size applies to zoo models" in capsys.readouterr().out


def test_cli_onnx_that_is_not_polynomial_is_refused_with_its_nodes(seeded_cache, tmp_path, capsys):
    import torch
    from torch import nn

    from polyfhe.cli import main

    path = tmp_path / "relu.onnx"
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    with warnings.catch_warnings():  # the TorchScript exporter is deprecated; polyfhe's own exporter uses it too
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(model, (torch.zeros(1, 1, 4, 4),), str(path), dynamo=False, input_names=["x"])
    assert main(["cost", str(path)]) == 1
    out = capsys.readouterr().out
    assert "not polynomial" in out and "Relu" in out


@pytest.mark.parametrize("kind", ["missing_onnx", "other_file", "unknown_name", "empty_folder"])
def test_cli_unknown_input_says_what_is_accepted(seeded_cache, tmp_path, capsys, kind):
    from polyfhe.cli import main

    target = {"missing_onnx": tmp_path / "nope.onnx", "other_file": tmp_path / "weights.txt",
              "unknown_name": "no_such_model", "empty_folder": tmp_path / "empty"}[kind]
    if kind == "other_file":
        target.write_text("not a model")
    if kind == "empty_folder":
        target.mkdir()
    assert main(["cost", str(target)]) == 2
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert all(what in out for what in ACCEPTED), out


def test_cli_refuses_a_concrete_program_folder_clearly(seeded_cache, tmp_path, capsys):
    from polyfhe.cli import main
    from polyfhe.engines.concrete import ConcreteProgram

    folder = tmp_path / "src"
    folder.mkdir()
    for name in ("client.zip", "server.zip", "model.onnx"):
        (folder / name).write_bytes(name.encode() * 10)
    program = ConcreteProgram.create(folder, (1, 1, 8, 8), 10, {"n_bits": 4, "rounding_threshold_bits": 6,
                                                                "p_error": None}, "post-training",
                                     {"concrete_ml": "1.9.0"}, {"model_name": "fake"})
    saved = program.save(tmp_path / "concrete")
    assert main(["cost", str(saved)]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "Concrete ML" in out and "CKKS" in out and "--target ckks" in out


# ------------------------------------------------------------------------------------------------------------
# the default method: the compiled program's numbers whenever it compiles here
# ------------------------------------------------------------------------------------------------------------
def test_trace_counts_only_tensors_a_ciphertext_holds():
    """monet_fhe_bn's two-conv patch embedding composes into one map, so its 512-channel middle is never held:
    the compiled program runs on N=16384 (measured), and the estimate picks that ring too."""
    meta, shape = zoo_models._build("monet_fhe_bn", 28)
    traced = trace_model(meta, shape)
    assert traced.widest <= 8192
    params, boot = zoo_models.estimate_params(traced, "seal")
    assert boot is None and params.poly_modulus_degree == 16384


def test_auto_compiles_a_leveled_model_that_fits_one_ciphertext(seeded_cache, monkeypatch):
    """monet_fhe_bn at 28x28 compiles in under a minute; the default must compile it (its traced estimate was
    N=32768 and 2x the compiled program's keys and memory), without compiling here: the compile is a spy."""
    from ckks_testlib import digits_program

    program, _ = digits_program()
    calls = []

    def spy(name, img_size, engine, **kwargs):
        calls.append((name, img_size, engine))
        return program

    monkeypatch.setattr(zoo_models, "compile_model", spy)
    report = zoo_models.model_cost("monet_fhe_bn", 28, "seal", machine_bytes=None)
    assert calls == [("monet_fhe_bn", 28, "seal")]
    assert report.method == "compiled"
    assert report.prediction.counters["plain_products"] == program.manifest.info["planned"]["plain_products"]


def test_auto_falls_back_to_the_estimate_when_the_compiler_gives_up(seeded_cache, monkeypatch):
    from polyfhe.exporters.ckks.memory import CompileMemoryError

    def refuse(*args, **kwargs):
        raise CompileMemoryError("node /x would hold 99 GB")

    monkeypatch.setattr(zoo_models, "compile_model", refuse)
    report = zoo_models.model_cost("lpnn_bn", None, "seal", machine_bytes=None)
    assert report.method == "estimated"
    assert any("99 GB" in note for note in report.notes)
    with pytest.raises(CompileMemoryError):
        zoo_models.model_cost("lpnn_bn", None, "seal", method="compiled", machine_bytes=None)


def test_default_method_agrees_with_the_compiled_program(seeded_cache):
    """A small zoo model's default prediction is the compiled one (within 1.2x: here exactly)."""
    default = zoo_models.model_cost("lpnn_bn", None, "seal", machine_bytes=None).prediction
    compiled = zoo_models.model_cost("lpnn_bn", None, "seal", method="compiled", machine_bytes=None).prediction
    assert default.params == compiled.params
    for field in ("eval_seconds", "key_bytes", "peak_bytes"):
        ratio = getattr(default, field) / getattr(compiled, field)
        assert 1 / 1.2 <= ratio <= 1.2, (field, ratio)


# ------------------------------------------------------------------------------------------------------------
# progress
# ------------------------------------------------------------------------------------------------------------
def test_calibration_and_compile_are_announced_on_stderr_not_as_warnings(tmp_path, monkeypatch, capsys, caplog):
    from polyfhe.cli import main
    from polyfhe.cost import model

    monkeypatch.setenv("POLYFHE_CACHE_DIR", str(tmp_path))  # empty: the first run measures
    monkeypatch.setattr(model, "calibrate", lambda engine: _costs(engine))
    with caplog.at_level(logging.WARNING):
        assert main(["cost", "lpnn_bn", "--json"]) == 0
    captured = capsys.readouterr()
    assert _json(captured.out)["method"] == "compiled"  # stdout stays one JSON object
    assert "measuring seal's operation costs" in captured.err
    assert "compiling lpnn_bn" in captured.err and "done in" in captured.err
    assert not [r for r in caplog.records if "calibrating" in r.getMessage()]
    assert main(["cost", "lpnn_bn", "--method", "estimated"]) == 0  # cached now: nothing to announce
    assert "measuring" not in capsys.readouterr().err


def test_calibrate_logs_its_start_at_info(monkeypatch, caplog):
    from polyfhe.cost import model, opbench

    monkeypatch.setattr(opbench, "calibrator", lambda engine: lambda: ([], []))
    monkeypatch.setattr(opbench, "measure_base_rss", lambda engine: 0)
    monkeypatch.setattr(model, "fit_costs", lambda *args, **kwargs: _costs("seal"))
    monkeypatch.setattr(model.KeyBytesModel, "fit", staticmethod(lambda keys: None))
    with caplog.at_level(logging.INFO, logger="polyfhe.cost.model"):
        model.calibrate("seal", isolated=False)
    levels = {r.levelno for r in caplog.records if "calibrating" in r.getMessage()}
    assert levels == {logging.INFO}
