"""`polyfhe client keys create` and `client infer --keys DIR` against a real server: the context is uploaded once."""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import subprocess
import sys

import httpx
import numpy as np
import pytest
from serve_testlib import OTHER, TINY, start_server

from polyfhe.cli import main
from polyfhe.program.keydir import KeyDir

pytestmark = pytest.mark.fhe


@pytest.fixture(scope="module")
def keyed_server(programs, tmp_path_factory):
    """A server of its own: these tests count the sessions it creates and leave theirs open (as --keys does)."""
    server = start_server(programs["root"], tmp_path_factory.mktemp("log") / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def made_keys(keyed_server, tmp_path_factory) -> tuple:
    folder = tmp_path_factory.mktemp("keys") / "tiny-keys"
    made = _cli("client", "keys", "create", "--model", TINY, "--server", keyed_server.url, "--out", str(folder),
                "--json")
    assert made.returncode == 0, made.stderr
    return folder, json.loads(made.stdout)


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "POLYFHE_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "polyfhe.cli", *args], check=False, capture_output=True, text=True,
                          timeout=300, env=env)


def _created(server) -> int:
    return httpx.get(f"{server.url}/v1/stats", timeout=10).json()["sessions"]["created_total"]


def _infer(folder, path, *flags: str) -> list[dict]:
    proc = _cli("client", "infer", "--keys", str(folder), str(path), "--json", *flags)
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stderr and "requests" not in proc.stderr  # stderr is a pipe: no progress bars
    return [json.loads(line) for line in proc.stdout.splitlines()]


def test_keys_create_writes_private_files_for_the_served_program(made_keys, programs, keyed_server):
    folder, record = made_keys
    assert record["program_id"] == programs[TINY].program_id
    assert (record["model"], record["server"]) == (TINY, keyed_server.url)
    assert stat.S_IMODE((folder / "secret.pfhe").stat().st_mode) == 0o600
    assert stat.S_IMODE((folder / "keys.json").stat().st_mode) == 0o600
    assert _created(keyed_server) == 0  # making keys uploads nothing


def test_two_runs_with_keys_upload_the_context_once(made_keys, keyed_server, samples, tmp_path):
    folder, _ = made_keys
    x, plain = samples
    np.save(tmp_path / "x.npy", x[:2])
    before = _created(keyed_server)
    first = _infer(folder, tmp_path / "x.npy")  # --model and --server: the ones the keys were made for
    session = KeyDir(folder).session_id(keyed_server.url, TINY)
    second = _infer(folder, tmp_path / "x.npy")
    assert _created(keyed_server) - before == 1
    assert [r["context_uploads"] for r in first + second] == [1, 1, 0, 0]
    assert session and KeyDir(folder).session_id(keyed_server.url, TINY) == session
    for rows in (first, second):
        np.testing.assert_allclose([r["logits"] for r in rows], plain[:2], atol=1e-3)

    # the server forgot the session: the next run uploads the same context again, once, and records the new id
    httpx.delete(f"{keyed_server.url}/v1/sessions/{session}", timeout=10).raise_for_status()
    third = _infer(folder, tmp_path / "x.npy", "--model", TINY, "--server", keyed_server.url)
    assert [r["context_uploads"] for r in third] == [1, 1] and _created(keyed_server) - before == 2
    assert KeyDir(folder).session_id(keyed_server.url, TINY) not in (None, session)
    np.testing.assert_allclose([r["logits"] for r in third], plain[:2], atol=1e-3)


def test_keys_for_another_model_are_refused(made_keys, keyed_server, programs, tmp_path):
    folder, _ = made_keys
    np.save(tmp_path / "x.npy", np.zeros((1, 1, 8, 8)))
    before = _created(keyed_server)
    proc = _cli("client", "infer", "--keys", str(folder), "--model", OTHER, str(tmp_path / "x.npy"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"holds keys for program {programs[TINY].program_id}" in proc.stderr
    assert f"model {OTHER} at {keyed_server.url} needs keys for program {programs[OTHER].program_id}" in proc.stderr
    assert _created(keyed_server) == before


def test_a_truncated_key_file_gives_a_clear_error(made_keys, keyed_server, tmp_path):
    folder = tmp_path / "damaged"
    shutil.copytree(made_keys[0], folder)
    secret = folder / "secret.pfhe"
    secret.write_bytes(secret.read_bytes()[:1000])
    np.save(tmp_path / "x.npy", np.zeros((1, 1, 8, 8)))
    proc = _cli("client", "infer", "--keys", str(folder), str(tmp_path / "x.npy"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "secret.pfhe is not the file that was written" in proc.stderr and "truncated" in proc.stderr


def test_client_progress_is_drawn_on_a_terminal(keyed_server, samples, tmp_path, monkeypatch):
    """The same command in this process with a terminal on stderr: the upload and request bars appear there,
    never on stdout."""
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    np.save(tmp_path / "x.npy", samples[0][:1])
    out, err = io.StringIO(), Terminal()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    assert main(["client", "infer", "--server", keyed_server.url, "--model", TINY, str(tmp_path / "x.npy")]) == 0
    assert "uploading public context" in err.getvalue() and "requests" in err.getvalue()
    assert "uploading" not in out.getvalue() and "class" in out.getvalue()
