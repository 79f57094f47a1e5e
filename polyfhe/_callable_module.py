"""Let a subpackage that shares its name with a public function (``export``, ``fold``) be called like it.

``polyfhe.export`` is both the exporter subpackage and the public function. Whichever import binds the
attribute first, calling it must work, so the subpackage's module object forwards calls to the function.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable


def make_callable(module_name: str, function: Callable) -> None:
    class _CallableModule(types.ModuleType):
        def __call__(self, *args, **kwargs):
            return function(*args, **kwargs)

    sys.modules[module_name].__class__ = _CallableModule
