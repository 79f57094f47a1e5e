"""A client's keys in a folder, so that later runs restore them instead of making new ones (``--keys DIR``).

The folder holds three files, each written under a temporary name and renamed, so a reader never sees half of one:

- ``secret.pfhe``: the private backup (``client.secret_context()``: the secret key, and the public key on SEAL).
  Created with mode 0600 by ``os.open`` (never readable by others, not even between a write and a chmod); nothing
  here sends it anywhere, and it is written only where the user asked.
- ``public.pfhe``: the public context, the bytes a server gets. A restored client uploads exactly these, so a
  server session opened with them stays valid across runs.
- ``keys.json`` (0600 too: session ids are bearer tokens): the program id, parameter fingerprint and engine the keys
  are for, both files' sizes and SHA-256 (a truncated or changed file is named, never loaded), and the last session
  id per server URL and model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import stat
import time
from pathlib import Path
from typing import Any

from polyfhe.program.boundary import KeyMismatchError
from polyfhe.program.params import fingerprint_params
from polyfhe.program.wire import WireError

__all__ = ["FORMAT", "PUBLIC_FILE", "RECORD_FILE", "SECRET_FILE", "KeyDir", "KeyDirError"]

log = logging.getLogger(__name__)

FORMAT = "polyfhe-keys/1"
SECRET_FILE, PUBLIC_FILE, RECORD_FILE = "secret.pfhe", "public.pfhe", "keys.json"
PRIVATE_MODE, PUBLIC_MODE = 0o600, 0o644
MAX_RECORD_BYTES = 1 << 20  # keys.json holds a few session ids; a larger one is not ours


class KeyDirError(ValueError):
    """A key folder that is missing, unreadable, corrupt or made for another program; the message says which."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write(path: Path, data: bytes, mode: int) -> None:
    """A new file created with ``mode`` (``os.open``: the mode holds from the first byte), then renamed over
    ``path``."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _describe(record: dict) -> str:
    return f"program {record.get('program_id')} on {record.get('backend')} ({record.get('params_text')})"


class KeyDir:
    """The key folder at ``path``: :meth:`save` a client's keys, :meth:`load` them for a program's manifest, and
    remember the server session they opened (:meth:`session_id`, :meth:`remember_session`)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def holds_keys(self) -> bool:
        return any((self.path / name).exists() for name in (RECORD_FILE, SECRET_FILE))

    # ------------------------------------------------------------------------------------------------------
    def save(self, client: Any, *, overwrite: bool = False, server: str | None = None,
             model: str | None = None) -> dict:
        """Write ``client``'s private backup, public context and record; refuses a folder that holds keys unless
        ``overwrite`` (replacing keys orphans the sessions opened with them). ``server``/``model``: where the keys
        are meant to be used (later runs default to them)."""
        if self.holds_keys() and not overwrite:
            raise KeyDirError(f"{self.path} already holds keys; choose another folder or replace them on purpose")
        if self.path.exists() and not self.path.is_dir():
            raise KeyDirError(f"{self.path} exists and is not a folder")
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        manifest = client.manifest
        secret, public = client.secret_context(), client.public_context()
        record = {
            "format": FORMAT, "program_id": manifest.program_id, "params": fingerprint_params(manifest.params),
            "params_text": manifest.params.describe(), "backend": manifest.backend,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "server": server, "model": model,
            "files": {SECRET_FILE: {"bytes": len(secret), "sha256": _sha256(secret)},
                      PUBLIC_FILE: {"bytes": len(public), "sha256": _sha256(public)}},
            "sessions": {},
        }
        _write(self.path / SECRET_FILE, secret, PRIVATE_MODE)
        _write(self.path / PUBLIC_FILE, public, PUBLIC_MODE)
        self._write_record(record)
        log.info("keys for program %s written to %s", manifest.program_id, self.path)
        return record

    def _write_record(self, record: dict) -> None:
        _write(self.path / RECORD_FILE, (json.dumps(record, indent=1) + "\n").encode(), PRIVATE_MODE)

    def record(self) -> dict:
        """``keys.json``, checked for the fields the other methods read."""
        path = self.path / RECORD_FILE
        if not path.is_file():
            raise KeyDirError(f"{self.path} holds no polyfhe keys ({RECORD_FILE} is missing); make them with "
                              f"`polyfhe client keys create ... --out {self.path}`")
        try:
            if path.stat().st_size > MAX_RECORD_BYTES:
                raise ValueError(f"{path.stat().st_size} bytes, more than a key record ever holds")
            record = json.loads(path.read_text())
            files = record["files"]
            for name in (SECRET_FILE, PUBLIC_FILE):
                if not isinstance(files[name]["bytes"], int) or not isinstance(files[name]["sha256"], str):
                    raise TypeError(f"the entry for {name} lacks its size or SHA-256")
            if record.get("format") != FORMAT:
                raise ValueError(f"format {record.get('format')!r}, expected {FORMAT!r}")
            if not isinstance(record.setdefault("sessions", {}), dict):
                raise TypeError("'sessions' is not an object")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise KeyDirError(f"{path} is not a valid key record (corrupt or truncated?): {exc}") from None
        return record

    def check(self, manifest: Any, what: str = "the program") -> dict:
        """The record, if it is for ``manifest``'s program, parameters and engine; else :class:`KeyDirError`
        saying what was found and what was expected."""
        record = self.record()
        expected = {"program_id": manifest.program_id, "params": fingerprint_params(manifest.params),
                    "backend": manifest.backend, "params_text": manifest.params.describe()}
        if any(record.get(k) != expected[k] for k in ("program_id", "params", "backend")):
            raise KeyDirError(f"{self.path} holds keys for {_describe(record)}; {what} needs keys for "
                              f"{_describe(expected)}")
        return record

    def load(self, manifest: Any, what: str = "the program") -> Any:
        """The client whose keys these are, for ``manifest``: its ``public_context()`` returns the saved bytes."""
        from polyfhe.program.engines import restore_client

        record = self.check(manifest, what)
        secret = self._read(SECRET_FILE, record)
        public = self._read(PUBLIC_FILE, record)
        try:
            return restore_client(manifest, secret, public)
        except (WireError, KeyMismatchError) as exc:
            raise KeyDirError(f"the keys in {self.path} cannot be restored: {exc}") from None

    def _read(self, name: str, record: dict) -> bytes:
        path = self.path / name
        try:
            if name == SECRET_FILE and stat.S_IMODE(path.stat().st_mode) & 0o077:
                log.warning("%s is readable by other users (mode %o); it holds your secret key", path,
                            stat.S_IMODE(path.stat().st_mode))
            data = path.read_bytes()
        except FileNotFoundError:
            raise KeyDirError(f"{path} is missing: the key folder is incomplete") from None
        except OSError as exc:
            raise KeyDirError(f"cannot read {path}: {exc}") from None
        want = record["files"][name]
        if len(data) != int(want["bytes"]) or _sha256(data) != want["sha256"]:
            raise KeyDirError(f"{path} is not the file that was written ({len(data)} bytes, {want['bytes']} "
                              "written; its SHA-256 differs): truncated or changed since")
        return data

    # ------------------------------------------------------------------------------------------------------
    def session_id(self, server: str, model: str) -> str | None:
        """The last session these keys opened for ``model`` at ``server`` (it may have expired since)."""
        by_model = self.record()["sessions"].get(server.rstrip("/"))
        sid = by_model.get(model) if isinstance(by_model, dict) else None
        return sid if isinstance(sid, str) and sid else None

    def remember_session(self, server: str, model: str, session_id: str) -> None:
        record = self.record()
        by_model = record["sessions"].get(server.rstrip("/"))
        record["sessions"][server.rstrip("/")] = {**(by_model if isinstance(by_model, dict) else {}),
                                                  model: session_id}
        self._write_record(record)
