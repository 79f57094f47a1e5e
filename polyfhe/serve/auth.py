"""Optional bearer tokens (``polyfhe serve --auth-token-file F``): who may open and use sessions.

The file holds one token per line (blank lines and ``#`` comments ignored), each at least
:data:`MIN_TOKEN_CHARS` characters. A request names its token as ``Authorization: Bearer TOKEN``; it is compared
with every known token in constant time (no early exit on the first match or the first differing byte). A session
remembers the fingerprint of the token that opened it and answers 404 to any other, exactly as an unknown id does.
Tokens are never logged; the log names a token by the first characters of its fingerprint.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
from pathlib import Path

from polyfhe.serve.errors import ApiError

__all__ = ["MIN_TOKEN_CHARS", "TokenAuth", "TokenFileError", "fingerprint"]

log = logging.getLogger(__name__)

MIN_TOKEN_CHARS = 16


class TokenFileError(ValueError):
    """The token file is missing, unreadable or holds no usable token."""


def fingerprint(token: str) -> str:
    """A token's SHA-256: what sessions store, so the tokens themselves are held in one place only."""
    return hashlib.sha256(token.encode()).hexdigest()


class TokenAuth:
    def __init__(self, tokens: list[str]) -> None:
        if not tokens:
            raise TokenFileError("no tokens given")
        self._fingerprints = [fingerprint(t) for t in tokens]

    @classmethod
    def from_file(cls, path: str | Path) -> TokenAuth:
        path = Path(path)
        try:
            text = path.read_text()
            mode = path.stat().st_mode
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenFileError(f"cannot read the token file {path}: {exc}") from None
        tokens = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        short = [i + 1 for i, t in enumerate(tokens) if len(t) < MIN_TOKEN_CHARS or any(c.isspace() for c in t)]
        if short:
            raise TokenFileError(f"the token file {path} has tokens shorter than {MIN_TOKEN_CHARS} characters or with "
                                 f"spaces (token(s) {short}); make them with `python -c \"import secrets; "
                                 "print(secrets.token_urlsafe(32))\"`")
        if not tokens:
            raise TokenFileError(f"the token file {path} holds no token (one per line)")
        if mode & (stat.S_IRWXG | stat.S_IRWXO) and os.name == "posix":
            log.warning("the token file %s is readable by other users; chmod 600 it", path)
        return cls(tokens)

    def owner(self, authorization: str | None) -> str:
        """The fingerprint of the request's token; 401 when it is missing or unknown."""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, "unauthorized", "this server needs a bearer token: send 'Authorization: Bearer "
                           "TOKEN' (polyfhe client --auth-token-file F)", extra={"scheme": "Bearer"})
        given = fingerprint(token.strip())
        match = False
        for known in self._fingerprints:  # every one compared: the time does not say which (or whether) matched
            match |= hmac.compare_digest(known, given)
        if not match:
            log.warning("refused a request with an unknown bearer token")
            raise ApiError(401, "unauthorized", "the bearer token is not valid for this server",
                           extra={"scheme": "Bearer"})
        return given
