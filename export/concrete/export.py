"""``export(model_or_onnx, target="concrete", calibration=X, n_bits=...)``: fold, export ONNX, compile with Concrete ML.

Our own fold and ONNX exporter make the graph; Concrete ML compiles it in its isolated environment (post-training
quantisation on ``calibration``). With labelled data (``train_data``) and ``quantization="auto"``, a model whose
quantised accuracy falls more than ``qat_tolerance`` below its float accuracy is fine-tuned with polyfhe's own
fake-quant (:mod:`polyfhe.exporters.concrete.qat`) and compiled again; the manifest says which quantisation was used and
what each step measured. Concrete ML's refusals come back as :class:`ConcreteExportError` naming the knob to turn.

Defaults (``n_bits="auto"``, ``rounding_threshold_bits="auto"``): a small grid (:data:`AUTO_N_BITS` x
:data:`AUTO_ROUNDING`: accumulators rounded to 6 bits, the value Concrete ML's authors recommend, or 5) is compiled
and scored against the float model: on ``eval_data``'s labels when given, else as the agreement of the top-1 class
with the float model's on the calibration inputs (the manifest's ``info["auto"]["scored_on"]``, the log and the
accuracy summary say which). Among the settings within :data:`AUTO_TOLERANCE` of the best score, the one with the
smallest predicted evaluation keys wins. Each candidate's predicted keys (read from the compiled circuit, before any
key is made, :mod:`polyfhe.engines.concrete.keys`) must fit ``max_keys_bytes`` and the key-generation memory budget
``max_keygen_memory_bytes`` (a fixed default, never the memory free now, so the choice is a function of the program
and the arguments alone); candidates that do not are stepped over, and settings given explicitly that do not are
refused, in seconds, with the predicted size.
"""

from __future__ import annotations

import logging
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from polyfhe.engines.concrete.env import ConcreteEnv, find_env
from polyfhe.engines.concrete.keys import (
    DEFAULT_KEYGEN_MEMORY_BYTES,
    DEFAULT_MAX_KEYS_BYTES,
    ConcreteKeysTooLarge,
    check_keys_fit,
    describe,
    progress,
)
from polyfhe.engines.concrete.program import ConcreteProgram
from polyfhe.engines.concrete.worker import (
    ConcreteCallError,
    ConcreteWorkerDied,
    Worker,
    array_blob,
    blob_array,
)

__all__ = ["QUANTIZATION_MODES", "ConcreteExportError", "export_concrete"]

log = logging.getLogger(__name__)

QUANTIZATION_MODES = ("auto", "post-training", "quantization-aware")
DEFAULT_N_BITS = 4  # what fine-tuning simulates when n_bits is a per-kind dict without op_inputs
AUTO = "auto"
# the grid searched when n_bits / rounding_threshold_bits are "auto" (docs/concrete.md has the measurements)
AUTO_N_BITS = (4, 5, 6)
# exact rounding (Concrete ML's default method): encrypted results then equal the quantised model's in the clear,
# which is what the manifest's accuracy measures; {"n_bits": 5, "method": "approximate"} is cheaper but off by one
# now and then (up to 3.7 in the digits MLP's logits)
AUTO_ROUNDING = (6, 5)
AUTO_TOLERANCE = 0.01  # a setting scoring within this of the grid's best counts as good as the best
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


def _settings_text(settings: dict) -> str:
    rounding = settings["rounding_threshold_bits"]
    if isinstance(rounding, dict):
        rounding = f"{rounding.get('n_bits')} ({rounding.get('method', 'exact')})"
    return f"n_bits={settings['n_bits']}, rounding_threshold_bits={rounding}"


def _compile(worker: Worker, proto: Any, calib: np.ndarray, settings: dict, out: Path | None,
             eval_x: np.ndarray | None, *, max_keys_bytes: int | None = DEFAULT_MAX_KEYS_BYTES,
             memory_budget: int | None = DEFAULT_KEYGEN_MEMORY_BYTES, check: bool = True) -> dict:
    """Compile one setting in the worker; ``out`` None: only compile and score (a grid candidate, nothing saved).
    The reply's ``keys`` is Concrete's key-size prediction; with ``check``, keys that would not fit are refused
    here, before any key is made. ``calibration_logits``: the quantised model on ``calib``; with ``eval_x``,
    ``quantized_logits`` and (when saved) ``simulated_logits`` on it."""
    calib_shape, calib_blob = array_blob(calib)
    score_x = calib if eval_x is None else np.concatenate([calib, eval_x])
    score_shape, score_blob = array_blob(score_x)
    blobs = [proto.SerializeToString(), calib_blob, score_blob]
    header = {**settings, "inputset_shape": calib_shape, "eval_shape": score_shape, "save": out is not None,
              "simulate": False}
    if out is not None:
        header["out"] = str(out)
    try:
        with progress("compiling" if out is None else "compiling and saving", _settings_text(settings)):
            reply, outs = worker.call("compile", header, blobs)
            logits = blob_array(outs[0], reply.pop("disable_shape"))
            if out is not None and eval_x is not None:  # Concrete's FHE simulation on the evaluation data only
                _, eval_blob = array_blob(eval_x)
                header = {**header, "save": False, "simulate": True, "eval_shape": list(eval_x.shape)}
                sim, sim_outs = worker.call("compile", header, blobs[:2] + [eval_blob])
                reply["simulated_logits"] = blob_array(sim_outs[1], sim["simulate_shape"])
                reply["simulate_seconds"] = sim.get("simulate_seconds")
    except ConcreteCallError as exc:
        raise ConcreteExportError(_explain(exc, settings, proto)) from None
    except ConcreteWorkerDied as exc:
        raise ConcreteExportError(f"Concrete ML's compiler process ended ({exc}); try a smaller n_bits") from None
    reply["calibration_logits"] = logits[:len(calib)]
    if eval_x is not None:
        reply["quantized_logits"] = logits[len(calib):]
    if check:
        try:
            _fits(reply.get("keys"), max_keys_bytes, memory_budget, settings)
        except ConcreteKeysTooLarge as exc:
            raise ConcreteExportError(f"Concrete ML compiled the model, but {exc}") from None
    return reply


def _fits(keys: dict | None, max_keys_bytes: int | None, memory_budget: int | None, settings: dict) -> None:
    """The key checks export makes: the server's limit and the fixed key-generation budget (never the memory free
    now: export's outcome must not depend on the machine's state; ``program.client()`` checks that)."""
    check_keys_fit(keys, max_keys_bytes, free_bytes=None, settings=_settings_text(settings),
                   memory_budget_bytes=memory_budget)


def _scored_on(calib: np.ndarray, eval_y: np.ndarray | None) -> dict:
    """What the automatic settings are scored on, for the manifest and the log."""
    if eval_y is not None:
        return {"data": "eval_data", "samples": len(eval_y),
                "score": f"accuracy on eval_data's labels ({len(eval_y)} samples)"}
    return {"data": "calibration", "samples": len(calib),
            "score": (f"top-1 agreement with the float model on the {len(calib)} calibration inputs (no eval_data "
                      "given: the settings were chosen on the inputs they were calibrated on)")}


def _candidates(n_bits: Any, rounding: Any, p_error: float | None) -> list[dict]:
    """The settings to try: the grid over whichever knob is "auto" (the cheapest-looking first), or the one given."""
    bits = list(AUTO_N_BITS) if n_bits == AUTO else [n_bits]
    roundings = list(AUTO_ROUNDING) if rounding == AUTO else [rounding]
    return [{"n_bits": b, "rounding_threshold_bits": r, "p_error": p_error} for b in bits for r in roundings]


def _search(worker: Worker, proto: Any, calib: np.ndarray, grid: list[dict], eval_x: np.ndarray | None,
            eval_y: np.ndarray | None, max_keys_bytes: int | None,
            memory_budget: int | None = DEFAULT_KEYGEN_MEMORY_BYTES) -> tuple[dict, dict]:
    """Compile every candidate (seconds each for small models), score it against the float model and read its
    predicted keys; keep those whose keys fit ``max_keys_bytes`` and ``memory_budget``, then, among those within
    AUTO_TOLERANCE of the best score, the one with the smallest keys (ties: the better score, then the grid's
    order). A function of its arguments only. Returns (settings, what the search saw, for the manifest)."""
    float_calib = _float_logits(proto, calib).reshape(len(calib), -1).argmax(1)
    scored_on = _scored_on(calib, eval_y)
    log.info("auto settings: scoring %d candidates by %s", len(grid), scored_on["score"])
    rows = []
    for settings in grid:
        try:
            reply = _compile(worker, proto, calib, settings, None, eval_x, check=False)
        except ConcreteExportError as exc:
            rows.append({**settings, "error": str(exc)[:300]})
            log.info("auto settings: %s does not compile (%s)", _settings_text(settings), str(exc)[:200])
            continue
        score = (_accuracy(reply["quantized_logits"], eval_y) if eval_y is not None
                 else float((reply["calibration_logits"].reshape(len(calib), -1).argmax(1) == float_calib).mean()))
        row = {**settings, "score": score, "max_bit_width": reply.get("max_bit_width"),
               "evaluation_keys_bytes": (reply.get("keys") or {}).get("evaluation_keys_bytes"),
               "complexity": (reply.get("keys") or {}).get("complexity")}
        try:
            _fits(reply.get("keys"), max_keys_bytes, memory_budget, settings)
            row["fits"] = True
        except ConcreteKeysTooLarge as exc:
            row["fits"], row["refused"] = False, str(exc)
            log.warning("auto settings: stepping over %s: %s", _settings_text(settings), exc)
        rows.append(row)
        log.info("auto settings: %s scores %.3f, evaluation keys %.0f MB", _settings_text(settings), score,
                 (row["evaluation_keys_bytes"] or 0) / 1e6)
    fitting = [r for r in rows if r.get("fits")]
    if not fitting:
        sizes = [r for r in rows if r.get("evaluation_keys_bytes")]
        smallest = min(sizes, key=lambda r: r["evaluation_keys_bytes"]) if sizes else None
        raise ConcreteExportError("no automatic setting fits: " + (smallest.get("refused") or smallest.get("error", "")
                                                                    if smallest else rows[0].get("error", "")))
    best = max(r["score"] for r in fitting)
    good = [r for r in fitting if r["score"] >= best - AUTO_TOLERANCE]
    chosen = min(good, key=lambda r: (r["evaluation_keys_bytes"] or 0, -r["score"]))
    settings = {k: chosen[k] for k in ("n_bits", "rounding_threshold_bits", "p_error")}
    log.info("auto settings: chose %s (score %.3f, best %.3f; scored by %s)", _settings_text(settings),
             chosen["score"], best, scored_on["score"])
    return settings, {"scored_on": scored_on["data"], "score": scored_on["score"], "samples": scored_on["samples"],
                      "tolerance": AUTO_TOLERANCE, "max_keys_bytes": max_keys_bytes,
                      "max_keygen_memory_bytes": memory_budget, "chosen": settings, "candidates": rows}


def _agreement(proto: Any, x: np.ndarray, quantized_logits: np.ndarray) -> float:
    """How often the quantised model's top-1 class equals the float model's on ``x``."""
    want = _float_logits(proto, x).reshape(len(x), -1).argmax(1)
    return float((np.asarray(quantized_logits).reshape(len(x), -1).argmax(1) == want).mean())


def _accuracy_cost(info: dict) -> dict:
    """What quantisation costs against the float model, as the manifest states it."""
    cost: dict[str, Any] = {"calibration_agreement": info.get("calibration_agreement")}
    acc = info.get("accuracy")
    if acc:
        cost.update(float=acc["float"], quantized=acc["quantized"], loss=acc["float"] - acc["quantized"],
                    samples=acc["samples"])
        cost["summary"] = (f"accuracy {acc['quantized']:.3f} quantised vs {acc['float']:.3f} float on "
                           f"{acc['samples']} eval samples (loss {cost['loss']:+.3f})")
    else:
        cost["summary"] = (f"the quantised model picks the float model's class on "
                           f"{100 * (info.get('calibration_agreement') or 0):.1f}% of the calibration inputs (no "
                           "labels given: pass eval_data for accuracy)")
    auto = info.get("auto")
    if auto:  # which data chose the settings: the calibration inputs are a weaker judge than held-out labels
        cost["settings_scored_on"] = auto.get("scored_on")
        cost["summary"] += ("; settings chosen on eval_data" if auto.get("scored_on") == "eval_data" else
                            "; settings chosen on the calibration inputs")
    return cost


def _accuracy(logits: np.ndarray, y: np.ndarray) -> float:
    return float((np.asarray(logits).reshape(len(y), -1).argmax(1) == np.asarray(y)).mean())


def _float_logits(proto, x: np.ndarray) -> np.ndarray:
    """The float model's logits (onnxruntime on the exported graph: what Concrete ML quantises)."""
    from polyfhe.ort_providers import inference_session

    session = inference_session(proto.SerializeToString())
    name = session.get_inputs()[0].name
    return np.concatenate([session.run(None, {name: x[i:i + 256].astype(np.float32)})[0]
                           for i in range(0, len(x), 256)])


def export_concrete(model: Any, calibration: Any, *, n_bits: int | dict | str = AUTO,
                    rounding_threshold_bits: int | dict | str | None = AUTO, p_error: float | None = None,
                    input_shape: tuple[int, ...] | None = None, quantization: str = "auto",
                    train_data: tuple[Any, Any] | None = None, eval_data: tuple[Any, Any] | None = None,
                    qat_epochs: int = 3, qat_tolerance: float = 0.01, env: ConcreteEnv | str | Path | None = None,
                    out: str | Path | None = None,
                    max_keys_bytes: int | None = DEFAULT_MAX_KEYS_BYTES,
                    max_keygen_memory_bytes: int | None = DEFAULT_KEYGEN_MEMORY_BYTES) -> ConcreteProgram:
    """Compile ``model`` (module, ONNX path/bytes/ModelProto) for Concrete ML; see the module docstring.

    ``n_bits`` / ``rounding_threshold_bits``: Concrete ML's knobs; ``"auto"`` (the default) searches
    :data:`AUTO_N_BITS` / :data:`AUTO_ROUNDING`; ``rounding_threshold_bits=None`` rounds nothing.
    ``eval_data`` (x, y): accuracy of the float, quantised (clear) and simulated-FHE model, in the manifest.
    ``out``: where the program's files go (default: a temporary folder that lives as long as the program).
    ``max_keys_bytes``: the largest serialised evaluation keys accepted (the server's default context limit; None:
    no limit). ``max_keygen_memory_bytes``: the memory key generation may take on the client's machine (a fixed
    default, not the memory free now, so the same call makes the same choice on any machine; None: no limit);
    settings past either are stepped over (automatic) or refused (explicit)."""
    import onnx

    from polyfhe.analysis import analyze

    if quantization not in QUANTIZATION_MODES:
        raise ValueError(f"quantization={quantization!r}; accepted: {list(QUANTIZATION_MODES)}")
    if quantization == "quantization-aware" and train_data is None:
        raise ValueError("quantization='quantization-aware' needs train_data=(x, y) to fine-tune on")
    environment = env if isinstance(env, ConcreteEnv) else find_env(env)
    grid = _candidates(n_bits, rounding_threshold_bits, p_error)
    settings = grid[0]
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
        if len(grid) > 1:
            settings, info["auto"] = _search(worker, proto, calib, grid, eval_x, eval_y, max_keys_bytes,
                                             max_keygen_memory_bytes)
        limits = {"max_keys_bytes": max_keys_bytes, "memory_budget": max_keygen_memory_bytes}
        reply = _compile(worker, proto, calib, settings, folder, eval_x, **limits)
        info["keys"] = reply.get("keys")
        info["calibration_agreement"] = _agreement(proto, calib, reply["calibration_logits"])
        used = "post-training"
        if eval_x is not None:
            info["accuracy"] = _accuracies(model, proto, reply, eval_x, eval_y)
        if _wants_qat(quantization, train_data, info.get("accuracy"), qat_tolerance):
            tuned, qat_info = _finetune(model, proto, train_data, eval_data, shape, settings["n_bits"], qat_epochs)
            tuned_proto, _ = to_concrete_onnx(tuned, shape, check_x=calib[:16])
            ptq_accuracy = info.get("accuracy")
            info["post_training"] = {"accuracy": ptq_accuracy, "max_bit_width": reply["max_bit_width"]}
            reply = _compile(worker, tuned_proto, calib, settings, folder, eval_x, **limits)
            info["qat"] = qat_info
            tuned_accuracy = None if eval_x is None else _accuracies(tuned, tuned_proto, reply, eval_x, eval_y)
            if quantization == "auto" and tuned_accuracy["quantized"] <= ptq_accuracy["quantized"]:
                # fine-tuning did not pay off under Concrete's own quantiser: keep the post-training program
                log.warning("quantization-aware fine-tuning reached %.3f, post-training %.3f: keeping the latter",
                            tuned_accuracy["quantized"], ptq_accuracy["quantized"])
                info["qat"]["kept"], info["qat"]["accuracy"] = False, tuned_accuracy
                reply = _compile(worker, proto, calib, settings, folder, eval_x, **limits)
                used = "post-training (quantization-aware fine-tuning tried, not kept)"
            else:
                proto, used = tuned_proto, f"quantization-aware (polyfhe fake-quant, {qat_epochs} epochs)"
                info["qat"]["kept"] = True
                if tuned_accuracy is not None:
                    info["accuracy"] = tuned_accuracy
            info["keys"] = reply.get("keys")
            info["calibration_agreement"] = _agreement(proto, calib, reply["calibration_logits"])
        info.update({k: reply[k] for k in ("compile_seconds", "max_bit_width", "p_error", "global_p_error",
                                           "statistics") if k in reply})
        info["accuracy_cost"] = _accuracy_cost(info)
    finally:
        worker.close()
    onnx.save(proto, str(folder / "model.onnx"))
    output_size = int(np.prod([d.dim_value for d in proto.graph.output[0].type.tensor_type.shape.dim][1:]))
    program = ConcreteProgram.create(folder, (1, *shape), output_size, settings, used, versions, info, owned)
    program.evaluation = {"calibration": reply["calibration_logits"]}  # the quantised model, in the clear
    if eval_x is not None:
        program.evaluation.update(quantized=reply["quantized_logits"], simulated=reply["simulated_logits"])
    log.info("compiled %s for Concrete ML: %s quantisation at n_bits=%s, rounding_threshold_bits=%s, max bit width "
             "%s; %s; %s", name, used, settings["n_bits"], settings["rounding_threshold_bits"],
             info.get("max_bit_width"), describe(info["keys"]) if info.get("keys") else "no key prediction",
             info["accuracy_cost"]["summary"])
    return program


def to_concrete_onnx(model: Any, input_shape: tuple[int, ...] | None,
                     check_x: np.ndarray | None = None) -> tuple[Any, str]:
    """(ModelProto at the opset Concrete ML reads, name): modules are folded and exported by our exporter at that
    opset, ONNX graphs converted to it; then constant and shape subgraphs are folded (:mod:`graph_prep`) and the
    result checked against the unfolded graph on ``check_x``."""
    from polyfhe.exporters.concrete.graph_prep import (
        fold_public_shapes,  # onnx: never imported by the runtime
    )

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
        from polyfhe.exporters.onnx import export_onnx

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
    from polyfhe.exporters.concrete.qat import quantization_aware_finetune

    bits = n_bits if isinstance(n_bits, int) else int(n_bits.get("op_inputs", DEFAULT_N_BITS))
    x_tr = _as_samples(train_data[0], shape, "train_data x").astype(np.float32)
    x_ev, y_ev = (x_tr, train_data[1]) if eval_data is None else (
        _as_samples(eval_data[0], shape, "eval_data x").astype(np.float32), eval_data[1])
    result = quantization_aware_finetune(model, x_tr, np.asarray(train_data[1]), x_ev, np.asarray(y_ev),
                                         n_bits=bits, epochs=epochs, lr=QAT_LR)
    return result.model, result.to_dict()
