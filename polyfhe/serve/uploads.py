"""A first look at uploaded bytes: container kind and identity, so that refusals say exactly what was wrong.

Only the small JSON header is parsed here (no copy of the sections); the full validation (sizes, sections,
SEAL's own checks) is the job of :class:`polyfhe.engines.seal.server.CKKSServer`.
"""

from __future__ import annotations

import json
import struct

from polyfhe.program.ckks_program import CKKSProgram
from polyfhe.program.engines import kind_of
from polyfhe.program.wire import (
    KIND_CONTEXT,
    KIND_NAMES,
    KIND_SECRET,
    MAGIC,
    MAX_HEADER,
    MAX_HEADER_NESTING,
    header_nesting,
)
from polyfhe.serve.errors import ApiError

__all__ = ["check_upload"]


def check_upload(data: bytes, expect: bytes, program: CKKSProgram) -> dict:
    """The header of a container of kind ``expect`` made for ``program``; :class:`ApiError` 400/422 if not."""
    what = KIND_NAMES[expect]
    start = len(MAGIC) + 5
    if len(data) < start or not data.startswith(MAGIC):
        raise ApiError(400, "not_polyfhe_bytes", f"the body is not a polyfhe {what} (bad magic); send the bytes "
                       f"of {'client.public_context()' if expect == KIND_CONTEXT else 'client.encrypt(x)'}")
    kind = bytes(data[len(MAGIC): len(MAGIC) + 1])
    if expect == KIND_CONTEXT and kind == KIND_SECRET:
        raise ApiError(400, "secret_key_refused", "this context holds a secret key: the server accepts only "
                       "public contexts (client.public_context()); keep the secret key on the client")
    if kind != expect:
        raise ApiError(400, "wrong_kind", f"expected a {what}, got a {KIND_NAMES.get(kind, 'unknown container')}")
    (size,) = struct.unpack("<I", data[len(MAGIC) + 1: start])
    if size > MAX_HEADER or start + size > len(data):
        raise ApiError(400, f"bad_{'context' if expect == KIND_CONTEXT else 'ciphertext'}",
                       f"the {what} is truncated or corrupt: header length {size} for {len(data)} bytes")
    raw = bytes(data[start: start + size])
    if header_nesting(raw) > MAX_HEADER_NESTING:
        header = f"nested deeper than {MAX_HEADER_NESTING} levels"
    else:
        try:
            header = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            header = f"not valid JSON ({type(exc).__name__}: {str(exc)[:200]})"
    if not isinstance(header, dict):
        raise ApiError(400, f"bad_{'context' if expect == KIND_CONTEXT else 'ciphertext'}",
                       f"the {what} header is not a JSON object: {str(header)[:200]}")
    if header.get("program_id") != program.program_id:
        raise ApiError(422, "wrong_program", f"the {what} was made for program {header.get('program_id')!r}, "
                       f"this model runs program {program.program_id!r}; fetch its manifest from "
                       "/v1/models/NAME/manifest and make keys for it")
    if header.get("params") != program.params_fingerprint:  # a Concrete fingerprint never equals a CKKS one
        detail, extra = kind_of(program).wrong_parameters(program, what)
        raise ApiError(422, "wrong_parameters", detail, extra=extra)
    return header

