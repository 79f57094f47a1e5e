"""polyfhe: activation-free polynomial networks, proven add/mul-only, run on CKKS-encrypted images.

Public API::

    model = polyfhe.create_model("monet_lr_bn", num_classes=10)
    folded = polyfhe.fold(model)                        # BN, alpha, pooling factors -> affine maps
    polyfhe.export(model, target="onnx", path="m.onnx") # fold + export + checker + onnxruntime parity
    report = polyfhe.analyze("m.onnx")                  # polynomial? degree, ct x ct depth, CKKS levels
    prog = polyfhe.export(model, target="ckks", calibration=X)   # CKKS program (layout="single"|"batch")
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
from typing import Any

# Public names, imported on first use: the CKKS runtime must load without torch or onnx.
_LAZY = {
    "AnalysisReport": "polyfhe.analysis", "analyze": "polyfhe.analysis",
    "calibrate": "polyfhe.calibration",
    "CKKSProgram": "polyfhe.runtime.program", "load_program": "polyfhe.runtime.program",
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
