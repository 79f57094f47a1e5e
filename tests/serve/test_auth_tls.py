"""Who may use a server: bearer tokens binding sessions to their token, HTTPS with a self-signed certificate on
loopback, and the start-up refusals (bad token file, half a TLS pair, insecure programs without the flag)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import httpx
import numpy as np
import pytest
import torch
from serve_testlib import TINY, start_server
from torch import nn

from polyfhe.program.params import CKKSParams
from polyfhe.serve.http_client import ServeClient, ServeError

pytestmark = pytest.mark.fhe

TOKEN_A, TOKEN_B = "alpha-" + "a" * 26, "bravo-" + "b" * 26
OCTETS = {"Content-Type": "application/octet-stream"}


def _bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}", **OCTETS}


@pytest.fixture(scope="module")
def token_server(programs, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokens")
    tokens = folder / "tokens.txt"
    tokens.write_text(f"# two clients\n{TOKEN_A}\n\n{TOKEN_B}\n")
    tokens.chmod(0o600)
    server = start_server(programs["root"], folder / "server.log", "--auth-token-file", str(tokens),
                          "--max-context-mb", "64")
    yield server
    server.stop()


def test_sessions_need_a_valid_token_and_answer_only_their_own(token_server, programs, samples):
    x, plain = samples
    url = token_server.url
    assert httpx.get(f"{url}/v1/models").status_code == 200  # the catalogue stays public
    client = programs[TINY].client()
    context = client.public_context()
    for headers in (OCTETS, _bearer("not-a-token-of-this-server"), {"Authorization": "Basic abc", **OCTETS}):
        refused = httpx.post(f"{url}/v1/sessions", params={"model": TINY}, content=context, headers=headers,
                             timeout=60)
        assert refused.status_code == 401 and refused.json()["error"] == "unauthorized", refused.text
        assert refused.headers["WWW-Authenticate"] == "Bearer"

    with ServeClient(url, token=TOKEN_A) as alice, alice.open_session(TINY, keys=client) as session:
        np.testing.assert_allclose(session.infer(x[0]).logits, plain[0], atol=1e-3)
        query = client.encrypt(x[:1])
        for method, path, body in (("POST", f"/v1/sessions/{session.id}/infer", query),
                                   ("GET", f"/v1/sessions/{session.id}", None),
                                   ("DELETE", f"/v1/sessions/{session.id}", None)):
            other = httpx.request(method, f"{url}{path}", content=body, headers=_bearer(TOKEN_B), timeout=60)
            assert other.status_code == 404 and other.json()["error"] == "unknown_session", other.text
            anonymous = httpx.request(method, f"{url}{path}", content=body, headers=OCTETS, timeout=60)
            assert anonymous.status_code == 401
        np.testing.assert_allclose(session.infer(x[1]).logits, plain[1], atol=1e-3)  # still alice's
    with ServeClient(url) as nobody, pytest.raises(ServeError, match="401 unauthorized"):
        nobody.open_session(TINY, keys=client)
    assert TOKEN_A not in token_server.log_text() and TOKEN_B not in token_server.log_text()


def test_stats_and_metrics_need_a_token_when_tokens_are_on(token_server):
    url = token_server.url
    for path in ("/v1/stats", "/metrics"):
        refused = httpx.get(f"{url}{path}", timeout=30)
        assert refused.status_code == 401 and refused.json()["error"] == "unauthorized", path
        assert httpx.get(f"{url}{path}", headers=_bearer(TOKEN_A), timeout=30).status_code == 200, path
    assert httpx.get(f"{url}/healthz", timeout=30).status_code == 200  # liveness stays open for load balancers


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed to make the test's self-signed certificate (apt-get install openssl)")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out",
                    str(cert)], check=True, capture_output=True)
    return cert, key


def test_https_with_a_self_signed_certificate(programs, samples, certificate, tmp_path):
    x, plain = samples
    cert, key = certificate
    server = start_server(programs["root"], tmp_path / "server.log", "--ssl-certfile", str(cert),
                          "--ssl-keyfile", str(key), "--max-context-mb", "64", scheme="https", ca_file=cert)
    try:
        assert server.url.startswith("https://")
        with ServeClient(server.url, ca_file=cert) as api, api.open_session(TINY) as session:
            np.testing.assert_allclose(session.infer(x[0]).logits, plain[0], atol=1e-3)
        with ServeClient(server.url) as untrusting, pytest.raises(ServeError, match="unreachable.*CERTIFICATE"):
            untrusting.models()  # the system's authorities do not know a self-signed certificate
        with pytest.raises(httpx.HTTPError):
            httpx.get(server.url.replace("https://", "http://") + "/healthz", timeout=5)  # no plain HTTP there
    finally:
        server.stop()


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "polyfhe.cli", "serve", "--port", "0", *args],
                          check=False, capture_output=True, text=True, timeout=120)


def test_start_up_refusals(programs, certificate, tmp_path):
    root = str(programs["root"])
    short = tmp_path / "short.txt"
    short.write_text("tooshort\n")
    done = _serve("--programs", root, "--auth-token-file", str(short))
    assert done.returncode == 2 and "shorter than 16 characters" in done.stderr, done.stderr
    done = _serve("--programs", root, "--auth-token-file", str(tmp_path / "missing.txt"))
    assert done.returncode == 2 and "cannot read the token file" in done.stderr, done.stderr
    done = _serve("--programs", root, "--ssl-certfile", str(certificate[0]))
    assert done.returncode == 2 and "needs both --ssl-certfile and --ssl-keyfile" in done.stderr, done.stderr


def test_an_insecure_program_is_served_only_with_the_flag(tmp_path):
    import polyfhe

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 4)).eval()
    calib = np.random.default_rng(0).random((16, 1, 4, 4)).astype(np.float32)
    params = CKKSParams(4096, (60, 40, 60), 40, security="none")
    polyfhe.export(model, target="ckks", calibration=calib, input_shape=(1, 4, 4), params=params,
                   allow_insecure=True).save(tmp_path / "programs" / "weak")
    done = _serve("--programs", str(tmp_path / "programs"))
    assert done.returncode == 2 and "model weak" in done.stderr and "--allow-insecure" in done.stderr, done.stderr
    server = start_server(tmp_path / "programs", tmp_path / "server.log", "--allow-insecure")
    try:
        assert httpx.get(f"{server.url}/v1/models").json()["models"][0]["name"] == "weak"
    finally:
        server.stop()
