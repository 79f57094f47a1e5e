"""Lattigo bootstrapping keys generated in a short-lived child process.

Generating and marshalling the bootstrapping keys through the wheel peaks near four times their size (Go's keys,
Go's marshalled buffer, its C copy, Python's bytes), and Go does not hand the freed heap back to the operating
system for minutes: in the client's own process that garbage stays resident while the rest of the run (the
public context, a server in the same process) needs the memory. In a child the peak is the same, but it ends
with the child, and the parent holds the marshalled keys only (measured in docs/ckks.md).

The secret key reaches the child through a pipe (stdin), never the disk; the child writes the marshalled keys to
its stdout. Framing on both pipes: an 8-byte little-endian length before each part, each read bounded
(:func:`polyfhe.workers.framing.read_part`). The child's stderr goes to a temporary file, never a pipe
(:class:`polyfhe.workers.child.Child`: a child that filled a stderr pipe before writing its keys would block
forever, and the parent with it); its last words are kept for the error message.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import BinaryIO

from polyfhe.workers.child import Child
from polyfhe.workers.framing import FrameError, read_part, write_part

__all__ = ["generate_here", "generate_in_child"]

log = logging.getLogger(__name__)

_STDERR_TAIL = 1 << 16  # bytes of the child's stderr kept for error messages
_PEER = "the bootstrapping key child"


def _read_part(stream: BinaryIO, limit: int) -> bytearray:
    return read_part(stream, limit, peer=_PEER, what="its keys")


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
    child = Child(command or [sys.executable, "-m", __name__], env=os.environ.copy(), label=_PEER)
    try:
        try:
            write_part(child.stdin, header)
            write_part(child.stdin, secret_key)
            child.stdin.close()
        except BrokenPipeError:
            pass  # the child ended early: its exit status and last words say why, below
        try:
            keys = _read_part(child.stdout, limit)
        except (EOFError, FrameError) as exc:
            child.kill()
            raise RuntimeError(_child_failure(child, str(exc))) from None
        if child.wait() != 0:
            raise RuntimeError(_child_failure(child, "it exited after sending its keys"))
        return keys
    finally:
        child.close(timeout=0)


def _child_failure(child: Child, what: str) -> str:
    code, err = child.proc.returncode, child.last_words(_STDERR_TAIL)
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
    write_part(stdout, keys)
    stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_main())
