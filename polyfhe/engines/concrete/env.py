"""Concrete ML's own environment: where it lives, whether it is complete, and how to create it.

Concrete ML 1.9 pins torch 2.3.1 (and pulls its CUDA build, about 6.5 GB), so it can never be installed next to
polyfhe. ``polyfhe setup concrete`` creates a virtual environment under the user's cache (or a given folder) from
the pinned list in ``requirements.txt``; polyfhe then reaches it only through a worker process
(:mod:`polyfhe.engines.concrete.worker`): ONNX and numbers in, artifacts and bytes out.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CONCRETE_ML_VERSION", "ENV_VARIABLE", "ConcreteEnv", "ConcreteEnvMissing", "default_env_dir",
           "find_env", "requirements_path", "setup_env"]

log = logging.getLogger(__name__)

CONCRETE_ML_VERSION = "1.9.0"
ENV_VARIABLE = "POLYFHE_CONCRETE_ENV"  # a folder that overrides the default location
STAMP = ".polyfhe-concrete-stamp"  # written last: a half-built environment has none and is built again
SETUP_COMMAND = "polyfhe setup concrete"


class ConcreteEnvMissing(RuntimeError):
    """Concrete ML's environment is absent or incomplete; the message gives the command that creates it."""


def requirements_path() -> Path:
    return Path(__file__).with_name("requirements.txt")


def _stamp_value() -> str:
    """What a complete environment's stamp holds: the pinned list's hash and the interpreter's version."""
    digest = hashlib.sha256(requirements_path().read_bytes()).hexdigest()[:16]
    return f"concrete-ml {CONCRETE_ML_VERSION} requirements {digest} python {sys.version_info[0]}.{sys.version_info[1]}"


def default_env_dir() -> Path:
    """``$POLYFHE_CONCRETE_ENV``, else ``$XDG_CACHE_HOME/polyfhe/concrete-ml-VERSION`` (``~/.cache`` by default)."""
    override = os.environ.get(ENV_VARIABLE)
    if override:
        return Path(override).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "polyfhe" / f"concrete-ml-{CONCRETE_ML_VERSION}"


@dataclass(frozen=True)
class ConcreteEnv:
    """A complete environment: its folder and the interpreter that runs the worker."""

    path: Path

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    def is_complete(self) -> bool:
        stamp = self.path / STAMP
        return self.python.is_file() and stamp.is_file() and stamp.read_text().strip() == _stamp_value()


def _command_for(path: Path) -> str:
    default = path == default_env_dir()
    return SETUP_COMMAND if default else f"{SETUP_COMMAND} --path {path}"


def find_env(path: str | Path | None = None) -> ConcreteEnv:
    """The environment at ``path`` (default: :func:`default_env_dir`); :class:`ConcreteEnvMissing` naming the
    command that creates it when it is absent, half-built or made for other pins."""
    env = ConcreteEnv(Path(path).expanduser() if path is not None else default_env_dir())
    if env.is_complete():
        return env
    state = "is not complete or was made for other versions" if env.path.exists() else "does not exist"
    raise ConcreteEnvMissing(
        f"target='concrete' needs Concrete ML {CONCRETE_ML_VERSION} in its own environment, and {env.path} "
        f"{state}; create it with `{_command_for(env.path)}` (about 6.5 GB, a few minutes; it cannot share "
        "polyfhe's environment because Concrete ML pins torch 2.3.1)")


def setup_env(path: str | Path | None = None, python: str | None = None, force: bool = False) -> ConcreteEnv:
    """Create (or complete) the environment; idempotent: a complete one is left as it is unless ``force``.

    ``python``: the interpreter the environment is made from (default: the one running polyfhe, which the worker
    protocol and the pins are made for)."""
    env = ConcreteEnv(Path(path).expanduser() if path is not None else default_env_dir())
    if env.is_complete() and not force:
        log.info("Concrete ML environment at %s is up to date", env.path)
        return env
    env.path.mkdir(parents=True, exist_ok=True)
    (env.path / STAMP).unlink(missing_ok=True)
    base = python or getattr(sys, "_base_executable", None) or sys.executable
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as output:
        _step([base, "-m", "venv", "--clear" if force else "--upgrade-deps", str(env.path)], output,
              "creating the virtual environment")
        _step([str(env.python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
               "-r", str(requirements_path())], output, f"installing Concrete ML {CONCRETE_ML_VERSION}")
    probe = "import concrete.ml, concrete.fhe, torch; print(concrete.ml.__version__)"
    check = subprocess.run([str(env.python), "-I", "-c", probe], capture_output=True, text=True, timeout=600,
                           check=False)
    if check.returncode != 0 or check.stdout.strip() != CONCRETE_ML_VERSION:
        raise ConcreteEnvMissing(f"the environment at {env.path} was installed but `import concrete.ml` fails: "
                                 f"{check.stderr.strip()[-2000:]}")
    (env.path / STAMP).write_text(_stamp_value() + "\n")
    log.info("Concrete ML environment ready at %s in %.0f s", env.path, time.perf_counter() - t0)
    return env


def _step(command: list[str], output, what: str) -> None:
    log.info("%s: %s", what, " ".join(command))
    done = subprocess.run(command, stdout=output, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        output.seek(0)
        tail = output.read().decode(errors="replace")[-3000:]
        raise ConcreteEnvMissing(f"{what} failed (exit {done.returncode}); the end of its output:\n{tail}")
