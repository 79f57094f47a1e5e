"""bench/seal_dot.py on a small ring: both paths timed, identical bytes, table, JSON and plot written."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench" / "seal_dot.py"
pytestmark = pytest.mark.fhe


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH.parent))  # its sibling machine_info, as `python bench/seal_dot.py` sees it
    spec = importlib.util.spec_from_file_location("seal_dot", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.path.remove(str(BENCH.parent))


def test_smoke_compares_both_paths_byte_for_byte(bench, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    args = ["--ring", "4096", "--chain", "40", "30", "30", "40", "--primes", "3", "2", "--terms", "1", "5",
            "--repeats", "1", "--out", str(tmp_path)]
    assert bench.main(args) == 0
    report = json.loads((tmp_path / "seal_dot.json").read_text())
    assert [(r["primes"], r["terms"]) for r in report["rows"]] == [(3, 1), (3, 5), (2, 1), (2, 5)]
    assert all(r["identical"] and r["seal_ms"] > 0 and r["dot_ms"] > 0 for r in report["rows"])
    assert (tmp_path / "seal_dot.png").read_bytes()[:4] == b"\x89PNG"
    assert "dot kernel" in capsys.readouterr().out


def test_levels_the_chain_lacks_or_cannot_multiply_at_are_refused(bench, tmp_path: Path) -> None:
    chain = ["--ring", "4096", "--chain", "40", "30", "30", "40", "--out", str(tmp_path)]
    with pytest.raises(SystemExit, match="1..3 data primes"):
        bench.main([*chain, "--primes", "4"])
    with pytest.raises(SystemExit, match="cannot hold a product"):
        bench.main([*chain, "--primes", "1"])
