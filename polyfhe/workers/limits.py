"""Resource limits a child sets on itself: its address space (``RLIMIT_AS``) and its rank for the OOM killer.

Standard library only (a child in an environment of its own loads this by path). A child limits itself, before it
imports what it will run, rather than through a ``preexec_fn``: that is unsafe in a threaded parent such as the
HTTP server.
"""

from __future__ import annotations

import logging
import resource

__all__ = ["address_space_argument", "address_space_limits", "limit_address_space", "yield_to_oom_killer"]

log = logging.getLogger(__name__)

ADDRESS_SPACE_FLAG = "--address-space"


def limit_address_space(limit: int, within_hard: bool = True) -> int:
    """Set this process's ``RLIMIT_AS`` (soft and hard) to ``limit`` bytes and return it. ``within_hard``: lower
    ``limit`` to the hard limit already set (else ``setrlimit`` refuses to raise it: ``ValueError``)."""
    if within_hard:
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return limit


def address_space_argument(argv: list[str]) -> int | None:
    """The ``--address-space BYTES`` value of ``argv``, or None."""
    if ADDRESS_SPACE_FLAG not in argv:
        return None
    value = int(argv[argv.index(ADDRESS_SPACE_FLAG) + 1])
    if value <= 0:
        raise ValueError(f"--address-space must be positive, not {value}")
    return value


def address_space_limits() -> list[int | None]:
    """This process's ``RLIMIT_AS`` as ``[soft, hard]``, None for no limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    return [None if v == resource.RLIM_INFINITY else v for v in (soft, hard)]


def yield_to_oom_killer() -> None:
    """Make this process the OOM killer's first choice (raising one's own score needs no privilege)."""
    try:
        with open("/proc/self/oom_score_adj", "w") as fh:
            fh.write("1000")
    except OSError:
        log.debug("could not raise this process's oom_score_adj")
