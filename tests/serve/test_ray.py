"""``polyfhe serve --ray`` on a local Ray cluster (2 CPUs, no dashboard, HTTP on 127.0.0.1): two key-holding
replicas, a session opened through one is served by the other after the first is killed, honest answers equal the
single-process server's, and bad input gets the same 4xx as ``polyfhe serve``."""

from __future__ import annotations

import os

import httpx
import numpy as np
import pytest
from serve_testlib import OTHER, TINY, free_port

from polyfhe.serve.config import MIB, ServeConfig
from polyfhe.serve.http_client import ServeClient

pytestmark = [pytest.mark.ray, pytest.mark.fhe]

OCTETS = {"Content-Type": "application/octet-stream"}


@pytest.fixture(scope="module")
def ray_server(programs, tmp_path_factory):
    """The same limits as the single-process ``server`` fixture, on two replicas."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    from polyfhe.serve.ray_app import RayOptions, start

    config = ServeConfig(programs["root"], max_ciphertext_bytes=1 * MIB, max_context_bytes=40 * MIB,
                         max_sessions=12)
    options = RayOptions(2, 2, key_store=str(tmp_path_factory.mktemp("keys")), num_cpus=2,
                         object_store_bytes=200 * MIB)
    server = start(config, options, port=free_port())
    yield server
    server.stop()


def test_a_session_survives_its_replica(ray_server, server, programs, samples) -> None:
    x, plain = samples
    assert len(ray_server.holder_replicas()) == 2
    with ServeClient(ray_server.url) as api, api.open_session(TINY) as session, \
            ServeClient(server.url) as single_api, single_api.open_session(TINY) as single:
        keys = session.keys
        first = api.request("POST", f"/v1/sessions/{session.id}/infer", content=keys.encrypt(x[:1].reshape(1, -1)),
                            headers=OCTETS)
        replica = first.headers["X-Polyfhe-Replica"]
        np.testing.assert_allclose(keys.decrypt(first.content)[0], plain[0], atol=1e-3)
        ray_server.kill_replica(replica)
        for i in range(1, 4):  # ServeClient retries the 503 of a request routed to the dead replica
            got = session.infer(x[i]).logits
            np.testing.assert_allclose(got, plain[i], atol=1e-3)
            np.testing.assert_allclose(got, single.infer(x[i]).logits, atol=1e-3)  # the single-process answer
        again = api.request("POST", f"/v1/sessions/{session.id}/infer", content=keys.encrypt(x[:1].reshape(1, -1)),
                            headers=OCTETS)
        assert again.headers["X-Polyfhe-Replica"] != replica
        assert session.uploads == 1  # served from the key store: the context was never uploaded again


def _bad_requests(url: str, programs) -> list[tuple[str, int, str]]:
    """(what, status, error code) of each bad request against the server at ``url``."""
    keys, other = programs[TINY].client(), programs[OTHER].client()
    context = keys.public_context()
    out = []
    with httpx.Client(base_url=url, timeout=120) as http:
        def post(what: str, path: str, body: bytes, **params) -> None:
            r = http.post(path, content=body, headers=OCTETS, params=params)
            out.append((what, r.status_code, r.json().get("error")))

        post("garbage context", "/v1/sessions", b"\x00garbage" * 100, model=TINY)
        post("truncated context", "/v1/sessions", context[:len(context) // 2], model=TINY)
        post("secret context", "/v1/sessions", keys.secret_context(), model=TINY)
        post("ciphertext as context", "/v1/sessions", keys.encrypt(np.zeros((1, 64))), model=TINY)
        post("other program's context", "/v1/sessions", other.public_context(), model=TINY)
        post("no model", "/v1/sessions", context)
        post("unknown model", "/v1/sessions", context, model="nope")
        post("empty body", "/v1/sessions", b"", model=TINY)
        post("unknown session", "/v1/sessions/" + "x" * 32 + "/infer", keys.encrypt(np.zeros((1, 64))))
        post("path traversal", "/v1/sessions/..%2F..%2Fetc/infer", b"x")
        opened = http.post("/v1/sessions", content=context, headers=OCTETS, params={"model": TINY}).json()
        sid = opened["session_id"]
        post("garbage ciphertext", f"/v1/sessions/{sid}/infer", b"\x01" * 1000)
        post("context as ciphertext", f"/v1/sessions/{sid}/infer", context[:200_000])
        post("oversized ciphertext", f"/v1/sessions/{sid}/infer", b"\x00" * (2 * MIB))
        post("other program's ciphertext", f"/v1/sessions/{sid}/infer", other.encrypt(np.zeros((1, 64))))
        missing = http.get("/v1/nothing")
        out.append(("no such route", missing.status_code, missing.json()["error"]))
        http.delete(f"/v1/sessions/{sid}")
        gone = http.get(f"/v1/sessions/{sid}")
        out.append(("deleted session", gone.status_code, gone.json()["error"]))
    return out


def test_bad_input_gets_the_same_4xx_as_the_single_process_server(ray_server, server, programs) -> None:
    on_ray, single = _bad_requests(ray_server.url, programs), _bad_requests(server.url, programs)
    assert on_ray == single
    assert all(400 <= status < 500 for _what, status, _code in on_ray), on_ray


@pytest.mark.slow
def test_the_cli_serves_on_ray_and_stops_cleanly(programs, samples, tmp_path) -> None:
    """``polyfhe serve --ray`` as a user starts it (autoscaling 1:2 replicas, its own local cluster): an honest
    query, the same limits in ``/v1/models``, and SIGTERM ends it (exit 0) with its cluster."""
    import subprocess

    from serve_testlib import start_server

    x, plain = samples
    keys = tmp_path / "keys"
    server = start_server(programs["root"], tmp_path / "server.log", "--ray", "--replicas", "1:2", "--ray-cpus", "2",
                          "--key-store", str(keys), "--max-ciphertext-mb", "1", startup_s=240)
    try:
        with ServeClient(server.url) as api, api.open_session(TINY) as session:
            np.testing.assert_allclose(session.infer(x[0]).logits, plain[0], atol=1e-3)
            assert api.request("GET", "/v1/stats").json()["host"]["isolation"] == "ray"
            assert api.request("GET", "/v1/models").json()["limits"]["max_ciphertext_bytes"] == MIB
        assert oct(keys.stat().st_mode & 0o777) == "0o700"
        assert "Ray Serve, 1:2 key-holding replicas" in server.log_text()
    finally:
        server.proc.terminate()
        try:
            code = server.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.stop()
            raise
    assert code == 0, server.log_text()[-3000:]


def test_the_cli_refuses_tls_with_ray(programs, capsys) -> None:
    from polyfhe.cli import main

    assert main(["serve", "--ray", "--programs", str(programs["root"]), "--ssl-certfile", "c.pem",
                 "--ssl-keyfile", "k.pem"]) == 2
    assert "terminate TLS in front" in capsys.readouterr().err


def test_the_application_builder_takes_the_serve_limits(programs, tmp_path) -> None:
    """``import_path: polyfhe.serve.ray_app:application`` (KubeRay's RayService): bound without a cluster."""
    from polyfhe.serve.ray_app import application

    app = application({"programs": str(programs["root"]), "key_store": str(tmp_path), "replicas": "1:3",
                       "key_budget_mb": 512, "session_ttl": 60, "threads_per_replica": 2})
    assert type(app).__name__ == "Application"
    with pytest.raises(ValueError, match="unknown"):
        application({"programs": "p", "key_store": "k", "replica": "1:2"})
