"""Fold normalisations and constant scales into affine maps (``polyfhe.fold(model)``)."""

from polyfhe._callable_module import make_callable
from polyfhe.fold import lpnn as _lpnn  # noqa: F401  (registers the LPNN rules)
from polyfhe.fold import monet as _monet  # noqa: F401  (registers the MONet rules)
from polyfhe.fold import polynext as _polynext  # noqa: F401  (registers the PolyNeXt rules)
from polyfhe.fold import resmlp as _resmlp  # noqa: F401  (registers the polynomial ResMLP rules)
from polyfhe.fold.driver import fold
from polyfhe.fold.rules import FoldError, register_fold_rule

__all__ = ["FoldError", "fold", "register_fold_rule"]

make_callable(__name__, fold)
