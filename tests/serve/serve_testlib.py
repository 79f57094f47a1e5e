"""Helpers for the server tests: real ``polyfhe serve`` processes on free loopback ports."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

TINY, OTHER = "tiny", "other"
STARTUP_S = 90.0
SHUTDOWN_S = 30.0  # uvicorn's graceful shutdown is capped at 5 s, the host's at 5 s per worker; then load


@dataclass
class ServerProcess:
    url: str
    proc: subprocess.Popen
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        """SIGTERM; once uvicorn has drained HTTP and begun the application shutdown, SIGTERM the workers too.

        The process host joins each worker 5 s before killing it (closing its pipe does not wake the reader
        thread blocked on it, so the worker never reads EOF): 10 s per server for nothing. A server still up
        ``SHUTDOWN_S`` after SIGTERM is killed and the test fails, so a real hang is not hidden."""
        if self.proc.poll() is not None:
            return
        workers = _children(self.proc.pid)
        self.proc.terminate()
        deadline = time.monotonic() + SHUTDOWN_S
        while workers and self.proc.poll() is None and time.monotonic() < deadline:
            if "Waiting for application shutdown." in self.log_text():
                time.sleep(0.2)  # the host marks itself closing first: a worker ended now is not restarted
                for pid in workers:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGTERM)
                break
            time.sleep(0.05)
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=15)
            raise AssertionError(f"server did not exit within {SHUTDOWN_S:g} s of SIGTERM:\n"
                                 f"{self.log_text()[-3000:]}") from None


def _children(pid: int) -> list[int]:
    """The worker processes (multiprocessing spawns) whose parent is ``pid``, read from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid and \
                    b"spawn_main" in (stat.parent / "cmdline").read_bytes():
                found.append(int(stat.parent.name))
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(programs: Path, log: Path, *flags: str, scheme: str = "http",
                 ca_file: Path | None = None, startup_s: float = STARTUP_S) -> ServerProcess:
    """``polyfhe serve`` in a subprocess on a free loopback port, once ``/healthz`` answers (over HTTPS with
    ``scheme="https"``, trusting ``ca_file``)."""
    port = free_port()
    cmd = [sys.executable, "-m", "polyfhe.cli", "-v", "serve", "--programs", str(programs), "--host", "127.0.0.1",
           "--port", str(port), *flags]
    env = {**os.environ, "POLYFHE_THREADS": "1"}  # a 2-core machine is shared: one thread per evaluation
    fh = log.open("w")
    proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(f"{scheme}://127.0.0.1:{port}", proc, log)
    verify = ssl.create_default_context(cafile=str(ca_file)) if ca_file is not None else True
    deadline = time.monotonic() + startup_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log_text()}")
        try:
            if httpx.get(f"{server.url}/healthz", timeout=2, verify=verify).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"server did not answer /healthz within {startup_s} s:\n{server.log_text()}")
