"""Start a child process on pipes, keep its last words, and end it (at the parent's exit, or when out of step).

A child's stdin and stdout carry frames (:mod:`polyfhe.workers.framing`); its stderr goes to an unnamed temporary
file, never a pipe: a child that writes more to stderr than a pipe holds before it answers would otherwise block,
and the parent with it. The end of that file (a bounded read) is what an error message quotes.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import weakref
from collections.abc import Mapping, Sequence
from typing import IO

__all__ = ["Child"]

log = logging.getLogger(__name__)

WAIT_S = 30.0  # for a killed or closed child to be reaped


def _end(proc: subprocess.Popen, workdir: str | None) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=WAIT_S)
    if workdir is not None:
        shutil.rmtree(workdir, ignore_errors=True)


class Child:
    """One child process: ``argv`` (its interpreter first), ``env`` (None: this process's), ``workdir``: a folder
    it runs in, removed when it ends. It is killed when this object is collected or the parent exits."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str] | None = None, workdir: str | None = None,
                 label: str = "child process") -> None:
        self.label = label
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the child it records
        self.proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                     env=None if env is None else dict(env), cwd=workdir)
        self._finalizer = weakref.finalize(self, _end, self.proc, workdir)
        log.debug("started %s (pid %d)", label, self.proc.pid)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def stdin(self) -> IO[bytes]:
        assert self.proc.stdin is not None
        return self.proc.stdin

    @property
    def stdout(self) -> IO[bytes]:
        assert self.proc.stdout is not None
        return self.proc.stdout

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def last_words(self, limit: int = 2000) -> str:
        """The last ``limit`` bytes the child wrote to stderr, as text ("" once :meth:`close` released them)."""
        if self._stderr.closed:
            return ""
        self._stderr.seek(0, os.SEEK_END)
        size = self._stderr.tell()
        self._stderr.seek(max(0, size - limit))
        return self._stderr.read(limit).decode(errors="replace")

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout=timeout)

    def kill(self) -> int:
        """End the child now (SIGKILL) if it still runs; its exit status."""
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait(timeout=WAIT_S)

    def desync(self, reason: str) -> int:
        """The child answered out of step: nothing it says can be trusted, so it is killed (whatever it holds, keys
        included, goes with it). Its exit status."""
        log.error("%s (pid %d) answered out of step (%s); stopping it", self.label, self.pid, reason)
        return self.kill()

    def close(self, timeout: float = WAIT_S) -> None:
        """Close its stdin (a well-behaved child ends on that), wait ``timeout``, then kill it; release its pipes."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(timeout=timeout)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self._finalizer()
        for stream in (self.proc.stdout, self._stderr):
            if stream is not None:
                stream.close()
