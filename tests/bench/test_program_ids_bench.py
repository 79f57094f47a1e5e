"""bench/program_ids.py: a case's program id is hex and survives save and load (the refactor's id check)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import polyfhe


def _bench():
    """``bench/program_ids.py``, loaded by path so that bench/ never joins ``sys.path``."""
    path = Path(__file__).resolve().parents[2] / "bench" / "program_ids.py"
    spec = importlib.util.spec_from_file_location("bench_program_ids_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_case_id_is_hex_and_unchanged_by_save_and_load(tmp_path):
    bench = _bench()
    program = bench.build("seal_batch")  # the cheapest export: a batch-layout MLP on 64 digits
    assert re.fullmatch(r"[0-9a-f]{16,}", program.program_id)
    program.save(tmp_path / "prog")
    assert polyfhe.load_program(tmp_path / "prog").program_id == program.program_id
    row = bench.run_case("seal_batch")
    assert row["id"] == program.program_id and "error" not in row  # deterministic: a second export, same id
