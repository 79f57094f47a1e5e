"""The one range reduction: streaming min / max / moments / percentiles of named values over batches.

Every range profiler (onnxruntime over an ONNX graph, the compiler's circuit in numpy, a compiled program run
on plaintext slots) decides only which values it observes and how it evaluates them; the bookkeeping is a
:class:`RangeProfile` here. Only numpy is imported, so the compiler can use it without the training stack.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, fields
from typing import Any, Generic, TypeVar

import numpy as np

__all__ = [
    "PERCENTILE_SAMPLES", "RangeAccumulator", "RangeProfile", "ValueRange", "array_range", "float_from_json",
    "json_float",
]

PERCENTILE_SAMPLES = 1 << 18  # numbers kept per value for the percentiles (a uniform subsample beyond that)
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}

K = TypeVar("K", bound=Hashable)


def json_float(value: float) -> float | str:
    """Strict JSON has no NaN/Infinity: non-finite numbers (an overflowing value) become strings."""
    return value if math.isfinite(value) else str(value)


def float_from_json(value: float | str) -> float:
    return _NON_FINITE[value] if isinstance(value, str) else float(value)


@dataclass(frozen=True)
class ValueRange:
    """Range of one value over the calibration data; ``shape`` is per sample (batch axis dropped).

    ``p001`` / ``p999`` are the 0.1th and 99.9th percentiles (NaN when the profile kept no numbers for them);
    ``count`` is how many numbers were seen.
    """

    name: str
    shape: tuple[int, ...]
    min: float
    max: float
    abs_max: float
    p001: float
    p999: float
    mean: float
    std: float
    count: int = 0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "shape": list(self.shape), "count": self.count}
        for f in fields(self):
            if f.name not in out:
                out[f.name] = json_float(getattr(self, f.name))
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ValueRange:
        skip = ("name", "shape", "count")
        floats = {f.name: float_from_json(data[f.name]) for f in fields(cls) if f.name not in skip}
        return cls(name=str(data["name"]), shape=tuple(int(s) for s in data["shape"]),
                   count=int(data.get("count", 0)), **floats)


class RangeAccumulator:
    """Streaming statistics of one value over batches whose leading axis is the sample axis.

    ``quota_per_sample`` numbers per sample of a batch are kept for the percentiles; 0 keeps none (extremes and
    moments only, the percentiles are NaN).
    """

    def __init__(self, name: str, quota_per_sample: float, seed: int = 0) -> None:
        self.name = name
        self.quota_per_sample = quota_per_sample
        self.rng = np.random.default_rng(seed)
        self.shape: tuple[int, ...] | None = None
        self.count = 0
        self.total = self.total_sq = 0.0
        self.lo, self.hi = math.inf, -math.inf
        self.samples: list[np.ndarray] = []

    def update(self, batch: np.ndarray) -> None:
        values = np.asarray(batch, dtype=np.float64)
        if self.shape is None:
            self.shape = tuple(values.shape[1:]) if values.ndim else ()
        flat = values.ravel()
        if flat.size == 0:
            return
        self.count += flat.size
        self.total += float(flat.sum())
        self.total_sq += float(np.square(flat).sum())  # not np.dot: BLAS threads stall on a busy machine
        self.lo = float(np.min([self.lo, flat.min()]))  # np.min / np.max propagate NaN, Python's min does not
        self.hi = float(np.max([self.hi, flat.max()]))
        if self.quota_per_sample <= 0:
            return
        keep = math.ceil(self.quota_per_sample * (values.shape[0] if values.ndim else 1))
        # Uniform draws with replacement: O(keep), unlike choice(replace=False), which shuffles the batch.
        self.samples.append(flat if flat.size <= keep else flat[self.rng.integers(0, flat.size, keep)])

    @property
    def abs_max(self) -> float:
        """max |value| seen so far (0 before any number)."""
        return float(np.max([abs(self.lo), abs(self.hi)])) if self.count else 0.0

    def result(self) -> ValueRange:
        if self.count == 0:
            raise ValueError(f"no data was recorded for {self.name!r}")
        mean = self.total / self.count
        var = max(self.total_sq / self.count - mean * mean, 0.0) if math.isfinite(mean) else math.nan
        p001 = p999 = math.nan
        if self.samples:
            p001, p999 = (float(v) for v in np.percentile(np.concatenate(self.samples), [0.1, 99.9]))
        return ValueRange(self.name, self.shape or (), self.lo, self.hi, self.abs_max,
                          p001, p999, mean, math.sqrt(var), self.count)


class RangeProfile(Generic[K]):
    """Ranges of several values, keyed by whatever names them (an ONNX value name, a circuit register).

    ``percentile_samples`` numbers per value are kept for the percentiles over ``samples`` calibration samples
    (0: none). A value's accumulator is made on its first observation, seeded by that order, so a profiler
    that observes its values in a fixed order gets reproducible percentiles.
    """

    def __init__(self, samples: int = 1, percentile_samples: int = 0) -> None:
        self.quota = percentile_samples / max(1, samples)
        self.accumulators: dict[K, RangeAccumulator] = {}

    def observe(self, key: K, batch: np.ndarray) -> None:
        """Add a batch of ``key``'s values (leading axis: samples)."""
        acc = self.accumulators.get(key)
        if acc is None:
            acc = self.accumulators[key] = RangeAccumulator(str(key), self.quota, seed=len(self.accumulators))
        acc.update(batch)

    def ranges(self) -> dict[K, ValueRange]:
        """Full statistics per value, in the order they were first observed."""
        return {key: acc.result() for key, acc in self.accumulators.items()}

    def extremes(self) -> dict[K, tuple[float, float]]:
        """(min, max) per value."""
        return {key: (acc.lo, acc.hi) for key, acc in self.accumulators.items()}

    def abs_max(self) -> dict[K, float]:
        """max |value| per value (0 for a value observed only empty)."""
        return {key: acc.abs_max for key, acc in self.accumulators.items()}


def array_range(name: str, x: np.ndarray) -> ValueRange:
    """The :class:`ValueRange` of one array of samples (leading axis = samples)."""
    profile: RangeProfile[str] = RangeProfile(len(x), PERCENTILE_SAMPLES)
    profile.observe(name, x)
    return profile.ranges()[name]
