"""polyfhe: activation-free polynomial networks, proven add/mul-only, run on CKKS-encrypted images.

Public API (timm-style zoo first; later stages are imported lazily so ``import polyfhe`` stays light)::

    model = polyfhe.create_model("monet_lr_bn", num_classes=10)
    polyfhe.list_models("*_bn")
"""

from __future__ import annotations

import logging

from polyfhe.models.registry import create_model, list_models, model_entry

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = ["__version__", "create_model", "list_models", "model_entry"]
