"""The automatic Concrete settings (``n_bits``/``rounding_threshold_bits`` "auto"): a function of the program and the
arguments, never of the memory the export machine has free at that moment, and what they were scored on is in the
manifest. Concrete ML is not needed: the compile step is replaced by fixed replies."""

from __future__ import annotations

import numpy as np
import pytest

from polyfhe.engines.concrete import keys as concrete_keys
from polyfhe.exporters.concrete import export as concrete_export

CALIB = np.zeros((20, 4))
FLOAT_CLASSES = np.arange(20) % 10
GB = 1_000_000_000


def _logits(agree: int) -> np.ndarray:
    """Logits whose argmax equals the float model's on the first ``agree`` of 20 calibration inputs."""
    classes = FLOAT_CLASSES.copy()
    classes[agree:] = (classes[agree:] + 1) % 10
    return np.eye(10)[classes]


# (n_bits, rounding) -> (calibration inputs agreeing with the float model, serialised keys, expanded keys): the
# setting that scores best needs 10 GB of memory to make its keys, the others 2 to 3 GB
TABLE = {(4, 6): (18, 0.10, 1.0), (4, 5): (17, 0.08, 0.8), (5, 6): (18, 0.20, 1.5), (5, 5): (18, 0.15, 1.2),
         (6, 6): (20, 0.90, 8.0), (6, 5): (19, 0.40, 2.0)}


@pytest.fixture
def fake_compiler(monkeypatch):
    def compile_one(worker, proto, calib, settings, out, eval_x, **_):
        agree, serialised, expanded = TABLE[(settings["n_bits"], settings["rounding_threshold_bits"])]
        keys = {"evaluation_keys_bytes": int(serialised * GB), "bootstrap_keys_bytes_in_memory": int(expanded * GB),
                "keyswitch_keys_bytes_in_memory": 0}
        reply = {"keys": keys, "max_bit_width": 6, "calibration_logits": _logits(agree)}
        if eval_x is not None:
            reply["quantized_logits"] = _logits(agree)[:len(eval_x)]
        return reply

    monkeypatch.setattr(concrete_export, "_compile", compile_one)
    monkeypatch.setattr(concrete_export, "_float_logits", lambda proto, x: np.eye(10)[FLOAT_CLASSES[:len(x)]])


def _choose(**kwargs):
    grid = concrete_export._candidates("auto", "auto", None)
    return concrete_export._search(None, None, CALIB, grid, None, None, concrete_export.DEFAULT_MAX_KEYS_BYTES,
                                   **kwargs)


def test_auto_choice_does_not_depend_on_the_memory_free_now(fake_compiler, monkeypatch):
    chosen = {}
    for free in (4 * GB, 64 * GB):
        monkeypatch.setattr(concrete_keys, "available_memory", lambda free=free: free)
        settings, _ = _choose()
        chosen[free] = settings
    assert chosen[4 * GB] == chosen[64 * GB] == {"n_bits": 6, "rounding_threshold_bits": 6, "p_error": None}


def test_auto_choice_takes_an_explicit_memory_budget(fake_compiler, monkeypatch):
    monkeypatch.setattr(concrete_keys, "available_memory", lambda: 1 << 50)
    settings, seen = _choose(memory_budget=4 * GB)  # the 10 GB key generation is stepped over, whatever is free
    assert settings == {"n_bits": 6, "rounding_threshold_bits": 5, "p_error": None}
    refused = next(r for r in seen["candidates"] if r["n_bits"] == 6 and r["rounding_threshold_bits"] == 6)
    assert not refused["fits"] and "key-generation memory budget of 4.00 GB" in refused["refused"]
    assert seen["max_keygen_memory_bytes"] == 4 * GB


def test_manifest_names_what_the_settings_were_scored_on(fake_compiler, caplog):
    with caplog.at_level("INFO", logger=concrete_export.log.name):
        _, seen = _choose()
    assert seen["scored_on"] == "calibration" and seen["samples"] == len(CALIB)
    assert "calibration inputs" in seen["score"]
    assert "calibration inputs" in " ".join(r.getMessage() for r in caplog.records if "chose" in r.getMessage())
    cost = concrete_export._accuracy_cost({"calibration_agreement": 1.0, "auto": seen})
    assert cost["settings_scored_on"] == "calibration"
    assert cost["summary"].endswith("settings chosen on the calibration inputs")

    grid = concrete_export._candidates("auto", "auto", None)
    eval_x, eval_y = np.zeros((10, 4)), FLOAT_CLASSES[:10]
    _, seen = concrete_export._search(None, None, CALIB, grid, eval_x, eval_y, None)
    assert seen["scored_on"] == "eval_data" and seen["samples"] == 10
    accuracy = {"float": 1.0, "quantized": 1.0, "samples": 10}
    cost = concrete_export._accuracy_cost({"calibration_agreement": 1.0, "accuracy": accuracy, "auto": seen})
    assert cost["summary"].endswith("settings chosen on eval_data")
