"""Per-value ranges of an exported ONNX graph, measured in onnxruntime on calibration images.

The CKKS exporter needs, for every encrypted value, how large it gets: the scale and the headroom of the
modulus chain depend on it. ``profile_onnx_ranges`` exposes every value that depends on the graph input as an
extra graph output, runs the graph batch by batch and keeps exact min / max / mean / std and percentile
estimates (exact whenever a value has at most ``PERCENTILE_SAMPLES`` numbers over the whole data). The
statistics are the shared reduction of :mod:`polyfhe.calibration.reduction`.
"""

from __future__ import annotations

import copy
import logging

import numpy as np
import onnx

from polyfhe.analysis import load_model
from polyfhe.analysis.graph import topological_order
from polyfhe.analysis.loader import ModelLike
from polyfhe.calibration.reduction import (
    PERCENTILE_SAMPLES,
    RangeAccumulator,
    RangeProfile,
    ValueRange,
    array_range,
    float_from_json,
    json_float,
)
from polyfhe.ort_providers import inference_session

__all__ = [
    "PERCENTILE_SAMPLES", "RangeAccumulator", "RangeProfile", "ValueRange", "array_range", "float_from_json",
    "json_float", "profile_onnx_ranges",
]

log = logging.getLogger(__name__)

_FLOAT_TYPES = {
    onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16,
}


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
    profile: RangeProfile[str] = RangeProfile(len(x), PERCENTILE_SAMPLES)
    for start in range(0, len(x), batch_size):
        xb = x[start:start + batch_size].astype(input_type, copy=False)
        profile.observe(graph_input.name, xb)
        for name, out in zip(names, session.run(names, {graph_input.name: xb}), strict=True):
            profile.observe(name, out)
    log.info("profiled %d values over %d samples", len(profile.accumulators), len(x))
    return profile.ranges()
