"""bench/ckks_plans.py files a server's operation counts as counted (SEAL) or planned (Lattigo: the lowering's
predictions, ``planned_*``), and its table says which."""

from __future__ import annotations

import pytest
from ckks_testlib import bench_module


@pytest.fixture(scope="module")
def plans():
    with bench_module("ckks_plans") as module:
        yield module


def test_lattigo_rotations_are_read_from_its_planned_counts(plans):
    from polyfhe.engines.lattigo.engine import planned_counts

    counts = planned_counts({"giant_rotations": 7, "baby_rotations": 12, "output_rotations": 2, "products": 3})
    assert plans.run_counts(counts, "lattigo") == {"planned_rotations": 21}
    # a baseline tree from before the planned_ names: the same predictions, filed as planned
    assert plans.run_counts({"giant_rotations": 7, "baby_rotations": 12}, "lattigo") == {"planned_rotations": 19}


def test_seal_rotations_stay_counted(plans):
    assert plans.run_counts({"rotations": 40, "key_switches": 45}, "seal") == {"rotations": 40, "key_switches": 45}


def test_the_table_labels_planned_counts(plans):
    info = {"cpu": "cpu", "usable_cores": 2, "load_avg_1m": 0.0, "python": "3.11"}
    rows = [{"case": "c", "column": "this tree / lattigo", "tree": "this", "planned_rotations": 21},
            {"case": "c", "column": "this tree / seal", "tree": "this", "rotations": 40, "key_switches": 45}]
    table = plans.render(info, rows)
    planned = next(line for line in table.splitlines() if "rotations per query, planned" in line)
    counted = next(line for line in table.splitlines() if "rotations per query (counted)" in line)
    assert "| 21 | - |" in planned and "not measured" in planned
    assert "| - | 40 |" in counted
