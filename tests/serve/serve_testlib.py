"""Helpers for the server tests: real ``polyfhe serve`` processes on free loopback ports."""

from __future__ import annotations

import os
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
SHUTDOWN_S = 30.0  # uvicorn's graceful shutdown is capped at 5 s; the rest is room for a loaded machine


@dataclass
class ServerProcess:
    url: str
    proc: subprocess.Popen
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        """SIGTERM, then wait; a server still up ``SHUTDOWN_S`` after SIGTERM is killed and the test fails, so a
        real hang is not hidden."""
        if self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=SHUTDOWN_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=15)
            raise AssertionError(f"server did not exit within {SHUTDOWN_S:g} s of SIGTERM:\n"
                                 f"{self.log_text()[-3000:]}") from None


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
