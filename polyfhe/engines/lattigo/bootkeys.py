"""Lattigo bootstrapping keys generated in a short-lived child process.

Generating and marshalling the bootstrapping keys through the wheel peaks near four times their size (Go's keys,
Go's marshalled buffer, its C copy, Python's bytes), and Go does not hand the freed heap back to the operating
system for minutes: in the client's own process that garbage stays resident while the rest of the run (the
public context, a server in the same process) needs the memory. In a child the peak is the same, but it ends
with the child, and the parent holds the marshalled keys only (measured in docs/ckks.md).

The secret key reaches the child through a pipe (stdin), never the disk; the child writes the marshalled keys to
its stdout. Framing on both pipes: an 8-byte little-endian length before each part. The child's stderr is drained
by a thread while its stdout is read (a child that filled the stderr pipe before writing its keys would otherwise
block forever, and the parent with it); its last words are kept for the error message.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
import threading
from typing import BinaryIO

__all__ = ["generate_here", "generate_in_child"]

log = logging.getLogger(__name__)

_LEN = struct.Struct("<Q")
_CHUNK = 1 << 24
_STDERR_TAIL = 1 << 16  # bytes of the child's stderr kept for error messages (all of it is read)


class _Drain:
    """Reads a pipe to its end on a thread, keeping the last ``keep`` bytes."""

    def __init__(self, stream: BinaryIO, keep: int = _STDERR_TAIL) -> None:
        self.tail, self._keep, self._stream = bytearray(), keep, stream
        self._thread = threading.Thread(target=self._run, daemon=True, name="bootkeys-stderr")
        self._thread.start()

    def _run(self) -> None:
        try:
            while chunk := self._stream.read1(1 << 16):
                self.tail += chunk
                if len(self.tail) > 2 * self._keep:
                    del self.tail[:-self._keep]
        except (OSError, ValueError):
            pass

    def text(self, timeout: float = 10.0) -> str:
        self._thread.join(timeout)
        return bytes(self.tail[-self._keep:]).decode(errors="replace")


def _write_part(stream: BinaryIO, data: bytes | memoryview) -> None:
    stream.write(_LEN.pack(len(data)))
    view = memoryview(data)
    stream.writelines(view[start:start + _CHUNK] for start in range(0, len(view), _CHUNK))


def _read_part(stream: BinaryIO, limit: int) -> bytearray:
    head = stream.read(_LEN.size)
    if len(head) != _LEN.size:
        raise EOFError("the bootstrapping key child ended before sending its keys")
    (n,) = _LEN.unpack(head)
    if n > limit:
        raise ValueError(f"the bootstrapping key child announced {n} bytes, over the {limit}-byte limit")
    out = bytearray(n)
    view, got = memoryview(out), 0
    while got < n:
        read = stream.readinto(view[got:got + _CHUNK])
        if not read:
            raise EOFError(f"the bootstrapping key child sent {got} of {n} bytes")
        got += read
    return out


def generate_here(lattigo_params: dict, spec: dict, secret_key: bytes, h: int) -> bytes:
    """The marshalled ``BootstrapEvalKeys`` for ``spec`` (logn, logp, log_slots), generated in this process."""
    from lattigo import ckks, rlwe

    params = ckks.Parameters.from_dict(lattigo_params)
    sk = rlwe.SecretKey.unmarshal_binary(secret_key)
    btp = rlwe.BootstrapParams(params, logn=int(spec["logn"]), logp=list(spec["logp"]), h=h,
                               log_slots=int(spec["log_slots"]))
    try:
        evk, keys = btp.gen_eval_keys(sk)
        evk.close()
        try:
            return keys.marshal_binary()
        finally:
            keys.close()
    finally:
        btp.close()


def generate_in_child(lattigo_params: dict, spec: dict, secret_key: bytes, h: int, limit: int,
                      command: list[str] | None = None) -> bytearray:
    """:func:`generate_here` in a child process; ``limit`` bounds the bytes accepted back (the predicted size
    with room to spare). Errors carry the child's last words (an out-of-memory kill says so). ``command``: the
    child's command line (tests), by default this module run by this interpreter."""
    header = json.dumps({"params": lattigo_params, "spec": spec, "h": h}).encode()
    child = subprocess.Popen(command or [sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=os.environ.copy())
    assert child.stdin is not None and child.stdout is not None and child.stderr is not None
    stderr = _Drain(child.stderr)
    try:
        try:
            _write_part(child.stdin, header)
            _write_part(child.stdin, secret_key)
            child.stdin.close()
        except BrokenPipeError:
            pass  # the child ended early: its exit status and last words say why, below
        try:
            keys = _read_part(child.stdout, limit)
        except (EOFError, ValueError) as exc:
            if child.poll() is None:
                child.kill()
            child.wait()
            raise RuntimeError(_child_failure(child, str(exc), stderr.text())) from None
        if child.wait() != 0:
            raise RuntimeError(_child_failure(child, "it exited after sending its keys", stderr.text()))
        return keys
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        stderr.text(timeout=5.0)
        child.stdout.close()
        child.stderr.close()


def _child_failure(child: subprocess.Popen, what: str, err: str) -> str:
    code = child.returncode
    reason = ("killed (signal 9: most likely out of memory; see `polyfhe export --bootstrap-memory`)"
              if code == -9 else f"exit status {code}")
    return (f"bootstrapping key generation failed: {what}; the child process ended with {reason}. "
            f"{err[-2000:].strip()}")


def _main() -> int:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    request = json.loads(bytes(_read_part(stdin, 1 << 20)))
    secret_key = bytes(_read_part(stdin, 1 << 30))
    keys = generate_here(request["params"], request["spec"], secret_key, int(request["h"]))
    del secret_key
    _write_part(stdout, keys)
    stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_main())
