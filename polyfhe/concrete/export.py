"""``export(model_or_onnx, target="concrete", calibration=X, n_bits=...)``: fold, export ONNX, compile with Concrete ML.

Our own fold and ONNX exporter make the graph; Concrete ML compiles it in its isolated environment (post-training
quantisation on ``calibration``). With labelled data (``train_data``) and ``quantization="auto"``, a model whose
quantised accuracy falls more than ``qat_tolerance`` below its float accuracy is fine-tuned with polyfhe's own
fake-quant (:mod:`polyfhe.concrete.qat`) and compiled again; the manifest says which quantisation was used and
what each step measured. Concrete ML's refusals come back as :class:`ConcreteExportError` naming the knob to turn.
"""

from __future__ import annotations

import logging
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from polyfhe.concrete.env import ConcreteEnv, find_env
from polyfhe.concrete.program import ConcreteProgram
from polyfhe.concrete.worker import ConcreteCallError, ConcreteWorkerDied, Worker, array_blob, blob_array

__all__ = ["QUANTIZATION_MODES", "ConcreteExportError", "export_concrete"]

log = logging.getLogger(__name__)

QUANTIZATION_MODES = ("auto", "post-training", "quantization-aware")
DEFAULT_N_BITS = 4
MAX_CALIBRATION = 1024
CONCRETE_OPSET = 14  # Concrete ML 1.9 refuses any other
# a gentle step: at 1e-3 the digits MLP fitted polyfhe's fake-quant grid (70% -> 87.5%) but lost under Concrete's
# own (80% -> 69.5%); at 1e-4 Concrete's quantised accuracy rose 80% -> 84.5% (3 bits, 3 epochs; docs/concrete.md)
QAT_LR = 1e-4


class ConcreteExportError(ValueError):
    """Concrete ML cannot compile the model; the message names the node or the knob to change."""


# Concrete ML's refusal (matched on type and message) -> what to tell the user; first match wins
_ADVICE: tuple[tuple[str, str], ...] = (
    (r"NoParametersFound", ("no TFHE parameters fit these bit widths: lower n_bits (now {n_bits}) or "
                            "rounding_threshold_bits (now {rounding_threshold_bits}), or raise p_error "
                            "(now {p_error})")),
    (r"bit.?width|more than 16|16 bits|maximum.*bit",
     ("an accumulator needs more than the 16 bits TFHE allows: set rounding_threshold_bits (now "
      "{rounding_threshold_bits}, e.g. 6) or lower n_bits (now {n_bits})")),
    (r"not supported|unsupported|is not implemented|ONNX_OPS_TO_NUMPY_IMPL",
     "the graph uses an op Concrete ML does not implement"),
)


_TOO_WIDE = re.compile(r"@ (?P<node>\S+)\s*\n\^+ this (?P<bits>\d+)-bit value is used as an input to a table lookup")


_MISSING_OPS = re.compile(r"not currently implemented: (?P<ops>[A-Za-z0-9_, ]+)")


def _explain(exc: ConcreteCallError, settings: dict, proto: Any = None) -> str:
    text = f"{exc.error}: {exc.message}"
    missing = _MISSING_OPS.search(exc.message)
    if missing and proto is not None:
        ops = {op.strip() for op in missing["ops"].split(",") if op.strip()}
        nodes = [f"{n.name or '(unnamed)'} ({n.op_type})" for n in proto.graph.node if n.op_type in ops]
        return (f"Concrete ML could not compile the model: node(s) {', '.join(nodes[:5]) or sorted(ops)} use ops "
                f"Concrete ML does not implement ({', '.join(sorted(ops))}); rewrite them with ops it has "
                "(MatMul/Gemm, Conv, Add, Mul, element-wise activations, pooling) or export another graph")
    if "does not support dilation" in exc.message and proto is not None:
        dilated = [f"{n.name or '(unnamed)'} (dilations {list(a.ints)})" for n in proto.graph.node if n.op_type == "Conv"
                   for a in n.attribute if a.name == "dilations" and any(d != 1 for d in a.ints)]
        return (f"Concrete ML could not compile the model: its convolution has no dilation, and node(s) "
                f"{', '.join(dilated[:5]) or '(a Conv)'} are dilated; use undilated kernels (a dilated kernel equals "
                "a larger one with zeros between its taps) or run the model under CKKS")
    wide = _TOO_WIDE.search(exc.message)
    if wide:  # Concrete marks the offending op with ^^^ under the line that names its ONNX node
        node = wide["node"].rsplit(".", 1)[0]
        return (f"Concrete ML could not compile the model: node {node} produces a {wide['bits']}-bit value that "
                "feeds a table lookup, and TFHE lookups take at most 16 bits; set rounding_threshold_bits "
                f"(now {settings['rounding_threshold_bits']}, e.g. 6) or lower n_bits (now {settings['n_bits']})")
    for pattern, advice in _ADVICE:
        if re.search(pattern, text, flags=re.IGNORECASE):
            return f"Concrete ML could not compile the model: {advice.format(**settings)} ({text[:600]})"
    return f"Concrete ML could not compile the model ({text[:800]})"


def _as_samples(x: Any, shape: tuple[int, ...], what: str) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float64)
    per = int(np.prod(shape))
    if arr.ndim < 2 or arr.shape[0] == 0 or int(np.prod(arr.shape[1:])) != per:
        raise ConcreteExportError(f"{what} of shape {arr.shape} is not a batch of samples of shape {shape}")
    if not np.all(np.isfinite(arr)):
        raise ConcreteExportError(f"{what} contains NaN or infinite values")
    return arr.reshape((-1, *shape))


def _compile(worker: Worker, proto: Any, calib: np.ndarray, settings: dict, out: Path,
             eval_x: np.ndarray | None) -> dict:
    shape, blob = array_blob(calib)
    blobs = [proto.SerializeToString(), blob]
    header = {**settings, "out": str(out), "inputset_shape": shape}
    if eval_x is not None:
        header["eval_shape"], eval_blob = array_blob(eval_x)
        blobs.append(eval_blob)
    try:
        reply, outs = worker.call("compile", header, blobs)
    except ConcreteCallError as exc:
        raise ConcreteExportError(_explain(exc, settings, proto)) from None
    except ConcreteWorkerDied as exc:
        raise ConcreteExportError(f"Concrete ML's compiler process ended ({exc}); try a smaller n_bits") from None
    if eval_x is not None:
        reply["quantized_logits"] = blob_array(outs[0], reply.pop("disable_shape"))
        reply["simulated_logits"] = blob_array(outs[1], reply.pop("simulate_shape"))
    return reply


def _accuracy(logits: np.ndarray, y: np.ndarray) -> float:
    return float((np.asarray(logits).reshape(len(y), -1).argmax(1) == np.asarray(y)).mean())


def _float_logits(proto, x: np.ndarray) -> np.ndarray:
    """The float model's logits (onnxruntime on the exported graph: what Concrete ML quantises)."""
    from polyfhe.ort_providers import inference_session

    session = inference_session(proto.SerializeToString())
    name = session.get_inputs()[0].name
    return np.concatenate([session.run(None, {name: x[i:i + 256].astype(np.float32)})[0]
                           for i in range(0, len(x), 256)])


def export_concrete(model: Any, calibration: Any, *, n_bits: int | dict = DEFAULT_N_BITS,
                    rounding_threshold_bits: int | None = None, p_error: float | None = None,
                    input_shape: tuple[int, ...] | None = None, quantization: str = "auto",
                    train_data: tuple[Any, Any] | None = None, eval_data: tuple[Any, Any] | None = None,
                    qat_epochs: int = 3, qat_tolerance: float = 0.01, env: ConcreteEnv | str | Path | None = None,
                    out: str | Path | None = None) -> ConcreteProgram:
    """Compile ``model`` (module, ONNX path/bytes/ModelProto) for Concrete ML; see the module docstring.

    ``eval_data`` (x, y): accuracy of the float, quantised (clear) and simulated-FHE model, in the manifest.
    ``out``: where the program's files go (default: a temporary folder that lives as long as the program)."""
    import onnx

    from polyfhe.analysis import analyze

    if quantization not in QUANTIZATION_MODES:
        raise ValueError(f"quantization={quantization!r}; accepted: {list(QUANTIZATION_MODES)}")
    if quantization == "quantization-aware" and train_data is None:
        raise ValueError("quantization='quantization-aware' needs train_data=(x, y) to fine-tune on")
    environment = env if isinstance(env, ConcreteEnv) else find_env(env)
    settings = {"n_bits": n_bits, "rounding_threshold_bits": rounding_threshold_bits, "p_error": p_error}
    if input_shape is None and not isinstance(model, (str, Path, bytes)) and hasattr(model, "forward") \
            and getattr(model, "input_shape", None) is None:
        input_shape = tuple(np.shape(calibration)[1:])  # a plain torch module: its inputs look like these
    calib_arr = np.asarray(calibration, dtype=np.float64)
    proto, name = to_concrete_onnx(model, input_shape, check_x=calib_arr[:16] if calib_arr.ndim > 1 else None)
    shape = _graph_input_shape(proto)
    calib = _as_samples(calibration, shape, "calibration")[:MAX_CALIBRATION]
    eval_x, eval_y = (None, None) if eval_data is None else (_as_samples(eval_data[0], shape, "eval_data x"),
                                                            np.asarray(eval_data[1]))
    owned = None if out is not None else tempfile.TemporaryDirectory(prefix="polyfhe-concrete-")
    folder = Path(out if out is not None else owned.name)
    folder.mkdir(parents=True, exist_ok=True)
    worker = Worker("compiler", environment)
    try:
        versions, _ = worker.call("ping")
        versions.pop("ok", None)
        versions.pop("blobs", None)
        report = analyze(proto)
        info: dict[str, Any] = {"model_name": name, "polynomial": report.polynomial, "degree": report.degree,
                                "mult_depth": report.mult_depth}
        reply = _compile(worker, proto, calib, settings, folder, eval_x)
        used = "post-training"
        if eval_x is not None:
            info["accuracy"] = _accuracies(model, proto, reply, eval_x, eval_y)
        if _wants_qat(quantization, train_data, info.get("accuracy"), qat_tolerance):
            tuned, qat_info = _finetune(model, proto, train_data, eval_data, shape, n_bits, qat_epochs)
            tuned_proto, _ = to_concrete_onnx(tuned, shape, check_x=calib[:16])
            ptq_accuracy = info.get("accuracy")
            info["post_training"] = {"accuracy": ptq_accuracy, "max_bit_width": reply["max_bit_width"]}
            reply = _compile(worker, tuned_proto, calib, settings, folder, eval_x)
            info["qat"] = qat_info
            tuned_accuracy = None if eval_x is None else _accuracies(tuned, tuned_proto, reply, eval_x, eval_y)
            if quantization == "auto" and tuned_accuracy["quantized"] <= ptq_accuracy["quantized"]:
                # fine-tuning did not pay off under Concrete's own quantiser: keep the post-training program
                log.warning("quantization-aware fine-tuning reached %.3f, post-training %.3f: keeping the latter",
                            tuned_accuracy["quantized"], ptq_accuracy["quantized"])
                info["qat"]["kept"], info["qat"]["accuracy"] = False, tuned_accuracy
                reply = _compile(worker, proto, calib, settings, folder, eval_x)
                used = "post-training (quantization-aware fine-tuning tried, not kept)"
            else:
                proto, used = tuned_proto, f"quantization-aware (polyfhe fake-quant, {qat_epochs} epochs)"
                info["qat"]["kept"] = True
                if tuned_accuracy is not None:
                    info["accuracy"] = tuned_accuracy
        info.update({k: reply[k] for k in ("compile_seconds", "max_bit_width", "p_error", "global_p_error",
                                           "statistics") if k in reply})
    finally:
        worker.close()
    onnx.save(proto, str(folder / "model.onnx"))
    output_size = int(np.prod([d.dim_value for d in proto.graph.output[0].type.tensor_type.shape.dim][1:]))
    program = ConcreteProgram.create(folder, (1, *shape), output_size, settings, used, versions, info, owned)
    if eval_x is not None:
        program.evaluation = {"quantized": reply["quantized_logits"], "simulated": reply["simulated_logits"]}
    log.info("compiled %s for Concrete ML: %s quantisation at n_bits=%s, max bit width %s", name, used, n_bits,
             info.get("max_bit_width"))
    return program


def to_concrete_onnx(model: Any, input_shape: tuple[int, ...] | None,
                     check_x: np.ndarray | None = None) -> tuple[Any, str]:
    """(ModelProto at the opset Concrete ML reads, name): modules are folded and exported by our exporter at that
    opset, ONNX graphs converted to it; then constant and shape subgraphs are folded (:mod:`graph_prep`) and the
    result checked against the unfolded graph on ``check_x``."""
    from polyfhe.concrete.graph_prep import fold_public_shapes  # onnx: never imported by the runtime

    proto, name = _opset_graph(model, input_shape)
    folded, count = fold_public_shapes(proto)
    if count and check_x is not None:
        check_x = np.asarray(check_x).reshape((-1, *_graph_input_shape(proto)))
        want, got = _float_logits(proto, check_x), _float_logits(folded, check_x)
        if not np.allclose(got, want, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(want).max()))):
            raise ConcreteExportError(f"folding {count} shape nodes changed the graph's outputs (max difference "
                                      f"{float(np.abs(got - want).max()):.3g}); please report this model")
    return folded, name


def _opset_graph(model: Any, input_shape: tuple[int, ...] | None) -> tuple[Any, str]:
    import onnx
    from onnx import version_converter

    from polyfhe.analysis.loader import default_opset, load_model

    if hasattr(model, "forward"):
        from polyfhe.export.onnx import export_onnx

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "model.onnx"
            export_onnx(model, path, input_shape, opset=CONCRETE_OPSET, require_polynomial=False)
            return onnx.load(str(path)), getattr(model, "model_name", type(model).__name__)
    proto = load_model(model)
    name = Path(model).stem if isinstance(model, (str, Path)) else "onnx"
    if default_opset(proto) != CONCRETE_OPSET:
        try:
            proto = version_converter.convert_version(proto, CONCRETE_OPSET)
        except Exception as exc:  # the converter raises several types
            raise ConcreteExportError(f"the ONNX graph (opset {default_opset(proto)}) cannot be converted to opset "
                                      f"{CONCRETE_OPSET}, the one Concrete ML reads: {exc}") from exc
    return proto, name


def _graph_input_shape(proto) -> tuple[int, ...]:
    initializers = {t.name for t in proto.graph.initializer}
    graph_input = next(i for i in proto.graph.input if i.name not in initializers)
    dims = [d.dim_value for d in graph_input.type.tensor_type.shape.dim][1:]
    if not dims or not all(dims):
        raise ConcreteExportError("the ONNX graph input needs a static shape after the batch axis")
    return tuple(int(d) for d in dims)


def _accuracies(model: Any, proto, reply: dict, x: np.ndarray, y: np.ndarray) -> dict:
    return {"float": _accuracy(_float_logits(proto, x), y),
            "quantized": _accuracy(reply["quantized_logits"], y),
            "simulated": _accuracy(reply["simulated_logits"], y), "samples": len(y)}


def _wants_qat(mode: str, train_data: Any, accuracy: dict | None, tolerance: float) -> bool:
    if mode == "quantization-aware":
        return True
    if mode != "auto" or train_data is None or accuracy is None:
        return False
    return accuracy["float"] - accuracy["quantized"] > tolerance


def _finetune(model: Any, proto, train_data, eval_data, shape, n_bits, epochs: int) -> tuple[Any, dict]:
    from torch import nn

    if not isinstance(model, nn.Module):
        raise ConcreteExportError("quantization-aware fine-tuning needs the torch module, not an ONNX graph; "
                                  "pass the model or use quantization='post-training'")
    from polyfhe.concrete.qat import quantization_aware_finetune

    bits = n_bits if isinstance(n_bits, int) else int(n_bits.get("op_inputs", DEFAULT_N_BITS))
    x_tr = _as_samples(train_data[0], shape, "train_data x").astype(np.float32)
    x_ev, y_ev = (x_tr, train_data[1]) if eval_data is None else (
        _as_samples(eval_data[0], shape, "eval_data x").astype(np.float32), eval_data[1])
    result = quantization_aware_finetune(model, x_tr, np.asarray(train_data[1]), x_ev, np.asarray(y_ev),
                                         n_bits=bits, epochs=epochs, lr=QAT_LR)
    return result.model, result.to_dict()
