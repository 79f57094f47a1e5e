"""The process boundary to Concrete ML: one worker process per role, framed requests, crashes contained.

A worker runs ``worker_main.py`` with the isolated environment's interpreter (``python -I``: nothing from
polyfhe's side is importable there). Every call sends a JSON header and raw blobs and gets the same back. When the
worker raises, :class:`ConcreteCallError` carries its type and message; when it dies (Concrete's native code can
abort on bytes it cannot parse), :class:`ConcreteWorkerDied` says so with the end of its stderr, and the caller's
process is untouched: the next call starts a fresh worker. A fresh worker's first exchange is ``hello``: its
environment stamp (protocol, interpreter version) must be this process's, else it is stopped before any work. The
process, the framing and the watchdog are polyfhe's worker framework (:mod:`polyfhe.workers`).

Memory is bounded twice. Every worker runs under a fixed address-space limit (``RLIMIT_AS``, default
:data:`DEFAULT_ADDRESS_SPACE_BYTES`, ``Worker(address_space_bytes=...)``): the worker sets it on itself before it
imports anything (``worker_main.py --address-space``; a ``preexec_fn`` would do the same in the forked child but is
unsafe in a threaded parent such as the HTTP server), so a parse that tries to allocate past it fails inside the
worker with a ``MemoryError`` or an abort, never on the machine. ``polyfhe serve``'s key budget counts what a
Concrete session holds, its worker included (``ConcreteProgram.session_memory_bytes``, measured); this limit is
virtual address space, tens of GB above that, so it is not what the budget counts. And every byte string a worker
will parse is size-checked here before it is sent
(:func:`check_blob_sizes`, limits per command in :data:`PARSE_LIMITS`): an oversized upload is refused with
:class:`ConcreteInputTooLarge`, naming the limit and the size sent, and never reaches the worker.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from pathlib import Path

import numpy as np

from polyfhe.engines.concrete.env import ConcreteEnv, find_env
from polyfhe.workers.child import Child
from polyfhe.workers.framing import FrameError, FrameFormat
from polyfhe.workers.stamp import StampMismatch, check_stamp, environment_stamp
from polyfhe.workers.watchdog import Watchdog, free_memory_limit

__all__ = ["DEFAULT_ADDRESS_SPACE_BYTES", "PARSE_LIMITS", "ConcreteCallError", "ConcreteInputTooLarge",
           "ConcreteWorkerDied", "Worker", "array_blob", "blob_array", "check_blob_sizes"]

log = logging.getLogger(__name__)

MAGIC = b"PFCW"
MAX_HEADER = 1 << 20
MAX_REPLY_BYTES = 8 << 30  # a reply is keys or ciphertexts: bounded even though the worker is our own
WORKER_SCRIPT = Path(__file__).with_name("worker_main.py")
# Address space a worker may map (RLIMIT_AS). Virtual, not resident: the interpreter, torch and Concrete's thread
# arenas reserve several GB they never touch, so the bound sits well above what a worker holds; Concrete's key
# generation for a large circuit takes tens of GB (the memory watchdog below ends a worker earlier when the
# machine has less free).
DEFAULT_ADDRESS_SPACE_BYTES = 48 << 30
# The most bytes of each kind a worker is sent to parse, by command (blob index -> (limit, what it is)). Concrete
# ML's evaluation keys for the circuits polyfhe compiles are tens to hundreds of MB and a query's ciphertexts a few
# MB to tens of MB; the limits leave an order of magnitude of room and stay far below the address-space bound.
PARSE_LIMITS: dict[str, dict[int, tuple[int, str]]] = {
    "server_keys": {0: (4 << 30, "evaluation keys")},
    "server_run": {0: (512 << 20, "ciphertext")},
    "decrypt": {0: (512 << 20, "result ciphertext")},
    "compile": {0: (2 << 30, "ONNX model"), 1: (1 << 30, "input set"), 2: (1 << 30, "evaluation inputs")},
    "encrypt": {0: (1 << 30, "input array")},
}
MAX_REQUEST_BYTES = 8 << 30  # every request, whatever its command
PROTOCOL = "concrete-worker-1"  # as worker_main.PROTOCOL: its hello must report this and this interpreter's version
FRAMES = FrameFormat(MAGIC, MAX_HEADER, MAX_REPLY_BYTES, kind="reply", owner="parent's")


class ConcreteCallError(RuntimeError):
    """The worker raised; ``error`` is the exception type inside Concrete ML, ``bad_input`` marks bytes it
    refused (keys or ciphertexts from outside)."""

    def __init__(self, error: str, message: str, bad_input: bool = False) -> None:
        super().__init__(f"{error}: {message}")
        self.error, self.message, self.bad_input = error, message, bad_input


class ConcreteWorkerDied(RuntimeError):
    """The worker process ended while it served a call; ``out_of_memory``: the memory watchdog stopped it."""

    def __init__(self, message: str, out_of_memory: bool = False) -> None:
        super().__init__(message)
        self.out_of_memory = out_of_memory


class ConcreteInputTooLarge(ValueError):
    """A byte string over its limit was to be sent to a worker for parsing; nothing was sent."""


def check_blob_sizes(command: str, blobs, limits: dict[str, dict[int, tuple[int, str]]] | None = None,
                     role: str = "Concrete ML") -> None:
    """Refuse, before anything is sent, a request whose byte strings pass their limits: per blob
    (:data:`PARSE_LIMITS` by command) and in all (:data:`MAX_REQUEST_BYTES`)."""
    limits = PARSE_LIMITS if limits is None else limits
    sizes = [len(b) for b in blobs]
    for index, size in enumerate(sizes):
        limit, what = limits.get(command, {}).get(index, (MAX_REQUEST_BYTES, f"blob {index}"))
        if size > limit:
            raise ConcreteInputTooLarge(f"the {what} sent to the {role} worker for {command!r} is {size} bytes, over "
                                        f"the limit of {limit} bytes: refused before it was sent")
    if sum(sizes) > MAX_REQUEST_BYTES:
        raise ConcreteInputTooLarge(f"the request {command!r} to the {role} worker carries {sum(sizes)} bytes, "
                                    f"over the limit of {MAX_REQUEST_BYTES} bytes: refused before it was sent")


def array_blob(x: np.ndarray) -> tuple[list[int], bytes]:
    arr = np.ascontiguousarray(x, dtype="<f8")
    return list(arr.shape), arr.tobytes()


def blob_array(blob: bytes, shape: list[int]) -> np.ndarray:
    return np.frombuffer(blob, dtype="<f8").reshape([int(s) for s in shape]).copy()


class Worker:
    """One worker process; ``call`` is serialised by a lock (a worker serves one request at a time)."""

    def __init__(self, role: str, env: ConcreteEnv | None = None, threads: int | None = None,
                 memory_limit_bytes: int | None = None,
                 address_space_bytes: int | None = DEFAULT_ADDRESS_SPACE_BYTES,
                 parse_limits: dict[str, dict[int, tuple[int, str]]] | None = None) -> None:
        """``memory_limit_bytes``: the worker is ended past it (default: 90% of what the machine has free when
        a call starts, plus what the worker holds already). ``address_space_bytes``: the worker's fixed
        ``RLIMIT_AS`` (``None``: none). ``parse_limits``: per-command size limits of what it is sent
        (default :data:`PARSE_LIMITS`)."""
        if address_space_bytes is not None and address_space_bytes <= 0:
            raise ValueError(f"address_space_bytes must be positive, not {address_space_bytes}")
        self.role = role
        self.memory_limit_bytes = memory_limit_bytes
        self.address_space_bytes = address_space_bytes
        self.parse_limits = PARSE_LIMITS if parse_limits is None else parse_limits
        self.env = env or find_env()
        self.threads = threads
        self._lock = threading.Lock()
        self._proc: Child | None = None
        self.restarts = 0

    def _start(self) -> Child:
        environ = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        if self.threads:
            environ.update(OMP_NUM_THREADS=str(self.threads), RAYON_NUM_THREADS=str(self.threads))
        # its own working folder: Concrete ML writes debugging artifacts (.artifacts/) into the current one
        workdir = tempfile.mkdtemp(prefix="polyfhe-concrete-")
        limit = [] if self.address_space_bytes is None else ["--address-space", str(int(self.address_space_bytes))]
        return Child([str(self.env.python), "-I", str(WORKER_SCRIPT), *limit], env=environ, workdir=workdir,
                     label=f"Concrete ML {self.role} worker")

    def _hello(self, child: Child) -> None:
        """A new worker's first exchange: its environment stamp must be this process's (same protocol, same
        interpreter version as the environment was made for), else it is stopped before any work."""
        FRAMES.write(child.stdin, {"command": "hello"})
        reply, _ = FRAMES.read(child.stdout)
        try:
            check_stamp(environment_stamp(PROTOCOL), reply.get("stamp"), f"the Concrete ML {self.role} worker")
        except StampMismatch as exc:
            child.kill()
            raise StampMismatch(f"{exc}; rebuild its environment with `polyfhe setup concrete --force`") from None

    def stderr_tail(self, limit: int = 2000) -> str:
        return "" if self._proc is None else self._proc.last_words(limit)

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.alive

    def call(self, command: str, header: dict | None = None, blobs: tuple[bytes, ...] | list = ()) -> tuple[dict, list]:
        """Send one request and wait for its reply. While it runs, a watchdog ends the worker if its memory passes
        what the machine had free (Concrete's key generation for a large circuit can take tens of GB). Byte
        strings over their limit are refused before anything is sent (:class:`ConcreteInputTooLarge`); a new
        worker whose environment stamp differs is refused (:class:`~polyfhe.workers.stamp.StampMismatch`)."""
        check_blob_sizes(command, blobs, self.parse_limits, f"Concrete ML {self.role}")
        with self._lock:
            fresh = not self.alive
            if fresh:
                if self._proc is not None:
                    self.restarts += 1
                self._proc = self._start()
            proc = self._proc
            limit = self.memory_limit_bytes if self.memory_limit_bytes is not None else free_memory_limit(proc.pid)
            watchdog = Watchdog(proc.pid, memory_limit=limit, label="Concrete ML worker")
            try:
                if fresh:
                    self._hello(proc)
                FRAMES.write(proc.stdin, {**(header or {}), "command": command}, blobs)
                reply, out = FRAMES.read(proc.stdout)
            except (BrokenPipeError, EOFError, OSError, FrameError) as exc:
                if isinstance(exc, FrameError):
                    code = proc.desync(str(exc))  # out of step: nothing it says next can be trusted
                else:
                    code = proc.wait(timeout=60) if proc.alive else proc.proc.returncode
                if watchdog.tripped:
                    raise ConcreteWorkerDied(
                        f"the Concrete ML {self.role} worker was stopped during {command!r}: it passed "
                        f"{watchdog.peak / 1e9:.1f} GB, more than the {watchdog.limit / 1e9:.1f} GB this machine had "
                        "free; a smaller model, fewer bits (n_bits, rounding_threshold_bits) or a machine with more "
                        "memory is needed", out_of_memory=True) from exc
                raise ConcreteWorkerDied(f"the Concrete ML {self.role} worker ended during {command!r} "
                                         f"(exit code {code}); its last words: {self.stderr_tail()[-800:]}") from exc
            finally:
                watchdog.stop()
        if not reply.get("ok"):
            raise ConcreteCallError(str(reply.get("error")), str(reply.get("message")),
                                    bool(reply.get("bad_input")))
        return reply, out

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._proc.close()
                self._proc = None
