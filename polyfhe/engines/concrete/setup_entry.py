"""Concrete ML's entry in ``polyfhe setup`` (:mod:`polyfhe.workers.environments` imports it by name)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from polyfhe.engines.concrete.env import (
    CONCRETE_ML_VERSION,
    ConcreteEnv,
    ConcreteEnvMissing,
    default_env_dir,
    setup_env,
)

__all__ = ["PROVIDER", "ConcreteSetup"]


@dataclass(frozen=True)
class ConcreteSetup:
    """Its environment's pins, stamp and build live in :mod:`polyfhe.engines.concrete.env`."""

    title: str = f"Concrete ML {CONCRETE_ML_VERSION}"
    cost: str = "a few minutes; about 6.5 GB"
    failure: type[Exception] = ConcreteEnvMissing

    def is_complete(self, path: Path | None) -> bool:
        return ConcreteEnv(path or default_env_dir()).is_complete()

    def setup(self, path: Path | None, force: bool) -> Path:
        return setup_env(path, force=force).path


PROVIDER = ConcreteSetup()
