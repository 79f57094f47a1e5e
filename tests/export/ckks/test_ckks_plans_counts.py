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


def test_the_cost_model_prices_the_servers_plaintext_budget(plans, monkeypatch):
    """The bench's predicted columns come from the cost model with the budget its servers run with
    (``--plaintext-cache-gb``), so the measured/predicted ratio compares like with like."""
    seen = {}

    class Prediction:
        eval_seconds, cold_seconds, peak_bytes, samples = 8.0, 12.0, 3e9, 2

    def predict(workload, costs, **kwargs):
        seen.update(kwargs, workload=workload, costs=costs)
        return Prediction()

    attrs = {"predict": predict, "program_workload": lambda prog: ("workload", prog),
             "calibrated_costs": lambda engine: ("costs", engine)}
    monkeypatch.setattr(plans, "_tree_attr", lambda name, *modules: attrs[name])

    class Program:
        class manifest:
            backend = "seal"

    monkeypatch.delenv("POLYFHE_BENCH_PLAINTEXT_GB", raising=False)
    assert plans._predicted(Program) == {"predicted_warm_s": 4.0, "predicted_cold_s": 12.0, "predicted_peak_gb": 3.0}
    assert "plaintext_budget" not in seen and seen["costs"] == ("costs", "seal")
    monkeypatch.setenv("POLYFHE_BENCH_PLAINTEXT_GB", "6")
    plans._predicted(Program)
    assert seen["plaintext_budget"] == 6 * 10**9


def test_a_tree_without_the_cost_model_predicts_nothing(plans, monkeypatch):
    def missing(name, *modules):
        raise ImportError(name)

    monkeypatch.setattr(plans, "_tree_attr", missing)
    assert plans._predicted(object()) == {}
