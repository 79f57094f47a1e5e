"""``polyfhe models``: fast by default (no analyzer), the analyzer's columns with --analyze, and no overflow
warnings from the untrained deep models the analysis exports."""

from __future__ import annotations

import json
import logging

import pytest

from polyfhe import zoo


def _no_analysis(row):
    raise AssertionError(f"the analyzer ran for {row.name} without --analyze")


def test_default_lists_the_zoo_without_running_the_analyzer(monkeypatch, capsys):
    from polyfhe.cli import main

    monkeypatch.setattr(zoo, "with_analysis", _no_analysis)
    assert main(["models", "monet_lr*", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == ["monet_lr", "monet_lr_bn"]
    assert all(r["params"] > 0 and r["macs"] > 0 for r in rows)
    assert all(r["degree"] is None and r["levels"] is None for r in rows)


def test_default_table_leaves_out_the_analyzer_columns_and_says_how_to_get_them(monkeypatch, capsys):
    from polyfhe.cli import main

    monkeypatch.setattr(zoo, "with_analysis", _no_analysis)
    assert main(["models", "lpnn_bn"]) == 0
    out = capsys.readouterr().out
    assert "lpnn_bn" in out and "GMACs" in out and "degree" not in out.split("\n")[2]
    assert "polyfhe models --analyze" in out


def test_no_analyze_is_still_accepted(monkeypatch, capsys):
    from polyfhe.cli import main

    monkeypatch.setattr(zoo, "with_analysis", _no_analysis)
    assert main(["models", "lpnn_bn", "--no-analyze", "--no-macs", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["macs"] is None and row["degree"] is None


def test_analyze_fills_degree_depth_and_levels_without_overflow_warnings(capsys, caplog):
    """monet_fhe_deep_bn, randomly initialised, overflows float32 on random inputs: expected for an untrained
    deep polynomial net, and no concern of a structural analysis, so nothing is said about it."""
    from polyfhe.cli import main

    with caplog.at_level(logging.WARNING):
        assert main(["models", "monet_fhe_deep_bn", "--analyze", "--json"]) == 0
    captured = capsys.readouterr()
    (row,) = json.loads(captured.out)
    assert (row["mult_depth"], row["levels"]) == (12, 25) and row["degree"] == 2**12
    assert "overflow" not in caplog.text and "overflow" not in captured.err
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_only_the_expected_overflow_warning_is_dropped(monkeypatch, caplog):
    """Other warnings of the exporter still reach the log while the zoo analysis runs."""
    import polyfhe.analysis
    import polyfhe.exporters.onnx as onnx_exporter

    exporter_log = logging.getLogger("polyfhe.exporters.onnx")

    def fake_export(name, img_size, out_dir):
        exporter_log.warning("%s: output overflows on random inputs (untrained deep model?); parity not checked",
                             "X")
        exporter_log.warning("something else went wrong")
        return "graph.onnx"

    class Report:
        degree, mult_depth, levels = 4, 2, 3

    monkeypatch.setattr(onnx_exporter, "export_zoo_model_for_check", fake_export)
    monkeypatch.setattr(polyfhe.analysis, "analyze", lambda path: Report())
    row = zoo.zoo_row("lpnn_bn", with_macs=False)
    with caplog.at_level(logging.WARNING):
        analysed = zoo.with_analysis(row)
    assert (analysed.degree, analysed.mult_depth, analysed.levels) == (4, 2, 3)
    assert "something else went wrong" in caplog.text and "overflows" not in caplog.text
    assert not exporter_log.filters  # the filter is gone afterwards
    exporter_log.warning("%s: output overflows on random inputs (untrained deep model?); parity not checked", "Y")
    assert "overflows" in caplog.text  # outside the zoo analysis the warning is said as before


def test_zoo_rows_draws_progress_through_the_callable_it_is_given():
    seen = []

    def progress(items, desc, total):
        seen.append((desc, total))
        return items

    rows = zoo.zoo_rows("monet_lr*", with_macs=False, progress=progress)
    assert len(rows) == 2 and seen == [("counting parameters", 2)]


@pytest.mark.parametrize("pattern", ["no_such_*"])
def test_no_match_exits_1(pattern, capsys):
    from polyfhe.cli import main

    assert main(["models", pattern]) == 1
    assert "no model matches" in capsys.readouterr().out
