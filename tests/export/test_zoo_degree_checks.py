"""Degree checks in CI: every polynomial zoo model (BN variants, norm-free families) exports and passes ``polyfhe check``; every LN variant is rejected.

Models are built at small resolutions with random weights: the check is structural (which ops, what degree),
so the resolution only changes sizes, not the graph's operator types or depth.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import polyfhe
from polyfhe.cli import main as cli_main
from polyfhe.exporters.onnx import export_zoo_model_for_check
from polyfhe.zoo import analysis_img_size

DATA_DEPENDENT_OPS = {"ReduceMean", "Sqrt", "Div", "Reciprocal", "LayerNormalization", "Pow", "Max", "Clip"}


def _size(name: str) -> int:
    return analysis_img_size(name)


def _check_json(path: Path, *extra: str, capsys: pytest.CaptureFixture) -> tuple[int, dict]:
    code = cli_main(["check", str(path), "--json", *extra])
    out = capsys.readouterr().out
    return code, json.loads(out)


@pytest.mark.parametrize("name", [n for n in polyfhe.list_models() if polyfhe.model_entry(n).norm != "ln"])
def test_bn_variant_exports_and_passes_the_degree_check(name: str, tmp_path: Path, capsys) -> None:
    path = export_zoo_model_for_check(name, img_size=_size(name), out_dir=tmp_path)
    code, report = _check_json(path, capsys=capsys)
    assert code == 0, report["violations"]
    assert report["polynomial"] is True and report["violations"] == []
    assert report["degree"] >= 2 and report["mult_depth"] >= 1 and report["levels"] >= report["mult_depth"]
    entry = polyfhe.model_entry(name)
    if entry.spec_ct_depth is not None:
        # The spec counts ct x ct products per block; our graph must not be deeper than the spec's count.
        assert report["mult_depth"] <= entry.spec_ct_depth
    # A budget below the measured depth must fail the build.
    code, over = _check_json(path, "--max-depth", str(report["mult_depth"] - 1), capsys=capsys)
    assert code == 1 and over["polynomial"] is True and over["within_limits"] is False


@pytest.mark.parametrize("name", [n for n in polyfhe.list_models() if polyfhe.model_entry(n).norm == "ln"])
def test_ln_variant_is_rejected_naming_non_polynomial_nodes(name: str, tmp_path: Path, capsys) -> None:
    path = export_zoo_model_for_check(name, img_size=_size(name), out_dir=tmp_path)
    code, report = _check_json(path, capsys=capsys)
    assert code == 1
    assert report["polynomial"] is False and report["violations"]
    ops = {v["op"] for v in report["violations"]}
    assert ops & DATA_DEPENDENT_OPS, ops
    assert all(v["node"] for v in report["violations"])


def test_console_script_check_exit_codes(tmp_path: Path) -> None:
    """The installed ``polyfhe`` entry point, as users call it in their CI."""
    good = export_zoo_model_for_check("monet_lr_bn", out_dir=tmp_path)
    bad = export_zoo_model_for_check("monet_lr", out_dir=tmp_path)
    corrupt = tmp_path / "corrupt.onnx"
    corrupt.write_bytes(good.read_bytes()[:100])
    exe = [sys.executable, "-m", "polyfhe.cli", "check"]
    assert subprocess.run([*exe, str(good)], check=False, capture_output=True).returncode == 0
    assert subprocess.run([*exe, str(bad)], check=False, capture_output=True).returncode == 1
    broken = subprocess.run([*exe, str(corrupt)], check=False, capture_output=True, text=True)
    assert broken.returncode == 2 and broken.stderr.strip()
