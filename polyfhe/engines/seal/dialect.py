"""SEAL format versions at the server's byte boundary: ours, and the foreign ones whose wire format is ours.

SEAL before 4.4 loads only objects whose header carries its own major.minor (``IsCompatibleVersion``), yet the
bytes of every object a client and a server exchange (ciphertexts, public, relinearisation and Galois keys) are
the same in SEAL 4.1 and 4.3: the browser client, node-seal 7.0.0, is SEAL 4.1.2 compiled to WASM, and TenSEAL
0.3.18 is SEAL 4.3. So an object in a compatible version is accepted: its headers (the outer one and every nested
one, which must all say that version) are rewritten to ours before SEAL loads it, and a server answers such a
client in its version (:func:`to_version`). Every other version is refused on its 16-byte header, before a byte
is inflated (:func:`check_version`).
"""

from __future__ import annotations

import functools
import logging
import os
import struct
from collections.abc import Iterable

from polyfhe.engines.seal.memfile import memory_file, read_all
from polyfhe.engines.seal.sealbytes import (
    CT_MEMBERS,
    HEADER,
    MAGIC,
    SerializationError,
    inflate_into,
    parse_header,
    read_header,
)

__all__ = ["COMPATIBLE_VERSIONS", "LOCAL_VERSION", "Version", "accepted_versions",  # noqa: F822 (__getattr__)
           "check_version", "describe_version", "local_version", "rewrite_headers", "to_version"]

log = logging.getLogger(__name__)

Version = tuple[int, int]

# Foreign versions whose wire format equals SEAL 4.3's, with who writes them. 4.1 (node-seal 7.0.0): shown in
# shared/specs/ckks.md section 4 (every nested header's minor byte rewritten 4.3 <-> 4.1, both directions load
# and decrypt) and end to end by the Node interop test against node-seal itself.
COMPATIBLE_VERSIONS: frozenset[Version] = frozenset({(4, 1)})
_WRITERS: dict[Version, str] = {(4, 1): "node-seal 7"}
# The local versions that equality was shown for: another SEAL (a 4.4 build, say) reads only its own version
# until someone shows its format equal too.
_SAME_WIRE: frozenset[Version] = frozenset({(4, 1), (4, 3)})

# Our own ciphertexts are tens of MB at most (N = 2^17 with 60 primes: 126 MB): a bound, not a check
_TRUSTED_CAP = 1 << 32
_VERSION_OFFSET = struct.calcsize("<HB")  # a SEAL header's major and minor bytes follow its magic and size


def __getattr__(name: str):
    """``LOCAL_VERSION``, found on first use (it needs SEAL loaded: :func:`local_version`)."""
    if name == "LOCAL_VERSION":
        return local_version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def local_version() -> Version:
    """The (major, minor) this process's SEAL writes, read once from the header of an object it saves: the
    installed TenSEAL decides it, not this file."""
    try:
        import tenseal.sealapi as sa
    except ImportError as exc:  # pragma: no cover - tenseal is a core dependency
        raise ImportError("CKKS needs TenSEAL: pip install 'tenseal==0.3.18'") from exc
    with memory_file() as (fd, path):
        sa.EncryptionParameters(sa.SCHEME_TYPE.NONE).save(path)
        magic, _, major, minor = HEADER.unpack(os.pread(fd, HEADER.size, 0))[:4]
    if magic != MAGIC:
        raise RuntimeError("SEAL saved an object without a SEAL header")
    version = (major, minor)
    log.debug("SEAL writes format %s", describe_version(version))
    return version


def accepted_versions() -> tuple[Version, ...]:
    """The versions this process loads: its own first, then the compatible foreign ones (none when its own SEAL
    is not one the formats were shown equal for)."""
    local = local_version()
    if local not in _SAME_WIRE:
        return (local,)
    return (local, *sorted(COMPATIBLE_VERSIONS - {local}, reverse=True))


def describe_version(version: Version) -> str:
    return f"{version[0]}.{version[1]}"


def _refusal(version: Version) -> str:
    local, *foreign = accepted_versions()
    names = [describe_version(local)] + [f"{describe_version(v)} ({_WRITERS[v]})" if v in _WRITERS
                                         else describe_version(v) for v in foreign]
    return (f"SEAL format {describe_version(version)}: this server reads {' and '.join(names)}; make keys with "
            "polyfhe's client or the web page")


def check_version(data) -> Version:
    """The SEAL format version of untrusted ``data``, refused (:class:`SerializationError`) unless it is one of
    :func:`accepted_versions`: decided on the 16-byte header alone, before anything is inflated."""
    view = memoryview(data).cast("B")
    if len(view) >= HEADER.size:
        magic, header_size, major, minor = HEADER.unpack_from(view)[:4]
        if magic == MAGIC and header_size == HEADER.size and (major, minor) not in accepted_versions():
            raise SerializationError(_refusal((major, minor)))
    return parse_header(view).version


def rewrite_headers(fd: int, offsets: Iterable[int], version: Version) -> None:
    """Set the version of the uncompressed SEAL headers at ``offsets`` of an inflated object in ``fd`` (each is
    checked to be a header first): the one change a compatible foreign object needs."""
    packed = bytes(version)
    for offset in offsets:
        read_header(fd, offset)
        if os.pwrite(fd, packed, offset + _VERSION_OFFSET) != len(packed):
            raise OSError(f"short write rewriting the SEAL header at byte {offset}")


def to_version(data: bytes, version: Version) -> bytes:
    """One of the server's own ciphertexts (trusted: ``SealContext.dump``) in format ``version``: unchanged when
    that is ours; otherwise inflated, with its outer and its data's header rewritten (a client of that SEAL
    refuses ours). Only for ciphertexts: their one nested header sits at a fixed offset."""
    if version == local_version():
        return data
    if version not in accepted_versions():
        raise ValueError(f"SEAL format {describe_version(version)} is not one this process reads and writes")
    with memory_file() as (fd, _):
        inflate_into(fd, data, _TRUSTED_CAP, "result ciphertext")
        rewrite_headers(fd, (0, HEADER.size + CT_MEMBERS), version)
        return read_all(fd)
