"""Microbenchmarks that calibrate :mod:`polyfhe.runtime.opcosts` on the machine that runs them.

Each engine's probes live in its folder (``polyfhe/engines/<engine>/probes.py``) and are reached through its
record (``Backend.probes``): SEAL times each operation on its own, Lattigo times small model graphs whose tallies
list every operation in them. Both also record the serialized size of their keys, which fits
:class:`~polyfhe.runtime.opcosts.KeyBytesModel`. The whole run takes well under a minute per engine and up to
about 2 GB on a 2-core machine.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Callable

from polyfhe.program.engines import BACKEND_NAMES, get_backend
from polyfhe.runtime.opcosts import KeyObservation, Probe, best_seconds

__all__ = ["KeyObservation", "best_seconds", "calibrated_engines", "calibrator", "measure_base_rss"]

log = logging.getLogger(__name__)


def calibrated_engines() -> list[str]:
    """The engines that have calibration probes."""
    return sorted(name for name in BACKEND_NAMES if get_backend(name).probes is not None)


def calibrator(engine: str) -> Callable[[], tuple[list[Probe], list[KeyObservation]]]:
    """The engine's probes; ``ValueError`` naming the engines that have some."""
    probes = get_backend(engine).probes if engine in BACKEND_NAMES else None
    if probes is None:
        raise ValueError(f"no calibration for backend {engine!r}; known: {calibrated_engines()}")
    return probes


def measure_base_rss(engine: str) -> int:
    """Resident bytes of a fresh server process with the runtime and the engine loaded (no keys yet)."""
    probe = (f"{get_backend(engine).server_imports}\nfor line in open('/proc/self/status'):\n"
             "    if line.startswith('VmRSS:'): print(int(line.split()[1]) * 1024)")
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
        return int(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError, OSError) as exc:
        log.warning("could not measure the %s server's base memory (%s); assuming 300 MB", engine, exc)
        return 300 << 20
