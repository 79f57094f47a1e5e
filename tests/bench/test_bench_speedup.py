"""bench/ckks.py compares like with like (cold/cold, warm/warm); Lattigo's per-run counts say they are planned."""

from __future__ import annotations

import pytest
from ckks_testlib import bench_module


@pytest.fixture(scope="module")
def bench():
    with bench_module("ckks") as module:
        yield module


def test_both_speedups_are_like_for_like(bench):
    ours = {"cold_s": 2.0, "warm_s": 0.5}
    naive = {"latency_s": 30.0, "latency_cold_s": 30.0, "latency_warm_s": 20.0}
    out = bench.speedups(ours, naive)
    assert out["speedup_cold"] == pytest.approx(30.0 / 2.0)  # naive cold / ours cold
    assert out["speedup_warm"] == pytest.approx(20.0 / 0.5)  # naive warm / ours warm
    assert out["speedup"] == out["speedup_warm"] and out["speedup_basis"] == "warm/warm"
    # the old mixed ratio (naive cold / ours warm) is neither
    assert 30.0 / 0.5 not in (out["speedup_cold"], out["speedup_warm"])
    only_cold = bench.speedups(ours, {**naive, "latency_warm_s": None})
    assert only_cold["speedup_warm"] is None and only_cold["speedup_basis"] == "cold/cold"


def test_lattigo_run_counts_are_labelled_planned():
    from polyfhe.engines.lattigo.engine import planned_counts

    counts = planned_counts({"bootstraps": 2, "giant_rotations": 7, "products": 3})
    assert counts == {"planned_bootstraps": 2, "planned_giant_rotations": 7, "planned_products": 3}
    assert all(k.startswith("planned_") for k in counts)


def test_run_renders_planned_counts_as_planned():
    from rich.console import Console

    from polyfhe.commands.render import counts_table

    console = Console(record=True, width=120)
    console.print(counts_table({"planned_giant_rotations": 7}, {}))
    text = console.export_text()
    assert "giant rotations (planned, not measured)" in text and "7" in text
