"""Per-value ranges of an exported ONNX graph, measured in onnxruntime on calibration images.

The CKKS exporter needs, for every encrypted value, how large it gets: the scale and the headroom of the
modulus chain depend on it. ``profile_onnx_ranges`` exposes every value that depends on the graph input as an
extra graph output, runs the graph batch by batch and keeps exact min / max / mean / std and percentile
estimates (exact whenever a value has at most ``PERCENTILE_SAMPLES`` numbers over the whole data).
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import onnx

from polyfhe.analysis import load_model
from polyfhe.analysis.graph import topological_order
from polyfhe.analysis.loader import ModelLike
from polyfhe.ort_providers import inference_session

__all__ = [
    "PERCENTILE_SAMPLES", "RangeAccumulator", "ValueRange", "array_range", "float_from_json", "json_float",
    "profile_onnx_ranges",
]

log = logging.getLogger(__name__)

PERCENTILE_SAMPLES = 1 << 18  # numbers kept per value for the percentiles (a uniform subsample beyond that)
_FLOAT_TYPES = {
    onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16,
}
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def json_float(value: float) -> float | str:
    """Strict JSON has no NaN/Infinity: non-finite numbers (an overflowing value) become strings."""
    return value if math.isfinite(value) else str(value)


def float_from_json(value: float | str) -> float:
    return _NON_FINITE[value] if isinstance(value, str) else float(value)


@dataclass(frozen=True)
class ValueRange:
    """Range of one ONNX value over the calibration data; ``shape`` is per sample (batch axis dropped).

    ``p001`` / ``p999`` are the 0.1th and 99.9th percentiles; ``count`` is how many numbers were seen.
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
    """Streaming statistics of one value over batches whose leading axis is the sample axis."""

    def __init__(self, name: str, quota_per_sample: float, seed: int = 0) -> None:
        self.name = name
        self.quota_per_sample = quota_per_sample  # numbers kept for the percentiles, per sample of a batch
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
        keep = math.ceil(self.quota_per_sample * (values.shape[0] if values.ndim else 1))
        # Uniform draws with replacement: O(keep), unlike choice(replace=False), which shuffles the batch.
        self.samples.append(flat if flat.size <= keep else flat[self.rng.integers(0, flat.size, keep)])

    def result(self) -> ValueRange:
        if self.count == 0:
            raise ValueError(f"no data was recorded for {self.name!r}")
        mean = self.total / self.count
        var = max(self.total_sq / self.count - mean * mean, 0.0) if math.isfinite(mean) else math.nan
        p001, p999 = (float(v) for v in np.percentile(np.concatenate(self.samples), [0.1, 99.9]))
        abs_max = float(np.max([abs(self.lo), abs(self.hi)]))
        return ValueRange(self.name, self.shape or (), self.lo, self.hi, abs_max,
                          p001, p999, mean, math.sqrt(var), self.count)


def array_range(name: str, x: np.ndarray) -> ValueRange:
    """The :class:`ValueRange` of one array of samples (leading axis = samples)."""
    acc = RangeAccumulator(name, PERCENTILE_SAMPLES / max(1, len(x)))
    acc.update(x)
    return acc.result()


def _input_dependent_floats(proto: onnx.ModelProto) -> tuple[onnx.ValueInfoProto, list[tuple[str, int]]]:
    """The single graph input, and every float value computed from it (name, elem type), in graph order."""
    graph = proto.graph
    initializers = {t.name for t in graph.initializer}
    inputs = [i for i in graph.input if i.name not in initializers]
    if len(inputs) != 1:
        names = [i.name for i in inputs]
        raise ValueError(f"range profiling needs a graph with exactly one input, got {names}")
    inferred = onnx.shape_inference.infer_shapes(proto)
    types = {vi.name: vi.type.tensor_type.elem_type
             for vi in (*inferred.graph.value_info, *inferred.graph.output, *inferred.graph.input)}
    dependent = {inputs[0].name}
    values: list[tuple[str, int]] = []
    for _, node in topological_order(graph):
        if not any(name in dependent for name in node.input):
            continue
        for name in filter(None, node.output):
            dependent.add(name)
            if types.get(name) in _FLOAT_TYPES:
                values.append((name, types[name]))
            else:
                log.debug("not profiling %s (type %s)", name, types.get(name))
    return inputs[0], values


def _check_input(x: np.ndarray, graph_input: onnx.ValueInfoProto) -> None:
    dims = graph_input.type.tensor_type.shape.dim
    expected = tuple(d.dim_value if d.HasField("dim_value") else None for d in dims)
    ok = x.ndim == len(expected) and all(
        e is None or e == s for e, s in zip(expected[1:], x.shape[1:], strict=True)
    )
    if not ok:
        shown = tuple(e if e is not None else "?" for e in expected)
        raise ValueError(f"calibration data of shape {x.shape} does not fit graph input "
                         f"{graph_input.name!r} of shape {shown}")
    if len(x) == 0:
        raise ValueError("no calibration samples (x is empty)")


def profile_onnx_ranges(model: ModelLike, x: np.ndarray, batch_size: int = 256) -> dict[str, ValueRange]:
    """Ranges of the graph input and of every float value computed from it, keyed by ONNX value name.

    ``model`` is a ModelProto, a path or serialized bytes; ``x`` holds the samples (leading axis), in the
    graph input's layout. Runs in onnxruntime with graph optimisations off, so every value is the graph's own.
    """
    import onnxruntime as ort

    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    proto = load_model(model)
    graph_input, values = _input_dependent_floats(proto)
    x = np.asarray(x)
    _check_input(x, graph_input)
    exposed = copy.deepcopy(proto)
    existing = {o.name for o in exposed.graph.output}
    exposed.graph.output.extend(
        onnx.helper.make_tensor_value_info(name, elem, None) for name, elem in values if name not in existing
    )
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = inference_session(exposed.SerializeToString(), options)
    input_type = onnx.helper.tensor_dtype_to_np_dtype(graph_input.type.tensor_type.elem_type)
    names = [name for name, _ in values]
    quota = PERCENTILE_SAMPLES / len(x)
    accumulators = {n: RangeAccumulator(n, quota, seed=i) for i, n in enumerate([graph_input.name, *names])}
    for start in range(0, len(x), batch_size):
        xb = x[start:start + batch_size].astype(input_type, copy=False)
        accumulators[graph_input.name].update(xb)
        for name, out in zip(names, session.run(names, {graph_input.name: xb}), strict=True):
            accumulators[name].update(out)
    log.info("profiled %d values over %d samples", len(accumulators), len(x))
    return {name: acc.result() for name, acc in accumulators.items()}
