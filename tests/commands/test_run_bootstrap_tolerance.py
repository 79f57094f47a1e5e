"""``polyfhe run``'s tolerance of a program that bootstraps (issue 55, item 7): nothing simulates a bootstrap's
error, so the bound is the one from the parameters, the output says it leaves the bootstraps out (text and
``--json``), and a result beyond it is not exit code 3. A leveled program keeps the compiler's enforced tolerance.

Running a real bootstrap takes minutes (docs/bootstrapping.md), so the bootstrapped program here is a small SEAL
program whose saved manifest gains the compiler's bootstrap record (``info["bootstrap"]``; the program id does not
hash ``info``), its noise record kept: the one the compiler simulates before it places bootstraps."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from torch import nn

from polyfhe.cli import main
from polyfhe.program.params import largest_value

BOOTSTRAP_RECORD = {"count": 2, "cuts_after_level": [1, 2], "registers": [[3], [5]], "packed": [False, False],
                    "levels_left_after_segment": [0, 0], "levels_needed": 3, "levels_per_segment": 1}


class _Square(nn.Module):
    def forward(self, x):
        return x * x


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """(leveled program folder, the same with a bootstrap record, calibration images)."""
    import polyfhe

    root = tmp_path_factory.mktemp("run_boot")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 12), _Square(), nn.Linear(12, 4)).eval()
    x = np.random.default_rng(0).random((64, 1, 8, 8)).astype(np.float32)
    polyfhe.export(model, target="ckks", calibration=x, input_shape=(1, 8, 8)).save(root / "leveled")
    shutil.copytree(root / "leveled", root / "boot")
    manifest = json.loads((root / "boot" / "manifest.json").read_text())
    assert "noise" in manifest["info"] and "bootstrap" not in manifest["info"]
    manifest["info"]["bootstrap"] = BOOTSTRAP_RECORD
    (root / "boot" / "manifest.json").write_text(json.dumps(manifest))
    return root / "leveled", root / "boot", x


def _huge(tmp_path, x, monkeypatch):
    """An input that overflows the modulus, let through with the range check disabled: garbage logits."""
    from polyfhe.program import boundary

    monkeypatch.setattr(boundary, "_check_range", lambda m, arr, dtype, clip: arr)
    np.save(tmp_path / "huge.npy", x[:1] * 1e6)
    return tmp_path / "huge.npy"


def test_the_tolerance_of_a_manifest_that_bootstraps_is_the_parameters_bound_and_not_enforced(programs):
    from polyfhe.program.ckks_program import load_program
    from polyfhe.program.noise import FALLBACK_SHARE, error_tolerance, tolerance_for

    leveled, boot, _ = programs
    lev, bst = load_program(leveled), load_program(boot)
    assert lev.program_id == bst.program_id  # info is not hashed: the same program with a bootstrap record
    t = tolerance_for(lev.manifest)
    assert (t.source, t.enforced, t.bootstraps) == ("compiler", True, 0)
    assert t.value == lev.manifest.info["noise"]["tolerance"]
    b = tolerance_for(bst.manifest)
    assert (b.source, b.enforced, b.bootstraps) == ("parameters", False, 2)
    assert b.value == FALLBACK_SHARE * largest_value(bst.params) != bst.manifest.info["noise"]["tolerance"]
    assert "does not include the error of the program's 2 bootstrap(s)" in b.note
    assert b.to_dict()["enforced"] is False
    # the pair error_tolerance returns agrees: a noise record does not count for a program that bootstraps
    assert error_tolerance(bst.params, bst.manifest.info) == (b.value, "parameters")
    assert error_tolerance(lev.params, lev.manifest.info) == (t.value, "compiler")


@pytest.mark.fhe
def test_a_leveled_program_keeps_the_compilers_tolerance_and_exit_code_3(programs, tmp_path, capsys, monkeypatch):
    leveled, _, x = programs
    np.save(tmp_path / "x.npy", x[:1])
    assert main(["run", str(leveled), "--input", str(tmp_path / "x.npy"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tolerance_source"] == "compiler" and result["tolerance_enforced"] and result["agrees"]
    assert "compiler's noise prediction" in result["tolerance_note"]
    assert main(["run", str(leveled), "--input", str(tmp_path / "x.npy")]) == 0
    assert "tolerance:" not in capsys.readouterr().out  # the text is as before

    assert main(["run", str(leveled), "--input", str(_huge(tmp_path, x, monkeypatch)), "--json"]) == 3
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert not result["agrees"] and result["tolerance_source"] == "compiler" and result["tolerance_enforced"]
    assert "differs from the plaintext program" in captured.err and "it is wrong" in captured.err


@pytest.mark.fhe
def test_a_bootstrapped_program_says_its_bound_leaves_bootstrap_noise_out(programs, tmp_path, capsys, monkeypatch):
    _, boot, x = programs
    np.save(tmp_path / "x.npy", x[:1])
    assert main(["run", str(boot), "--input", str(tmp_path / "x.npy"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tolerance_source"] == "parameters" and result["tolerance_enforced"] is False
    assert "does not include the error of the program's 2 bootstrap(s)" in result["tolerance_note"]
    assert result["agrees"]
    assert main(["run", str(boot), "--input", str(tmp_path / "x.npy")]) == 0
    out = capsys.readouterr().out
    assert "tolerance: a bound from the program's parameters" in out and "bootstrap(s)" in out

    # beyond the bound: reported with a warning, not exit code 3 (the bound does not model the bootstraps)
    assert main(["run", str(boot), "--input", str(_huge(tmp_path, x, monkeypatch)), "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert not result["agrees"] and result["max_abs_error"] > result["tolerance"]
    assert result["tolerance_enforced"] is False
    assert "warning:" in captured.err and "not judged wrong" in captured.err and "it is wrong" not in captured.err
