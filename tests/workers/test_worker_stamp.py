"""Environment stamps: a child that reports another environment at hello is refused and stopped, by Concrete's
workers and by the server's; Concrete's worker loads the framework by path where polyfhe is not importable."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from polyfhe.engines.concrete.env import ConcreteEnv
from polyfhe.engines.concrete.worker import WORKER_SCRIPT, Worker
from polyfhe.workers.stamp import StampMismatch, check_stamp, environment_stamp


def test_a_stamp_that_differs_is_refused_naming_the_difference() -> None:
    ours = environment_stamp("p-1", packages=("pytest", "surely-not-installed-here"))
    assert ours["package:surely-not-installed-here"] == "absent"
    check_stamp(ours, dict(ours), "the child")
    with pytest.raises(StampMismatch, match="the child runs in another environment .*python '2.7' where '3"):
        check_stamp(ours, {**ours, "python": "2.7"}, "the child")
    with pytest.raises(StampMismatch, match="reported no environment stamp"):
        check_stamp(ours, None, "the child")


def _env(folder: Path, body: str) -> ConcreteEnv:
    """A stand-in for Concrete ML's environment: ``bin/python`` runs ``body`` with this interpreter."""
    (folder / "bin").mkdir(parents=True)
    python = folder / "bin" / "python"
    python.write_text(f"#!/bin/sh\n{body}\n")
    python.chmod(0o755)
    return ConcreteEnv(folder)


def test_a_concrete_worker_with_another_stamp_is_refused_and_stopped(tmp_path: Path) -> None:
    script = tmp_path / "other.py"
    script.write_text(f"import os, sys\nsys.path.insert(0, {str(WORKER_SCRIPT.parent)!r})\nimport worker_main as w\n"
                      "out = os.fdopen(os.dup(1), 'wb')\n"
                      "while True:\n    w.read_frame(sys.stdin.buffer)\n"
                      "    w.write_frame(out, {'ok': True, 'stamp': {**w.worker_stamp(), 'python': '2.7'}})\n")
    worker = Worker("server", _env(tmp_path / "env", f"exec {sys.executable} {script}"))
    with pytest.raises(StampMismatch, match=r"the Concrete ML server worker runs in another environment .*python "
                                            r"'2.7'.*polyfhe setup concrete --force"):
        worker.call("limits")
    assert not worker.alive
    worker.close()


def test_the_concrete_worker_needs_nothing_but_the_standard_library(tmp_path: Path) -> None:
    """``-S``: no site-packages, so neither polyfhe nor numpy is importable, as in Concrete ML's environment; the
    worker loads polyfhe/workers by path, answers hello and serves."""
    worker = Worker("server", _env(tmp_path / "env", f'exec {sys.executable} -S "$@"'), address_space_bytes=4 << 30)
    try:
        reply, _ = worker.call("limits")
        assert reply["address_space"] == [4 << 30, 4 << 30] and reply["max_request_bytes"] == 8 << 30
    finally:
        worker.close()


class _Proc:
    def __init__(self) -> None:
        self.killed = False

    def kill(self) -> None:
        self.killed = True


class _ReadyPipe:
    def __init__(self, stamp) -> None:
        self.stamp = stamp

    def poll(self, timeout=None) -> bool:
        return True

    def recv(self):
        return "ready", {"pid": 1, "stamp": self.stamp}


def test_a_serve_worker_with_another_stamp_is_refused_and_stopped() -> None:
    from polyfhe.serve.process_host import WorkerLost, _WorkerProcess
    from polyfhe.serve.worker_main import worker_stamp

    worker = _WorkerProcess.__new__(_WorkerProcess)
    worker.spec, worker.proc, worker._lock = SimpleNamespace(index=2), _Proc(), threading.Lock()
    worker.conn = _ReadyPipe(worker_stamp())
    assert worker._await_ready()["pid"] == 1 and not worker.proc.killed
    worker.conn = _ReadyPipe({**worker_stamp(), "package:polyfhe": "0.0.0-other"})
    with pytest.raises(WorkerLost, match="worker 2 could not start: worker 2 runs in another environment"):
        worker._await_ready()
    assert worker.proc.killed
