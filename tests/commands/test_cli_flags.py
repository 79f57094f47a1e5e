"""`polyfhe export/run` flags reach the API, `polyfhe run --keys` restores keys, and progress bars stay off pipes."""

from __future__ import annotations

import importlib
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from polyfhe.cli import main
from polyfhe.program.ckks_program import load_program

pytestmark = pytest.mark.fhe


class Square(nn.Module):
    def forward(self, x):
        return x * x


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    """A tiny polynomial ONNX model (64 -> 12 -> x^2 -> 4), calibration images, two saved programs and an input."""
    import polyfhe

    root = tmp_path_factory.mktemp("cli")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 12), Square(), nn.Linear(12, 4)).eval()
    model.input_shape = (1, 8, 8)
    calib = np.random.default_rng(0).random((64, 1, 8, 8)).astype(np.float32)
    polyfhe.export(model, target="onnx", path=root / "tiny.onnx")
    np.save(root / "calib.npy", calib)
    np.save(root / "x.npy", np.random.default_rng(1).random((2, 1, 8, 8)))
    polyfhe.export(model, target="ckks", calibration=calib, input_shape=(1, 8, 8)).save(root / "tiny")
    polyfhe.export(model, target="ckks", calibration=calib, input_shape=(1, 8, 8), scale_bits=35).save(root / "other")
    return {"root": root, "onnx": root / "tiny.onnx", "calib": root / "calib.npy", "x": root / "x.npy",
            "tiny": root / "tiny", "other": root / "other"}


def _export(files, out, *flags: str) -> int:
    return main(["export", str(files["onnx"]), "--target", "ckks", "--out", str(out), "--calibration",
                 str(files["calib"]), *flags])


def test_export_flags_reach_export_ckks(files, tmp_path, monkeypatch):
    exporter = importlib.import_module("polyfhe.exporters.ckks")  # the function polyfhe.export shadows the package
    seen: dict = {}
    real = exporter.export_ckks

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(exporter, "export_ckks", spy)
    monkeypatch.setenv("POLYFHE_THREADS", "5")
    assert _export(files, tmp_path / "p", "--poly-modulus-degree", "16384", "--scale-bits", "35",
                   "--galois-key-budget-mb", "64", "--batch-memory-mb", "512", "--threads", "1") == 0
    params = load_program(tmp_path / "p").params
    assert (params.poly_modulus_degree, params.scale_bits, params.security) == (16384, 35, "tc128")
    assert seen["galois_key_budget"] == 64 << 20 and seen["batch_memory_budget"] == 512 << 20
    assert seen["allow_insecure"] is False and "params" not in seen
    assert os.environ["POLYFHE_THREADS"] == "1"


def test_export_modulus_chain_needs_allow_insecure_below_128_bits(files, tmp_path, capsys):
    chain = ["--poly-modulus-degree", "8192", "--scale-bits", "50", "--coeff-mod-bits", "60,50,50,50,60"]
    assert _export(files, tmp_path / "refused", *chain) == 1
    assert "exceeds the 128-bit bound of 218 bits" in capsys.readouterr().err
    assert _export(files, tmp_path / "p", *chain, "--allow-insecure") == 0
    params = load_program(tmp_path / "p").params
    assert (params.coeff_mod_bits, params.scale_bits, params.security) == ((60, 50, 50, 50, 60), 50, "none")
    assert _export(files, tmp_path / "half", "--coeff-mod-bits", "60,50,60") == 2
    assert "--coeff-mod-bits needs --poly-modulus-degree and --scale-bits" in capsys.readouterr().err


def test_run_threads_flag_reaches_the_evaluator(files, monkeypatch, capsys):
    from polyfhe.runtime import execute

    pools: list[int] = []
    real = execute.shared_pool
    monkeypatch.setattr(execute, "shared_pool", lambda threads: pools.append(threads) or real(threads))
    monkeypatch.setenv("POLYFHE_THREADS", "1")
    assert main(["run", str(files["tiny"]), "--input", str(files["x"]), "--threads", "3", "--json"]) == 0
    assert 3 in pools and 1 not in pools  # the encrypted run and the plaintext check both ran on 3 threads
    json.loads(capsys.readouterr().out)


def test_run_with_keys_restores_them_and_refuses_another_programs(files, tmp_path, capsys):
    keys = tmp_path / "keys"
    assert main(["client", "keys", "create", "--program", str(files["tiny"]), "--out", str(keys)]) == 0
    capsys.readouterr()
    assert main(["run", str(files["tiny"]), "--input", str(files["x"]), "--keys", str(keys), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["keys"] == {"restored": True, "dir": str(keys)}
    assert result["classes"] == result["plain_classes"] and result["max_abs_error"] < 1e-3
    assert result["sizes"]["public_context"] == (keys / "public.pfhe").stat().st_size
    assert main(["run", str(files["other"]), "--input", str(files["x"]), "--keys", str(keys)]) == 2
    err = capsys.readouterr().err
    other_id = load_program(files["other"]).program_id
    assert f"needs keys for program {other_id}" in err and "holds keys for program" in err
    assert main(["client", "keys", "create", "--program", str(files["tiny"]), "--out", str(keys)]) == 2
    assert "already holds keys; pass --force" in capsys.readouterr().err


def test_run_progress_is_drawn_on_a_terminal_only(files, monkeypatch):
    def run(stderr: io.StringIO) -> str:
        monkeypatch.setattr(sys, "stdout", io.StringIO())
        monkeypatch.setattr(sys, "stderr", stderr)
        assert main(["run", str(files["tiny"]), "--input", str(files["x"]), "--json"]) == 0
        json.loads(sys.stdout.getvalue())  # stdout holds the JSON object alone
        return stderr.getvalue()

    steps = len(load_program(files["tiny"]).manifest.steps)
    drawn = run(FakeTerminal())
    assert "making keys" in drawn and "evaluating encrypted" in drawn and f"/{steps}" in drawn
    assert run(io.StringIO()) == ""


def test_run_in_a_pipe_prints_no_progress(files):
    """A real process with stderr on a pipe: no bar, no carriage returns."""
    proc = subprocess.run([sys.executable, "-m", "polyfhe.cli", "run", str(files["tiny"]), "--input",
                           str(files["x"]), "--threads", "1"], check=False, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "max abs error" in proc.stdout
    assert "evaluating" not in proc.stderr and "making keys" not in proc.stderr and "\r" not in proc.stderr
