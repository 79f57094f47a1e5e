"""polyfhe: activation-free polynomial networks, proven add/mul-only, run on CKKS-encrypted images.

Public API (``fold`` and ``export`` are functions that shadow their subpackages; import submodules as
``from polyfhe.export.onnx import ...``)::

    model = polyfhe.create_model("monet_lr_bn", num_classes=10)
    folded = polyfhe.fold(model)                        # BN, alpha, pooling factors -> affine maps
    polyfhe.export(model, target="onnx", path="m.onnx") # fold + export + checker + onnxruntime parity
    report = polyfhe.analyze("m.onnx")                  # polynomial? degree, ct x ct depth, CKKS levels
"""

from __future__ import annotations

import logging

from polyfhe.analysis import AnalysisReport, analyze
from polyfhe.export import export  # the function deliberately shadows the subpackage (see ARCHITECTURE.md)
from polyfhe.fold import FoldError, fold
from polyfhe.models.registry import create_model, list_models, model_entry

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "AnalysisReport", "FoldError", "__version__", "analyze", "create_model", "export", "fold", "list_models",
    "model_entry",
]
