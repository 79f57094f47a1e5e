"""timm-style model registry: ``register_model`` / ``create_model`` / ``list_models``.

Each entry carries the reference numbers from ``shared/specs/models.md`` (parameter count at the default
configuration, sequential ct x ct count and folded CKKS levels where the spec gives them) so that tests and
``polyfhe models`` can compare what we build against what the papers and reference code report.
"""

from __future__ import annotations

import fnmatch
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

ModelBuilder = Callable[..., nn.Module]


@dataclass(frozen=True)
class ModelEntry:
    """One registered architecture and the reference facts we test it against."""

    name: str
    builder: ModelBuilder
    family: str
    norm: str  # "ln" (training form), "bn" (folds to add/mul) or "none" (polynomial without any norm)
    default_cfg: dict[str, Any] = field(default_factory=dict)
    spec_params: int | None = None  # reference parameter count at default_cfg (None: no reference number)
    spec_ct_depth: int | None = None  # spec section 3: sequential ct x ct products
    spec_levels: int | None = None  # spec section 3: folded level total (without merging convs)
    description: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "family": self.family,
            "norm": self.norm,
            "default_cfg": dict(self.default_cfg),
            "spec_params": self.spec_params,
            "spec_ct_depth": self.spec_ct_depth,
            "spec_levels": self.spec_levels,
            "description": self.description,
        }


_REGISTRY: dict[str, ModelEntry] = {}
NORM_KINDS = ("ln", "bn", "none")


def _first_doc_line(obj: object) -> str:
    doc = (getattr(obj, "__doc__", None) or "").strip()
    return doc.splitlines()[0] if doc else ""


def register_model(
    name: str,
    *,
    family: str,
    norm: str,
    default_cfg: dict[str, Any],
    spec_params: int | None = None,
    spec_ct_depth: int | None = None,
    spec_levels: int | None = None,
    description: str = "",
) -> Callable[[ModelBuilder], ModelBuilder]:
    """Decorator that registers ``builder(**cfg) -> nn.Module`` under ``name``."""
    if norm not in NORM_KINDS:
        raise ValueError(f"norm must be one of {', '.join(map(repr, NORM_KINDS))}, got {norm!r}")

    def decorator(builder: ModelBuilder) -> ModelBuilder:
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} is already registered")
        _REGISTRY[name] = ModelEntry(
            name=name,
            builder=builder,
            family=family,
            norm=norm,
            default_cfg=dict(default_cfg),
            spec_params=spec_params,
            spec_ct_depth=spec_ct_depth,
            spec_levels=spec_levels,
            description=description or _first_doc_line(builder),
        )
        return builder

    return decorator


# Model-family modules; importing one runs its @register_model decorators.
FAMILY_MODULES: tuple[str, ...] = (
    "polyfhe.models.monet", "polyfhe.models.polynext", "polyfhe.models.fhe_recipes", "polyfhe.models.lpnn",
    "polyfhe.models.taylornet", "polyfhe.models.resmlp",
)


def _ensure_loaded() -> None:
    for module in FAMILY_MODULES:
        importlib.import_module(module)


def list_models(pattern: str = "*") -> list[str]:
    """Registered model names matching a shell-style ``pattern``, sorted."""
    _ensure_loaded()
    return sorted(n for n in _REGISTRY if fnmatch.fnmatch(n, pattern))


def model_entry(name: str) -> ModelEntry:
    """The registry entry for ``name``; unknown names raise ``KeyError`` listing what exists."""
    _ensure_loaded()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(
            f"unknown model {name!r}; available models: {', '.join(sorted(_REGISTRY))}"
        ) from None


def create_model(name: str, **overrides: Any) -> nn.Module:
    """Build a registered model; ``overrides`` (e.g. ``num_classes``, ``img_size``, ``in_chans``) replace defaults."""
    entry = model_entry(name)
    cfg = {**entry.default_cfg, **overrides}
    model = entry.builder(**cfg)
    model.model_name = name  # lets later stages (fold, export) name the model in messages
    return model
