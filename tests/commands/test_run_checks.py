"""``polyfhe run`` refuses inputs outside the calibrated range (or clips them with a warning), runs any number of
samples in chunks of one ciphertext, and exits 3 when the encrypted result disagrees with the plaintext program."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from polyfhe.cli import main


class _Square(nn.Module):
    def forward(self, x):
        return x * x


@pytest.fixture(scope="module")
def program_dir(tmp_path_factory):
    """A 1x8x8 -> 12 -> x^2 -> 4 program calibrated on [0, 1) images, its folder and the calibration images."""
    import polyfhe

    root = tmp_path_factory.mktemp("run_checks")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 12), _Square(), nn.Linear(12, 4)).eval()
    x = np.random.default_rng(0).random((64, 1, 8, 8)).astype(np.float32)
    polyfhe.export(model, target="ckks", calibration=x, input_shape=(1, 8, 8)).save(root / "prog")
    return root / "prog", x


@pytest.mark.fhe
def test_uint8_images_are_refused_with_the_range_and_the_fix(program_dir, tmp_path, capsys):
    prog, x = program_dir
    np.save(tmp_path / "u8.npy", (x[:1] * 255).astype(np.uint8))
    assert main(["run", str(prog), "--input", str(tmp_path / "u8.npy")]) == 2
    err = capsys.readouterr().err
    assert "outside the range" in err and "divide them by 255 first" in err and "--clip" not in err  # not clipping


@pytest.mark.fhe
def test_clip_runs_with_a_python_warning_saying_how_many(program_dir, tmp_path, capsys):
    from polyfhe.program.boundary import NumericalWarning

    prog, x = program_dir
    sample = x[:1].copy()
    sample[0, 0, 0, :3] = [1.5, 2.0, -1.0]
    np.save(tmp_path / "wide.npy", sample)
    with pytest.warns(NumericalWarning, match="clipped 3 of 64 input values"):
        assert main(["run", str(prog), "--input", str(tmp_path / "wide.npy"), "--clip", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["agrees"] and result["max_abs_error"] <= result["tolerance"]
    assert result["tolerance_source"] == "compiler"


@pytest.mark.fhe
def test_more_samples_than_a_ciphertext_holds_run_in_chunks(program_dir, tmp_path, capsys):
    from polyfhe.program.ckks_program import load_program

    prog, x = program_dir
    lanes = load_program(prog).manifest.samples_per_query
    many = np.resize(x, (2 * lanes + 3, 1, 8, 8))
    np.save(tmp_path / "many.npy", many)
    assert main(["run", str(prog), "--input", str(tmp_path / "many.npy"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["samples"] == 2 * lanes + 3 and result["queries"] == 3
    assert [q["samples"] for q in result["per_query"]] == [lanes, lanes, 3]
    assert result["timings"]["encrypt"] == pytest.approx(sum(q["encrypt"] for q in result["per_query"]))
    assert result["sizes"]["input_ciphertext"] == sum(q["input_ciphertext"] for q in result["per_query"])
    assert result["argmax_agreement"] == result["samples"] and result["agrees"]
    want = load_program(prog).run_plain(many)
    assert np.allclose(result["logits"], want, atol=1e-3)


@pytest.mark.fhe
def test_a_result_beyond_the_noise_exits_3(program_dir, tmp_path, capsys, monkeypatch):
    """Out-of-range values let through (the range check disabled) overflow the modulus: garbage, exit code 3."""
    from polyfhe.program import boundary

    prog, x = program_dir
    monkeypatch.setattr(boundary, "_check_range", lambda m, arr, dtype, clip: arr)
    np.save(tmp_path / "huge.npy", x[:1] * 1e6)
    assert main(["run", str(prog), "--input", str(tmp_path / "huge.npy"), "--json"]) == 3
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert not result["agrees"] and result["max_abs_error"] > result["tolerance"]
    assert "differs from the plaintext program" in captured.err
