"""polyfhe: activation-free polynomial networks, proven add/mul-only, run on CKKS-encrypted images.

Public API (``fold`` and ``export`` are functions that shadow their subpackages; import submodules as
``from polyfhe.export.onnx import ...``)::

    model = polyfhe.create_model("monet_lr_bn", num_classes=10)
    folded = polyfhe.fold(model)                        # BN, alpha, pooling factors -> affine maps
    polyfhe.export(model, target="onnx", path="m.onnx") # fold + export + checker + onnxruntime parity
    report = polyfhe.analyze("m.onnx")                  # polynomial? degree, ct x ct depth, CKKS levels
    prog = polyfhe.export(model, target="ckks", calibration=X)   # CKKS program (layout="single"|"batch")
    prog.save("prog"); prog = polyfhe.load_program("prog")
    client = prog.client(); server = prog.server(client.public_context())
    y = client.decrypt(server.run(client.encrypt(x)))
    print(polyfhe.symbolic(small_model, variables=("x", "y")))  # explicit polynomial (sympy), pruned
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

# Public names, imported on first use: the CKKS runtime (``polyfhe.fhe``) must load without torch or onnx.
_LAZY = {
    "AnalysisReport": "polyfhe.analysis", "analyze": "polyfhe.analysis",
    "calibrate": "polyfhe.calibration",
    "export": "polyfhe.export",  # the function; the subpackage forwards calls to it (see _callable_module)
    "CKKSProgram": "polyfhe.fhe.program", "load_program": "polyfhe.fhe.program",
    "FoldError": "polyfhe.fold", "fold": "polyfhe.fold",
    "create_model": "polyfhe.models.registry", "list_models": "polyfhe.models.registry",
    "model_entry": "polyfhe.models.registry",
    "symbolic": "polyfhe.symbolic",
    "train": "polyfhe.training",
}


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
    "AnalysisReport", "CKKSProgram", "FoldError", "__version__", "analyze", "calibrate", "create_model", "export", "fold", "list_models",
    "load_program", "model_entry", "symbolic", "train",
]
