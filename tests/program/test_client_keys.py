"""Client keys that persist: a client restored from its private backup (and the key folder that holds it)."""

from __future__ import annotations

import json
import os
import stat

import numpy as np
import pytest
from ckks_testlib import export_square_mlp

from polyfhe.engines.seal.client import CKKSClient
from polyfhe.program.boundary import KeyMismatchError
from polyfhe.program.engines import BackendUnavailable, get_backend, restore_client
from polyfhe.program.keydir import PUBLIC_FILE, RECORD_FILE, SECRET_FILE, KeyDir, KeyDirError
from polyfhe.program.wire import WireError

pytestmark = pytest.mark.fhe


def _export(width: int, classes: int, **kwargs):
    return export_square_mlp(width, classes, **kwargs)


@pytest.fixture(scope="module")
def tiny():
    return _export(12, 4)


@pytest.fixture(scope="module")
def other():
    return _export(6, 3, scale_bits=35)


@pytest.fixture(scope="module")
def x():
    return np.random.default_rng(1).random((3, 1, 8, 8))


@pytest.fixture(scope="module")
def session(tiny, x):
    """The original client, its public context, and a server's answer made with those keys."""
    client = tiny.client()
    context = client.public_context()
    answer = tiny.server(context).run(client.encrypt(x))
    return client, context, answer


def test_restored_seal_client_decrypts_what_the_original_keys_made(tiny, x, session):
    client, context, answer = session
    restored = CKKSClient.load(tiny.manifest, client.secret_context(), context)
    expected = tiny.run_plain(x)
    np.testing.assert_allclose(restored.decrypt(answer), client.decrypt(answer), atol=1e-9)
    np.testing.assert_allclose(restored.decrypt(answer), expected, atol=1e-3)
    assert restored.public_context() == context  # a server session opened with it stays valid
    # and the restored client encrypts for that same session: the original decrypts the server's answer
    np.testing.assert_allclose(client.decrypt(tiny.server(context).run(restored.encrypt(x))), expected, atol=1e-3)


def test_backup_alone_derives_new_evaluation_keys_for_the_same_secret(tiny, x, session):
    client, context, answer = session
    restored = restore_client(tiny.manifest, client.secret_context())
    assert restored.public_context() != context  # relinearisation and Galois keys made again (new randomness)
    np.testing.assert_allclose(restored.decrypt(answer), tiny.run_plain(x), atol=1e-3)
    answer2 = tiny.server(restored.public_context()).run(restored.encrypt(x))
    np.testing.assert_allclose(client.decrypt(answer2), tiny.run_plain(x), atol=1e-3)  # one secret key


def test_backup_for_another_program_or_from_other_keys_is_refused(tiny, other, session):
    client = session[0]
    with pytest.raises(KeyMismatchError, match=f"keys for program {tiny.program_id}.*expected keys for program "
                                               f"{other.program_id}.*scale 2\\^35"):
        CKKSClient.load(other.manifest, client.secret_context())
    stranger = tiny.client()
    with pytest.raises(KeyMismatchError, match="public context was made with other keys"):
        CKKSClient.load(tiny.manifest, client.secret_context(), stranger.public_context())
    with pytest.raises(KeyMismatchError, match="public context holds keys for program"):
        CKKSClient.load(tiny.manifest, client.secret_context(), other.client().public_context())


@pytest.mark.parametrize("damage", ["truncated", "garbage", "public context as backup"])
def test_corrupt_backup_bytes_raise_a_clear_error(tiny, session, damage):
    client, context, _ = session
    secret = client.secret_context()
    data = {"truncated": secret[: len(secret) // 2], "garbage": os.urandom(1000),
            "public context as backup": context}[damage]
    with pytest.raises(WireError, match="truncated|bad magic|expected a secret"):
        CKKSClient.load(tiny.manifest, data)


def test_key_dir_files_are_private_from_the_first_byte(tiny, x, session, tmp_path, monkeypatch):
    """0600 even under a permissive umask, and with chmod forbidden: the mode is set when the file is created."""
    client, context, answer = session

    def no_chmod(*args, **kwargs):
        raise AssertionError("key files must be created private, not chmod-ed after writing")

    monkeypatch.setattr(os, "chmod", no_chmod)
    monkeypatch.setattr(os, "fchmod", no_chmod)
    old = os.umask(0)
    try:
        record = KeyDir(tmp_path / "keys").save(client, server="http://example.test", model="tiny")
    finally:
        os.umask(old)
    monkeypatch.undo()
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "keys").iterdir()}
    assert modes == {SECRET_FILE: 0o600, RECORD_FILE: 0o600, PUBLIC_FILE: 0o644}  # no temporary file left
    assert stat.S_IMODE((tmp_path / "keys").stat().st_mode) == 0o700
    assert (tmp_path / "keys" / PUBLIC_FILE).read_bytes() == context
    assert record["program_id"] == tiny.program_id and record["backend"] == "seal"
    restored = KeyDir(tmp_path / "keys").load(tiny.manifest)
    assert restored.public_context() == context
    np.testing.assert_allclose(restored.decrypt(answer), tiny.run_plain(x), atol=1e-3)


def test_key_dir_records_sessions_and_refuses_to_overwrite(tiny, session, tmp_path):
    client, _, _ = session
    keys = KeyDir(tmp_path / "keys")
    keys.save(client)
    assert keys.session_id("http://a:1", "tiny") is None
    keys.remember_session("http://a:1/", "tiny", "s1")
    keys.remember_session("http://a:1", "other", "s2")
    assert keys.session_id("http://a:1", "tiny") == "s1" and keys.session_id("http://a:1", "other") == "s2"
    assert stat.S_IMODE((tmp_path / "keys" / RECORD_FILE).stat().st_mode) == 0o600  # session ids are tokens
    with pytest.raises(KeyDirError, match="already holds keys"):
        keys.save(tiny.client())
    keys.save(tiny.client(), overwrite=True)
    assert keys.session_id("http://a:1", "tiny") is None  # new keys: the old sessions are not theirs


def test_key_dir_for_another_program_is_refused_saying_what_was_expected(tiny, other, session, tmp_path):
    client, _, _ = session
    KeyDir(tmp_path / "keys").save(client)
    with pytest.raises(KeyDirError, match=f"holds keys for program {tiny.program_id} on seal .*scale 2\\^40.*; "
                                          f"model other needs keys for program {other.program_id} on seal "
                                          ".*scale 2\\^35"):
        KeyDir(tmp_path / "keys").load(other.manifest, "model other")


def _damage(folder, name: str, how: str) -> None:
    path = folder / name
    if how == "truncate":
        path.write_bytes(path.read_bytes()[:100])
    elif how == "remove":
        path.unlink()
    else:
        path.write_text("{\"format\": ")


@pytest.mark.parametrize(("name", "how", "message"), [
    (SECRET_FILE, "truncate", "truncated or changed since"),
    (PUBLIC_FILE, "truncate", "truncated or changed since"),
    (PUBLIC_FILE, "remove", "is missing: the key folder is incomplete"),
    (RECORD_FILE, "corrupt", "not a valid key record"),
    (RECORD_FILE, "remove", "holds no polyfhe keys"),
])
def test_damaged_key_dir_gives_a_clear_error(tiny, session, tmp_path, name, how, message):
    client, _, _ = session
    folder = tmp_path / "keys"
    KeyDir(folder).save(client)
    _damage(folder, name, how)
    with pytest.raises(KeyDirError, match=message):
        KeyDir(folder).load(tiny.manifest)


def test_a_backup_that_fails_to_load_is_named_with_its_folder(tiny, session, tmp_path):
    """A record that matches damaged bytes (rewritten together) still ends in KeyDirError, not a traceback."""
    client, _, _ = session
    folder = tmp_path / "keys"
    KeyDir(folder).save(client)
    bad = client.secret_context()[:-7]
    record = json.loads((folder / RECORD_FILE).read_text())
    import hashlib

    record["files"][SECRET_FILE] = {"bytes": len(bad), "sha256": hashlib.sha256(bad).hexdigest()}
    (folder / RECORD_FILE).write_text(json.dumps(record))
    (folder / SECRET_FILE).write_bytes(bad)
    with pytest.raises(KeyDirError, match=f"keys in {folder} cannot be restored: .*truncated"):
        KeyDir(folder).load(tiny.manifest)


def test_lattigo_client_restores_from_its_backup(x, tmp_path):
    try:
        get_backend("lattigo").available()
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
    program = _export(12, 4, backend="lattigo")
    client = program.client()
    context = client.public_context()
    answer = program.server(context).run(client.encrypt(x))
    KeyDir(tmp_path / "keys").save(client)
    assert stat.S_IMODE((tmp_path / "keys" / SECRET_FILE).stat().st_mode) == 0o600
    restored = KeyDir(tmp_path / "keys").load(program.manifest)
    assert type(restored).__name__ == "LattigoClient" and restored.public_context() == context
    np.testing.assert_allclose(restored.decrypt(answer), client.decrypt(answer), atol=1e-9)
    np.testing.assert_allclose(restored.decrypt(answer), program.run_plain(x), atol=1e-3)
    np.testing.assert_allclose(client.decrypt(program.server(context).run(restored.encrypt(x))),
                               program.run_plain(x), atol=1e-3)
    seal = _export(12, 4)
    with pytest.raises(KeyMismatchError, match="on lattigo .*expected keys for program .* on seal"):
        restore_client(seal.manifest, client.secret_context())
