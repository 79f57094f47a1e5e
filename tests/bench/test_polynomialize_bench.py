"""bench/polynomialize.py runs end to end on digits: ReLU CNN -> polynomialize -> CKKS -> encrypted test images."""

from __future__ import annotations

import json

import pytest
from ckks_testlib import bench_module


@pytest.mark.fhe
def test_the_bench_runs_on_digits_and_records_its_table(tmp_path):
    with bench_module("polynomialize") as bench:
        assert bench.main(["--dataset", "digits", "--epochs", "3", "--ft-epochs", "1", "--train", "600",
                           "--images", "1", "--threads", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    replaced = [(r["path"], r["was"], r["now"]) for r in result["polynomialize"]["replaced"]]
    assert replaced == [("2", "ReLU", "degree-2 polynomial"), ("3", "MaxPool2d", "AvgPool2d"),
                        ("6", "ReLU", "degree-2 polynomial")]
    assert result["params"]["security"] == "tc128" and result["degree"] == 4
    encrypted = result["encrypted"]
    assert encrypted["images"] >= 3 * encrypted["samples_per_ciphertext"] and encrypted["server_warm_s"] > 0
    assert encrypted["max_abs_logit_error"] < 1e-3 * encrypted["max_abs_logit"]
    assert "| encrypted vs plaintext" in (tmp_path / "results.md").read_text()
