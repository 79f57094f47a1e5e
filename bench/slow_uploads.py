"""A slow-upload attacker for the server benchmarks and tests: raw HTTP uploads that declare a length and then
send one byte a second, from a chosen loopback source address (``127.0.0.2`` and up are this machine too).

``Trickle`` is one such connection; ``SlowUploads`` keeps ``count`` of them open against a server, opening a new
one whenever the server answers one, and counts the answers by status (what ``bench/serve_load.py
--slow-uploads`` reports beside the honest clients' latencies).
"""

from __future__ import annotations

import collections
import socket
import threading
import time

__all__ = ["SlowUploads", "Trickle"]


class Trickle:
    """One raw HTTP upload from ``source`` that declares ``declared`` bytes and sends one a second."""

    def __init__(self, host: str, port: int, path: str, declared: int, source: str) -> None:
        self.sock = socket.create_connection((host, port), timeout=10, source_address=(source, 0))
        self.sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/octet-stream\r\n"
                          f"Content-Length: {declared}\r\n\r\n".encode())
        self.answer = b""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.sock.settimeout(1.0)
        while not self._stop.is_set():
            try:
                self.sock.sendall(b"P")
            except OSError:
                pass
            try:
                data = self.sock.recv(65536)
                if not data:
                    return
                self.answer += data
            except TimeoutError:
                continue
            except OSError:
                return

    def _complete(self) -> bool:
        head, sep, body = self.answer.partition(b"\r\n\r\n")
        if not sep:
            return False
        length = [line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")]
        return not length or len(body) >= int(length[0])

    def status(self, wait_s: float = 0.0) -> int | None:
        """The HTTP status the server answered (its body read in full), or None while it has not."""
        end = time.monotonic() + wait_s
        while not self._complete() and time.monotonic() < end and self._thread.is_alive():
            time.sleep(0.1)
        if not self.answer.startswith(b"HTTP/1.1 "):
            return None
        return int(self.answer[9:12])

    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()


class SlowUploads:
    """``count`` trickling uploads to ``path`` at once, each declaring ``declared`` bytes, from ``sources`` in
    turn; an answered one is replaced until :meth:`stop`. ``answers``: status (0: the connection failed, -1: closed unanswered) -> count."""

    def __init__(self, host: str, port: int, path: str, declared: list[int], sources: list[str]) -> None:
        self.host, self.port, self.path, self.declared, self.sources = host, port, path, declared, sources
        self.answers: collections.Counter = collections.Counter()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._keep, args=(i,), daemon=True) for i in range(len(declared))]

    def start(self) -> SlowUploads:
        for t in self._threads:
            t.start()
        return self

    def _keep(self, i: int) -> None:
        while not self._stop.is_set():
            try:
                trickle = Trickle(self.host, self.port, self.path, self.declared[i], self.sources[i % len(self.sources)])
            except OSError:
                self.answers[0] += 1
                time.sleep(1)
                continue
            try:
                while not self._stop.is_set() and trickle.status() is None and trickle.alive():
                    time.sleep(0.5)
                status = trickle.status()
                if status is not None or not self._stop.is_set():
                    self.answers[status if status is not None else -1] += 1  # -1: closed without an answer
            finally:
                trickle.close()

    def stop(self) -> dict[str, int]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)
        return {str(k): v for k, v in sorted(self.answers.items())}
