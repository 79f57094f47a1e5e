"""Where serialised SEAL objects (secret keys included) pass: memory on Linux, else a private 0600 file."""

from __future__ import annotations

import os
import stat
import sys

import pytest

from polyfhe.engines.seal import context as seal_backend
from polyfhe.engines.seal import memfile


def test_linux_memory_file_has_no_directory_entry():
    if not (hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")):
        pytest.skip("memfd_create and /proc only on Linux")
    with memfile.memory_file() as (fd, path):
        assert path == f"/proc/self/fd/{fd}"
        assert "memfd:" in os.readlink(path)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX modes")
def test_fallback_file_is_private_and_removed(monkeypatch, tmp_path):
    """Off Linux: a 0600 file in a fresh 0700 directory, both gone when the block ends (also on error)."""
    monkeypatch.delattr(os, "memfd_create", raising=False)
    monkeypatch.setattr(memfile.tempfile, "tempdir", str(tmp_path))
    with memfile.memory_file() as (fd, path):
        os.write(fd, b"secret")
        directory = os.path.dirname(path)
        assert os.path.dirname(directory) == str(tmp_path)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        assert os.listdir(directory) == [os.path.basename(path)]
        assert memfile.read_all(fd) == b"secret"
    assert not os.path.exists(directory)
    with pytest.raises(RuntimeError), memfile.memory_file() as (fd, path):
        raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX modes")
def test_secret_key_round_trips_through_the_fallback(monkeypatch, tmp_path):
    """SEAL saves and loads a secret key by path through the fallback file, and leaves nothing behind."""
    from polyfhe.program.params import CKKSParams

    seal = seal_backend.SealContext(CKKSParams(2048, (60, 60, 60), 30, security="none"))
    secret = seal.sa.KeyGenerator(seal.context).secret_key()
    in_memory = seal.dump(secret)
    monkeypatch.delattr(os, "memfd_create", raising=False)
    monkeypatch.setattr(memfile.tempfile, "tempdir", str(tmp_path))
    data = seal.dump(secret)
    loaded = seal.load("secret_key", data)
    assert data == in_memory
    assert seal.dump(loaded) == data
    assert os.listdir(tmp_path) == []
