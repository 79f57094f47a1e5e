"""Files SEAL (de)serialises through: ``tenseal.sealapi`` reads and writes SEAL objects only by path, so the
bytes pass through an anonymous in-memory file where the platform has one, never a directory entry."""

from __future__ import annotations

import contextlib
import os
import tempfile

__all__ = ["memory_file", "read_all"]


@contextlib.contextmanager
def memory_file():
    """(fd, path) of a file to (de)serialise through: ``tenseal.sealapi`` (de)serialises only through paths.

    Linux (``memfd_create`` and ``/proc/self/fd``): an anonymous in-memory file reached as ``/proc/self/fd/N``; no
    directory entry, nothing on disk. Elsewhere (macOS, Windows, a Linux without ``/proc``) there is no anonymous
    file SEAL can open by path, so the bytes, secret keys included, do pass through the temporary directory's file
    system: a file of mode 0600 inside a fresh directory of mode 0700 (``tempfile.mkdtemp``), unlinked together
    with its directory as soon as the caller's block ends. It can reach a disk only there and only while the
    block runs (or in swap/page cache, as any memory can).
    """
    if hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"):
        fd = os.memfd_create("polyfhe-seal", os.MFD_CLOEXEC)
        try:
            yield fd, f"/proc/self/fd/{fd}"
        finally:
            os.close(fd)
        return
    directory = tempfile.mkdtemp(prefix="polyfhe-")  # mode 0700: no other user can list or open what is inside
    path = os.path.join(directory, "object")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o600)
        try:
            yield fd, path
        finally:
            os.close(fd)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.rmdir(directory)


def read_all(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    chunks, offset = [], 0
    while offset < size:
        chunk = os.pread(fd, size - offset, offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)
