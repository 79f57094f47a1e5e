"""Loading (proto, path, bytes; corrupt and truncated files) and the ``check`` subcommand's exit codes."""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path

import numpy as np
import onnx
import pytest
from analysis_testlib import make_model, node

from polyfhe.analysis import ModelLoadError, analyze
from polyfhe.commands import check


def _poly_model() -> onnx.ModelProto:
    nodes = [node("MatMul", ["x", "W"], "h"), node("Mul", ["h", "h"], "y")]
    return make_model(nodes, {"x": (1, 3)}, ["y"], {"W": np.arange(9.0).reshape(3, 3)})


def _relu_model() -> onnx.ModelProto:
    return make_model([node("Relu", ["x"], "y", name="act")], {"x": (1, 3)}, ["y"])


@pytest.fixture
def poly_path(tmp_path: Path) -> Path:
    path = tmp_path / "poly.onnx"
    onnx.save(_poly_model(), str(path))
    return path


@pytest.fixture
def relu_path(tmp_path: Path) -> Path:
    path = tmp_path / "relu.onnx"
    onnx.save(_relu_model(), str(path))
    return path


def test_accepts_proto_path_str_and_bytes(poly_path: Path) -> None:
    reports = [analyze(_poly_model()), analyze(poly_path), analyze(str(poly_path)), analyze(poly_path.read_bytes())]
    assert {(r.degree, r.levels) for r in reports} == {(2, 2)}


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such file"):
        analyze(tmp_path / "absent.onnx")
    with pytest.raises(ModelLoadError, match="not a file"):
        analyze(tmp_path)


@pytest.mark.parametrize("payload", [b"", b"\x00", b"not an onnx file at all", bytes(range(256)) * 4])
def test_corrupt_bytes(tmp_path: Path, payload: bytes) -> None:
    path = tmp_path / "bad.onnx"
    path.write_bytes(payload)
    with pytest.raises(ModelLoadError):
        analyze(path)
    with pytest.raises(ModelLoadError):
        analyze(payload)


def test_every_truncation_is_refused() -> None:
    """Protobuf parses some truncated prefixes without error; structural checks must catch them all."""
    data = _poly_model().SerializeToString()
    assert analyze(data).polynomial
    for cut in range(len(data)):
        with pytest.raises(ModelLoadError):
            analyze(data[:cut])


def test_structurally_broken_graphs() -> None:
    undefined = make_model([node("Neg", ["ghost"], "y")], {"x": (1, 2)}, ["y"])
    with pytest.raises(ModelLoadError, match="undefined value 'ghost'"):
        analyze(undefined)
    cycle = make_model([node("Add", ["x", "b"], "a"), node("Neg", ["a"], "b")], {"x": (1, 2)}, ["a"])
    with pytest.raises(ModelLoadError, match="cycle"):
        analyze(cycle)
    no_output = make_model([node("Neg", ["x"], "y")], {"x": (1, 2)}, ["z"])
    with pytest.raises(ModelLoadError, match="never produced"):
        analyze(no_output)
    with pytest.raises(ModelLoadError):
        analyze(12345)  # type: ignore[arg-type]


def test_model_load_error_is_a_value_error() -> None:
    assert issubclass(ModelLoadError, ValueError)


# ------------------------------------------------------------------------------------------------ CLI


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="polyfhe")
    check.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def _run(argv: list[str]) -> int:
    args = _parse(argv)
    return args.func(args)


def test_parser_wiring() -> None:
    args = _parse(["check", "m.onnx", "--json", "--max-degree", "4", "--max-depth", "2", "--max-levels", "7"])
    assert (args.target, args.json, args.max_degree, args.max_depth, args.max_levels) == ("m.onnx", True, 4, 2, 7)
    assert args.func is check.run
    with pytest.raises(SystemExit):
        _parse(["check", "m.onnx", "--max-degree", "-1"])


def test_cli_exit_0_and_json(poly_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["check", str(poly_path), "--json", "--max-degree", "2"]) == 0
    out = json.loads(capsys.readouterr().out)  # exactly one JSON object
    assert out["polynomial"] is True and out["degree"] == 2 and out["mult_depth"] == 1 and out["levels"] == 2
    assert out["violations"] == [] and out["within_limits"] is True


def test_cli_exit_1_not_polynomial(relu_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["check", str(relu_path), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["polynomial"] is False and out["degree"] is None and out["within_limits"] is False
    assert [(v["node"], v["op"]) for v in out["violations"]] == [("act", "Relu")]
    assert "polyfhe.polynomialize" in out["remedy"]


@pytest.mark.parametrize("flag, value", [("--max-degree", "1"), ("--max-depth", "0"), ("--max-levels", "1")])
def test_cli_exit_1_over_limit(poly_path: Path, flag: str, value: str, capsys) -> None:
    assert _run(["check", str(poly_path), "--json", flag, value]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["polynomial"] is True and out["within_limits"] is False and out["limit_failures"]


def test_cli_exit_2_unreadable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(_poly_model().SerializeToString()[:40])
    assert _run(["check", str(bad)]) == 2
    assert "error" in capsys.readouterr().err
    assert _run(["check", str(tmp_path / "missing.onnx"), "--json"]) == 2
    captured = capsys.readouterr()
    assert "no such file" in json.loads(captured.out)["error"]


def test_cli_human_report(poly_path: Path, relu_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["check", str(poly_path)]) == 0
    text = capsys.readouterr().out
    assert "polynomial" in text and "degree" in text and "limits: none given" in text
    assert "within limits" not in text  # no limit was given: no verdict on limits
    assert _run(["check", str(poly_path), "--max-degree", "50", "--max-levels", "50"]) == 0
    assert "within limits (degree <= 50, levels <= 50): yes" in capsys.readouterr().out
    assert _run(["check", str(relu_path)]) == 1
    text = capsys.readouterr().out
    assert "NOT polynomial" in text and "act" in text and "Relu" in text
    assert "within limits" not in text  # the verdict is "NOT polynomial", not a limit
    assert "the way in:" in text and "polyfhe.polynomialize" in text


def test_cli_zoo_name_without_exporter(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "polyfhe.exporters.onnx", None)  # import -> ImportError
    assert _run(["check", "monet_t"]) == 2
    assert "zoo-name targets need the ONNX exporter" in capsys.readouterr().err


def test_cli_zoo_name_with_exporter(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    fake = types.ModuleType("polyfhe.exporters.onnx")
    calls: list[str] = []

    def export_zoo_model_for_check(name: str, img_size: int | None = None) -> onnx.ModelProto:
        calls.append(name)
        if name != "tiny_poly":
            raise KeyError(name)
        return _poly_model()

    fake.export_zoo_model_for_check = export_zoo_model_for_check  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "polyfhe.exporters.onnx", fake)
    assert _run(["check", "tiny_poly", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["degree"] == 2
    assert _run(["check", "no_such_model"]) == 2
    assert calls == ["tiny_poly", "no_such_model"]
