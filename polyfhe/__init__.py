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
"""

from __future__ import annotations

import logging

from polyfhe.analysis import AnalysisReport, analyze
from polyfhe.calibration import calibrate
from polyfhe.export import export  # the function deliberately shadows the subpackage (see ARCHITECTURE.md)
from polyfhe.fhe.program import CKKSProgram, load_program
from polyfhe.fold import FoldError, fold
from polyfhe.models.registry import create_model, list_models, model_entry
from polyfhe.training import train

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "AnalysisReport", "CKKSProgram", "FoldError", "__version__", "analyze", "calibrate", "create_model", "export", "fold", "list_models",
    "load_program", "model_entry", "train",
]
