"""The child's side of a framed worker: keep stdout for frames only, and answer requests one at a time.

Standard library only, relative imports only (a child in an environment of its own loads this by path). The loop
answers every request with one reply: ``{"ok": True, ...}`` and the command's blobs, or ``{"ok": False, "error":
type, "message": ...}`` when the command raised (``"bad_input": True`` for the ``bad_input`` exception type: bytes
from outside that the library refused), and the child stays up. It returns when the parent closes the pipe.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import BinaryIO

from .framing import FrameFormat

__all__ = ["Command", "protect_stdout", "serve_requests"]

Command = Callable[[dict, list], tuple[dict, list]]
MESSAGE_CHARS = 4000  # of an error's message and trace sent back


def protect_stdout() -> BinaryIO:
    """The protocol's stream (a copy of stdout); whatever the libraries print from now on lands on stderr, never
    inside a frame."""
    protocol = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return protocol


def serve_requests(commands: dict[str, Command], frames: FrameFormat, requests: BinaryIO, replies: BinaryIO,
                   bad_input: type[BaseException]) -> None:
    """Read requests off ``requests`` and answer each on ``replies`` until the parent closes the pipe. A frame
    that breaks ``frames`` raises (the child ends: it is out of step)."""
    while True:
        try:
            header, blobs = frames.read(requests)
        except EOFError:
            return
        command = commands.get(header.get("command"))
        try:
            if command is None:
                raise ValueError(f"unknown command {header.get('command')!r}")
            reply, out = command(header, blobs)
            frames.write(replies, {"ok": True, **reply}, out)
        except bad_input as exc:
            frames.write(replies, {"ok": False, "bad_input": True, "error": "BadInput", "message": str(exc)})
        except Exception as exc:  # noqa: BLE001 - reported to the parent with its type; the child stays up
            frames.write(replies, {"ok": False, "error": type(exc).__name__, "message": str(exc)[:MESSAGE_CHARS],
                                   "trace": traceback.format_exc()[-MESSAGE_CHARS:]})
