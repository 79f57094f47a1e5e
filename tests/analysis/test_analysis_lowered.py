"""Polynomial and lowered are two answers: polynomial uses the CKKS compiler cannot lower are named, not refused."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from analysis_testlib import make_model, node, sympy_degree

from polyfhe.analysis import AnalysisReport, NotLowered, analyze, registry
from polyfhe.analysis.optable import compiler_for, op_table
from polyfhe.commands import check

BACKEND_OPERATORS = Path(onnx.__file__).parent / "backend" / "test" / "data" / "pytorch-operator"


def _backend_model(name: str) -> Path:
    path = BACKEND_OPERATORS / name / "model.onnx"
    if not path.is_file():
        pytest.skip(f"onnx {onnx.__version__} does not ship the backend test model {name}")
    return path


@pytest.mark.parametrize("name, gemms", [("test_operator_mm", 1), ("test_operator_addmm", 2)])
def test_onnx_backend_gemm_of_two_inputs_is_polynomial_of_degree_2_but_not_lowered(name: str, gemms: int) -> None:
    report = analyze(_backend_model(name))
    assert report.polynomial and not report.violations
    assert (report.degree, report.mult_depth) == (2, 1)
    assert report.op_counts.ct_ct_mults == gemms
    assert len(report.not_lowered) == gemms
    assert {(e.op, e.engine) for e in report.not_lowered} == {("Gemm", "ckks")}
    assert all("encrypted A and B" in e.reason for e in report.not_lowered)
    assert not report.lowered_by("ckks") and report.lowered_by("other") is True
    assert report.within_limits(max_degree=2, max_depth=1)


@pytest.mark.parametrize(
    "nodes, inputs, inits, degree, needle",
    [
        ([node("Gemm", ["x", "x"], "y", transB=1)], {"x": (2, 4)}, {}, 2, "encrypted A and B"),
        ([node("Gemm", ["x", "W", "x"], "y")], {"x": (4, 4)}, {"W": np.ones((4, 4))}, 1, "encrypted A and C"),
        ([node("Gemm", ["x", "W", "x"], "y", alpha=0.5, beta=2.0)], {"x": (4, 4)}, {"W": np.ones((4, 4))}, 1,
         "encrypted A and C"),
        ([node("Conv", ["w", "x"], "y")], {"x": (1, 1, 2)}, {"w": np.ones((1, 1, 4))}, 1, "encrypted weights"),
        ([node("Conv", ["x", "x"], "y")], {"x": (1, 1, 1)}, {}, 2, "encrypted weights"),
        ([node("Conv", ["w", "W", "x"], "y")], {"x": (4,)}, {"w": np.ones((1, 4, 1)), "W": np.ones((4, 4, 1))}, 1,
         "encrypted bias"),
        ([node("Pow", ["x", "k"], "y")], {"x": (1, 2)}, {"k": np.array([2.0, 3.0])}, 3, "not a single number"),
    ],
    ids=["gemm_ct_ct", "gemm_ct_bias", "gemm_ct_bias_scaled", "conv_ct_weights", "conv_ct_data_and_weights",
         "conv_ct_bias", "pow_per_element"],
)
def test_polynomial_but_not_lowered(nodes, inputs, inits, degree: int, needle: str) -> None:
    model = make_model(nodes, inputs, ["y"], inits)
    report = analyze(model)
    assert report.polynomial and not report.violations and report.degree == degree
    (entry,) = report.not_lowered
    assert (entry.node, entry.op, entry.engine) == (f"{nodes[0].op_type}_0", nodes[0].op_type, "ckks")
    assert needle in entry.reason and "CKKS compiler" in entry.reason


def test_gemm_of_two_encrypted_operands_degree_matches_sympy() -> None:
    nodes = [node("Gemm", ["x", "x", "b"], "g", transB=1, alpha=0.5), node("Gemm", ["g", "x", "x"], "y", beta=-2.0)]
    model = make_model(nodes, {"x": (2, 2)}, ["y"], {"b": np.array([1.0, -3.0])})
    report = analyze(model)
    assert report.degree == sympy_degree(model) == 3 and report.mult_depth == 2
    assert [e.node for e in report.not_lowered] == ["Gemm_0", "Gemm_1"]


def test_rule_without_a_lowering_is_reported_not_lowered(monkeypatch: pytest.MonkeyPatch) -> None:
    """An op the analyzer accepts but the compiler has no lowering for: every use of it is named."""
    rules = dict(registry._RULES)
    monkeypatch.setattr(registry, "_RULES", rules)
    registry.register_rule("Softsign", summary="test only", lowering=())(lambda ctx: ctx.same_for_all(ctx.operand(0)))
    assert not op_table()["Softsign"].lowered
    report = analyze(make_model([node("Softsign", ["x"], "y", name="soft")], {"x": (1, 4)}, ["y"]))
    assert report.polynomial
    assert [(e.node, e.op, e.engine) for e in report.not_lowered] == [("soft", "Softsign", "ckks")]
    assert "no lowering" in report.not_lowered[0].reason


def test_violations_are_only_non_polynomial_ops() -> None:
    nodes = [node("Gemm", ["x", "x"], "g", transB=1), node("Relu", ["g"], "y")]
    report = analyze(make_model(nodes, {"x": (2, 2)}, ["y"]))
    assert not report.polynomial and [(v.node, v.op) for v in report.violations] == [("Relu_1", "Relu")]
    assert [e.op for e in report.not_lowered] == ["Gemm"]
    assert not report.lowered_by("ckks")


def test_report_round_trips_and_old_json_loads() -> None:
    report = analyze(_backend_model("test_operator_addmm"))
    data = json.loads(json.dumps(report.to_dict()))
    assert AnalysisReport.from_dict(data) == report
    assert data["not_lowered"][0] == {"node": "Gemm_0", "op": "Gemm", "engine": "ckks",
                                      "reason": report.not_lowered[0].reason}
    del data["not_lowered"]
    assert AnalysisReport.from_dict(data).not_lowered == ()
    assert NotLowered.from_dict({"node": "n", "op": "Gemm"}) == NotLowered("n", "Gemm", "", "")


def test_engines_resolve_to_the_ckks_compiler() -> None:
    assert {compiler_for(name) for name in ("ckks", "seal", "lattigo")} == {"ckks"}
    with pytest.raises(ValueError, match="accepted"):
        compiler_for("nope")


# ------------------------------------------------------------------------------------------------ CLI


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="polyfhe")
    check.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_exit_code_stays_polynomial_unless_lowering_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(_backend_model("test_operator_mm"))
    assert _run(["check", path, "--json"]) == check.EXIT_OK
    out = json.loads(capsys.readouterr().out)
    assert out["polynomial"] is True and out["degree"] == 2 and out["lowered"] is False
    assert [(e["op"], e["engine"]) for e in out["not_lowered"]] == [("Gemm", "ckks")]
    for engine in ("ckks", "seal", "lattigo"):
        assert _run(["check", path, "--json", "--require-lowered", engine]) == check.EXIT_NOT_LOWERED == 3
        out = json.loads(capsys.readouterr().out)
        assert out["require_lowered"] == engine and out["lowered_engine"] == "ckks"
    assert _run(["check", path, "--require-lowered", "ckks", "--max-degree", "1", "--json"]) == 1
    capsys.readouterr()


def test_cli_lowered_model_passes_the_requirement(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "square.onnx"
    onnx.save(make_model([node("Mul", ["x", "x"], "y")], {"x": (1, 4)}, ["y"]), path)
    assert _run(["check", str(path), "--require-lowered", "seal"]) == 0
    assert "lowered by the ckks compiler: yes" in capsys.readouterr().out


def test_cli_human_report_prints_both_answers(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["check", str(_backend_model("test_operator_addmm"))]) == 0
    out = capsys.readouterr().out
    assert "polynomial" in out and "NOT polynomial" not in out
    assert "lowered by the ckks compiler: no" in out and "Gemm" in out and "encrypted A and B" in out
