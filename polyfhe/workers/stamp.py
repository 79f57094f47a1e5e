"""An environment stamp: what a child reports at hello, so its parent can refuse one running somewhere else.

Standard library only (a child in an environment of its own loads this by path). A stamp is a flat dict of
strings: the protocol the child speaks, its interpreter's version and the versions of packages that must match.
The parent builds the stamp it expects the same way and compares (:func:`check_stamp`): a child started from an
environment made for another interpreter, or one restarted after polyfhe was upgraded under a running server,
is stopped before it is sent any work.
"""

from __future__ import annotations

import sys

__all__ = ["StampMismatch", "check_stamp", "environment_stamp"]


class StampMismatch(RuntimeError):
    """A child reported an environment other than the one its parent expects."""


def _version(package: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "absent"


def environment_stamp(protocol: str, packages: tuple[str, ...] = ()) -> dict[str, str]:
    """This process's stamp: ``protocol``, the interpreter's ``major.minor`` and each of ``packages``' versions."""
    stamp = {"protocol": protocol, "python": f"{sys.version_info[0]}.{sys.version_info[1]}"}
    stamp.update({f"package:{name}": _version(name) for name in packages})
    return stamp


def check_stamp(expected: dict[str, str], reported: object, who: str) -> None:
    """Refuse (:class:`StampMismatch`) a ``reported`` stamp that is not ``expected``; ``who`` names the child."""
    if not isinstance(reported, dict):
        raise StampMismatch(f"{who} reported no environment stamp (it speaks another protocol)")
    differ = [f"{key} {reported.get(key)!r} where {value!r} was expected" for key, value in sorted(expected.items())
              if reported.get(key) != value]
    if differ:
        raise StampMismatch(f"{who} runs in another environment than this process expects: " + "; ".join(differ))
