"""The one range reduction every profiler shares: exact extremes, moments, percentiles, and a light import."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from polyfhe.calibration.reduction import PERCENTILE_SAMPLES, RangeProfile, array_range


def test_profile_extremes_and_abs_max_are_exact_over_batches() -> None:
    rng = np.random.default_rng(0)
    batches = {r: [rng.normal(scale=r + 1, size=(n, 7)) for n in (3, 5, 1)] for r in range(4)}
    profile: RangeProfile[int] = RangeProfile()
    for r, parts in batches.items():
        for part in parts:
            profile.observe(r, part)
    for r, parts in batches.items():
        whole = np.concatenate(parts)
        assert profile.extremes()[r] == (float(whole.min()), float(whole.max()))
        assert profile.abs_max()[r] == float(np.max(np.abs(whole)))
    assert list(profile.abs_max()) == list(batches)  # first-observation order


def test_profile_without_percentiles_still_has_moments() -> None:
    profile: RangeProfile[str] = RangeProfile()
    profile.observe("v", np.array([[1.0, -3.0], [2.0, 4.0]]))
    r = profile.ranges()["v"]
    assert (r.min, r.max, r.abs_max, r.count, r.shape) == (-3.0, 4.0, 4.0, 4, (2,))
    assert r.mean == pytest.approx(1.0) and math.isnan(r.p001) and math.isnan(r.p999)


def test_empty_value_has_abs_max_zero() -> None:
    profile: RangeProfile[int] = RangeProfile()
    profile.observe(0, np.zeros((2, 0)))
    assert profile.abs_max() == {0: 0.0}


def test_array_range_percentiles_are_exact_for_small_data() -> None:
    x = np.arange(1000, dtype=np.float64).reshape(10, 100)
    assert x.size <= PERCENTILE_SAMPLES
    r = array_range("x", x)
    assert (r.p001, r.p999) == tuple(float(v) for v in np.percentile(x, [0.1, 99.9]))
    assert r.std == pytest.approx(float(x.std()))


def test_reduction_imports_without_the_training_stack() -> None:
    code = "import sys, polyfhe.calibration.reduction; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "False"
