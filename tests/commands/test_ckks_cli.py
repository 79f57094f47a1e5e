"""``polyfhe export --target ckks`` and ``polyfhe run`` on a tiny square-activation ONNX; bench smoke run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from PIL import Image
from torch import nn

from polyfhe.cli import main
from polyfhe.exporters.onnx import export_onnx

REPO = Path(__file__).resolve().parents[2]


class _Square(nn.Module):
    def forward(self, x):
        return x * x


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(tiny.onnx, program dir, calibration images): 1x8x8 -> 12 -> x^2 -> 4, compiled for layout single."""
    root = tmp_path_factory.mktemp("ckks_cli")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 12), _Square(), nn.Linear(12, 4)).eval()
    onnx_path = root / "tiny.onnx"
    export_onnx(model, onnx_path, (1, 8, 8))  # graph input "input", output "logits"
    x = np.random.default_rng(0).random((64, 1, 8, 8)).astype(np.float32)
    np.save(root / "calib.npy", x)
    prog = root / "prog"
    rc = main(["export", str(onnx_path), "--target", "ckks", "--out", str(prog),
               "--calibration", str(root / "calib.npy")])
    assert rc == 0
    return onnx_path, prog, x


def _onnx_logits(onnx_path: Path, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    return sess.run(None, {"input": x.reshape(1, 1, 8, 8).astype(np.float32)})[0][0]


def _clear_winner(onnx_path: Path, candidates: np.ndarray) -> np.ndarray:
    """A sample whose top two logits differ clearly, so CKKS noise (~1e-6) cannot flip the class."""
    gaps = [np.diff(np.sort(_onnx_logits(onnx_path, c))[-2:])[0] for c in candidates]
    assert max(gaps) > 1e-3
    return candidates[int(np.argmax(gaps))]


def test_export_writes_program_and_prints_summary(exported, tmp_path, capsys):
    onnx_path, prog, _ = exported
    manifest = json.loads((prog / "manifest.json").read_text())
    assert manifest["layout"] == "single" and manifest["input_shape"] == [1, 1, 8, 8]
    assert manifest["info"]["calibrated"] and manifest["galois_steps"]
    assert main(["export", str(onnx_path), "--out", str(tmp_path / "b"), "--layout", "batch",
                 "--calibration", str(exported[0].parent / "calib.npy"), "--samples", "8"]) == 0
    out = capsys.readouterr().out
    assert "Galois keys" in out and "levels used / available" in out
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["layout"] == "batch" and manifest["galois_steps"] == []
    assert manifest["info"]["samples"] == 8


@pytest.mark.fhe
def test_run_npy_and_png_match_plaintext_class(exported, tmp_path, capsys):
    onnx_path, prog, x = exported
    sample = _clear_winner(onnx_path, x[:16])
    np.save(tmp_path / "x.npy", sample)
    assert main(["run", str(prog), "--input", str(tmp_path / "x.npy")]) == 0
    out = capsys.readouterr().out
    assert f"class: {int(np.argmax(_onnx_logits(onnx_path, sample)))}" in out
    assert "evaluate time" in out and "public context" in out

    # An 8x8 grayscale PNG needs no resizing: the program must see exactly pixels / 255.
    pixels = (np.random.default_rng(1).random((16, 8, 8)) * 255).astype(np.uint8)
    img = _clear_winner(onnx_path, pixels.astype(np.float32) / 255.0)
    Image.fromarray((img * 255).round().astype(np.uint8), mode="L").save(tmp_path / "x.png")
    assert main(["run", str(prog), "--input", str(tmp_path / "x.png"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["classes"] == [int(np.argmax(_onnx_logits(onnx_path, img)))]
    assert result["max_abs_error"] < 1e-3
    assert np.allclose(result["logits"][0], _onnx_logits(onnx_path, img), atol=1e-3)
    assert result["sizes"]["input_ciphertext"] > 0 and result["timings"]["evaluate"] > 0


@pytest.mark.fhe
def test_export_and_run_on_the_lattigo_backend(exported, tmp_path, capsys):
    onnx_path, _, x = exported
    prog = tmp_path / "lattigo"
    assert main(["export", str(onnx_path), "--out", str(prog), "--backend", "lattigo",
                 "--calibration", str(onnx_path.parent / "calib.npy")]) == 0
    out = capsys.readouterr().out
    assert "lattigo per query" in out and "hoisted baby steps" in out
    assert json.loads((prog / "manifest.json").read_text())["backend"] == "lattigo"
    sample = _clear_winner(onnx_path, x[:16])
    np.save(tmp_path / "x.npy", sample)
    assert main(["run", str(prog), "--input", str(tmp_path / "x.npy"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["classes"] == [int(np.argmax(_onnx_logits(onnx_path, sample)))]
    assert result["max_abs_error"] < 1e-3
    with pytest.raises(SystemExit):
        main(["export", str(onnx_path), "--out", str(tmp_path / "x"), "--backend", "openfhe"])
    assert "invalid choice: 'openfhe'" in capsys.readouterr().err


@pytest.mark.fhe
def test_run_several_samples_in_one_single_layout_ciphertext(exported, tmp_path, capsys):
    onnx_path, prog, x = exported
    lanes = json.loads((prog / "manifest.json").read_text())["samples_per_ciphertext"]
    assert lanes >= 4
    np.savez(tmp_path / "x.npz", x=x[:4])
    assert main(["run", str(prog), "--input", str(tmp_path / "x.npz"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    want = np.stack([_onnx_logits(onnx_path, row) for row in x[:4]])
    assert np.allclose(result["logits"], want, atol=1e-3)
    np.save(tmp_path / "many.npy", np.resize(x, (lanes + 1, 1, 8, 8)))  # two queries
    assert main(["run", str(prog), "--input", str(tmp_path / "many.npy"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["samples"] == lanes + 1 and result["queries"] == 2 and result["agrees"]


def test_export_no_spend_levels_option(exported, tmp_path, capsys):
    onnx_path, prog, _ = exported
    calib = str(onnx_path.parent / "calib.npy")
    spend = json.loads((prog / "manifest.json").read_text())["info"]["level_spend"]
    assert spend["spent"] == 0 and spend["factored"] == [] and spend["budget"] >= spend["lower_bound"]
    capsys.readouterr()
    assert main(["export", str(onnx_path), "--out", str(tmp_path / "merged"), "--calibration", calib,
                 "--no-spend-levels"]) == 0
    assert "level_spend" not in json.loads((tmp_path / "merged" / "manifest.json").read_text())["info"]
    assert "levels spent" in capsys.readouterr().out


def test_export_samples_per_ciphertext_option(exported, tmp_path, capsys):
    onnx_path, _, _ = exported
    calib = str(onnx_path.parent / "calib.npy")
    assert main(["export", str(onnx_path), "--out", str(tmp_path / "one"), "--calibration", calib,
                 "--samples-per-ciphertext", "1"]) == 0
    assert json.loads((tmp_path / "one" / "manifest.json").read_text())["samples_per_ciphertext"] == 1
    assert "samples per ciphertext" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:  # argparse: not a power of two
        main(["export", str(onnx_path), "--out", str(tmp_path / "bad"), "--samples-per-ciphertext", "3"])
    assert exc.value.code == 2 and "power of two" in capsys.readouterr().err
    assert main(["export", str(onnx_path), "--out", str(tmp_path / "big"), "--calibration", calib,
                 "--samples-per-ciphertext", "4096"]) == 1  # more than fit beside the widest tensor
    assert "powers of two up to 64" in capsys.readouterr().err


def test_export_of_a_checkpoint_takes_raw_images(tmp_path, capsys):
    """A checkpoint trained on (x - mean) / std compiles to a program fed [0, 1] images, at no extra level."""
    from polyfhe.data.sources import load_digits
    from polyfhe.folding import fold
    from polyfhe.models.registry import create_model
    from polyfhe.training.checkpoint import save_checkpoint
    from polyfhe.training.data import Normalization

    kwargs = {"img_size": 8, "dims": (16,), "depths": (1,)}
    torch.manual_seed(0)
    model = create_model("monet_fhe_bn", **kwargs)
    x = load_digits().x_train[:256].astype(np.float32)
    norm = Normalization((0.3,), (0.4,))
    with torch.no_grad():
        model.train()(torch.from_numpy(norm.apply_numpy(x)))
        model.head.weight.normal_(0, 0.1)
    model.eval()
    classes = [f"digit {i}" for i in range(10)]
    save_checkpoint(model, tmp_path / "ckpt", model_name="monet_fhe_bn", model_kwargs=kwargs,
                    extra={"normalization": norm.to_dict(), "classes": classes, "data": "digits",
                           "test_accuracy": 0.5})
    save_checkpoint(model, tmp_path / "raw", model_name="monet_fhe_bn", model_kwargs=kwargs)
    for ckpt, out in (("ckpt", "prog"), ("raw", "plain")):  # default calibration: digits in [0, 1]
        assert main(["export", str(tmp_path / ckpt), "--out", str(tmp_path / out)]) == 0
    capsys.readouterr()
    from polyfhe.program.ckks_program import load_program

    prog = load_program(tmp_path / "prog")
    with torch.no_grad():
        want = fold(model)(torch.from_numpy(norm.apply_numpy(x[:8]))).numpy()
    np.testing.assert_allclose(prog.run_plain(x[:8]), want, rtol=1e-4, atol=1e-4)
    assert prog.manifest.input_range[0] >= 0.0 and prog.manifest.input_range[1] <= 1.0
    assert prog.manifest.depth == load_program(tmp_path / "plain").manifest.depth  # merged: no extra level
    card = json.loads((tmp_path / "prog" / "card.json").read_text())  # what the server's page shows
    assert card == {"class_names": classes, "dataset": "digits", "accuracy": 0.5}
    assert not (tmp_path / "plain" / "card.json").exists()  # a checkpoint that records none: no card


@pytest.mark.parametrize(
    ("name", "make", "message"),
    [
        ("bad.npy", lambda p: np.save(p, np.zeros((3, 5))), "shape (3, 5)"),
        ("missing.npy", lambda p: None, "does not exist"),
        ("text.png", lambda p: p.write_text("not an image"), "not a readable image"),
        ("input.txt", lambda p: p.write_text("1 2 3"), "accepted inputs are"),
    ],
)
def test_run_rejects_bad_input(exported, tmp_path, capsys, name, make, message):
    _, prog, _ = exported
    path = tmp_path / name
    make(path)
    assert main(["run", str(prog), "--input", str(path)]) == 2
    assert message in capsys.readouterr().err


def test_run_rejects_missing_program(tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.zeros((1, 8, 8)))
    assert main(["run", str(tmp_path), "--input", str(tmp_path / "x.npy")]) == 2
    assert "manifest.json is missing" in capsys.readouterr().err


def test_export_rejects_bad_input(exported, tmp_path, capsys):
    onnx_path, _, _ = exported
    assert main(["export", str(tmp_path / "none.onnx"), "--out", str(tmp_path / "p")]) == 2
    assert "does not exist" in capsys.readouterr().err
    np.save(tmp_path / "wrong.npy", np.zeros((4, 1, 5, 5)))
    assert main(["export", str(onnx_path), "--out", str(tmp_path / "p"),
                 "--calibration", str(tmp_path / "wrong.npy")]) == 2
    assert "do not fit the model input (1, 8, 8)" in capsys.readouterr().err
    assert main(["export", "no_such_model", "--out", str(tmp_path / "p")]) == 2
    assert "unknown model 'no_such_model'" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


@pytest.mark.fhe
@pytest.mark.slow  # 20-45 s: a child process, two key sets, the TenSEAL baseline
def test_bench_quick_runs(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "ckks.py"), "--quick", "--batch", "64", "--warm-runs", "1",
         "--out", str(tmp_path)], check=False, capture_output=True, text=True, timeout=240, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    payload = json.loads((tmp_path / "ckks_bench.json").read_text())
    (result,) = payload["results"]
    assert result["case"] == "digits_mlp" and result["batch_size"] == 64
    assert result["max_error"] < 1e-3 and result["naive"]["kind"] == "measured"
    assert result["warm_s"] > 0 and result["speedup"] > 0
    assert (tmp_path / "ckks_bench.png").stat().st_size > 0
    assert "speedup" in proc.stdout
