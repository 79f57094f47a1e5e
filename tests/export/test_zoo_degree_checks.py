"""Degree checks in CI: every polynomial zoo model (BN variants, norm-free families) exports and passes ``polyfhe check``; every LN variant is rejected.

Models are built at small resolutions with random weights: the check is structural (which ops, what degree),
so the resolution only changes sizes, not the graph's operator types or depth. By default one narrow model
per family and norm runs (``SAMPLE``); the full sweep, an ONNX export of 10-35 s per model, is ``slow``.
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

# The narrowest registered model of each family variant and norm. cpolynext_lr_bn, not cpolynext_fhe_bn, so
# that the spec's ct x ct depth bound is checked by default too.
SAMPLE = {
    "monet_lr", "monet_lr_bn", "apolynext_t", "apolynext_fhe_bn", "cpolynext_lr", "cpolynext_lr_bn",
    "lpnn_bn", "resmlp_poly", "taylor_mixer",
}


def _group(name: str) -> tuple[str, str]:
    """(family variant, norm): PolyNeXt's attention (a) and convolution (c) variants are separate graphs."""
    entry = polyfhe.model_entry(name)
    return (name.split("_")[0] if entry.family == "polynext" else entry.family), entry.norm


def _sweep(ln: bool) -> list:
    names = [n for n in polyfhe.list_models() if (polyfhe.model_entry(n).norm == "ln") == ln]
    return [n if n in SAMPLE else pytest.param(n, marks=pytest.mark.slow) for n in names]


def test_the_sample_holds_one_model_of_every_family_and_norm() -> None:
    """A family added to the registry must join SAMPLE, or the default run would not check it at all."""
    groups = [_group(n) for n in sorted(SAMPLE)]
    assert sorted(groups) == sorted({_group(n) for n in polyfhe.list_models()}), groups


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``exported(name)``: the zoo model's .onnx, exported once per module (several tests check it)."""
    folder = tmp_path_factory.mktemp("zoo")
    paths: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in paths:
            paths[name] = export_zoo_model_for_check(name, img_size=analysis_img_size(name), out_dir=folder)
        return paths[name]

    return get


def _check_json(path: Path, *extra: str, capsys: pytest.CaptureFixture) -> tuple[int, dict]:
    code = cli_main(["check", str(path), "--json", *extra])
    out = capsys.readouterr().out
    return code, json.loads(out)


@pytest.mark.parametrize("name", _sweep(ln=False))
def test_bn_variant_exports_and_passes_the_degree_check(name: str, exported, capsys) -> None:
    path = exported(name)
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


@pytest.mark.parametrize("name", _sweep(ln=True))
def test_ln_variant_is_rejected_naming_non_polynomial_nodes(name: str, exported, capsys) -> None:
    path = exported(name)
    code, report = _check_json(path, capsys=capsys)
    assert code == 1
    assert report["polynomial"] is False and report["violations"]
    ops = {v["op"] for v in report["violations"]}
    assert ops & DATA_DEPENDENT_OPS, ops
    assert all(v["node"] for v in report["violations"])


def test_console_script_check_exit_codes(exported, tmp_path: Path) -> None:
    """The installed ``polyfhe`` entry point, as users call it in their CI (the three processes run side by
    side: each spends its seconds importing)."""
    good, bad = exported("monet_lr_bn"), exported("monet_lr")
    corrupt = tmp_path / "corrupt.onnx"
    corrupt.write_bytes(good.read_bytes()[:100])
    exe = [sys.executable, "-m", "polyfhe.cli", "check"]
    procs = [subprocess.Popen([*exe, str(p)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for p in (good, bad, corrupt)]
    (_, _), (_, _), (_, broken_err) = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 1, 2]
    assert broken_err.strip()
