"""bench/gpu_throughput.py in its CPU smoke mode: our three T models measured, timm models skipped clearly."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu_throughput.py"
OURS = ["MONet-T", "CPolyNeXt-T", "APolyNeXt-T"]
SMOKE = ["--device", "cpu", "--img-size", "64", "--steps", "2", "--warmup", "1", "--batch-size", "2"]


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH.parent))  # its sibling machine_info, as `python bench/gpu_throughput.py` sees it
    spec = importlib.util.spec_from_file_location("gpu_throughput", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)
    sys.path.remove(str(BENCH.parent))


def test_smoke_measures_our_models(bench, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert bench.main([*SMOKE, "--models", *OURS, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "throughput.json").read_text())
    assert [r["model"] for r in report["results"]] == OURS
    assert all(r["infer_img_s"] > 0 and r["train_img_s"] > 0 for r in report["results"])
    assert report["machine"]["batch_size"] == 2 and report["machine"]["torch"] == torch.__version__
    assert (tmp_path / "throughput.png").read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr().out
    assert "torch " + torch.__version__ in out and "CPolyNeXt-T" in out


@pytest.mark.skipif(importlib.util.find_spec("timm") is not None, reason="timm is installed here")
def test_timm_models_skipped_or_refused_without_timm(bench, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert bench.main([*SMOKE, "--models", "ConvFormer-S18", "--out", str(tmp_path)]) == 0
    assert 'skipping ConvFormer-S18: timm is not installed' in capsys.readouterr().out
    assert json.loads((tmp_path / "throughput.json").read_text())["results"] == []
    assert bench.main([*SMOKE, "--models", "CAFormer-S18", "--require-timm", "--out", str(tmp_path)]) == 2
    assert 'pip install "polyfhe[bench]"' in capsys.readouterr().err


def test_compile_refused_on_cpu(bench, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert bench.main([*SMOKE, "--models", "MONet-T", "--compile", "--out", str(tmp_path)]) == 2
    assert "CUDA only" in capsys.readouterr().err
