"""Fold normalisations and constant scales into affine maps (``polyfhe.fold(model)``)."""

from polyfhe.folding import lpnn as _lpnn  # noqa: F401  (registers the LPNN rules)
from polyfhe.folding import monet as _monet  # noqa: F401  (registers the MONet rules)
from polyfhe.folding import polynext as _polynext  # noqa: F401  (registers the PolyNeXt rules)
from polyfhe.folding import resmlp as _resmlp  # noqa: F401  (registers the polynomial ResMLP rules)
from polyfhe.folding.driver import fold
from polyfhe.folding.rules import FoldError, register_fold_rule

__all__ = ["FoldError", "fold", "register_fold_rule"]
