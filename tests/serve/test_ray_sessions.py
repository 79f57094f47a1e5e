"""``polyfhe serve --ray`` without Ray: the key store, and the Ray front's routes over replicas simulated in this
process (real SEAL keys, real key store): failover from the store, corrupt store files, refused contexts, expiry,
the per-replica key budget, and the CLI's message when Ray is missing."""

from __future__ import annotations

import builtins
import json
import os
import stat
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient
from raylib import OCTETS, ray_front
from serve_testlib import TINY

from polyfhe.serve.keystore import CorruptSession, KeyStore, StoredSession

pytestmark = pytest.mark.fhe

SID = "A" * 31 + "b"


def _record(**kw) -> StoredSession:
    now = time.time()
    return StoredSession(**{"session_id": SID, "model": "m", "program_id": "p", "key_bytes": 10, "context_bytes": 0,
                            "sha256": "", "created": now, "last_used": now, **kw})


def test_key_store_round_trip_is_private_and_checked(tmp_path) -> None:
    store = KeyStore(tmp_path / "keys")
    record = store.put(_record(), b"public context bytes")
    assert stat.S_IMODE((tmp_path / "keys").stat().st_mode) == 0o700
    for name in os.listdir(tmp_path / "keys"):
        assert stat.S_IMODE((tmp_path / "keys" / name).stat().st_mode) == 0o600
    assert store.record(SID) == record and store.context(record) == b"public context bytes"
    assert store.live_count() == 1 and store.session_ids() == [SID]
    # ids are checked before they name a file: no traversal, no other file
    for bad in ("../" + SID[3:], SID + "/x", SID[:-1], "", "a" * 33, SID[:-1] + "."):
        assert store.record(bad) is None
        with pytest.raises(ValueError):
            store.delete(bad)
    # truncated, altered, missing context; unreadable record: a lost session, never a crash
    (tmp_path / "keys" / f"{SID}.ctx").write_bytes(b"public context byt")
    with pytest.raises(CorruptSession, match="bytes"):
        store.context(record)
    (tmp_path / "keys" / f"{SID}.ctx").write_bytes(b"public context BYTES")
    with pytest.raises(CorruptSession, match="SHA-256"):
        store.context(record)
    for junk in (b"{not json", b"[]", json.dumps({**record.to_dict(), "key_bytes": "10"}).encode(), b"\x00" * 10):
        (tmp_path / "keys" / f"{SID}.json").write_bytes(junk)
        with pytest.raises(CorruptSession):
            store.record(SID)
    assert store.sweep(ttl_s=60, forget_s=60) == 0 and store.session_ids() == []  # the corrupt record is dropped


def test_key_store_expires_then_forgets(tmp_path) -> None:
    store = KeyStore(tmp_path)
    now = time.time()
    store.put(_record(last_used=now - 100), b"x")
    assert store.sweep(ttl_s=50, forget_s=1000, now=now) == 1
    assert store.record(SID).state == "expired" and store.live_count() == 0  # context gone, record kept: 410
    assert store.sweep(ttl_s=50, forget_s=10, now=now + 100) == 0
    assert store.record(SID) is None  # forgotten: 404


@pytest.fixture
def front(programs, tmp_path):
    app, replicas, store = ray_front(programs["root"], tmp_path / "keys", max_ciphertext_bytes=1 << 20)
    with TestClient(app) as http:
        yield http, replicas, store


def _open(http, keys) -> str:
    opened = http.post("/v1/sessions", params={"model": TINY}, content=keys.public_context(), headers=OCTETS)
    assert opened.status_code == 201, opened.text
    return opened.json()["session_id"]


def _infer(http, keys, session_id: str, x: np.ndarray):
    return http.post(f"/v1/sessions/{session_id}/infer", content=keys.encrypt(x.reshape(1, -1)), headers=OCTETS)


def test_a_dead_replicas_sessions_are_served_from_the_store(front, programs, samples) -> None:
    http, replicas, store = front
    x, plain = samples
    keys = programs[TINY].client()
    session = _open(http, keys)
    first = replicas.where[session]
    answer = _infer(http, keys, session, x[0])
    assert answer.status_code == 200 and answer.headers["X-Polyfhe-Replica"] == f"r{first}"
    np.testing.assert_allclose(keys.decrypt(answer.content)[0], plain[0], atol=1e-3)

    replicas.kill(first)
    lost = _infer(http, keys, session, x[1])  # routed to the replica as it died: retry
    assert lost.status_code == 503 and lost.json()["error"] == "worker_lost" and lost.headers["Retry-After"] == "1"
    again = _infer(http, keys, session, x[1])
    assert again.status_code == 200 and again.headers["X-Polyfhe-Replica"] == f"r{1 - first}"
    np.testing.assert_allclose(keys.decrypt(again.content)[0], plain[1], atol=1e-3)
    assert replicas.caches[1 - first].loads_total == 1  # loaded from the store, not uploaded again
    assert http.get(f"/v1/sessions/{session}").json()["requests"] == 3
    assert http.delete(f"/v1/sessions/{session}").json()["deleted"] is True
    assert store.session_ids() == [] and _infer(http, keys, session, x[0]).json()["error"] == "unknown_session"


def test_corrupt_store_files_are_lost_sessions(front, programs, samples, tmp_path) -> None:
    http, replicas, _store = front
    x, plain = samples
    keys = programs[TINY].client()
    truncated, garbled, healthy = (_open(http, keys) for _ in range(3))
    for session in (truncated, garbled):
        replicas.caches[replicas.where[session]].drop(session)  # not held any more: read from the store
    ctx = tmp_path / "keys" / f"{truncated}.ctx"
    ctx.write_bytes(ctx.read_bytes()[:1000])
    (tmp_path / "keys" / f"{garbled}.json").write_text('{"format": 1, "session_id": 5')
    for session in (truncated, garbled):
        refused = _infer(http, keys, session, x[0])
        assert refused.status_code == 410 and refused.json()["error"] == "session_lost", refused.text
    ok = _infer(http, keys, healthy, x[2])  # the others carry on
    np.testing.assert_allclose(keys.decrypt(ok.content)[0], plain[2], atol=1e-3)


def test_refused_contexts_leave_nothing_in_the_store(front, programs) -> None:
    http, _replicas, store = front
    keys = programs[TINY].client()
    secret = http.post("/v1/sessions", params={"model": TINY}, content=keys.secret_context(), headers=OCTETS)
    assert secret.status_code == 400 and secret.json()["error"] == "secret_key_refused"
    context = bytearray(keys.public_context())
    context[-5000:] = bytes(5000)  # a valid header over corrupt keys: the replica's engine refuses it
    bad = http.post("/v1/sessions", params={"model": TINY}, content=bytes(context), headers=OCTETS)
    assert bad.status_code == 400 and bad.json()["error"] == "bad_context", bad.text
    assert store.session_ids() == [] and os.listdir(store.url) == []
    assert http.post("/v1/sessions/../x/infer", content=b"x").status_code == 404


def test_expired_sessions_answer_410_on_every_replica(programs, samples, tmp_path) -> None:
    app, _replicas, store = ray_front(programs["root"], tmp_path / "keys", session_ttl_s=1.0)
    x, _plain = samples
    keys = programs[TINY].client()
    with TestClient(app) as http:
        session = _open(http, keys)
        time.sleep(1.5)
        gone = _infer(http, keys, session, x[0])
        assert gone.status_code == 410 and gone.json()["error"] == "session_expired"
        assert store.live_count() == 0


def test_a_replica_keeps_keys_within_its_budget(programs, samples, tmp_path) -> None:
    keys = programs[TINY].client()
    one = len(keys.public_context()) * 2  # room for one session's keys, not two
    app, replicas, _store = ray_front(programs["root"], tmp_path / "keys", replicas=1, budget_bytes=one)
    x, plain = samples
    with TestClient(app) as http:
        a, b = _open(http, keys), _open(http, keys)
        cache = replicas.caches[0]
        assert cache.held() == [b] and cache.evictions_total == 1
        np.testing.assert_allclose(keys.decrypt(_infer(http, keys, a, x[0]).content)[0], plain[0], atol=1e-3)
        assert cache.held() == [a] and cache.loads_total == 3


def test_serve_ray_without_ray_says_how_to_install(monkeypatch, programs, capsys) -> None:
    from polyfhe.cli import main

    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    assert main(["serve", "--ray", "--programs", str(programs["root"])]) == 2
    assert "pip install 'polyfhe[ray]'" in capsys.readouterr().err
