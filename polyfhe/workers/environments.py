"""The environments of their own that ``polyfhe setup NAME`` builds, one entry per engine that needs one.

An engine whose library cannot share polyfhe's environment (Concrete ML pins torch 2.3.1) runs it in a virtual
environment of its own, reached through worker processes (:mod:`polyfhe.workers.child`). Adding such an engine
to ``polyfhe setup`` is one entry here and one small provider object in the engine's folder, imported by name
on first use (this package sits below the engines and never imports them).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

__all__ = ["ENVIRONMENTS", "EnvironmentProvider", "OwnEnvironment", "components", "provider"]


class EnvironmentProvider(Protocol):
    """What an engine tells ``polyfhe setup`` about its environment (its own folder holds the pins and stamp)."""

    title: str  # what is set up, with its version: "Concrete ML 1.9.0"
    cost: str  # what building it takes: "a few minutes; about 6.5 GB"
    failure: type[Exception]  # raised when it cannot be built; its message says why

    def is_complete(self, path: Path | None) -> bool:
        """Whether the environment at ``path`` (None: its default place) is built, for these pins."""

    def setup(self, path: Path | None, force: bool) -> Path:
        """Build (or complete) it; idempotent unless ``force``. Its folder."""


@dataclass(frozen=True)
class OwnEnvironment:
    """One ``polyfhe setup`` component: ``purpose`` (for the help), ``default_place`` (where it goes without
    ``--path``), ``provider`` (``"module:attribute"`` of its :class:`EnvironmentProvider`)."""

    name: str
    purpose: str
    default_place: str
    provider: str


ENVIRONMENTS: dict[str, OwnEnvironment] = {
    "concrete": OwnEnvironment("concrete", "Concrete ML for target='concrete'",
                               "the user's cache, or $POLYFHE_CONCRETE_ENV",
                               "polyfhe.engines.concrete.setup_entry:PROVIDER"),
}


def components() -> tuple[str, ...]:
    """The names ``polyfhe setup`` accepts."""
    return tuple(ENVIRONMENTS)


def provider(name: str) -> EnvironmentProvider:
    """The provider of environment ``name``, its engine module imported now."""
    module, _, attribute = ENVIRONMENTS[name].provider.partition(":")
    return getattr(importlib.import_module(module), attribute)
