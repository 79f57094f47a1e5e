"""Numbers the Linux kernel reports in ``/proc`` files of ``Field: value kB`` lines (``/proc/meminfo``,
``/proc/PID/status``), in bytes: one reader for the memory checks of the plaintext store, the server's worker
processes and the Concrete workers. ``None`` where the file or the field does not exist (other systems)."""

from __future__ import annotations

__all__ = ["available_memory", "peak_resident_bytes", "proc_bytes", "resident_bytes"]


def proc_bytes(path: str, field: str) -> int | None:
    """``field``'s value in bytes (the file states kB), or None."""
    prefix = field + ":"
    try:
        with open(path) as fh:
            for line in fh:
                if line.startswith(prefix):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_memory() -> int | None:
    """Bytes the kernel says new allocations can still take without swapping (``MemAvailable``)."""
    return proc_bytes("/proc/meminfo", "MemAvailable")


def resident_bytes() -> int | None:
    """This process's resident memory now (``VmRSS``)."""
    return proc_bytes("/proc/self/status", "VmRSS")


def peak_resident_bytes() -> int | None:
    """The most resident memory this process has had (``VmHWM``)."""
    return proc_bytes("/proc/self/status", "VmHWM")
