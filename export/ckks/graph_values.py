"""What the lowering knows of an ONNX graph before it walks it: the batch axis fixed to 1, and every value's
concrete shape and value on a zero input."""

from __future__ import annotations

import numpy as np
import onnx

from polyfhe.exporters.ckks.affine import LoweringError
from polyfhe.ort_providers import inference_session  # the probe stays on CPU: its values feed the compiler

__all__ = ["fix_batch_axis", "probe_values"]


def fix_batch_axis(model: onnx.ModelProto) -> onnx.ModelProto:
    """A symbolic leading (batch) axis of the input becomes 1: one ciphertext program serves one sample."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    init = {t.name for t in model.graph.initializer}
    for info in [*model.graph.input, *model.graph.output]:
        if info.name in init or not info.type.tensor_type.HasField("shape"):
            continue
        dims = info.type.tensor_type.shape.dim
        if dims and not dims[0].HasField("dim_value"):
            dims[0].dim_value = 1
    for info in model.graph.value_info:
        info.type.tensor_type.ClearField("shape")  # re-inferred from the fixed input shape
    return model


def probe_values(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Concrete values (hence shapes) of every value: run onnxruntime once on zeros with all intermediates exposed.

    Static shape inference gives up on shapes computed through Shape/Gather/Concat chains (the TorchScript
    exporter emits many); one real run cannot.
    """
    import onnxruntime as ort

    probe = onnx.ModelProto.FromString(model.SerializeToString())
    known = {o.name for o in probe.graph.output}
    for node in probe.graph.node:
        for out in node.output:
            if out and out not in known:
                probe.graph.output.append(onnx.ValueInfoProto(name=out))
                known.add(out)
    init = {t.name for t in probe.graph.initializer}
    feeds = {}
    for info in probe.graph.input:
        if info.name in init:
            continue
        dims = info.type.tensor_type.shape.dim
        if not all(d.HasField("dim_value") for d in dims):
            raise LoweringError(f"input {info.name!r} needs a static shape; export with a fixed input_shape")
        elem = onnx.helper.tensor_dtype_to_np_dtype(info.type.tensor_type.elem_type)
        feeds[info.name] = np.zeros([d.dim_value for d in dims], dtype=elem)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    try:
        session = inference_session(probe.SerializeToString(), options, device="cpu")
        values = session.run(None, feeds)
    except Exception as exc:
        raise LoweringError(f"onnxruntime could not run the model to find its shapes: {exc}") from exc
    probed = dict(zip([o.name for o in probe.graph.output], values, strict=True))
    probed.update(feeds)
    return probed
