"""A watchdog that kills a child past a memory limit or a deadline (Linux ``/proc`` for the memory).

A child's own ``RLIMIT_AS`` bounds virtual memory; what the machine can afford is resident memory, which only the
parent can watch: the watchdog samples the child's ``VmRSS`` a few times a second and sends it SIGKILL past
``memory_limit`` (before the kernel's OOM killer picks a process, maybe the parent). A deadline ends a child that
hangs. The caller learns why from :attr:`Watchdog.tripped` once the child's pipe closes.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from polyfhe.procinfo import available_memory, proc_bytes

__all__ = ["Watchdog", "free_memory_limit"]

log = logging.getLogger(__name__)


def free_memory_limit(pid: int, share: float = 0.9) -> int | None:
    """What the child holds now plus ``share`` of what the machine has free; None where that is unknown."""
    current = proc_bytes(f"/proc/{pid}/status", "VmRSS") or 0
    free = available_memory()
    return None if free is None else current + int(share * free)


class Watchdog:
    """Watches ``pid`` until :meth:`stop`; kills it past ``memory_limit`` resident bytes or ``timeout_s`` seconds
    (None: not that check). ``tripped``: ``"memory"`` or ``"timeout"`` once it killed, else None; ``peak``: the
    most resident bytes seen. ``label`` names the child in the log."""

    PERIOD_S = 0.25

    def __init__(self, pid: int, memory_limit: int | None = None, timeout_s: float | None = None,
                 label: str = "child process") -> None:
        self.pid, self.limit, self.timeout_s, self.label = pid, memory_limit, timeout_s, label
        self.peak = 0
        self.tripped: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if memory_limit is not None or timeout_s is not None:
            self._thread = threading.Thread(target=self._watch, daemon=True, name=f"watchdog-{pid}")
            self._thread.start()

    def _watch(self) -> None:
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        while not self._stop.wait(self.PERIOD_S):
            if deadline is not None and time.monotonic() > deadline:
                log.warning("%s %d ran past %.0f s: stopping it", self.label, self.pid, self.timeout_s)
                self._kill("timeout")
                return
            if self.limit is None:
                continue
            rss = proc_bytes(f"/proc/{self.pid}/status", "VmRSS")
            if rss is None:
                return
            self.peak = max(self.peak, rss)
            if self.peak > self.limit:
                log.warning("%s %d passed %.1f GB (limit %.1f GB): stopping it", self.label, self.pid,
                            self.peak / 1e9, self.limit / 1e9)
                self._kill("memory")
                return

    def _kill(self, why: str) -> None:
        self.tripped = why
        try:
            os.kill(self.pid, signal.SIGKILL)
        except OSError:
            pass

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
