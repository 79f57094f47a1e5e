"""How many worker processes ``polyfhe serve`` starts when ``--worker-processes`` is not given.

Each worker loads every program itself, so a worker costs its interpreter and engine (about
:data:`WORKER_BASE_BYTES`, measured) plus the programs' arrays; the plaintext store budget is split between the
workers and so costs the same for any count. More workers means a native crash (or the OOM killer) costs fewer
sessions: with ``n`` workers, a dead one loses about ``1/n`` of them. The count is the cores, at most
:data:`MAX_AUTO_WORKERS`, lowered until every worker's share fits :data:`MEMORY_SHARE` of the memory available.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from polyfhe.procinfo import available_memory

__all__ = ["MAX_AUTO_WORKERS", "WORKER_BASE_BYTES", "WorkerChoice", "auto_worker_processes", "program_bytes"]

log = logging.getLogger(__name__)

MAX_AUTO_WORKERS = 4
WORKER_BASE_BYTES = 400 << 20  # a worker's resident memory with the engines loaded, before any program or key
MEMORY_SHARE = 0.5  # of the memory available at start: keys and plaintexts need the rest


@dataclass(frozen=True)
class WorkerChoice:
    processes: int
    reason: str


def program_bytes(folders: Iterable[Path]) -> int:
    """Bytes of the programs' files: what each worker holds once it has loaded them (arrays as stored)."""
    total = 0
    for folder in folders:
        for path in Path(folder).rglob("*"):
            if path.is_file():
                total += path.stat().st_size
    return total


def auto_worker_processes(folders: Iterable[Path], plaintext_bytes: int, cores: int | None = None,
                          available: int | None = None) -> WorkerChoice:
    """The worker count for programs in ``folders`` whose plaintext stores hold ``plaintext_bytes`` in all."""
    cores = cores if cores is not None else (os.cpu_count() or 1)
    available = available if available is not None else available_memory()
    per_worker = WORKER_BASE_BYTES + program_bytes(folders)
    wanted = max(1, min(cores, MAX_AUTO_WORKERS))
    if available is None:
        return WorkerChoice(wanted, f"{wanted} (one per core, at most {MAX_AUTO_WORKERS}; memory not known)")
    room = MEMORY_SHARE * available - min(plaintext_bytes, MEMORY_SHARE * available / 2)
    n = wanted
    while n > 1 and n * per_worker > room:
        n -= 1
    why = f"{n} ({cores} cores; about {per_worker / 2**20:.0f} MiB per worker with its programs, " \
          f"{available / 2**30:.1f} GiB available)"
    return WorkerChoice(n, why)
