"""polyfhe: activation-free polynomial networks, proven add/mul-only, run on CKKS-encrypted images.

Public API::

    model = polyfhe.create_model("monet_lr_bn", num_classes=10)
    folded = polyfhe.fold(model)                        # BN, alpha, pooling factors -> affine maps
    polyfhe.export(model, target="onnx", path="m.onnx") # fold + export + checker + onnxruntime parity
    report = polyfhe.analyze("m.onnx")                  # polynomial? degree, ct x ct depth, CKKS levels
    report = polyfhe.analyze(model, input_shape=(1, 28, 28))  # a module: folded and exported to ONNX first
    prog = polyfhe.export(model, target="ckks", calibration=X)   # CKKS program (layout="single"|"batch")
    print(prog); print(prog.summary())                  # one line; a readable table (still a dict)
    logits = prog.run_plain(x)                          # simulation: the compiled program on plaintext
    prog.save("prog"); prog = polyfhe.load_program("prog")
    client = prog.client(); server = prog.server(client.public_context())
    y = client.decrypt(server.run(client.encrypt(x)))
    print(polyfhe.symbolic(small_model, variables=("x", "y")))  # explicit polynomial (sympy), pruned

No subpackage shares a name with a public function: the exporters install as ``polyfhe.exporters``, the fold
driver as ``polyfhe.folding``, the symbolic expansion as ``polyfhe.expansion``.
"""

from __future__ import annotations

import importlib
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

# Public names, imported on first use: the CKKS runtime must load without torch or onnx.
_LAZY = {
    "AnalysisReport": "polyfhe.analysis",
    "calibrate": "polyfhe.calibration",
    "CKKSProgram": "polyfhe.program.ckks_program", "load_program": "polyfhe.program.ckks_program",
    "FoldError": "polyfhe.folding", "fold": "polyfhe.folding",
    "create_model": "polyfhe.models.registry", "list_models": "polyfhe.models.registry",
    "model_entry": "polyfhe.models.registry",
    "symbolic": "polyfhe.expansion",
    "polynomialize": "polyfhe.training.polynomialize",
    "train": "polyfhe.training",
}

# export target -> (module, function); each exporter is imported only when its target is asked for
EXPORT_TARGETS: dict[str, tuple[str, str]] = {
    "onnx": ("polyfhe.exporters.onnx", "export_onnx_file"),
    "ckks": ("polyfhe.exporters.ckks", "export_ckks"),
    "concrete": ("polyfhe.exporters.concrete", "export_concrete"),
}


def export(model: Any, target: str = "onnx", **kwargs: Any) -> Any:
    """Export ``model`` to ``target``: "onnx" (folds, exports, checks parity and polynomiality, returns the path),
    "ckks" (a :class:`CKKSProgram`) or "concrete" (a Concrete ML program)."""
    try:
        module, function = EXPORT_TARGETS[target]
    except KeyError:
        raise ValueError(f"unknown export target {target!r}; available: {', '.join(sorted(EXPORT_TARGETS))}") from None
    return getattr(importlib.import_module(module), function)(model, **kwargs)


def analyze(model: Any, *, input_shape: tuple[int, ...] | None = None) -> Any:
    """The degree analysis (:class:`AnalysisReport`: polynomial? degree, ct x ct depth, CKKS levels) of an ONNX
    model (``onnx.ModelProto``, a path to a .onnx file, or its bytes) or of a torch ``nn.Module``.

    A module is folded and exported to ONNX first, in a temporary folder, exactly as ``export(target="onnx")``
    does; that needs its input shape: ``input_shape=(C, H, W)`` (one sample, no batch axis), else the module's
    ``input_shape`` attribute (every registry model has one). A non-polynomial module is reported, not refused.
    """
    if _is_torch_module(model):
        return _analyze_module(model, input_shape)
    if input_shape is not None:
        raise ValueError("input_shape= is for a torch nn.Module (exported to ONNX first); an ONNX model carries "
                         "its own input shape")
    return importlib.import_module("polyfhe.analysis").analyze(model)


def _is_torch_module(model: Any) -> bool:
    torch = sys.modules.get("torch")  # a module instance means torch is imported already; never import it here
    return torch is not None and isinstance(model, torch.nn.Module)


def _analyze_module(model: Any, input_shape: tuple[int, ...] | None) -> Any:
    shape = input_shape if input_shape is not None else getattr(model, "input_shape", None)
    if shape is None:
        raise ValueError(
            f"polyfhe.analyze exports a module to ONNX first and needs its input shape: {type(model).__name__} has "
            "no input_shape attribute; pass polyfhe.analyze(module, input_shape=(1, 28, 28)) (one sample, no batch "
            "axis), or export it first, polyfhe.export(model, target=\"onnx\", path=\"model.onnx\", "
            "input_shape=...), and analyze the file")
    exporter = importlib.import_module("polyfhe.exporters.onnx")
    with tempfile.TemporaryDirectory(prefix="polyfhe-analyze-") as tmp:
        exported = exporter.export_onnx(model, Path(tmp) / "model.onnx", tuple(shape), require_polynomial=False,
                                        allow_nonfinite=True)  # an untrained deep model may overflow: still analyse
    return exported.analysis


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'polyfhe' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "EXPORT_TARGETS", "AnalysisReport", "CKKSProgram", "FoldError", "__version__", "analyze", "calibrate",
    "create_model", "export", "fold", "list_models", "load_program", "model_entry", "polynomialize", "symbolic",
    "train",
]
