"""The Go runtime settings the Lattigo wheels should start with.

Each wheel is a Go shared library whose runtime reads ``GOGC`` from the environment the *process* started with:
setting ``os.environ`` from Python afterwards does not reach it (measured: ``GODEBUG=gctrace=1`` set from Python
printed nothing). By default Go lets its heap grow to twice the live size before collecting; a Lattigo server's live
heap is gigabytes (every diagonal encoded, the key set), so the garbage of a few queries alone took
cpolynext_fhe_bn (8x8, one process for client and server) from 16.2 to 20.8 GB. ``GOGC=25`` held it at 17.1 GB
with no measurable cost per query (9.0 s against 9.8 s). The ``polyfhe`` command starts itself again with these
defaults when they are missing; library users set them in the environment of their server process.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["GO_ENV_DEFAULTS", "missing_go_env", "restart_with_go_env", "warn_if_missing"]

log = logging.getLogger(__name__)

GO_ENV_DEFAULTS = {"GOGC": "25"}
_MARKER = "POLYFHE_GO_ENV_SET"  # set on the restarted process, so it never restarts twice


def missing_go_env(environ=None) -> dict[str, str]:
    """The defaults this environment lacks (a value the user set is kept)."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in GO_ENV_DEFAULTS.items() if k not in environ}


def restart_with_go_env() -> None:
    """Replace this process by itself with the Go defaults added, once; a no-op when nothing is missing.

    Only for a command-line entry point, before any Go library is loaded: ``exec`` keeps the pid and arguments.
    """
    missing = missing_go_env()
    if not missing or os.environ.get(_MARKER) or not getattr(sys, "orig_argv", None):
        return
    env = {**os.environ, **missing, _MARKER: "1"}
    os.execve(sys.executable, list(sys.orig_argv), env)


_warned = False


def warn_if_missing() -> None:
    """Log once per process that Lattigo runs with Go's default, memory-hungry collector settings."""
    global _warned
    missing = missing_go_env()
    if missing and not _warned:
        _warned = True
        settings = " ".join(f"{k}={v}" for k, v in missing.items())
        log.warning("the Lattigo engine runs with Go's default collector: its heap may grow to twice the live "
                    "keys and diagonals; start this process with %s to bound it (polyfhe's command does)", settings)
